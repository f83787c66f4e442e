"""A*-decoding (issue 16, section 3): best-first search over sampled steps by a process reward.

* a callable scorer that prefers a known kind of step steers the search to it (and a planted
  wrong scorer does not: the check can fail); A*'s queue order against the scores it was given;
* the token budget and the expansion budget are respected; seeded runs repeat;
* each sampled step is a sample of the model (chi-square of the first two tokens of the steps of
  an expansion, drawn side by side in one tree), and another temperature's distribution is
  rejected;
* the prompt is prefilled once and the steps are nodes of one tree (no copies);
* a speculative method, sampling filters, a zero temperature and the 'tests' scorer are refused
  with typed errors; the API, the CLI and the server give the same search.
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
from leapdecode.strategies.a_star import AStarConfig
from leapdecode.strategies.scorers import Sample
from helpers.server import tiny_server

ALPHA = 0.01
PROMPT = " return xabzz"


@pytest.fixture(scope="module")
def no_eos(tiny):
    return dataclasses.replace(tiny(seed=0), eos_token_ids=set())


def _next_probs(model, ids, params):
    cache = model.model.new_cache(batch_size=1, max_len=len(ids) + 8)
    with torch.no_grad():
        logits = model.model.forward(torch.tensor([ids]), cache, logits_for=slice(-1, None))[0, -1]
    return target_probs(logits[None].float(), params)[0].double()


def _joint(model, ids, params, top: int = 12):
    """The exact joint of the first two sampled tokens, over the ``top`` likeliest first tokens
    (the rest pooled into one key per first token: None)."""
    p1 = _next_probs(model, ids, params)
    likeliest = set(torch.topk(p1, top).indices.tolist())
    out = {}
    for x in torch.nonzero(p1).flatten().tolist():
        if x in likeliest:
            p2 = _next_probs(model, ids + [x], params)
            for y in torch.nonzero(p2).flatten().tolist():
                out[(x, y)] = float(p1[x] * p2[y])
        else:
            out[(x, None)] = out.get((x, None), 0.0) + float(p1[x])
    return out


def _even_score(sample: Sample) -> float:
    """A process reward that prefers even token ids: +1 per even token, -100 per odd one."""
    return float(sum(1 if t % 2 == 0 else -100 for t in sample.tokens))


# ============================================================================ the search
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_scorer_that_prefers_a_kind_of_step_steers_the_search_to_it(tiny, seed):
    """Steps of one token; the reward prefers even tokens (which this model samples about 70% of
    the time: an all-even 12-token output about 1% of the time); A* with 4 samples per expansion
    finds one (a state whose samples are all odd is left for another all-even one)."""
    no_eos = dataclasses.replace(tiny(seed=1), eos_token_ids=set())
    kw = dict(temperature=1.0, seed=seed, max_new_tokens=12)
    opts = {"num_samples": 4, "max_step_tokens": 1, "token_budget": 600}
    res = leapdecode.generate(no_eos, PROMPT, strategy=AStarConfig(scorer=_even_score, **opts), **kw)
    (h,) = res.hypotheses
    assert len(h.tokens) == 12 and h.finish_reason == "length"
    assert all(t % 2 == 0 for t in h.tokens), h.tokens
    assert h.score == 12.0 and h.info["steps"] == 12
    assert res.stats["sampled_tokens"] <= 600 and res.stats["goals_popped"] == 1
    # a planted wrong reward (it prefers odd tokens) does not give an all-even output: the check can fail
    wrong = leapdecode.generate(no_eos, PROMPT, strategy=AStarConfig(scorer=lambda s: -_even_score(s), **opts), **kw)
    assert not all(t % 2 == 0 for t in wrong.hypotheses[0].tokens)
    assert runner_for(no_eos).caches_in_use == 0


def test_states_are_popped_best_first_by_g_plus_h(no_eos):
    """Replay the search from what the scorer saw and the expansions it reports: each expanded
    state had the lowest f = step_cost * steps - r of the states open at its pop (ties: the one
    pushed first), and a planted reordering (by r alone) is not what happened."""
    seen: dict[int, Sample] = {}

    def scorer(sample: Sample) -> float:
        seen[sample.index] = sample
        return float(sum(sample.tokens) % 7) - 0.1 * len(sample.tokens)

    cfg = AStarConfig(scorer=scorer, num_samples=3, max_step_tokens=1, token_budget=60, step_cost=0.5)
    res = leapdecode.generate(no_eos, PROMPT, strategy=cfg, temperature=1.0, seed=5, max_new_tokens=8)
    r = {i: scorer(s) for i, s in seen.items()}
    r[0] = 0.0
    steps = {i: len(s.tokens) for i, s in seen.items()}  # one token per step
    steps[0] = 0

    def replay(f) -> bool:
        open_ = {0}
        for sid, children in res.stats["expanded"]:
            best = min(open_, key=lambda q: (f(q), q))
            if best != sid:
                return False
            open_.discard(sid)
            for c in children:
                assert seen[c].tokens[:-1] == ([] if sid == 0 else seen[sid].tokens)  # a child extends its parent
            open_.update(children)
        return True

    assert len(res.stats["expanded"]) == res.stats["expansions"] > 5
    assert replay(lambda q: 0.5 * steps[q] - r[q])
    assert not replay(lambda q: -r[q])  # without the path cost the order differs: the check can fail


@pytest.mark.parametrize("budget, expansions", [(1, None), (7, None), (40, None), (300, 3), (300, 1)])
def test_the_token_and_expansion_budgets_are_respected(no_eos, budget, expansions):
    cfg = AStarConfig(num_samples=4, max_step_tokens=3, token_budget=budget, max_expansions=expansions,
                      scorer="sum-logprob")
    res = leapdecode.generate(no_eos, PROMPT, strategy=cfg, temperature=1.0, seed=3, max_new_tokens=30)
    st = res.stats
    assert st["sampled_tokens"] <= budget
    assert st["tree_nodes"] <= st["sampled_tokens"]  # every node is a sampled token, forwarded once
    if expansions is not None:
        assert st["expansions"] <= expansions
    assert st["budget_exhausted"]  # 30 tokens of sum-logprob: the budget ends first
    if budget < 4 * 3:  # not even one expansion fits: its cut steps are dropped, the prompt alone comes back
        assert res.tokens == [] and st["sampled_tokens"] == (0 if budget < 4 else 4) and st["expansions"] == 1
    else:
        assert res.tokens and res.finish_reason == "length"
    assert runner_for(no_eos).caches_in_use == 0


def test_a_goal_in_time_ends_the_search_before_the_budget(tiny):
    """With an end-of-sequence token that is likely, some step ends the solution; the first goal
    popped ends the search, with the budget left over."""
    base = tiny(seed=1)
    ids = base.tokenizer.encode(PROMPT)
    eos = int(_next_probs(base, ids, SamplingParams(temperature=1.0)).argsort()[-1])
    lm = dataclasses.replace(base, eos_token_ids={eos})
    res = leapdecode.generate(lm, prompt_ids=ids, strategy="a-star", temperature=1.0, seed=0, max_new_tokens=40,
                              strategy_options={"max_step_tokens": 2, "token_budget": 2000,
                                                "num_return_sequences": 2})
    assert res.stats["goals_popped"] == 2 and not res.stats["budget_exhausted"]
    assert all(h.finish_reason == "stop" and h.tokens[-1] == eos for h in res.hypotheses)
    assert res.finish_reason == "stop" and res.tokens == res.hypotheses[0].tokens[:-1]
    assert res.stats["sampled_tokens"] < 2000


def test_the_hypotheses_carry_the_models_own_log_probabilities(no_eos):
    """Each returned solution's log-probability is the model's (temperature 1): every state's
    tokens attended to their own branch of the shared tree.  (Seed 4: three different solutions with
    the sampler's random stream, ``sampling.sample``; many seeds return one solution several times.)"""
    res = leapdecode.generate(no_eos, PROMPT, strategy="a-star", temperature=1.2, seed=4, max_new_tokens=9,
                              strategy_options={"max_step_tokens": 3, "token_budget": 400, "num_samples": 3,
                                                "num_return_sequences": 3})
    ids = no_eos.tokenizer.encode(PROMPT)
    assert len(res.hypotheses) == 3 and len({tuple(h.tokens) for h in res.hypotheses}) > 1
    for h in res.hypotheses:
        want = sum(math.log(float(_next_probs(no_eos, ids + h.tokens[:j], SamplingParams(temperature=1.0))[t]))
                   for j, t in enumerate(h.tokens))
        assert len(h.tokens) == 9 and h.logprob == pytest.approx(want, abs=1e-4)
        assert h.score == pytest.approx(want / 9, abs=1e-4)  # the default process reward: mean-logprob


def test_same_seed_same_search(no_eos):
    def run(seed):
        return leapdecode.generate(no_eos, PROMPT, strategy="a-star", temperature=0.9, seed=seed, max_new_tokens=10,
                                   strategy_options={"max_step_tokens": 2, "token_budget": 80,
                                                     "num_return_sequences": 2})

    a, b, c = run(4), run(4), run(5)
    assert [h.to_dict() for h in a.hypotheses] == [h.to_dict() for h in b.hypotheses]
    assert a.stats["sampled_tokens"] == b.stats["sampled_tokens"]
    assert [h.tokens for h in a.hypotheses] != [h.tokens for h in c.hypotheses]


# ============================================================================ the samples
def test_each_sampled_step_is_a_sample_of_the_model(no_eos, chi2):
    """The first expansion draws 4 two-token steps side by side (one tree forward per position):
    pooled over runs, their tokens follow the model's joint at the temperature; a planted other
    temperature is rejected (the test has power)."""
    ids = no_eos.tokenizer.encode(PROMPT)
    temperature = 0.7
    counts: dict = {}
    expected = _joint(no_eos, ids, SamplingParams(temperature=temperature))
    for run in range(300):
        seen: list[Sample] = []
        leapdecode.generate(no_eos, prompt_ids=ids, temperature=temperature, seed=run, max_new_tokens=6,
                            strategy=AStarConfig(num_samples=4, max_step_tokens=2, max_expansions=1,
                                                 scorer=lambda s: seen.append(s) or 0.0))
        assert len(seen) == 4
        for s in seen:
            key = (s.tokens[0], s.tokens[1]) if (s.tokens[0], s.tokens[1]) in expected else (s.tokens[0], None)
            counts[key] = counts.get(key, 0) + 1
    keys = sorted(expected, key=str)
    stat, df, pval = chi2([counts.get(k, 0) for k in keys], [expected[k] for k in keys])
    assert sum(counts.values()) == 1200 and set(counts) <= set(expected)
    assert pval > ALPHA, (stat, df, pval)
    other = _joint(no_eos, ids, SamplingParams(temperature=1.2))
    assert chi2([counts.get(k, 0) for k in keys], [other[k] for k in keys])[2] < ALPHA


def test_the_prompt_is_prefilled_once_and_steps_are_tree_nodes(tiny, monkeypatch):
    lm = tiny(seed=2)
    decoder = lm.model
    ids = (lm.tokenizer.encode("abcdefgh ") * 40)[:300]
    calls: list = []
    forward = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda tokens, *a, **k: calls.append(tokens.shape[-1]) or
                        forward(tokens, *a, **k))
    runner_for(lm).prefix_cache.clear()
    res = leapdecode.generate(lm, prompt_ids=ids, strategy="a-star", temperature=1.0, seed=0, max_new_tokens=12,
                              strategy_options={"max_step_tokens": 3, "token_budget": 60, "num_samples": 3})
    assert sorted(c for c in calls if c > 4) == [43, 256]  # the prompt but its last token, once, in its chunks
    assert max(c for c in calls if c not in (43, 256)) <= 3  # each later forward: the k tips side by side
    assert res.stats["tree_nodes"] <= res.stats["sampled_tokens"] <= 60
    assert runner_for(lm).caches_in_use == 0


