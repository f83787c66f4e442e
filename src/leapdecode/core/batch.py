"""One iteration of continuous batching: every running generation's next forward in one pass.

Iteration-level scheduling ("Orca: A Distributed Serving System for Transformer-Based Generative
Models", Yu et al., 2022; vLLM): a scheduler (``server/engine.py``) keeps a set of running
``Generation`` objects, lets requests join and leave between iterations, and calls
``step_batch`` once per iteration.  Each generation hands over the forward it needs next
(``Generation.next_forwards``, the task protocol of ``core/task.py``): a prompt chunk, or its root with its proposer's token tree.
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
its cost.  ``SpeculationScheduler`` (what the server's engine uses) decides it per iteration from
measured costs: the batched forward's cost per sequence and per draft row, measured online
(``batch_cost.BatchCost``), each sequence's recent acceptance and its proposer's measured time;
a sequence whose drafts do not pay gets a plain step (its proposer does not run), a step where
nothing pays is plain batched decoding, and a gated sequence is re-probed now and then.  The
earlier rule, ``speculation_caps`` (from the single-sequence verification profile alone), stays
as the engine's ``speculation="profile"`` policy.

Exactness across sequences: ``NativeCausalLM.forward_batch`` gives each token the bits of its
own sequence's forward (with the default batch-invariant kernels), so a request's greedy output
does not depend on what else is in the batch.  Backends without ``forward_batch`` run the
forwards one after the other (same results, no speed-up).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .generate import Generation
from .running_mean import DiscountedMean, discounted_mean
from .task import Forward, StepOutput, Task

if TYPE_CHECKING:
    from .cost_model import VerifyCost


@dataclass
class Outcome:
    """What one iteration did for one generation: its ``StepOutput`` (None: it did not run this
    iteration, e.g. a prompt chunk that waits for the next one), or the error that ended it.
    ``drafted``: the draft nodes its decoding step verified (0: a plain step; None: no decoding
    step ran, e.g. a prompt chunk); ``host_s``: seconds spent in its own halves of the step
    (planning and proposing, then verifying, committing, observing, detokenizing)."""

    output: StepOutput | None = None
    error: BaseException | None = None
    drafted: int | None = None
    host_s: float = 0.0


@dataclass
class BatchTiming:
    """What the batched forward of one ``step_batch`` held and how long it took (filled in when
    a ``BatchTiming`` is passed; ``forward_s`` stays 0 when no batched forward ran or it failed)."""

    forward_s: float = 0.0
    items: int = 0  # forwards in the batch (sequences)
    tree_rows: int = 0  # draft nodes (rows beyond each decoding step's root)
    prefill_rows: int = 0  # prompt-chunk tokens beyond each chunk's first


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


def run_forwards(model, forwards: "list[Forward]") -> list[torch.Tensor]:
    """The target's logits for each forward (on its own ``cache``), in one batched pass where the
    backend has one."""
    decoder = model.model
    batch = getattr(decoder, "forward_batch", None)
    if batch is None or len(forwards) == 1:
        return [f.run(decoder) for f in forwards]
    from ..models.native import BatchItem

    return batch([BatchItem(f.tokens, f.cache, f.parents, f.logits_for, f.hidden) for f in forwards])


def step_batch(tasks: Sequence[Task], caps: Sequence[int | None] | None = None,
               max_prefill_chunks: int = 1, timing: BatchTiming | None = None) -> list[Outcome]:
    """One iteration over ``tasks`` (all on one runner; generations, searches, parallel samples:
    ``core/task.py``): every forward they need now, run together; returns one ``Outcome`` per
    task, in order.

    ``caps[i]`` bounds task i's draft tree this iteration (None: its own budget).  At most
    ``max_prefill_chunks`` prompt chunks run (tasks still prefilling beyond that wait, in order).
    A task that fails is reported in its ``Outcome`` and left finished; the others go on.  If the
    batched forward itself fails, each task's forwards are retried alone, so that only the task
    at fault fails.  ``timing``: filled in with the batched forward's contents and seconds (what
    ``SpeculationScheduler`` learns the forward's cost from)."""
    out = [Outcome() for _ in tasks]
    work: list[tuple[int, Forward]] = []
    chunks = 0
    clock = time.perf_counter
    for i, task in enumerate(tasks):
        if task.prefilling:
            if chunks >= max_prefill_chunks:
                continue
            chunks += 1
        t0 = clock()
        try:
            nxt = task.next_forwards(None if caps is None else caps[i])
        except Exception as e:  # noqa: BLE001 - reported per task
            out[i].error = e
            task.abort()
            continue
        finally:
            out[i].host_s = clock() - t0
        if isinstance(nxt, StepOutput):
            out[i].output = nxt
            continue
        work.extend((i, f) for f in nxt)
        if any(f.tree is not None for f in nxt):
            out[i].drafted = sum(len(f.tree) for f in nxt if f.tree is not None)
    if not work:
        return out
    model = tasks[work[0][0]].model
    t0 = clock()
    try:
        logits = run_forwards(model, [f for _, f in work])
    except Exception:  # noqa: BLE001 - find the one at fault: undo, then each task alone
        logits = None
        for _, f in work:
            f.undo()
            if f.hidden is not None:
                f.hidden.clear()
    if timing is not None and logits is not None:
        timing.forward_s = clock() - t0
        timing.items = len(work)
        timing.tree_rows = sum(f.draft_rows for _, f in work)
        timing.prefill_rows = sum(f.prefill_rows for _, f in work)
    by_task: dict[int, list[int]] = {}
    for k, (i, _) in enumerate(work):
        by_task.setdefault(i, []).append(k)
    for i, ks in by_task.items():
        t1 = clock()
        try:
            forwards = [work[k][1] for k in ks]
            lgs = [logits[k] for k in ks] if logits is not None else run_forwards(model, forwards)
            out[i].output = tasks[i].finish_forwards(forwards, lgs)
        except Exception as e:  # noqa: BLE001 - reported per task
            out[i].error = e
            tasks[i].abort()
        out[i].host_s += clock() - t1
    return out


