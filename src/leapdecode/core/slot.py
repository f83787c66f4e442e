"""What one generation holds on its runner, from its first step to its end.

A ``Slot`` is taken when a ``Generation`` (``core/generate.py``) starts (a generation that waits
holds nothing) and given back once, at its
end, on a failure, or when an abandoned generation is collected: a KV-cache slot of the runner (so
generations in flight never share one) with its KV-cache policy's state, the random generator of the
request's seed, the ``DecodeContext`` its proposer reads, and the plan of the prompt's prefill
through the prefix cache.  The generation's decisions (tokens, text, statistics) are not here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidParameterError
from .kv_policy import KVPolicy, PolicyState
from .prefill import PrefillPlanner, prefill_chunk
from .proposer import DecodeContext, Proposer
from .runner import slot_len
from .sampling import SamplingParams
from .task import Forward

if TYPE_CHECKING:
    from .runner import ModelRunner

TREE_MARGIN = 128  # cache slots reserved beyond the output for the last step's tree


def cache_tokens(model, prompt_len: int, max_new_tokens: int, kv_policy: KVPolicy | None = None) -> int:
    """Tokens a generation asks its KV-cache slot to hold: the prompt, the output and the margin
    for the last step's tree (the runner rounds it up: ``runner.slot_len``); with a KV-cache
    policy, what the policy keeps plus a prefill chunk or a tree (``KVPolicy.cache_tokens``)."""
    if kv_policy is not None:
        return min(model.max_seq_len, kv_policy.cache_tokens(prompt_len, max_new_tokens, TREE_MARGIN))
    return min(model.max_seq_len, prompt_len + max_new_tokens + TREE_MARGIN)


class Slot:
    """A generation's claim on ``runner``, taken at its first step (``take``): ``cache`` (and ``kv``,
    its policy's state; None without a policy), ``generator``, ``ctx`` and ``prefill`` (all None
    until then).  ``release()`` gives them back once; ``releasing()`` does on a failure."""

    def __init__(self, runner: "ModelRunner", prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 kv_policy: KVPolicy | None, memory_scope: str | None) -> None:
        self.runner, self.prompt_ids, self.params, self.max_new_tokens = runner, prompt_ids, params, max_new_tokens
        self.kv_policy, self.memory_scope = kv_policy, memory_scope
        self.taken = self.released = False
        self.cache = self.kv = self.generator = self.ctx = self.prefill = None
        self.t_start = self.prefill_s = 0.0

    def take(self) -> "Slot":
        """Take the resources (once; a failure half-way gives back what it took and leaves it untaken)."""
        if self.taken:
            return self
        runner, model, params, kv_policy, scope = self.runner, self.runner.model, self.params, self.kv_policy, \
            self.memory_scope
        self.t_start = time.perf_counter()
        gen = torch.Generator(device=model.model.device)
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        want = cache_tokens(model, len(self.prompt_ids), self.max_new_tokens, kv_policy)
        if kv_policy is None:
            cache = runner.acquire_cache(model, want)
        else:
            cache = runner.acquire_cache(model, want, kind=kv_policy.cache_kind)
        try:
            self.kv: PolicyState | None = kv_policy.start(model, cache) if kv_policy is not None else None
            self.ctx = DecodeContext(runner, cache, params, gen, len(self.prompt_ids), self.max_new_tokens,
                                     memory_scope=scope)
            # the prompt but its last token, in chunks aligned to position 0, through the prefix cache
            self.prefill = PrefillPlanner(runner, cache, self.prompt_ids, kv_policy, scope=scope)
        except BaseException:
            runner.release_cache(cache)
            raise
        self.cache, self.generator, self.taken = cache, gen, True
        return self

    @staticmethod
    def size(model, prompt_len: int, max_new_tokens: int, kv_policy: KVPolicy | None = None) -> tuple[int, str]:
        """The slot a generation takes (``Task.kv_tokens``): ``cache_tokens`` rounded up as the
        runner rounds it, and the cache's kind (its KV-cache policy's)."""
        return (slot_len(model, cache_tokens(model, prompt_len, max_new_tokens, kv_policy)),
                kv_policy.cache_kind if kv_policy is not None else "plain")

    # ---------------------------------------------------------------- the prompt's prefill
    @property
    def prefilling(self) -> bool:
        """Prompt chunks still to run (before the slot is taken: unless the prompt is one token)."""
        return not self.prefill.done if self.taken else len(self.prompt_ids) > 1

    def next_chunk_tokens(self) -> int:
        """About how many prompt tokens the next prefill forward computes (a scheduler's guess)."""
        if self.taken:
            return self.prefill.next_tokens()
        return max(min(len(self.prompt_ids) - 1, prefill_chunk(self.runner.model.model, self.kv_policy)), 0)

    def next_chunk(self, proposer: Proposer | None) -> Forward | None:
        """The next prompt chunk to compute (None: the prefill is done); a proposer that reads the
        prompt's features gets the hidden states of its last tokens."""
        return self.prefill.next_forward(proposer.prompt_features() if proposer is not None else 0)

    def chunk_computed(self, work: Forward, proposer: Proposer | None) -> None:
        """A prompt chunk's forward ran: commit it, hand its hidden states to the proposer, count it."""
        self.cache.commit()
        if work.hidden:
            proposer.observe_prompt(self.prefill.prefilled, work.hidden)
        self.prefill.computed(work)
        if self.kv is not None:
            self.kv.committed(range(work.tokens.numel()), "prefill_end" if self.prefill.done else "prefill")

    def prefill_alone(self, proposer: Proposer | None, decoder) -> None:
        """The prompt's remaining chunks, each forward run alone on ``decoder``."""
        while (work := self.next_chunk(proposer)) is not None:
            work.run(decoder, self.cache)
            self.chunk_computed(work, proposer)

    def adopt(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Take the slot with the prompt's keys and values but its last token's, copied from another
        generation's prefill (``KVCache.committed_slice``).  Before it is taken, without a KV-cache
        policy (its generation prefills its own prompt)."""
        if self.taken:
            raise RuntimeError("adopt_prompt must come before the generation starts")
        if self.kv_policy is not None:
            raise InvalidParameterError("a generation with a kv_policy prefills its own prompt")
        if k.shape[3] != len(self.prompt_ids) - 1:
            raise ValueError(f"{k.shape[3]} prompt slots given for a prompt of {len(self.prompt_ids)} tokens "
                             "(all but the last)")
        with self.take().releasing():
            if k.shape[3]:
                self.cache.append_committed(k, v)
            self.prefill.adopt(k.shape[3])

    # ---------------------------------------------------------------- the end
    def keep_output(self, tokens: list[int]) -> None:
        """Keep the blocks of the tokens decided in the prefix cache, where the model's prefill allows it:
        the cache's committed slots hold their keys and values (a bonus token at the end has none yet;
        slots past a stop are never read)."""
        if self.prefill.keeps_output:
            self.prefill.keep_decided(tokens, min(self.cache.length, len(tokens)))

    def prefill_ended(self) -> None:
        """The prompt's prefill is over (the generation decodes from here): its time."""
        self.prefill_s = time.perf_counter() - self.t_start

    def end(self, tokens: list[int], proposer: Proposer | None) -> None:
        """The generation decoded to its end (``tokens``: all it decided, prompt first): its output's
        blocks kept, the proposer ended (what it fed the runner's memory counted against the bounds),
        and everything given back."""
        try:
            self.keep_output(tokens)
            if proposer is not None:
                proposer.end()
                self.runner.memory.settle()
        finally:
            self.release()

    def timing(self) -> dict[str, float | int]:
        """The generation's wall time so far, its prefill's, and the prompt tokens the prefix cache gave."""
        return {"wall": time.perf_counter() - self.t_start, "prefill_s": self.prefill_s,
                "prefix_reused": self.prefill.reused}

    def release(self) -> None:
        if self.taken and not self.released:
            self.released = True
            self.ctx.release_all()
            self.runner.release_cache(self.cache)

    @contextmanager
    def releasing(self) -> Iterator[None]:
        """Gives everything back if the block fails (its generation cannot go on)."""
        try:
            yield
        except BaseException:
            self.release()
            raise

    def __del__(self) -> None:  # an abandoned generation still returns its cache slot
        try:
            self.release()
        except Exception:
            pass
