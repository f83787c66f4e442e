"""Decoding strategies (issue 16, section 1): beam search, patience, diverse beam, best-first beam,
stochastic beam and conditional Poisson beam, on the KV cache's token tree.

* beam search returns transformers' ``generate(num_beams=...)`` hypotheses and ``sequences_scores``
  on a tiny Llama built in transformers and loaded natively with the same weights;
* patience against an independent reference beam search (written here from transformers' rules,
  scoring with the transformers model itself);
* best-first beam search against the paper's beam search and against brute force (tiny vocabulary);
* stochastic beam search's Gumbel-top-k samples against the exact sampling-without-replacement
  probabilities (chi-square, with a planted error that the test must catch);
* conditional Poisson samples and inclusion probabilities against brute force;
* the KV cache's prune/commit: bitwise equal keys and logits;
* the runner gets its cache back (also after errors), bad options are typed errors naming the option,
  and the API, CLI and server round trips.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leapdecode
from leapdecode.core.runner import ModelRunner
from leapdecode.errors import InvalidParameterError
from leapdecode.models.decoder import LoadedModel
from leapdecode.models.kv_cache import KVCache
from leapdecode.strategies import search as search_mod
from leapdecode.strategies.registry import STRATEGIES, BeamConfig, strategy_config
from leapdecode.strategies.stochastic_beam import conditional_poisson_sample, odds_weights
from helpers.server import tiny_server
from helpers.models import EOS, hf_pair, prompt_ids, small_vocab

PROMPTS = ["Hello there", "The cat", "a"]


# ---------------------------------------------------------------------------- models
def hf_logp(hf, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 next-token log-probabilities after ``ids`` (one full forward)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def native_logp(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """leapdecode's fp32 next-token log-probabilities after ``ids``, on a fresh cache."""
    model = lm.model
    cache = model.new_cache(max_len=len(ids) + 1)
    logits = model.forward(torch.tensor([ids]), cache, logits_for=slice(-1, None))
    return torch.log_softmax(logits[0, -1].float(), dim=-1)


def strip(seq: list[int], eos=EOS) -> list[int]:
    """A transformers output row up to and including its first end-of-sequence token (it pads after)."""
    for i, t in enumerate(seq):
        if t in eos:
            return seq[: i + 1]
    return seq


# ---------------------------------------------------------------------------- beam vs transformers
BEAM_CASES = [  # num_beams, length_penalty, early_stopping, max_new_tokens, num_return_sequences
    (2, 1.0, False, 8, 1),
    (2, 1.0, False, 12, 2),
    (4, 1.0, False, 12, 4),
    (3, 0.5, True, 10, 3),
    (2, 2.0, "never", 10, 2),
    (5, -1.0, False, 8, 3),
    (4, 0.0, "never", 9, 4),
    (6, 1.5, True, 7, 6),
]


@pytest.mark.parametrize("num_beams, length_penalty, early_stopping, max_new, n", BEAM_CASES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_beam_equals_transformers_generate(num_beams, length_penalty, early_stopping, max_new, n, prompt):
    hf, lm = hf_pair()
    ids = prompt_ids(lm, prompt)
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
                      num_return_sequences=n, max_new_tokens=max_new, do_sample=False, eos_token_id=list(EOS),
                      pad_token_id=EOS[0], return_dict_in_generate=True, output_scores=True)
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="beam", num_beams=num_beams,
                              length_penalty=length_penalty, num_return_sequences=n, max_new_tokens=max_new,
                              strategy_options={"early_stopping": early_stopping})
    want = [strip(out.sequences[i, len(ids):].tolist()) for i in range(n)]
    assert [h.tokens for h in res.hypotheses] == want
    got_scores = torch.tensor([h.score for h in res.hypotheses])
    # the same algorithm on the same weights: only the two implementations' fp32 rounding differs
    torch.testing.assert_close(got_scores, out.sequences_scores.float(), rtol=2e-5, atol=2e-5)
    # the best hypothesis is the result's text and tokens (without the end-of-sequence token)
    best = res.hypotheses[0]
    assert res.tokens == [t for t in best.tokens if t not in EOS]
    assert res.text == lm.tokenizer.decode(res.tokens)
    # logprob is the plain sum of the model's log-probabilities: score * length ** length_penalty
    for h in res.hypotheses:
        assert h.logprob == pytest.approx(h.score * len(h.tokens) ** length_penalty, rel=1e-4, abs=1e-4)


def test_beam_matches_transformers_where_hypotheses_end_early():
    # the equivalence above is only meaningful if some cases finish on an end-of-sequence token
    hf, lm = hf_pair()
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=prompt_ids(lm, "Hello there"), strategy="beam",
                              num_beams=3, max_new_tokens=10, length_penalty=0.5,
                              strategy_options={"early_stopping": True})
    assert [h.finish_reason for h in res.hypotheses] == ["stop", "stop", "length"]


