"""The engine: one worker thread that runs generations one at a time, behind a bounded queue.

torch and the model's shared KV cache are not safe to use from two threads at
once, so every ``Generation`` is built and run on the single worker thread.
Requests arrive on the asyncio event loop as ``Job`` objects (a job is one
request: its ``n`` generations run back to back and hold one slot); the worker
reports back through an ``asyncio.Queue`` of events fed with
``loop.call_soon_threadsafe``:

    ("start", i)              generation i began (its Generation was built)
    ("piece", i, text)        a piece of generation i's text
    ("done", i, result)       generation i finished (a GenerationResult)
    ("error", exception)      building or running a generation failed; nothing more follows but "end"
    ("end",)                  the job is over; the worker has let go of it

``Engine.cancel`` (client gone, request timed out) removes a waiting job from
the queue at once, or stops a running one at its next decoding step through
``Generation.cancel()``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("leapdecode.server")


class QueueFullError(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass
class GenSpec:
    """One generation: the prompt's token ids and the keyword arguments for ``Generation``."""

    prompt_ids: list[int]
    kwargs: dict[str, Any] = field(default_factory=dict)


class Job:
    def __init__(self, specs: list[GenSpec], deadline: float | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.specs = specs
        self.deadline = deadline  # time.monotonic() value, or None
        self.loop = loop or asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.enqueued_at = time.monotonic()
        self.started_at: float | None = None
        self.cancel_reason: str | None = None
        self.current = None  # the Generation running now (engine thread)
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    def emit(self, *event: Any) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel_reason = self.cancel_reason or "shutdown"

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


class Engine:
    """A worker thread over a model; ``max_queue`` jobs may wait while one runs."""

    def __init__(self, model, max_queue: int = 16, metrics=None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.model = model
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
                raise RuntimeError("the engine is shut down")
            if len(self._pending) >= self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFullError(self.retry_after())
            self.counters["submitted"] += 1
            self._pending.append(job)
            self._cv.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """Stop ``job``: drop it from the queue, or stop its generation at the next step."""
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
        with job._lock:
            if job.current is not None:
                job.current.cancel()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            pending, self._pending = list(self._pending), deque()
            running = self._running
            self._cv.notify_all()
        for job in pending:
            job.cancel_reason = "shutdown"
            job.emit("error", RuntimeError("the server is shutting down"))
            job.emit("end")
        if running is not None:
            self.cancel(running, "shutdown")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
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
            except BaseException as e:  # never let the worker die
                log.exception("engine: job failed")
                self.counters["failed"] += 1
                job.emit("error", e)
            finally:
                with self._cv:
                    self._running = None
                self._recent.append(time.monotonic() - t0)
                job.emit("end")

    def _run_job(self, job: Job) -> None:
        import torch

        from ..core.generate import Generation

        job.started_at = time.monotonic()
        for i, spec in enumerate(job.specs):
            if job.cancelled:
                return
            if job.deadline is not None and time.monotonic() > job.deadline:
                self.cancel(job, "timeout")
                return
            try:
                with torch.no_grad():
                    gen = Generation(self.model, None, prompt_ids=spec.prompt_ids, **spec.kwargs)
            except Exception as e:
                self.counters["failed"] += 1
                job.emit("error", e)
                return
            with job._lock:
                job.current = gen
                if job.cancelled:
                    gen.cancel()
            job.emit("start", i)
            try:
                with torch.no_grad():
                    for piece in gen:
                        job.emit("piece", i, piece)
                        if job.deadline is not None and time.monotonic() > job.deadline:
                            self.cancel(job, "timeout")
            except Exception as e:
                log.exception("engine: generation failed")
                self.counters["failed"] += 1
                job.emit("error", e)
                return
            finally:
                with job._lock:
                    job.current = None
            res = gen.result
            if self.metrics is not None and res is not None:
                self.metrics.observe_generation(res.stats, res.finish_reason)
            job.emit("done", i, res)
        if not job.cancelled:
            self.counters["completed"] += 1
