"""The engine: one worker thread that runs generations one at a time, behind a bounded queue.

torch is not safe to drive from two threads at once, so every generation is built and stepped
on the single worker thread, on the server's own ``ModelRunner`` (built at start-up with its
drafts; it never loads another one).  Requests arrive on the asyncio event loop as ``Job``
objects (a job is one request: its ``n`` generations run back to back and hold one slot); the
worker reports back through an ``asyncio.Queue`` of typed events fed with
``loop.call_soon_threadsafe``:

    Started(index)                 generation ``index`` began (its Generation was built)
    Delta(index, text, tokens)     one step's text and tokens
    Finished(index, result)        generation ``index`` is over (a GenerationResult)
    Failed(error, error_id)        building or running a generation failed; only Ended follows
    Ended()                        the job is over; the worker has let go of it

(the app adds ``Disconnected()`` itself when the client hangs up).  ``Engine.cancel`` (client
gone, request timed out) removes a waiting job from the queue at once, or stops a running one
before its next ``Generation.step()``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Union

from ..api import start_generation
from ..core.config import MethodConfig
from ..core.runner import ModelRunner
from ..core.sampling import SamplingParams
from .exceptions import EngineStopped, QueueFullError

if TYPE_CHECKING:
    from ..core.generate import GenerationResult
    from ..models.decoder import LoadedModel

log = logging.getLogger("leapdecode.server")


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
    """One generation, validated: what ``start_generation`` takes."""

    prompt_ids: list[int]
    max_new_tokens: int
    method: MethodConfig
    sampling: SamplingParams
    stop: list[str] | None = None

    def start(self, runner: ModelRunner):
        return start_generation(runner, prompt_ids=self.prompt_ids, max_new_tokens=self.max_new_tokens,
                                method=self.method, stop=self.stop, **self.sampling.as_dict())


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
class Engine:
    """A worker thread over a runner; ``max_queue`` jobs may wait while one runs."""

    def __init__(self, runner: ModelRunner, max_queue: int = 16, metrics=None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.runner = runner
        self.max_queue = max_queue
        self.metrics = metrics
        self._pending: deque[Job] = deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
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
        return self._running is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def retry_after(self) -> int:
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return int(min(60, max(1, math.ceil(mean * (self.queue_depth + 1)))))

    def submit(self, job: Job) -> None:
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
        """Stop ``job``: drop it from the queue, or stop its generation before the next step."""
        with self._cv:
            if job.cancelled:
                return
            job.cancel_reason = reason
            try:
                self._pending.remove(job)
                queued = True
            except ValueError:
                queued = False
            if queued or self._running is job:
                self.counters["cancelled"] += 1
                if self.metrics is not None:
                    self.metrics.observe_cancel(reason)

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            pending, self._pending = list(self._pending), deque()
            running = self._running
            self._cv.notify_all()
        for job in pending:
            job.cancel_reason = "shutdown"
            job.emit(Failed(EngineStopped("the server is shutting down")))
            job.emit(Ended())
        if running is not None:
            self.cancel(running, "shutdown")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        from .errors import report_internal

        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = self._pending.popleft()
                self._running = job
            t0 = time.monotonic()
            try:
                self._run_job(job)
            except Exception as e:  # never let the worker die
                self.counters["failed"] += 1
                job.emit(Failed(e, report_internal(e)))
            finally:
                with self._cv:
                    self._running = None
                self._recent.append(time.monotonic() - t0)
                job.emit(Ended())

    def _run_job(self, job: Job) -> None:
        import torch

        job.started_at = time.monotonic()
        for i, spec in enumerate(job.specs):
            if job.cancelled:
                return
            if job.past_deadline():
                self.cancel(job, "timeout")
                return
            with torch.no_grad():
                gen = spec.start(self.runner)
            job.emit(Started(i))
            try:
                with torch.no_grad():
                    while True:
                        if job.past_deadline():
                            self.cancel(job, "timeout")
                        if job.cancelled:
                            gen.cancel()  # the next step finishes it as "cancelled"
                        out = gen.step()
                        if out.text or out.tokens:
                            job.emit(Delta(i, out.text, tuple(out.tokens)))
                        if out.finished:
                            break
            finally:
                gen.close()  # the KV cache goes back to the runner, whatever happened
            res = gen.result
            if self.metrics is not None and res is not None:
                self.metrics.observe_generation(res.stats, res.finish_reason)
            job.emit(Finished(i, res))
        if not job.cancelled:
            self.counters["completed"] += 1
