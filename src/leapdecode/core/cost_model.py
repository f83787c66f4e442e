"""What a verification forward costs on this machine, as a function of the tree size.

A hardware-aware tree size is the idea of "Sequoia: Scalable, Robust, and
Hardware-aware Speculative Decoding" (Chen et al., 2024): the best tree is the
one that maximises expected accepted tokens per second, and the seconds depend
on the hardware.  Whether verifying 24 tokens costs the same as verifying one
is a property of the machine, not a constant: on a CPU with AMX a bf16 forward
of up to ~32 tokens costs about one token's; on a CPU with only AVX512-BF16 we
measured a 25-token forward of the 1.5B model at 1.9x a 1-token forward.  So
leapdecode measures it, on the live cache (the nodes are appended as pending
and rolled back, so the measurement touches nothing), once per target model and
machine: the profile of a model loaded from a file is kept in
``<cache>/verify_cost.json`` for a week.

Only decisions that cannot change the output may depend on these timings:
greedy tree sizes (any tree gives vanilla's tokens).  Seeded sampling must be
reproducible, so its tree shapes never depend on a clock.
"""

from __future__ import annotations

import bisect
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from ..models.store import atomic_write

PROBE_SIZES = (1, 4, 8, 16, 24, 32)


class VerifyCost:
    """Seconds of one target forward of ``n`` tokens, interpolated from measured points.

    With ``learn=True`` (the profiles ``verify_cost_for`` hands out) the curve is also corrected
    online from the forwards the generation loop times (``observe``): one probe is a few seconds
    on a machine whose speed drifts by 10-25% within minutes, and a probe that caught a quiet
    moment for one size and a busy one for another mis-states the ratios that tree sizes are
    chosen from (measured: 1.63x for 4 tokens against 1.35x in the forwards that followed).
    The correction is a log-linear model, ``seconds(n) = profile(n) * exp(level + dev(n))``:
    ``level`` follows the machine's current speed (every observation moves it), ``dev(n)`` is
    the size's own steady deviation from the probe (observations of that size, with the level
    taken out), interpolated between observed sizes and held flat beyond them."""

    LEVEL_RATE = 0.1  # weight of one forward in the speed level
    DEV_RATE = 0.05  # least weight of one forward in its size's deviation (1/count before that)
    MIN_COUNT = 3  # observations of a size before its deviation is used
    LEARN_ROWS = 64  # sizes learned and tabulated (beyond: the profile's slope, scaled)

    def __init__(self, sizes: list[int], seconds: list[float], contended: bool = False, learn: bool = False) -> None:
        if len(sizes) != len(seconds) or not sizes:
            raise ValueError("need one time per size")
        self.sizes = list(sizes)
        # measured while other processes held the cores (measure_verify_cost): kept for minutes only
        self.contended = bool(contended)
        # a forward of more tokens never costs less: monotone, so noise cannot favour big trees
        self.seconds = [max(seconds[: i + 1]) for i in range(len(seconds))]
        self.learn = bool(learn)
        self.observations = 0
        self._level = 0.0
        self._dev: dict[int, list[float]] = {}  # size -> [mean log deviation from the level, count]
        self._table: list[float] | None = None  # corrected seconds of sizes 0 .. LEARN_ROWS

    def profile(self, n: int) -> float:
        """The probe's curve alone (no online correction)."""
        s, t = self.sizes, self.seconds
        if n <= s[0]:
            return t[0]
        if n >= s[-1]:  # extrapolate with the last slope
            slope = (t[-1] - t[-2]) / (s[-1] - s[-2]) if len(s) > 1 else 0.0
            return t[-1] + slope * (n - s[-1])
        i = bisect.bisect_left(s, n)
        w = (n - s[i - 1]) / (s[i] - s[i - 1])
        return t[i - 1] + w * (t[i] - t[i - 1])

    def __call__(self, n: int) -> float:
        if not self.observations:
            return self.profile(n)
        table = self._table if self._table is not None else self._tabulate()
        top = self.LEARN_ROWS
        if n <= top:
            return table[max(n, 0)]
        return table[top] * self.profile(n) / self.profile(top)

    def observe(self, n: int, seconds: float) -> None:
        """A measured forward of ``n`` tokens (ignored unless ``learn``)."""
        if not self.learn or not (seconds > 0.0 and math.isfinite(seconds)) or not 1 <= n <= self.LEARN_ROWS:
            return
        r = math.log(seconds / self.profile(n))
        d = self._dev.get(n)
        self._level += self.LEVEL_RATE * (r - self._deviation(n) - self._level)
        resid = r - self._level
        if d is None:
            self._dev[n] = [resid, 1.0]
        else:
            d[1] += 1.0
            d[0] += max(1.0 / d[1], self.DEV_RATE) * (resid - d[0])
        self.observations += 1
        self._table = None

    def _known(self) -> list[int]:
        """The sizes with enough observations for their own deviation, ascending."""
        return sorted(k for k, (_, c) in self._dev.items() if c >= self.MIN_COUNT)

    def _deviation(self, n: int, known: list[int] | None = None) -> float:
        """dev(n): the size's own where it has enough observations, else interpolated between the
        nearest sizes that have (``known``), or the nearest one's beyond them (0 while none has)."""
        if known is None:
            known = self._known()
        if not known:
            return 0.0
        i = bisect.bisect_left(known, n)
        if i < len(known) and known[i] == n:
            return self._dev[n][0]
        if i == 0:
            return self._dev[known[0]][0]
        if i == len(known):
            return self._dev[known[-1]][0]
        lo, hi = known[i - 1], known[i]
        w = (n - lo) / (hi - lo)
        return (1 - w) * self._dev[lo][0] + w * self._dev[hi][0]

    def _tabulate(self) -> list[float]:
        table, best, known = [], 0.0, self._known()
        for n in range(self.LEARN_ROWS + 1):
            best = max(best, self.profile(n) * math.exp(self._level + self._deviation(max(n, 1), known)))
            table.append(best)  # monotone, as the profile
        self._table = table
        return table

    def relative(self) -> dict[int, float]:
        """The cost of each probe size relative to one token's (online corrections included)."""
        one = self(1)
        return {n: round(self(n) / one, 3) for n in self.sizes}


