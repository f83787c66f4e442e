"""OpenAI-compatible HTTP API over one model: ``create_app(model, ...) -> FastAPI``.

Endpoints (as OpenAI defines them): ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events ending with ``data: [DONE]``); plus ``GET /health`` and
``GET /metrics`` (Prometheus text format).

Extensions: a request may carry ``"leapdecode": {"method", "options", "draft", "tree_budget",
"top_k", "min_p", "typical_p", "repetition_penalty"}`` (``protocol.py``); every response (and
the final chunk of each streamed choice) carries ``"leapdecode": {...}`` with the method used
and its statistics (``mean_accepted``: tokens emitted per target forward, ``tokens_per_s``,
``queue_s``, ...).  Draft models are loaded at start-up only (``drafts=``); a request naming
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
from typing import Any, Iterable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.prefix_cache import PrefixCache
from ..errors import InvalidParameterError
from ..proposers.registry import DEFAULT_METHOD, method_config
from ..proposers.registry import request_limits as all_request_limits
from . import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES, DEFAULT_MEMORY_BUDGET_BYTES, MEMORY_SCOPES
from .config import DEFAULT_MAX_BODY_BYTES, ServerConfig
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


def create_app(
    model,
    default_method: str | None = None,
    default_options: dict[str, Any] | None = None,
    drafts: Mapping[str, Any] | Iterable[str] = (),
    api_key: str | Iterable[str] | None = None,
    max_queue: int = 16,
    request_timeout: float = 600.0,
    max_tokens_limit: int | None = None,
    default_max_tokens: int = 256,
    served_model_name: str | None = None,
    tree_budget: int | None = None,
    max_n: int = 16,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_batch: int = 8,
    kv_budget_bytes: int | None = None,
    speculate_under_load: bool = True,
    prefix_cache_bytes: int | None = None,
    datastores: Mapping[str, str] | None = None,
    heads: Mapping[str, str] | None = None,
    request_limits: Mapping[str, Any] | None = None,
    memory_budget_bytes: int | None = DEFAULT_MEMORY_BUDGET_BYTES,
    memory_scope: str = "key",
    metrics_public: bool = False,
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
    grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT_S,
) -> FastAPI:
    """An OpenAI-compatible app serving ``model`` (a LoadedModel) with one engine thread.

    ``default_method`` / ``default_options``: the method of requests that name none, and its
    options (validated here: an ``InvalidParameterError`` names the bad one); ``drafts``: draft
    models by name (loaded models, or names loaded now with the model's dtype and device), the
    only ones requests may use; the first is the default draft of methods that take one;
    ``max_batch``: generations decoded together (continuous batching, ``engine.py``);
    ``kv_budget_bytes``: KV-cache bytes they may reserve (default ``engine.DEFAULT_KV_BUDGET``);
    ``speculate_under_load``: size every sequence's draft tree per step from measured costs and
    its acceptance (``engine.py``; False: every generation drafts its own full tree); ``prefix_cache_bytes``: the exact prefix cache's size (0: off);
    ``max_queue``: requests that may wait for a place in the batch (more get 429); ``request_timeout``:
    seconds from arrival until the request's generation is cancelled (504);
    ``max_tokens_limit``: the largest ``max_tokens`` accepted (default: the model's context);
    ``default_max_tokens``: for chat requests without ``max_tokens`` (completions default to
    16, as OpenAI's); ``max_body_bytes``: larger request bodies get 413; ``datastores`` / ``heads``:
    name -> path of the datastores and head directories requests may name (a request names one of
    these, never a path: the server opens no file a request names).

    Tenants: ``api_key``, one key or several (each a tenant; None: no authentication);
    ``memory_scope``: whose part of the cross-request memory a request reads and feeds ("key": its
    key's, "user": its key's and its ``user`` field's, "shared": every client's; docs/server.md says
    what sharing exposes); ``memory_budget_bytes``: the byte budget of that memory, every tenant's
    together (least recently used out; None: unbounded); ``request_limits``: overrides of the most a
    request may ask of each option that sizes state or work (``proposers.registry.request_limits``:
    "METHOD.OPTION" -> bound); ``metrics_public``: /metrics answers without the key.

    Structured output: ``max_grammar_bytes``: the largest structure a request may give (its JSON
    schemas, tools' parameters, regex or grammar together; more gets 400); ``grammar_timeout``: the
    seconds a schema's check (in a child process, ``constraints/isolated.py``) and a grammar's
    compilation may each take, beside decoding (``prepare.py``).
    """
    default_method = default_method or DEFAULT_METHOD
    default_options = dict(default_options or {})
    base = {"tree_budget": tree_budget} if tree_budget is not None else {}
    method_config(default_method, {**base, **default_options})  # bad defaults fail before any draft loads
    if isinstance(drafts, str):
        drafts = [drafts]
    wanted = dict(drafts) if isinstance(drafts, Mapping) else dict.fromkeys(drafts)  # name -> loaded or None
    names = list(wanted)
    if default_options.get("draft") is not None:
        wanted.setdefault(default_options["draft"], None)
    if memory_scope not in MEMORY_SCOPES:
        raise InvalidParameterError(f"memory_scope must be one of {', '.join(MEMORY_SCOPES)}, got {memory_scope!r}")
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    runner = build_runner(model, wanted)
    runner.memory.max_bytes = memory_budget_bytes
    if prefix_cache_bytes is not None:
        runner.prefix_cache = PrefixCache(prefix_cache_bytes)
    cfg = ServerConfig(
        model_name=served_model_name or model.name,
        default_method=default_method,
        default_options=default_options,
        # the first draft loaded, named in every request's options; not the target's registered
        # pair, which methods find by themselves (runner.draft()): ``auto`` then leaves it out
        # beside a trained head, as in-process (a named draft it would keep, and pay for)
        default_draft=names[0] if names and names[0] != getattr(model, "draft_name", None) else None,
        tree_budget=tree_budget,
        api_keys=keys,
        memory_scope=memory_scope,
        metrics_public=bool(metrics_public),
        request_timeout=float(request_timeout),
        max_tokens_limit=int(max_tokens_limit or model.max_seq_len),
        default_max_tokens=int(default_max_tokens),
        max_n=int(max_n),
        max_body_bytes=int(max_body_bytes),
        max_grammar_bytes=int(max_grammar_bytes),
        grammar_timeout=float(grammar_timeout),
        files={"datastore": dict(datastores or {}), "head": dict(heads or {})},
        limits=all_request_limits(dict(request_limits or {})),
    )
    try:
        default_config = resolve_method(None, cfg.defaults(runner))
    except PydanticCustomError as e:
        raise InvalidParameterError(e.message()) from None

    metrics = Metrics()
    engine = Engine(runner, max_queue=max_queue, metrics=metrics, max_batch=max_batch,
                    kv_budget_bytes=kv_budget_bytes, speculate_under_load=speculate_under_load)
    metrics.queue_depth = lambda: engine.queue_depth
    metrics.busy = lambda: int(engine.busy)
    metrics.batch_size = lambda: engine.batch_size
    metrics.kv_cache = lambda: (engine.kv_reserved_bytes, engine.kv_budget_bytes)
    metrics.prefix_cache = runner.prefix_cache.stats
    metrics.proposer_memory = lambda: (runner.memory.nbytes, runner.memory.max_bytes or 0, len(runner.memory),
                                       runner.memory.evictions)
    preparer = Preparer(cfg, runner, limit=max_queue, retry_after=engine.retry_after)
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
