"""The generation loop: propose -> verify -> commit -> update the proposer.

It is the same loop for every method.  Vanilla decoding is the case where there is no
proposer, so every step verifies just the root and emits the target's next token.
End-of-sequence, stop strings and the token limit act on committed tokens only.

A ``Generation`` holds one sequence's state: its KV cache (a slot the runner hands out for the
generation's lifetime, so generations in flight never share one), its proposer, its random
generator and the tokens it decided; its parts do the work: the prompt's chunks
(``core/prefill.py``), each step's tree (``core/step_planner.py``), what the target's logits
decide (``core/committer.py``) and the text (``core/output.py``).  ``step()`` runs one iteration
and returns what it decided; a batched scheduler calls its two halves (``next_forwards``,
``finish_forwards``), and iterating a ``Generation`` calls ``step()`` until the sequence finishes.
``core/reference.py`` is the same loop for vanilla decoding in one screen, the oracle the tests
compare every method with.

This module knows proposers only through the interface of ``core/proposer.py``; which method
builds which proposer is decided a layer up (``leapdecode.api``, ``leapdecode.proposers``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidParameterError
from .committer import Committer
from .constraint import Constraint
from .cost_model import synchronize
from .kv_policy import KVPolicy, PolicyState, check_policy
from .output import OutputProcessor
from .prefill import PrefillPlanner, prefill_chunk
from .prompt import check_max_new_tokens, check_prompt_ids, check_stop
from .proposer import DecodeContext, Proposer
from .sampling import SamplingParams
from .step_planner import StepPlanner
from .task import Forward, Status, StepOutput, Task

if TYPE_CHECKING:
    from .runner import ModelRunner

TREE_MARGIN = 128  # cache slots reserved beyond the output for the last step's tree


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled", "error" (abort())
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "stats": self.stats}


def cache_tokens(model, prompt_len: int, max_new_tokens: int, kv_policy: KVPolicy | None = None) -> int:
    """Tokens a generation asks its KV-cache slot to hold: the prompt, the output and the margin
    for the last step's tree (the runner rounds it up: ``runner.slot_len``); with a KV-cache
    policy, what the policy keeps plus a prefill chunk or a tree (``KVPolicy.cache_tokens``)."""
    if kv_policy is not None:
        return min(model.max_seq_len, kv_policy.cache_tokens(prompt_len, max_new_tokens, TREE_MARGIN))
    return min(model.max_seq_len, prompt_len + max_new_tokens + TREE_MARGIN)


class Generation(Task):
    """One generation on a runner (a ``Task``: ``core/task.py``), a façade over its parts: the
    prefill planner (``core/prefill.py``), the step planner (``core/step_planner.py``), the
    committer (``core/committer.py``) and the output processor (``core/output.py``); it holds the
    request's state (``status``, the tokens decided) and its resources (a KV-cache slot, the random
    generator).  Iterate for text pieces as they are decided, or call ``step()``; then read
    ``.result``.  ``close()`` (called at the end, and by ``cancel`` when iteration stops) gives the
    KV cache back to the runner."""

    streams = True  # its text is final as it is decided (stop strings held back)

    def __init__(self, runner: "ModelRunner", prompt_ids: list[int], params: SamplingParams,
                 proposer: Proposer | None = None, method: str = "vanilla", max_new_tokens: int = 256,
                 stop: list[str] | None = None, tree_budget: int | None = None, kv_policy: KVPolicy | None = None,
                 constraint: Constraint | None = None, memory_scope: str | None = None) -> None:
        model = runner.model
        self.runner, self.model, self.params, self.method = runner, model, params, method
        self.memory_scope = memory_scope  # whose part of the runner's memory the proposer uses (DecodeContext)
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        self.stop = check_stop(stop)
        self.prompt_ids = check_prompt_ids(prompt_ids, model)
        self.kv_policy = check_policy(kv_policy, model)  # lossy KV-cache compression; None: exact
        self.proposer, self.constraint = proposer, constraint  # constraint: a grammar (core/constraint.py)
        budget = (tree_budget or proposer.default_budget) if proposer is not None else 0
        self.out = OutputProcessor(model.tokenizer, self.stop)  # text pieces, stop strings, statistics
        self.planner = StepPlanner(proposer, constraint, budget, model.device, self.out)
        self.result: GenerationResult | None = None
        self._kv: PolicyState | None = None
        # where its life is: WAITING, PREFILLING (a cache taken), DECODING (the proposer began), FINISHED
        self._stage = Status.WAITING
        self._cancelled = self._closed = False  # a cancel asked for; the cache given back
        self.cache = None

    # -------------------------------------------------------------- control
    def cancel(self) -> None:
        """Stop at the next step (e.g. the client went away)."""
        self._cancelled = True

    @property
    def finished(self) -> bool:
        return self.result is not None

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def __next__(self) -> str:
        """The next text piece: steps until one decides text (``StopIteration`` once finished)."""
        try:
            while self.result is None:
                out = self.step()
                if out.text:
                    return out.text
        except BaseException:
            if self.result is None:  # a step failed: the generation ends where it stood
                self._finish("cancelled")
            raise
        raise StopIteration

    @property
    def status(self) -> Status:
        if self.result is not None or self._stage is Status.WAITING:
            return Status.FINISHED if self.result is not None else Status.WAITING
        return Status.PREFILLING if self.prefilling else Status.DECODING

    @property
    def decoding(self) -> bool:
        """Started, prompt prefilled, not finished: its next forward is a decoding step."""
        return self._stage is not Status.WAITING and self.result is None and not self.prefilling

    @property
    def prefilling(self) -> bool:
        """Not finished, with prompt chunks still to run through the target (so before it started
        too, when the prompt has more than its root token)."""
        done = self.prefill.prefilled if self._stage is not Status.WAITING else 0
        return self.result is None and done < len(self.prompt_ids) - 1

    def next_chunk_tokens(self) -> int:
        """About how many prompt tokens this generation's next prefill forward computes (a cost
        model's guess: blocks the prefix cache restores are not looked up)."""
        if self._stage is not Status.WAITING:
            return self.prefill.next_tokens()
        return max(min(len(self.prompt_ids) - 1, prefill_chunk(self.model.model, self.kv_policy)), 0)

    @property
    def tree_budget(self) -> int:
        """Most drafted nodes a step verifies (the step planner's; 0 without a proposer)."""
        return self.planner.tree_budget

    @property
    def draft_acceptance(self) -> float:
        """Draft tokens accepted per step that verified a tree, so far (``OutputProcessor``)."""
        return self.out.draft_acceptance()

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        """Take a cache slot from the runner, prefill the prompt (all but its last token, which is
        the first step's root) and start the proposer.  ``step()`` calls it when needed."""
        self._begin()
        while self.prefilling:
            work = self._next_prefill()
            if work is not None:
                self.finish_forward(work, work.run(self.model.model, self.cache))
        self._ready()

    def _begin(self) -> None:
        """The cache slot, the random generator and the prefill plan (no forward yet)."""
        if self._stage is not Status.WAITING:
            return
        self._stage = Status.PREFILLING
        model, params, ids, policy = self.model, self.params, self.prompt_ids, self.kv_policy
        self._t_start = time.perf_counter()
        self.generator = gen = torch.Generator(device=model.model.device)
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        want = cache_tokens(model, len(ids), self.max_new_tokens, policy)
        if policy is None:
            self.cache = cache = self.runner.acquire_cache(model, want)
        else:
            self.cache = cache = self.runner.acquire_cache(model, want, kind=policy.cache_kind)
            self._kv = policy.start(model, cache)
        self.ctx = DecodeContext(self.runner, cache, params, gen, len(ids), self.max_new_tokens,
                                 memory_scope=self.memory_scope)
        # the prompt but its last token, in chunks aligned to position 0, through the prefix cache
        self.prefill = PrefillPlanner(self.runner, cache, ids, policy, scope=self.memory_scope)

    def adopt_prompt(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Start from a prompt another generation already prefilled: ``k``, ``v`` are the keys and
        values of this prompt's tokens but its last (``KVCache.committed_slice`` of that generation's
        cache after its prefill), copied into this generation's cache instead of computing them.
        Exact: a prefill is the same position-0-aligned chunks wherever it runs, so the copy holds
        the bits this generation would have computed.  Before the first step, without a KV policy."""
        if self._stage is not Status.WAITING:
            raise RuntimeError("adopt_prompt must come before the generation starts")
        if self.kv_policy is not None:
            raise InvalidParameterError("a generation with a kv_policy prefills its own prompt")
        if k.shape[3] != len(self.prompt_ids) - 1:
            raise ValueError(f"{k.shape[3]} prompt slots given for a prompt of {len(self.prompt_ids)} tokens "
                             "(all but the last)")
        self._begin()
        if k.shape[3]:
            self.cache.append_committed(k, v)
        self.prefill.adopt(k.shape[3])

    def _next_prefill(self) -> "Forward | None":
        """The next prompt chunk to compute; a proposer that reads the prompt's features gets the
        hidden states of its last tokens."""
        return self.prefill.next_forward(self.proposer.prompt_features() if self.proposer is not None else 0)

    def _ready(self) -> None:
        """After the prefill: the decoding state and the proposer (which may prefill its own)."""
        if self._stage is not Status.PREFILLING:
            return
        self._stage = Status.DECODING
        try:
            self._prefill_s = time.perf_counter() - self._t_start
            self.tokens = list(self.prompt_ids)  # decided so far; the last one is the root (not yet in the cache)
            self.generated: list[int] = []
            self.committer = Committer(self.ctx, self.proposer, self.constraint, self._kv, self.out, self.tokens)
            if self.proposer is not None:
                if self.proposer.needs_verify_cost(self.params):
                    self.ctx.verify_cost = self.runner.verify_cost(self.cache)
                self.proposer.begin(self.ctx, self.tokens)
        except BaseException:
            self._release()
            raise

    # ----------------------------------------------------------------- step
    def step(self) -> StepOutput:
        """One propose -> verify -> commit iteration (the first call also prefills the prompt)."""
        if self.result is not None:
            return StepOutput("", [], True, self.result.finish_reason)
        try:
            self.start()
            work = self.next_forward()
            if isinstance(work, StepOutput):
                return work
            cost = self.ctx.verify_cost if work.tree is not None else None
            if cost is None or not cost.learn:
                return self.finish_forward(work, work.run(self.model.model, self.cache))
            # the measured profile learns from every step's forward (greedy tree sizes follow it)
            t0 = time.perf_counter()
            logits = work.run(self.model.model, self.cache)
            synchronize(logits.device)
            cost.observe(work.tokens.numel(), time.perf_counter() - t0)
            return self.finish_forward(work, logits)
        except BaseException:
            self._release()
            raise

    def next_forward(self, cap: int | None = None) -> "Forward | StepOutput":
        """The first half of a step, for a scheduler that batches the target's forwards: the next
        forward this generation needs (a prompt chunk, or the root and the proposer's tree; ``cap``
        bounds the tree's size), or a ``StepOutput`` when the generation ended without one.  Hand
        the forward's logits to ``finish_forward``; nothing else may touch the cache in between."""
        if self.result is not None:
            return StepOutput("", [], True, self.result.finish_reason)
        try:
            self._begin()
            if self._cancelled:
                return self._finish("cancelled")
            if self.prefilling:
                work = self._next_prefill()
                if work is not None:
                    return work
            self._ready()
            if self.cache.room() < 1:
                return self._finish("length")
            budget = self.planner.budget(self.cache.room(), self.max_new_tokens - len(self.generated), cap)
            return self.planner.plan(self.tokens, self.cache, budget)
        except BaseException:
            self._release()
            raise

    def finish_forward(self, work: "Forward", logits: torch.Tensor) -> StepOutput:
        """The second half of a step: ``logits`` (``[1, T, vocab]``) of ``work``'s forward."""
        try:
            if work.tree is None:  # a prompt chunk
                self.cache.commit()
                if work.hidden:
                    self.proposer.observe_prompt(self.prefill.prefilled, work.hidden)
                self.prefill.computed(work)
                if self._kv is not None:
                    self._kv.committed(range(work.tokens.numel()), "prefill" if self.prefilling else "prefill_end")
                return StepOutput("", [], False)
            kept, finish = self.committer.commit(work, logits[0], self.tokens, self.generated)
            shown = self.out.emit(kept, finish)
            if shown.covering is not None:  # a stop string: the output ends where its text does
                self.generated = shown.covering
            if shown.finish is not None:
                self._finish(shown.finish, shown.text)
                return StepOutput(shown.piece, kept, True, shown.finish)
            return StepOutput(shown.piece, kept, False)
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------ the task protocol (core/task.py)
    def next_forwards(self, cap: int | None = None) -> "list[Forward] | StepOutput":
        nxt = self.next_forward(cap)
        if isinstance(nxt, StepOutput):
            return nxt
        nxt.cache, nxt.decoder = self.cache, self.model.model
        return [nxt]

    def finish_forwards(self, forwards: "list[Forward]", logits: "list[torch.Tensor]") -> StepOutput:
        return self.finish_forward(forwards[0], logits[0])

    # --------------------------------------------------------------- finish
    def _finish(self, reason: str, text: str | None = None) -> StepOutput:
        if self.result is not None:
            return StepOutput("", [], True, self.result.finish_reason)
        stage, self._stage = self._stage, Status.FINISHED
        if stage is not Status.DECODING:  # ended before or during the prefill: the proposer never began
            self._release()
            stats = {"method": self.method}
            if stage is Status.PREFILLING:
                stats["prefix_reused"] = self.prefill.reused
            self.result = GenerationResult("", [], len(self.prompt_ids), reason, stats)
            return StepOutput("", [], True, reason)
        try:
            if self.prefill.keeps_output:
                # the cache's committed slots hold the keys and values of the tokens decided so far
                # (a bonus token at the end has none yet; slots past a stop are never read)
                self.prefill.keep_decided(self.tokens, min(self.cache.length, len(self.tokens)))
            if self.proposer is not None:
                self.proposer.end()
                self.runner.memory.settle()  # what the proposer fed its memory counts against the bounds
        finally:
            self._release()
        stats = self.out.stats(method=self.method, new_tokens=len(self.generated), prompt_tokens=len(self.prompt_ids),
                               wall=time.perf_counter() - self._t_start, prefill_s=self._prefill_s,
                               prefix_reused=self.prefill.reused, constrained=self.constraint is not None)
        stats.update(self.proposer.stats() if self.proposer is not None else {})
        stats.update(self._kv.stats() if self._kv is not None else {})
        self.result = GenerationResult(self.out.text if text is None else text, list(self.generated),
                                       len(self.prompt_ids), reason, stats)
        return StepOutput("", [], True, reason)

    def abort(self) -> None:
        """Give the cache back after a failure that ends this generation (finish reason "error")."""
        self._release()  # the runner resets the cache it takes back
        if self.result is None:  # finished: a later step() or next_forward() does nothing
            self.result = GenerationResult("", list(getattr(self, "generated", [])), len(self.prompt_ids), "error",
                                           {"method": self.method})

    def close(self) -> None:
        """Give the cache back now (a generation abandoned before its end)."""
        if self.result is None:
            self._finish("cancelled")

    def _release(self) -> None:
        if self.cache is not None and not self._closed:
            self._closed = True
            self.ctx.release_all()
            self.runner.release_cache(self.cache)

    def __del__(self) -> None:  # an abandoned generation still returns its cache slot
        try:
            if self._stage is not Status.WAITING and not self._closed:
                self._release()
        except Exception:
            pass
