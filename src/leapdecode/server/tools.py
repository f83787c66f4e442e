"""Tool calls (OpenAI ``tools`` / ``tool_choice``) in the Hermes format.

The chat templates that support tools (Qwen2.5's, Hermes', and the tiny test template) describe
the tools to the model and ask it to answer a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(several blocks, one per line, for parallel calls).  This module holds what the server needs
for that, and nothing about HTTP:

* ``Tool`` and ``ToolCalling``: the validated ``tools`` and ``tool_choice`` of a request;
* ``tool_call_grammar``: for ``tool_choice`` ``"required"`` or a named function, the llguidance
  Lark grammar the output must follow.  It produces the tags *and* the JSON: the JSON object is
  ``%json`` of ``{"name": <const of an allowed name>, "arguments": <that tool's parameters>}``
  (``anyOf`` over the allowed tools), between ``<tool_call>\\n`` and ``\\n</tool_call>``.  Why the
  tags and not the bare JSON object: the template asked the model for the tags, so the model's
  own first choices are ``<tool_call>`` then ``{"name": ...``; a bare object would start it off
  its distribution (worse arguments from small models), and the same text is what the template
  renders when the call comes back in the next turn's history.  For the same reason the JSON is
  written the way the template renders a past call (``tojson``: ``", "`` and ``": "``, no other
  whitespace): a model cannot spend its tokens on blank lines inside a call, and the tags, the
  keys and the separators are forced tokens (drafted by the grammar, verified in one forward);
* ``parse_tool_calls``: for ``"auto"`` (free generation), the Hermes blocks parsed out of the
  text afterwards, as vLLM's hermes parser does (all or nothing: one malformed block or an
  unknown function name leaves the whole text as content); a text that is nothing but call
  objects without the tags counts too (Qwen2.5-Coder-0.5B answers that way);
* ``ToolTextFilter``: streaming: content is sent as it comes until a ``<tool_call>`` may start;
  what follows is held back and sent at the end as one ``tool_calls`` delta (or as content when
  it does not parse).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FENCE = "```json"
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
# a function without ``parameters`` takes none (OpenAI): its arguments are the empty object
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# a constrained call is written as the chat template renders a past call (transformers' ``tojson``:
# ``{"name": "f", "arguments": {"a": 1, "b": [1, 2]}}``): no whitespace but these separators
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE) + "|"
                    + re.escape(TOOL_CALL_OPEN) + r"(.*)\Z", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    """One ``{"type": "function", "function": {...}}`` of a request, validated."""

    name: str
    description: str | None = None
    parameters: dict = field(default_factory=lambda: dict(NO_PARAMETERS))

    def for_template(self) -> dict:
        """As ``apply_chat_template(tools=...)`` takes it (OpenAI's shape)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCalling:
    """What a request asks of tools: ``mode`` ``"auto"`` (the model may call one: parse its text),
    ``"required"`` (it must call one or more) or ``"function"`` (it must call ``function``)."""

    tools: tuple[Tool, ...]
    mode: Literal["auto", "required", "function"]
    function: str | None = None
    parallel: bool = False  # "required" may make several calls (parallel_tool_calls: true)

    @property
    def constrained(self) -> bool:
        return self.mode != "auto"

    @property
    def allowed(self) -> tuple[Tool, ...]:
        """The tools the output may call."""
        if self.mode == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.allowed)

    def for_template(self) -> list[dict]:
        return [t.for_template() for t in self.tools]


