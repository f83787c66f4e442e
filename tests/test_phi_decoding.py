"""phi-Decoding (issue 16, section 3): foresight sampling with clustering, in-width and in-depth
pruning.

* its pieces against their definitions: TF-IDF (scikit-learn's formula), k-means on separable
  texts, the in-width rule, the joint selection weights, draws without replacement (chi-square);
* a scorer that prefers a kind of step steers the output toward it, and a planted reversed scorer
  away from it (both against plain sampling from the same model);
* the candidate steps are samples of the model (chi-square), and the tokens returned carry the
  model's own log-probabilities (the pruned and committed KV tree gives the right logits);
* the step, early-stop and token limits; seeded runs repeat;
* refusals with typed errors (a speculative method, a tree too large, the 'tests' scorer), and
  the API, the CLI and the server give the same search.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import leapdecode
from leapdecode import runner_for
from leapdecode.core.sampling import SamplingParams, target_probs
from leapdecode.errors import InvalidParameterError, ScorerError
from leapdecode.strategies.phi_decoding import (PhiDecodingConfig, draw_without_replacement, kmeans,
                                                selection_weights, softmax, tfidf, width_keep)
from leapdecode.strategies.scorers import Sample
from helpers.server import tiny_server

ALPHA = 0.01
PROMPT = " return xabzz"


def _next_probs(model, ids, params):
    cache = model.model.new_cache(batch_size=1, max_len=len(ids) + 8)
    with torch.no_grad():
        logits = model.model.forward(torch.tensor([ids]), cache, logits_for=slice(-1, None))[0, -1]
    return target_probs(logits[None].float(), params)[0].double()


@pytest.fixture(scope="module")
def no_eos(tiny):
    return dataclasses.replace(tiny(seed=1), eos_token_ids=set())


def _even_share(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / len(tokens)


# ============================================================================ the pieces
def test_tfidf_is_scikit_learns_formula():
    x = tfidf(["a cat sat", "The cat", "dog dog!"])  # words of 2+ characters, lower-cased: cat dog sat the
    idf = {"cat": math.log(4 / 3) + 1, "dog": math.log(4 / 2) + 1, "sat": math.log(4 / 2) + 1,
           "the": math.log(4 / 2) + 1}
    rows = [[idf["cat"], 0, idf["sat"], 0], [idf["cat"], 0, 0, idf["the"]], [0, 2 * idf["dog"], 0, 0]]
    want = torch.tensor(rows, dtype=torch.float64)
    want = want / want.norm(dim=1, keepdim=True)
    assert torch.allclose(x, want, atol=1e-12)
    with pytest.raises(ValueError):
        tfidf(["a", "!?", ""])


@pytest.mark.parametrize("seed", range(5))
def test_kmeans_separates_separable_texts(seed):
    texts = ["the answer is 12 apples", "answer 12 apples then", "so 12 apples is the answer",
             "we divide by zero first", "divide by zero again", "zero divide"]
    g = torch.Generator().manual_seed(seed)
    labels = kmeans(tfidf(texts), 2, g)
    assert len(set(labels[:3])) == 1 and len(set(labels[3:])) == 1 and labels[0] != labels[3]
    with pytest.raises(ValueError):
        kmeans(tfidf(texts[:2]), 3, g)


def test_in_width_pruning_keeps_what_is_above_mean_minus_sigma_std():
    vals = [-0.1, -0.2, -0.3, -2.0, -0.15]
    t = torch.tensor(vals, dtype=torch.float64)
    bar = float(t.mean() - t.std(unbiased=False))
    assert width_keep(vals, 1.0) == [i for i, v in enumerate(vals) if v > bar] == [0, 1, 2, 4]
    assert width_keep(vals, 0.0) == [0, 1, 2, 4]  # above the mean (-0.55)
    assert width_keep([-1.0] * 4, 1.0) == []  # all equal: none is above (the code's strict rule)


def test_selection_weights_mix_the_advantage_softmax_and_the_cluster_share():
    adv, labels, tau = [0.3, -0.1, 0.2, 0.25], [0, 1, 0, 0], 0.1
    w = selection_weights(adv, labels, tau)
    a = softmax(adv, tau)
    share = [3 / 10, 1 / 10, 3 / 10, 3 / 10]  # cluster sizes 3, 1, 3, 3 over their sum 10
    assert w == pytest.approx([0.5 * x + 0.5 * s for x, s in zip(a, share)])
    assert sum(w) == pytest.approx(1.0)


def test_draws_without_replacement_follow_the_sequential_rule(chi2):
    w = [0.5, 0.3, 0.15, 0.05]
    g = torch.Generator().manual_seed(0)
    counts: dict = {}
    for _ in range(4000):
        pair = tuple(draw_without_replacement(w, 2, g))
        counts[pair] = counts.get(pair, 0) + 1
    keys = [(i, j) for i in range(4) for j in range(4) if i != j]
    expected = [w[i] * w[j] / (1 - w[i]) for i, j in keys]
    assert chi2([counts.get(k, 0) for k in keys], expected)[2] > ALPHA
    wrong = [w[i] * w[j] for i, j in keys]  # a planted error: the second draw ignores the first
    wrong = [x / sum(wrong) for x in wrong]
    assert chi2([counts.get(k, 0) for k in keys], wrong)[2] < ALPHA
    assert sorted(draw_without_replacement([0.0, 0.0, 1.0], 3, g))[0] == 0 and draw_without_replacement(w, 9, g)


# ============================================================================ the search
def test_a_scorer_that_prefers_a_kind_of_step_steers_the_output(no_eos):
    """The scorer (on each candidate's completed trajectory) counts even tokens minus odd ones:
    phi-decoding's outputs hold more even tokens than plain sampling's, and a planted reversed
    scorer's fewer (so the check can fail)."""
    def score(s: Sample) -> float:
        return float(sum(1 if t % 2 == 0 else -1 for t in s.tokens))

    kw = dict(temperature=1.0, max_new_tokens=12)
    plain = [_even_share(leapdecode.generate(no_eos, PROMPT, seed=s, method="vanilla", **kw).tokens)
             for s in range(40)]

    def mean_share(fn) -> float:
        cfg = PhiDecodingConfig(scorer=fn, max_step_tokens=2, max_steps=6)
        outs = [leapdecode.generate(no_eos, PROMPT, strategy=cfg, seed=s, **kw).hypotheses[0].tokens
                for s in range(10)]
        assert all(len(t) == 12 for t in outs)
        return sum(map(_even_share, outs)) / len(outs)

    base, right, wrong = sum(plain) / len(plain), mean_share(score), mean_share(lambda s: -score(s))
    assert right > base + 0.1, (right, base)
    assert wrong < base - 0.1, (wrong, base)
    assert runner_for(no_eos).caches_in_use == 0


def test_candidate_steps_are_samples_of_the_model(no_eos, chi2):
    """Without in-width pruning every first-step candidate gets a foresight, so the scorer sees
    all M * N of them first: pooled over runs, their first tokens follow the model at the
    temperature, and another temperature's distribution is rejected."""
    ids = no_eos.tokenizer.encode(PROMPT)
    temperature = 0.8
    counts: dict = {}
    for run in range(60):
        seen: list = []
        cfg = PhiDecodingConfig(step_beam_size=2, num_rollout=4, max_steps=1, max_step_tokens=1, width_pruning=False,
                                scorer=lambda s: seen.append(s.tokens) or 0.0)
        leapdecode.generate(no_eos, prompt_ids=ids, strategy=cfg, temperature=temperature, seed=run, max_new_tokens=3)
        for t in seen[:8]:
            counts[t[0]] = counts.get(t[0], 0) + 1
    p = _next_probs(no_eos, ids, SamplingParams(temperature=temperature))
    obs = [counts.get(i, 0) for i in range(len(p))]
    assert sum(obs) == 480
    assert chi2(obs, p.tolist())[2] > ALPHA
    assert chi2(obs, _next_probs(no_eos, ids, SamplingParams(temperature=1.6)).tolist())[2] < ALPHA


@pytest.mark.parametrize("seed", [0, 3])
def test_the_output_carries_the_models_own_log_probabilities(no_eos, seed):
    """The returned tokens' log-probability is the model's (temperature 1): the KV tree that
    pruned, committed and moved nodes between steps gave every token its own logits."""
    res = leapdecode.generate(no_eos, PROMPT, strategy="phi-decoding", temperature=1.0, seed=seed, max_new_tokens=14,
                              strategy_options={"max_step_tokens": 3, "max_steps": 3, "step_beam_size": 3,
                                                "num_rollout": 3})
    (h,) = res.hypotheses
    ids = no_eos.tokenizer.encode(PROMPT)
    want = sum(math.log(float(_next_probs(no_eos, ids + h.tokens[:j], SamplingParams(temperature=1.0))[t]))
               for j, t in enumerate(h.tokens))
    assert len(h.tokens) == 14 and h.logprob == pytest.approx(want, abs=1e-4)
    assert res.stats["kv_moved"] > 0  # the tree was really pruned and compacted on the way


def test_limits_and_the_early_stop(tiny, no_eos):
    res = leapdecode.generate(no_eos, PROMPT, strategy="phi-decoding", temperature=1.0, seed=1, max_new_tokens=10,
                              strategy_options={"max_step_tokens": 1, "max_steps": 3, "depth_pruning": False})
    st = res.stats
    assert st["steps"] == 3 and st["early_stop"] is None and len(res.tokens) == 10
    for rec in st["trace"]:
        assert rec["candidates"] == 16 and len(rec["selected"]) == 4 and rec["kept"] <= 16
    # a model whose samples agree: every selected step is the same text, the early stop comes at min_steps
    lm = dataclasses.replace(tiny(seed=0), eos_token_ids=set())
    res = leapdecode.generate(lm, "hello world", strategy="phi-decoding", temperature=1.0, seed=1, max_new_tokens=12,
                              strategy_options={"max_step_tokens": 1, "max_steps": 6, "min_steps": 2})
    assert res.stats["early_stop"] == "same steps" and res.stats["steps"] == 2
    assert len(res.tokens) == 12  # the final rollouts complete the solution
    off = leapdecode.generate(lm, "hello world", strategy="phi-decoding", temperature=1.0, seed=1, max_new_tokens=12,
                              strategy_options={"max_step_tokens": 1, "max_steps": 6, "min_steps": 2,
                                                "depth_pruning": False})
    assert off.stats["early_stop"] is None and off.stats["steps"] == 6


def test_beams_that_end_leave_the_step_beam(tiny):
    """With a likely end-of-sequence token, selected candidates that ended are kept as finished
    solutions and the beam shrinks; the output is one of them or a completed beam."""
    base = tiny(seed=1)
    ids = base.tokenizer.encode(PROMPT)
    eos = int(_next_probs(base, ids, SamplingParams(temperature=1.0)).argsort()[-1])
    lm = dataclasses.replace(base, eos_token_ids={eos})
    res = leapdecode.generate(lm, prompt_ids=ids, strategy="phi-decoding", temperature=1.0, seed=2, max_new_tokens=12,
                              strategy_options={"max_step_tokens": 2, "max_steps": 4})
    (h,) = res.hypotheses
    assert h.finish_reason in ("stop", "length") and len(h.tokens) <= 12
    assert (h.finish_reason == "stop") == (h.tokens[-1] == eos)
    assert sum(len(r["selected"]) for r in res.stats["trace"][-1:]) <= 4
    assert runner_for(lm).caches_in_use == 0


def test_same_seed_same_search(no_eos):
    def run(seed):
        return leapdecode.generate(no_eos, PROMPT, strategy="phi-decoding", temperature=0.9, seed=seed,
                                   max_new_tokens=10, strategy_options={"max_step_tokens": 2, "max_steps": 3})

    a, b, c = run(4), run(4), run(5)
    assert [h.to_dict() for h in a.hypotheses] == [h.to_dict() for h in b.hypotheses]
    assert a.stats["trace"] == b.stats["trace"]
    assert a.stats["trace"] != c.stats["trace"]


def test_each_step_of_the_search_runs_at_most_one_forward(tiny, monkeypatch):
    """A search is stepped like a generation: the first step prefills, every later one runs at most
    one forward (a server interleaves those with its other requests)."""
    lm = tiny(seed=1)
    decoder = lm.model
    calls: list = []
    forward = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    gen = leapdecode.start_generation(lm, PROMPT, strategy="phi-decoding", temperature=1.0, seed=0, max_new_tokens=10,
                                      strategy_options={"max_step_tokens": 2, "max_steps": 3})
    gen.step()
    first = len(calls)  # the prompt's chunks and its last token
    steps = 1
    while True:
        before = len(calls)
        done = gen.step().finished
        steps += 1
        assert len(calls) - before <= 1
        if done:
            break
    assert steps > 5 and gen.result.tokens
    assert gen.result.stats["target_forwards"] == 1 + len(calls) - first  # the last prompt token's, then the rounds'
    assert runner_for(lm).caches_in_use == 0


@pytest.mark.integration
def test_on_smollm2_rollouts_are_clustered_and_agreement_stops_early():
    """Real text: the candidates' rollouts are clustered (TF-IDF + k-means) at every step, and a
    threshold of 0 makes the first step at min_steps stop the stepping (the in-depth pruning)."""
    lm = leapdecode.load("smollm2-135m")
    q = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer step by step.\n"
    res = leapdecode.generate(lm, q, strategy="phi-decoding", temperature=0.7, seed=0, max_new_tokens=32,
                              strategy_options={"max_steps": 4, "max_step_tokens": 10, "foresight_tokens": 16,
                                                "positive_advantage": False, "threshold": 0.0, "min_steps": 2})
    st = res.stats
    assert st["early_stop"] == "cluster" and st["steps"] == 2
    for rec in st["trace"]:
        assert rec["clusters"] is not None and set(rec["clusters"]) <= {0, 1, 2}
        assert 4 <= len(rec["clusters"]) <= rec["kept"]
    assert res.text.strip() and len(res.tokens) <= 32
    assert runner_for(lm).caches_in_use == 0


# ============================================================================ errors
@pytest.mark.parametrize("kwargs, error, named", [
    (dict(method="pld"), InvalidParameterError, "does not combine with method 'pld'"),
    (dict(top_p=0.9), InvalidParameterError, "top_p"),
    (dict(temperature=0.0), InvalidParameterError, "temperature > 0"),
    (dict(strategy_options={"scorer": "tests"}), ScorerError, "cannot score a partial"),
    (dict(strategy_options={"num_return_sequences": 2}), InvalidParameterError, "num_return_sequences"),
    (dict(strategy_options={"tau": 0}), InvalidParameterError, "tau"),
    (dict(strategy_options={"step_delimiter": ""}), InvalidParameterError, "max_step_tokens"),
    (dict(max_new_tokens=400), InvalidParameterError, "tree nodes"),
    (dict(max_new_tokens=200, strategy_options={"num_rollout": 8}), InvalidParameterError, "tree nodes"),
])
def test_bad_phi_decoding_parameters_are_typed_errors(tiny, kwargs, error, named):
    kw = {"temperature": 1.0, **kwargs}
    with pytest.raises(error, match=named):
        leapdecode.start_generation(tiny(seed=1), PROMPT, strategy="phi-decoding", **kw)


def test_the_default_sizes_fit_and_a_long_output_fits_with_caps(tiny):
    assert PhiDecodingConfig().pending_nodes(256) <= 4096  # the API's default max_new_tokens
    gen = leapdecode.start_generation(tiny(seed=1), PROMPT, strategy="phi-decoding", temperature=1.0,
                                      max_new_tokens=800, strategy_options={"foresight_tokens": 8, "max_step_tokens": 8})
    assert gen.cfg.pending_nodes(800) <= 4096
    gen.close()


@pytest.mark.parametrize("m, n, max_new, step, ahead", [(2, 3, 40, None, None), (3, 2, 60, 3, 5), (2, 2, 30, 4, None)])
def test_the_tree_never_outgrows_the_nodes_reserved_for_it(no_eos, monkeypatch, m, n, max_new, step, ahead):
    """No end-of-sequence token, so every rollout runs to max_new_tokens: the tree reaches its
    bound, and the search reserves exactly ``pending_nodes`` (an overflow would raise)."""
    from leapdecode.strategies.search import TreeKV

    peak = [0]
    expand = TreeKV.expand

    def spy(self, parents, tokens, hidden=None):
        out = expand(self, parents, tokens, hidden)
        peak[0] = max(peak[0], self.pending)
        return out

    monkeypatch.setattr(TreeKV, "expand", spy)
    cfg = PhiDecodingConfig(step_beam_size=m, num_rollout=n, max_steps=3, max_step_tokens=step, foresight_tokens=ahead,
                            step_delimiter="" if step else "\n", width_pruning=False)
    res = leapdecode.generate(no_eos, PROMPT, strategy=cfg, temperature=1.0, seed=0, max_new_tokens=max_new)
    assert len(res.tokens) == max_new
    assert peak[0] <= cfg.pending_nodes(max_new)
    assert peak[0] > cfg.pending_nodes(max_new) // 2  # the bound is not loose by much


def test_cancel_close_and_a_failing_scorer_give_the_cache_back(tiny):
    lm = tiny(seed=1)
    gen = leapdecode.start_generation(lm, PROMPT, strategy="phi-decoding", temperature=1.0, seed=0, max_new_tokens=12,
                                      strategy_options={"max_step_tokens": 2, "max_steps": 4})
    for _ in range(4):
        gen.step()
    assert runner_for(lm).caches_in_use == 1
    gen.cancel()
    assert gen.step().finished and gen.result.finish_reason == "cancelled" and runner_for(lm).caches_in_use == 0
    gen = leapdecode.start_generation(lm, PROMPT, strategy="phi-decoding", temperature=1.0, seed=0, max_new_tokens=12,
                                      strategy_options={"max_step_tokens": 2, "max_steps": 4})
    gen.step()
    gen.step()
    gen.close()
    assert runner_for(lm).caches_in_use == 0
    calls = []

    def flaky(sample):
        calls.append(1)
        if len(calls) > 5:
            raise KeyError("no reward")
        return 0.0

    with pytest.raises(ScorerError, match="raised KeyError"):
        leapdecode.generate(lm, PROMPT, strategy=PhiDecodingConfig(scorer=flaky, max_step_tokens=2), temperature=1.0, seed=0,
                            max_new_tokens=12)
    assert runner_for(lm).caches_in_use == 0


# ============================================================================ CLI and server
def test_cli_runs_phi_decoding_as_the_api_does(capsys):
    from leapdecode import cli

    argv = ["generate", "-m", "tiny-random", "--strategy", "phi-decoding", "--temperature", "0.9", "--seed", "3",
            "--strategy-option", "max_step_tokens=2", "--strategy-option", "max_steps=2",
            "--strategy-option", "num_rollout=2", "--max-new-tokens", "6", "--json", "Hello hello"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ref = leapdecode.generate(leapdecode.load("tiny-random"), "Hello hello", strategy="phi-decoding", temperature=0.9,
                              seed=3, max_new_tokens=6,
                              strategy_options={"max_step_tokens": 2, "max_steps": 2, "num_rollout": 2})
    assert out["hypotheses"] == [h.to_dict() for h in ref.hypotheses] and len(out["hypotheses"]) == 1
    assert out["stats"]["strategy"] == "phi-decoding" and out["stats"]["trace"] == ref.stats["trace"]


@pytest.fixture(scope="module")
def server():
    yield from tiny_server("vanilla")


def test_server_runs_phi_decoding_as_the_api_does(server):
    httpx = pytest.importorskip("httpx")
    options = {"max_step_tokens": 2, "max_steps": 2, "step_beam_size": 2}
    chat = [{"role": "user", "content": "hi"}]
    body = {"model": server.model.name, "messages": chat, "max_tokens": 6, "seed": 5, "temperature": 0.9,
            "leapdecode": {"strategy": "phi-decoding", "strategy_options": options}}
    r = httpx.post(server.url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ref = leapdecode.generate(leapdecode.load("tiny-random", dtype="fp32"), chat, strategy="phi-decoding",
                              temperature=0.9, seed=5, max_new_tokens=6, strategy_options=options)
    assert [c["message"]["content"] for c in r.json()["choices"]] == [ref.hypotheses[0].text]
    assert server.runner.caches_in_use == 0
    bad = dict(body, n=2)
    r = httpx.post(server.url + "/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    too_big = dict(body, max_tokens=400, leapdecode={"strategy": "phi-decoding"})  # a clear 400, no cache held
    r = httpx.post(server.url + "/chat/completions", json=too_big, timeout=60)
    assert r.status_code == 400 and "tree nodes" in r.json()["error"]["message"], r.text
    assert server.runner.caches_in_use == 0
