"""KV-cache compression policies (``core/kv_policy.py``): lossy, off by default.

1. Specs: every policy parses from its string and back; bad specs are an ``InvalidParameterError``
   naming the problem (API, CLI before loading, server 400).
2. ``KVCache.keep`` / ``pos_offset``: the kept slots are gathered per (layer, kv head) in order, and
   tokens appended later get their true positions.
3. Each policy's selection, on hand-checkable caches (slot contents encode their original index):
   StreamingLLM keeps sinks + window; H2O evicts the lowest accumulated score and keeps the recent;
   SnapKV keeps the top pooled votes and the window; and, on the tiny model against brute force,
   H2O's accumulated attention, SnapKV's kept keys, Expected Attention's query statistics (undone
   rope) and scores (mean and covariance rotated to the future positions).
4. Generations: each policy keeps the cache within its budget through a long generation, in a
   slot smaller than the full one; with a budget larger than the sequence the output is bitwise
   the output without a policy (true positions); no policy leaves everything as it was (no
   observer, the prefix cache used); a policy generation leaves the prefix cache alone; policies
   with speculative methods (pld, draft, layerskip) and in ``step_batch``; int8 round trip
   bounded; the HF backend is refused; the engine reserves the policy's smaller slot.
"""

from __future__ import annotations

import math

import pytest
import torch

from leapdecode import ModelRunner, generate
from leapdecode.api import start_generation
from leapdecode.core.generate import Generation
from leapdecode.core.slot import TREE_MARGIN, cache_tokens
from leapdecode.core.kv_policy import (POLICIES, ExpectedAttentionConfig, H2OConfig, Int8Config, KVPolicy,
                                       ScopeConfig, SnapKVConfig, StreamingConfig, attention_probs,
                                       parse_kv_policy, pooled, snapkv_slots)
from leapdecode.core.runner import slot_len
from leapdecode.core.sampling import SamplingParams
from leapdecode.errors import InvalidParameterError
from leapdecode.models.kv_cache import Int8KVCache, KVCache, quantize_int8
from leapdecode.models.native import apply_rope, rms_norm

PROMPT = "the quick brown fox jumps over the lazy dog; " * 8  # 360 byte tokens on the tiny model

SMALL = {  # a small budget of every eviction policy, and the most committed tokens it may hold
    "streaming:sink=4,window=60": lambda gen, new: 64,
    "h2o:budget=64,recent=8": lambda gen, new: 64,
    "snapkv:budget=64,window=8": lambda gen, new: 64 + new + 1,
    "scope:prefill=48,decode=32,recent=8,window=8": lambda gen, new: 80,
    "expected:budget=64,step=4": lambda gen, new: 64,
}


# ============================================================================ 1. specs
def test_every_policy_parses_and_round_trips():
    cases = {
        "streaming:sink=4,window=256": StreamingConfig(sink=4, window=256),
        "h2o:budget=256,recent=32": H2OConfig(budget=256, recent=32),
        "snapkv:budget=256": SnapKVConfig(budget=256),
        "scope:prefill=256,decode=128": ScopeConfig(prefill=256, decode=128),
        "expected:budget=256": ExpectedAttentionConfig(budget=256),
        "int8": Int8Config(),
        " SnapKV : budget=100 , pool=avg, kernel=5 ": SnapKVConfig(budget=100, pool="avg", kernel=5),
        "expected:budget=64,cov=false,vnorm=no": ExpectedAttentionConfig(budget=64, cov=False, vnorm=False),
    }
    for spec, want in cases.items():
        got = parse_kv_policy(spec)
        assert got == want, spec
        assert parse_kv_policy(got.spec()) == got
    assert set(POLICIES) == {"streaming", "h2o", "snapkv", "scope", "expected", "int8"}
    for spec in (None, "", "none", "off"):
        assert parse_kv_policy(spec) is None
    cfg = H2OConfig(budget=8, recent=2)
    assert parse_kv_policy(cfg) is cfg
    with pytest.raises(dataclasses_frozen_error()):
        cfg.budget = 9


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("spec, words", [
    ("lru:budget=3", ["unknown kv_policy 'lru'", "streaming"]),
    ("h2o:budget=abc", ["'budget'", "integer", "'abc'"]),
    ("h2o:size=4", ["no option 'size'", "budget, recent"]),
    ("h2o:budget=32,recent=32", ["recent (32)", "smaller than budget (32)"]),
    ("h2o:budget=0", ["'budget'", ">= 2"]),
    ("streaming:window=0", ["'window'", ">= 1"]),
    ("streaming:sink=-1", ["'sink'", ">= 0"]),
    ("snapkv:budget=64,kernel=4", ["kernel must be odd", "4"]),
    ("snapkv:budget=64,pool=median", ["'pool'", "max, avg", "'median'"]),
    ("snapkv:budget=8,window=8", ["window (8)", "budget (8)"]),
    ("scope:prefill=64,decode=16,recent=16", ["recent (16)", "decode (16)"]),
    ("expected:budget=20,sink=4,step=16", ["sink + step", "budget (20)"]),
    ("expected:cov=maybe", ["'cov'", "true or false"]),
    ("int8:bits=4", ["no option 'bits'", "none"]),
    ("h2o:budget", ["KEY=VALUE", "'budget'"]),
    ("h2o:budget=8,budget=9", ["'budget' given twice"]),
])
def test_bad_specs_name_the_problem(spec, words):
    with pytest.raises(InvalidParameterError) as e:
        parse_kv_policy(spec)
    for w in words:
        assert w in str(e.value), (spec, str(e.value))