# ---------------------------------------------------------------------------- the scheduler
PROBE_ROWS = 4  # draft nodes a gated-off sequence is re-probed with
PROBE_FIRST = 8  # its own plain steps before the first re-probe; the gap doubles after each
PROBE_MAX = 64  # ... up to this
MIN_ROW_ACCEPT = 0.1  # a draft row expected to be accepted less often than this is never verified


class SequenceStats:
    """What the scheduler knows of one generation: its recent acceptance (discounted hits and
    trials of a chain model: a step that verified k nodes and accepted a adds a hits and a + 1
    trials, or a trials when all k were accepted), its own decoding steps, and how long its
    proposer takes (``extra``, a running mean the scheduler keeps: ``SpeculationScheduler._host``).

    The acceptance is not a ``running_mean`` mean: a step adds a variable number of trials (its
    weight in the ratio is its trials, not one), and ``accept_rate`` pulls the ratio towards a
    prior that changes between reads (the scheduler's pooled rate) with a fixed weight that is not
    discounted, so hits and trials are kept as the posterior's sums."""

    __slots__ = ("hits", "trials", "plain_run", "gap", "extra", "planned")

    # not measured; kept as they were (set with the scheduler's step-weighted prior, commit
    # 6d8704e: DISCOUNT 0.8 -> 0.85, PRIOR_WEIGHT 1.5 -> 0.5; the scheduler was measured only as a
    # whole, lab notes benchmarks.md section 14b, "Per-step tree sizes from measured costs")
    DISCOUNT = 0.85  # per speculative step, of hits and trials: the last few steps dominate
    PRIOR_WEIGHT = 0.5  # trials the prior is worth in ``accept_rate``

    def __init__(self) -> None:
        self.hits = self.trials = 0.0
        self.plain_run = 0  # decoding steps since it last verified a tree
        self.gap = PROBE_FIRST  # plain steps before its next re-probe
        self.extra: float | None = None  # running mean extra host seconds of its speculative steps
        self.planned = ""  # "probe", "spec" or "" (plain): what the last plan gave it

    def accept_rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """Per-token acceptance ``p`` (of the chain model), pulled towards ``prior``."""
        return min(max((self.hits + weight * prior) / (self.trials + weight), 0.01), 0.97)

    def update(self, drafted: int, accepted: int) -> None:
        d = self.DISCOUNT
        self.hits = d * self.hits + accepted
        self.trials = d * self.trials + accepted + (1 if accepted < drafted else 0)


