"""The OpenAI-compatible server, driven with the real ``openai`` client (and httpx for raw HTTP).

One in-process server (uvicorn in a background thread on a free loopback port) serves
``tiny-random`` for the whole module, with one draft (``tiny-random:1``) loaded at start-up; the
reference outputs come from a second, identical ``tiny-random`` instance so that the test never
touches the served model's runner while the engine thread may be using it.

No assertion here is about elapsed time: waits are bounded (``eventually``) only so that a
broken server fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from leapdecode import generate  # noqa: E402
from leapdecode.core.prompt import encode_prompt  # noqa: E402
from leapdecode.errors import InvalidParameterError  # noqa: E402
from leapdecode.models.loader import load  # noqa: E402
from leapdecode.server import engine as engine_mod  # noqa: E402
from leapdecode.server import prepare as prepare_mod  # noqa: E402
from leapdecode.server.app import create_app  # noqa: E402
from leapdecode.server.config import ServeConfig  # noqa: E402
from leapdecode.server.engine import (Delta, Ended, Engine, Failed, Finished, GenSpec, Started,  # noqa: E402
                                      build_runner)

from helpers.scripts import load_script  # noqa: E402
from helpers.server import collect_job_events, eventually, start_server  # noqa: E402

LONG = 1500  # max_tokens of a greedy generation (no EOS: 'Hello'/'Hi' run to the limit) far longer than any wait
DRAFT = "tiny-random:1"


@pytest.fixture(scope="module")
def server():
    model = load("tiny-random", dtype="fp32")
    app = create_app(model, ServeConfig(default_method="vanilla", drafts=(DRAFT,), max_queue=4, request_timeout=60))
    srv, thread, url = start_server(app)
    yield SimpleNamespace(url=url, app=app, engine=app.state.engine, config=app.state.config, model=model,
                          runner=app.state.runner)
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def ref():
    """An identical model for reference outputs (deterministic weights)."""
    return load("tiny-random", dtype="fp32")


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def wait_idle(engine):
    eventually(lambda: not engine.busy and not engine.queue_depth, "the engine did not go idle")


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def ref_generate(ref, prompt, **kw):
    return generate(ref, prompt, method="vanilla", **kw)


CHAT = [{"role": "user", "content": "Say hello."}]


# ---------------------------------------------------------------------------- endpoints
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-random"]
    assert client.models.retrieve("tiny-random").id == "tiny-random"
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == "tiny-random"


def test_chat_completion_matches_generate(client, ref):
    r = client.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=24, temperature=0)
    want = ref_generate(ref, CHAT, max_new_tokens=24, temperature=0.0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(encode_prompt(ref, CHAT))
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = extra(r, "leapdecode")
    assert stats["method"] == "vanilla" and stats["mean_accepted"] == 1.0 and stats["draft"] is None
    assert stats["new_tokens"] == len(want.tokens) and stats["target_forwards"] == len(want.tokens)


def test_text_completion_and_echo(client, ref):
    r = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=12, temperature=0)
    want = ref_generate(ref, "Hello", max_new_tokens=12, temperature=0.0)
    assert r.object == "text_completion"
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    r2 = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=12, temperature=0, echo=True)
    assert r2.choices[0].text == "Hello" + want.text
    # token-id prompts and a batch of prompts
    ids = ref.tokenizer.encode("Hello")
    r3 = client.completions.create(model="tiny-random", prompt=[ids, "Hello"], max_tokens=12, temperature=0)
    assert [c.text for c in r3.choices] == [want.text, want.text] and r3.usage.prompt_tokens == 10


def test_streaming_chat_equals_non_streamed(client):
    kw = dict(model="tiny-random", messages=CHAT, max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kw)
    pieces, finish, stats, roles = [], None, None, []
    with client.chat.completions.create(stream=True, **kw) as s:
        for chunk in s:
            assert chunk.object == "chat.completion.chunk"
            d = chunk.choices[0].delta
            if d.role:
                roles.append(d.role)
            if d.content:
                pieces.append(d.content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
                stats = extra(chunk, "leapdecode")
    assert len(pieces) > 1  # streamed, not sent in one piece at the end
    assert "".join(pieces) == full.choices[0].message.content
    assert roles == ["assistant"] and finish == full.choices[0].finish_reason
    assert stats["new_tokens"] == full.usage.completion_tokens


def test_streaming_completion_with_usage(client, ref):
    want = ref_generate(ref, "Hello", max_new_tokens=20, temperature=0.0)
    texts, usage, finishes = [], None, []
    for chunk in client.completions.create(model="tiny-random", prompt="Hello", max_tokens=20, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
            assert not chunk.choices
        for c in chunk.choices:
            texts.append(c.text)
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert len([t for t in texts if t]) > 1 and "".join(texts) == want.text
    assert finishes == ["length"]
    assert usage.prompt_tokens == 5 and usage.completion_tokens == 20


def test_stream_chunks_on_the_wire(server):
    """Without include_usage a chunk has no usage field; role and content appear only when set."""
    body = {"model": "tiny-random", "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["leapdecode"]["method"] == "vanilla"
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in chunks[1:-1])


def test_stop_strings(client, ref):
    base = ref_generate(ref, "Hello", max_new_tokens=30, temperature=0.0).text
    stop = next(ch for ch in base[3:] if ch.isalnum())  # a character that appears a few pieces in
    want = ref_generate(ref, "Hello", max_new_tokens=30, temperature=0.0, stop=[stop])
    assert want.finish_reason == "stop" and stop not in want.text
    r = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-random", prompt="Hello", max_tokens=30, temperature=0, stop=stop, stream=True))
    assert streamed == want.text
    assert r.usage.completion_tokens == len(want.tokens)


def test_n_choices_and_seeds(client, ref):
    r = client.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=10, temperature=1.0,
                                       seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    refs = [ref_generate(ref, CHAT, max_new_tokens=10, temperature=1.0, seed=7 + k) for k in range(3)]
    want = [g.text for g in refs]
    assert [c.message.content for c in r.choices] == want
    assert r.usage.completion_tokens == sum(len(g.tokens) for g in refs)
    assert r.usage.prompt_tokens == len(encode_prompt(ref, CHAT))  # counted once for all n
    assert len(extra(r, "leapdecode")["choices"]) == 3
    again = client.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=10, temperature=1.0,
                                           seed=7, n=3)
    assert [c.message.content for c in again.choices] == want
    # streamed n > 1: each index gets its own text and finish
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.completions.create(model="tiny-random", prompt="Hello", max_tokens=8, temperature=0,
                                           n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert texts[0] == texts[1] == ref_generate(ref, "Hello", max_new_tokens=8, temperature=0.0).text
    assert finished == {0, 1}


def test_method_extension_is_lossless(client):
    kw = dict(model="tiny-random", prompt="Hello", max_tokens=24, temperature=0)
    plain = client.completions.create(**kw)
    r = client.completions.create(**kw, extra_body={"leapdecode": {"method": "draft", "draft": DRAFT}})
    stats = extra(r, "leapdecode")
    assert stats["method"] == "draft" and stats["draft"] == DRAFT
    assert r.choices[0].text == plain.choices[0].text
    assert stats["mean_accepted"] >= 1.0 and stats["target_forwards"] <= 24
    # the server's default draft (the first loaded) when the request names none
    r = client.completions.create(**kw, extra_body={"leapdecode": {"method": "draft"}})
    assert extra(r, "leapdecode")["draft"] == DRAFT and r.choices[0].text == plain.choices[0].text
    # method options, validated against the method's config
    r = client.completions.create(**kw, extra_body={"leapdecode": {"method": "pld",
                                                                   "options": {"max_ngram": 3, "draft_len": 4}}})
    assert extra(r, "leapdecode")["method"] == "pld" and r.choices[0].text == plain.choices[0].text
    r = client.completions.create(**kw, extra_body={"leapdecode": {"method": "draft",
                                                                   "options": {"draft": DRAFT, "top_k": 2}}})
    assert extra(r, "leapdecode")["draft"] == DRAFT and r.choices[0].text == plain.choices[0].text


# ---------------------------------------------------------------------------- errors
def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_a_body_that_is_not_declared_json_is_refused(server):
    """Issue 45 (probe HS02): a web page can make a browser POST text/plain, form or multipart bodies
    to a local server without a CORS check; such a body must not run a generation."""
    body = b'{"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": ctype})
        assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type", ctype
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": ctype})
        assert r.status_code == 200, (ctype, r.text)


def test_a_message_that_is_not_utf8_is_a_400(server):
    """Issue 45 (probe HS23): a lone surrogate in a message was a 500 (the tokenizer's TypeError)."""
    body = b'{"model": "tiny-random", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800"}]}'
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid UTF-8" in error_of(r)["message"], r.text


def test_a_response_format_schema_nested_too_deep_is_a_400(server):
    """Probe HR06: a response_format schema nested 2,000 levels was a 500 (RecursionError)."""
    schema = '{"type": "object", "properties": {"a": ' * 2000 + '{"type": "object"}' + "}}" * 2000
    body = ('{"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' + schema + "}}}")
    r = httpx.post(server.url + "/v1/chat/completions", content=body.encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in error_of(r)["message"], r.text[:300]


def test_max_tokens_and_max_completion_tokens_must_agree(server):
    """Issue 45 (probe HS45): both limits given and different was 4 tokens, the other silently ignored."""
    base = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json={**base, "max_tokens": 4, "max_completion_tokens": 3})
    assert r.status_code == 400 and error_of(r)["param"] == "max_completion_tokens", r.text
    assert "disagree" in error_of(r)["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={**base, "max_tokens": 3, "max_completion_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text


def test_malformed_and_missing(server):
    url = server.url
    r = httpx.post(url + "/v1/chat/completions", content=b'{"model": "tiny-random", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    r = httpx.post(url + "/v1/chat/completions", json=["not", "an", "object"])
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-random"})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    assert error_of(r)["code"] == "missing_required_parameter"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and error_of(r)["param"] == "model"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-random", "messages": [{"role": "robot"}]})
    assert r.status_code == 400 and error_of(r)["param"] == "messages[0].role" and "role" in error_of(r)["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-random", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and error_of(r)["param"] == "messages[0].content"
    assert error_of(r)["code"] == "unsupported_parameter"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
    assert error_of(r)["message"] == 'max_tokens must be an integer, got "many"'
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "x", "stream": "yes"})
    assert r.status_code == 400 and error_of(r)["param"] == "stream"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": [], "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": [[1, 99999]], "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt"
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "x", "leapdecode": "fast"})
    assert r.status_code == 400 and error_of(r)["param"] == "leapdecode"
    r = httpx.get(url + "/v1/nothing-here")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_limits(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=5000)
    assert "5000" in e.value.message and "2048" in e.value.message and e.value.param == "max_tokens"
    assert e.value.code == "max_tokens_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # prompt + max_tokens over the context
        client.completions.create(model="tiny-random", prompt="a" * 2000, max_tokens=100)
    assert e.value.code == "context_length_exceeded" and "2048" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # the prompt alone fills the context
        client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "a" * 2100}])
    assert e.value.code == "context_length_exceeded" and "2048" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="Hi", n=1000)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="Hi", n=2, best_of=3)
    assert e.value.param == "best_of" and e.value.code == "unsupported_parameter"


