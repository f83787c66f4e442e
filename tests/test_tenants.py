"""Many tenants on one server (issue 61, probes of shared/probe/report-2.md): the server bounds every
request option that sizes shared or long-lived state, its cross-request memory has one byte budget,
and each API key's memory (the methods' learned state and the prefix cache) is its own.

Each test builds its own app on ``tiny-random`` and drives it with httpx through ``start_server`` (a
loopback port), so what one test teaches a memory never reaches another.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from leapdecode.errors import InvalidParameterError  # noqa: E402
from leapdecode.models.loader import load  # noqa: E402
from leapdecode.proposers.registry import parse_request_limits, request_limits  # noqa: E402
from leapdecode.server.app import create_app  # noqa: E402
from leapdecode.server.config import ServeConfig  # noqa: E402

from helpers.server import start_server  # noqa: E402

KEYS = ("key-of-alice", "key-of-bob")
# suffix with the paper's rule (no measured costs: it drafts whatever its tries match), greedy
SUFFIX = {"method": "suffix", "options": {"cost_aware": False}}


@pytest.fixture(scope="module")
def model():
    return load("tiny-random", dtype="fp32")


def serve(model, **kw):
    app = create_app(model, ServeConfig(default_method="vanilla", max_queue=4, request_timeout=60, api_keys=KEYS,
                                        speculate_under_load=False, **kw))
    srv, thread, url = start_server(app)
    return SimpleNamespace(app=app, url=url, runner=app.state.runner, stop=lambda: (
        setattr(srv, "should_exit", True), thread.join(10)))


@pytest.fixture
def server(model, request):
    s = serve(model, **getattr(request, "param", {}))
    yield s
    s.stop()


def ask(server, prompt: str, key: str = KEYS[0], max_tokens: int = 48, **leapdecode) -> httpx.Response:
    body = {"model": "tiny-random", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "leapdecode": leapdecode or SUFFIX}
    return httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


# ---------------------------------------------------------------------------- the server's bounds
@pytest.mark.parametrize("option, value", [("memory_tokens", 10**12), ("depth", 10**7)])
def test_N_SUF1_N_SUF3_suffix_sizes_above_the_bound_are_refused(server, option, value):
    """Probes N-SUF1 and N-SUF3: ``memory_tokens: 10**12`` and ``depth: 10**7`` were answered 200."""
    e = error(ask(server, "Hi", method="suffix", options={option: value}))
    assert e["param"] == f"leapdecode.options.{option}"
    bound = request_limits()[f"suffix.{option}"]
    assert f"at most {bound}" in e["message"] and f"--request-limit suffix.{option}=N" in e["message"]
    assert ok(ask(server, "Hi", method="suffix", options={option: bound}))["choices"]  # the bound itself is fine


def test_every_method_option_that_sizes_state_or_work_is_bounded(server):
    """A request's tree budget, windows and pools stay within the server's bounds, whichever method."""
    for key, bound in request_limits().items():
        method, option = key.split(".")
        if isinstance(bound, bool):
            continue
        e = error(ask(server, "Hi", method=method, options={option: bound + 1}))
        assert e["param"] == f"leapdecode.options.{option}" and f"at most {bound}" in e["message"], key
    e = error(ask(server, "Hi", method="pld", tree_budget=10**6))  # the shorthand names itself
    assert e["param"] == "leapdecode.tree_budget"


@pytest.mark.parametrize("server", [{"request_limits": parse_request_limits(["suffix.depth=100"])}],
                         indirect=True)
def test_the_operator_moves_a_bound(server):
    assert ok(ask(server, "Hi", method="suffix", options={"depth": 100}))["choices"]
    assert "at most 100" in error(ask(server, "Hi", method="suffix", options={"depth": 101}))["message"]


def test_request_limit_arguments_are_checked():
    assert parse_request_limits(["tree_budget=8"])["suffix.tree_budget"] == 8  # every method's
    assert parse_request_limits(["suffix.remember_prompts=true"]) == {"suffix.remember_prompts": True}
    for bad in ("suffix.min_prob=1", "nosuch.depth=3", "suffix.depth", "suffix.depth=1", "suffix.depth=x"):
        with pytest.raises(InvalidParameterError):
            parse_request_limits([bad])


def random_text(rng: random.Random, words: int) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))


@pytest.mark.parametrize("server", [{"memory_budget_bytes": 4 << 20, "request_limits": parse_request_limits(
    ["suffix.remember_prompts=true", "suffix.memory_tokens=100000000"])}], indirect=True)
def test_N_SUF7_a_hostile_mix_stays_within_the_memory_budget(server):
    """Probes N-SUF7, N-SUF7b: one request with a long prompt, ``remember_prompts``, a large depth and a
    new ``memory_tokens`` per request grew a server by 1.4 GiB each, never released.  Remembering
    prompts is refused unless the operator allows it; allowed, every memory together stays within the
    byte budget (the oldest content goes first)."""
    rng = random.Random(0)
    hostile = {"remember_prompts": True, "depth": 64}
    for i in range(4):  # ~1,700 tokens a prompt, each with its own memory_tokens: its own memory
        options = {**hostile, "memory_tokens": 10**6 + i}
        ok(ask(server, random_text(rng, 250), key=KEYS[i % 2], max_tokens=8, method="suffix", options=options))
        assert server.runner.memory.nbytes <= 4 << 20
    assert server.runner.memory.evictions > 0  # the budget did the bounding (a depth-64 trie of one prompt: ~30 MB)


def test_N_SUF2_remembering_prompts_needs_the_operator(server):
    """A request may not make the server keep its prompt (another tenant's text) unless allowed."""
    e = error(ask(server, "Hi", method="suffix", options={"remember_prompts": True}))
    assert e["param"] == "leapdecode.options.remember_prompts"
    assert "--request-limit suffix.remember_prompts=true" in e["message"]


# ---------------------------------------------------------------------------- memory stays with its tenant
PROMPT = "The quick brown fox jumps over the lazy dog. " * 7  # 315 byte tokens: a whole prefill chunk


def run_pair(server, first_key: str, second_key: str) -> tuple[dict, dict, int]:
    """The same greedy suffix request from ``first_key``, then ``second_key``: both answers and the
    prefix-cache hits the second one made."""
    a = ok(ask(server, PROMPT, key=first_key))
    hits = server.runner.prefix_cache.stats()["hits"]
    b = ok(ask(server, PROMPT, key=second_key))
    return a, b, server.runner.prefix_cache.stats()["hits"] - hits


def test_N_SUF4_N_SUF8_N_SUF9_one_tenants_text_never_changes_anothers_drafts(server):
    """Probes N-SUF4, N-SUF8, N-SUF9 (untestable then: the scheduler did not speculate): with two keys,
    the second tenant's request drafts and accepts exactly as on an empty memory, and restores none of
    the first tenant's prompt from the prefix cache, though the first one's output and prompt are in
    the server's memory."""
    a, b, hits = run_pair(server, KEYS[0], KEYS[1])
    assert b["choices"][0]["text"] == a["choices"][0]["text"]  # greedy: the same tokens either way
    assert b["leapdecode"]["target_forwards"] == a["leapdecode"]["target_forwards"]  # as on an empty memory
    assert b["leapdecode"]["mean_accepted"] == a["leapdecode"]["mean_accepted"]
    assert hits == 0
    again = ok(ask(server, PROMPT, key=KEYS[0]))  # the first tenant's own memory does draft for it
    assert again["leapdecode"]["target_forwards"] < a["leapdecode"]["target_forwards"]
    assert server.runner.prefix_cache.stats()["hits"] > 0


@pytest.mark.parametrize("server", [{"memory_scope": "shared"}], indirect=True)
def test_a_shared_memory_is_the_operators_choice(server):
    """The control: with ``--memory-scope shared`` the second key's request does draft from the first
    one's output and restores its prompt (so the test above can tell the scopes apart)."""
    a, b, hits = run_pair(server, KEYS[0], KEYS[1])
    assert b["leapdecode"]["target_forwards"] < a["leapdecode"]["target_forwards"]
    assert hits > 0


@pytest.mark.parametrize("server", [{"memory_scope": "user"}], indirect=True)
def test_the_user_field_scopes_memory_where_the_operator_allows_it(server):
    def as_user(user: str) -> dict:
        body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "user": user,
                "leapdecode": SUFFIX}
        return ok(httpx.post(server.url + "/v1/completions", json=body, timeout=120,
                             headers={"Authorization": f"Bearer {KEYS[0]}"}))

    first, other, again = as_user("u1"), as_user("u2"), as_user("u1")
    assert other["leapdecode"]["target_forwards"] == first["leapdecode"]["target_forwards"]
    assert again["leapdecode"]["target_forwards"] < first["leapdecode"]["target_forwards"]
