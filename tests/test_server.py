"""The OpenAI-compatible server, driven with the real ``openai`` client (and httpx for raw HTTP).

One in-process server (uvicorn in a background thread on a free loopback port)
serves ``tiny-random`` for the whole module; the reference outputs come from a
second, identical ``tiny-random`` instance so that the test never touches the
served model's cache while the engine thread may be using it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import uvicorn  # noqa: E402

from leapdecode.core.generate import encode_prompt, generate  # noqa: E402
from leapdecode.errors import InvalidParameterError  # noqa: E402
from leapdecode.models.loader import load  # noqa: E402
from leapdecode.server.app import create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LONG = 1500  # max_tokens of a greedy generation (no EOS: 'Hello'/'Hi' run to the limit) far longer than any wait


@pytest.fixture(scope="module")
def server():
    model = load("tiny-random", dtype="fp32")
    app = create_app(model, default_method="vanilla", max_queue=4, request_timeout=60)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    yield SimpleNamespace(url=url, app=app, engine=app.state.engine, config=app.state.config, model=model)
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


def wait_idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while engine.busy or engine.queue_depth:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


CHAT = [{"role": "user", "content": "Say hello."}]


# ---------------------------------------------------------------------------- endpoints
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny-random"]
    assert client.models.retrieve("tiny-random").id == "tiny-random"
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == "tiny-random"


def test_chat_completion_matches_generate(client, ref):
    r = client.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=24, temperature=0)
    want = generate(ref, CHAT, max_new_tokens=24, temperature=0.0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(encode_prompt(ref, CHAT))
    assert r.usage.completion_tokens == len(want.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = extra(r, "leapdecode")
    assert stats["method"] == "vanilla" and stats["mean_accepted"] == 1.0
    assert stats["new_tokens"] == len(want.tokens) and stats["target_forwards"] == len(want.tokens)


def test_text_completion_and_echo(client, ref):
    r = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=12, temperature=0)
    want = generate(ref, "Hello", max_new_tokens=12, temperature=0.0)
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
    pieces, finish, stats, roles, arrivals = [], None, None, [], []
    with client.chat.completions.create(stream=True, **kw) as s:
        for chunk in s:
            assert chunk.object == "chat.completion.chunk"
            arrivals.append(time.perf_counter())
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
    want = generate(ref, "Hello", max_new_tokens=20, temperature=0.0)
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


def test_stop_strings(client, ref):
    base = generate(ref, "Hello", max_new_tokens=30, temperature=0.0).text
    stop = next(ch for ch in base[3:] if ch.isalnum())  # a character that appears a few pieces in
    want = generate(ref, "Hello", max_new_tokens=30, temperature=0.0, stop=[stop])
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
    refs = [generate(ref, CHAT, max_new_tokens=10, temperature=1.0, seed=7 + k) for k in range(3)]
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
    assert texts[0] == texts[1] == generate(ref, "Hello", max_new_tokens=8, temperature=0.0).text
    assert finished == {0, 1}


def test_method_extension_is_lossless(client):
    kw = dict(model="tiny-random", prompt="Hello", max_tokens=24, temperature=0)
    plain = client.completions.create(**kw)
    r = client.completions.create(**kw, extra_body={"leapdecode": {"method": "draft", "draft": "tiny-random:1"}})
    stats = extra(r, "leapdecode")
    assert stats["method"] == "draft" and stats["draft"] == "tiny-random:1"
    assert r.choices[0].text == plain.choices[0].text
    assert stats["mean_accepted"] >= 1.0 and stats["target_forwards"] <= 24


# ---------------------------------------------------------------------------- errors
def error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_malformed_and_missing(server):
    url = server.url
    r = httpx.post(url + "/v1/chat/completions", content=b'{"model": "tiny-random", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    r = httpx.post(url + "/v1/chat/completions", json=["not", "an", "object"])
    assert r.status_code == 400
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-random"})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and error_of(r)["param"] == "model"
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny-random", "messages": [{"role": "robot"}]})
    assert r.status_code == 400 and "role" in error_of(r)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
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
    with pytest.raises(openai.BadRequestError) as e:  # prompt + max_tokens over the context
        client.completions.create(model="tiny-random", prompt="a" * 2000, max_tokens=100)
    assert e.value.code == "context_length_exceeded" and "2048" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # the prompt alone fills the context
        client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "a" * 2100}])
    assert e.value.code == "context_length_exceeded" and "2048" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-random", prompt="Hi", n=1000)


@pytest.mark.parametrize("kw", [dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_sampling_params(client, kw):
    from leapdecode.core.sampling import SamplingParams

    args = dict(temperature=kw.get("temperature", 1.0), top_p=kw.get("top_p", 1.0))
    with pytest.raises(InvalidParameterError) as want:
        SamplingParams(**args)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4, **kw)
    assert e.value.status_code == 400 and e.value.body["message"] == str(want.value)


def test_bad_extension_fields(client):
    for ext, param in (({"method": "telepathy"}, "leapdecode.method"), ({"draft": "/etc/passwd"}, "leapdecode.draft"),
                       ({"colour": "red"}, "leapdecode.colour")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4, extra_body={"leapdecode": ext})
        assert e.value.param == param
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4, logprobs=2)
    assert e.value.code == "unsupported_parameter"


def test_api_key(server):
    server.config.api_key = "s3cret"
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
        server.config.api_key = None


# ---------------------------------------------------------------------------- queue, cancellation, timeout
def test_queue_full_gives_429_and_disconnects_free_slots(server):
    engine, url = server.engine, server.url
    wait_idle(engine)
    cancelled0 = engine.counters["cancelled"]
    engine.max_queue = 1

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
            await asyncio.wait_for(started.wait(), 20)
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
        deadline = time.monotonic() + 5
        while engine.counters["cancelled"] < cancelled0 + 2:
            assert time.monotonic() < deadline, engine.counters
            time.sleep(0.02)
        wait_idle(engine, 5)
    finally:
        engine.max_queue = 4
    metrics = httpx.get(url + "/metrics").text
    assert re.search(r'leapdecode_requests_total\{endpoint="/v1/completions",status="429"\} [1-9]', metrics)


def test_stream_disconnect_cancels_generation(server, client):
    engine = server.engine
    wait_idle(engine)
    cancelled0 = engine.counters["cancelled"]
    stream = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=LONG, stream=True,
                                       temperature=0)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # hang up after a few chunks (the generation would take ~20 s)
    t0 = time.monotonic()
    r = client.completions.create(model="tiny-random", prompt="Hi", max_tokens=4)  # served promptly
    assert time.monotonic() - t0 < 5 and r.choices[0].finish_reason == "length"
    assert engine.counters["cancelled"] == cancelled0 + 1


def test_non_streaming_disconnect_cancels(server):
    engine = server.engine
    wait_idle(engine)
    cancelled0 = engine.counters["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"model": "tiny-random", "prompt": "Hi", "max_tokens": LONG, "temperature": 0},
                   timeout=httpx.Timeout(10, read=0.5))
    wait_idle(engine, 5)
    assert engine.counters["cancelled"] == cancelled0 + 1


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
    wait_idle(engine, 5)
    assert 'leapdecode_requests_cancelled_total{reason="timeout"} 2' in httpx.get(server.url + "/metrics").text


# ---------------------------------------------------------------------------- metrics, cli
def test_metrics(server, client):
    client.chat.completions.create(model="tiny-random", messages=CHAT, max_tokens=5, temperature=0)
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


def test_serve_cli_defaults():
    from leapdecode.cli import build_parser
    from leapdecode.proposers import METHODS

    a = build_parser().parse_args(["serve", "-m", "tiny-random"])
    assert (a.host, a.port, a.max_queue, a.request_timeout, a.api_key) == ("127.0.0.1", 8000, 16, 600.0, None) \
        or a.api_key is not None  # $LEAPDECODE_API_KEY may be set
    assert a.method == ("auto" if "auto" in METHODS else "vanilla")
    assert a.func.__module__ == "leapdecode.server.cli"


# ---------------------------------------------------------------------------- load test (short CI version)
@pytest.mark.loadtest
def test_loadtest_short():
    spec = importlib.util.spec_from_file_location("loadtest", ROOT / "scripts" / "loadtest.py")
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    s = lt.run_loadtest(model="tiny-random", clients=32, duration=10.0, max_tokens=32, settle=1.5)
    print(json.dumps({k: v for k, v in s.items() if k != "server_log_tail"}, indent=1))
    assert lt.check(s, rss_slack_mb=50.0) == [], s.get("server_log_tail")
    assert s["completed"] > 0 and s["rejected"] + s["completed"] + s["disconnected"] == s["requests"]
    assert not s["server_exited_during_run"]
