"""What one generation holds on its runner, from its first step to its end.

A ``Slot`` is taken when a ``Generation`` (``core/generate.py``) starts and given back once, at its
end, on a failure, or when an abandoned generation is collected: a KV-cache slot of the runner (so
generations in flight never share one) with its KV-cache policy's state, the random generator of the
request's seed, the ``DecodeContext`` its proposer reads, and the plan of the prompt's prefill
through the prefix cache.  The generation's decisions (tokens, text, statistics) are not here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .kv_policy import KVPolicy, PolicyState
from .prefill import PrefillPlanner
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
    """A generation's resources on ``runner``: ``cache`` (and ``kv``, its policy's state; None
    without a policy), ``generator``, ``ctx`` and ``prefill``.  ``release()`` gives them back once."""

    def __init__(self, runner: "ModelRunner", prompt_ids: list[int], params: SamplingParams, max_new_tokens: int,
                 kv_policy: KVPolicy | None, memory_scope: str | None) -> None:
        model = runner.model
        self.runner, self.released, self.t_start, self.prefill_s = runner, False, time.perf_counter(), 0.0
        self.generator = gen = torch.Generator(device=model.model.device)
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        want = cache_tokens(model, len(prompt_ids), max_new_tokens, kv_policy)
        if kv_policy is None:
            self.cache = runner.acquire_cache(model, want)
        else:
            self.cache = runner.acquire_cache(model, want, kind=kv_policy.cache_kind)
        try:
            self.kv: PolicyState | None = kv_policy.start(model, self.cache) if kv_policy is not None else None
            self.ctx = DecodeContext(runner, self.cache, params, gen, len(prompt_ids), max_new_tokens,
                                     memory_scope=memory_scope)
            # the prompt but its last token, in chunks aligned to position 0, through the prefix cache
            self.prefill = PrefillPlanner(runner, self.cache, prompt_ids, kv_policy, scope=memory_scope)
        except BaseException:
            self.released = True
            runner.release_cache(self.cache)
            raise

    @staticmethod
    def size(model, prompt_len: int, max_new_tokens: int, kv_policy: KVPolicy | None = None) -> tuple[int, str]:
        """The slot a generation takes (``Task.kv_tokens``): ``cache_tokens`` rounded up as the
        runner rounds it, and the cache's kind (its KV-cache policy's)."""
        return (slot_len(model, cache_tokens(model, prompt_len, max_new_tokens, kv_policy)),
                kv_policy.cache_kind if kv_policy is not None else "plain")

    # ---------------------------------------------------------------- the prompt's prefill
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

    def adopt(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prompt's keys and values but its last token's, copied from another generation's prefill."""
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

    def timing(self) -> dict[str, float | int]:
        """The generation's wall time so far, its prefill's, and the prompt tokens the prefix cache gave."""
        return {"wall": time.perf_counter() - self.t_start, "prefill_s": self.prefill_s,
                "prefix_reused": self.prefill.reused}

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.ctx.release_all()
            self.runner.release_cache(self.cache)

    def __del__(self) -> None:  # an abandoned generation still returns its cache slot
        try:
            self.release()
        except Exception:
            pass
