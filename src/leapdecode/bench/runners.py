"""Runners: leapdecode's methods and the peer systems (``bench/peers/``) behind one interface.

``runner.run(prompt_ids, max_new_tokens, temperature, seed, structure) -> RunOutput``: decode from
the given prompt token ids (under ``structure``, ``compile_constraint``'s keywords, when given) (every
runner gets the same ids, so token ids can be compared with vanilla's) and report the generated ids
without the end-of-sequence token, the wall time of the whole call, the target's forward passes where
known, and the peak resident memory sampled during the call.  ``LeapdecodeRunner`` is a row of one of
leapdecode's methods; the peers' runners are in ``bench/peers/``.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..core.cost_model import synchronize
from ..errors import InvalidParameterError

PLD_TOKENS = 10  # prompt-lookup draft length of the HF and llama.cpp peers
RSS_INTERVAL_S = 0.005


@dataclass
class RunOutput:
    tokens: list[int]
    wall_s: float
    target_forwards: int | None = None
    text: str = ""
    finish_reason: str = ""
    peak_rss_mb: float | None = None
    peak_gpu_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    constraint_s: float | None = None  # time in the grammar engine (structured runs)

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)


class SkipPeer(Exception):
    """A peer that cannot run here; the message says why (and how to add it)."""


# --------------------------------------------------------------------------- memory
def _rss_reader() -> Callable[[], int] | None:
    """A cheap function giving this process's resident set size in bytes."""
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY)

        def read_statm() -> int:
            return int(os.pread(fd, 128, 0).split()[1]) * page

        read_statm()
        return read_statm
    except (OSError, AttributeError, ValueError, IndexError):
        pass
    try:
        import psutil

        proc = psutil.Process()
        return lambda: proc.memory_info().rss
    except ImportError:
        return None


_READ_RSS = _rss_reader()