# ---------------------------------------------------------------------------- patience
def reference_beam(logp, k: int, length_penalty: float, early_stopping, max_new: int, eos=EOS,
                   patience: float = 1.0) -> list[tuple[list[int], float]]:
    """Beam search written from transformers' documented rules, with the patience factor (the finished
    pool holds ceil(patience * k)); ``logp(tokens)`` gives fp32 next-token log-probabilities."""
    cap = max(1, math.ceil(patience * k - 1e-9))
    width = max(2, 1 + len(eos)) * k
    running = [([], torch.tensor(0.0))]
    finished: list[tuple[float, list[int]]] = []
    open_ = True
    for t in range(max_new):
        cands = []
        for tokens, score in running:
            acc = logp(tokens) + score
            top, idx = torch.topk(acc, min(width, acc.numel()))
            cands += [(v, tokens + [i]) for v, i in zip(top, idx.tolist())]
        cands.sort(key=lambda c: -float(c[0]))
        cands = cands[:width]
        new_len = t + 1
        hits = [c[1][-1] in eos or new_len == max_new for c in cands]
        nxt = [c for c, h in zip(cands, hits) if not h][:k]
        full = len(finished) >= cap
        if open_ and not (full and early_stopping is True):
            fresh = [(float(c[0] / new_len ** length_penalty), c[1]) for c, h in list(zip(cands, hits))[:k] if h]
            finished = sorted(finished + fresh, key=lambda f: -f[0])[:cap]
        full = len(finished) >= cap
        if open_ and full and nxt:
            hyp_len = max_new if early_stopping == "never" and length_penalty > 0 else new_len
            open_ = float(nxt[0][0] / hyp_len ** length_penalty) > finished[-1][0]
        if not open_ or (full and early_stopping is True) or all(hits):
            break
        running = [(tokens, score) for score, tokens in nxt]
    return [(tokens, s) for s, tokens in finished]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 4), patience=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]),
       length_penalty=st.sampled_from([0.0, 1.0, 2.0]), early_stopping=st.sampled_from([True, False, "never"]),
       prompt=st.sampled_from(PROMPTS), max_new=st.integers(2, 8))
def test_patience_against_a_reference_beam_search(k, patience, length_penalty, early_stopping, prompt, max_new):
    hf, lm = hf_pair()
    ids = prompt_ids(lm, prompt)
    cfg = BeamConfig(num_beams=k, patience=patience, length_penalty=length_penalty, early_stopping=early_stopping)
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy=cfg, max_new_tokens=max_new)
    want = reference_beam(lambda toks: hf_logp(hf, ids + toks), k, length_penalty, early_stopping, max_new,
                          patience=patience)
    assert [h.tokens for h in res.hypotheses] == [w[0] for w in want]
    assert [h.score for h in res.hypotheses] == pytest.approx([w[1] for w in want], rel=2e-5, abs=2e-5)
    assert len(res.hypotheses) <= cfg.kept
    if patience == 1.0:  # patience 1 is plain beam search, bit for bit
        plain = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="beam", num_beams=k,
                                    length_penalty=length_penalty, max_new_tokens=max_new,
                                    strategy_options={"early_stopping": early_stopping})
        assert [(h.tokens, h.score) for h in plain.hypotheses] == [(h.tokens, h.score) for h in res.hypotheses]


def test_patience_changes_when_a_first_come_search_stops():
    # early_stopping=True stops once ceil(p * k) hypotheses finished: more patience, more of them
    _, lm = hf_pair()
    ids = prompt_ids(lm, "The cat")
    counts = []
    for p in (0.5, 1.0, 2.0, 3.0):
        res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="beam", num_beams=2, patience=p,
                                  max_new_tokens=40, length_penalty=0.5, strategy_options={"early_stopping": True})
        assert all(h.finish_reason == "stop" for h in res.hypotheses)
        counts.append((len(res.hypotheses), res.stats["rounds"]))
    assert [c[0] for c in counts] == [1, 2, 4, 6]
    assert [c[1] for c in counts] == sorted({c[1] for c in counts})  # strictly more rounds


