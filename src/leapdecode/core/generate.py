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
from .kv_policy import KVPolicy, check_policy
from .output import OutputProcessor
from .prefill import prefill_chunk
from .prompt import check_max_new_tokens, check_prompt_ids, check_stop
from .proposer import Proposer
from .sampling import SamplingParams
from .slot import Slot
from .step_planner import StepPlanner
from .task import Forward, Status, StepOutput, Task

if TYPE_CHECKING:
    from .runner import ModelRunner


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


class Generation(Task):
    """One generation on a runner (a ``Task``: ``core/task.py``), a façade over its parts: its
    resources on the runner (``core/slot.py``: KV-cache slot, random generator, prompt prefill),
    the step planner, the committer and the output processor.  It holds the request and what was
    decided (``tokens``, ``generated``, ``result``).  Iterate for text pieces, or call ``step()``;
    ``close()`` gives the resources back early."""

    streams = True  # its text is final as it is decided (stop strings held back)

    @classmethod
    def kv_tokens(cls, model: Any, prompt_len: int, max_new_tokens: int, *, strategy: Any = None,
                  kv_policy: KVPolicy | None = None) -> tuple[int, str]:
        return Slot.size(model, prompt_len, max_new_tokens, kv_policy)

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
        self.slot: Slot | None = None  # taken at the first step, given back at the end
        self._stage = Status.WAITING  # PREFILLING (a slot taken), DECODING (the proposer began), FINISHED
        self._cancelled = False

    cache = property(lambda self: self.slot.cache if self.slot is not None else None)
    finished = property(lambda self: self.result is not None)
    tree_budget = property(lambda self: self.planner.tree_budget, doc="most drafted nodes a step verifies")
    draft_acceptance = property(lambda self: self.out.draft_acceptance(), doc="draft tokens accepted per tree step")

    @property
    def status(self) -> Status:
        if self.result is not None or self._stage is Status.WAITING:
            return Status.FINISHED if self.result is not None else Status.WAITING
        return Status.PREFILLING if self.prefilling else Status.DECODING

    decoding = property(lambda self: self.status is Status.DECODING)

    @property
    def prefilling(self) -> bool:
        """Not finished, with prompt chunks still to run (before it started too, unless the prompt is one token)."""
        return self.result is None and (not self.slot.prefill.done if self.slot else len(self.prompt_ids) > 1)

    def next_chunk_tokens(self) -> int:
        """About how many prompt tokens the next prefill forward computes (a scheduler's guess)."""
        if self.slot is not None:
            return self.slot.prefill.next_tokens()
        return max(min(len(self.prompt_ids) - 1, prefill_chunk(self.model.model, self.kv_policy)), 0)

    # ---------------------------------------------------------------- start
    def _begin(self) -> None:
        if self.slot is None:
            self.slot = Slot(self.runner, self.prompt_ids, self.params, self.max_new_tokens, self.kv_policy,
                             self.memory_scope)
            self._stage = Status.PREFILLING

    def adopt_prompt(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Start from the keys and values of this prompt but its last token that another generation
        prefilled (``KVCache.committed_slice``): exact, a prefill being the same position-0-aligned
        chunks wherever it runs.  Before the first step, without a KV policy."""
        if self._stage is not Status.WAITING:
            raise RuntimeError("adopt_prompt must come before the generation starts")
        if self.kv_policy is not None:
            raise InvalidParameterError("a generation with a kv_policy prefills its own prompt")
        if k.shape[3] != len(self.prompt_ids) - 1:
            raise ValueError(f"{k.shape[3]} prompt slots given for a prompt of {len(self.prompt_ids)} tokens "
                             "(all but the last)")
        self._begin()
        self.slot.adopt(k, v)

    def start(self) -> None:
        """Take the slot, prefill the prompt (all but its last token, the first step's root), start
        the proposer.  ``step()`` calls it when needed."""
        self._begin()
        while self.prefilling:
            work = self.slot.next_chunk(self.proposer)
            if work is not None:
                self.finish_forward(work, work.run(self.model.model, self.cache))
        self._ready()

    def _ready(self) -> None:
        """After the prefill: the decoding state and the proposer (which may prefill its own)."""
        if self._stage is not Status.PREFILLING:
            return
        self._stage, slot = Status.DECODING, self.slot
        try:
            slot.prefill_s = time.perf_counter() - slot.t_start
            self.tokens = list(self.prompt_ids)  # decided so far; the last one is the root (not yet in the cache)
            self.generated: list[int] = []
            self.committer = Committer(slot.ctx, self.proposer, self.constraint, slot.kv, self.out, self.tokens)
            if self.proposer is not None:
                if self.proposer.needs_verify_cost(self.params):
                    slot.ctx.verify_cost = self.runner.verify_cost(self.cache)
                self.proposer.begin(slot.ctx, self.tokens)
        except BaseException:
            slot.release()
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
            cost = self.slot.ctx.verify_cost if work.tree is not None else None
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

    def run(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result

    def next_forward(self, cap: int | None = None) -> "Forward | StepOutput":
        """A step's first half, for a scheduler that batches forwards: the next forward (a prompt
        chunk, or the root and the proposer's tree, ``cap`` bounding its size), or a ``StepOutput``
        when it ended without one.  Nothing may touch the cache before ``finish_forward``."""
        if self.result is not None:
            return StepOutput("", [], True, self.result.finish_reason)
        try:
            self._begin()
            if self._cancelled:
                return self._finish("cancelled")
            work = self.slot.next_chunk(self.proposer) if self.prefilling else None
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
        """A step's second half: ``logits`` (``[1, T, vocab]``) of ``work``'s forward."""
        try:
            if work.tree is None:  # a prompt chunk
                self.slot.chunk_computed(work, self.proposer)
                return StepOutput("", [], False)
            kept, finish = self.committer.commit(work, logits[0], self.tokens, self.generated)
            shown = self.out.emit(kept, finish)
            if shown.covering is not None:  # a stop string: the output ends where its text does
                self.generated = shown.covering
            if shown.finish is not None:
                self._finish(shown.finish, shown.text)
            return StepOutput(shown.piece, kept, shown.finish is not None, shown.finish)
        except BaseException:
            self._release()
            raise

    # the task protocol (core/task.py): a generation's step is one forward on its own cache
    def next_forwards(self, cap: int | None = None) -> "list[Forward] | StepOutput":
        nxt = self.next_forward(cap)
        if isinstance(nxt, StepOutput):
            return nxt
        nxt.cache, nxt.decoder = self.cache, self.model.model
        return [nxt]

    def finish_forwards(self, forwards: "list[Forward]", logits: "list[torch.Tensor]") -> StepOutput:
        return self.finish_forward(forwards[0], logits[0])

    # --------------------------------------------------------------- finish
    def cancel(self) -> None:
        """Stop at the next step (e.g. the client went away)."""
        self._cancelled = True

    def _finish(self, reason: str, text: str | None = None) -> StepOutput:
        if self.result is None:
            stage, self._stage, n = self._stage, Status.FINISHED, len(self.prompt_ids)
            if stage is not Status.DECODING:  # ended before or during the prefill: the proposer never began
                self._release()
                reused = {"prefix_reused": self.slot.prefill.reused} if stage is Status.PREFILLING else {}
                self.result = GenerationResult("", [], n, reason, {"method": self.method, **reused})
                return StepOutput("", [], True, reason)
            try:
                self.slot.keep_output(self.tokens)
                if self.proposer is not None:
                    self.proposer.end()
                    self.runner.memory.settle()  # what the proposer fed its memory counts against the bounds
            finally:
                self._release()
            stats = {**self.out.stats(method=self.method, new_tokens=len(self.generated), prompt_tokens=n,
                                      constrained=self.constraint is not None, **self.slot.timing()),
                     **(self.proposer.stats() if self.proposer is not None else {}),
                     **(self.slot.kv.stats() if self.slot.kv is not None else {})}
            self.result = GenerationResult(text if text is not None else self.out.text, list(self.generated), n,
                                           reason, stats)
        return StepOutput("", [], True, self.result.finish_reason)

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
        if self.slot is not None:
            self.slot.release()