@pytest.mark.parametrize("kw", [dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_sampling_params(client, kw):
    from leapdecode.core.sampling import SamplingParams

    args = dict(temperature=kw.get("temperature", 1.0), top_p=kw.get("top_p", 1.0))
    with pytest.raises(InvalidParameterError) as want:
        SamplingParams(**args)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4, **kw)
    assert e.value.status_code == 400 and e.value.body["message"] == str(want.value)
    assert e.value.param == next(iter(kw))


def test_bad_extension_fields(client):
    for ext, param in (({"method": "telepathy"}, "leapdecode.method"),
                       ({"draft": "/etc/passwd"}, "leapdecode.draft"),  # vanilla takes no draft
                       ({"method": "draft", "draft": "/etc/passwd"}, "leapdecode.draft"),
                       ({"colour": "red"}, "leapdecode.colour"),
                       ({"top_k": -1}, "leapdecode.top_k"),
                       ({"tree_budget": 0}, "leapdecode.tree_budget"),
                       ({"method": "pld", "options": "fast"}, "leapdecode.options"),
                       ({"method": "pld", "options": {"max_ngram": 0}}, "leapdecode.options.max_ngram"),
                       ({"method": "pld", "options": {"min_ngram": 3, "max_ngram": 2}},
                        "leapdecode.options")):  # each is valid alone: the combination is not
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4, extra_body={"leapdecode": ext})
        assert e.value.param == param, (ext, e.value.message)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4, logprobs=2)
    assert e.value.code == "unsupported_parameter" and e.value.param == "logprobs"