def test_each_step_of_the_search_runs_at_most_one_forward(tiny, monkeypatch):
    """A search is stepped like a generation: the first step prefills, every later one runs at most
    one forward (a server interleaves those with its other requests)."""
    lm = tiny(seed=1)
    decoder = lm.model
    calls: list = []
    forward = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    gen = leapdecode.start_generation(lm, PROMPT, strategy="a-star", temperature=1.0, seed=0, max_new_tokens=10,
                                      strategy_options={"max_step_tokens": 3, "token_budget": 80})
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
def test_on_smollm2_steps_end_at_the_delimiter():
    """Real text: every step of an open state ends with the token that completes a newline; the
    search returns an ended solution within its budget."""
    lm = leapdecode.load("smollm2-135m")
    q = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer step by step.\n"
    seen: list[Sample] = []

    def reward(sample: Sample) -> float:
        seen.append(sample)
        return sample.mean_logprob

    res = leapdecode.generate(lm, q, strategy=AStarConfig(scorer=reward, token_budget=300, max_step_tokens=24),
                              temperature=0.7, seed=0, max_new_tokens=40)
    tok = lm.tokenizer
    opened = [s for s in seen if not s.finished]
    assert opened and res.stats["sampled_tokens"] <= 300
    at_newline = 0
    for s in opened:  # each step ends at the newline-completing token, or after 24 tokens without one
        ends = [0] + [j for j in range(1, len(s.tokens) + 1) if tok.decode(s.tokens[:j]).count("\n") >
                      tok.decode(s.tokens[:j - 1]).count("\n")]
        at_newline += ends[-1] == len(s.tokens)
        assert ends[-1] == len(s.tokens) or (len(s.tokens) - ends[-1]) % 24 == 0, s.text
    assert at_newline >= len(opened) // 2
    assert res.hypotheses and len(res.tokens) <= 40
    assert runner_for(lm).caches_in_use == 0


