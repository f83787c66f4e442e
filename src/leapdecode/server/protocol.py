"""The wire format: OpenAI request and response models (pydantic), and the ``leapdecode`` extension.

Requests are validated with ``Model.model_validate(body, context=config)``: the server's
configuration (``config.ServeConfig``, resolved by ``create_app``) carries what validation needs to
know about it (its default method and options, the drafts loaded at start-up, its limits).  Every validation error is a pydantic
``ValidationError`` whose first error names the field (``errors.py`` turns it into a 400 with
``param`` set): the field's location (``messages[0].role``, ``leapdecode.top_k``), or, for an
error found across fields (a method option), ``ctx["param"]`` (``leapdecode.options.k``).

Error types raised here (``PydanticCustomError``):

* ``ld_field``: the message follows the field's name (``"max_tokens" + " must be an integer..."``);
* ``ld_verbatim``: the message is complete as it is (it names the field itself);
* ``unsupported_parameter``: an OpenAI parameter this server does not implement.

``ctx`` may also carry ``code`` (the OpenAI error code) and ``param`` (overrides the location).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, PrivateAttr, SerializerFunctionWrapHandler, \
    ValidationInfo, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from ..core.config import MethodConfig
from ..core.prompt import CHAT_ROLES
from ..core.kv_policy import KVPolicy
from ..core.sampling import SamplingParams
from ..errors import InvalidParameterError
from ..proposers.registry import check_request_limits
from ..request import GenerationRequest, RequestError, validate_request
from ..strategies.registry import StrategyConfig
from .config import ServeConfig
from .tools import NAME_RE, NO_PARAMETERS, Tool, ToolCalling


# ---------------------------------------------------------------------------- server context
# method options whose value is a path on the server: a request picks one of the names given at start-up
# (``serve --datastore NAME=PATH``, ``--head NAME=PATH``), never a path (issue 45: a request must not make
# the server open a file it names)
FILE_OPTIONS = ("datastore", "head")


def _defaults(info: ValidationInfo) -> ServeConfig:
    return info.context if isinstance(info.context, ServeConfig) else ServeConfig()


# ---------------------------------------------------------------------------- errors and scalar types
def verbatim(message: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError("ld_verbatim", "{message}", {"message": message, **ctx})


def _shown(v: Any) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(v: Any) -> int:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise PydanticCustomError("ld_field", "must be an integer, got {got}", {"got": _shown(v)})
    return v


def _num(v: Any) -> float | int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PydanticCustomError("ld_field", "must be a number, got {got}", {"got": _shown(v)})
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise PydanticCustomError("ld_field", "must be a boolean, got {got}", {"got": _shown(v)})
    return v


Int = Annotated[int, PlainValidator(_int)]
Number = Annotated[float, PlainValidator(_num)]
Bool = Annotated[bool, PlainValidator(_bool)]


# ---------------------------------------------------------------------------- the leapdecode extension
class LeapdecodeExtension(BaseModel):
    """``"leapdecode": {...}`` on a request: the decoding method, its options, extra sampling knobs."""

    model_config = ConfigDict(extra="forbid")

    method: Any = None  # a name (``validate_request`` knows them)
    options: dict[str, Any] | None = None
    draft: str | None = None  # shorthand for options.draft
    tree_budget: Int | None = None  # shorthand for options.tree_budget
    top_k: Int | None = None
    min_p: Number | None = None
    typical_p: Number | None = None
    repetition_penalty: Number | None = None
    kv_policy: str | None = None  # lossy KV-cache compression: a spec string (core/kv_policy.py)
    regex: str | None = None  # structured output: the completion matches this regex
    grammar: str | None = None  # structured output: Lark (llguidance) or GBNF grammar
    strategy: Any = None  # a decoding strategy (strategies/registry.py): the n choices are its hypotheses
    strategy_options: dict[str, Any] | None = None  # the strategy's options (num_beams, length_penalty, ...)

    @field_validator("method", "strategy", mode="before")
    @classmethod
    def _name(cls, v: Any) -> Any:
        """"" is none given; the request validator says which names it knows."""
        return None if v == "" else v

    @field_validator("strategy_options", mode="before")
    @classmethod
    def _strategy_options(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, dict):
            raise verbatim(f"leapdecode.strategy_options must be an object of option names to values, got "
                           f"{_shown(v)}")
        return v

    @field_validator("kv_policy", mode="before")
    @classmethod
    def _kv_policy(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, str):
            raise verbatim(f"leapdecode.kv_policy must be a spec string such as 'h2o:budget=256,recent=32', "
                           f"got {_shown(v)}")
        return v


# ---------------------------------------------------------------------------- the request validator
# request fields (``request.py``'s paths) under their names in this protocol; others are ``leapdecode.NAME``
PROTOCOL_NAMES = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
                  "max_new_tokens": "max_tokens", "json_schema": "response_format"}


# where a field's own value is refused (not a rule across fields), the error's param names the value's place
VALUE_PARAMS = {"json_schema": "response_format.json_schema.schema"}


def field_name(path: str, where: dict[str, str]) -> str:
    """This protocol's name of a request field: the one that set it, else its place in a request."""
    return where.get(path) or PROTOCOL_NAMES.get(path) or f"leapdecode.{path}"


