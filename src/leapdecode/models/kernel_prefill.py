"""Which path a quantized layer's prefill-sized forwards take: the batch-invariant kernel, or a bf16 copy of
its dequantized weights through oneDNN, as measured per code format on this machine (``prefill_on_dense``,
``prefill_ratios``, kept in the cache), within the memory the copies may take (``DenseBudget``).  The
measurement itself runs the torch layer (``qkernel.measure_prefill_ratio``), which passes it in.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import weakref
from typing import Callable

import torch

from ..errors import InvalidParameterError
from .kernel_library import build_key
from .kernel_pack import FORMATS
from .store import atomic_write, cache_dir, say

# Forwards of up to this many rows (decoding, tree verification: NativeCausalLM's
# INVARIANT_MAX_TOKENS is the same 64) run on the batch-invariant kernel.  Larger ones (prefill
# chunks) run, layer by layer, on the kernel or on a bf16 copy of the dequantized weights through
# oneDNN, whichever measured faster for the layer's code formats (``prefill_on_dense``): AMX bf16
# tiles beat int8 dot products; on a Zen 4 (AVX512-VNNI, no AMX) the kernel wins for 4-bit groups of
# 32 and loses for 6-bit groups of 16.
DENSE_MIN_ROWS = 64
# The bf16 copies cost 2 bytes a weight beside the kernel's ~0.6 (a 1.5B's: 3.1 GB; a 7B's: 14 GB), and
# which layers get one follows a noisy microbenchmark (``prefill_ratios``).  Measured end to end, they
# bought qwen2.5-coder-1.5b 12% on a 512-token prefill (180 -> 203 tokens/s) for 0.6 GB more at its
# peak (1.55 -> 2.13 GB), and a fresh cache's ratios once chose copies that held 2.8 GB for it and 5.8
# GB for a 3B (Xeon with AMX, 2 cores, 2026-12-06; lab notes section 52).  So no copy is kept unless
# ``LEAPDECODE_DENSE_BUDGET_MB`` grants them memory (``DenseBudget``): the memory a model takes is then
# its blocks' and its caches', predictably; a layer whose copy does not fit prefills on the kernel.
DENSE_BUDGET_ENV = "LEAPDECODE_DENSE_BUDGET_MB"
PREFILL_ENV = "LEAPDECODE_PREFILL"  # "kernel" or "dense": the prefill path without measuring
PREFILL_PROFILE_MAX_AGE_S = 7 * 24 * 3600


@functools.lru_cache(maxsize=None)
def prefill_ratios(measure: Callable[[int, int], float]) -> dict[tuple[int, int], float]:
    """Per code format (bits, group): the kernel's time over the bf16 copy's on a prefill-sized
    product (``measure(bits, group)``: ``qkernel.measure_prefill_ratio``), measured once per machine,
    build and thread count and kept for a week in ``<cache>/kernels/prefill.json``."""
    path = cache_dir() / "kernels" / "prefill.json"
    key = f"{build_key()}-torch{torch.__version__}-t{torch.get_num_threads()}"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    entry = stored.get(key) if isinstance(stored, dict) else None
    if isinstance(entry, dict) and time.time() - entry.get("time", 0) < PREFILL_PROFILE_MAX_AGE_S:
        try:
            return {tuple(int(v) for v in k.split("/")): float(r) for k, r in entry["ratios"].items()}
        except (KeyError, ValueError, AttributeError):
            pass
    ratios = {(bits, group): measure(bits, group) for bits, group in FORMATS}
    now = time.time()
    # entries past their age are never read again: dropped (one per build and thread count piled up)
    stored = {k: v for k, v in (stored.items() if isinstance(stored, dict) else ())
              if isinstance(v, dict) and isinstance(v.get("time"), (int, float))
              and now - v["time"] < PREFILL_PROFILE_MAX_AGE_S}
    stored[key] = {"time": now, "ratios": {f"{b}/{g}": round(r, 4) for (b, g), r in ratios.items()}}
    try:
        atomic_write(path, json.dumps(stored, indent=1))
    except OSError:
        pass  # a read-only cache: measured again next time
    return ratios


def prefill_on_dense(parts, measure: Callable[[int, int], float]) -> bool:
    """Whether a forward of more than ``DENSE_MIN_ROWS`` rows over these parts runs on the bf16 copy
    (faster there: e.g. AMX bf16 tiles) or on the kernel (int8 dot products faster than bf16 ones:
    e.g. a Zen 4 with AVX512-VNNI and no AMX; no bf16 copy is then built).  Decided from measured
    ratios (``prefill_ratios(measure)``), weighted by the parts' sizes; ``LEAPDECODE_PREFILL`` overrides."""
    forced = os.environ.get(PREFILL_ENV, "").strip().lower()
    if forced in ("kernel", "dense"):
        return forced == "dense"
    ratios = prefill_ratios(measure)
    size = sum(p.out_features * p.in_features for p in parts)
    return sum(p.out_features * p.in_features * ratios.get((p.bits, p.group), 1.0) for p in parts) > size


class DenseBudget:
    """The bytes of bf16 prefill copies this process may keep (``LEAPDECODE_DENSE_BUDGET_MB``, none by
    default), handed out layer by layer as each first needs its copy and given back when a layer goes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.used = 0
        self.refused = 0  # bytes of copies refused
        self._limit: int | None = None

    @property
    def limit(self) -> int:
        if self._limit is None:
            forced = os.environ.get(DENSE_BUDGET_ENV, "").strip()
            try:
                self._limit = int(float(forced) * 2**20) if forced else 0
            except ValueError:
                raise InvalidParameterError(f"{DENSE_BUDGET_ENV}={forced!r} is not a number of MiB") from None
        return self._limit

    def take(self, owner: object, nbytes: int) -> bool:
        """Reserve ``nbytes`` for ``owner`` (given back when it is collected); False where they do not fit."""
        with self._lock:
            if self.used + nbytes > self.limit:
                first = not self.refused
                self.refused += nbytes
            else:
                self.used += nbytes
                weakref.finalize(owner, self._give, nbytes)
                return True
        if first and self.limit:
            say(f"prefill runs on the int4 kernel for the layers whose bf16 copies would pass "
                f"{self.limit / 2**30:.1f} GiB ({DENSE_BUDGET_ENV})")
        return False

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


DENSE_BUDGET = DenseBudget()
