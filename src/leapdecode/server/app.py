"""OpenAI-compatible HTTP API over one model: ``create_app(model, ServeConfig(...)) -> FastAPI``.

Endpoints (as OpenAI defines them): ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events ending with ``data: [DONE]``); plus ``GET /health`` and
``GET /metrics`` (Prometheus text format).

Extensions: a request may carry ``"leapdecode": {"method", "options", "draft", "tree_budget",
"top_k", "min_p", "typical_p", "repetition_penalty"}`` (``protocol.py``); every response (and
the final chunk of each streamed choice) carries ``"leapdecode": {...}`` with the method used
and its statistics (``mean_accepted``: tokens emitted per target forward, ``tokens_per_s``,
``queue_s``, ...).  Draft models are loaded at start-up only (``ServeConfig.drafts``); a request naming
another gets a 400.

Differences from OpenAI worth knowing: greedy decoding is ``temperature: 0``
(OpenAI's default temperature, 1, is kept); logprobs, logit_bias, the deprecated
``functions`` and presence/frequency penalties are not supported (400).  Tools
(``tools``, ``tool_choice``) work where the model's chat template reads ``tools``, in the
Hermes ``<tool_call>`` format (``tools.py``); ``parallel_tool_calls`` defaults to one call.
Errors are OpenAI error objects ``{"error": {"message", "type", "param", "code"}}``
(``errors.py``).

Where things are: ``protocol.py`` (request and response models), ``prepare.py`` (body limit,
validation and tokenization, off the event loop), ``engine.py`` (the worker thread and its
queue), ``respond.py`` (JSON and streamed answers), ``errors.py`` (exception -> status).
"""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.prefix_cache import PrefixCache
from ..errors import InvalidParameterError
from ..proposers.registry import method_config
from .config import ServeConfig
from .engine import Engine, build_runner
from .errors import ApiError, api_error
from .metrics import Metrics, MetricsMiddleware
from .prepare import Kind, Preparer, check_json_body, read_body
from .protocol import ModelCard, ModelList, resolve_method
from .respond import answer


class ApiRoute(APIRoute):
    """Routes answer every exception themselves, through the status table (``errors.api_error``)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except Exception as e:
                return api_error(e).response()

        return route


def check_auth(request: Request, api_keys: tuple[str, ...]) -> str | None:
    """The tenant a request comes from (``key-N``: the N-th ``--api-key``, counted from 1), or a 401;
    None when the server has no key.  Every key is compared, in constant time, whichever matches."""
    if not api_keys:
        return None
    header = request.headers.get("authorization", "")
    given = header[7:].strip() if header[:7].lower() == "bearer " else ""
    matched = [hmac.compare_digest(given.encode(), key.encode()) for key in api_keys]
    if not given or not any(matched):
        raise ApiError(401, "Incorrect API key provided" if given else
                       "Missing API key: send it as 'Authorization: Bearer KEY'", code="invalid_api_key")
    return f"key-{matched.index(True) + 1}"


def create_app(model, config: ServeConfig | None = None, drafts: Mapping[str, Any] | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``model`` (a LoadedModel) with one engine thread, as
    ``config`` says (``config.ServeConfig``; its fields say what each one does).  ``drafts``: draft
    models loaded already, by name (added after ``config.drafts``, which are loaded now with the
    model's dtype and device); requests may use only the drafts loaded here.  A bad default method
    or option is an ``InvalidParameterError`` naming it, before any draft loads."""
    config = config or ServeConfig()
    base = {"tree_budget": config.tree_budget} if config.tree_budget is not None else {}
    method_config(config.default_method, {**base, **config.default_options})  # before any draft loads
    loaded = dict(drafts or {})
    names = config.draft_names(model, loaded)
    wanted = {name: loaded.get(name) for name in names}  # name -> loaded or None
    if config.default_options.get("draft") is not None:
        wanted.setdefault(config.default_options["draft"], None)
    runner = build_runner(model, wanted)
    cfg = config.resolved(model, runner, names)
    runner.memory.max_bytes = cfg.memory_budget_bytes
    if cfg.prefix_cache_bytes is not None:
        runner.prefix_cache = PrefixCache(cfg.prefix_cache_bytes)
    try:
        default_config = resolve_method(None, cfg)
    except PydanticCustomError as e:
        raise InvalidParameterError(e.message()) from None

    metrics = Metrics()
    engine = Engine(runner, max_queue=cfg.max_queue, metrics=metrics, max_batch=cfg.max_batch,
                    kv_budget_bytes=cfg.kv_budget_bytes, speculate_under_load=cfg.speculate_under_load)
    metrics.queue_depth = lambda: engine.queue_depth
    metrics.busy = lambda: int(engine.busy)
    metrics.batch_size = lambda: engine.batch_size
    metrics.kv_cache = lambda: (engine.kv_reserved_bytes, engine.kv_budget_bytes)
    metrics.prefix_cache = runner.prefix_cache.stats
    metrics.proposer_memory = lambda: (runner.memory.nbytes, runner.memory.max_bytes or 0, len(runner.memory),
                                       runner.memory.evictions)
    preparer = Preparer(cfg, runner, limit=cfg.max_queue, retry_after=engine.retry_after)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()
        preparer.close()

    app = FastAPI(title="leapdecode", description="OpenAI-compatible API for leapdecode", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.router.route_class = ApiRoute
    app.state.engine, app.state.metrics, app.state.config = engine, metrics, cfg
    app.state.model, app.state.runner, app.state.default_config = model, runner, default_config
    app.state.preparer = preparer
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code in (404, 405) \
            else str(exc.detail)
        return ApiError(exc.status_code, msg, code=code, headers=getattr(exc, "headers", None)).response()

    def model_card() -> ModelCard:
        return ModelCard(id=cfg.model_name, created=created, max_model_len=model.max_seq_len)

    async def complete(request: Request, kind: Kind):
        tenant = check_auth(request, cfg.api_keys)
        check_json_body(request)
        raw = await read_body(request, cfg.max_body_bytes)
        prep = await preparer(kind, raw)
        prep = prep.scoped(cfg.scope(tenant, prep.request.user))
        return await answer(request, engine, prep, cfg)

    # ------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped", "model": cfg.model_name,
                             "queue_depth": engine.queue_depth, "max_queue": engine.max_queue,
                             "busy": engine.busy}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def get_metrics(request: Request):
        if not cfg.metrics_public:  # request counts and memory are the server's business (probe N-AUTH7)
            check_auth(request, cfg.api_keys)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_auth(request, cfg.api_keys)
        return ModelList(data=[model_card()]).model_dump(mode="json")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        check_auth(request, cfg.api_keys)
        if model_id != cfg.model_name:
            raise ApiError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card().model_dump(mode="json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "completion")

    return app
