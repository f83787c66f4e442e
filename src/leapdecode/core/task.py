"""One task protocol: what a batched scheduler drives (``core/batch.step_batch``, the server's engine).

A *task* is anything that runs on a runner's target one step at a time: a ``Generation``
(``core/generate.py``), a search (``strategies/search.TreeSearch``) or a set of sampled
generations (``strategies/parallel.ParallelSamples``).  Each step a scheduler asks every task for
the target forwards it needs (``next_forwards``), runs all of them in one batched forward, and
hands each task its forwards' logits (``finish_forwards``); a task that needs no shared forward
this step (it prefilled a search's prompt, it ended) answers with a ``StepOutput`` at once.  So a
beam search shares the batch with other requests, and the scheduler never asks what kind of task
it holds (vLLM v1's scheduler likewise sees requests, not their kinds).

Every forward a task hands over runs on the runner's target model (``Forward.cache``: the cache it
runs on); a task that also needs another model (contrastive decoding's amateur) runs that forward
itself, inside ``finish_forwards``.  A search's round is a coroutine: ``advance`` suspends at
``yield from tree.expand_co(...)`` until the scheduler sends the forward's logits back
(``strategies/search.py``); a strategy whose round does its forwards itself (superposed decoding's
embeddings, the step-level searches' rollouts) still runs through the protocol, just not batched.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from collections.abc import Generator
from typing import Any, ClassVar

import torch


@dataclass
class StepOutput:
    """What one step decided: the text that can be shown now, the tokens it kept, and whether
    the task is over (then ``finish_reason`` says why).  A search shows nothing until its end."""

    text: str
    tokens: list[int]
    finished: bool
    finish_reason: str | None = None


@dataclass
class Forward:
    """One target forward a task needs: a prompt chunk (``tree`` None; ``prefill_key``: its
    prefix-cache key when it is a whole chunk), a decoding step's root and draft tree
    (``parents``: the flattened tree, None for a chain; ``hidden``: a list for the per-layer hidden
    states when the proposer wants them), or a search's new tree nodes (``all_logits``, with
    ``parents``: each node's pending slot, -1 for the committed end; ``keep_pending``: the pending
    nodes before them, kept if the forward must be undone).  ``cache`` and ``decoder``: what it
    runs on (set by the task that hands it over)."""

    tokens: torch.Tensor  # [T]
    parents: list[int] | None = None
    tree: Any = None  # core.tree.TokenTree
    hidden: list | None = None
    prefill_key: bytes | None = None
    t0: float = 0.0
    proposed: bool = False  # the proposer drafted this step's tree (it then observes the verdict)
    drafted: Any = None  # the proposer's tree when the grammar pruned it (``tree``: what is verified)
    kept: list[int] | None = None  # for each node of ``tree``, its index in ``drafted``
    cache: Any = None
    all_logits: bool = False
    keep_pending: int = 0
    decoder: Any = None  # the decoder it runs on (what a task hands to the batch is on the runner's target)

    @property
    def logits_for(self) -> slice | None:
        """A prompt chunk needs no logits; a step or a search's nodes need all of them."""
        return None if self.tree is not None or self.all_logits else slice(0, 0)

    @property
    def draft_rows(self) -> int:
        """Rows beyond the first that are drafts or search nodes (a cost model's tree rows)."""
        if self.tree is not None:
            return len(self.tree)
        return self.tokens.numel() - 1 if self.all_logits else 0

    @property
    def prefill_rows(self) -> int:
        """Rows beyond the first of a prompt chunk (a cost model's prefill rows)."""
        return 0 if self.tree is not None or self.all_logits else self.tokens.numel() - 1

    def run(self, decoder=None, cache=None) -> torch.Tensor:
        """This forward alone on ``decoder`` (or its own) and ``cache`` (or its own): ``[1, T, vocab]``
        logits."""
        kwargs = {"hidden_states": self.hidden} if self.hidden is not None else {}
        decoder = self.decoder if decoder is None else decoder
        return decoder.forward(self.tokens[None], self.cache if cache is None else cache, parents=self.parents,
                               logits_for=self.logits_for, **kwargs)

    def undo(self) -> None:
        """Drop what this forward appended to its cache (after a batched forward failed)."""
        if self.keep_pending:
            self.cache.prune_pending(list(range(self.keep_pending)))
        else:
            self.cache.rollback()