def test_bad_config_values_and_types():
    with pytest.raises(InvalidParameterError, match="'budget' must be an integer"):
        H2OConfig(budget=8.5)
    with pytest.raises(InvalidParameterError, match="'budget' must be an integer"):
        H2OConfig(budget=True)
    with pytest.raises(InvalidParameterError, match="spec string"):
        parse_kv_policy(256)


def test_api_refuses_a_bad_spec_before_any_work(tiny, fresh_runner):
    runner = fresh_runner(tiny())
    with pytest.raises(InvalidParameterError, match="unknown kv_policy"):
        start_generation(runner, "hi", kv_policy="bogus")
    assert runner.caches_in_use == 0
    with pytest.raises(InvalidParameterError, match="kv_policy must be a KV-cache policy"):
        Generation(runner, [1, 2, 3], SamplingParams(), kv_policy="h2o")


def test_cli_bad_kv_policy_exits_2_before_loading(monkeypatch, capsys):
    from leapdecode import cli

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cli, "load_from_args", no_loading)
    assert cli.main(["generate", "--kv-policy", "h2o:budget=4,recent=9", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leapdecode: error:") and "recent (9)" in err and len(err.splitlines()) == 1
    a = cli.build_parser().parse_args(["generate", "--kv-policy", "streaming:window=16", "hi"])
    assert cli.decoding_request(a).kv_policy == StreamingConfig(window=16)
    a = cli.build_parser().parse_args(["generate", "hi"])
    assert cli.decoding_request(a).kv_policy is None
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "LOSSY" in capsys.readouterr().out


def test_hf_backend_is_refused(tiny):
    from types import SimpleNamespace

    from leapdecode.models.decoder import LoadedModel

    fake = LoadedModel(name="fake-hf", model=SimpleNamespace(backend="hf", max_seq_len=512), tokenizer=None)
    with pytest.raises(InvalidParameterError, match="kv_policy needs the native backend"):
        Generation(ModelRunner(fake), [1, 2, 3], SamplingParams(), kv_policy=H2OConfig(budget=8, recent=2))
    with pytest.raises(InvalidParameterError, match="kv_policy needs the native backend"):  # before a draft loads
        start_generation(ModelRunner(fake), prompt_ids=[1, 2, 3], method="draft", kv_policy="int8")


# ============================================================================ 2. the cache
def _indexed_cache(lm, n: int, max_len: int = 64) -> KVCache:
    """A cache of the tiny model's shape whose committed slot i holds i (+ 1000 * kv head) in every
    key and value element."""
    cfg = lm.model.cfg
    cache = lm.model.new_cache(max_len=max_len)
    idx = torch.arange(n, dtype=torch.float32).view(1, 1, 1, n, 1)
    heads = torch.arange(cfg.n_kv_heads, dtype=torch.float32).view(1, 1, -1, 1, 1) * 1000
    k = (idx + heads).expand(cfg.n_layers, 1, cfg.n_kv_heads, n, cfg.head_dim).clone()
    cache.append_committed(k, k.clone())
    return cache


def _kept(cache: KVCache) -> torch.Tensor:
    """[layers, kv_heads, length]: the original index of each committed slot."""
    return torch.stack([cache.layer_kv(layer)[0][0, :, :, 0] % 1000 for layer in range(cache.k.shape[0])]).long()


def test_keep_gathers_per_head_and_positions_stay_true(tiny):
    lm = tiny()
    cache = _indexed_cache(lm, 10)
    layers, heads = cache.k.shape[0], cache.k.shape[2]
    slots = torch.tensor([[0, 3, 9], [1, 2, 9]]).expand(layers, heads, 3)
    cache.keep(slots)
    assert cache.length == 3 and cache.pos_offset == 7
    assert torch.equal(_kept(cache), slots)
    assert torch.equal(cache.v[0, 0, 1, :3, 0], torch.tensor([1001.0, 1002.0, 1009.0]))  # values move too
    positions, mask = cache.plan_append(None, 2)
    assert positions.tolist() == [10, 11] and mask is None  # the true positions, not slots 3, 4
    with pytest.raises(ValueError, match="pending"):
        cache.keep(torch.tensor([0]))
    cache.commit()
    cache.keep(torch.tensor([0, 4]))  # the same slots everywhere
    assert cache.length == 2 and cache.pos_offset == 10
    assert cache.plan_append(None, 1)[0].tolist() == [12]
    cache.rollback()
    with pytest.raises(ValueError, match="committed slots"):
        cache.keep(torch.tensor([0, 5]))
    cache.reset()
    assert cache.pos_offset == 0 and cache.observer is None and cache.plan_append(None, 1)[0].tolist() == [0]


def test_int8_cache_round_trip_and_tree_commit():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 16) * torch.tensor([0.01, 1.0, 50.0]).view(1, 3, 1, 1)
    x[0, 0, 0] = 0  # an all-zero row
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.shape == (2, 3, 5, 1)
    err = (q.float() * s - x).abs()
    assert bool((err <= x.abs().amax(-1, keepdim=True) / 254 + 1e-7).all())
    assert float(err.max()) > 0  # lossy indeed
    cache = Int8KVCache(2, 3, 16, max_len=32, dtype=torch.float32)
    plain = KVCache(2, 3, 16, max_len=32, dtype=torch.float32)
    assert cache.nbytes < plain.nbytes / 3 and cache.bytes_per_slot == 2 * 2 * 3 * (16 + 4)
    for c in (cache, plain):
        c.plan_append([-1, -1, 1, 2, 3], 5)  # a root with two branches
        for layer in range(2):
            k = torch.randn(1, 3, 5, 16, generator=torch.Generator().manual_seed(layer))
            keys, values = c.write(layer, k, 2 * k)
            assert keys.shape == (1, 3, 5, 16)
        c.commit([1, 2, 3, 4])
    for layer in range(2):
        k8, v8 = cache.layer_kv(layer)
        k, v = plain.layer_kv(layer)
        assert torch.allclose(k8, k, atol=float(k.abs().max()) / 200) and torch.allclose(v8, v, atol=float(v.abs().max()) / 200)
    ck, cv = cache.committed_slice(1, 3)
    assert ck.shape == (2, 1, 3, 2, 16)
    with pytest.raises(NotImplementedError):
        cache.split_slots()


# ============================================================================ 3. selections
def _state(policy: KVPolicy, lm, cache: KVCache):
    return policy.start(lm, cache)


def test_streaming_keeps_sinks_and_window(tiny):
    lm = tiny()
    cache = _indexed_cache(lm, 20)
    state = _state(StreamingConfig(sink=3, window=5), lm, cache)
    assert cache.observer is None  # it needs no attention
    state.committed([0], "decode")
    want = [0, 1, 2, 15, 16, 17, 18, 19]
    assert cache.length == 8 and cache.pos_offset == 12
    assert (_kept(cache) == torch.tensor(want)).all()
    state.committed([0], "decode")  # within the budget: nothing moves
    assert cache.length == 8 and state.evicted == 12


def test_h2o_evicts_the_lowest_accumulated_score(tiny):
    lm = tiny()
    cache = _indexed_cache(lm, 6)
    state = _state(H2OConfig(budget=5, recent=2), lm, cache)
    layers, heads = state.acc.shape[:2]
    acc = torch.zeros(layers, heads, 6)
    acc[:, 0, :6] = torch.tensor([5.0, 1.0, 3.0, 4.0, 0.0, 0.0])  # head 0: slot 1 is the lightest of 0..3
    acc[:, 1, :6] = torch.tensor([0.5, 2.0, 3.0, 4.0, 9.0, 0.0])  # head 1: slot 0 is
    state.acc[:, :, :6] = acc
    more = _indexed_cache(lm, 7)  # the 7th token arrives (no queries stashed: nothing accumulated)
    cache.append_committed(more.k[:, :, :, 6:7].clone(), more.v[:, :, :, 6:7].clone())
    state.committed([0], "decode")
    kept = _kept(cache)
    assert cache.length == 5
    assert kept[:, 0].tolist() == [[0, 2, 3, 5, 6]] * layers  # slots 5, 6 are the recent ones
    assert kept[:, 1].tolist() == [[2, 3, 4, 5, 6]] * layers
    assert state.acc[0, 0, :5].tolist() == [5.0, 3.0, 4.0, 0.0, 0.0]  # scores follow their tokens
    assert state.acc[0, 1, :5].tolist() == [3.0, 4.0, 9.0, 0.0, 0.0]


def test_snapkv_keeps_the_top_pooled_votes_and_the_window():
    probs = torch.zeros(2, 1, 2, 12)  # 2 kv heads, 1 query head each, a window of 2, 12 prompt tokens
    probs[0, 0, :, :10] = torch.tensor([0.1, 0, 0, 0.9, 0, 0, 0, 0.5, 0, 0])
    probs[1, 0, 0, :10] = torch.tensor([0, 0.8, 0, 0, 0, 0, 0.2, 0, 0, 0.3])
    slots = snapkv_slots(probs, prompt=12, budget=5, window=2, kernel=1, pool="max")
    assert slots.tolist() == [[0, 3, 7, 10, 11], [1, 6, 9, 10, 11]]
    # max pooling over 3 positions: the neighbours of a strong vote come along
    slots = snapkv_slots(probs, prompt=12, budget=5, window=2, kernel=3, pool="max")
    assert slots[0].tolist()[:3] == [2, 3, 4] and slots[0].tolist()[3:] == [10, 11]
    assert pooled(torch.tensor([0.0, 3.0, 0.0, 0.0]), 3, "avg").tolist() == [1.5, 1.0, 1.0, 0.0]


def test_attention_probs_is_causal_softmax():
    torch.manual_seed(1)
    q, k = torch.randn(4, 3, 8), torch.randn(2, 5, 8)  # 4 query heads over 2 kv heads
    p = attention_probs(q, k, first=2)
    assert p.shape == (2, 2, 3, 5)
    for h in range(4):
        for j in range(3):
            s = (q[h, j] @ k[h // 2, : 3 + j].T) / math.sqrt(8)
            assert torch.allclose(p[h // 2, h % 2, j, : 3 + j], torch.softmax(s, -1), atol=1e-6)
            assert float(p[h // 2, h % 2, j, 3 + j :].sum()) == 0


def _reference_qkv(lm, ids: list[int]):
    """Per layer, the rope'd queries and keys and the pre-rope queries of ``ids`` (positions 0..),
    from the model's own weights (one forward, no cache tricks)."""
    model = lm.model
    hidden: list = []
    cache = model.new_cache(max_len=len(ids) + 8)
    model.forward(torch.tensor([ids]), cache, hidden_states=hidden, logits_for=slice(0, 0))
    n = len(ids)
    cos, sin = model.rope_cos[:n], model.rope_sin[:n]
    out = []
    for layer, block in enumerate(model.layers):
        h = rms_norm(hidden[layer], block.attn_norm, model.cfg.rms_norm_eps)
        q_pre, _, _ = block.rotary_qkv(block.wqkv(h), torch.ones_like(cos), torch.zeros_like(sin))
        q, k, v = block.rotary_qkv(block.wqkv(h), cos, sin)
        out.append((q[0], k[0], v[0], q_pre[0]))
    return out


def test_h2o_scores_are_the_attention_each_token_received(tiny, fresh_runner):
    lm = tiny()
    gen = start_generation(fresh_runner(lm), PROMPT[:60], max_new_tokens=5, kv_policy="h2o:budget=500,recent=4")
    gen.run()  # no eviction at this budget: the scores are sums over every committed query
    committed = gen.tokens[:-1]
    state = gen.slot.kv
    for layer, (q, k, _, _) in enumerate(_reference_qkv(lm, committed)):
        probs = attention_probs(q, k, first=0)  # every committed query over every committed key
        want = probs.sum(dim=(1, 2))
        assert torch.allclose(state.acc[layer, :, : len(committed)], want, atol=1e-4), layer


def test_snapkv_keeps_the_keys_brute_force_selects(tiny, fresh_runner):
    lm = tiny()
    policy = SnapKVConfig(budget=24, window=6, kernel=5, pool="avg")
    runner = fresh_runner(lm)
    gen = start_generation(runner, PROMPT[:101], max_new_tokens=1, kv_policy=policy)
    gen.start()
    prompt = gen.prompt_ids[:-1]  # what the prefill committed
    cache = gen.cache
    assert cache.length == 24 and cache.pos_offset == len(prompt) - 24
    for layer, (q, k, _, _) in enumerate(_reference_qkv(lm, prompt)):
        w = policy.window
        probs = attention_probs(q[:, -w:], k, first=len(prompt) - w)
        slots = snapkv_slots(probs, len(prompt), policy.budget, w, policy.kernel, policy.pool)
        want = torch.stack([k[h, slots[h]] for h in range(k.shape[0])])
        assert torch.allclose(cache.layer_kv(layer)[0][0], want, atol=1e-5), layer
        assert slots[:, -w:].tolist() == [list(range(len(prompt) - w, len(prompt)))] * k.shape[0]
    gen.close()


def test_expected_attention_statistics_and_scores(tiny, fresh_runner):
    lm = tiny()
    policy = ExpectedAttentionConfig(budget=400, sink=4, queries=16, future=32)
    gen = start_generation(fresh_runner(lm), PROMPT[:50], max_new_tokens=1, kv_policy=policy)
    gen.start()
    state, cache = gen.slot.kv, gen.cache
    prompt = gen.prompt_ids[:-1]
    ref = _reference_qkv(lm, prompt)
    cfg = lm.model.cfg
    d = cfg.head_dim
    # rotate_half as a matrix, built from its definition
    eye = torch.eye(d)
    rot = torch.cat([-eye[d // 2 :], eye[: d // 2]])
    for layer, (q, k, v, q_pre) in enumerate(ref):
        # the buffer holds the last `queries` committed queries before rope (undone from the stash)
        assert torch.allclose(state.buf[layer], q_pre[:, -16:].float(), atol=1e-4), layer
        scores = state.scores(layer, k[:, 4:], v[:, 4:])
        # brute force: explicit rotation matrices of the next `future` positions, averaged
        nxt = cache.length + cache.pos_offset
        rs = []
        for p in range(nxt, nxt + 32):
            c, s = lm.model.rope_cos[p], lm.model.rope_sin[p]
            rs.append(torch.diag(c) + torch.diag(s) @ rot)
        r = torch.stack(rs).mean(0)
        buf = q_pre[:, -16:].float()
        g = cfg.n_heads // cfg.n_kv_heads
        want = torch.zeros(cfg.n_kv_heads, k.shape[1] - 4)
        for h in range(cfg.n_heads):
            mu = buf[h].mean(0)
            cov = (buf[h] - mu).T @ (buf[h] - mu) / buf.shape[1]
            mu_f, cov_f = r @ mu, r @ cov @ r.T
            keys = k[h // g, 4:]
            z = keys @ mu_f / math.sqrt(d) + torch.einsum("nd,de,ne->n", keys, cov_f, keys) / (2 * d)
            want[h // g] += torch.softmax(z, -1) / g
        want = want * v[:, 4:].norm(dim=-1)
        assert torch.allclose(scores, want, rtol=1e-3, atol=1e-6), layer
    # rope undone is the identity on the rotation it undoes
    x = torch.randn(3, 5, d)
    cos, sin = lm.model.rope_cos[7:12], lm.model.rope_sin[7:12]
    assert torch.allclose(apply_rope(apply_rope(x, cos, sin), cos, -sin), x, atol=1e-5)
    gen.close()


# ============================================================================ 4. generations
def _run_tracking(gen: Generation, bound) -> tuple[list[int], int]:
    """Step a generation to its end, checking after every step that the committed tokens are
    within ``bound(gen, new_tokens_so_far)``; returns (tokens, most held)."""
    most = 0
    while not gen.finished:
        gen.step()
        if not gen.finished:
            held = gen.cache.length
            most = max(most, held)
            assert held <= bound(gen, len(gen.generated)), (held, gen.kv_policy)
    return gen.result.tokens, most


@pytest.mark.parametrize("spec", list(SMALL))
def test_each_policy_keeps_its_budget_in_a_smaller_slot(tiny, fresh_runner, spec):
    lm = tiny()
    runner = fresh_runner(lm)
    gen = start_generation(runner, PROMPT, max_new_tokens=300, kv_policy=spec, method="vanilla")
    tokens, most = _run_tracking(gen, SMALL[spec])
    stats = gen.result.stats
    assert len(tokens) == 300 and stats["kv_policy"] == parse_kv_policy(spec).spec()
    assert stats["kv_evicted"] > 0 and most <= stats["kv_peak_tokens"]
    assert stats["kv_tokens"] <= SMALL[spec](gen, 300)
    full = slot_len(lm, cache_tokens(lm, len(gen.prompt_ids), 300))
    assert stats["kv_slot_tokens"] < full, (stats["kv_slot_tokens"], full)
    assert stats["kv_bytes"] == stats["kv_tokens"] * gen.cache.bytes_per_slot
    assert runner.caches_in_use == 0


def test_slot_sizes_follow_the_policy(tiny):
    lm = tiny()
    full = cache_tokens(lm, 1000, 500)
    assert full == 1000 + 500 + TREE_MARGIN
    assert cache_tokens(lm, 1000, 500, StreamingConfig(sink=4, window=256)) == 260 + 128  # + a chunk
    assert cache_tokens(lm, 1000, 500, H2OConfig(budget=256)) == 256 + 128
    assert cache_tokens(lm, 1000, 500, SnapKVConfig(budget=256)) == 1000 + TREE_MARGIN  # the prompt first
    assert cache_tokens(lm, 100, 500, SnapKVConfig(budget=256)) == 100 + 500 + TREE_MARGIN
    assert cache_tokens(lm, 1000, 500, ScopeConfig(prefill=256, decode=128)) == 1000 + TREE_MARGIN
    assert cache_tokens(lm, 10, 20, H2OConfig(budget=256)) == 10 + 20 + TREE_MARGIN  # never above the full
    assert cache_tokens(lm, 1000, 500, Int8Config()) == full


@pytest.mark.parametrize("spec", ["streaming:sink=4,window=2000", "h2o:budget=2000,recent=8",
                                  "snapkv:budget=2000", "scope:prefill=2000,decode=2000",
                                  "expected:budget=2000"])
def test_a_budget_larger_than_the_sequence_changes_nothing(tiny, fresh_runner, spec):
    lm = tiny()
    want = generate(fresh_runner(lm), PROMPT, max_new_tokens=120)
    got = generate(fresh_runner(lm), PROMPT, max_new_tokens=120, kv_policy=spec)
    assert got.tokens == want.tokens and got.stats["kv_evicted"] == 0


def test_evicted_prompt_positions_stay_true(tiny):
    """After evictions the next token sits at its true position: layer 0 (whose keys and values
    depend on the token and its position only) of the compressed cache gives the root the query,
    the keys and the attention output of a full forward that attends to the kept tokens only."""
    lm = tiny()
    model, cfg = lm.model, lm.model.cfg
    ids = lm.tokenizer.encode(PROMPT)[:200]
    policy = StreamingConfig(sink=4, window=100)
    cache = model.new_cache(max_len=512)
    state = policy.start(lm, cache)
    for s in range(0, 199, 128):  # the prompt but its last token, in two chunks, evicting after each
        chunk = ids[s : min(s + 128, 199)]
        model.forward(torch.tensor([chunk]), cache, logits_for=slice(0, 0))
        cache.commit()
        state.committed(range(len(chunk)), "prefill")
    assert cache.length == 104 and cache.pos_offset == 95
    seen = {}
    cache.observer = lambda layer, q, keys: seen.setdefault(layer, (q, keys))
    model.forward(torch.tensor([[ids[199]]]), cache)  # the root: true position 199, slot 104
    q0, keys0 = seen[0]
    q, k, v, _ = _reference_qkv(lm, ids)[0]
    kept = list(range(4)) + list(range(99, 200))
    assert torch.allclose(q0[0, :, 0], q[:, 199], atol=1e-5)  # rotated at position 199, not 104
    assert torch.allclose(keys0[0], k[:, kept], atol=1e-5)
    g = cfg.n_heads // cfg.n_kv_heads
    values0 = cache.layer_kv(0, cache.total)[1][0]
    got = torch.stack([torch.softmax(q0[0, h, 0] @ keys0[0, h // g].T / math.sqrt(cfg.head_dim), -1) @ values0[h // g]
                       for h in range(cfg.n_heads)])
    want = torch.stack([torch.softmax(q[h, 199] @ k[h // g, kept].T / math.sqrt(cfg.head_dim), -1) @ v[h // g, kept]
                        for h in range(cfg.n_heads)])
    assert torch.allclose(got, want, atol=1e-5)


def test_no_policy_changes_nothing(tiny, fresh_runner):
    lm = tiny()
    runner = fresh_runner(lm)
    gen = start_generation(runner, PROMPT * 2, max_new_tokens=20)
    gen.start()
    assert gen.kv_policy is None and gen.slot.kv is None and gen.cache.observer is None
    assert type(gen.cache) is KVCache and gen.cache.pos_offset == 0
    res = gen.run()
    assert not any(k.startswith("kv_") for k in res.stats)
    assert len(runner.prefix_cache) >= 2  # whole 256-token chunks stored, as always
    again = generate(runner, PROMPT * 2, max_new_tokens=20)
    assert again.tokens == res.tokens and again.stats["prefix_reused"] >= 512


def test_a_policy_generation_leaves_the_prefix_cache_alone(tiny, fresh_runner):
    lm = tiny()
    runner = fresh_runner(lm)
    generate(runner, PROMPT * 2, max_new_tokens=4)  # fills the prefix cache
    before = runner.prefix_cache.stats()
    res = generate(runner, PROMPT * 2, max_new_tokens=4, kv_policy="h2o:budget=128,recent=8")
    after = runner.prefix_cache.stats()
    assert res.stats["prefix_reused"] == 0
    assert (after["hits"], after["misses"], after["blocks"]) == (before["hits"], before["misses"], before["blocks"])
    # the cache it gives back is clean for the next (plain) generation: no observer, no offset
    runner = fresh_runner(lm)
    gen = start_generation(runner, PROMPT, max_new_tokens=4, kv_policy="h2o:budget=64,recent=8", method="vanilla")
    gen.run()
    used = gen.cache
    assert gen.result.stats["kv_evicted"] > 0  # its offset was not 0 when it gave the cache back
    plain = start_generation(runner, "hi there", max_new_tokens=2, method="vanilla")
    plain.start()
    assert plain.cache is used  # the same slot, reused
    assert plain.cache.observer is None and plain.cache.pos_offset == 0 and plain.cache.length == len(plain.prompt_ids) - 1
    plain.close()


def test_int8_generation_runs_and_holds_fewer_bytes(tiny, fresh_runner):
    lm = tiny()
    runner = fresh_runner(lm)
    plain = generate(runner, PROMPT, max_new_tokens=100)
    q8 = start_generation(runner, PROMPT, max_new_tokens=100, kv_policy="int8")
    q8.start()
    assert isinstance(q8.cache, Int8KVCache)
    res = q8.run()
    assert len(res.tokens) == 100 and res.stats["kv_evicted"] == 0
    per_plain = 2 * lm.model.cfg.n_layers * lm.model.cfg.n_kv_heads * lm.model.cfg.head_dim * 4
    assert res.stats["kv_bytes"] < res.stats["kv_tokens"] * per_plain / 3
    # kinds are pooled apart: a plain request never gets an int8 cache, nor the reverse
    c = runner.acquire_cache(lm, 64)
    assert type(c) is KVCache
    c8 = runner.acquire_cache(lm, 64, kind="int8")
    assert type(c8) is Int8KVCache
    runner.release_cache(c)
    runner.release_cache(c8)
    assert len(plain.tokens) == 100


@pytest.mark.parametrize("method, options", [("pld", {}), ("draft", {"draft": "copy"}), ("layerskip", {"skip": 1}),
                                             ("lookahead", {})])
@pytest.mark.parametrize("spec", ["h2o:budget=64,recent=8", "streaming:sink=4,window=60",
                                  "scope:prefill=48,decode=32,recent=8,window=8"])
def test_policies_with_speculative_methods_keep_the_budget(tiny, fresh_runner, method, options, spec):
    lm = tiny()
    drafts = {"copy": tiny(copy=1)} if method == "draft" else None
    runner = fresh_runner(lm, verify_cost="flat", drafts=drafts)
    gen = start_generation(runner, PROMPT, max_new_tokens=150, method=method, options=options, kv_policy=spec)
    tokens, _ = _run_tracking(gen, SMALL[spec])
    # under a policy a speculative method's text depends on how many tokens each step commits
    # (kv_policy.py), and with lookahead that follows its n-gram pool: it may end by EOS earlier
    assert len(tokens) == 150 or gen.result.finish_reason == "stop", (len(tokens), gen.result.finish_reason)
    assert gen.result.stats["kv_evicted"] > 0  # the 360-token prompt alone exceeds every budget here
    assert gen.result.stats["target_forwards"] <= 150
    assert runner.caches_in_use == 0


@pytest.fixture(scope="module")
def q4():
    """The int4 tiny model (batch-invariant kernel and attention): batched == solo bitwise."""
    from leapdecode.models import kernel_library
    from leapdecode.models.loader import load

    problem = kernel_library.kernel_problem()
    if problem is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {problem}")
    return load("tiny-random", weights="int4")


def test_policies_in_step_batch_give_their_solo_output(q4, fresh_runner):
    """(Flat verification costs for both runners: pld's cost-aware chains would otherwise follow
    each runner's own timing, and a lossy policy's output follows the trees it saw.)"""
    from leapdecode.core.batch import step_batch

    specs = [(None, "vanilla"), ("h2o:budget=64,recent=8", "vanilla"), ("streaming:sink=4,window=60", "pld"),
             ("int8", "vanilla"), ("expected:budget=64,step=4", "pld"), ("scope:prefill=48,decode=32,recent=8,window=8",
                                                                       "vanilla")]
    prompts = [PROMPT[i * 7 :] for i in range(len(specs))]
    solo = [generate(fresh_runner(q4, verify_cost="flat"), p, max_new_tokens=60, kv_policy=s, method=m).tokens
            for p, (s, m) in zip(prompts, specs)]
    runner = fresh_runner(q4, verify_cost="flat")
    gens = [start_generation(runner, p, max_new_tokens=60, kv_policy=s, method=m) for p, (s, m) in zip(prompts, specs)]
    for _ in range(600):
        if all(g.finished for g in gens):
            break
        out = step_batch(gens, max_prefill_chunks=2)
        assert all(o.error is None for o in out), [o.error for o in out]
        for g, (s, _) in zip(gens, specs):
            if s in SMALL and g.decoding:
                assert g.cache.length <= SMALL[s](g, len(getattr(g, "generated", []))), s
    assert [g.result.tokens for g in gens] == solo
    assert runner.caches_in_use == 0


def test_engine_reserves_the_policy_slot(tiny):
    from leapdecode.proposers import method_config
    from leapdecode.request import GenerationRequest
    from leapdecode.server.engine import Engine, GenSpec, build_runner, kv_bytes_per_token

    lm = tiny()
    engine = Engine(build_runner(lm), max_batch=2)
    try:
        ids = list(range(1, 1001))
        base = GenSpec(ids, GenerationRequest(method_config("vanilla", {}), SamplingParams(), 500))
        full = engine.reservation(base)
        assert full == kv_bytes_per_token(lm) * slot_len(lm, 1000 + 500 + TREE_MARGIN)
        import dataclasses

        policy = StreamingConfig(sink=4, window=256)
        stream = engine.reservation(GenSpec(ids, dataclasses.replace(base.request, kv_policy=policy)))
        assert stream == kv_bytes_per_token(lm) * 512 and stream < full / 2
        q8 = engine.reservation(GenSpec(ids, dataclasses.replace(base.request, kv_policy=Int8Config())))
        assert q8 == kv_bytes_per_token(lm, "int8") * slot_len(lm, 1000 + 500 + TREE_MARGIN) and q8 < full / 2
    finally:
        engine.stop()


def _server_post(app, client, ext, prompt="Hi", max_tokens=4):
    return client.post("/v1/completions", json={"model": app.state.config.model_name, "prompt": prompt,
                                                "max_tokens": max_tokens, "temperature": 0, "leapdecode": ext})


def test_server_rejects_a_bad_kv_policy_with_400(tiny):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from leapdecode.server.app import create_app
    from leapdecode.server.config import ServeConfig

    app = create_app(tiny(), ServeConfig(default_method="vanilla", max_queue=4, request_timeout=60))
    with TestClient(app) as client:
        for bad, words in (("h2o:budget=8,recent=8", "recent (8)"), ("zip", "unknown kv_policy"),
                           (7, "spec string"), ("snapkv:budget=64,kernel=2", "kernel must be odd")):
            r = _server_post(app, client, {"kv_policy": bad})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "leapdecode.kv_policy" and words in err["message"], err
        assert app.state.engine.counters["submitted"] == 0  # refused before queueing


def test_server_runs_a_kv_policy_as_the_api_does(q4):
    """On the int4 model (batch-invariant attention: the bits do not depend on the cache slot's
    size, which differs between a fresh runner and the server's reused caches)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from leapdecode.server.app import create_app
    from leapdecode.server.config import ServeConfig

    app = create_app(q4, ServeConfig(default_method="vanilla", max_queue=4, request_timeout=60))
    with TestClient(app) as client:
        for spec in ("streaming:sink=4,window=60", "h2o:budget=64,recent=8", "int8"):
            r = _server_post(app, client, {"kv_policy": spec}, prompt=PROMPT, max_tokens=40)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 40
            # vanilla, as the server's default here: with a policy the output depends on how many
            # tokens each step commits, so on the method (and on auto's measured tree sizes)
            want = generate(ModelRunner(q4), PROMPT, max_new_tokens=40, kv_policy=spec, method="vanilla")
            assert r.json()["choices"][0]["text"] == want.text, spec


def test_methods_doc_lists_every_policy_and_option():
    from pathlib import Path

    from leapdecode.core.kv_policy import policies_markdown

    text = (Path(__file__).resolve().parents[1] / "docs" / "methods.md").read_text()
    begin, end = "<!-- kv-policies:begin -->\n", "\n<!-- kv-policies:end -->"
    assert begin in text and end in text, "docs/methods.md lost its generated kv_policy section"
    assert text[text.index(begin) + len(begin) : text.index(end)].strip() == policies_markdown().strip(), (
        "docs/methods.md's kv_policy tables differ from the configs: regenerate them with "
        "leapdecode.core.kv_policy.policies_markdown()")
    assert "lossy" in text.lower() and "off by default" in text
