"""Server metrics, rendered in the Prometheus text exposition format (version 0.0.4).

Written by hand (no prometheus-client dependency).  Counters and histograms are
updated from the event loop (requests) and from the engine thread
(generations), so every update takes one lock.  ``MetricsMiddleware`` counts and
times the HTTP requests.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(**kv: str) -> str:
    if not kv:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in kv.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


def process_rss_bytes() -> int | None:
    """Resident set size of this process now (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status) -> count
        self.latency_buckets: dict[str, list[int]] = {}
        self.latency_sum: dict[str, float] = defaultdict(float)
        self.latency_count: dict[str, int] = defaultdict(int)
        self.cancelled: dict[str, int] = defaultdict(int)  # reason -> count
        self.generations: dict[str, int] = defaultdict(int)  # finish_reason -> count
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.target_forwards = 0
        self.generation_seconds = 0.0
        self.last_tokens_per_s = 0.0
        self.last_mean_accepted = 0.0
        self.steps = 0  # engine iterations (one batched target forward each)
        self.step_sequences = 0  # sum over iterations of the generations stepped
        self.last_batch = 0
        self.queue_depth = lambda: 0  # set by the app: callables reading the engine
        self.busy = lambda: 0
        self.batch_size = lambda: 0  # generations running now
        self.kv_cache = lambda: (0, 0)  # (bytes reserved by running generations, budget)
        self.prefix_cache = lambda: {}  # PrefixCache.stats()
        self.proposer_memory = lambda: (0, 0, 0, 0)  # (bytes, budget (0: none), entries, evictions)

    # ------------------------------------------------------------ updates
    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1
            b = self.latency_buckets.setdefault(endpoint, [0] * len(LATENCY_BUCKETS))
            for i, le in enumerate(LATENCY_BUCKETS):
                if seconds <= le:
                    b[i] += 1
            self.latency_sum[endpoint] += seconds
            self.latency_count[endpoint] += 1

    def observe_generation(self, stats: dict, finish_reason: str) -> None:
        with self._lock:
            self.generations[finish_reason] += 1
            n = int(stats.get("new_tokens", 0))
            self.generated_tokens += n
            self.prompt_tokens += int(stats.get("prompt_tokens", 0))
            self.target_forwards += int(stats.get("target_forwards", 0))
            self.generation_seconds += float(stats.get("wall_s", 0.0))
            if n:
                self.last_tokens_per_s = float(stats.get("tokens_per_s", 0.0))
                self.last_mean_accepted = float(stats.get("mean_accepted", 0.0))

    def observe_step(self, batch: int, stepped: int) -> None:
        """One engine iteration over ``batch`` running generations, ``stepped`` of which ran."""
        with self._lock:
            self.steps += 1
            self.step_sequences += stepped
            self.last_batch = batch

    def observe_cancel(self, reason: str) -> None:
        with self._lock:
            self.cancelled[reason] += 1

    # ------------------------------------------------------------ rendering
    def render(self) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{labels} {_fmt(value)}")

        with self._lock:
            metric("leapdecode_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [(_labels(endpoint=e, status=s), c) for (e, s), c in sorted(self.requests.items())])
            hist: list[tuple[str, float]] = []
            for e in sorted(self.latency_buckets):
                for le, c in zip(LATENCY_BUCKETS, self.latency_buckets[e]):
                    hist.append((_labels(endpoint=e, le=_fmt(le)), c))
                hist.append((_labels(endpoint=e, le="+Inf"), self.latency_count[e]))
            out.append("# HELP leapdecode_request_duration_seconds Request latency (to the last byte sent).")
            out.append("# TYPE leapdecode_request_duration_seconds histogram")
            for labels, value in hist:
                out.append(f"leapdecode_request_duration_seconds_bucket{labels} {_fmt(value)}")
            for e in sorted(self.latency_buckets):
                out.append(f"leapdecode_request_duration_seconds_sum{_labels(endpoint=e)} "
                           f"{_fmt(round(self.latency_sum[e], 6))}")
                out.append(f"leapdecode_request_duration_seconds_count{_labels(endpoint=e)} "
                           f"{self.latency_count[e]}")
            metric("leapdecode_requests_cancelled_total", "counter",
                   "Requests whose generation was cancelled, by reason (disconnect, timeout).",
                   [(_labels(reason=r), c) for r, c in sorted(self.cancelled.items())])
            metric("leapdecode_generations_total", "counter", "Finished generations by finish reason.",
                   [(_labels(finish_reason=r), c) for r, c in sorted(self.generations.items())])
            metric("leapdecode_generated_tokens_total", "counter", "Tokens generated.",
                   [("", self.generated_tokens)])
            metric("leapdecode_prompt_tokens_total", "counter", "Prompt tokens processed.",
                   [("", self.prompt_tokens)])
            metric("leapdecode_target_forwards_total", "counter", "Target-model forward passes while decoding.",
                   [("", self.target_forwards)])
            metric("leapdecode_generation_seconds_total", "counter", "Time spent generating (engine busy).",
                   [("", round(self.generation_seconds, 6))])
            tps = self.generated_tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0
            metric("leapdecode_tokens_per_second", "gauge",
                   "Decoding speed: generated tokens / generation seconds since start.", [("", round(tps, 3))])
            metric("leapdecode_last_tokens_per_second", "gauge", "Decoding speed of the last generation.",
                   [("", self.last_tokens_per_s)])
            mean_acc = self.generated_tokens / self.target_forwards if self.target_forwards else 0.0
            metric("leapdecode_mean_accepted_tokens", "gauge",
                   "Tokens emitted per target forward since start (1.0 = no speculation gain).",
                   [("", round(mean_acc, 4))])
            metric("leapdecode_last_mean_accepted_tokens", "gauge",
                   "Tokens emitted per target forward in the last generation.", [("", self.last_mean_accepted)])
        metric("leapdecode_queue_depth", "gauge", "Requests waiting for the engine.", [("", self.queue_depth())])
        metric("leapdecode_engine_busy", "gauge", "1 while the engine runs a request.", [("", self.busy())])
        metric("leapdecode_batch_size", "gauge", "Generations running in the batch now.", [("", self.batch_size())])
        with self._lock:
            metric("leapdecode_engine_steps_total", "counter", "Engine iterations (one batched forward each).",
                   [("", self.steps)])
            mean_batch = self.step_sequences / self.steps if self.steps else 0.0
            metric("leapdecode_mean_batch_size", "gauge", "Generations stepped per iteration since start.",
                   [("", round(mean_batch, 3))])
        used, budget = self.kv_cache()
        metric("leapdecode_kv_cache_bytes", "gauge", "KV-cache bytes reserved by running generations.", [("", used)])
        metric("leapdecode_kv_cache_budget_bytes", "gauge", "KV-cache bytes running generations may reserve.",
               [("", budget)])
        metric("leapdecode_kv_cache_usage_ratio", "gauge", "Reserved over budget.",
               [("", round(used / budget, 4) if budget else 0.0)])
        pc = self.prefix_cache()
        if pc:
            metric("leapdecode_prefix_cache_hits_total", "counter", "Prompt chunks reused from the prefix cache.",
                   [("", pc["hits"])])
            metric("leapdecode_prefix_cache_misses_total", "counter", "Prompt chunks looked up and computed.",
                   [("", pc["misses"])])
            metric("leapdecode_prefix_cache_hit_rate", "gauge", "Hits over lookups since start.",
                   [("", pc["hit_rate"])])
            metric("leapdecode_prefix_cache_bytes", "gauge", "Bytes of KV kept by the prefix cache.",
                   [("", pc["bytes"])])
        held, budget, entries, evictions = self.proposer_memory()
        metric("leapdecode_proposer_memory_bytes", "gauge", "Bytes of cross-request memory the methods keep "
               "(every tenant's: suffix tries, statistics, head copies).", [("", held)])
        metric("leapdecode_proposer_memory_budget_bytes", "gauge", "Their byte budget (--memory-budget-mib; 0: none).",
               [("", budget)])
        metric("leapdecode_proposer_memory_entries", "gauge", "Entries of that memory.", [("", entries)])
        metric("leapdecode_proposer_memory_evictions_total", "counter",
               "Entries dropped or shrunk to stay within the budget (least recently used first).", [("", evictions)])
        rss = process_rss_bytes()
        if rss is not None:
            metric("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", [("", rss)])
        metric("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
               [("", round(self.started, 3))])
        return "\n".join(out) + "\n"


TRACKED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class MetricsMiddleware:
    """Counts requests by endpoint and status, and times them to their last byte (ASGI middleware)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = next((p for p in TRACKED_PATHS if path == p or path.startswith(p + "/")), "other")
        t0 = time.perf_counter()
        status = {"code": 500, "done": False}

        def record() -> None:
            if not status["done"]:
                status["done"] = True
                self.metrics.observe_request(endpoint, status["code"], time.perf_counter() - t0)

        async def wrapped_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record()

        try:
            await self.app(scope, receive, wrapped_send)
        finally:
            record()  # disconnected mid-stream, or failed before responding