def validate(where: dict[str, str], d: ServeConfig, **fields: Any) -> GenerationRequest:
    """``validate_request`` with this server's defaults; a ``RequestError`` becomes the 400 naming
    the field as a request wrote it (``where``: the fields a shorthand set, e.g. ``n``)."""
    try:
        return validate_request(defaults=d.request_defaults(), **fields)
    except InvalidParameterError as e:  # every one the validator raises names its field
        path = e.field or "options"
        param = field_name(path, where) if isinstance(e, RequestError) else \
            where.get(path) or VALUE_PARAMS.get(path) or field_name(path, where)
        raise verbatim(e.render(lambda path: field_name(path, where)), param=param) from None


def method_options(ext: LeapdecodeExtension, where: dict[str, str]) -> dict[str, Any]:
    """The method options a request gives: ``leapdecode.options`` and the ``draft`` /
    ``tree_budget`` shorthands (recorded in ``where``), which must agree."""
    options: dict[str, Any] = {}
    for key in ("tree_budget", "draft"):
        if getattr(ext, key) is not None:
            options[key], where[f"options.{key}"] = getattr(ext, key), f"leapdecode.{key}"
    for key, value in (ext.options or {}).items():
        if key in options and value != options[key]:
            raise verbatim(f"leapdecode.{key} ({options[key]!r}) and leapdecode.options.{key} ({value!r}) differ",
                           param=f"leapdecode.options.{key}")
        options[key] = value
    return options


def server_method(cfg: MethodConfig, given: dict[str, Any], where: dict[str, str], d: ServeConfig) -> MethodConfig:
    """A validated method config on this server: the options a request set stay within the server's
    bounds (``d.request_limits``), the file options it named (``datastore``, ``head``) become the paths given
    at start-up, and its draft must be loaded here."""
    try:
        check_request_limits(cfg, given, d.request_limits)
    except InvalidParameterError as e:
        raise verbatim(str(e), param=field_name(e.field or "options", where), code="request_limit") from None
    for key in FILE_OPTIONS:
        if given.get(key) is not None:  # the request named it: one of the server's names
            named = d.files.get(key, {})
            param = field_name(f"options.{key}", where)
            if not isinstance(given[key], str) or given[key] not in named:
                listed = ", ".join(sorted(named)) or "none"
                raise verbatim(f"{key} {_shown(given[key])} is not one of this server's {key}s (named at start-up "
                               f"with leapdecode serve --{key} NAME=PATH: {listed})", param=param)
            cfg = cfg.replace(**{key: named[given[key]]})
    draft = getattr(cfg, "draft", None)
    if draft is not None and draft not in (d.drafts or ()):
        loaded = ", ".join(sorted(d.drafts or ())) or "none"
        raise verbatim(f"draft model {_shown(draft)} is not loaded on this server (loaded: {loaded}); drafts are "
                       "loaded at start-up (leapdecode serve --draft NAME)",
                       param=where.get("options.draft", "leapdecode.options.draft"), code="model_not_found")
    return cfg