def _gain(p: float, k: int) -> float:
    """Expected accepted draft tokens of a chain of ``k`` with per-token acceptance ``p``."""
    return p * (1.0 - p ** k) / (1.0 - p) if p < 1.0 else float(k)


def _depth(p: float, threshold: float, budget: int) -> int:
    """The number of depths d >= 1 with p ** d above ``threshold`` (at most ``budget``)."""
    if budget < 1 or p <= threshold or threshold <= 0.0:
        return budget if threshold <= 0.0 and p > 0.0 else 0
    return min(budget, int(math.log(threshold) / math.log(p) + 1e-9))


class LoadGuard:
    """Measured throughput of the scheduler's plans against plain batched decoding, per load level.

    The scheduler's plan rests on a cost model (a linear batched-forward cost, each proposer's
    measured time, a chain model of acceptance); where the model is wrong, speculation can lose to
    plain decoding, which issue 14 forbids ("batched speculation never below plain batched
    decoding").  So the choice between the two is also made on what they measurably did: a
    two-armed bandit per load level (the number of decoding sequences, in powers of two: 1, 2,
    3-4, 5-8, ...).  An arm holds for ``WINDOW`` iterations; after ``EXPLORE`` windows a level
    runs the arm that is behind for ``PROBE_WINDOW`` iterations, so a changed load or text is
    noticed; each such look that leaves the same arm ahead doubles the windows until the next one
    (up to ``EXPLORE_MAX``), and a change of leader brings the interval back to ``EXPLORE``: the
    arm behind gets about a tenth of the iterations at first, about 2% once the order is settled.
    The better arm is the one with more committed tokens per wall second (sums over its windows,
    discounted by ``DISCOUNT`` a window: a ratio of two discounted sums, tokens over seconds, in
    which an iteration weighs by its seconds, so not a ``running_mean`` mean of iterations).
    Iterations that carry a prompt chunk are not counted (their time is prefill's), but they
    follow the leader (``leader``): where plain decoding measures faster, the decoding sequences
    of a prefill iteration do not draft either.
    Which arm runs changes no text: greedy output is the same with any tree or none, and seeded
    sampling draws by position (drafter-invariant)."""

    WINDOW = 8
    PROBE_WINDOW = 4
    EXPLORE = 6
    EXPLORE_MAX = 24
    # per window, of both arms' tokens and seconds at a level; not measured; kept as it was (set
    # with the guard, commit c51ae88; the guard was measured as a whole, lab notes benchmarks.md
    # section 26)
    DISCOUNT = 0.85

    def __init__(self) -> None:
        self._levels: dict[int, dict] = {}

    @staticmethod
    def level(decoding: int) -> int:
        return max(decoding - 1, 0).bit_length()

    def _state(self, level: int) -> dict:
        st = self._levels.get(level)
        if st is None:
            st = self._levels[level] = {"arm": "spec", "left": 0, "since": 0, "every": self.EXPLORE,
                                        "leader": None, "explored": False,
                                        "tokens": {"spec": 0.0, "plain": 0.0}, "seconds": {"spec": 0.0, "plain": 0.0}}
        return st

    def rate(self, level: int, arm: str) -> float | None:
        """Measured committed tokens per second of ``arm`` at ``level`` (None: not measured yet)."""
        st = self._levels.get(level)
        if st is None or st["seconds"][arm] <= 0.0:
            return None
        return st["tokens"][arm] / st["seconds"][arm]

    def leader(self, decoding: int) -> str:
        """The arm that measures faster at this load now ("spec" until both are measured)."""
        level = self.level(decoding)
        spec, plain = self.rate(level, "spec"), self.rate(level, "plain")
        return "plain" if spec is not None and plain is not None and plain > spec else "spec"

    def arm(self, decoding: int) -> str:
        """"spec" (the scheduler's plan) or "plain" (no draft at all) for the next iteration."""
        level = self.level(decoding)
        st = self._state(level)
        if st["left"] <= 0:
            for a in ("spec", "plain"):  # discount the old windows: loads and texts drift
                st["tokens"][a] *= self.DISCOUNT
                st["seconds"][a] *= self.DISCOUNT
            spec, plain = self.rate(level, "spec"), self.rate(level, "plain")
            if spec is None or plain is None:
                st["arm"] = "spec" if spec is None else "plain"
            else:
                better = "spec" if spec >= plain else "plain"
                worse = "plain" if better == "spec" else "spec"
                if better != st["leader"]:  # a new leader: look at the other arm soon again
                    st["every"], st["since"] = self.EXPLORE, 0
                elif st["explored"]:  # the look at the arm behind left the order as it was
                    st["every"] = min(2 * st["every"], self.EXPLORE_MAX)
                st["leader"], st["explored"] = better, False
                st["since"] += 1
                if st["since"] >= st["every"]:
                    st["since"], st["explored"] = 0, True
                    st["arm"], st["left"] = worse, self.PROBE_WINDOW
                    return worse
                st["arm"] = better
            st["left"] = self.WINDOW
        return st["arm"]

    def record(self, decoding: int, arm: str, tokens: int, seconds: float) -> None:
        st = self._state(self.level(decoding))
        st["left"] -= 1
        if seconds > 0.0:
            st["tokens"][arm] += tokens
            st["seconds"][arm] += seconds


