"""The server's one configuration (``ServeConfig``): what ``leapdecode serve``'s options set, each
default written once here, built by the command line (``cli.py``), carried to every Ray Serve
replica (``settings.py``, ``ray_serve.py``) and given to ``create_app``, which resolves what depends
on the model and the runner (``resolved``) and hands the result to every part of the app: the
request validation (``protocol.py``'s context), preparation, the answers."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import InvalidParameterError
from ..proposers.registry import DEFAULT_METHOD, METHODS, request_limits
from ..request import RequestDefaults
from . import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_GRAMMAR_BYTES, \
    DEFAULT_MEMORY_BUDGET_BYTES, MEMORY_SCOPES

if TYPE_CHECKING:
    from ..core.runner import ModelRunner
    from ..models.decoder import LoadedModel


def default_drafts(model, method: str, options: dict, given: list[str] | None) -> list[str]:
    """The drafts to load: those given, else the model's registered draft when the method uses one."""
    if given:
        return list(given)
    if options.get("draft"):
        return [options["draft"]]
    if METHODS[method].uses_draft_model and model.draft_name and options.get("use_draft", True) is not False:
        return [model.draft_name]
    return []


@dataclass
class ServeConfig:
    """Everything the app is built from but the model (picklable: each Ray Serve replica builds the
    same app).  Fixed once the app is built, except where tests adjust it."""

    # decoding: the method of requests that name none, its options, every method's tree budget
    default_method: str = DEFAULT_METHOD
    default_options: dict[str, Any] = field(default_factory=dict)  # of the default method (--option)
    tree_budget: int | None = None  # --tree-budget: every method's default
    # draft models loaded at start-up (--draft), the only ones requests may use; the first is the default
    # of methods with a draft option.  None: the model's registered draft where the default method uses one
    drafts: tuple[str, ...] | None = None
    default_draft: str | None = None  # resolved: the draft named in every request's options (``resolved``)
    # name -> path of the datastores and head directories requests may name (--datastore, --head)
    datastores: dict[str, str] = field(default_factory=dict)
    heads: dict[str, str] = field(default_factory=dict)
    # "METHOD.OPTION" -> the most a request may ask (--request-limit: overrides; resolved: every bound)
    request_limits: dict[str, Any] = field(default_factory=dict)
    max_n: int = 16  # prompts x n of one request
    max_tokens_limit: int | None = None  # the largest max_tokens (None: the model's context; resolved)
    default_max_tokens: int = 256  # chat requests without max_tokens (completions: 16, as OpenAI's)
    served_model_name: str | None = None  # the model id clients use (None: the model's name; resolved)
    # tenants: each --api-key is one (none: no authentication); whose part of the cross-request memory
    # (proposer memory, prefix cache) a request uses: "key" (its API key's), "user" (its key's and its
    # ``user`` field's), or "shared" (one for every client); that memory's byte budget (None: unbounded)
    api_keys: tuple[str, ...] = ()
    memory_scope: str = "key"
    memory_budget_bytes: int | None = DEFAULT_MEMORY_BUDGET_BYTES
    metrics_public: bool = False  # /metrics answers without the key (--metrics-public)
    # the engine (engine.py): generations decoded together, requests waiting (more: 429), KV-cache bytes
    # the running ones may reserve (None: ``engine.DEFAULT_KV_BUDGET``), draft trees sized by the load
    max_batch: int = 8
    max_queue: int = 16
    kv_budget_bytes: int | None = None
    speculate_under_load: bool = True
    prefix_cache_bytes: int | None = None  # the exact prefix cache's size (None: the runner's; 0: off)
    request_timeout: float = 600.0  # seconds from arrival until a request is cancelled (504)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # a request's structures, together (--max-grammar-bytes)
    grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT_S  # seconds a schema's check, and a compile, may take

    def __post_init__(self) -> None:
        if self.memory_scope not in MEMORY_SCOPES:
            raise InvalidParameterError(f"memory_scope must be one of {', '.join(MEMORY_SCOPES)}, "
                                        f"got {self.memory_scope!r}")
        if isinstance(self.api_keys, str):
            self.api_keys = (self.api_keys,)
        if isinstance(self.drafts, str):
            self.drafts = (self.drafts,)
        self.api_keys = tuple(self.api_keys or ())
        self.drafts = None if self.drafts is None else tuple(self.drafts)

    @property
    def model_name(self) -> str:
        return self.served_model_name or ""

    @property
    def files(self) -> dict[str, dict[str, str]]:
        """Option -> {name: path}: what a request's file options (``datastore``, ``head``) may name."""
        return {"datastore": self.datastores, "head": self.heads}

    def draft_names(self, model: "LoadedModel", loaded: dict[str, Any]) -> list[str]:
        """The drafts to load by name, in order (``loaded``: those given loaded already, added last)."""
        given = list(self.drafts or ()) + [name for name in loaded if name not in (self.drafts or ())]
        if given or self.drafts is not None:
            return given
        return default_drafts(model, self.default_method, dict(self.default_options), None)

    def resolved(self, model: "LoadedModel", runner: "ModelRunner", names: list[str]) -> "ServeConfig":
        """This configuration on ``model`` with ``runner`` (the drafts ``names`` loaded on it): every
        field that defaults to the model's filled in, the drafts those loaded, every request bound."""
        return replace(
            self, default_options=dict(self.default_options), served_model_name=self.served_model_name or model.name,
            max_tokens_limit=int(self.max_tokens_limit or model.max_seq_len), drafts=tuple(runner.drafts),
            # the first draft loaded, named in every request's options; not the target's registered pair,
            # which methods find by themselves (runner.draft()): ``auto`` then leaves it out beside a
            # trained head, as in-process (a named draft it would keep, and pay for)
            default_draft=names[0] if names and names[0] != getattr(model, "draft_name", None) else None,
            request_limits=request_limits(dict(self.request_limits)))

    def request_defaults(self) -> RequestDefaults:
        """What ``request.validate_request`` fills in where a request leaves a field out."""
        every = {k: v for k, v in (("tree_budget", self.tree_budget), ("draft", self.default_draft)) if v is not None}
        return RequestDefaults(method=self.default_method, options=dict(self.default_options), temperature=1.0,
                               every_method=every)

    def scope(self, tenant: str | None, user: str | None) -> str | None:
        """The memory scope of a request from ``tenant`` (``check_auth``'s) with OpenAI's ``user``
        field ``user`` (read only under ``memory_scope="user"``); None: the one shared scope."""
        if self.memory_scope == "shared":
            return None
        owner = tenant or "anonymous"
        if self.memory_scope == "user" and user:
            return f"{owner}/user:{user}"
        return owner
