"""The engine: one worker thread that decodes the running requests together (continuous
batching), behind a bounded queue.

torch is not safe to drive from two threads at once, so every generation is built and stepped
on the single worker thread, on the server's own ``ModelRunner`` (built at start-up with its
drafts; it never loads another one).  Each iteration steps every running generation in one
batched target forward (``core/batch.py``: chunked prefill, ragged token trees, per-step tree
sizes from measured costs: ``SpeculationScheduler``); requests join between iterations when there is room in the batch and in
the KV-cache budget, and leave as soon as they finish.  Requests arrive on the asyncio event
loop as ``Job`` objects (a job is one request: its ``n`` generations run side by side); the
worker reports back through an ``asyncio.Queue`` of typed events fed with
``loop.call_soon_threadsafe``:

    Started(index)                 choice ``index`` began (its Generation or search was built)
    Delta(index, text, tokens)     one step's text and tokens
    Finished(index, result)        generation ``index`` is over (a GenerationResult)
    Failed(error, error_id)        building or running a generation failed; only Ended follows
    Ended()                        the job is over; the worker has let go of it

(the app adds ``Disconnected()`` itself when the client hangs up).  ``Engine.cancel`` (client
gone, request timed out) removes a waiting job from the queue at once, or stops a running one
at its next iteration (its cache slot is free for the next request then).

A spec whose request has a decoding strategy (``GenerationRequest.strategy``) runs a search (``strategies/search.py``)
or N parallel samples instead of a generation: every one of them is a task (``core/task.py``)
and hands its forwards to the same batched forward, one round per iteration (a beam search's
new nodes are rows of the batch beside other requests' steps; its prompt prefills inside its
first round, alone); it gives ``strategy.returns`` choices: they all start together and finish
together, at the end of the search (its hypotheses, best first).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Union

from ..api import start_request
from ..core.batch import BatchTiming, SpeculationScheduler, speculation_caps, step_batch
from ..core.runner import ModelRunner
from ..core.generate import Generation
from ..core.task import Task
from ..errors import InvalidParameterError
from ..request import GenerationRequest
from ..strategies.registry import task_kind
from .exceptions import EngineStopped, QueueFullError, RequestTooLargeError

if TYPE_CHECKING:
    from ..core.generate import GenerationResult
    from ..models.decoder import LoadedModel

log = logging.getLogger("leapdecode.server")

DEFAULT_KV_BUDGET = 4 * 2**30  # bytes of KV-cache slots the running generations may hold


# ---------------------------------------------------------------------------- events
@dataclass(frozen=True)
class Started:
    index: int


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    index: int
    result: "GenerationResult"


@dataclass(frozen=True)
class Failed:
    error: BaseException
    error_id: str | None = None  # set when the engine logged it as an internal fault


@dataclass(frozen=True)
class Ended:
    pass


@dataclass(frozen=True)
class Disconnected:
    pass


Event = Union[Started, Delta, Finished, Failed, Ended, Disconnected]


# ---------------------------------------------------------------------------- jobs
@dataclass(frozen=True)
class GenSpec:
    """One generation (or search) to run: its prompt's token ids and its validated request
    (``request.py``; its structure compiled already into its ``constraint``, this choice's own)."""

    prompt_ids: list[int]
    request: GenerationRequest

    @property
    def choices(self) -> int:
        """How many choices this spec answers (a search's ``returns``, else 1)."""
        return 1 if self.request.strategy is None else self.request.strategy.returns

    def start(self, runner: ModelRunner):
        """The generation (or search) of this spec, not started."""
        return start_request(runner, self.request, prompt_ids=self.prompt_ids)


TRIM_EVERY_S = 2.0  # at most one heap trim per this many seconds, after a request ends


def trim_heap() -> None:
    """Give the allocator's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing).  A request's KV cache and activations are freed when it ends, but the memory of
    tensors below glibc's mmap threshold stays in the process's heap, scattered among live blocks:
    in a 5-minute soak of mixed request sizes the server's resident memory kept climbing (+11.6%
    past the warm-up, its caches all within their budgets) until it was trimmed (scripts/soak.py)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: "ctypes.CDLL | bool | None" = None


class Job:
    def __init__(self, specs: list[GenSpec], deadline: float | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.specs = specs
        self.deadline = deadline  # time.monotonic() value, or None
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.enqueued_at = time.monotonic()
        self.started_at: float | None = None
        self.cancel_reason: str | None = None
        self.failed = False

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    def emit(self, event: Event) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel_reason = self.cancel_reason or "shutdown"

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


# ---------------------------------------------------------------------------- runner
def build_runner(model: "LoadedModel", drafts: Mapping[str, "LoadedModel | None"] | Iterable[str] = ()) -> ModelRunner:
    """The server's runner: drafts are added here, at start-up, and no other is ever loaded.
    ``drafts``: names, or a mapping from a name to its loaded model (``None``: load it here, with
    the target's weight format or dtype, and device: ``loader.load_draft``)."""
    from ..models.loader import load_draft

    runner = ModelRunner(model, allow_draft_loading=False)
    wanted = dict(drafts) if isinstance(drafts, Mapping) else dict.fromkeys(drafts)
    for name, loaded in wanted.items():
        runner.add_draft(name, loaded if loaded is not None else load_draft(name, model))
    return runner


# ---------------------------------------------------------------------------- the engine
@dataclass(eq=False)
class Running:
    """One task of a running job (a generation, a search, parallel samples: ``core/task.py``)."""

    job: Job
    index: int  # its (first) choice
    gen: Task
    reserved: int  # KV-cache bytes its slot holds
    choices: int = 1  # a search answers several


def kv_bytes_per_token(model: "LoadedModel", kind: str = "plain") -> int:
    """Bytes of the target's KV cache per token (all layers, keys and values); ``kind``: the cache
    kind (``"int8"`` for an int8 KV-cache policy)."""
    from ..models.kv_cache import cache_bytes_per_token

    decoder = model.model
    cfg = getattr(decoder, "cfg", None)
    if cfg is None:
        return 0
    return cache_bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, decoder.dtype, kind)


class Engine:
    """Continuous batching over a runner: up to ``max_batch`` generations run together (one
    batched target forward per iteration, ``core/batch.py``), ``max_queue`` jobs may wait.

    A job is admitted when all its generations fit: ``max_batch`` running generations and
    ``kv_budget_bytes`` of KV-cache slots (each generation's slot is reserved whole at admission:
    the prompt, ``max_tokens`` and the tree margin, so a running generation never runs out of
    cache and nothing is ever preempted; a job waits in the queue instead).  A job that could
    never fit the budget fails with ``RequestTooLargeError`` (400) at submission.

    Draft trees under load (``speculate_under_load``): ``speculation="measured"`` (the default)
    sizes every speculating generation's tree each iteration with ``core/batch.py``'s
    ``SpeculationScheduler`` (from the forward's online-measured cost, each sequence's recent
    acceptance and its proposer's measured time; a step where no draft pays is plain batched
    decoding; a seeded sampled text does not depend on its trees: drafter-invariant sampling);
    ``"profile"`` is the earlier policy (``_caps``: ``speculation_caps`` from the single-sequence
    verification profile, from batch 2 on).
    ``speculate_under_load=False``: every generation drafts its own full tree."""

    SPECULATION_MODES = ("measured", "profile")

    def __init__(self, runner: ModelRunner, max_queue: int = 16, metrics=None, max_batch: int = 8,
                 kv_budget_bytes: int | None = None, speculate_under_load: bool = True,
                 speculation: str = "measured") -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if speculation not in self.SPECULATION_MODES:
            raise InvalidParameterError(f"speculation must be one of {', '.join(self.SPECULATION_MODES)}, "
                                        f"got {speculation!r}")
        self.runner = runner
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.kv_budget_bytes = kv_budget_bytes if kv_budget_bytes is not None else DEFAULT_KV_BUDGET
        self.speculate_under_load = speculate_under_load
        self.speculation = speculation
        # the load-adaptive tree sizes (None: full trees, or the profile policy)
        self.scheduler = SpeculationScheduler(runner) if speculate_under_load and speculation == "measured" else None
        self.metrics = metrics
        tokens, kind = Generation.kv_tokens(runner.model, 1, 1)
        smallest = kv_bytes_per_token(runner.model, kind) * tokens
        if self.kv_budget_bytes < smallest:  # probe SV20 (issue 45): every request would be a 400
            raise InvalidParameterError(f"a KV-cache budget of {self.kv_budget_bytes / 2**20:.2f} MiB holds no "
                                        f"request: the smallest needs {smallest / 2**20:.2f} MiB "
                                        "(leapdecode serve --kv-budget-mib)")
        self._trimmed_at = 0.0  # time.monotonic() of the last heap trim (``_retire``)
        self._pending: deque[Job] = deque()
        self._cv = threading.Condition()
        self._running: list[Running] = []
        self._reserved = 0
        self._stop = False
        self._recent: deque[float] = deque(maxlen=32)  # durations of recent jobs (for Retry-After)
        self.counters = {"submitted": 0, "rejected": 0, "completed": 0, "cancelled": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="leapdecode-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ event-loop side
    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def batch_size(self) -> int:
        """Generations running now."""
        return len(self._running)

    @property
    def kv_reserved_bytes(self) -> int:
        return self._reserved

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def retry_after(self) -> int:
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        waves = (self.queue_depth + 1) / max(1, self.max_batch)
        return int(min(60, max(1, math.ceil(mean * waves))))

    def reservation(self, spec: GenSpec) -> int:
        """KV-cache bytes a spec's task holds: its kind says how many tokens of which cache kind
        (``Task.kv_tokens``: a generation's slot, a KV-cache policy's smaller one, int8 with fewer
        bytes a token; a search's tree; N parallel samples' slots)."""
        request = spec.request
        tokens, kind = task_kind(request.strategy).kv_tokens(self.runner.model, len(spec.prompt_ids),
                                                             request.max_new_tokens, strategy=request.strategy,
                                                             kv_policy=request.kv_policy)
        return kv_bytes_per_token(self.runner.model, kind) * tokens

    def submit(self, job: Job) -> None:
        need = sum(self.reservation(s) for s in job.specs)
        if need > self.kv_budget_bytes:
            raise RequestTooLargeError(
                f"the request needs {need / 2**20:.0f} MiB of KV cache (prompt + max_tokens, times n); "
                f"this server's budget is {self.kv_budget_bytes / 2**20:.0f} MiB: ask for fewer tokens")
        with self._cv:
            if self._stop:
                raise EngineStopped("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFullError(self.retry_after(), self.max_queue)
            self.counters["submitted"] += 1
            self._pending.append(job)
            self._cv.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Stop ``job``: drop it from the queue, or stop its generations before their next step."""
        with self._cv:
            if job.cancelled:
                return
            job.cancel_reason = reason
            try:
                self._pending.remove(job)
                queued = True
            except ValueError:
                queued = False
            if queued or any(r.job is job for r in self._running):
                self.counters["cancelled"] += 1
                if self.metrics is not None:
                    self.metrics.observe_cancel(reason)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            pending, self._pending = list(self._pending), deque()
            running = {r.job for r in self._running}
            self._cv.notify_all()
        for job in pending:
            job.cancel_reason = "shutdown"
            job.emit(Failed(EngineStopped("the server is shutting down")))
            job.emit(Ended())
        for job in running:
            self.cancel(job, "shutdown")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        import torch

        while True:
            with self._cv:
                while not self._pending and not self._running and not self._stop:
                    self._cv.wait()
                if self._stop and not self._running:
                    return
                admitted = self._admit()
            for job in admitted:
                self._start(job)
            if self._running:
                try:
                    with torch.no_grad():
                        self._iterate()
                except Exception as e:  # a fault of the engine itself: fail what runs, never die
                    self._fail_running(e)

    def _admit(self) -> list[Job]:
        """Jobs from the head of the queue that fit now (called under the lock)."""
        out = []
        while self._pending and not self._stop:
            job = self._pending[0]
            need = sum(self.reservation(s) for s in job.specs)
            n = len(self._running) + sum(len(j.specs) for j in out)
            fits = n + len(job.specs) <= self.max_batch and self._reserved + need <= self.kv_budget_bytes
            if not fits and (n or out):
                break  # wait for running generations to finish (FIFO: no overtaking)
            self._pending.popleft()
            self._reserved += need
            out.append(job)
        return out

    def _start(self, job: Job) -> None:
        """Build the job's generations (no forward yet) and add them to the running set."""
        from .errors import report_internal

        job.started_at = time.monotonic()
        built: list[Running] = []
        try:
            index = 0
            for spec in job.specs:
                built.append(Running(job, index, spec.start(self.runner), self.reservation(spec), spec.choices))
                index += spec.choices
        except Exception as e:
            with self._cv:
                self._reserved -= sum(self.reservation(s) for s in job.specs)  # what _admit reserved
            for r in built:
                r.gen.close()
            self._fail(job, e, report_internal(e))
            return
        with self._cv:
            self._running.extend(built)
        for r in built:
            for j in range(r.choices):
                job.emit(Started(r.index + j))

    def _fail_running(self, error: BaseException) -> None:
        from .errors import report_internal

        error_id = report_internal(error)
        with self._cv:
            running, self._running = self._running, []
            self._reserved -= sum(r.reserved for r in running)
        for r in running:
            r.gen.abort()
        for job in {r.job: None for r in running}:
            if not job.failed:
                job.failed = True
                self._fail(job, error, error_id)

    def _fail(self, job: Job, error: BaseException, error_id: str | None) -> None:
        self.counters["failed"] += 1
        job.emit(Failed(error, error_id))
        self._end(job)

    def _end(self, job: Job) -> None:
        self._recent.append(time.monotonic() - (job.started_at or job.enqueued_at))
        if not job.cancelled and not job.failed:
            self.counters["completed"] += 1
        job.emit(Ended())

    def _iterate(self) -> None:
        """One batched step of every running generation."""
        from .errors import report_internal

        running = list(self._running)  # generations, searches and parallel samples alike (core/task.py)
        for r in running:
            if r.job.past_deadline():
                self.cancel(r.job, "timeout")
            if r.job.cancelled:
                r.gen.cancel()  # its next step finishes it as "cancelled"
        if not running:
            return
        gens = [r.gen for r in running]
        timing = None
        if self.scheduler is not None:
            caps, timing = self.scheduler.plan(gens), BatchTiming()
        else:
            caps = self._caps(running) if self.speculate_under_load and len(running) > 1 else None
        outcomes = step_batch(gens, caps, timing=timing)
        if self.scheduler is not None:
            self.scheduler.record(gens, outcomes, timing)
        if self.metrics is not None:
            self.metrics.observe_step(len(running), sum(1 for o in outcomes if o.output is not None))
        done: list[Running] = []
        for r, o in zip(running, outcomes):
            if o.error is not None:
                done.extend(x for x in running if x.job is r.job and x not in done)
                if not r.job.failed:
                    r.job.failed = True
                    for x in running:
                        if x.job is r.job and x is not r:
                            x.gen.close()
                    self._fail(r.job, o.error, report_internal(o.error))
                continue
            out = o.output
            if out is None or r.job.failed:
                continue
            if out.text or out.tokens:
                r.job.emit(Delta(r.index, out.text, tuple(out.tokens)))
            if out.finished:
                done.append(r)
                res = r.gen.result
                if self.metrics is not None and res is not None:
                    self.metrics.observe_generation(res.stats, res.finish_reason)
                for j, one in enumerate(r.gen.choice_results(r.choices)):
                    if not r.gen.streams and (one.text or one.tokens):  # a search's choices, decided at its end
                        r.job.emit(Delta(r.index + j, one.text, tuple(one.tokens)))
                    r.job.emit(Finished(r.index + j, one))
        self._retire(done)

    def _retire(self, done: list[Running]) -> None:
        """Take finished generations or searches out of the batch, give their KV budget back, and
        end each job none of whose parts still runs."""
        if not done:
            return
        with self._cv:
            for r in done:
                if r in self._running:
                    self._running.remove(r)
                    self._reserved -= r.reserved
            ended = {r.job for r in done if not any(x.job is r.job for x in self._running)}
        for job in ended:
            if not job.failed:
                self._end(job)
        if ended and time.monotonic() - self._trimmed_at > TRIM_EVERY_S:
            self._trimmed_at = time.monotonic()
            trim_heap()

    def _caps(self, running: list[Running]) -> list[int | None] | None:
        """The ``"profile"`` policy (see the class): draft tokens per speculating generation this
        iteration (``speculation_caps``).  Any tree keeps a greedy text, a seeded sampled text
        (drafter-invariant sampling) and an unseeded sample's distribution."""
        gens = [r.gen for r in running]
        capped = [g.proposer is not None and g.decoding for g in gens]
        if not any(capped):
            return None
        # measured once (or read from the profile store) on a cache with nothing pending
        cost = self.runner.verify_cost(next(g for g, c in zip(gens, capped) if c).cache)
        accept = [g.draft_acceptance if c else None for g, c in zip(gens, capped)]
        # rows that are not capped drafts: every root, and a full tree for a speculator not decoding yet
        fixed = sum(1 if c or g.proposer is None else 1 + g.tree_budget for g, c in zip(gens, capped))
        caps = speculation_caps(accept, [g.tree_budget for g in gens], fixed, cost)
        return [cap if c else None for cap, c in zip(caps, capped)]