CONTENDED_SHARE = 0.5  # below this share of its threads' CPU time a probe counts as contended


def measure_verify_cost(loaded, cache, sizes: tuple[int, ...] = PROBE_SIZES, repeats: int = 5) -> VerifyCost:
    """Time target forwards of each size as pending nodes on ``cache``, rolled back after: one
    untimed round that warms the kernels for every shape, then ``repeats`` rounds over all sizes
    (interleaved, so a burst of load elsewhere hits one round, not one size).  A size's time is
    the median over the rounds of its ratio to the same round's smallest size, times the smallest
    size's fastest time: the ratios are what tree sizes are chosen from, and a ratio taken within
    one round does not mix a quiet moment with a busy one.

    On the CPU the probe also compares the process's CPU time with the wall time its threads had:
    below ``CONTENDED_SHARE`` other processes held the cores, and the result is marked
    ``contended`` (kept for minutes, not a week: ``PROFILE_MAX_AGE_S``)."""
    model = loaded.model
    sizes = tuple(n for n in sizes if n <= min(cache.room(), cache.max_pending)) or (1,)
    device = loaded.device
    rounds: list[list[float]] = []
    wall = cpu = 0.0
    for r in range(repeats + 1):
        times = []
        for n in sizes:
            tokens = torch.zeros(1, n, dtype=torch.long, device=device)
            parents = [-1] + [(j - 1) // 2 for j in range(1, n)]  # a binary tree: the masked path
            synchronize(device)
            c0, t0 = process_seconds(), time.perf_counter()
            model.forward(tokens, cache, parents=parents)
            synchronize(device)
            dt = time.perf_counter() - t0
            times.append(dt)
            if r:
                wall, cpu = wall + dt, cpu + process_seconds() - c0
            cache.rollback()
        if r:
            rounds.append(times)
    base = min(t[0] for t in rounds)
    seconds = [base * statistics.median(t[i] / t[0] for t in rounds) for i in range(len(sizes))]
    share = cpu / (wall * torch.get_num_threads()) if wall > 0 else 1.0
    return VerifyCost(list(sizes), seconds, contended=device.type == "cpu" and share < CONTENDED_SHARE,
                      learn=True)


def process_seconds() -> float:
    """CPU seconds this process's threads have used (all of them)."""
    return time.process_time()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock reading covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hardware_name(device: torch.device) -> str:
    """The GPU's name, or the processor's model name (``/proc/cpuinfo``, else ``platform``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def machine_description(device: torch.device) -> str:
    """What a measured figure ran on: ``hardware_name``, and on a CPU the cores and torch threads, and
    torch's version (a bench summary's ``machine``; the results page reads the part before the
    first comma)."""
    import os

    if device.type == "cuda":
        return f"{hardware_name(device)}, torch {torch.__version__}"
    return (f"{hardware_name(device)}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}")


PROBE_VERSION = 2  # how profiles are measured (2: ratios within rounds, median of 5); older ones are measured again
PROFILE_MAX_AGE_S = 7 * 24 * 3600  # a stored profile older than this is measured again
CONTENDED_MAX_AGE_S = 600  # ... and one measured while other processes held the cores, after this


def _profile_key(loaded) -> str | None:
    """What a measured profile depends on: how it was measured (``PROBE_VERSION``), the model file,
    dtype, weight format (and the block kernel's build), attention mode, backend and the machine
    (processor or GPU, torch threads, torch version).  None for a model with no file (built
    in-process)."""
    path = getattr(loaded, "path", None)
    if path is None:
        return None
    try:
        stamp = Path(path).stat().st_mtime_ns
    except OSError:
        return None
    fmt = f"{getattr(loaded, 'weights', '')}/{getattr(loaded.model, 'attention', '')}"
    from ..models.kernel_library import build_key
    from ..models.qkernel import QLinear

    if any(isinstance(m, QLinear) for m in getattr(loaded.model, "modules", list)()):
        fmt += f"/qgemm-{build_key()}"  # a changed kernel is measured again
    return "|".join(map(str, (f"probe{PROBE_VERSION}", Path(path).resolve(), stamp, loaded.dtype, fmt, loaded.backend,
                              hardware_name(loaded.device), torch.get_num_threads(), torch.__version__)))


def _profiles_path() -> Path:
    from ..models.registry import cache_dir

    return cache_dir() / "verify_cost.json"


def _load_profile(key: str) -> VerifyCost | None:
    try:
        entry = json.loads(_profiles_path().read_text()).get(key)
        contended = bool(entry.get("contended", False)) if entry else False
        max_age = CONTENDED_MAX_AGE_S if contended else PROFILE_MAX_AGE_S
        if entry and time.time() - entry["measured_at"] < max_age:
            return VerifyCost(entry["sizes"], entry["seconds"], contended, learn=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no profile, or an unreadable one: measure again
    return None


def _profile_is_live(key: str, entry) -> bool:
    """Is a stored profile still of use: younger than ``PROFILE_MAX_AGE_S`` and of a model file
    that still exists (a test's or a deleted model's entries are dropped when a profile is stored,
    so the file does not grow for ever)."""
    parts = key.split("|")
    try:
        return time.time() - float(entry["measured_at"]) < PROFILE_MAX_AGE_S and len(parts) > 1 and Path(parts[1]).exists()
    except (TypeError, ValueError, KeyError):
        return False


def _store_profile(key: str, cost: VerifyCost) -> None:
    """Add the profile to the JSON file (written to a temporary file, then renamed); a cache
    directory that cannot be written is not an error, the profile is just measured next time."""
    path = _profiles_path()
    try:
        try:
            profiles = json.loads(path.read_text())
            if not isinstance(profiles, dict):
                profiles = {}
        except (OSError, ValueError):
            profiles = {}
        profiles = {k: v for k, v in profiles.items() if _profile_is_live(k, v)}
        profiles[key] = {"sizes": cost.sizes, "seconds": cost.seconds, "measured_at": time.time(),
                         "contended": cost.contended}
        atomic_write(path, json.dumps(profiles, indent=1))
    except OSError:
        pass


def verify_cost_for(loaded, cache) -> VerifyCost:
    """The target's verification cost.  For a model loaded from a file it is kept in
    ``<cache>/verify_cost.json`` per model and machine (re-measured after a week), so a one-shot
    CLI call does not pay the ~2 s probe each time (a contended probe: for minutes); measured on
    ``cache`` otherwise.  The runner
    (``core/runner.py``) keeps the result for the generations of its process."""
    key = _profile_key(loaded)
    cost = _load_profile(key) if key is not None else None
    if cost is None:
        cost = measure_verify_cost(loaded, cache)
        if key is not None:
            _store_profile(key, cost)
    return cost


def best_tree_size(probs: list[float], fixed_s: float, verify: VerifyCost) -> tuple[int, float]:
    """How many of the candidate nodes to verify, best first: the ``n`` that maximises
    (1 + sum of the ``n`` largest acceptance probabilities) / (``fixed_s`` + verify(n + 1)),
    i.e. expected tokens emitted per second of this step.  ``probs`` must be sorted,
    largest first.  Returns (n, rate)."""
    return _best_prefix(probs, lambda expected, rows: expected / (fixed_s + verify(rows)))


def best_tree_gain(probs: list[float], rate: float, verify: VerifyCost) -> tuple[int, float]:
    """How many of the candidate nodes to verify, best first, at a known long-run ``rate`` (tokens
    per second of the drafter's steps): the ``n`` that maximises (1 + sum of the ``n`` largest
    acceptance probabilities) - ``rate`` x verify(n + 1), the expected tokens of the step less what
    its verification's seconds earn at that rate.  This is Dinkelbach's step for a ratio ("On
    Nonlinear Fractional Programming", Dinkelbach, 1967): at the rate the current choices achieve,
    choices that maximise it do not achieve less.  Time already spent drafting the step is sunk and does
    not enter, unlike ``best_tree_size``'s step ratio, where it does: a slow draft made a larger
    tree look worth verifying.  ``probs`` must be sorted, largest first.  Returns (n, value)."""
    return _best_prefix(probs, lambda expected, rows: expected - rate * verify(rows))


def _best_prefix(probs: list[float], value) -> tuple[int, float]:
    """The ``n`` whose ``value(1 + sum of the n largest probs, n + 1 verified rows)`` is largest (the
    first on a tie), and that value."""
    best_n, best = 0, value(1.0, 1)
    expected = 1.0
    for i, p in enumerate(probs):
        expected += p
        v = value(expected, i + 2)
        if v > best:
            best_n, best = i + 1, v
    return best_n, best


class TryAgain:
    """A cut that learning alone can never revise, tried again now and then.

    A drafter that learns its acceptance from verdicts learns only about what it drafted: once its
    estimates say the next candidate is not worth a row, that candidate is never verified, so the
    estimate never moves, whatever the text does later (measured: after one early miss ``sam`` and
    ``pld`` drafted nothing for the rest of eight HumanEval problems whose matches' first tokens
    were 75% right; ``suffix``'s trie for the request's own text stopped drafting its long matches;
    ``scripts/draft_ceiling.py --replay``).  So for each slot (a context and the size the cut
    stopped at) every ``patience`` cuts the candidate after the cut is drafted too.  The patience
    starts at ``explore_after``, doubles each time that candidate has its chance and is rejected,
    and starts over when it is accepted: where it never pays, the tries are a logarithmic share of
    the steps (after a first miss at the 8th, 24th, 56th, 120th, ... cut).  A candidate that would
    not pay even if it were always accepted is never tried (``sized``)."""

    MAX_PATIENCE = 1 << 16

    def __init__(self, explore_after: int = 4) -> None:
        self.explore_after = explore_after  # 0: never
        self._state: dict = {}  # slot -> [cuts waited, patience]

    def _slot(self, slot) -> list[int]:
        return self._state.setdefault(slot, [0, self.explore_after])

    def patience(self, slot) -> int:
        return self._slot(slot)[1]

    def due(self, slot) -> bool:
        """A cut at ``slot``: is it time to draft the next candidate too?"""
        if not self.explore_after:
            return False
        state = self._slot(slot)
        state[0] += 1
        if state[0] >= state[1]:
            state[0] = 0
            return True
        return False

    def verdict(self, slot, accepted: bool) -> None:
        """The candidate after the cut at ``slot`` had its chance (its parent was accepted)."""
        if self.explore_after:
            state = self._slot(slot)
            state[1] = self.explore_after if accepted else min(2 * state[1], self.MAX_PATIENCE)

    def sized(self, probs: list[float], fixed_s: float, verify: "VerifyCost", context) -> tuple[int, float, bool]:
        """``best_tree_size`` of ``probs`` (best first), one more when the cut at slot ``(context,
        size)`` is due and that candidate would pay if it were sure.  Returns (size, the cut's rate,
        whether the last one is a try)."""
        n, rate = best_tree_size(probs, fixed_s, verify)
        if n < len(probs):
            sure = probs[:n] + [probs[n - 1] if n else 1.0]  # the next one always accepted
            if best_tree_size(sure, fixed_s, verify)[0] > n and self.due((context, n)):
                return n + 1, rate, True
        return n, rate, False


class ChainAcceptance:
    """For a model-free drafter's chain: P(the token at depth ``d`` is accepted | the tokens
    before it were), per context bucket (e.g. how long the suffix match was), learned from the
    verdicts.  Starts from ``prior`` with the weight of ``strength`` observations.  A depth the
    estimates cut off is tried again now and then (``TryAgain``: without it one rejected first
    token after a match of some length shut that length out for good)."""

    def __init__(self, n_buckets: int, max_depth: int, prior: float = 0.5, strength: float = 2.0,
                 explore_after: int = 4) -> None:
        self.max_depth = max_depth
        self.hits = [[prior * strength] * max_depth for _ in range(n_buckets)]
        self.seen = [[strength] * max_depth for _ in range(n_buckets)]
        self.tries = TryAgain(explore_after)

    def cumulative(self, bucket: int, length: int) -> list[float]:
        """P(the first ``d`` tokens are all accepted), d = 1..length."""
        out, p = [], 1.0
        for d in range(min(length, self.max_depth)):
            p *= self.hits[bucket][d] / self.seen[bucket][d]
            out.append(p)
        return out

    def update(self, bucket: int, verified: int, accepted: int) -> None:
        """``verified`` chain tokens were checked, the first ``accepted`` of them accepted."""
        for d in range(min(verified, accepted + 1, self.max_depth)):
            self.seen[bucket][d] += 1.0
            self.hits[bucket][d] += float(d < accepted)
        last = verified - 1  # the chain's last token, when it had its chance: the cut before it
        if 0 <= last < self.max_depth and accepted >= last:
            self.tries.verdict((bucket, last), accepted > last)

    def worth(self, bucket: int, length: int, verify: "VerifyCost", fixed_s: float = 0.0) -> int:
        """How many of a ``length``-token chain's tokens are worth verifying (greedy): the prefix
        that maximises expected tokens per second (``best_tree_size``), or one more when the depth
        it stops at is due to be tried again."""
        return self.tries.sized(self.cumulative(bucket, length), fixed_s, verify, bucket)[0]

    def observe_chain(self, bucket: int, verified: int, accepted_nodes: list[int]) -> None:
        """A chain drafted as tree nodes 0, 1, 2, ... had ``verified`` of them checked; the verdict
        accepted ``accepted_nodes`` (its path): learn from the leading run of chain nodes on it."""
        on_chain = 0
        for d, node in enumerate(accepted_nodes):
            if node != d:
                break
            on_chain += 1
        self.update(bucket, verified, on_chain)


class AcceptanceCalibration:
    """P(a draft node is accepted | its parent was), as a function of the drafter's probability
    of the node given its parent (a draft model's, or a retrieved continuation's frequency):
    binned frequencies, starting from the identity."""

    BINS = 10

    def __init__(self, prior: float = 2.0) -> None:
        self.hits = [prior * (b + 0.5) / self.BINS for b in range(self.BINS)]
        self.seen = [prior] * self.BINS

    def bin(self, p: float) -> int:
        return min(int(p * self.BINS), self.BINS - 1)

    def __call__(self, p: float) -> float:
        b = self.bin(p)
        return min(max(self.hits[b] / self.seen[b], 1e-4), 1.0)

    def update(self, b: int, accepted: bool) -> None:
        self.hits[b] += float(accepted)
        self.seen[b] += 1.0

    def observe_tree(self, probs: list[float], parents: list[int], accepted: list[int]) -> None:
        """Learn from a verified tree whose node ``i`` had probability ``probs[i]`` given its parent:
        every node whose parent was accepted (or is the root) had its chance."""
        ok = set(accepted)
        for node in range(min(len(parents), len(probs))):
            parent = parents[node]
            if parent < 0 or parent in ok:
                self.update(self.bin(probs[node]), node in ok)


class BatchCost:
    """Seconds of one batched target forward (``core/batch.py``'s ``step_batch``), measured online.

    A linear model of the forward's wall time in what it holds: ``items`` (sequences, each with
    its root or prompt chunk: per-sequence attention and overhead, one logits row for a root),
    ``tree_rows`` (draft nodes: a row through every layer and the LM head) and ``prefill_rows``
    (prompt-chunk tokens past a chunk's first: no LM head),

        seconds = a + b * items + c * tree_rows + e * prefill_rows,

    fitted by exponentially discounted least squares (``discount`` per observation, so it follows
    the machine's load) with a ridge pull towards a prior read off the single-sequence verification
    profile (``VerifyCost``), worth ``prior_weight`` observations per coefficient.  The pull keeps
    the coefficients defined while nothing varies: a scheduler that stops speculating stops seeing
    tree rows, and their cost then stays where it was last measured (or at the prior).

    Only load-dependent scheduling reads it (greedy and unseeded sampled tree sizes: any tree
    gives the same greedy tokens and an exact sample), never a seeded sequence's tree."""

    FEATURES = 4  # 1, items, tree_rows, prefill_rows

    def __init__(self, profile: "VerifyCost", discount: float = 0.97, prior_weight: float = 0.25) -> None:
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        one = profile(1)
        per_row = max((profile(16) - one) / 15.0, 0.02 * one)
        # one sequence, one row: a + b = verify(1); a tree row: the profile's slope per token
        self.prior = [0.5 * one, 0.5 * one, per_row, 0.7 * per_row]
        scale = [1.0, 8.0, 8.0, 64.0]  # typical feature sizes: the ridge is per observation at that size
        self._ridge = [prior_weight * s * s for s in scale]
        self.discount = discount
        n = self.FEATURES
        self._xx = [[0.0] * n for _ in range(n)]
        self._xt = [0.0] * n
        self.observations = 0
        self._coef: list[float] | None = None

    @staticmethod
    def _x(items: int, tree_rows: int, prefill_rows: int) -> list[float]:
        return [1.0, float(items), float(tree_rows), float(prefill_rows)]

    def observe(self, items: int, tree_rows: int, prefill_rows: int, seconds: float) -> None:
        """One measured forward."""
        if not (seconds > 0.0 and math.isfinite(seconds)) or items < 1:
            return
        x, g = self._x(items, tree_rows, prefill_rows), self.discount
        for i in range(self.FEATURES):
            self._xt[i] = g * self._xt[i] + x[i] * seconds
            row = self._xx[i]
            for j in range(self.FEATURES):
                row[j] = g * row[j] + x[i] * x[j]
        self.observations += 1
        self._coef = None

    def coefficients(self) -> list[float]:
        """(a, b, c, e): fixed seconds, per item, per tree row, per prefill row."""
        if self._coef is None:
            n = self.FEATURES
            m = [[self._xx[i][j] + (self._ridge[i] if i == j else 0.0) for j in range(n)]
                 + [self._xt[i] + self._ridge[i] * self.prior[i]] for i in range(n)]
            coef = _solve(m)
            self._coef = coef if coef is not None else list(self.prior)
        return self._coef

    def __call__(self, items: int, tree_rows: int = 0, prefill_rows: int = 0) -> float:
        a, b, c, e = self.coefficients()
        return max(a + b * items + self.row_seconds() * tree_rows + max(e, 0.0) * prefill_rows, 1e-6)

    def row_seconds(self) -> float:
        """The marginal seconds of one more draft row (at least a twentieth of the prior's: a row is
        never free)."""
        return max(self.coefficients()[2], 0.05 * self.prior[2])


def _solve(m: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on an augmented n x (n+1) matrix (in place)."""
    n = len(m)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-18:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][k] * out[k] for k in range(r + 1, n))) / m[r][r]
    return out