def resolve_method(ext: LeapdecodeExtension | None, d: ServeConfig) -> MethodConfig:
    """The validated method config of a request's extension alone (the server's default: ``None``)."""
    ext = ext or LeapdecodeExtension()
    where: dict[str, str] = {}
    given = method_options(ext, where)
    request = validate(where, d, method=ext.method, options=given or None)
    return server_method(request.method, given, where, d)


def resolve_request(req: "_Request", d: ServeConfig) -> GenerationRequest:
    """The validated ``GenerationRequest`` of a request (every rule is ``request.py``'s; the
    server adds its own: ``n`` as a strategy's ``num_return_sequences``, at most ``max_n``
    choices, no tools with a strategy, its file names and loaded drafts)."""
    ext = req.leapdecode or LeapdecodeExtension()
    where = {"max_new_tokens": req.max_tokens_param}
    given = method_options(ext, where)
    strategy_options = None if ext.strategy_options is None else dict(ext.strategy_options)
    if ext.strategy is not None:
        strategy_options = strategy_options or {}
        if req.n is not None:
            if strategy_options.get("num_return_sequences", req.n) != req.n:
                raise verbatim(f"n ({req.n}) and leapdecode.strategy_options.num_return_sequences "
                               f"({_shown(strategy_options['num_return_sequences'])}) differ", param="n")
            strategy_options["num_return_sequences"] = req.n
            where["strategy_options.num_return_sequences"] = "n"
        else:
            strategy_options.setdefault("num_return_sequences", 1)
    pick = {name: getattr(ext, name) for name in ("top_k", "min_p", "typical_p", "repetition_penalty")}
    pick.update(top_p=req.top_p, seed=req.seed)
    sampling = {k: v for k, v in pick.items() if v is not None}
    if req.temperature is not None:
        sampling["temperature"] = req.temperature
    request = validate(where, d, method=ext.method, options=given or None, strategy=ext.strategy,
                       strategy_options=strategy_options, stop=req.stop, kv_policy=ext.kv_policy,
                       max_new_tokens=req.requested_max_tokens or 1,  # each prompt's own budget: prepare.py
                       **sampling, **req.structure)
    if request.strategy is not None:
        name = request.strategy.strategy
        if request.strategy.returns > d.max_n:
            raise verbatim(f"strategy {name!r} would return {request.strategy.returns} choices; this server returns "
                           f"at most {d.max_n}", param=where.get("strategy_options.num_return_sequences",
                                                                  "leapdecode.strategy_options"))
        if req.tools:
            raise verbatim(f"strategy {name!r} does not combine with tools", param="tools")
    return replace(request, method=server_method(request.method, given, where, d))