# ---------------------------------------------------------------------------- the KV cache's prune/commit
def attended(cache: KVCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values each pending node attends to (all layers), in attention order."""
    out = []
    if not cache.n_pending:
        return out
    for idx in cache.attended_slots(cache.n_pending):
        out.append((cache.k.index_select(3, idx).clone(), cache.v.index_select(3, idx).clone()))
    return out


def positions(cache: KVCache) -> list[int]:
    return [cache.length + cache.pos_offset + d for d in cache._depths]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_prune_pending_keeps_each_kept_nodes_keys_in_order(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    cache = KVCache(2, 2, 4, max_len=64, max_pending=6)
    prefix = data.draw(st.integers(1, 5))
    cache.plan_append(None, prefix)
    for layer in range(2):
        cache.write(layer, torch.randn(1, 2, prefix, 4, generator=g), torch.randn(1, 2, prefix, 4, generator=g))
    cache.commit()
    n = data.draw(st.integers(1, 20))
    cache.reserve_pending(n)  # grows the ancestor table (from 6)
    assert cache.max_pending >= n
    parents = [data.draw(st.integers(-1, i - 1)) for i in range(n)]
    split = data.draw(st.integers(1, n))  # appended in two forwards: the second on top of the first
    for part in (parents[:split], parents[split:]):
        if part:
            cache.plan_append(part, len(part))
            for layer in range(2):
                t = len(part)
                cache.write(layer, torch.randn(1, 2, t, 4, generator=g), torch.randn(1, 2, t, 4, generator=g))
    before, pos = attended(cache), positions(cache)
    live = data.draw(st.sets(st.integers(0, n - 1), min_size=1))
    keep = set()
    for node in live:  # the live nodes and their ancestors
        while node >= 0 and node not in keep:
            keep.add(node)
            node = parents[node]
    slots = sorted(keep)
    chain = []  # the longest chain from a root that every kept node descends from
    while True:
        nxt = [s for s in slots if parents[s] == (chain[-1] if chain else -1)]
        if len(nxt) != 1:
            break
        chain.append(nxt[0])
    commit = data.draw(st.integers(0, len(chain)))
    length = cache.length
    mapping = cache.prune_pending(slots, commit=commit)
    assert cache.length == length + commit
    rest = slots[commit:]
    assert [mapping[s] for s in rest] == list(range(len(rest)))
    assert all(mapping[s] == -1 for s in range(n) if s not in rest)
    after, pos_after = attended(cache), positions(cache)
    for s in rest:  # the same keys and values, bit for bit, in the same order, at the same position
        j = mapping[s]
        assert torch.equal(after[j][0], before[s][0]) and torch.equal(after[j][1], before[s][1])
        assert pos_after[j] == pos[s]
    for j, s in enumerate(slots[:commit]):  # committed in place of the chain
        assert torch.equal(cache.k[:, :, :, length + j], before[s][0][:, :, :, -1])


def test_prune_pending_refuses_what_is_not_a_tree_prefix():
    cache = KVCache(1, 1, 4, max_len=32)
    cache.plan_append([-1, 0, 0, -1], 4)  # two roots: 0 (children 1, 2) and 3
    with pytest.raises(ValueError, match="dropped parent"):
        cache.prune_pending([1], commit=0)
    with pytest.raises(ValueError, match="chain"):
        cache.prune_pending([0, 1, 2], commit=2)  # 2 is not 1's child
    with pytest.raises(ValueError, match="descend"):
        cache.prune_pending([0, 3], commit=1)  # 3 is not below the committed 0
    with pytest.raises(ValueError, match="ascending"):
        cache.prune_pending([1, 0], commit=0)
    assert cache.n_pending == 4  # nothing changed
    assert cache.prune_pending([0, 2], commit=1) == [-1, -1, 0, -1]
    assert (cache.length, cache._parents, cache._depths) == (1, [-1], [0])


def recording_expand(monkeypatch):
    """Record, for every node a search appends, its tokens (from the prompt's end) and its logits."""
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    paths: dict[int, tuple[int, ...]] = {search_mod.ROOT: ()}
    original = search_mod.TreeKV.expand_co

    def expand_co(self, parents, tokens, hidden=None):
        ids, logits = yield from original(self, parents, tokens, hidden)
        for nid, p, tok, row in zip(ids, parents, tokens, logits):
            paths[nid] = paths[p] + (tok,)
            seen[paths[nid]] = row.clone()
        return ids, logits

    monkeypatch.setattr(search_mod.TreeKV, "expand_co", expand_co)
    return seen


@pytest.mark.parametrize("seed, prompt", [(0, "The cat"), (1, "a")])
def test_pruned_and_committed_tree_gives_each_hypothesis_its_logits_bitwise(monkeypatch, seed, prompt):
    # int8 weights and the invariant attention: every op is batch invariant, so a hypothesis's
    # logits in the search's tree (after its prunes and commits) must be the bits of feeding the
    # prompt and the hypothesis one token at a time into a fresh cache
    lm = leapdecode.load(f"tiny-random:{seed}", weights="int8")
    assert lm.model.attention == "invariant"
    seen = recording_expand(monkeypatch)
    prunes = []
    original = KVCache.prune_pending

    def spy(self, slots, commit=0):
        prunes.append((len(slots), commit, self.n_pending))
        return original(self, slots, commit)

    monkeypatch.setattr(KVCache, "prune_pending", spy)
    ids = prompt_ids(lm, prompt)
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="beam", num_beams=4, max_new_tokens=12)
    assert res.hypotheses and len(seen) > 20
    # (these prompts were picked so that the search does both)
    assert any(0 < c < kept for kept, c, _ in prunes), "no commit of a shared prefix below live branches"
    assert any(kept < pending for kept, _, pending in prunes), "the search never dropped a node"
    model = lm.model
    for path, row in seen.items():
        cache = model.new_cache(max_len=len(ids) + len(path) + 1)
        if len(ids) > 1:
            model.forward(torch.tensor([ids[:-1]]), cache, logits_for=slice(0, 0))
            cache.commit()
        for tok in [ids[-1], *path]:
            logits = model.forward(torch.tensor([[tok]]), cache)
            cache.commit()
        assert torch.equal(logits[0, -1], row), f"hypothesis {path}: logits differ from the recomputed ones"


# ---------------------------------------------------------------------------- the cache goes back
def test_the_runner_gets_the_cache_back_after_a_search_and_after_errors(monkeypatch):
    _, lm = hf_pair()
    runner = ModelRunner(lm)
    runner.add_draft("amateur", lm)  # contrastive decoding's amateur (any model of the vocabulary will do)
    options = {"contrastive": {"amateur": "amateur"}}
    ids = prompt_ids(lm, "The cat")
    for name in STRATEGIES:
        t = 1.0 if STRATEGIES[name].config.stochastic else 0.0
        res = leapdecode.generate(runner, prompt_ids=ids, strategy=name, max_new_tokens=5, temperature=t, seed=0,
                                  strategy_options=options.get(name))
        assert res.hypotheses and runner.caches_in_use == 0, name
    # abandoned after one round
    s = leapdecode.stream(runner, prompt_ids=ids, strategy="beam", max_new_tokens=5)
    s.step()
    s.step()
    assert runner.caches_in_use == 1
    s.close()
    assert runner.caches_in_use == 0 and s.result.finish_reason == "cancelled"
    # cancelled: the next step finishes it
    s = leapdecode.stream(runner, prompt_ids=ids, strategy="beam", max_new_tokens=5)
    s.step()
    s.cancel()
    assert s.step().finished and s.result.finish_reason == "cancelled" and runner.caches_in_use == 0
    # a failure inside a round
    calls = []
    original = search_mod.TreeKV.expand_co

    def failing(self, parents, tokens, hidden=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("planted fault")
        return (yield from original(self, parents, tokens, hidden))

    monkeypatch.setattr(search_mod.TreeKV, "expand_co", failing)
    s = leapdecode.stream(runner, prompt_ids=ids, strategy="beam", max_new_tokens=5)
    with pytest.raises(RuntimeError, match="planted"):
        s.run()
    assert runner.caches_in_use == 0 and s.result.finish_reason == "error"
    monkeypatch.undo()
    # the cache given back is reused clean: a plain generation on this runner equals a fresh runner's
    a = leapdecode.generate(runner, prompt_ids=ids, method="vanilla", max_new_tokens=8)
    b = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, method="vanilla", max_new_tokens=8)
    assert a.tokens == b.tokens


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, named", [
    (dict(strategy="beams"), "unknown strategy 'beams'"),
    (dict(strategy="beam", strategy_options={"width": 2}), "no option 'width'"),
    (dict(strategy="beam", num_beams=0), "'num_beams'"),
    (dict(strategy="beam", num_beams=True), "'num_beams'"),
    (dict(strategy="beam", length_penalty=float("nan")), "'length_penalty'"),
    (dict(strategy="beam", patience=0), "'patience'"),
    (dict(strategy="beam", strategy_options={"early_stopping": "sometimes"}), "'early_stopping'"),
    (dict(strategy="beam", num_beams=2, num_return_sequences=3), "'num_return_sequences'"),
    (dict(strategy="beam", num_beams=2, patience=2.0, num_return_sequences=5), "'num_return_sequences'"),
    (dict(strategy="beam", num_beams=3, strategy_options={"num_beams": 4}), "disagree"),
    (dict(strategy="diverse-beam", num_beams=5, strategy_options={"num_beam_groups": 2}), "divisible"),
    (dict(strategy="diverse-beam", patience=2.0), "no option 'patience'"),
    (dict(strategy="best-first-beam", length_penalty=1.0), "no option 'length_penalty'"),
    (dict(strategy="beam", method="pld"), "does not combine with method 'pld'"),
    (dict(strategy="beam", method="auto"), "does not combine with method 'auto'"),
    (dict(strategy="beam", temperature=0.7), "deterministic"),
    (dict(strategy="stochastic-beam"), "temperature > 0"),
    (dict(strategy="cps-beam", temperature=1.0, top_k=5), "top_k"),
    (dict(strategy="beam", stop=["x"]), "stop"),
    (dict(strategy="beam", kv_policy="int8"), "kv_policy"),
    (dict(strategy="beam", regex="[a-z]+"), "does not combine with regex"),
    (dict(num_beams=4), "num_beams needs a strategy"),
    (dict(strategy_options={"num_beams": 4}), "need a strategy"),
    (dict(strategy="beam", strategy_options=[1]), "mapping"),
])
def test_bad_strategy_parameters_are_typed_errors_naming_them(kwargs, named, monkeypatch):
    _, lm = hf_pair()
    runner = ModelRunner(lm)
    monkeypatch.setattr(search_mod.TreeKV, "__init__", lambda *a, **k: pytest.fail("a search started"))
    with pytest.raises(InvalidParameterError) as info:
        leapdecode.generate(runner, "hi", max_new_tokens=4, **kwargs)
    assert named in str(info.value)
    assert runner.caches_in_use == 0


