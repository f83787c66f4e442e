"""One iteration of continuous batching: every running generation's next forward in one pass.

Iteration-level scheduling ("Orca: A Distributed Serving System for Transformer-Based Generative
Models", Yu et al., 2022; vLLM): a scheduler (``server/engine.py``) keeps a set of running
``Generation`` objects, lets requests join and leave between iterations, and calls
``step_batch`` once per iteration.  Each generation hands over the forward it needs next
(``Generation.next_forward``): a prompt chunk, or its root with its proposer's token tree.
Prompt chunks are at most ``PREFILL_CHUNK`` tokens and only ``max_prefill_chunks`` of them run
per iteration, so a long prompt never stalls the running decodes for long (chunked prefill:
"SARATHI: Efficient LLM Inference by Piggybacking Decodes with Chunked Prefills", Agrawal et
al., 2023; TetriInfer's fixed-size chunks, 2024).

Batched speculation: each sequence carries its own tree, and all trees are verified in the same
forward with ragged acceptance: each sequence commits its own accepted path in its own cache
slot, so nothing needs realigning between sequences (the problem "Batch Speculative Decoding
Done Right" (2025) solves for padded batches does not arise; "BASS: Batched Attention-optimized
Speculative Sampling", Qian et al., 2024, and EMS-SD, 2024, batch ragged trees the same way).

How much to speculate under load follows TETRIS ("TETRIS: Optimal Draft Token Selection for
Batch Speculative Decoding", Wu et al., 2025): the verification budget of an iteration goes to
the sequences whose drafts are most likely to be accepted, and only while an extra row pays for
its measured cost (``speculation_caps``).  At batch 1 that is the method's own tree; as the batch
fills, the same rows cost more and trees shrink to nothing when they no longer pay.  Only greedy
sequences are capped: greedy output does not depend on the tree, while a seeded sampling
sequence must draw the same tree as alone to reproduce its output.

Exactness across sequences: ``NativeCausalLM.forward_batch`` gives each token the bits of its
own sequence's forward (with the default batch-invariant kernels), so a request's greedy output
does not depend on what else is in the batch.  Backends without ``forward_batch`` run the
forwards one after the other (same results, no speed-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .generate import Forward, Generation, StepOutput

if TYPE_CHECKING:
    from .cost_model import VerifyCost


@dataclass
class Outcome:
    """What one iteration did for one generation: its ``StepOutput`` (None: it did not run this
    iteration, e.g. a prompt chunk that waits for the next one), or the error that ended it."""

    output: StepOutput | None = None
    error: BaseException | None = None


def speculation_caps(accept: Sequence[float | None], budgets: Sequence[int], fixed_rows: int,
                     cost: "VerifyCost") -> list[int]:
    """Draft tokens per sequence for one batched verification (TETRIS-style greedy selection).

    ``accept[i]``: sequence i's observed mean accepted draft tokens per step (None: it does not
    speculate); ``budgets[i]``: its own tree budget; ``fixed_rows``: rows of the forward that are
    not drafts (the roots, others' trees, prompt chunks).  A chain model of acceptance: with
    per-token acceptance ``p`` (from the mean ``a = p / (1 - p)``), the d-th draft token is
    accepted with probability ``p**d``.  Rows are added, best expected gain first, while the
    expected tokens per second of the whole forward grow."""
    caps = [0] * len(budgets)
    rates = [None if a is None else min(max(a / (1.0 + a), 0.05), 0.95) for a in accept]
    rows = max(fixed_rows, 1)
    tokens = float(fixed_rows)
    while True:
        best, gain = -1, 0.0
        for i, p in enumerate(rates):
            if p is not None and caps[i] < budgets[i]:
                g = p ** (caps[i] + 1)
                if g > gain:
                    best, gain = i, g
        if best < 0 or (tokens + gain) / cost(rows + 1) <= tokens / cost(rows):
            return caps
        caps[best] += 1
        rows += 1
        tokens += gain


def run_forwards(model, work: list[tuple[Generation, Forward]]) -> list[torch.Tensor]:
    """The target's logits for each (generation, forward), in one batched pass where the backend
    has one."""
    decoder = model.model
    batch = getattr(decoder, "forward_batch", None)
    if batch is None or len(work) == 1:
        return [f.run(decoder, g.cache) for g, f in work]
    from ..models.native import BatchItem

    return batch([BatchItem(f.tokens, g.cache, f.parents, f.logits_for, f.hidden) for g, f in work])


def step_batch(gens: Sequence[Generation], caps: Sequence[int | None] | None = None,
               max_prefill_chunks: int = 1) -> list[Outcome]:
    """One iteration over ``gens`` (all on one runner): each generation's next forward, run
    together; returns one ``Outcome`` per generation, in order.

    ``caps[i]`` bounds generation i's draft tree this iteration (None: its own budget).  At most
    ``max_prefill_chunks`` prompt chunks run (generations still prefilling beyond that wait, in
    order).  A generation that fails is reported in its ``Outcome`` and left finished; the others
    go on.  If the batched forward itself fails, each forward is retried alone, so that only the
    generation at fault fails."""
    out = [Outcome() for _ in gens]
    work: list[tuple[int, Forward]] = []
    chunks = 0
    for i, gen in enumerate(gens):
        if gen.prefilling:
            if chunks >= max_prefill_chunks:
                continue
            chunks += 1
        try:
            nxt = gen.next_forward(None if caps is None else caps[i])
        except Exception as e:  # noqa: BLE001 - reported per generation
            out[i].error = e
            gen.abort()
            continue
        if isinstance(nxt, StepOutput):
            out[i].output = nxt
        else:
            work.append((i, nxt))
    if not work:
        return out
    model = gens[work[0][0]].model
    try:
        logits = run_forwards(model, [(gens[i], f) for i, f in work])
    except Exception:  # noqa: BLE001 - find the one at fault: roll back, then one at a time
        logits = None
        for i, f in work:
            gens[i].cache.rollback()
            if f.hidden is not None:
                f.hidden.clear()
    for k, (i, f) in enumerate(work):
        try:
            lg = logits[k] if logits is not None else run_forwards(model, [(gens[i], f)])[0]
            out[i].output = gens[i].finish_forward(f, lg)
        except Exception as e:  # noqa: BLE001 - reported per generation
            out[i].error = e
            gens[i].abort()
    return out