# ============================================================================ errors
@pytest.mark.parametrize("kwargs, error, named", [
    (dict(method="pld"), InvalidParameterError, "does not combine with method 'pld'"),
    (dict(method="draft"), InvalidParameterError, "does not combine with method 'draft'"),
    (dict(top_k=5), InvalidParameterError, "top_k"),
    (dict(temperature=0.0), InvalidParameterError, "temperature > 0"),
    (dict(stop=["x"]), InvalidParameterError, "does not combine with stop"),
    (dict(strategy_options={"scorer": "tests", "tests": "pass"}), InvalidParameterError, "no option 'tests'"),
    (dict(strategy_options={"scorer": "tests"}), ScorerError, "cannot score a partial"),
    (dict(strategy_options={"scorer": "bleu"}), ScorerError, "unknown scorer"),
    (dict(strategy_options={"num_samples": 0}), InvalidParameterError, "num_samples"),
    (dict(strategy_options={"token_budget": 10 ** 6}), InvalidParameterError, "token_budget"),
    (dict(strategy_options={"step_delimiter": ""}), InvalidParameterError, "max_step_tokens"),
    (dict(strategy_options={"step_cost": -1}), InvalidParameterError, "step_cost"),
])
def test_bad_a_star_parameters_are_typed_errors(tiny, kwargs, error, named):
    kw = {"temperature": 1.0, **kwargs}
    with pytest.raises(error, match=named):
        leapdecode.start_generation(tiny(seed=1), PROMPT, strategy="a-star", **kw)