def test_a_strategy_config_object_and_its_options():
    _, lm = hf_pair()
    ids = prompt_ids(lm, "The cat")
    a = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy=BeamConfig(num_beams=3, length_penalty=0.5),
                            max_new_tokens=6)
    b = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="beam",
                            strategy_options={"num_beams": 3, "length_penalty": 0.5}, max_new_tokens=6)
    c = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy=BeamConfig(num_beams=2), num_beams=3,
                            length_penalty=0.5, max_new_tokens=6)
    assert [h.to_dict() for h in a.hypotheses] == [h.to_dict() for h in b.hypotheses] == \
        [h.to_dict() for h in c.hypotheses]
    assert len(a.hypotheses) == 3 and a.stats["strategy"] == "beam" and a.stats["method"] == "vanilla"
    assert strategy_config("beam", {"early_stopping": "never"}).early_stopping == "never"
    # the default stays no strategy: greedy decoding with the default method
    assert "hypotheses" not in leapdecode.generate(ModelRunner(lm), prompt_ids=ids, max_new_tokens=3).to_dict()


# ---------------------------------------------------------------------------- best-first beam search
def paper_beam(logp, k: int, max_new: int, eos: set[int]) -> tuple[list[int], float]:
    """Beam search as "Best-First Beam Search" (Meister et al., 2020) defines it: each step keeps the
    k best of the running hypotheses' extensions and the finished hypotheses (which stay in the beam);
    it ends when all k are finished (or at max_new); returns the best."""
    beam = [((), 0.0, False)]
    for _ in range(max_new):
        cands = []
        for toks, score, done in beam:
            if done:
                cands.append((toks, score, True))
                continue
            row = logp(list(toks)).tolist()
            cands += [(toks + (t,), score + v, t in eos or len(toks) + 1 == max_new) for t, v in enumerate(row)]
        cands.sort(key=lambda c: -c[1])
        beam = cands[:k]
        if all(c[2] for c in beam):
            break
    best = max(beam, key=lambda c: c[1])
    return list(best[0]), best[1]