def drive(co: Generator) -> Any:
    """Run a coroutine that yields ``Forward``s (``ids, logits = yield from ...``) to its end, each
    forward alone on its own decoder and cache; its return value."""
    try:
        forward = next(co)
        while True:
            forward = co.send(forward.run())
    except StopIteration as stop:
        return stop.value


class Status(str, Enum):
    """Where a task is in its life (vLLM v1's request status): built but not started, running its
    prompt through the target, decoding, or finished (``result.finish_reason`` says why)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class Task:
    """Base of the tasks a scheduler drives (see the module docstring).  The defaults describe a
    task that drafts nothing: a scheduler's speculation planning leaves it alone."""

    streams: ClassVar[bool] = False  # True: its text is final step by step; False: all at its end
    proposer: Any = None  # what drafts its trees (None: nothing is drafted)
    tree_budget: int = 0
    result: Any = None  # set when it ends (a GenerationResult or SearchResult)
    cache: Any = None  # its target KV cache, when it holds one

    @classmethod
    def kv_tokens(cls, model: Any, prompt_len: int, max_new_tokens: int, *, strategy: Any = None,
                  kv_policy: Any = None) -> tuple[int, str]:
        """The KV-cache tokens a task of this kind holds at most (its slots, rounded as the runner
        rounds them) for a prompt of ``prompt_len`` tokens and ``max_new_tokens``, and their cache
        kind (``models.kv_cache.cache_bytes_per_token``): what a server reserves before it builds
        one.  ``strategy``: a search's config; ``kv_policy``: a generation's KV-cache policy."""
        raise NotImplementedError(f"{cls.__name__} does not say how much KV cache it holds")

    @property
    def done(self) -> bool:
        """It has ended (``result`` is set)."""
        return self.result is not None

    @property
    def status(self) -> Status:
        if self.done:
            return Status.FINISHED
        return Status.PREFILLING if self.prefilling else Status.DECODING

    @property
    def prefilling(self) -> bool:
        """It has prompt chunks for the batch still to run (a search prefills inside its first step)."""
        return False

    @property
    def decoding(self) -> bool:
        return not self.done and not self.prefilling

    def next_forwards(self, cap: int | None = None) -> "list[Forward] | StepOutput":
        """The target forwards this task needs now (``cap`` bounds a draft tree), or a
        ``StepOutput`` when it needs none this step.  Hand their logits to ``finish_forwards``;
        nothing else may touch its caches in between."""
        raise NotImplementedError

    def finish_forwards(self, forwards: "list[Forward]", logits: "list[torch.Tensor]") -> StepOutput:
        """The second half of a step: each forward's logits (``[1, T, vocab]``), in order."""
        raise NotImplementedError

    def choice_results(self, n: int) -> list:
        """Its result as ``n`` choices (a search's n best hypotheses; a generation is one)."""
        return [self.result]

    _cancelled: bool = False  # cancel() was called: it ends at its next step

    def cancel(self) -> None:
        """End at its next step (finish reason "cancelled"; e.g. the client went away)."""
        self._cancelled = True

    # a task is an iterator of its text pieces (``leapdecode.stream``), as a file is of its lines: ``next()``
    # runs steps until one decides text; ``close()``, or leaving a ``with`` block, gives the caches back
    # early (a task no longer referenced gives them back when it is collected)
    def __iter__(self) -> "Task":
        return self

    _text_given: bool = False  # a task that decides its text at its end handed it to ``next()``

    def step(self) -> StepOutput:
        """One step alone, its forwards run on their own (the first one starts the task)."""
        raise NotImplementedError

    def __next__(self) -> str:
        """The next text piece: steps until one decides text (``StopIteration`` once the task is over);
        a step that fails ends the task where it stood (``close``).  A task that decides its text at
        its end (``streams`` False: a search, its best hypothesis) gives it whole, once, at its end."""
        try:
            while not self.done:
                if text := self.step().text:
                    return text
        except BaseException:
            self.close()
            raise
        if not self.streams and not self._text_given:
            self._text_given = True
            if self.result.text:
                return self.result.text
        raise StopIteration

    def run(self) -> Any:
        """Steps to the end: the result."""
        for _ in self:
            pass
        return self.result

    def __enter__(self) -> "Task":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Give its caches back now (a task abandoned before its end)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Give its caches back after a failure (finish reason "error")."""
        raise NotImplementedError
