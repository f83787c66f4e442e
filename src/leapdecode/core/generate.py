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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .committer import Committer
from .constraint import Constraint
from .kv_policy import KVPolicy, check_policy
from .output import OutputProcessor
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
        self.max_new_tokens = check_max_new_tokens(max_new_tokens)
        self.stop = check_stop(stop)
        self.prompt_ids = check_prompt_ids(prompt_ids, model)
        self.kv_policy = check_policy(kv_policy, model)  # lossy KV-cache compression; None: exact
        self.proposer, self.constraint = proposer, constraint  # constraint: a grammar (core/constraint.py)
        budget = (tree_budget or proposer.default_budget) if proposer is not None else 0
        self.out = OutputProcessor(model.tokenizer, self.stop)  # text pieces, stop strings, statistics
        self.planner = StepPlanner(proposer, constraint, budget, model.device, self.out)
        self.tokens, self.generated = list(self.prompt_ids), []  # decided (tokens: prompt first; its last: the root)
        # its claim on the runner (KV-cache slot, generator, prompt prefill), taken at the first step;
        # memory_scope: whose part of the runner's memory the proposer uses (DecodeContext)
        self.slot = Slot(runner, self.prompt_ids, params, self.max_new_tokens, self.kv_policy, memory_scope)
        self.committer: Committer | None = None  # from the prefill's end (the proposer began): DECODING
        self.result: GenerationResult | None = None

    cache = property(lambda self: self.slot.cache)
    finished = property(lambda self: self.result is not None)
    tree_budget = property(lambda self: self.planner.tree_budget, doc="most drafted nodes a step verifies")
    draft_acceptance = property(lambda self: self.out.draft_acceptance(), doc="draft tokens accepted per tree step")
    decoding = property(lambda self: self.status is Status.DECODING)
    prefilling = property(lambda self: self.result is None and self.slot.prefilling, doc="prompt chunks still to run")

    def next_chunk_tokens(self) -> int:
        """About how many prompt tokens the next prefill forward computes (a scheduler's guess)."""
        return self.slot.next_chunk_tokens()

    @property
    def status(self) -> Status:
        return Status.WAITING if not self.slot.taken and self.result is None else super().status

    # ---------------------------------------------------------------- start
    def adopt_prompt(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Start from the keys and values of this prompt but its last token that another generation
        prefilled (``KVCache.committed_slice``): exact, a prefill being the same position-0-aligned
        chunks wherever it runs.  Before the first step, without a KV policy."""
        self.slot.adopt(k, v)

    def start(self) -> None:
        """Take the slot, prefill the prompt (all but its last token, the first step's root), start
        the proposer.  ``step()`` calls it when needed."""
        with self.slot.take().releasing():
            self.slot.prefill_alone(self.proposer, self.model.model)
            self._decode()

    def _decode(self) -> None:
        """After the prefill: the committer, and the proposer begins (it may prefill its own)."""
        if self.committer is None:
            self.slot.prefill_ended()
            self.committer = Committer(self.slot.ctx, self.proposer, self.constraint, self.slot.kv, self.out,
                                       self.tokens)
            self.planner.begin(self.slot.ctx, self.tokens)

    # ----------------------------------------------------------------- step
    def step(self) -> StepOutput:
        """One propose -> verify -> commit iteration, its forward alone (the first also prefills)."""
        if self.result is None:
            self.start()
        work = self.next_forwards()
        if isinstance(work, StepOutput):
            return work
        with self.slot.releasing():
            logits = self.planner.run(work[0])  # (it times a step's forward where the cost profile learns)
        return self.finish_forwards(work, [logits])

    # the task protocol (core/task.py): a step is one forward on its own cache, a prompt chunk or a tree
    def next_forwards(self, cap: int | None = None) -> "list[Forward] | StepOutput":
        """A step's first half: the next forward (a prompt chunk, or the root and the proposer's tree,
        ``cap`` bounding its size), or a ``StepOutput`` when it ended without one."""
        if self.result is not None:
            return self._ended()
        with self.slot.take().releasing():
            if self._cancelled:
                return self._finish("cancelled")
            if not self.prefilling or (work := self.slot.next_chunk(self.proposer)) is None:
                self._decode()
                if self.cache.room() < 1:
                    return self._finish("length")
                budget = self.planner.budget(self.cache.room(), self.max_new_tokens - len(self.generated), cap)
                work = self.planner.plan(self.tokens, self.cache, budget)
            work.cache, work.decoder = self.cache, self.model.model
            return [work]

    def finish_forwards(self, forwards: "list[Forward]", logits: "list[torch.Tensor]") -> StepOutput:
        """A step's second half: the logits (``[1, T, vocab]``) of its forward."""
        work = forwards[0]
        with self.slot.releasing():
            if work.tree is None:  # a prompt chunk
                self.slot.chunk_computed(work, self.proposer)
                return StepOutput("", [], False)
            kept, finish = self.committer.commit(work, logits[0][0], self.tokens, self.generated)
            shown = self.out.emit(kept, finish)
            if shown.covering is not None:  # a stop string: the output ends where its text does
                self.generated = shown.covering
            if shown.finish is not None:
                self._finish(shown.finish, shown.text)
            return StepOutput(shown.piece, kept, shown.finish is not None, shown.finish)

    # --------------------------------------------------------------- finish
    def _finish(self, reason: str, text: str | None = None) -> StepOutput:
        if self.result is None:
            slot, n, stats = self.slot, len(self.prompt_ids), {"method": self.method}
            if self.committer is None:  # ended before or during the prefill: the proposer never began
                slot.release()
                reused = {"prefix_reused": slot.prefill.reused} if slot.taken else {}
                self.result = GenerationResult("", [], n, reason, {**stats, **reused})
                return self._ended()
            slot.end(self.tokens, self.proposer)
            stats = {**self.out.stats(method=self.method, new_tokens=len(self.generated), prompt_tokens=n,
                                      constrained=self.constraint is not None, **slot.timing()),
                     **(self.proposer.stats() if self.proposer is not None else {}),
                     **(slot.kv.stats() if slot.kv is not None else {})}
            self.result = GenerationResult(self.out.text if text is None else text, list(self.generated), n,
                                           reason, stats)
        return self._ended()

    def _ended(self) -> StepOutput:
        return StepOutput("", [], True, self.result.finish_reason)

    def abort(self) -> None:
        """Give the cache back after a failure that ends this generation (finish reason "error")."""
        self.slot.release()  # the runner resets the cache it takes back
        if self.result is None:  # finished: a later step() or next_forwards() does nothing
            self.result = GenerationResult("", list(self.generated), len(self.prompt_ids), "error",
                                           {"method": self.method})

    def close(self) -> None:
        """Give the cache back now (a generation abandoned before its end)."""
        if self.result is None:
            self._finish("cancelled")