def exhaustive_mode(logp, max_new: int, eos: set[int], vocab: int) -> tuple[list[int], float]:
    """The most probable complete sequence (ended by eos, or max_new long), by brute force."""
    best: tuple[list[int], float] = ([], -math.inf)
    stack = [((), 0.0)]
    while stack:
        toks, score = stack.pop()
        row = logp(list(toks)).tolist()
        for t in range(vocab):
            s = score + row[t]
            if t in eos or len(toks) + 1 == max_new:
                if s > best[1]:
                    best = (list(toks) + [t], s)
            else:
                stack.append((toks + (t,), s))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_best_first_returns_beam_searchs_best_hypothesis(seed, k):
    # the paper's result for monotone scores (log-probabilities): under the beam constraint k,
    # best-first beam search returns beam search's best hypothesis, with at most as many expansions
    lm = small_vocab(6, seed)
    ids = [1, 3, 2]
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="best-first-beam", num_beams=k,
                              max_new_tokens=5)
    tokens, score = paper_beam(lambda t: native_logp(lm, ids + t), k, 5, lm.eos_token_ids)
    best = res.hypotheses[0]
    assert best.tokens == tokens
    assert best.score == pytest.approx(score, abs=1e-4)
    assert res.stats["expansions"] <= k * 5


@pytest.mark.parametrize("seed", [0, 3])
def test_best_first_without_a_beam_constraint_finds_the_mode(seed):
    # with k at least the hypotheses of any length it is uniform-cost search: the exact mode
    lm = small_vocab(6, seed)
    ids = [2, 0]
    tokens, score = exhaustive_mode(lambda t: native_logp(lm, ids + t), 3, lm.eos_token_ids, 6)
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="best-first-beam", num_beams=256,
                              num_return_sequences=3, max_new_tokens=3)
    assert res.hypotheses[0].tokens == tokens
    assert res.hypotheses[0].score == pytest.approx(score, abs=1e-4)
    scores = [h.score for h in res.hypotheses]
    assert scores == sorted(scores, reverse=True) and len(scores) == 3  # popped best first
    # and a small beam may miss it (else the comparison above proves little)
    narrow = [leapdecode.generate(ModelRunner(small_vocab(6, s)), prompt_ids=ids, strategy="best-first-beam",
                                  num_beams=1, max_new_tokens=3).hypotheses[0].tokens
              for s in range(6)]
    modes = [exhaustive_mode(lambda t, s=s: native_logp(small_vocab(6, s), ids + t), 3, {5}, 6)[0] for s in range(6)]
    assert narrow != modes


# ---------------------------------------------------------------------------- stochastic beams
def leaves(lm: LoadedModel, ids: list[int], max_new: int, temperature: float = 1.0):
    """Every complete sequence and its probability at ``temperature`` (brute force)."""
    out = {}
    stack = [((), 0.0)]
    vocab = lm.model.cfg.vocab_size
    while stack:
        toks, lp = stack.pop()
        logits = native_logp(lm, ids + list(toks))  # log-softmax at T=1; rescale for T
        row = torch.log_softmax(logits / temperature, dim=-1).double() if temperature != 1.0 else logits.double()
        for t in range(vocab):
            s = lp + float(row[t])
            if t in lm.eos_token_ids or len(toks) + 1 == max_new:
                out[toks + (t,)] = math.exp(s)
            else:
                stack.append((toks + (t,), s))
    return out


def ordered_pair_probs(p: dict) -> dict:
    """Sampling two without replacement (Plackett-Luce): P(a first, b second) = p_a p_b / (1 - p_a)."""
    return {(a, b): pa * pb / (1 - pa) for a, pa in p.items() for b, pb in p.items() if a != b}


def run_stochastic(lm, ids, n, **kw):
    runner = ModelRunner(lm)
    return [leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=2, seed=i, **kw) for i in range(n)]


def test_stochastic_beam_samples_sequences_without_replacement(chi2, monkeypatch):
    lm = small_vocab(3, seed=4, std=0.6, embed_scale=0.12)
    ids = [0, 1]
    p = leaves(lm, ids, 2)
    assert len(p) == 7 and abs(sum(p.values()) - 1) < 1e-5
    assert min(p.values()) > 0.03  # flat enough that every ordered pair is seen
    expected = ordered_pair_probs(p)
    total = sum(expected.values())
    expected = {c: v / total for c, v in expected.items()}
    cells = sorted(expected)
    n = 1200

    def frequencies(results):
        counts = dict.fromkeys(cells, 0)
        for r in results:
            counts[tuple(tuple(h.tokens) for h in r.hypotheses)] += 1
        return [counts[c] for c in cells]

    results = run_stochastic(lm, ids, n, strategy="stochastic-beam", num_beams=2, temperature=1.0)
    assert all(len(r.hypotheses) == 2 for r in results)
    stat, df, pval = chi2(frequencies(results), [expected[c] for c in cells])
    assert pval > 1e-3, (stat, df, pval)
    # the keys are Gumbel-max keys: the first hypothesis's key is the largest, and each hypothesis's
    # log-probability is its model log-probability
    for r in results[:50]:
        keys = [h.score for h in r.hypotheses]
        assert keys == sorted(keys, reverse=True)
        for h in r.hypotheses:
            assert h.logprob == pytest.approx(math.log(p[tuple(h.tokens)]), abs=1e-5)
    # a planted error: children's Gumbels not conditioned on their parent's key; the test must see it
    from leapdecode.strategies.stochastic_beam import StochasticBeamSearch

    def unconditioned(self, parent_key, phi):
        u = torch.rand(phi.shape, generator=self.generator, dtype=torch.float64).clamp_(min=1e-300)
        return phi - torch.log(-torch.log(u))

    monkeypatch.setattr(StochasticBeamSearch, "condition", unconditioned)
    wrong = run_stochastic(lm, ids, n, strategy="stochastic-beam", num_beams=2, temperature=1.0)
    assert chi2(frequencies(wrong), [expected[c] for c in cells])[2] < 1e-3