def test_an_error_quoting_a_huge_value_is_bounded(client):
    """A message that quotes the client's value (an unknown method's name) echoes at most
    MAX_ERROR_MESSAGE characters of it, whatever the request's size."""
    from leapdecode.server.protocol import MAX_ERROR_MESSAGE

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4,
                                  extra_body={"leapdecode": {"method": "x" * 200_000}})
    assert e.value.param == "leapdecode.method" and "unknown method" in e.value.message
    assert len(e.value.body["message"]) == MAX_ERROR_MESSAGE


def test_unknown_option_names_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4,
                                  extra_body={"leapdecode": {"method": "pld", "options": {"colour": "red"}}})
    assert e.value.status_code == 400 and e.value.param == "leapdecode.options.colour"
    assert "'colour'" in e.value.message and "pld" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # an option of another method
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4,
                                  extra_body={"leapdecode": {"options": {"max_ngram": 3}}})
    assert e.value.param == "leapdecode.options.max_ngram" and "vanilla" in e.value.message


def test_unloaded_draft_is_a_400_and_loads_nothing(client, server, monkeypatch):
    import leapdecode.models.loader as loader

    def no_loading(*args, **kwargs):
        pytest.fail(f"a request loaded a model: load{args}")

    monkeypatch.setattr(loader, "load", no_loading)
    drafts_before = dict(server.runner.drafts)
    for ext, param in (({"method": "draft", "draft": "qwen2.5-coder-0.5b"}, "leapdecode.draft"),
                       ({"method": "draft", "options": {"draft": "tiny-random:7"}}, "leapdecode.options.draft"),
                       ({"method": "auto", "draft": "smollm2-135m"}, "leapdecode.draft")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4, extra_body={"leapdecode": ext})
        assert e.value.param == param and e.value.code == "model_not_found"
        assert DRAFT in e.value.message  # says what is loaded
    assert server.runner.drafts == drafts_before
    # the loaded draft still works, with nothing loaded
    r = client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4,
                                  extra_body={"leapdecode": {"method": "draft", "draft": DRAFT}})
    assert r.choices[0].finish_reason == "length"


def test_api_key(server):
    server.config.api_keys = ("s3cret",)
    try:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(server.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=2)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0) as c:
            assert c.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=2).choices
        assert httpx.get(server.url + "/health").status_code == 200  # health stays open
    finally:
        server.config.api_keys = ()


def test_N_AUTH7_metrics_need_the_key_unless_made_public(server):
    """Probe N-AUTH7: /metrics (request counts by status, process memory) answered without the key."""
    server.config.api_keys = ("k1", "k2")
    try:
        assert httpx.get(server.url + "/metrics").status_code == 401
        assert httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
        for key in ("k1", "k2"):  # every tenant's key opens it
            r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and "leapdecode_proposer_memory_bytes" in r.text
        server.config.metrics_public = True
        assert httpx.get(server.url + "/metrics").status_code == 200
    finally:
        server.config.api_keys, server.config.metrics_public = (), False


# ---------------------------------------------------------------------------- internal faults
def test_internal_fault_is_a_500_with_a_logged_id(server, client, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("the server is shutting down (not really: an internal fault)")

    monkeypatch.setattr(engine_mod, "start_request", boom)
    caplog.set_level(logging.ERROR, logger="leapdecode.server")
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny-random", "prompt": "Hi", "max_tokens": 4, "stream": stream})
        err = error_of(r)
        assert r.status_code == 500 and err["type"] == "server_error" and err["code"] == "internal_error"
        error_id = r.headers["x-error-id"]
        assert error_id in err["message"] and "shutting down" not in err["message"]
        logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info and logged[0].exc_info[0] is RuntimeError
    monkeypatch.undo()
    assert client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4).choices  # still serving


