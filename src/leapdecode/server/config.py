"""The server's settings (``ServerConfig``), fixed at start-up except where tests adjust them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.runner import ModelRunner
from . import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_GRAMMAR_BYTES
from .protocol import ServerDefaults


@dataclass
class ServerConfig:
    model_name: str
    default_method: str
    default_options: dict[str, Any] = field(default_factory=dict)  # of the default method (--option)
    default_draft: str | None = None  # the first --draft: used by any method with a draft option
    tree_budget: int | None = None  # --tree-budget: every method's default
    api_keys: tuple[str, ...] = ()  # --api-key (repeatable): each key is a tenant; none: no authentication
    # whose part of the cross-request memory (proposer memory, prefix cache) a request uses: "key" (its
    # API key's), "user" (its key's and its ``user`` field's), or "shared" (one for every client)
    memory_scope: str = "key"
    metrics_public: bool = False  # /metrics answers without the key (--metrics-public)
    request_timeout: float = 600.0
    max_tokens_limit: int = 2048
    default_max_tokens: int = 256
    max_n: int = 16
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # a request's structures, together (--max-grammar-bytes)
    grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT_S  # seconds a schema's check, and a compile, may take
    files: dict[str, dict[str, str]] = field(default_factory=dict)  # option -> {name: path} (--datastore, --head)
    limits: dict[str, Any] = field(default_factory=dict)  # "METHOD.OPTION" -> the most a request may ask

    def defaults(self, runner: ModelRunner) -> ServerDefaults:
        """The validation context of a request."""
        return ServerDefaults(default_method=self.default_method, default_options=dict(self.default_options),
                              default_draft=self.default_draft, tree_budget=self.tree_budget,
                              drafts=frozenset(runner.drafts), files=self.files, max_n=self.max_n,
                              max_tokens_limit=self.max_tokens_limit, limits=self.limits)

    def scope(self, tenant: str | None, user: str | None) -> str | None:
        """The memory scope of a request from ``tenant`` (``check_auth``'s) with OpenAI's ``user``
        field ``user`` (read only under ``memory_scope="user"``); None: the one shared scope."""
        if self.memory_scope == "shared":
            return None
        owner = tenant or "anonymous"
        if self.memory_scope == "user" and user:
            return f"{owner}/user:{user}"
        return owner