@pytest.mark.parametrize("strategy", ["stochastic-beam", "cps-beam"])
def test_a_stochastic_beam_as_wide_as_the_tree_returns_every_sequence(strategy):
    lm = small_vocab(3, seed=4, std=0.6, embed_scale=0.12)
    ids = [0, 1]
    p = leaves(lm, ids, 2, temperature=0.8)
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy=strategy, num_beams=7, max_new_tokens=2,
                              temperature=0.8, seed=1)
    assert sorted(tuple(h.tokens) for h in res.hypotheses) == sorted(p)
    for h in res.hypotheses:
        assert h.logprob == pytest.approx(math.log(p[tuple(h.tokens)]), abs=1e-5)
        if strategy == "cps-beam":  # every candidate was in every round's sample
            assert h.to_dict()["log_inclusion"] == pytest.approx(0.0, abs=1e-9)
    # the same seed, the same samples
    again = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy=strategy, num_beams=3, max_new_tokens=2,
                                temperature=0.8, seed=5)
    twice = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy=strategy, num_beams=3, max_new_tokens=2,
                                temperature=0.8, seed=5)
    assert [h.to_dict() for h in again.hypotheses] == [h.to_dict() for h in twice.hypotheses]


def brute_conditional_poisson(w: list[float], k: int) -> dict[tuple[int, ...], float]:
    sets = {s: math.prod(w[i] for i in s) for s in itertools.combinations(range(len(w)), k)}
    z = sum(sets.values())
    return {s: v / z for s, v in sets.items() if v > 0}


@pytest.mark.parametrize("w, k", [([0.5, 2.0, 1.0, 0.1, 3.0, 0.7], 2), ([0.5, 2.0, 1.0, 0.1, 3.0, 0.7, 1.3], 3),
                                  ([1.0, 0.0, 4.0, 0.25, 0.0], 2)])
def test_conditional_poisson_sample_is_exact(chi2, w, k):
    probs = brute_conditional_poisson(w, k)
    log_w = torch.tensor([math.log(x) if x > 0 else -math.inf for x in w], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    counts = dict.fromkeys(probs, 0)
    n = 3000
    for _ in range(n):
        chosen, incl = conditional_poisson_sample(log_w, k, g)
        assert tuple(chosen) in counts  # never a zero-weight item, always k distinct, ascending
        counts[tuple(chosen)] += 1
        for i, li in zip(chosen, incl):  # inclusion probabilities: the sum over the sets holding i
            assert li == pytest.approx(math.log(sum(v for s, v in probs.items() if i in s)), abs=1e-9)
    cells = sorted(probs)
    stat, df, pval = chi2([counts[c] for c in cells], [probs[c] for c in cells])
    assert pval > 1e-3, (stat, df, pval)


def test_conditional_poisson_with_fewer_candidates_than_k_takes_them_all():
    g = torch.Generator().manual_seed(0)
    chosen, incl = conditional_poisson_sample(torch.tensor([0.0, -math.inf, 1.0]), 3, g)
    assert chosen == [0, 2] and incl == pytest.approx([0.0, 0.0])
    lw = odds_weights(torch.tensor([math.log(0.2), math.log(0.3), math.log(0.5)]))
    assert torch.allclose(lw.exp(), torch.tensor([0.25, 0.3 / 0.7, 1.0], dtype=torch.float64))


# ---------------------------------------------------------------------------- diverse beam search
@pytest.mark.parametrize("groups, k, length_penalty, early_stopping", [(2, 4, 1.0, False), (3, 3, 0.5, True),
                                                                       (2, 6, 2.0, "never")])
def test_diverse_beam_without_penalty_is_independent_beam_searches(groups, k, length_penalty, early_stopping):
    _, lm = hf_pair()
    ids = prompt_ids(lm, "The cat")
    common = dict(prompt_ids=ids, max_new_tokens=8, length_penalty=length_penalty)
    div = leapdecode.generate(ModelRunner(lm), strategy="diverse-beam", num_beams=k,
                              strategy_options={"num_beam_groups": groups, "diversity_penalty": 0.0,
                                                "early_stopping": early_stopping}, **common)
    one = leapdecode.generate(ModelRunner(lm), strategy="beam", num_beams=k // groups,
                              strategy_options={"early_stopping": early_stopping}, **common)
    assert [h.tokens for h in div.hypotheses] == [h.tokens for h in one.hypotheses for _ in range(groups)]
    # (the forwards hold twice the rows: fp32 linear layers round differently, hence approx)
    assert [h.score for h in div.hypotheses] == pytest.approx([h.score for h in one.hypotheses
                                                                for _ in range(groups)], rel=1e-5)
    got = [h.info["group"] for h in div.hypotheses]  # each hypothesis once per group
    assert all(sorted(got[i : i + groups]) == list(range(groups)) for i in range(0, len(got), groups))


def test_diverse_beam_groups_avoid_each_others_tokens():
    _, lm = hf_pair()
    ids = prompt_ids(lm, "Hello there")
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="diverse-beam", num_beams=4, max_new_tokens=8,
                              strategy_options={"num_beam_groups": 2, "diversity_penalty": 1e3})
    first = {g: {tuple(h.tokens[:1]) for h in res.hypotheses if h.info["group"] == g and len(h.tokens) > 1}
             for g in (0, 1)}
    assert first[0] and first[1] and not first[0] & first[1]
    # a penalty only ever lowers scores: group 0 is never penalized
    for h in res.hypotheses:
        plain = h.logprob / len(h.tokens)
        assert h.score == pytest.approx(plain, abs=1e-4) if h.info["group"] == 0 else h.score <= plain + 1e-4
    # without the penalty both groups find the same first tokens
    same = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="diverse-beam", num_beams=4,
                               max_new_tokens=8, strategy_options={"num_beam_groups": 2, "diversity_penalty": 0.0})
    firsts = [{tuple(h.tokens[:1]) for h in same.hypotheses if h.info["group"] == g} for g in (0, 1)]
    assert firsts[0] == firsts[1]