def test_fault_mid_stream_is_an_error_event_with_a_logged_id(server, monkeypatch, caplog):
    real_start = GenSpec.start

    def start(self, runner):
        gen = real_start(self, runner)
        real_next, steps = gen.next_forwards, []

        def next_forwards(cap=None):  # what the engine calls once per iteration
            steps.append(1)
            if len(steps) == 4:
                raise RuntimeError("kaput")
            return real_next(cap)

        gen.next_forwards = next_forwards
        return gen

    monkeypatch.setattr(GenSpec, "start", start)
    caplog.set_level(logging.ERROR, logger="leapdecode.server")
    body = {"model": "tiny-random", "prompt": "Hello", "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "internal_error" and "kaput" not in error["message"]
    error_id = re.search(r"error id (\w+)", error["message"]).group(1)
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info[0] is RuntimeError
    wait_idle(server.engine)
    assert server.runner.caches_in_use == 0  # the failed generation gave its cache back


# ---------------------------------------------------------------------------- body size, event loop
def test_oversized_body_is_a_413(server):
    limit = server.config.max_body_bytes
    prompt = "x" * (limit + 10)
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny-random", "prompt": prompt}, timeout=60)
    assert r.status_code == 413
    err = error_of(r)
    assert str(limit) in err["message"] and err["code"] == "request_too_large"

    async def chunked():  # no Content-Length: cut off while reading
        async def body():
            for _ in range(limit // 65536 + 4):
                yield b" " * 65536

        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await c.post("/v1/chat/completions", content=body(), headers={"content-type": "application/json"})

    r = asyncio.run(chunked())
    assert r.status_code == 413 and str(limit) in error_of(r)["message"]
    metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r'leapdecode_requests_total\{endpoint="/v1/completions",status="413"\} [1-9]', metrics)


def test_health_answers_while_a_big_body_is_sent_and_rejected(server):
    """/health is answered while a 10 MB body is being uploaded (the upload waits for it)."""
    async def scenario():
        health = []

        async with httpx.AsyncClient(base_url=server.url, timeout=60) as up, \
                httpx.AsyncClient(base_url=server.url, timeout=60) as h:
            async def body():
                chunk = b" " * (256 * 1024)
                for i in range(40):  # 10 MiB
                    if i == 2:  # mid-upload: the server is reading this request's body
                        health.append((await h.get("/health")).json())
                    yield chunk

            r = await up.post("/v1/completions", content=body(), headers={"content-type": "application/json"})
            status = r.status_code
            after = (await h.get("/health")).json()
        return health, status, after

    health, status, after = asyncio.run(scenario())
    assert [x["status"] for x in health] == ["ok"] and after["status"] == "ok"
    assert status == 413


def test_tokenization_runs_off_the_event_loop(server, client, monkeypatch):
    """While a request's prompt is being tokenized (held here until /health has answered), the
    event loop serves other requests."""
    entered, release = threading.Event(), threading.Event()
    real = prepare_mod.encode_prompt

    def slow_encode(*args, **kwargs):
        entered.set()
        assert release.wait(60), "never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_mod, "encode_prompt", slow_encode)
    result = {}

    def request():
        result["r"] = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=3)

    t = threading.Thread(target=request)
    t.start()
    try:
        assert entered.wait(60)
        h = httpx.get(server.url + "/health", timeout=30)  # a blocked event loop would time out here
        assert h.status_code == 200
        assert client.models.list().data
    finally:
        release.set()
        t.join(60)
    assert result["r"].choices[0].finish_reason == "length"


