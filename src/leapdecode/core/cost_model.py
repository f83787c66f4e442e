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

The sizing maths that read the profile are ``core/sizing.py``'s; a batched forward's cost,
learned online, is ``core/batch_cost.py``'s.

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
from .running_mean import discounted_mean

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

    # not measured; kept as they were set with the online correction (commit 7003fe2, lab notes
    # benchmarks.md section 28, "Online correction"), the correction's tests use them
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
        self._level = discounted_mean(self._level, r - self._deviation(n), self.LEVEL_RATE)
        resid = r - self._level
        if d is None:
            self._dev[n] = [resid, 1.0]
        else:
            d[1] += 1.0
            d[0] = discounted_mean(d[0], resid, self.DEV_RATE, d[1])
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
