"""From a request body to the generations to run: size limit, parsing, validation, tokenization.

``read_body`` runs on the event loop (it only moves bytes, and stops at the size limit);
``prepare`` does the CPU work (JSON parsing, validation, chat templating, tokenization) and
``constrain`` compiles a structured request's grammar, off the event loop (``Preparer``), so a
large body never stalls the event loop and a slow grammar never delays a plain request (probe HR22):

* a request's structures (JSON schemas, tools' parameters, regex, grammar) are at most
  ``--max-grammar-bytes`` together (``structures``: a 400 before any work);
* a request with a schema not checked before, or a body over ``PLAIN_BODY_BYTES``, goes to the
  structured lane (parsing 200 KB of JSON alone takes milliseconds): its schemas are checked
  against their metaschemas in a child process (``constraints/isolated.py``: that pure-Python check
  held the interpreter lock for seconds and slowed decoding 2.8x), within ``--grammar-timeout``,
  then it is prepared and its grammar compiled on that lane's thread (the grammar engine releases
  the lock), within the same budget; plain requests are prepared on their own lane meanwhile.

Requests in preparation count against ``--max-queue`` like those waiting for the batch: more get a 429.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

from fastapi import Request

from ..constraints.grammar import CHECKED, COMPILE_TIMEOUT_S, schema_digest
from ..constraints.isolated import SchemaChecker
from ..core.config import MethodConfig
from ..core.prompt import encode_prompt
from ..core.runner import ModelRunner
from ..errors import GrammarError, InvalidParameterError
from .config import ServeConfig
from .engine import GenSpec
from .errors import ApiError, BodyTimeout, BodyTooLarge
from .exceptions import QueueFullError
from .protocol import ChatCompletionRequest, CompletionRequest
from .tools import ToolCalling, special_tags, template_supports_tools, tool_call_grammar

Kind = Literal["chat", "completion"]
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
PLAIN_BODY_BYTES = 64 << 10  # a larger body is parsed and prepared on the structured lane


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    kind: Kind
    request: ChatCompletionRequest | CompletionRequest
    prompt_lens: list[int]
    echo: list[str] | None  # completions with echo: the prompts' text, one per prompt
    specs: list[GenSpec]  # one per choice (a search: one per prompt, answering its n choices): prompt-major
    draft: str | None  # the draft model the method uses, if any
    tools: ToolCalling | None = None  # chat with tools: the answers' tool calls are parsed out
    structure: dict | None = None  # a grammar still to compile (``constrain``) into every spec's constraint

    @property
    def n(self) -> int:
        return self.request.choices_per_prompt

    def scoped(self, scope: str | None) -> "Prepared":
        """Its generations in the memory scope ``scope`` (``ServeConfig.scope``: the request's tenant)."""
        return replace(self, specs=[replace(spec, request=replace(spec.request, memory_scope=scope))
                                    for spec in self.specs])

    @property
    def choices(self) -> int:
        """Choices in the answer: prompts x n."""
        return sum(spec.choices for spec in self.specs)

    @property
    def strategy(self) -> str | None:
        cfg = self.request.strategy_config
        return None if cfg is None else cfg.strategy

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    @property
    def include_usage(self) -> bool:
        return self.request.include_usage

    @property
    def method(self) -> str:
        return self.request.method_config.method


# ---------------------------------------------------------------------------- the body
def check_json_body(request: Request) -> None:
    """A request body must be declared JSON (``application/json`` or a ``+json`` type) where its type
    is given: a web page can make a browser send ``text/plain``, form or multipart bodies to any
    address without a CORS check, and such a body must not drive the server (issue 45, finding 4)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), not {media or 'empty'!r}",
                       code="unsupported_media_type")


BODY_TIMEOUT_S = 30.0  # a body that takes longer to arrive is refused (probe HX02: slowloris)


async def read_body(request: Request, limit: int, timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The body, or ``BodyTooLarge`` as soon as it is known to exceed ``limit`` bytes (from
    Content-Length, before reading anything, or while reading a chunked body), or ``BodyTimeout``
    when it has not arrived whole within ``timeout_s``."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(limit)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyTimeout(timeout_s) from None


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request ({e}).", code="invalid_json") from None
    except RecursionError:  # probe HS70: arrays nested 10,000 deep
        raise ApiError(400, "We could not parse the JSON body of your request (nested too deeply).",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


# ---------------------------------------------------------------------------- preparation (worker thread)
def check_model(name: str, cfg: ServeConfig) -> None:
    if name != cfg.model_name:
        raise ApiError(404, f"The model '{name}' does not exist; this server serves '{cfg.model_name}'",
                       param="model", code="model_not_found")


def max_new_tokens(requested: int | None, prompt_len: int, context: int, default: int, param: str) -> int:
    room = context - prompt_len
    if requested is None:
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's maximum context length is "
                                f"{context} tokens (prompt + at least 1 new token)", param=param,
                           code="context_length_exceeded")
        return min(default, room)
    if prompt_len + requested > context:
        raise ApiError(400, f"this model's maximum context length is {context} tokens; you requested "
                            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                            "completion); reduce the prompt or max_tokens", param=param,
                       code="context_length_exceeded")
    return requested


def structures(body: dict, limit: int) -> list[tuple[str, dict]]:
    """A parsed body's JSON schemas as ``(param, schema)`` (``response_format``'s, each tool's
    parameters), found where well-formed (validation names what is not); a 400 when its structures
    (those, and a regex or grammar) take more than ``limit`` bytes of JSON together."""
    found: list[tuple[str, Any]] = []
    fmt = body.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) and fmt.get("type") == "json_schema" else None
    if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
        found.append(("response_format.json_schema.schema", spec["schema"]))
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("parameters"), dict):
            found.append((f"tools[{i}].function.parameters", fn["parameters"]))
    ext = body.get("leapdecode")
    texts = [ext.get(k) for k in ("regex", "grammar")] if isinstance(ext, dict) else []
    try:
        size = sum(len(json.dumps(v)) for _, v in found) + sum(len(t) for t in texts if isinstance(t, str))
    except RecursionError:
        raise ApiError(400, "a JSON schema of this request is nested too deeply to check",
                       param=found[0][0] if found else None) from None
    if size > limit:
        raise ApiError(400, f"this request's structured-output schemas and grammars take {size} bytes; this server "
                            f"compiles at most {limit} (leapdecode serve --max-grammar-bytes)",
                       param=found[0][0] if found else "leapdecode", code="grammar_too_large")
    return found


def draft_in_use(cfg: MethodConfig, runner: ModelRunner) -> str | None:
    """The draft model a method config will use on ``runner`` (``None``: none)."""
    if "draft" not in cfg.option_names() or getattr(cfg, "use_draft", True) is False:
        return None
    name = getattr(cfg, "draft", None) or runner.model.draft_name
    return name if name in runner.drafts else None


def _tool_schema_error(runner: ModelRunner, calling: ToolCalling, error: InvalidParameterError) -> ApiError:
    """The 400 for tools whose call grammar llguidance refused: naming the first tool whose
    parameters schema it refuses alone (else the tools as a whole)."""
    from ..constraints.grammar import compile_constraint

    for i, tool in enumerate(calling.tools):
        if tool in calling.allowed:
            try:
                compile_constraint(runner, json_schema=tool.parameters)
            except InvalidParameterError as e:
                where = f"tools[{i}].function.parameters"
                return ApiError(400, f"{where}: {e}", param=where)
    return ApiError(400, str(error), param="tools")


def _specs(req, prompts: list[list[int]], max_new: list[int]) -> list[GenSpec]:
    """One spec per choice (a search: one per prompt, answering its n choices), prompt-major; each
    with its prompt's token budget and its own seed (counted up from the request's)."""
    request = replace(req.generation_request, structure=None)  # compiled into each spec's constraint
    if request.strategy is not None:  # one search per prompt; its hypotheses are the n choices
        return [GenSpec(ids, replace(request, max_new_tokens=max_new[p], sampling=req.sampling(seed_offset=p)))
                for p, ids in enumerate(prompts)]
    n = req.choices_per_prompt
    return [GenSpec(ids, replace(request, max_new_tokens=max_new[p], sampling=req.sampling(seed_offset=p * n + j)))
            for p, ids in enumerate(prompts) for j in range(n)]


def _structure(req, runner: ModelRunner) -> dict | None:
    """The grammar a request constrains its output to (``compile_constraint``'s keywords), if any."""
    calling = req.tool_calling if isinstance(req, ChatCompletionRequest) else None
    if calling is not None and calling.constrained:  # tool_choice "required" or a named function
        from ..constraints.grammar import grammar_tokenizer

        special = special_tags(runner.model.tokenizer, grammar_tokenizer(runner).is_special_token)
        return {"grammar": tool_call_grammar(calling, special)}
    return req.structure or None


def constrain(prep: Prepared, runner: ModelRunner, timeout_s: float = COMPILE_TIMEOUT_S) -> Prepared:
    """Compile a prepared request's grammar into its specs' constraints (off the engine thread: a
    refused grammar is a 400 before queueing)."""
    structure = prep.structure
    if not structure:
        return prep
    from ..constraints.grammar import compile_constraint

    calling = prep.tools
    param = "response_format" if "json_schema" in structure else f"leapdecode.{next(iter(structure))}"
    try:
        first = compile_constraint(runner, timeout_s=timeout_s, **structure)
    except InvalidParameterError as e:
        if calling is not None and calling.constrained:
            raise _tool_schema_error(runner, calling, e) from None
        raise ApiError(400, str(e), param=param) from None
    specs = [replace(spec, request=replace(spec.request, constraint=first if i == 0 else first.fork()))
             for i, spec in enumerate(prep.specs)]
    return replace(prep, specs=specs, structure=None)


def prepare(kind: Kind, raw: bytes | dict, cfg: ServeConfig, runner: ModelRunner) -> Prepared:
    """Parse (unless ``raw`` is parsed already), validate and tokenize a request (pydantic errors
    propagate: a 400 naming the field); its grammar, if any, is left in ``structure`` for ``constrain``."""
    body = raw if isinstance(raw, dict) else parse_json(raw)
    model = runner.model
    if kind == "chat":
        req = ChatCompletionRequest.model_validate(body, context=cfg)
        check_model(req.model, cfg)
        calling = req.tool_calling
        with_tools = [i for i, m in enumerate(req.messages) if m.uses_tools]
        if (calling is not None or with_tools) and not template_supports_tools(model.tokenizer):
            why = f"model {model.name}'s chat template does not support tools (it never reads 'tools')"
            if calling is not None:
                raise ApiError(400, f"{why}: send tool_choice 'none' or no tools, or serve a model whose template "
                                    "supports them (Qwen2.5's)", param="tools")
            raise ApiError(400, f"{why}, so it cannot show messages[{with_tools[0]}] (a tool call or a tool's "
                                "answer)", param=f"messages[{with_tools[0]}]")
        try:
            ids = encode_prompt(model, [m.as_template_message() for m in req.messages],
                                tools=calling.for_template() if calling is not None else None)
        except InvalidParameterError as e:
            raise ApiError(400, str(e), param="messages") from None
        prompts, echo = [ids], None
        max_new = [max_new_tokens(req.requested_max_tokens, len(ids), model.max_seq_len, cfg.default_max_tokens,
                                  "messages")]
    else:
        req = CompletionRequest.model_validate(body, context=cfg)
        check_model(req.model, cfg)
        vocab = len(model.tokenizer)
        prompts, texts = [], []
        for i, p in enumerate(req.prompt):
            if isinstance(p, str):
                try:
                    ids = encode_prompt(model, p, chat=False)
                except InvalidParameterError as e:
                    raise ApiError(400, str(e) if len(req.prompt) == 1 else f"prompt[{i}]: {e}",
                                   param="prompt") from None
                texts.append(p)
            else:
                if any(t < 0 or t >= vocab for t in p):
                    raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
                ids = list(p)
                texts.append(model.tokenizer.decode(ids))
            prompts.append(ids)
        if len(prompts) * req.choices_per_prompt > cfg.max_n:
            raise ApiError(400, f"prompts x n must be at most {cfg.max_n}, got "
                                f"{len(prompts) * req.choices_per_prompt}", param="n")
        echo = texts if req.echo else None
        max_new = [max_new_tokens(req.requested_max_tokens, len(ids), model.max_seq_len,
                                  COMPLETION_DEFAULT_MAX_TOKENS, "prompt") for ids in prompts]
    if req.kv_policy is not None and runner.model.backend != "native":
        raise ApiError(400, f"kv_policy needs the native backend; this server runs {model.name} on the "
                            f"{runner.model.backend!r} backend", param="leapdecode.kv_policy")
    return Prepared(kind=kind, request=req, prompt_lens=[len(p) for p in prompts], echo=echo,
                    specs=_specs(req, prompts, max_new), draft=draft_in_use(req.method_config, runner),
                    tools=req.tool_calling if kind == "chat" else None, structure=_structure(req, runner))


STRUCTURED_NICE = 10  # the structured lane's thread runs below decoding (Linux: a thread's own nice value)


def lower_priority() -> None:
    """Lower the calling thread's scheduling priority (``STRUCTURED_NICE``): a grammar's compilation,
    seconds of CPU for a large schema, then takes what the engine thread leaves on a machine of few
    cores instead of slowing every generation.  Where a thread's priority cannot be set, nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STRUCTURED_NICE)
    except (OSError, AttributeError):
        pass


class Preparer:
    """Prepares requests off the event loop on two lanes (see the module docstring): plain requests
    on one worker thread; a request with a JSON schema not checked before on the structured lane,
    which checks its schemas in a child process (``checker``), then prepares it; every structured
    request's grammar compiles on the structured lane too.  At most ``limit`` requests are in
    preparation at once; one more is a ``QueueFullError`` (429 with ``retry_after()`` seconds)."""

    def __init__(self, cfg: ServeConfig, runner: ModelRunner, limit: int,
                 retry_after: Callable[[], int] = lambda: 1) -> None:
        self.cfg, self.runner, self.limit, self.retry_after = cfg, runner, limit, retry_after
        self.pending = 0  # requests in either stage (changed on the event loop only)
        self.checker = SchemaChecker(cfg.grammar_timeout, "leapdecode serve --grammar-timeout")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leapdecode-prepare")
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leapdecode-grammar",
                                                initializer=lower_priority)

    async def __call__(self, kind: Kind, raw: bytes) -> Prepared:
        if self.pending >= self.limit:
            raise QueueFullError(self.retry_after(), self.limit)
        loop = asyncio.get_running_loop()
        self.pending += 1
        try:
            heavy = len(raw) > PLAIN_BODY_BYTES  # parsing it alone takes milliseconds: not on the plain lane
            body = await loop.run_in_executor(self._grammar_pool if heavy else self._pool, self._unchecked, raw)
            lane = self._grammar_pool if heavy or body[1] is not None else self._pool
            prep = await loop.run_in_executor(lane, self._prepare, kind, body)
            if prep.structure:
                prep = await loop.run_in_executor(self._grammar_pool, constrain, prep, self.runner,
                                                  self.cfg.grammar_timeout)
            return prep
        finally:
            self.pending -= 1

    def _unchecked(self, raw: bytes) -> tuple[dict, list[tuple[str, dict]] | None]:
        """The parsed body and its schemas not checked before (None: none, a plain-lane request)."""
        body = parse_json(raw)
        todo = []
        for param, schema in structures(body, self.cfg.max_grammar_bytes):
            try:
                if schema_digest(schema) not in CHECKED:
                    todo.append((param, schema))
            except GrammarError as e:
                raise ApiError(400, str(e), param=param) from None
        return body, todo or None

    def _prepare(self, kind: Kind, body: tuple[dict, list[tuple[str, dict]] | None]) -> Prepared:
        parsed, todo = body
        for param, schema in todo or []:  # in the child: this thread waits without the interpreter lock
            try:
                self.checker.check(schema)
            except InvalidParameterError as e:
                raise ApiError(400, str(e), param=param) from None
        return prepare(kind, parsed, self.cfg, self.runner)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.checker.close()
