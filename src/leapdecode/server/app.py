"""OpenAI-compatible HTTP API over one model: ``create_app(model, ...) -> FastAPI``.

Endpoints (as OpenAI defines them): ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events ending with ``data: [DONE]``); plus ``GET /health`` and
``GET /metrics`` (Prometheus text format).

Extensions: a request may carry ``"leapdecode": {"method", "draft", "tree_budget",
"top_k", "min_p", "typical_p", "repetition_penalty"}``; every response (and the
final chunk of each streamed choice) carries ``"leapdecode": {...}`` with the
method used and its statistics (``mean_accepted``: tokens emitted per target
forward, ``tokens_per_s``, ``queue_s``, ...).

Differences from OpenAI worth knowing: greedy decoding is ``temperature: 0``
(OpenAI's default temperature, 1, is kept); logprobs, tools, logit_bias and
presence/frequency penalties are not supported (400).  Errors are OpenAI error
objects ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InvalidParameterError, LeapdecodeError, PromptTooLongError, UnknownModelError
from .engine import Engine, GenSpec, Job, QueueFullError
from .metrics import Metrics

log = logging.getLogger("leapdecode.server")

TRACKED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


# ---------------------------------------------------------------------------- errors
class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class RequestTimeout(Exception):
    pass


def _timeout_error(timeout: float) -> ApiError:
    return ApiError(504, f"the request did not finish within the server's request timeout of {timeout:g} s "
                         "(--request-timeout); its generation was cancelled",
                    type="timeout_error", code="request_timeout")


def _engine_error(e: BaseException) -> ApiError:
    """An exception from building or running a generation, as an API error."""
    if isinstance(e, UnknownModelError):
        return ApiError(400, str(e), param="leapdecode.draft", code="model_not_found")
    if isinstance(e, PromptTooLongError):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, (LeapdecodeError, ValueError)):
        return ApiError(400, str(e))
    if isinstance(e, RuntimeError) and "shutting down" in str(e):
        return ApiError(503, str(e), type="server_error", code="shutting_down")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


# ---------------------------------------------------------------------------- config
@dataclass
class ServerConfig:
    model_name: str
    default_method: str
    draft: str | None
    tree_budget: int | None
    api_key: str | None
    request_timeout: float
    max_tokens_limit: int
    default_max_tokens: int
    max_n: int


def _default_method() -> str:
    from ..proposers import METHODS

    return "auto" if "auto" in METHODS else "vanilla"


# ---------------------------------------------------------------------------- metrics middleware
class MetricsMiddleware:
    """Counts requests by endpoint and status, and times them to their last byte."""

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


# ---------------------------------------------------------------------------- request parsing
def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt_num(body: dict, name: str, default: float, where: str = "") -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise ApiError(400, f"{where}{name} must be a number, got {json.dumps(v)}", param=f"{where}{name}")
    return v


def _opt_int(body: dict, name: str, default: int | None, where: str = "") -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ApiError(400, f"{where}{name} must be an integer, got {json.dumps(v)}", param=f"{where}{name}")
    return v


def _reject_unsupported(body: dict) -> None:
    def bad(name: str, what: str) -> None:
        raise ApiError(400, f"{name} {what} is not supported by this server", param=name, code="unsupported_parameter")

    if body.get("logprobs") not in (None, False):
        bad("logprobs", "(token log-probabilities)")
    if body.get("top_logprobs") not in (None, 0):
        bad("top_logprobs", "(token log-probabilities)")
    for name in ("tools", "functions"):
        if body.get(name):
            bad(name, "(tool calling)")
    if body.get("tool_choice") not in (None, "none"):
        bad("tool_choice", "(tool calling)")
    if body.get("logit_bias"):
        bad("logit_bias", "")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            bad(name, "(use leapdecode.repetition_penalty)")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        bad("response_format", "other than {'type': 'text'}")
    if body.get("suffix"):
        bad("suffix", "(insertion)")
    if body.get("audio") is not None or body.get("modalities") not in (None, ["text"]):
        bad("modalities", "other than text")


@dataclass
class Decoding:
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None
    seed: int | None
    kwargs: dict  # Generation keyword arguments except max_new_tokens and seed
    method: str
    draft: str | None


def _parse_decoding(body: dict, cfg: ServerConfig, model) -> Decoding:
    from ..core.sampling import SamplingParams
    from ..proposers import METHODS

    _reject_unsupported(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    n = _opt_int(body, "n", 1)
    if n < 1 or n > cfg.max_n:
        raise ApiError(400, f"n must be between 1 and {cfg.max_n}, got {n}", param="n")
    best_of = _opt_int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise ApiError(400, "best_of other than n is not supported by this server", param="best_of",
                       code="unsupported_parameter")
    max_tokens = _opt_int(body, "max_completion_tokens", None)
    max_tokens = _opt_int(body, "max_tokens", max_tokens)
    param_name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    if max_tokens is not None:
        if max_tokens < 1:
            raise ApiError(400, f"{param_name} must be >= 1, got {max_tokens}", param=param_name)
        if max_tokens > cfg.max_tokens_limit:
            raise ApiError(400, f"{param_name} is {max_tokens}, over this server's limit of {cfg.max_tokens_limit} "
                                "tokens per completion", param=param_name, code="max_tokens_exceeded")
    temperature = _opt_num(body, "temperature", 1.0)
    top_p = _opt_num(body, "top_p", 1.0)
    seed = _opt_int(body, "seed", None)

    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, "stop must be a non-empty string or an array of non-empty strings", param="stop")
        stop = stop or None

    ext = body.get("leapdecode") or {}
    if not isinstance(ext, dict):
        raise ApiError(400, "leapdecode must be an object", param="leapdecode")
    known = {"method", "draft", "tree_budget", "top_k", "min_p", "typical_p", "repetition_penalty"}
    unknown = sorted(set(ext) - known)
    if unknown:
        raise ApiError(400, f"unknown leapdecode field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}",
                       param=f"leapdecode.{unknown[0]}")
    method = ext.get("method") or cfg.default_method
    if not isinstance(method, str) or method not in METHODS:
        raise ApiError(400, f"unknown method {method!r}; choose from {', '.join(METHODS)}", param="leapdecode.method")
    draft = ext.get("draft") if ext.get("draft") is not None else cfg.draft
    if draft is not None:
        from ..models.registry import REGISTRY

        allowed = set(REGISTRY) | {cfg.draft, model.draft_name}
        if not isinstance(draft, str) or not (draft in allowed or draft.startswith("tiny-random")):
            raise ApiError(400, f"draft {draft!r} is not available on this server; use a registered model name "
                                f"({', '.join(sorted(REGISTRY))})", param="leapdecode.draft", code="model_not_found")
    tree_budget = _opt_int(ext, "tree_budget", cfg.tree_budget, "leapdecode.")
    top_k = _opt_int(ext, "top_k", 0, "leapdecode.")
    min_p = _opt_num(ext, "min_p", 0.0, "leapdecode.")
    typical_p = _opt_num(ext, "typical_p", 1.0, "leapdecode.")
    repetition_penalty = _opt_num(ext, "repetition_penalty", 1.0, "leapdecode.")
    try:
        SamplingParams(temperature, top_k, top_p, min_p, typical_p, repetition_penalty, seed)
        if tree_budget is not None and tree_budget < 1:
            raise InvalidParameterError(f"tree_budget must be an integer >= 1, got {tree_budget}")
    except InvalidParameterError as e:
        param = next((p for p in ("temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty",
                                  "tree_budget") if str(e).startswith(p)), None)
        if param in ("top_k", "min_p", "typical_p", "repetition_penalty", "tree_budget"):
            param = "leapdecode." + param
        raise ApiError(400, str(e), param=param) from None
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, typical_p=typical_p,
                  repetition_penalty=repetition_penalty, stop=stop, method=method, tree_budget=tree_budget)
    if draft is not None:
        kwargs["draft"] = draft
    return Decoding(n=n, stream=stream, include_usage=bool(so.get("include_usage")), max_tokens=max_tokens,
                    seed=seed, kwargs=kwargs, method=method, draft=draft)


def _max_new_tokens(dec: Decoding, prompt_len: int, context: int, default: int, param: str) -> int:
    room = context - prompt_len
    if dec.max_tokens is None:
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's maximum context length is "
                                f"{context} tokens (prompt + at least 1 new token)", param=param,
                           code="context_length_exceeded")
        return min(default, room)
    if prompt_len + dec.max_tokens > context:
        raise ApiError(400, f"this model's maximum context length is {context} tokens; you requested "
                            f"{prompt_len + dec.max_tokens} tokens ({prompt_len} in the prompt, {dec.max_tokens} for "
                            "the completion); reduce the prompt or max_tokens", param=param,
                       code="context_length_exceeded")
    return dec.max_tokens


def _specs(dec: Decoding, prompts: list[list[int]], max_new: list[int]) -> list[GenSpec]:
    specs = []
    for p, ids in enumerate(prompts):
        for j in range(dec.n):
            k = p * dec.n + j
            seed = dec.seed + k if dec.seed is not None else None
            specs.append(GenSpec(ids, dict(dec.kwargs, max_new_tokens=max_new[p], seed=seed)))
    return specs


def _normalize_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be one of system, developer, user, assistant; "
                                f"got {json.dumps(role)}", param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content", code="unsupported_parameter")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts",
                           param=f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


# ---------------------------------------------------------------------------- responses
def _finish(reason: str) -> str:
    return reason if reason in ("stop", "length") else "length"


def _choice_stats(res) -> dict:
    s = res.stats
    keys = ("method", "new_tokens", "target_forwards", "mean_accepted", "tokens_per_s", "wall_s", "prefill_s",
            "accept_hist")
    return {k: s[k] for k in keys if k in s}


def _leapdecode_field(dec: Decoding, job: Job, results: list) -> dict:
    results = [r for r in results if r is not None]
    tokens = sum(len(r.tokens) for r in results)
    forwards = sum(int(r.stats.get("target_forwards", 0)) for r in results)
    wall = sum(float(r.stats.get("wall_s", 0.0)) for r in results)
    out: dict[str, Any] = {
        "method": dec.method,
        "draft": dec.draft,
        "mean_accepted": round(tokens / forwards, 4) if forwards else 0.0,
        "target_forwards": forwards,
        "new_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 3) if wall > 0 else 0.0,
        "queue_s": round((job.started_at or job.enqueued_at) - job.enqueued_at, 4),
    }
    if len(results) > 1:
        out["choices"] = [_choice_stats(r) for r in results]
    return out


def _usage(prompt_lens: list[int], results: list) -> dict:
    p = sum(prompt_lens)
    c = sum(len(r.tokens) for r in results if r is not None)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------------- the app
def create_app(
    model,
    default_method: str | None = None,
    draft: str | None = None,
    api_key: str | None = None,
    max_queue: int = 16,
    request_timeout: float = 600.0,
    max_tokens_limit: int | None = None,
    default_max_tokens: int = 256,
    served_model_name: str | None = None,
    tree_budget: int | None = None,
    max_n: int = 16,
) -> FastAPI:
    """An OpenAI-compatible app serving ``model`` (a LoadedModel) with one engine thread.

    ``max_queue``: requests that may wait while one runs (more get 429);
    ``request_timeout``: seconds from arrival until the request's generation is
    cancelled (504); ``max_tokens_limit``: the largest ``max_tokens`` accepted
    (default: the model's context); ``default_max_tokens``: for chat requests
    without ``max_tokens`` (completions default to 16, as OpenAI's).
    """
    metrics = Metrics()
    engine = Engine(model, max_queue=max_queue, metrics=metrics)
    metrics.queue_depth = lambda: engine.queue_depth
    metrics.busy = lambda: int(engine.busy)
    cfg = ServerConfig(
        model_name=served_model_name or model.name,
        default_method=default_method or _default_method(),
        draft=draft,
        tree_budget=tree_budget,
        api_key=api_key,
        request_timeout=float(request_timeout),
        max_tokens_limit=int(max_tokens_limit or model.max_seq_len),
        default_max_tokens=int(default_max_tokens),
        max_n=int(max_n),
    )
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()

    app = FastAPI(title="leapdecode", description="OpenAI-compatible API for leapdecode", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.config = cfg
    app.state.model = model
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    # ------------------------------------------------------------ error handlers
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return ApiError(exc.status_code, msg, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error").response()

    # ------------------------------------------------------------ helpers
    def check_auth(request: Request) -> None:
        key = cfg.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not given or not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "Incorrect API key provided" if given else
                           "Missing API key: send it as 'Authorization: Bearer KEY'",
                           param=None, code="invalid_api_key")

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"We could not parse the JSON body of your request ({e}).",
                           code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def check_model(body: dict) -> None:
        name = body.get("model")
        if name is None:
            raise ApiError(400, "you must provide a model parameter", param="model", code="missing_required_parameter")
        if name != cfg.model_name:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{cfg.model_name}'",
                           param="model", code="model_not_found")

    def submit(specs: list[GenSpec]) -> Job:
        job = Job(specs, deadline=time.monotonic() + cfg.request_timeout)
        try:
            engine.submit(job)
        except QueueFullError as e:
            raise ApiError(429, f"the server is busy ({engine.max_queue} requests waiting); retry after "
                                f"{e.retry_after} s", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        except RuntimeError as e:
            raise _engine_error(e) from None
        return job

    async def watch_disconnect(request: Request, job: Job) -> None:
        try:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    engine.cancel(job, "disconnect")
                    job.events.put_nowait(("disconnect",))
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # the connection is gone in some other way
            return

    async def next_event(job: Job) -> tuple:
        remaining = job.remaining()
        try:
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError
            return await asyncio.wait_for(job.events.get(), timeout=remaining)
        except asyncio.TimeoutError:
            engine.cancel(job, "timeout")
            raise RequestTimeout from None

    async def run(request: Request, kind: str, dec: Decoding, prompts: list[list[int]], max_new: list[int],
                  echo: list[str] | None):
        """Submit the request's generations and answer (JSON or an SSE stream)."""
        specs = _specs(dec, prompts, max_new)
        job = submit(specs)
        prompt_lens = [len(p) for p in prompts]
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        watcher = asyncio.create_task(watch_disconnect(request, job))
        handed_over = False
        try:
            if dec.stream:
                first = await next_event(job)
                if first[0] == "error":
                    raise _engine_error(first[1])
                if first[0] == "disconnect":
                    return Response(status_code=499)
                if first[0] == "end":  # cancelled before it started
                    if job.cancel_reason == "timeout":
                        raise _timeout_error(cfg.request_timeout)
                    return Response(status_code=499)
                handed_over = True
                return StreamingResponse(
                    stream(job, watcher, first, kind, rid, now, dec, prompt_lens, echo),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            results: list = [None] * len(specs)
            while True:
                ev = await next_event(job)
                if ev[0] == "done":
                    results[ev[1]] = ev[2]
                elif ev[0] == "error":
                    raise _engine_error(ev[1])
                elif ev[0] == "disconnect":
                    return Response(status_code=499)
                elif ev[0] == "end":
                    break
            if job.cancel_reason == "timeout":
                raise _timeout_error(cfg.request_timeout)
            if job.cancelled:
                return Response(status_code=499)
            choices = []
            for k, res in enumerate(results):
                if kind == "chat":
                    choices.append({"index": k, "message": {"role": "assistant", "content": res.text},
                                    "logprobs": None, "finish_reason": _finish(res.finish_reason)})
                else:
                    text = (echo[k // dec.n] if echo else "") + res.text
                    choices.append({"index": k, "text": text, "logprobs": None,
                                    "finish_reason": _finish(res.finish_reason)})
            return JSONResponse({
                "id": rid,
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": now,
                "model": cfg.model_name,
                "system_fingerprint": None,
                "choices": choices,
                "usage": _usage(prompt_lens, results),
                "leapdecode": _leapdecode_field(dec, job, results),
            })
        except RequestTimeout:
            raise _timeout_error(cfg.request_timeout) from None
        finally:
            if not handed_over:
                watcher.cancel()
                engine.cancel(job, "disconnect")  # a no-op when the job is over

    async def stream(job: Job, watcher: asyncio.Task, ev: tuple, kind: str, rid: str, now: int, dec: Decoding,
                     prompt_lens: list[int], echo: list[str] | None):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        results: list = [None] * len(job.specs)
        extra = {"usage": None} if dec.include_usage else {}

        def chunk(k: int, content: str | None = None, finish: str | None = None, role: bool = False, **more) -> str:
            if kind == "chat":
                delta: dict = {}
                if role:
                    delta["role"] = "assistant"
                if content is not None:
                    delta["content"] = content
                choice = {"index": k, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": k, "text": content or "", "logprobs": None, "finish_reason": finish}
            return _sse({"id": rid, "object": obj, "created": now, "model": cfg.model_name,
                         "system_fingerprint": None, "choices": [choice], **extra, **more})

        over = False
        try:
            while True:
                etype = ev[0]
                if etype == "start":
                    k = ev[1]
                    if kind == "chat":
                        yield chunk(k, "", role=True)
                    elif echo:
                        yield chunk(k, echo[k // dec.n])
                elif etype == "piece":
                    yield chunk(ev[1], ev[2])
                elif etype == "done":
                    k, res = ev[1], ev[2]
                    results[k] = res
                    if res.finish_reason != "cancelled":
                        stats = _leapdecode_field(dec, job, [res])
                        yield chunk(k, None if kind == "chat" else "", _finish(res.finish_reason), leapdecode=stats)
                elif etype == "error":
                    over = True  # the engine stopped the job itself
                    yield _sse(_engine_error(ev[1]).body())
                    break
                elif etype == "end":
                    over = True
                    if job.cancel_reason == "timeout":
                        yield _sse(_timeout_error(cfg.request_timeout).body())
                    elif job.cancelled:
                        return
                    elif dec.include_usage:
                        yield _sse({"id": rid, "object": obj, "created": now, "model": cfg.model_name,
                                    "system_fingerprint": None, "choices": [], "usage": _usage(prompt_lens, results),
                                    "leapdecode": _leapdecode_field(dec, job, results)})
                    break
                elif etype == "disconnect":
                    return
                try:
                    ev = await next_event(job)
                except RequestTimeout:
                    yield _sse(_timeout_error(cfg.request_timeout).body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not over:
                engine.cancel(job, "disconnect")

    # ------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped", "model": cfg.model_name,
                             "queue_depth": engine.queue_depth, "max_queue": engine.max_queue,
                             "busy": engine.busy}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "leapdecode",
                "max_model_len": model.max_seq_len}

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        check_auth(request)
        if model_id != cfg.model_name:
            raise ApiError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        from ..core.generate import encode_prompt

        check_auth(request)
        body = await read_body(request)
        check_model(body)
        if "messages" not in body:
            raise ApiError(400, "you must provide a messages parameter", param="messages",
                           code="missing_required_parameter")
        messages = _normalize_messages(body["messages"])
        dec = _parse_decoding(body, cfg, model)
        try:
            ids = encode_prompt(model, messages)
        except InvalidParameterError as e:
            raise ApiError(400, str(e), param="messages") from None
        max_new = _max_new_tokens(dec, len(ids), model.max_seq_len, cfg.default_max_tokens, "messages")
        return await run(request, "chat", dec, [ids], [max_new], None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        from ..core.generate import encode_prompt

        check_auth(request)
        body = await read_body(request)
        check_model(body)
        if "prompt" not in body:
            raise ApiError(400, "you must provide a prompt parameter", param="prompt",
                           code="missing_required_parameter")
        prompt = body["prompt"]
        vocab = len(model.tokenizer)
        if isinstance(prompt, str):
            prompt = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise ApiError(400, "prompt must be a string, an array of strings, an array of token ids or an array "
                                "of token-id arrays", param="prompt")
        dec = _parse_decoding(body, cfg, model)
        echo_flag = body.get("echo", False)
        if not isinstance(echo_flag, bool) and echo_flag is not None:
            raise ApiError(400, "echo must be a boolean", param="echo")
        prompts: list[list[int]] = []
        texts: list[str] = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                try:
                    ids = encode_prompt(model, p, chat=False)
                except InvalidParameterError as e:
                    raise ApiError(400, str(e) if len(prompt) == 1 else f"prompt[{i}]: {e}", param="prompt") from None
                texts.append(p)
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                if any(t < 0 or t >= vocab for t in p):
                    raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
                ids = list(p)
                texts.append(model.tokenizer.decode(ids))
            else:
                raise ApiError(400, f"prompt[{i}] must be a non-empty string or an array of token ids",
                               param="prompt")
            prompts.append(ids)
        if len(prompts) * dec.n > cfg.max_n:
            raise ApiError(400, f"prompts x n must be at most {cfg.max_n}, got {len(prompts) * dec.n}", param="n")
        max_new = [_max_new_tokens(dec, len(ids), model.max_seq_len, 16, "prompt") for ids in prompts]
        return await run(request, "completion", dec, prompts, max_new, texts if echo_flag else None)

    return app