# ---------------------------------------------------------------------------- requests
UNSUPPORTED = {  # field -> (accepted values, what it is)
    "logprobs": ((None, False), "(token log-probabilities)"),
    "top_logprobs": ((None, 0), "(token log-probabilities)"),
    "functions": ((None, [], {}), "(deprecated function calling; use tools)"),
    "logit_bias": ((None, {}), ""),
    "presence_penalty": ((None, 0), "(use leapdecode.repetition_penalty)"),
    "frequency_penalty": ((None, 0), "(use leapdecode.repetition_penalty)"),
    "suffix": ((None, ""), "(insertion)"),
    "audio": ((None,), "(modalities other than text)"),
    "modalities": ((None, ["text"]), "(modalities other than text)"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = None


class _Request(BaseModel):
    """Fields common to completions and chat completions.  Unknown top-level fields are ignored
    (as OpenAI clients send some, e.g. ``metadata``); unknown ``leapdecode`` fields are errors."""

    model_config = ConfigDict(extra="ignore")

    model: str
    stream: Bool | None = None
    stream_options: StreamOptions | None = None
    n: Int | None = None
    best_of: Int | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: Int | None = None
    stop: list[str] | None = None
    leapdecode: LeapdecodeExtension | None = None
    # OpenAI's end-user id: scopes the cross-request memory where the server says so (--memory-scope user)
    user: str | None = None
    # tool calling: validated by ChatCompletionRequest (a tuple of ``Tool``), refused by CompletionRequest
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # OpenAI parameters this server does not implement: accepted only at their neutral values
    logprobs: Any = None
    top_logprobs: Any = None
    functions: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    response_format: Any = None
    suffix: Any = None
    audio: Any = None
    modalities: Any = None

    _request: GenerationRequest = PrivateAttr()

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, v: Any, info: ValidationInfo) -> Any:
        accepted, what = UNSUPPORTED[info.field_name]
        if not any(v == a and type(v) is not bool or v is a for a in accepted):
            raise PydanticCustomError("unsupported_parameter", "{what}is not supported by this server",
                                      {"what": f"{what} " if what else ""})
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: Any) -> Any:
        """OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}``
        (its schema is the request's ``json_schema``: ``validate_request`` checks it against its
        metaschema, which a server's ``Preparer`` did in a child process first)."""
        if v is None:
            return None
        kind = v.get("type") if isinstance(v, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise verbatim("response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                           param="response_format.type")
        if kind == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
                raise verbatim("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                               param="response_format.json_schema.schema")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise verbatim("stop must be a non-empty string or an array of non-empty strings")
        return stops or None

    @field_validator("n")
    @classmethod
    def _n(cls, v: Any, info: ValidationInfo) -> Any:
        max_n = _defaults(info).max_n
        if v is not None and not 1 <= v <= max_n:
            raise verbatim(f"n must be between 1 and {max_n}, got {v}")
        return v

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            return v
        name, limit = info.field_name, _defaults(info).max_tokens_limit
        if v < 1:
            raise verbatim(f"{name} must be >= 1, got {v}")
        if limit is not None and v > limit:
            raise verbatim(f"{name} is {v}, over this server's limit of {limit} tokens per completion",
                           code="max_tokens_exceeded")
        return v

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> "_Request":
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise verbatim(f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                           "disagree; give one of them", param="max_completion_tokens")  # probe HS45
        self._request = resolve_request(self, _defaults(info))
        if self.best_of is not None and self.best_of != self.choices_per_prompt:
            raise PydanticCustomError("unsupported_parameter", "other than n is not supported by this server",
                                      {"param": "best_of"})
        return self

    @property
    def structure(self) -> dict[str, Any]:
        """What the output must follow, as ``compile_constraint`` keywords (empty: free text)."""
        fmt, ext = self.response_format, self.leapdecode
        out: dict[str, Any] = {}
        if isinstance(fmt, dict) and fmt.get("type") == "json_object":
            out["json_schema"] = {"type": "object"}
        elif isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            out["json_schema"] = fmt["json_schema"]["schema"]
        if ext is not None and ext.regex is not None:
            out["regex"] = ext.regex
        if ext is not None and ext.grammar is not None:
            out["grammar"] = ext.grammar
        return out

    # ------------------------------------------------------------ resolved values
    @property
    def choices_per_prompt(self) -> int:
        if self._request.strategy is not None:
            return self._request.strategy.returns
        return self.n or 1

    @property
    def strategy_config(self) -> StrategyConfig | None:
        """The request's decoding strategy (None: one sequence per choice)."""
        return self._request.strategy

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_tokens is not None else "max_completion_tokens"

    @property
    def method_config(self) -> MethodConfig:
        return self._request.method

    @property
    def generation_request(self) -> GenerationRequest:
        """The validated request (``request.py``), on this server (its method's names resolved)."""
        return self._request

    @property
    def kv_policy(self) -> KVPolicy | None:
        """The request's KV-cache policy (lossy; None: the exact cache)."""
        return self._request.kv_policy

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, seed_offset: int = 0) -> SamplingParams:
        """The sampling parameters of choice ``seed_offset`` (seeds count up from ``seed``)."""
        params = self._request.sampling
        return params if params.seed is None else replace(params, seed=params.seed + seed_offset)


# ---------------------------------------------------------------------------- tools (chat only)
TOOL_SHAPE = "{'type': 'function', 'function': {'name': ..., 'description': ..., 'parameters': {...}}}"
TOOL_CHOICES = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


def parse_tools(v: Any) -> tuple[Tool, ...] | None:
    """OpenAI's ``tools``, validated (every error names its field: ``tools[1].function.name``)."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise verbatim(f"tools must be an array of {TOOL_SHAPE} objects", param="tools")
    from ..constraints.grammar import check_json_schema

    out: list[Tool] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise verbatim(f"{where} must be an object {TOOL_SHAPE}", param=where)
        if t.get("type") != "function":
            raise verbatim(f"{where}.type must be 'function', got {_shown(t.get('type'))}", param=f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise verbatim(f"{where}.function must be an object {{'name', 'description', 'parameters'}}",
                           param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise verbatim(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got "
                           f"{_shown(name)}", param=f"{where}.function.name")
        if name in seen:
            raise verbatim(f"{where}.function.name {name!r} is also the name of tools[{seen[name]}]; function "
                           "names must be unique", param=f"{where}.function.name")
        seen[name] = i
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise verbatim(f"{where}.function.description must be a string", param=f"{where}.function.description")
        params = fn.get("parameters")
        where_p = f"{where}.function.parameters"
        if params is None:
            params = dict(NO_PARAMETERS)
        else:
            if not isinstance(params, dict):
                raise verbatim(f"{where_p} must be a JSON schema (an object), got {_shown(params)}", param=where_p)
            try:
                check_json_schema(params)
            except InvalidParameterError as e:
                raise verbatim(f"{where_p}: {e}", param=where_p) from None
            kind = params.get("type", "object")
            if kind != "object" and not (isinstance(kind, list) and "object" in kind):
                raise verbatim(f"{where_p} must describe an object (type 'object'): a call's arguments are a JSON "
                               f"object; got type {_shown(kind)}", param=where_p)
        out.append(Tool(name, description, params))
    return tuple(out) or None


def parse_tool_choice(v: Any) -> str | dict | None:
    if v is None or v in ("none", "auto", "required"):
        return v
    fn = v.get("function") if isinstance(v, dict) else None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str):
        return {"type": "function", "function": {"name": fn["name"]}}
    raise verbatim(f"tool_choice must be {TOOL_CHOICES}, got {_shown(v)}", param="tool_choice")


class FunctionCallIn(BaseModel):
    """A past call in an assistant message; ``arguments`` is OpenAI's JSON string (an object is
    taken too), kept as the object the chat template renders."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: Any = None

    @field_validator("arguments", mode="before")
    @classmethod
    def _arguments(cls, v: Any) -> Any:
        if v is None or v == "":
            return {}
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise PydanticCustomError("ld_field", "must be a JSON object as a string, got {got}",
                                          {"got": _shown(v)}) from None
        if not isinstance(v, dict):
            raise PydanticCustomError("ld_field", "must be a JSON object as a string, got {got}", {"got": _shown(v)})
        return v


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """A message; an assistant's may carry ``tool_calls`` (its ``content`` then may be null), and a
    ``tool`` message answers one call (``tool_call_id``).  Fields are validated in this order."""

    model_config = ConfigDict(extra="ignore")

    role: str
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(default=None, validate_default=True)
    content: str | None = Field(default=None, validate_default=True)

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, v: Any) -> Any:
        if v not in CHAT_ROLES:
            raise PydanticCustomError("ld_field", "must be one of {roles}; got {got}",
                                      {"roles": ", ".join(CHAT_ROLES), "got": _shown(v)})
        return v

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None or v == []:
            return None
        if info.data.get("role") != "assistant":
            raise PydanticCustomError("ld_field", "is only allowed on assistant messages")
        return v

    @field_validator("tool_call_id", mode="before")
    @classmethod
    def _tool_call_id(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") == "tool":
            raise PydanticCustomError("missing", "Field required")
        if v is not None and not isinstance(v, str):
            raise PydanticCustomError("ld_field", "must be a string, got {got}", {"got": _shown(v)})
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return None
            raise PydanticCustomError("missing", "Field required")
        if isinstance(v, list):
            texts = []
            for part in v:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise PydanticCustomError("unsupported_parameter", "other than text parts is not supported by "
                                              "this server")
                texts.append(part["text"])
            return "".join(texts)
        if not isinstance(v, str):
            raise PydanticCustomError("ld_field", "must be a string or an array of text parts")
        return v

    def as_template_message(self) -> dict[str, Any]:
        """As the chat template takes it (``developer`` is OpenAI's newer name for ``system``; a tool
        call's arguments as an object, as transformers' templates render them)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.content if self.content is not None else ""}
        if self.tool_calls:
            out["tool_calls"] = [{**({"id": c.id} if c.id is not None else {}), "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @property
    def uses_tools(self) -> bool:
        """A tool call or a tool's answer (the chat template must know tools)."""
        return self.role == "tool" or bool(self.tool_calls)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v: Any) -> Any:
        if not isinstance(v, list) or not v:
            raise verbatim("messages must be a non-empty array of {role, content} objects")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, v: Any) -> Any:
        return parse_tools(v)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        return parse_tool_choice(v)

    @field_validator("parallel_tool_calls", mode="before")
    @classmethod
    def _parallel(cls, v: Any) -> Any:
        return v if v is None else _bool(v)

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise verbatim("tool_choice needs tools (an array of functions the model may call)", param="tool_choice")
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            if name not in {t.name for t in self.tools}:
                raise verbatim(f"tool_choice names the function {name!r}, which is not in tools (functions: "
                               f"{', '.join(t.name for t in self.tools)})", param="tool_choice.function.name")
        given = [k for k, v in self.structure.items() if v is not None]
        if self.tool_calling is not None and given:
            what = "response_format" if given[0] == "json_schema" else f"leapdecode.{given[0]}"
            raise verbatim(f"tools (with tool_choice other than 'none') and {what} cannot be combined: a call's "
                           "arguments follow its function's parameters schema; send tool_choice 'none' for a "
                           f"structured answer", param=what)
        return self

    @property
    def tool_calling(self) -> ToolCalling | None:
        """What the request asks of tools (``None``: no tools, or ``tool_choice: "none"``)."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return None
        parallel = self.parallel_tool_calls is True  # not OpenAI's default: small models loop on calls
        if isinstance(choice, dict):
            return ToolCalling(self.tools, "function", choice["function"]["name"], parallel)
        return ToolCalling(self.tools, "required" if choice == "required" else "auto", None, parallel)


class CompletionRequest(_Request):
    prompt: list[str | list[int]]
    echo: Bool | None = None

    @field_validator("tools", "tool_choice", "parallel_tool_calls")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v not in (None, [], "none") and not isinstance(v, bool):
            raise PydanticCustomError("unsupported_parameter", "is only supported by /v1/chat/completions "
                                      "(tool calling)")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or is_ids(v):
            v = [v]
        if not isinstance(v, list) or not v:
            raise verbatim("prompt must be a string, an array of strings, an array of token ids or an array of "
                           "token-id arrays")
        for i, p in enumerate(v):
            if not (isinstance(p, str) and p) and not is_ids(p):
                raise verbatim(f"prompt[{i}] must be a non-empty string or an array of token ids")
        return v


# ---------------------------------------------------------------------------- responses
def _drop_none(data: dict, *names: str) -> dict:
    for name in names:
        if data.get(name, 0) is None:
            del data[name]
    return data


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    """A whole call in one streamed delta (OpenAI streams the arguments in pieces; one piece is valid)."""

    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is tool calls only
    tool_calls: list[ToolCallOut] | None = None  # sent only when there are calls

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict:
        return _drop_none(handler(self), "tool_calls")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[CompletionChoice]
    usage: Usage
    leapdecode: dict[str, Any]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChatChoice]
    usage: Usage
    leapdecode: dict[str, Any]


class ChatDelta(BaseModel):
    """Only what is set is sent (``{}`` in the last chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict:
        return _drop_none(handler(self), "role", "content", "tool_calls")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class _Chunk(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: None = None
    usage: Usage | None = None  # sent (as null until the last chunk) only with stream_options.include_usage
    leapdecode: dict[str, Any] | None = None  # sent in a choice's last chunk (and with the usage)

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict:
        return _drop_none(handler(self), "leapdecode")


class ChatCompletionChunk(_Chunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(_Chunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "leapdecode"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


MAX_ERROR_MESSAGE = 1000  # characters: a message quoting a client's value (an unknown name) echoes no more


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None

    @field_validator("message")
    @classmethod
    def _bounded(cls, message: str) -> str:
        return message if len(message) <= MAX_ERROR_MESSAGE else message[: MAX_ERROR_MESSAGE - 1] + "…"


class ErrorResponse(BaseModel):
    error: ErrorBody