def test_a_failing_scorer_is_a_scorer_error_and_gives_the_cache_back(tiny):
    lm = tiny(seed=1)
    with pytest.raises(ScorerError, match="raised ZeroDivisionError"):
        leapdecode.generate(lm, PROMPT, strategy=AStarConfig(scorer=lambda s: 1 / 0), temperature=1.0, seed=0,
                            max_new_tokens=6)
    assert runner_for(lm).caches_in_use == 0


def test_cancel_close_and_a_failing_scorer_give_the_cache_back(tiny):
    lm = tiny(seed=1)
    gen = leapdecode.start_generation(lm, PROMPT, strategy="a-star", temperature=1.0, seed=0, max_new_tokens=12,
                                      strategy_options={"max_step_tokens": 2, "token_budget": 200})
    for _ in range(4):
        gen.step()
    assert runner_for(lm).caches_in_use == 1
    gen.cancel()
    assert gen.step().finished and gen.result.finish_reason == "cancelled" and runner_for(lm).caches_in_use == 0
    gen = leapdecode.start_generation(lm, PROMPT, strategy="a-star", temperature=1.0, seed=0, max_new_tokens=12,
                                      strategy_options={"max_step_tokens": 2, "token_budget": 200})
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
        leapdecode.generate(lm, PROMPT, strategy=AStarConfig(scorer=flaky, max_step_tokens=2), temperature=1.0, seed=0,
                            max_new_tokens=12)
    assert runner_for(lm).caches_in_use == 0


