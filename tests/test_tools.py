"""Tool calls on the OpenAI-compatible server: ``tools``, ``tool_choice``, tool messages.

One in-process server (uvicorn in a background thread) serves a tiny random model whose ChatML
template is replaced by a small tools-aware one (Hermes format, like Qwen2.5's).  The model's
output is noise, so a call's arguments are only valid because the grammar made them so; with
``tool_choice: "auto"`` it never calls, so the Hermes parser is tested on written texts.  A real
model (qwen2.5-coder-0.5b, when installed) checks the special-token tags end to end.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from leapdecode.models.tiny import tiny_loaded  # noqa: E402
from leapdecode.server import prepare as prepare_mod  # noqa: E402
from leapdecode.server.app import create_app  # noqa: E402
from leapdecode.server.config import ServeConfig  # noqa: E402
from leapdecode.server.errors import ApiError  # noqa: E402
from leapdecode.server.tools import (Tool, ToolCalling, ToolTextFilter, call_schema, parse_tool_calls,  # noqa: E402
                                     special_tags, tool_call_grammar)
from helpers.server import start_server  # noqa: E402

MODEL = "tiny-random"
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Call one as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "metric": {"type": "boolean"}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time"}}]  # no parameters
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "days": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "snow"}'}]


def tools_model(name: str = MODEL):
    """A fresh tiny model (not the shared one: its template is changed) with the tools template."""
    model = tiny_loaded(name=name)
    model.tokenizer.chat_template = TOOLS_TEMPLATE
    return model


@pytest.fixture(scope="module")
def server():
    app = create_app(tools_model(), ServeConfig(default_method="vanilla", request_timeout=60))
    srv, thread, url = start_server(app)
    yield SimpleNamespace(url=url, app=app)
    srv.should_exit = True
    thread.join(10)


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def check_call(call, names=("get_weather", "now")) -> dict:
    """A response's tool call: its shape, and arguments that validate against the tool's schema."""
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


# ---------------------------------------------------------------------------- validation
def chat(**kw) -> dict:
    return {"model": MODEL, "messages": ASK, "max_tokens": 8, **kw}


BAD = [
    (chat(tools={"type": "function"}), "tools"),
    (chat(tools=["get_weather"]), "tools[0]"),
    (chat(tools=[{"type": "fn", "function": {"name": "f"}}]), "tools[0].type"),
    (chat(tools=[{"type": "function"}]), "tools[0].function"),
    (chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "x" * 65}}]), "tools[0].function.name"),
    (chat(tools=[TOOLS[0], TOOLS[1], TOOLS[0]]), "tools[2].function.name"),  # duplicate
    (chat(tools=[{"type": "function", "function": {"name": "f", "description": 3}}]), "tools[0].function.description"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
     "tools[0].function.parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]), "tools[0].function.parameters"),
    (chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (chat(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice.function.name"),
    (chat(tool_choice="required"), "tool_choice"),  # no tools
    (chat(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    (chat(tools=TOOLS, response_format={"type": "json_object"}), "response_format"),
    (chat(tools=TOOLS, tool_choice="required", leapdecode={"regex": "[a-z]+"}), "leapdecode.regex"),
    (chat(functions=[{"name": "f"}]), "functions"),
    ({"model": MODEL, "prompt": "Hi", "tools": TOOLS}, "tools"),  # /v1/completions
    (chat(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}]),
     "messages[0].tool_calls"),
    (chat(messages=ASK + [{"role": "tool", "content": "{}"}]), "messages[1].tool_call_id"),
    (chat(messages=ASK + [{"role": "assistant", "content": None}]), "messages[1].content"),
    (chat(messages=ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "not json"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (chat(messages=ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]),
     "messages[1].tool_calls[0].function"),
    # valid by the metaschema, but a keyword llguidance does not implement: found when compiling
    (chat(tools=[TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], tool_choice="required"),
     "tools[1].function.parameters"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_invalid_requests_are_400s_naming_the_field(server, body, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    if param in ("functions", "tools") and path == "/v1/completions" or param == "functions":
        assert error["code"] == "unsupported_parameter"


def test_error_messages_say_what_is_wrong(server):
    def message(body):
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400
        return r.json()["error"]["message"]

    assert "unique" in message(chat(tools=[TOOLS[0], TOOLS[0]]))
    assert "'fly'" in message(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}))
    assert "objekt" in message(chat(tools=[{"type": "function", "function": {"name": "f",
                                                                           "parameters": {"type": "objekt"}}}]))
    assert "uniqueItems" in message(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"uniqueItems": True}}}}}], tool_choice="required"))


@pytest.fixture
def unserved():
    """``unserved(model)`` -> an app that is never served (its requests are prepared directly)."""
    apps = []

    def make(model):
        apps.append(create_app(model, ServeConfig(default_method="vanilla")))
        return apps[-1]

    yield make
    for app in apps:
        app.state.engine.stop()


def test_templates_without_tools_refuse_them(unserved):
    """ChatML without ``tools`` (the tiny model's own, smollm2's): tools are a 400 unless
    tool_choice is "none" (then the template never sees them)."""
    app = unserved(tiny_loaded(name=MODEL))
    cfg, runner = app.state.config, app.state.runner

    def prep(**kw):
        return prepare_mod.constrain(prepare_mod.prepare("chat", json.dumps(chat(**kw)).encode(), cfg, runner), runner)

    with pytest.raises(ApiError) as e:
        prep(tools=TOOLS)
    assert e.value.status == 400 and e.value.param == "tools" and "does not support tools" in e.value.message
    with pytest.raises(ApiError) as e:
        prep(messages=HISTORY)
    assert e.value.param == "messages[1]"
    p = prep(tools=TOOLS, tool_choice="none")
    assert p.tools is None and p.specs[0].request.constraint is None
    assert p.specs[0].prompt_ids == prep().specs[0].prompt_ids


def test_prompt_carries_tools_and_past_calls(unserved):
    """The template gets the tools (OpenAI's shape) and past calls with arguments as objects."""
    app = unserved(tools_model())
    cfg, runner, tok = app.state.config, app.state.runner, app.state.runner.model.tokenizer

    def prompt(**kw):
        p = prepare_mod.constrain(prepare_mod.prepare("chat", json.dumps(chat(**kw)).encode(), cfg, runner), runner)
        return p, tok.decode(p.specs[0].prompt_ids)

    p, text = prompt(tools=TOOLS, messages=HISTORY)
    assert p.tools is not None and p.tools.mode == "auto" and p.specs[0].request.constraint is None
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text  # described to the model
    assert '"name": "now", "description": "The time", "parameters": {"type": "object"' in text  # none: {}
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>' in text
    assert '<tool_response>\n{"sky": "snow"}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    p, text = prompt(tools=TOOLS, tool_choice="none", messages=HISTORY)
    assert p.tools is None and "<tools>" not in text and "<tool_response>" in text
    p, _ = prompt(tools=TOOLS, tool_choice="required", n=2)
    assert p.tools.mode == "required" and all(s.request.constraint is not None for s in p.specs)
    assert p.specs[0].request.constraint is not p.specs[1].request.constraint  # one grammar state per choice


# ---------------------------------------------------------------------------- constrained calls, end to end
def test_required_tool_call(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.role == "assistant" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls not asked for: one call
    check_call(choice.message.tool_calls[0])
    assert r.usage.completion_tokens > 0


def test_named_function_with_sampling_and_n(client):
    """Every sampled choice calls the named function with valid arguments (each its own grammar)."""
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=3, temperature=1.0, seed=11,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=200)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather"
        check_call(call)
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 3
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "now"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "now" and json.loads(call.function.arguments) == {}


def test_parallel_calls_when_asked(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=True, max_tokens=400, temperature=1.0, seed=3)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":  # the model chose to stop: every call is valid
        assert c.message.tool_calls and all(check_call(call) is not None for call in c.message.tool_calls)
    else:  # it went on calling until max_tokens: a cut call leaves the text as it is
        assert c.finish_reason == "length"
        assert c.message.tool_calls or c.message.content.startswith("<tool_call>\n{")


def test_streamed_tool_call_with_the_openai_client(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    full = client.chat.completions.create(**kw)
    calls, content, finish, roles = {}, [], None, []
    with client.chat.completions.create(stream=True, **kw) as s:
        for chunk in s:
            d = chunk.choices[0].delta
            roles += [d.role] if d.role else []
            content += [d.content] if d.content else []
            for tc in d.tool_calls or []:
                calls[tc.index] = tc
            finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"] and not content and finish == "tool_calls"
    (call,) = calls.values()
    want = full.choices[0].message.tool_calls[0]
    assert call.function.name == want.function.name and call.function.arguments == want.function.arguments
    assert call.type == "function" and call.id.startswith("call_")
    check_call(call)
    # the client's own accumulator parses it into a final message
    with client.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.function.name == want.function.name and call.function.arguments == want.function.arguments


def test_auto_streams_the_same_content_as_unstreamed(client):
    """With tool_choice auto the noise model never calls: its text is content, streamed or not."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kw).choices[0]
    assert full.message.tool_calls is None and full.message.content and full.finish_reason == "length"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
              if c.choices]
    assert "".join(pieces) == full.message.content


def test_multi_turn_with_tool_messages_is_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens > 100
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=0)
    check_call(r.choices[0].message.tool_calls[0])


def test_wire_format(server):
    body = chat(tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    got = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    message = got["choices"][0]["message"]
    assert set(message) == {"role", "content", "tool_calls"} and message["content"] is None
    (call,) = message["tool_calls"]
    assert set(call) == {"id", "type", "function"} and set(call["function"]) == {"name", "arguments"}
    plain = httpx.post(server.url + "/v1/chat/completions", json=chat(temperature=0), timeout=60).json()
    assert set(plain["choices"][0]["message"]) == {"role", "content"}  # no tool_calls key without calls
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    (tc,) = deltas[-2]["tool_calls"]
    assert tc["index"] == 0 and tc["function"]["name"] == call["function"]["name"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------------------- grammar and parser
def test_grammar_accepts_exactly_hermes_calls():
    from leapdecode import runner_for
    from leapdecode.constraints.grammar import compile_constraint

    model = tiny_loaded(name="tiny-random")
    tok, runner = model.tokenizer, runner_for(model)
    tools = (Tool("get_weather", None, WEATHER), Tool("now"))
    assert special_tags(tok, lambda t: True) == frozenset()  # the byte tokenizer has no tag token

    def accepts(calling, text):
        c = compile_constraint(runner, grammar=tool_call_grammar(calling))
        for t in tok.encode(text):
            if not c.allows(t):
                return False
            c.push(t)
        return c.done

    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    required = ToolCalling(tools, "required")
    assert accepts(required, one) and not accepts(required, two)
    assert accepts(ToolCalling(tools, "required", parallel=True), two)
    assert not accepts(ToolCalling(tools, "function", "now"), one)
    assert accepts(ToolCalling(tools, "function", "now"), '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    for bad in (one.replace("Lima", "Rome"), one.replace(", \"days\": 2", ""), one.replace(": {", ":  {"),
                one.replace("<tool_call>\n", "")):
        assert not accepts(required, bad), bad
    assert call_schema(tools[1:])["properties"]["arguments"] == tools[1].parameters
    # a parameters schema with its own $defs: its references still resolve once it is embedded
    units = {"$defs": {"Unit": {"enum": ["c", "f"]}}, "type": "object", "required": ["unit"],
             "properties": {"unit": {"$ref": "#/$defs/Unit"}, "also": {"const": {"$ref": "#/x"}}}}
    for calling in (ToolCalling((Tool("temp", None, units),), "required"),
                    ToolCalling((Tool("temp", None, units), tools[1]), "required")):
        good = '<tool_call>\n{"name": "temp", "arguments": {"unit": "f"}}\n</tool_call>'
        assert accepts(calling, good) and not accepts(calling, good.replace('"f"', '"k"'))
    assert call_schema([Tool("temp", None, units)])["properties"]["arguments"]["properties"]["also"] == \
        {"const": {"$ref": "#/x"}}  # a value, not a reference


def test_hermes_parser():
    names = {"get_weather", "now"}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    p = parse_tool_calls(call, names)
    assert p.content is None and [(c.name, json.loads(c.arguments)) for c in p.calls] == \
        [("get_weather", {"city": "Oslo", "days": 3})]
    assert p.calls[0].id.startswith("call_")
    # text before the calls is content; two calls; text after the last one is dropped
    p = parse_tool_calls("Let me look.\n\n" + call + "\n" + call.replace("Oslo", "Lima") + "\nDone.", names)
    assert p.content == "Let me look." and [json.loads(c.arguments)["city"] for c in p.calls] == ["Oslo", "Lima"]
    assert p.calls[0].id != p.calls[1].id
    # a last block without its closing tag (the model stopped there)
    p = parse_tool_calls('<tool_call>\n{"name": "now", "arguments": {}}', names)
    assert [(c.name, c.arguments) for c in p.calls] == [("now", "{}")]
    # arguments written as a JSON string, or missing
    p = parse_tool_calls('<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', names)
    assert json.loads(p.calls[0].arguments) == {"tz": "UTC"}
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>', names).calls[0].arguments == "{}"
    # calls without tags (Qwen2.5-Coder-0.5B's way), bare or fenced
    bare = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}'
    for text in (bare, f"\n{bare}\n", f"```json\n{bare}\n```", f"{bare}\n{bare}"):
        p = parse_tool_calls(text, names)
        assert p.content is None and p.calls and all(c.name == "get_weather" for c in p.calls), text
    # all or nothing: anything that is not a call to a known function leaves the text as content
    for text in ("Hello there.", call.replace("get_weather", "fly"), call.replace("}}", "}"),
                 call + "<tool_call>not json</tool_call>", '<tool_call>["now"]</tool_call>',
                 '<tool_call>{"name": "now", "arguments": [1]}</tool_call>', '{"city": "Oslo"}',
                 bare + " and more", '{"name": "fly", "arguments": {}}'):
        p = parse_tool_calls(text, names)
        assert p.calls == () and p.content == text, text


@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_filter_holds_back_what_may_be_a_call(step):
    names = frozenset({"now"})
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'

    def run(text, hold_all=False):
        f = ToolTextFilter(names, hold_all)
        sent = "".join(f.feed(text[i:i + step]) for i in range(0, len(text), step))
        rest, calls = f.finish(text)
        return sent, rest, calls

    sent, rest, calls = run("Let me check.  \n" + call)
    assert sent + rest == "Let me check." and [c.name for c in calls] == ["now"]
    assert not sent.endswith(" ") and "<" not in sent
    sent, rest, calls = run("a < b and <tool is not <tool_call")  # ends like a tag that never came
    assert sent + rest == "a < b and <tool is not <tool_call" and calls == ()
    assert sent.startswith("a < b")  # content before a possible tag is not held back
    sent, rest, calls = run(call, hold_all=True)
    assert sent == rest == "" and len(calls) == 1
    sent, rest, calls = run("no call at all", hold_all=True)  # a constrained text that did not parse
    assert sent == "" and rest == "no call at all" and calls == ()
    sent, rest, calls = run('{"name": "now", "arguments": {}}')  # maybe a bare call: held, and it is one
    assert sent == rest == "" and len(calls) == 1
    sent, rest, calls = run('{"a": 1} is JSON')
    assert sent == "" and rest == '{"a": 1} is JSON' and calls == ()


# ---------------------------------------------------------------------------- a real template
def _installed(name: str) -> bool:
    from leapdecode.models.store import cache_dir

    return (cache_dir() / "models" / name / "leapdecode.json").exists()


@pytest.mark.integration
@pytest.mark.skipif(not _installed("qwen2.5-coder-0.5b"), reason="qwen2.5-coder-0.5b is not installed "
                    "(leapdecode models fetch qwen2.5-coder-0.5b)")
def test_qwen_template_and_special_tags():
    """Qwen2.5's template reads tools; its <tool_call> tags are special tokens, which the grammar
    must name as such (llguidance never matches a special token as text)."""
    from fastapi.testclient import TestClient

    from leapdecode.models.loader import load
    from leapdecode.constraints.grammar import grammar_tokenizer

    model = load("qwen2.5-coder-0.5b")
    app = create_app(model, ServeConfig(default_method="vanilla"))
    assert special_tags(model.tokenizer, grammar_tokenizer(app.state.runner).is_special_token) == \
        frozenset({"<tool_call>", "</tool_call>"})
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                               "parameters": {"type": "object", "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    with TestClient(app) as c:
        body = {"model": "qwen2.5-coder-0.5b", "max_tokens": 40, "temperature": 0, "tools": tools,
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
        for choice in ("required", "auto"):
            got = c.post("/v1/chat/completions", json={**body, "tool_choice": choice}).json()["choices"][0]
            assert got["finish_reason"] == "tool_calls", (choice, got)
            (call,) = got["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"])["city"] == "Paris"