# ---------------------------------------------------------------------------- CLI
def test_cli_generate_with_a_strategy_prints_every_hypothesis(capsys):
    from leapdecode import cli

    rc = cli.main(["generate", "-m", "tiny-random", "--strategy", "beam", "--num-beams", "3", "--n", "2",
                   "--length-penalty", "0.5", "--strategy-option", "early_stopping=never", "--max-new-tokens", "6",
                   "--json", "Hello"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = leapdecode.generate(leapdecode.load("tiny-random"), "Hello", strategy="beam", num_beams=3,
                              num_return_sequences=2, length_penalty=0.5, max_new_tokens=6,
                              strategy_options={"early_stopping": "never"})
    assert out["hypotheses"] == [h.to_dict() for h in ref.hypotheses]
    assert len(out["hypotheses"]) == 2 and out["text"] == ref.text and out["stats"]["strategy"] == "beam"
    # text mode: the best hypothesis
    assert cli.main(["generate", "-m", "tiny-random", "--strategy", "best-first-beam", "--num-beams", "2",
                     "--max-new-tokens", "6", "Hello"]) == 0
    best = leapdecode.generate(leapdecode.load("tiny-random"), "Hello", strategy="best-first-beam", num_beams=2,
                               max_new_tokens=6)
    assert capsys.readouterr().out == best.text + "\n"


@pytest.mark.parametrize("argv, named", [
    (["--num-beams", "3"], "--num-beams needs a --strategy"),
    (["--strategy-option", "num_beams=3"], "--strategy-option"),
    (["--strategy", "beam", "--num-beams", "0"], "num_beams"),
    (["--strategy", "beam", "--strategy-option", "beams=2"], "no option 'beams'"),
    (["--strategy", "beam", "--strategy-option", "length_penalty=x"], "length_penalty"),
    (["--strategy", "beam", "--num-beams", "2", "--strategy-option", "num_beams=3"], "disagree"),
    (["--strategy", "diverse-beam", "--patience", "2"], "--patience"),
    (["--strategy", "beam", "--method", "draft"], "does not combine with method 'draft'"),
    (["--strategy", "beam", "--temperature", "0.8"], "deterministic"),
    (["--strategy", "cps-beam"], "temperature > 0"),
    (["--strategy", "beam", "--regex", "[a-z]+"], "does not combine with --regex"),
    (["--strategy", "beam", "--n", "9"], "num_return_sequences"),
])
def test_cli_bad_strategy_flags_exit_2_naming_them_before_loading(no_loading, capsys, argv, named):
    from leapdecode import cli

    rc = cli.main(["generate", "-m", "tiny-random", *argv, "hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("leapdecode: error:") and named in err


def test_strategies_command_and_the_docs_tables(capsys):
    from pathlib import Path

    from leapdecode import cli

    assert cli.main(["strategies", "--markdown"]) == 0
    md = capsys.readouterr().out
    assert md.strip() == cli.strategies_markdown().strip()
    for name, spec in STRATEGIES.items():
        assert f"### `{name}` strategy options" in md
        for opt in spec.config.option_names():
            assert f"| `{opt}` |" in md
    doc = (Path(__file__).resolve().parents[1] / "docs" / "methods.md").read_text()
    begin, end = "<!-- strategies:begin -->\n", "\n<!-- strategies:end -->"
    assert begin in doc and end in doc, "docs/methods.md lost its generated strategies section"
    assert doc[doc.index(begin) + len(begin) : doc.index(end)].strip() == md.strip(), (
        "docs/methods.md's strategy tables differ from the configs: regenerate with `leapdecode strategies --markdown`")
    assert cli.main(["strategies"]) == 0
    assert "cps-beam" in capsys.readouterr().out


# ---------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server():
    yield from tiny_server("auto")


def test_server_returns_the_n_best_hypotheses_as_n_choices(server):
    httpx = pytest.importorskip("httpx")
    ref_model = leapdecode.load("tiny-random", dtype="fp32")
    body = {"model": server.model.name, "prompt": "Hello", "max_tokens": 8, "n": 3,
            "leapdecode": {"strategy": "beam", "strategy_options": {"num_beams": 4, "length_penalty": 0.5}}}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    ref = leapdecode.generate(ref_model, "Hello", strategy="beam", num_beams=4, num_return_sequences=3,
                              length_penalty=0.5, max_new_tokens=8)
    assert [c["text"] for c in out["choices"]] == [h.text for h in ref.hypotheses]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["leapdecode"]["strategy"] == "beam" and out["leapdecode"]["method"] == "vanilla"
    assert [c["score"] for c in out["leapdecode"]["choices"]] == [h.score for h in ref.hypotheses]
    assert out["usage"]["completion_tokens"] == sum(len(h.tokens) - (h.finish_reason == "stop")
                                                    for h in ref.hypotheses)
    # streamed chat, a stochastic strategy: the same seed gives the API's samples
    chat = [{"role": "user", "content": "hi"}]
    body = {"model": server.model.name, "messages": chat, "max_tokens": 6, "n": 2, "stream": True, "seed": 3,
            "leapdecode": {"strategy": "stochastic-beam", "strategy_options": {"num_beams": 3}}}
    texts = {0: "", 1: ""}
    finished = set()
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:]).get("choices", []):
                    texts[c["index"]] += c["delta"].get("content") or ""
                    if c.get("finish_reason"):
                        finished.add(c["index"])
    ref = leapdecode.generate(ref_model, chat, strategy="stochastic-beam", num_beams=3, num_return_sequences=2,
                              max_new_tokens=6, temperature=1.0, seed=3)
    assert [texts[0], texts[1]] == [h.text for h in ref.hypotheses] and finished == {0, 1}
    assert server.runner.caches_in_use == 0


@pytest.mark.parametrize("extra, param", [
    ({"leapdecode": {"strategy": "beam", "method": "pld"}}, "leapdecode.method"),
    ({"leapdecode": {"strategy": "beam", "strategy_options": {"num_beams": 0}}}, "leapdecode.strategy_options.num_beams"),
    ({"leapdecode": {"strategy": "beam", "strategy_options": {"beams": 2}}}, "leapdecode.strategy_options.beams"),
    ({"leapdecode": {"strategy": "beam"}, "n": 5}, "n"),
    ({"leapdecode": {"strategy": "beam"}, "temperature": 0.7}, "temperature"),
    ({"leapdecode": {"strategy": "cps-beam"}, "temperature": 0}, "temperature"),
    ({"leapdecode": {"strategy": "beam"}, "stop": ["x"]}, "stop"),
    ({"leapdecode": {"strategy": "beam", "top_k": 3}}, "leapdecode.top_k"),
    ({"leapdecode": {"strategy": "beams"}}, "leapdecode.strategy"),
    ({"leapdecode": {"strategy_options": {"num_beams": 2}}}, "leapdecode.strategy_options"),
])
def test_server_refuses_bad_strategy_requests_naming_the_field(server, extra, param):
    httpx = pytest.importorskip("httpx")
    body = {"model": server.model.name, "prompt": "Hello", "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ---------------------------------------------------------------------------- a real model
@pytest.mark.integration
def test_beam_on_smollm2_equals_transformers():
    from leapdecode.models.hf_backend import transformers_model

    lm = leapdecode.load("smollm2-135m", dtype="fp32", device="cpu", weights="fp32")
    hf = transformers_model(lm.path, lm.gguf, torch.float32).eval()  # transformers' own copy, from the GGUF
    ids = lm.tokenizer.encode("The capital of France is")
    eos = sorted(lm.eos_token_ids)
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), num_beams=3,
                      num_return_sequences=3, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                      pad_token_id=eos[0], return_dict_in_generate=True, output_scores=True)
    res = leapdecode.generate(lm, prompt_ids=ids, strategy="beam", num_beams=3, max_new_tokens=10)
    assert [h.tokens for h in res.hypotheses] == [strip(out.sequences[i, len(ids):].tolist(), set(eos))
                                                  for i in range(3)]
    assert [h.score for h in res.hypotheses] == pytest.approx(out.sequences_scores.tolist(), rel=1e-4, abs=1e-4)


# ---------------------------------------------------------------------------- backends and the prefix cache
def test_beam_on_the_transformers_backend_equals_transformers_generate():
    from leapdecode.models.hf_backend import HFCausalLM

    hf, native = hf_pair()
    lm = LoadedModel(name="hf-backend", model=HFCausalLM(hf, max_seq_len=256), tokenizer=native.tokenizer,
                     eos_token_ids=set(EOS))
    ids = prompt_ids(lm, "The cat")
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), num_beams=3,
                      num_return_sequences=3, max_new_tokens=9, length_penalty=0.5, do_sample=False,
                      eos_token_id=list(EOS), pad_token_id=EOS[0], return_dict_in_generate=True, output_scores=True)
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="beam", num_beams=3, length_penalty=0.5,
                              max_new_tokens=9)
    assert [h.tokens for h in res.hypotheses] == [strip(out.sequences[i, len(ids):].tolist()) for i in range(3)]
    assert [h.score for h in res.hypotheses] == pytest.approx(out.sequences_scores.tolist(), rel=2e-5, abs=2e-5)


def test_a_search_reuses_the_prompts_keys_from_the_prefix_cache():
    _, lm = hf_pair()
    runner = ModelRunner(lm)
    ids = [(i * 7) % 250 for i in range(600)]  # two whole 256-token chunks before the last token
    first = leapdecode.generate(runner, prompt_ids=ids, strategy="beam", num_beams=3, max_new_tokens=6)
    again = leapdecode.generate(runner, prompt_ids=ids, strategy="beam", num_beams=3, max_new_tokens=6)
    assert first.stats["prefix_reused"] == 0 and again.stats["prefix_reused"] == 512
    assert [h.to_dict() for h in again.hypotheses] == [h.to_dict() for h in first.hypotheses]
    # and a plain generation finds the chunks a search stored (the same chunking)
    plain = leapdecode.generate(runner, prompt_ids=ids, method="vanilla", max_new_tokens=2)
    assert plain.stats["prefix_reused"] == 512