# ============================================================================ CLI and server
def test_cli_runs_a_star_as_the_api_does(capsys):
    from leapdecode import cli

    argv = ["generate", "-m", "tiny-random", "--strategy", "a-star", "--temperature", "0.9", "--seed", "3",
            "--n", "2", "--strategy-option", "max_step_tokens=2", "--strategy-option", "token_budget=50",
            "--strategy-option", "scorer=sum-logprob", "--max-new-tokens", "6", "--json", "Hello hello"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ref = leapdecode.generate(leapdecode.load("tiny-random"), "Hello hello", strategy="a-star", temperature=0.9,
                              seed=3, num_return_sequences=2, max_new_tokens=6,
                              strategy_options={"max_step_tokens": 2, "token_budget": 50, "scorer": "sum-logprob"})
    assert out["hypotheses"] == [h.to_dict() for h in ref.hypotheses] and out["hypotheses"]
    assert out["stats"]["strategy"] == "a-star" and out["stats"]["sampled_tokens"] <= 50
    assert cli.main(["generate", "-m", "tiny-random", "--strategy", "a-star", "--method", "pld", "--temperature",
                     "1", "hi"]) == 2
    assert "does not combine with method 'pld'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server():
    yield from tiny_server("vanilla")


def test_server_runs_a_star_as_the_api_does(server):
    httpx = pytest.importorskip("httpx")
    options = {"max_step_tokens": 2, "token_budget": 40}
    body = {"model": server.model.name, "prompt": "Hello hello", "max_tokens": 6, "seed": 5, "temperature": 0.9,
            "n": 2, "leapdecode": {"strategy": "a-star", "strategy_options": options}}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ref = leapdecode.generate(leapdecode.load("tiny-random", dtype="fp32"), "Hello hello", strategy="a-star",
                              temperature=0.9, seed=5, max_new_tokens=6, num_return_sequences=2,
                              strategy_options=options)
    out = r.json()
    assert [c["text"] for c in out["choices"]] == [h.text for h in ref.hypotheses]
    assert [c["score"] for c in out["leapdecode"]["choices"]] == [h.score for h in ref.hypotheses]
    assert server.runner.caches_in_use == 0


@pytest.mark.parametrize("extra, param", [
    ({"leapdecode": {"strategy": "a-star", "method": "pld"}, "temperature": 1.0}, "leapdecode.method"),
    ({"leapdecode": {"strategy": "a-star"}, "temperature": 0}, "temperature"),
    ({"leapdecode": {"strategy": "a-star", "strategy_options": {"scorer": "tests"}}, "temperature": 1.0},
     "leapdecode.strategy_options.scorer"),
])
def test_server_refuses_bad_a_star_requests_naming_the_field(server, extra, param):
    httpx = pytest.importorskip("httpx")
    body = {"model": server.model.name, "prompt": "Hello", "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