# ---------------------------------------------------------------------------- constrained calls
def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local references (``#/$defs/X``, ``#``) pointing into ``root``, where it
    is embedded in a larger schema (a parameters schema's own ``$defs`` stay where they are)."""
    if isinstance(schema, list):
        return [_rebased(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in ("const", "enum", "default", "examples"):  # values, not schemas
            out[key] = value
        else:
            out[key] = _rebased(value, root)
    return out


def call_schema(tools: tuple[Tool, ...] | list[Tool]) -> dict:
    """The JSON schema of one Hermes call object to one of ``tools``."""
    def arguments(t: Tool, root: str) -> dict:
        params = _rebased(t.parameters, root)
        return params if "type" in params else {"type": "object", **params}

    if len(tools) == 1:
        options = [(tools[0], "#/properties/arguments")]
    else:
        options = [(t, f"#/anyOf/{i}/properties/arguments") for i, t in enumerate(tools)]
    calls = [{"type": "object",
              "properties": {"name": {"const": t.name}, "arguments": arguments(t, root)},
              "required": ["name", "arguments"], "additionalProperties": False} for t, root in options]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": dict(JSON_FORMAT)}


def special_tags(tokenizer, is_special) -> frozenset[str]:
    """The tags that are one special token of the tokenizer (Qwen2.5's ``<tool_call>`` and
    ``</tool_call>``; ``is_special``: llguidance's ``LLTokenizer.is_special_token``).  llguidance
    matches a special token only by its name in a grammar (``<tool_call>``), never as text; a
    tag that is no token (the tiny test models) is text."""
    out = set()
    for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) == 1 and is_special(ids[0]):
            out.add(tag)
    return frozenset(out)


def tool_call_grammar(calling: ToolCalling, special: frozenset[str] = frozenset()) -> str:
    """llguidance Lark: ``<tool_call>\\n{call}\\n</tool_call>``, one block (a named function, or
    ``"required"``) or, for ``"required"`` with ``parallel_tool_calls: true``, one or more joined by
    newlines (not the default: small models go on calling until max_tokens).  ``special``:
    the tags to write as special tokens (``special_tags``)."""
    def tag(text: str) -> str:
        return text if text in special else json.dumps(text)

    schema = json.dumps(call_schema(calling.allowed), ensure_ascii=False)
    many = calling.mode == "required" and calling.parallel
    start = 'start: call ("\\n" call)*' if many else "start: call"
    return (f"%llguidance {{}}\n{start}\n"
            f'call: {tag(TOOL_CALL_OPEN)} "\\n" obj "\\n" {tag(TOOL_CALL_CLOSE)}\n'
            f"obj: %json {schema}\n")


# ---------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class Parsed:
    """A completion's text split into its content and its tool calls (none: all is content)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(body: str, names: frozenset[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call_of(obj, names)


def _call_of(obj: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _bare_calls(text: str, names: frozenset[str]) -> tuple[ToolCall, ...]:
    """Calls written without tags: the whole text is call objects, one after another (in a
    ```json fence or not).  Small models do this (Qwen2.5-Coder-0.5B does, every time)."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
    if fenced:
        body = fenced.group(1)
    if not body.startswith("{"):
        return ()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            return ()
        call = _call_of(obj, names)
        if call is None:
            return ()
        calls.append(call)
        while i < len(body) and body[i].isspace():
            i += 1
    return tuple(calls)


def parse_tool_calls(text: str, names: frozenset[str] | set[str]) -> Parsed:
    """The Hermes ``<tool_call>`` blocks of ``text`` (a last block may lack its closing tag), or,
    when there is no tag, calls written bare (the whole text is call objects: ``_bare_calls``).
    Content is the text before the first block (``None`` when blank); text after the last block
    is dropped.  All or nothing: a block that is not a call to one of ``names`` (bad JSON, unknown
    name, arguments not an object) leaves the whole text as content, with no calls."""
    names = frozenset(names)
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        calls = _bare_calls(text, names)
        return Parsed(None, calls) if calls else Parsed(text)
    calls = []
    for m in _BLOCK.finditer(text, start):
        call = _call((m.group(1) if m.group(1) is not None else m.group(2)).strip(), names)
        if call is None:
            return Parsed(text)
        calls.append(call)
    head = text[:start]
    return Parsed(head.rstrip() if head.strip() else None, tuple(calls))


class ToolTextFilter:
    """The content of one streamed choice that may end in tool calls: ``feed`` returns what can
    be sent now (never a possible start of ``<tool_call>``, nor trailing whitespace that would be
    cut if a call follows, nor anything of a text that starts like bare calls: ``{`` or
    ````json``); ``finish`` parses the whole text and returns the content still to send and the
    calls.  ``hold_all``: a constrained choice, whose text is all calls."""

    def __init__(self, names: frozenset[str], hold_all: bool = False) -> None:
        self.names, self.hold_all = names, hold_all
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content

    def _safe(self) -> int:
        text = self.text
        head = text.lstrip()
        if head.startswith("{") or head.startswith(FENCE) or FENCE.startswith(head):
            return 0  # may be calls written bare (``_bare_calls``): hold all
        start = text.find(TOOL_CALL_OPEN)
        if start < 0:
            start = len(text)
            for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
                if TOOL_CALL_OPEN.startswith(text[-k:]):
                    start = len(text) - k
                    break
        return len(text[:start].rstrip())

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.hold_all:
            return ""
        safe = self._safe()
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self, text: str | None = None) -> tuple[str, tuple[ToolCall, ...]]:
        """(content not sent yet, calls), for the final ``text`` (default: what was fed)."""
        if text is not None:
            self.text = text
        parsed = parse_tool_calls(self.text, self.names)
        content = (parsed.content or "") if parsed.calls else self.text
        rest = content[self.sent:]
        self.sent = len(content)
        return rest, parsed.calls


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads ``tools`` (the Jinja text names the variable)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the one apply_chat_template picks with tools
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None