class SpeculationScheduler:
    """Per-step draft tree sizes for a batch, from measured costs (TETRIS's objective,
    "speculation that helps at batch 1 must not hurt throughput at batch 8").

    Each iteration (``plan``) it chooses for every speculating generation a cap on its draft tree
    (0: a plain step, and the proposer does not run at all) that maximises the iteration's
    expected committed tokens per second:

        (decoding sequences + sum_i gain_i(k_i)) / (forward(items, sum_i k_i) + host + sum_{k_i > 0} proposer_i)

    with ``gain_i(k) = p_i + ... + p_i ** k`` (a chain model of acceptance, ``p_i`` sequence i's
    recent per-token acceptance, pulled towards the pooled acceptance of the runner's recent
    steps), ``forward`` the runner's online-measured batched cost (``batch_cost.BatchCost``:
    seconds per item, per draft row, per prefill row), ``host`` the measured per-sequence Python
    work of a plain step and ``proposer_i`` the measured extra of a speculative step of sequence i
    (proposing, tree verification, observing).  The ratio is maximised exactly (Dinkelbach's
    iteration: at a rate ``r`` each sequence independently takes the k maximising
    ``gain_i(k) - r * (row * k + proposer_i)``, then ``r`` is updated), with one guard against
    noise in the measured costs: a row whose acceptance probability ``p_i ** d`` is below
    ``MIN_ROW_ACCEPT`` is never verified, however cheap rows look.  When no speculation's
    expected gain pays for its rows and its proposer, the whole step is plain batched decoding.

    On top of the plan, ``LoadGuard`` (``guard=True``, the default) compares what the plans measurably
    committed per second with plain batched decoding at the same load level, and runs plain
    iterations where those win.

    A generation gated off is re-probed with ``PROBE_ROWS`` nodes after ``PROBE_FIRST`` of its own
    plain steps, then after twice as many each time the probe does not bring it back: so it
    returns when its text turns repetitive (code, lists, a quoted passage).

    Every generation is capped this way, seeded sampled ones too: their draws belong to positions,
    not to trees (drafter-invariant sampling, ``core/verifier.py``), so their texts are the same
    under load as alone whatever trees the load gives them; greedy output does not depend on the
    trees at all, and every tree keeps an unseeded sample exact."""

    # The running means below follow ``running_mean``'s rule.  Their rates were set with the
    # scheduler (commits 5398170, 6d8704e) and the scheduler was measured only as a whole (lab notes
    # benchmarks.md section 14b); no measurement chose them (not measured; kept as they were).
    POOL_DISCOUNT = 0.97  # per speculative step, of the pooled acceptance's count (a DiscountedMean)
    POOL_PRIOR = 0.5  # the pooled acceptance before any step ...
    POOL_PRIOR_STEPS = 2.0  # ... worth this many steps (discounted like them)
    HOST_RATE = 0.1  # weight of one step in the mean plain-step and pooled extra host seconds
    # (HOST_RATE was HOST_DISCOUNT = 0.9, the old mean's share: 0.9 * mean + 0.1 * x)
    EXTRA_RATE = 0.5  # weight of one speculative step in a sequence's own mean extra host seconds

    def __init__(self, runner, guard: bool = True) -> None:
        self.runner = runner
        # measured throughput of the plans against plain decoding, per load level (None: plans alone)
        self.guard: LoadGuard | None = LoadGuard() if guard else None
        self._arm: str | None = None  # the guard's arm for the planned iteration
        self._guard_plain = False
        self._decoding = 0
        self._t_plan = 0.0
        self._seqs: dict[int, tuple[Generation, SequenceStats]] = {}
        # pooled per-step acceptance a / (a + a miss) of the recent speculative steps (a step-weighted
        # mean, so a few long accepted chains do not make every sequence look good): the prior of a
        # sequence that has not drafted yet
        self._pool = DiscountedMean(self.POOL_PRIOR, self.POOL_PRIOR_STEPS, self.POOL_DISCOUNT)
        self._plain_host: float | None = None  # per sequence, a plain decoding step's host seconds
        self._spec_extra: float | None = None  # pooled: a speculative step's extra host seconds
        self.counters = {"iterations": 0, "decode_steps": 0, "speculative_steps": 0, "draft_rows": 0,
                         "probes": 0, "plain_iterations": 0, "guard_plain_iterations": 0}

    # ------------------------------------------------------------------ state
    def stats_for(self, gen: Generation) -> SequenceStats:
        entry = self._seqs.get(id(gen))
        if entry is None or entry[0] is not gen:
            entry = self._seqs[id(gen)] = (gen, SequenceStats())
        return entry[1]

    def forget(self, gen: Generation) -> None:
        """Drop what is kept about a generation that left the batch."""
        entry = self._seqs.get(id(gen))
        if entry is not None and entry[0] is gen:
            del self._seqs[id(gen)]

    def pooled_rate(self) -> float:
        return min(max(self._pool.mean, 0.01), 0.97)

    def _extra(self, st: SequenceStats) -> float:
        """Measured host seconds a speculative step of this sequence costs beyond a plain step per
        token it emitted (proposing, verifying the tree, observing; its own, else the pooled)."""
        extra = st.extra if st.extra is not None else self._spec_extra
        return max(extra, 0.0) if extra is not None else 0.0

    # ------------------------------------------------------------------- plan
    def plan(self, gens: Sequence[Generation]) -> list[int | None]:
        """Draft-tree caps for one ``step_batch`` over ``gens`` (None: not speculating).  Pure:
        what a plan gave a generation is remembered, and counted by ``record`` only if its step
        ran."""
        self._t_plan = time.perf_counter()
        self._arm = None
        self._guard_plain = False  # the guard made this iteration plain (its arm, or the leader)
        caps: list[int | None] = [None] * len(gens)
        spec = [i for i, g in enumerate(gens) if g.proposer is not None and not g.done and g.tree_budget > 0]
        for i in spec:
            self.stats_for(gens[i]).planned = ""
        if not spec:
            return caps
        decoding = sum(1 for g in gens if g.decoding)
        prefilling = [g for g in gens if g.prefilling]
        if self.guard is not None and decoding:
            if not prefilling:
                self._arm, self._decoding = self.guard.arm(decoding), decoding
            # plain batched decoding measures better at this load now (a prefill iteration is not
            # measured, but its decoding sequences follow the leader)
            if (self._arm or self.guard.leader(decoding)) == "plain":
                self._guard_plain = True
                for i in spec:
                    caps[i] = 0
                return caps
        items = decoding + (1 if prefilling else 0)
        prefill_rows = prefilling[0].next_chunk_tokens() - 1 if prefilling else 0
        host0 = (self._plain_host or 0.0) * decoding
        cache = next((g.cache for g in gens if g.cache is not None and not g.done), None)
        cost = self.runner.batch_cost(cache) if cache is not None else None
        pooled = self.pooled_rate()
        rates = {i: self.stats_for(gens[i]).accept_rate(pooled) for i in spec}
        extra = {i: self._extra(self.stats_for(gens[i])) for i in spec}
        if cost is None:
            chosen = {i: 0 for i in spec}
        else:
            row = cost.row_seconds()
            base_s = cost(max(items, 1), 0, max(prefill_rows, 0)) + host0
            base_tokens = decoding
            chosen = {i: 0 for i in spec}
            rate = base_tokens / base_s
            for _ in range(8):  # Dinkelbach: converges in a few rounds
                new = {}
                for i in spec:
                    g, p = gens[i], rates[i]
                    if not g.decoding:
                        new[i] = 0
                        continue
                    k = _depth(p, max(rate * row, MIN_ROW_ACCEPT), g.tree_budget)
                    new[i] = k if k and _gain(p, k) - rate * (row * k + extra[i]) > 0.0 else 0
                tokens = base_tokens + sum(_gain(rates[i], k) for i, k in new.items())
                seconds = base_s + sum(row * k + extra[i] for i, k in new.items() if k)
                nrate = tokens / seconds
                done = new == chosen
                chosen, rate = new, nrate
                if done:
                    break
        for i in spec:
            g, st, k = gens[i], self.stats_for(gens[i]), chosen[i]
            if k:
                st.planned = "spec"
            elif st.plain_run >= st.gap:
                k, st.planned = min(g.tree_budget, PROBE_ROWS), "probe"
            caps[i] = k
        return caps

    # ----------------------------------------------------------------- record
    def record(self, gens: Sequence[Generation], outcomes: Sequence[Outcome], timing: BatchTiming | None) -> None:
        """Learn from one ``step_batch``: the forward's cost, each sequence's acceptance and host
        time, and the probes' schedule."""
        self.counters["iterations"] += 1
        # (a batch where nothing can speculate does not start the cost model: no verify-cost probe)
        if timing is not None and timing.items and timing.forward_s > 0.0 and any(g.proposer is not None
                                                                                 for g in gens):
            cache = next((g.cache for g in gens if g.cache is not None and not g.done), None)
            if cache is not None:
                self.runner.batch_cost(cache).observe(timing.items, timing.tree_rows, timing.prefill_rows,
                                                      timing.forward_s)
        any_spec = False
        for g, o in zip(gens, outcomes):
            if o.drafted is None or o.output is None:
                continue
            self.counters["decode_steps"] += 1
            if g.proposer is None:
                self._host(None, o.host_s)
                continue
            st = self.stats_for(g)
            if o.drafted:
                any_spec = True
                self.counters["speculative_steps"] += 1
                self.counters["draft_rows"] += o.drafted
                if st.planned == "probe":
                    self.counters["probes"] += 1
                if not o.output.finished:  # a finished step's tokens may be cut short (EOS, length)
                    accepted = min(max(len(o.output.tokens) - 1, 0), o.drafted)
                    st.update(o.drafted, accepted)
                    self._pool.add(accepted / (accepted + (accepted < o.drafted)))
                # each emitted token is credited a plain step's host work (detokenizing, stop strings)
                self._host(st, o.host_s - (self._plain_host or 0.0) * max(len(o.output.tokens), 1))
                st.plain_run = 0
                # a probe that did not bring it back: wait twice as long for the next one
                st.gap = min(st.gap * 2, PROBE_MAX) if st.planned == "probe" else PROBE_FIRST
            else:
                self._host(None, o.host_s)
                if not self._guard_plain:  # the guard's plain iterations do not bring a re-probe nearer
                    st.plain_run += 1
        for g in gens:
            if g.done:
                self.forget(g)
        if not any_spec:
            self.counters["plain_iterations"] += 1
        if self._arm is not None:
            if self._arm == "plain":
                self.counters["guard_plain_iterations"] += 1
            tokens = sum(len(o.output.tokens) for o in outcomes if o.drafted is not None and o.output is not None)
            self.guard.record(self._decoding, self._arm, tokens, time.perf_counter() - self._t_plan)
            self._arm = None

    def _host(self, st: SequenceStats | None, seconds: float) -> None:
        """A plain step's host seconds (``st`` None), or the extra seconds of ``st``'s speculative step:
        running means (``discounted_mean`` at ``HOST_RATE``, a sequence's own at ``EXTRA_RATE``),
        each starting at its first observation."""
        if st is None:
            self._plain_host = seconds if self._plain_host is None else discounted_mean(
                self._plain_host, seconds, self.HOST_RATE)
            return
        st.extra = seconds if st.extra is None else discounted_mean(st.extra, seconds, self.EXTRA_RATE)
        self._spec_extra = seconds if self._spec_extra is None else discounted_mean(
            self._spec_extra, seconds, self.HOST_RATE)