class PeakMemory:
    """Peak resident set size of this process while the ``with`` block runs.

    A thread samples RSS every ``RSS_INTERVAL_S`` (``/proc/self/statm``, else psutil):
    ``getrusage``'s ``ru_maxrss`` is a high-water mark for the whole process, so it
    cannot tell the runs apart.  Where neither is available, ``ru_maxrss`` is reported.
    The figure is the whole process's (all loaded models included), not the run's
    increment.  On CUDA the peak allocated GPU memory of the run is recorded too."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.peak_rss_mb: float | None = None
        self.peak_gpu_mb: float | None = None

    def __enter__(self) -> "PeakMemory":
        self._stop = threading.Event()
        self._peak = _READ_RSS() if _READ_RSS else 0
        if _READ_RSS is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def _sample(self) -> None:
        while not self._stop.wait(RSS_INTERVAL_S):
            try:
                self._peak = max(self._peak, _READ_RSS())
            except Exception:  # pragma: no cover - keep the bench running
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if _READ_RSS is not None:
            self._thread.join()
            self._peak = max(self._peak, _READ_RSS())
            self.peak_rss_mb = round(self._peak / 2**20, 1)
        else:
            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_rss_mb = round((kb if sys.platform != "darwin" else kb / 1024) / 1024, 1)
        if self.device is not None and self.device.type == "cuda":
            self.peak_gpu_mb = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)


# --------------------------------------------------------------------------- runners
class Runner:
    name = "runner"
    system = "leapdecode"

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
            seed: int | None = None, structure: dict | None = None) -> RunOutput:
        with PeakMemory(self.device) as mem:
            synchronize(self.device)
            t0 = time.perf_counter()
            out = self._run(prompt_ids, max_new_tokens, temperature, seed, structure)
            synchronize(self.device)
            out.wall_s = time.perf_counter() - t0
        out.peak_rss_mb, out.peak_gpu_mb = mem.peak_rss_mb, mem.peak_gpu_mb
        return out

    def _run(self, prompt_ids, max_new_tokens, temperature, seed, structure) -> RunOutput:  # pragma: no cover
        raise NotImplementedError

    def mark(self) -> Any:
        """What the runner has learned from earlier requests' text, for ``rewind``; None where it
        cannot be put back (a peer's server)."""
        return None

    def rewind(self, mark: Any) -> None:
        """Forget the text of the requests since ``mark``: a repeat of a request, and the first timed
        run of the warm-up's prompt, never draft from that request's own earlier output."""

    def close(self) -> None:
        pass


def split_method_row(text: str) -> tuple[str, dict]:
    """A bench row ``METHOD`` or ``METHOD:KEY=VALUE:KEY=VALUE`` (e.g. ``pld:cost_aware=false``, a
    method with options, so that two settings of one method compare in one run) -> (method, typed
    options); ``InvalidParameterError`` names an unknown method or a bad option."""
    from ..core.config import parse_option_assignments
    from ..proposers import METHODS, method_config

    base, *pairs = [p.strip() for p in text.split(":")]
    if base not in METHODS:
        raise InvalidParameterError(f"unknown method {base!r}; choose from {', '.join(METHODS)}")
    try:
        opts = parse_option_assignments(METHODS[base].config, pairs)
        method_config(base, opts)
    except InvalidParameterError as e:
        raise InvalidParameterError(f"--methods row {text!r}: {e}") from None
    return base, opts


class LeapdecodeRunner(Runner):
    """One of leapdecode's methods on the loaded target."""

    system = "leapdecode"

    def __init__(self, loaded, method: str, draft: str | None = None, tree_budget: int | None = None,
                 options: dict | None = None, drafts: dict | None = None) -> None:
        """``drafts``: draft models already loaded by other rows (name -> LoadedModel), shared so
        that each draft loads once per bench; this row adds the ones it loads.  A row loads a draft
        only when its method builds one (at its first run: the warm-up), so ``auto`` with a trained
        head, which leaves the registered draft out, never loads it."""
        from ..core.runner import ModelRunner
        from ..proposers import method_config, method_spec

        super().__init__(loaded.device)
        self.loaded, self.name = loaded, method  # the row's label: ``METHOD`` or ``METHOD:KEY=VALUE...``
        if ":" in method:
            method, row_opts = split_method_row(method)
            options = {**row_opts, **(options or {})}
        self.method = method
        opts = dict(options or {})
        fields = method_spec(method).config.option_names()
        if draft is not None and "draft" in fields:
            opts.setdefault("draft", draft)
        if tree_budget is not None:
            opts.setdefault("tree_budget", tree_budget)
        self.config = method_config(method, opts)
        # one runner per bench row: each method learns across the bench's prompts, as in a process
        # that serves one method, without sharing what it learns with the other rows
        self.runner = ModelRunner(loaded, prefix_cache_bytes=0)  # every run prefills its prompt
        self.shared_drafts = drafts if drafts is not None else {}

    def mark(self) -> Any:
        return self.runner.memory.snapshot()

    def rewind(self, mark: Any) -> None:
        self.runner.memory.restore(mark)

    def _run(self, prompt_ids, max_new_tokens, temperature, seed, structure) -> RunOutput:
        from ..api import start_generation

        have = self.runner.drafts
        for name, d in self.shared_drafts.items():  # loaded by another row
            if name not in have:
                self.runner.add_draft(name, d)
        gen = start_generation(self.runner, prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed, method=self.config, **(structure or {}))
        self.shared_drafts.update(self.runner.drafts)  # what this row's method loaded, for the next rows
        res = gen.run()
        return RunOutput(tokens=list(res.tokens), wall_s=0.0, target_forwards=res.stats.get("target_forwards"),
                         text=res.text, finish_reason=res.finish_reason, extra={"stats": res.stats},
                         constraint_s=res.stats.get("constraint_s"))


def strip_eos(ids: list[int], eos: set[int]) -> tuple[list[int], str]:
    """``ids`` up to the first end-of-sequence token, and the finish reason (``stop`` or ``length``)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i], "stop"
    return ids, "length"