def test_a_grammar_the_engine_cannot_follow_is_a_400(client, server):
    """Probes HR11, HR19: a huge repetition compiles, then hits the grammar engine's limits while
    generating: a 400 naming it (not a 500), and the server goes on."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="x", max_tokens=6,
                                  extra_body={"leapdecode": {"regex": "(a{1000}){1000}"}})
    assert "hit one of its limits while generating" in e.value.message
    assert client.completions.create(model="tiny-random", prompt="Hi", max_tokens=3).choices[0].text is not None


def test_a_slow_grammar_holds_no_plain_request_and_preparation_is_bounded(server, client, monkeypatch):
    """Probe HR22: while a structured request's grammar compiles (held here), a plain request is
    prepared and answered; requests in preparation count against the limit (a 429 beyond it)."""
    from leapdecode.constraints import grammar

    entered, release = threading.Event(), threading.Event()
    real = grammar.compile_constraint

    def slow_compile(*args, **kwargs):
        entered.set()
        assert release.wait(60), "never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(grammar, "compile_constraint", slow_compile)
    preparer = server.app.state.preparer
    result = {}

    def structured():
        result["r"] = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=3,
                                                extra_body={"leapdecode": {"regex": "[ab]+"}})

    t = threading.Thread(target=structured)
    t.start()
    try:
        assert entered.wait(60)
        plain = client.completions.create(model="tiny-random", prompt="Hi", max_tokens=3)
        assert plain.choices[0].finish_reason == "length"  # answered while the grammar compiles
        assert preparer.pending == 1
        preparer.limit = 1
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny-random", prompt="Hi", max_tokens=3)
        assert e.value.code == "queue_full" and int(e.value.response.headers["retry-after"]) >= 1
    finally:
        preparer.limit = server.engine.max_queue
        release.set()
        t.join(60)
    assert set(result["r"].choices[0].text) <= {"a", "b"} and preparer.pending == 0


def wide_schema(properties: int, tag: str = "") -> dict:
    """A schema as slow to check as ``properties`` properties (its unused ``$defs``), that the grammar
    engine follows easily (a row of thousands of optional properties it cannot)."""
    return {"type": "object", "properties": {"a": {"type": "integer"}},
            "$defs": {f"{tag}d{i}": {"type": "integer"} for i in range(properties)}}


def structured_chat(schema: dict) -> dict:
    return {"model": "tiny-random", "max_tokens": 3, "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def test_the_engine_gives_freed_memory_back_after_requests_end(server, client, monkeypatch):
    """scripts/soak.py: the resident memory of a server kept climbing past its warm-up though every
    cache stayed within its budget; freed heap pages go back to the system after requests end."""
    trims = []
    monkeypatch.setattr(engine_mod, "trim_heap", lambda: trims.append(1))
    server.engine._trimmed_at = 0.0
    client.completions.create(model="tiny-random", prompt="Hi", max_tokens=2)
    wait_idle(server.engine)
    assert trims == [1]
    client.completions.create(model="tiny-random", prompt="Hi", max_tokens=2)  # rate-limited: not again at once
    wait_idle(server.engine)
    assert trims == [1]
    monkeypatch.undo()
    engine_mod.trim_heap()  # the real one: glibc's malloc_trim here, harmless


def test_HR22_a_schema_is_checked_in_a_child_process_once(server, monkeypatch):
    """Probe HR22: a large schema's metaschema check (pure Python, seconds, holding the interpreter
    lock: decoding ran 2.8x slower beside it) ran on the server's own threads, three times per request.
    Now the server process never runs it: the child checks a schema once, and the request's validation
    and compilation find it checked."""
    import jsonschema

    def in_this_process(*args, **kwargs):
        raise AssertionError("a metaschema check ran in the server process")

    monkeypatch.setattr(jsonschema.validators, "validator_for", in_this_process)
    checker = server.app.state.preparer.checker
    before = checker.checks
    schema = wide_schema(2000, tag="hr22")
    for _ in range(2):
        r = httpx.post(server.url + "/v1/chat/completions", json=structured_chat(schema), timeout=60)
        assert r.status_code == 200, r.text
    assert checker.checks == before + 1  # checked once, in the child; the repeat found it checked
    bad = httpx.post(server.url + "/v1/chat/completions", json=structured_chat({"type": "nonsense"}), timeout=60)
    assert bad.status_code == 400 and error_of(bad)["param"] == "response_format.json_schema.schema"
    assert "nonsense" in error_of(bad)["message"]


def test_HR22_a_schema_past_the_size_bound_is_refused_before_any_work(server):
    """Probe HR22: two 20,000-property schemas (600 KB) held the server for seconds before a 400."""
    checker = server.app.state.preparer.checker
    before, limit = checker.checks, server.config.max_grammar_bytes
    r = httpx.post(server.url + "/v1/chat/completions", json=structured_chat(wide_schema(20000)), timeout=60)
    e = error_of(r)
    assert r.status_code == 400 and e["code"] == "grammar_too_large" and f"at most {limit}" in e["message"]
    assert "--max-grammar-bytes" in e["message"] and checker.checks == before


def test_HR22_a_check_past_its_time_budget_is_a_400_and_the_next_one_runs(server):
    checker = server.app.state.preparer.checker
    timeout = checker.timeout_s
    checker.timeout_s = 0.001  # no schema is checked that fast: the child is killed
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json=structured_chat(wide_schema(3000, tag="slow")),
                       timeout=60)
        assert r.status_code == 400 and "took more than 0.001 s to check" in error_of(r)["message"]
        assert "--grammar-timeout" in error_of(r)["message"]
    finally:
        checker.timeout_s = timeout
    r = httpx.post(server.url + "/v1/chat/completions", json=structured_chat(wide_schema(3000, tag="slow")),
                   timeout=60)
    assert r.status_code == 200, r.text  # a new child checked it


# ---------------------------------------------------------------------------- queue, cancellation, timeout
def test_queue_full_gives_429_and_disconnects_free_slots(server):
    engine, url = server.engine, server.url
    wait_idle(engine)
    cancelled0 = engine.counters["cancelled"]
    engine.max_queue, engine.max_batch = 1, 1  # one running, one waiting: the next is refused

    async def scenario():
        started = asyncio.Event()

        async def long_stream(c):
            body = {"model": "tiny-random", "prompt": "Hello", "max_tokens": LONG, "stream": True, "temperature": 0}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        started.set()

        async with httpx.AsyncClient(base_url=url, timeout=60) as c1, httpx.AsyncClient(base_url=url) as c2:
            running = asyncio.create_task(long_stream(c1))
            await asyncio.wait_for(started.wait(), 60)
            queued = asyncio.create_task(long_stream(c2))
            while engine.queue_depth < 1:
                await asyncio.sleep(0.01)
            oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError) as e:
                await oc.completions.create(model="tiny-random", prompt="Hi", max_tokens=4)
            assert int(e.value.response.headers["retry-after"]) >= 1
            assert e.value.code == "queue_full"
            await oc.close()
            running.cancel()  # both clients hang up: the running and the queued request
            queued.cancel()
            await asyncio.gather(running, queued, return_exceptions=True)

    try:
        asyncio.run(scenario())
        eventually(lambda: engine.counters["cancelled"] >= cancelled0 + 2, f"not cancelled: {engine.counters}")
        wait_idle(engine)
    finally:
        engine.max_queue, engine.max_batch = 4, 8
    metrics = httpx.get(url + "/metrics").text
    assert re.search(r'leapdecode_requests_total\{endpoint="/v1/completions",status="429"\} [1-9]', metrics)


def generated_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^leapdecode_generated_tokens_total (\S+)$", text, re.M).group(1))


def test_stream_disconnect_cancels_generation(server, client):
    engine = server.engine
    wait_idle(engine)
    cancelled0, tokens0 = engine.counters["cancelled"], generated_tokens(server.url)
    stream = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=LONG, stream=True,
                                       temperature=0)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # hang up after a few chunks
    eventually(lambda: engine.counters["cancelled"] == cancelled0 + 1, "the generation was not cancelled")
    wait_idle(engine)
    assert generated_tokens(server.url) - tokens0 < LONG  # stopped early, not run to its end
    assert server.runner.caches_in_use == 0
    r = client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    assert 'leapdecode_generations_total{finish_reason="cancelled"}' in httpx.get(server.url + "/metrics").text


def test_non_streaming_disconnect_cancels(server):
    engine = server.engine
    wait_idle(engine)
    cancelled0 = engine.counters["cancelled"]

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            task = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny-random", "prompt": "Hi", "max_tokens": LONG, "temperature": 0}))
            while not engine.busy:  # the generation is running
                await asyncio.sleep(0.01)
            task.cancel()  # hang up
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    eventually(lambda: engine.counters["cancelled"] == cancelled0 + 1, "the generation was not cancelled")
    wait_idle(engine)


def test_request_timeout_cancels(server, client):
    engine, config = server.engine, server.config
    wait_idle(engine)
    config.request_timeout = 0.4
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny-random", prompt="Hi", max_tokens=LONG, temperature=0)
        assert e.value.status_code == 504 and e.value.code == "request_timeout"
        with pytest.raises(openai.APIError) as e:  # streamed: an error event after some chunks
            for _ in client.completions.create(model="tiny-random", prompt="Hi", max_tokens=LONG, temperature=0,
                                              stream=True):
                pass
        assert "request timeout" in str(e.value)
    finally:
        config.request_timeout = 60
    wait_idle(engine)
    assert 'leapdecode_requests_cancelled_total{reason="timeout"} 2' in httpx.get(server.url + "/metrics").text


# ---------------------------------------------------------------------------- the engine's typed events
def test_engine_typed_events(ref):
    from leapdecode.core.sampling import SamplingParams
    from leapdecode.errors import PromptTooLongError
    from leapdecode.proposers import method_config
    from leapdecode.request import GenerationRequest

    runner = build_runner(ref)
    engine = Engine(runner, max_queue=2)
    try:
        ids = ref.tokenizer.encode("Hello")
        spec = GenSpec(ids, GenerationRequest(method_config("pld"), SamplingParams(), 12))
        events = asyncio.run(collect_job_events(engine, [spec, spec]))
        assert [type(e) for e in (events[0], events[-2], events[-1])] == [Started, Finished, Ended]
        for i in (0, 1):
            mine = [e for e in events if getattr(e, "index", None) == i]
            assert isinstance(mine[0], Started) and isinstance(mine[-1], Finished)
            deltas = [e for e in mine if isinstance(e, Delta)]
            assert all(isinstance(e, Delta) for e in mine[1:-1]) and len(deltas) > 1
            result = mine[-1].result
            assert "".join(d.text for d in deltas) == result.text
            assert [t for d in deltas for t in d.tokens] == result.tokens and len(result.tokens) == 12
            assert result.text == ref_generate(ref, "Hello", max_new_tokens=12).text
        # a client's mistake found by the engine: Failed with the error itself (no internal error id)
        bad = GenSpec([7] * 2048, GenerationRequest(method_config("vanilla"), SamplingParams(), 4))
        events = asyncio.run(collect_job_events(engine, [bad]))
        assert [type(e) for e in events] == [Failed, Ended]
        assert isinstance(events[0].error, PromptTooLongError) and events[0].error_id is None
        assert runner.caches_in_use == 0
    finally:
        engine.stop()


def test_server_runner_never_loads_drafts(server):
    assert server.runner.allow_draft_loading is False and set(server.runner.drafts) == {DRAFT}


def test_the_registered_draft_is_not_named_in_requests():
    """A server's first loaded draft is named in every request's options (a named draft is always
    used), except the target's registered pair: methods find that one themselves, and ``auto`` leaves
    it out beside a trained head, as it does in-process."""
    import dataclasses

    model = dataclasses.replace(load("tiny-random", dtype="fp32"), draft_name=DRAFT)
    draft = load(DRAFT, dtype="fp32")
    registered = create_app(model, ServeConfig(default_method="auto"), drafts={DRAFT: draft})
    assert registered.state.config.default_draft is None
    assert registered.state.runner.draft() is draft  # still loaded: auto and draft use it unnamed
    other = create_app(dataclasses.replace(model, draft_name=None), ServeConfig(default_method="auto"),
                       drafts={DRAFT: draft})
    assert other.state.config.default_draft == DRAFT
    for app in (registered, other):
        app.state.engine.stop()


# ---------------------------------------------------------------------------- configuration
def test_default_method_options(ref):
    model = load("tiny-random", dtype="fp32")
    app = create_app(model, ServeConfig(default_method="pld", default_options={"max_ngram": 2, "draft_len": 3}))
    srv, thread, url = start_server(app)
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            r = c.completions.create(model="tiny-random", prompt="Hello", max_tokens=16, temperature=0)
            assert extra(r, "leapdecode")["method"] == "pld"
            assert r.choices[0].text == ref_generate(ref, "Hello", max_new_tokens=16).text
            # the request's options override the server's; the server's apply to its default method only
            r = c.completions.create(model="tiny-random", prompt="Hello", max_tokens=4,
                                     extra_body={"leapdecode": {"options": {"draft_len": 5}}})
            assert r.choices
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model="tiny-random", prompt="Hello", max_tokens=4,
                                     extra_body={"leapdecode": {"method": "jacobi", "options": {"draft_len": 5}}})
            assert e.value.param == "leapdecode.options.draft_len"
        assert app.state.default_config.as_dict()["max_ngram"] == 2
    finally:
        srv.should_exit = True
        thread.join(10)
    with pytest.raises(InvalidParameterError, match="colour"):
        create_app(model, ServeConfig(default_method="pld", default_options={"colour": 1}))


def test_serve_cli_defaults():
    from leapdecode.cli import build_parser
    from leapdecode.proposers import DEFAULT_METHOD

    a = build_parser().parse_args(["serve", "-m", "tiny-random"])
    assert (a.host, a.port, a.max_queue, a.request_timeout, a.api_key) == ("127.0.0.1", 8000, 16, 600.0, None) \
        or a.api_key is not None  # $LEAPDECODE_API_KEY may be set
    assert a.method == DEFAULT_METHOD and a.draft is None and a.option is None
    assert a.max_body_bytes == 1 << 20
    assert a.func.__module__ == "leapdecode.server.cli"
    a = build_parser().parse_args(["serve", "--draft", "a", "--draft", "b", "--option", "k=1", "--option", "x=y"])
    assert a.draft == ["a", "b"] and a.option == ["k=1", "x=y"]


def test_serve_default_drafts():
    from leapdecode.server.config import default_drafts

    paired = SimpleNamespace(draft_name="small")
    alone = SimpleNamespace(draft_name=None)
    assert default_drafts(paired, "auto", {}, None) == ["small"]
    assert default_drafts(paired, "draft", {}, None) == ["small"]
    assert default_drafts(paired, "auto", {"use_draft": False}, None) == []
    assert default_drafts(paired, "pld", {}, None) == []
    assert default_drafts(alone, "auto", {}, None) == []
    assert default_drafts(paired, "draft", {}, ["x", "y"]) == ["x", "y"]
    assert default_drafts(alone, "draft", {"draft": "z"}, None) == ["z"]


@pytest.mark.parametrize("argv, words", [
    (["--method", "pld", "--option", "colour=red"], ["colour", "pld"]),
    (["--method", "pld", "--option", "max_ngram=many"], ["max_ngram", "many"]),
    (["--method", "pld", "--option", "max_ngram"], ["KEY=VALUE"]),
    (["--method", "telepathy"], ["telepathy"]),
    (["--max-body-bytes", "0"], ["--max-body-bytes"]),
    # issue 45 (../shared/probe/report.md): SV21 an unset variable as the key, SV22 a blank or padded
    # key, SV16/SV16b a timeout that is not a number
    (["--api-key", ""], ["--api-key", "empty"]),
    (["--api-key", "   "], ["--api-key", "empty"]),
    (["--api-key", " s3cret "], ["--api-key", "spaces"]),
    (["--request-timeout", "nan"], ["--request-timeout", "nan"]),
    (["--request-timeout", "inf"], ["--request-timeout", "inf"]),
    # issue 61: the tenants' and budgets' settings
    (["--api-key", "k", "--api-key", "k"], ["--api-key", "twice"]),
    (["--memory-budget-mib", "-1"], ["--memory-budget-mib"]),
    (["--request-limit", "suffix.min_prob=1"], ["--request-limit", "suffix.min_prob", "suffix.depth"]),
    (["--request-limit", "suffix.depth=1"], ["depth", ">= 2"]),
    (["--max-grammar-bytes", "0"], ["--max-grammar-bytes"]),
    (["--grammar-timeout", "0"], ["--grammar-timeout"]),
])
def test_serve_cli_bad_options_exit_2(capsys, monkeypatch, argv, words):
    import leapdecode.models.loader as loader
    from leapdecode.cli import main

    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded a model before checking options"))
    rc = main(["serve", "-m", "tiny-random", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leapdecode: error: ")
    for w in words:
        assert w in lines[0], (w, lines[0])


# ---------------------------------------------------------------------------- metrics
def test_metrics(server, client):
    client.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=5, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['leapdecode_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert samples['leapdecode_requests_total{endpoint="/v1/chat/completions",status="404"}'] >= 1
    assert samples["leapdecode_generated_tokens_total"] >= 5
    assert samples["leapdecode_tokens_per_second"] > 0
    assert samples["leapdecode_mean_accepted_tokens"] > 0.5
    assert samples["leapdecode_queue_depth"] == 0
    assert samples["process_resident_memory_bytes"] > 0
    b = 'leapdecode_request_duration_seconds_bucket{endpoint="/v1/chat/completions",le="+Inf"}'
    assert samples[b] == samples['leapdecode_request_duration_seconds_count{endpoint="/v1/chat/completions"}']
    assert "# TYPE leapdecode_request_duration_seconds histogram" in text
    assert "# TYPE leapdecode_requests_total counter" in text


# ---------------------------------------------------------------------------- the real CLI, a real model
def _loadtest():
    return load_script("loadtest")


@pytest.mark.integration
def test_serve_smollm2_with_method_options():
    """``leapdecode serve`` with --method/--option on the real smollm2-135m: lossless against vanilla."""
    lt = _loadtest()
    proc, url, log = lt.start_server("smollm2-135m", 4, ["--dtype", "fp32", "--device", "cpu", "--method", "pld",
                                                         "--option", "max_ngram=3", "--no-warmup"])
    try:
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "List three colours."}],
                "max_tokens": 24, "temperature": 0}
        got = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        want = httpx.post(url + "/v1/chat/completions", timeout=120,
                          json={**body, "leapdecode": {"method": "vanilla"}}).json()
        assert got["leapdecode"]["method"] == "pld" and want["leapdecode"]["method"] == "vanilla"
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["usage"]["completion_tokens"] >= 8
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={**body, "leapdecode": {"method": "draft", "draft": "qwen2.5-coder-0.5b"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "leapdecode.draft"
    finally:
        lt.stop_server(proc)
        Path(log).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- load test (short CI version)
@pytest.mark.loadtest
def test_loadtest_short():
    lt = _loadtest()
    # int4 on the block kernel: the batch-invariant configuration, where every greedy request of the
    # run must get the same text as when asked again alone (the solo check of the load test)
    s = lt.run_loadtest(model="tiny-random", clients=32, duration=10.0, max_tokens=32, settle=1.5,
                        server_args=["--weights", "int4"])
    print(json.dumps({k: v for k, v in s.items() if k != "server_log_tail"}, indent=1))
    assert lt.check(s, rss_slack_mb=50.0) == [], s.get("server_log_tail")
    assert s["completed"] > 0 and s["rejected"] + s["completed"] + s["disconnected"] == s["requests"]
    assert s["solo_checked"] > 10 and s["solo_mismatches"] == 0 and s["mean_batch_size"] > 2
    assert not s["server_exited_during_run"]


# ---------------------------------------------------------------------------- paths named by requests
def test_a_request_names_a_servers_file_never_a_path(server, monkeypatch):
    """Issue 45 (probes HE12, HE26-HE32): a request's ``datastore`` / ``head`` option is one of the
    names given at start-up (``--datastore NAME=PATH``, ``--head NAME=PATH``); any other value, an
    existing file, a missing one or a directory, gets the same 400 and no file is opened."""
    import leapdecode.proposers.rest as rest

    monkeypatch.setattr(rest, "resolve_datastore", lambda *a, **k: pytest.fail("opened a datastore a request named"))
    messages = []
    for method, key, value in (("rest", "datastore", "/etc/passwd"), ("rest", "datastore", "/nonexistent.npz"),
                               ("rest", "datastore", "~"), ("eagle", "head", "/tmp"), ("medusa", "head", "/no/such")):
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": "tiny-random", "messages": CHAT, "max_tokens": 2,
                             "leapdecode": {"method": method, "options": {key: value}}})
        err = error_of(r)
        assert r.status_code == 400 and err["param"] == f"leapdecode.options.{key}", r.text
        messages.append(err["message"].replace(json.dumps(value), "VALUE"))
    assert len(set(messages[:3])) == 1 and len(set(messages[3:])) == 1  # no existence oracle


def test_resolve_method_maps_a_servers_names_to_their_paths():
    from leapdecode.server.protocol import LeapdecodeExtension, resolve_method

    d = ServeConfig(datastores={"docs": "/srv/docs.npz"})
    cfg = resolve_method(LeapdecodeExtension(method="rest", options={"datastore": "docs"}), d)
    assert cfg.datastore == "/srv/docs.npz"
    # the operator's own --option is a path and stays one
    d = ServeConfig(default_method="rest", default_options={"datastore": "/srv/own.npz"})
    assert resolve_method(LeapdecodeExtension(), d).datastore == "/srv/own.npz"


def test_serve_named_paths(tmp_path):
    from leapdecode.errors import LeapdecodeError
    from leapdecode.server.cli import named_paths

    f = tmp_path / "ds.npz"
    f.write_bytes(b"x")
    assert named_paths("--datastore", [f"docs={f}"]) == {"docs": str(f)}
    for bad, words in (([f"{f}"], "NAME=PATH"), ([f"docs={tmp_path}/missing.npz"], "does not exist"),
                       ([f"a={f}", f"a={f}"], "twice"), (["=x"], "NAME=PATH")):
        with pytest.raises(LeapdecodeError, match=words):
            named_paths("--datastore", bad)


def test_start_up_refuses_what_every_request_would_then_refuse():
    """Issue 45 (probes SV17, SV20): `serve --method draft --no-warmup` without a draft, and a
    KV-cache budget too small for any request, started and then answered every request with a 400
    that blamed the client; both are start-up errors now."""
    from leapdecode.errors import LeapdecodeError
    from leapdecode.server.settings import ServeSettings

    settings = ServeSettings(model="tiny-random", config=ServeConfig(default_method="draft"), warmup=False)
    with pytest.raises(LeapdecodeError, match="draft"):
        settings.build_app()
    small = ServeSettings(model="tiny-random", config=ServeConfig(default_method="vanilla", kv_budget_bytes=2048),
                          warmup=False)
    with pytest.raises(LeapdecodeError, match="KV-cache budget .* holds no request"):
        small.build_app()


def test_a_client_leaving_mid_upload_is_not_an_internal_error():
    """Issue 45 (probe HX06): a disconnect while the body was read was logged as an internal error
    with a traceback; it maps to 499 in the status table and logs nothing."""
    from starlette.requests import ClientDisconnect

    from leapdecode.server.errors import api_error, report_internal

    err = api_error(ClientDisconnect())
    assert err.status == 499 and err.code == "client_closed_request"
    assert report_internal(ClientDisconnect()) is None


def test_a_body_that_never_arrives_times_out():
    """Issue 45 (probe HX02): a body announced with Content-Length and never sent held the
    connection open for over 70 s; read_body gives up after its timeout (408 in the status table)."""
    import asyncio

    from leapdecode.server.errors import BodyTimeout, api_error
    from leapdecode.server.prepare import read_body

    class Stalled:
        headers = {"content-length": "5000"}

        async def stream(self):
            yield b"x" * 20
            await asyncio.sleep(60)
            yield b"never"

    with pytest.raises(BodyTimeout):
        asyncio.run(read_body(Stalled(), 1 << 20, timeout_s=0.2))
    assert api_error(BodyTimeout(0.2)).status == 408
