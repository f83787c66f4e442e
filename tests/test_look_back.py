"""Look-back decoding (issue 16, section 2; "Look-back Decoding for Open-Ended Text Generation",
Xu et al., 2023).

The authors released no code, so the strategy is checked against a brute-force reference written
here from the paper's equations and Algorithm 1: every distribution from a plain forward of the
whole sequence on a fresh cache (no tree, no cache reuse, no hidden-state head), the KL divergences
from their definition, and the same seeded draws.  The reference has planted variants (uniform
sampling at an alarm, the paper's ablation; coherence measured against the history instead of the
prefix; the KL's arguments swapped; no sliding window) that the comparison must reject.  Then the
paper's properties: with one candidate, or no alarm, it is greedy decoding; an alarm's token is
among the top k; it repeats less than greedy decoding on a model that loops; the same seed gives
the same output; and the API, CLI and server round trips.
"""

from __future__ import annotations

import json

import pytest
import torch

import leapdecode
from leapdecode.core.runner import ModelRunner
from leapdecode.errors import InvalidParameterError
from leapdecode.strategies.registry import STRATEGIES, LookBackConfig, strategy_config
from helpers.server import tiny_server

PROMPTS = ["Hello there", "The cat sat", "a", "def f(x):"]


def all_log_probs(lm, ids: list[int]) -> torch.Tensor:
    """fp32 next-token log-probabilities after every prefix of ``ids`` (``[len(ids), V]``), from
    one plain forward of the whole sequence on a fresh cache."""
    model = lm.model
    cache = model.new_cache(max_len=len(ids) + 1)
    rows = []
    for i in range(0, len(ids), 128):  # (a cache holds at most 256 pending tokens)
        rows.append(model.forward(torch.tensor([ids[i : i + 128]]), cache)[0].double())
        cache.commit()
    return torch.log_softmax(torch.cat(rows), dim=-1)


def kl(p_lp: torch.Tensor, q_lp: torch.Tensor) -> float:
    """KL(p || q) from log-probabilities, as the definition writes it."""
    return float((p_lp.exp() * (p_lp - q_lp)).sum())


def reference_look_back(lm, ids: list[int], threshold: float, k: int, max_new: int, temperature: float = 1.0,
                        seed: int = 0, window: int = 128, prefix_window: int = 256,
                        planted: str | None = None) -> tuple[list[int], list[bool]]:
    """Algorithm 1 of the paper; returns the tokens and which steps were alarms.  ``planted``:
    "uniform" samples the alarm's candidates uniformly, "history" measures the candidates'
    next steps against the history instead of the prefix, "reverse" swaps the KL's arguments,
    "no-window" looks back on every earlier position."""
    g = torch.Generator()
    g.manual_seed(seed)
    eos = lm.eos_token_ids
    m = len(ids)
    out: list[int] = []
    alarms: list[bool] = []

    def div(p, q):
        return kl(q, p) if planted == "reverse" else kl(p, q)

    while len(out) < max_new:
        rows = all_log_probs(lm, ids + out)
        p_t = rows[-1]
        prompt_rows = rows[: m - 1]  # p(. | x_<j), j = 2..m
        prefix = list(prompt_rows[-prefix_window:]) if m > 1 else [rows[m - 1]]
        earlier = list(rows[:-1])
        history = earlier if planted == "no-window" else earlier[-window:]
        kl_min = min((div(p_t, q) for q in history), default=float("inf"))
        alarm = kl_min <= threshold
        alarms.append(alarm)
        if alarm and k > 1:
            cands = torch.topk(p_t, k).indices.tolist()
            against = history if planted == "history" else prefix
            nexts = [all_log_probs(lm, ids + out + [v])[-1] for v in cands]  # p(. | history, v)
            dists = torch.tensor([min(div(p_v, q) for q in against) for p_v in nexts], dtype=torch.float32)
            q = torch.full((k,), 1.0 / k) if planted == "uniform" else torch.softmax(-dists / temperature, dim=-1)
            tok = cands[int(torch.multinomial(q, 1, generator=g))]
        else:
            tok = int(torch.argmax(p_t))
        out.append(tok)
        if tok in eos:
            break
    return out, alarms


def run(lm, ids, threshold, k, max_new, temperature=1.0, seed=0, **options):
    return leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="look-back", max_new_tokens=max_new,
                               temperature=temperature, seed=seed,
                               strategy_options={"threshold": threshold, "top_k": k, **options})


CASES = [(1.0, 4, 14, 1.0, 0), (2.0, 5, 14, 1.0, 1), (3.0, 3, 12, 0.5, 2), (0.5, 8, 12, 1.0, 3)]


@pytest.mark.parametrize("threshold, k, max_new, temperature, seed", CASES)
@pytest.mark.parametrize("model_seed, prompt", [(0, "Hello there"), (3, "The cat sat"), (5, "a")])
def test_look_back_equals_a_brute_force_reference(tiny, threshold, k, max_new, temperature, seed, model_seed,
                                                  prompt):
    lm = tiny(seed=model_seed)
    ids = lm.tokenizer.encode(prompt)
    res = run(lm, ids, threshold, k, max_new, temperature, seed)
    want, alarms = reference_look_back(lm, ids, threshold, k, max_new, temperature, seed)
    assert res.hypotheses[0].tokens == want
    assert res.stats["alarms"] == sum(alarms)


def test_look_back_windows_equal_the_reference(tiny):
    lm = tiny(seed=1)
    ids = lm.tokenizer.encode("The cat sat on the mat. The cat")
    for window, prefix_window in [(4, 256), (128, 3), (2, 2)]:
        res = run(lm, ids, 2.0, 4, 14, window=window, prefix_window=prefix_window)
        want, alarms = reference_look_back(lm, ids, 2.0, 4, 14, window=window, prefix_window=prefix_window)
        assert res.hypotheses[0].tokens == want and res.stats["alarms"] == sum(alarms)


def _cases(tiny):
    for model_seed, prompt in [(0, "Hello there"), (3, "The cat sat"), (5, "a"), (1, "def f(x):")]:
        lm = tiny(seed=model_seed)
        for threshold, k, max_new, temperature, seed in CASES:
            yield lm, lm.tokenizer.encode(prompt), threshold, k, max_new, temperature, seed


@pytest.mark.parametrize("planted", ["uniform", "history", "reverse", "no-window"])
def test_look_back_reference_comparison_catches_planted_errors(tiny, planted):
    window = 3 if planted == "no-window" else 128
    for lm, ids, threshold, k, max_new, temperature, seed in _cases(tiny):
        got = run(lm, ids, threshold, k, max_new, temperature, seed, window=window).hypotheses[0].tokens
        want = reference_look_back(lm, ids, threshold, k, max_new, temperature, seed, window=window,
                                   planted=planted)[0]
        if got != want:
            return
    pytest.fail(f"the planted error {planted!r} went unnoticed")


def test_min_kl_is_the_definition_and_survives_ruled_out_tokens():
    from leapdecode.strategies.look_back import finite, min_kl

    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(3, 50, generator=g), -1)
    hist = torch.log_softmax(torch.randn(7, 50, generator=g), -1)
    want = torch.tensor([min(kl(p.double(), q.double()) for q in hist) for p in lp], dtype=torch.float64)
    assert torch.allclose(min_kl(lp, hist).double(), want, atol=1e-5)
    assert min_kl(lp, hist[:0]).isinf().all()  # nothing to look back on
    # a token ruled out (-inf) in both: its 0 * log 0 terms are 0, not NaN
    lp[:, 0] = hist[:, 0] = -float("inf")
    lp, hist = torch.log_softmax(lp, -1), torch.log_softmax(hist, -1)
    got = min_kl(lp, finite(hist))
    assert torch.isfinite(got).all() and (got >= -1e-6).all()
    assert torch.allclose(got.double(), torch.tensor([min(kl(p[1:].double(), q[1:].double()) for q in hist)
                                                      for p in lp], dtype=torch.float64), atol=1e-5)


# ---------------------------------------------------------------------------- the paper's properties
@pytest.mark.parametrize("model_seed, prompt", [(0, "Hello there"), (3, "The cat sat"), (5, "a")])
def test_one_candidate_or_no_alarm_is_greedy_decoding(tiny, model_seed, prompt):
    lm = tiny(seed=model_seed)
    ids = lm.tokenizer.encode(prompt)
    greedy = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, method="vanilla", max_new_tokens=16).tokens
    one = run(lm, ids, 100.0, 1, 16)  # an alarm every step, one candidate: the top token
    # (a one-token prompt's first step has nothing to look back on: no alarm)
    assert one.tokens == greedy and one.stats["alarms"] == len(one.hypotheses[0].tokens) - (len(ids) == 1)
    calm = run(lm, ids, 0.0, 8, 16)  # KL_min is never <= 0 here: no alarm
    assert calm.stats["alarms"] == 0 and calm.tokens == greedy


def test_an_alarm_picks_among_the_top_k_and_elsewhere_the_argmax(tiny):
    lm = tiny(seed=0)
    ids = lm.tokenizer.encode("Hello there")
    k = 3
    res = run(lm, ids, 2.0, k, 16, seed=4)
    toks = res.hypotheses[0].tokens
    _, alarms = reference_look_back(lm, ids, 2.0, k, 16, seed=4)
    assert any(alarms) and not all(alarms)
    differs = False
    for i, (tok, alarm) in enumerate(zip(toks, alarms)):
        p = all_log_probs(lm, ids + toks[:i])[-1]
        if alarm:
            assert tok in torch.topk(p, k).indices.tolist()
            differs |= tok != int(torch.argmax(p))
        else:
            assert tok == int(torch.argmax(p))
    assert differs, "no alarm chose another token than the argmax"


def rep_n(tokens: list[int], n: int) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def test_look_back_repeats_less_than_greedy_on_a_looping_model(tiny):
    lm = tiny(seed=0)
    ids = lm.tokenizer.encode("Hello there")
    greedy = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, method="vanilla", max_new_tokens=40).tokens
    assert rep_n(greedy, 2) > 0.5  # this model loops under greedy decoding
    for seed in range(3):
        lb = run(lm, ids, 1.5, 5, 40, seed=seed)
        assert lb.stats["alarms"] > 0
        assert rep_n(lb.tokens, 2) < rep_n(greedy, 2)


def test_same_seed_same_output_and_seeds_differ(tiny):
    lm = tiny(seed=3)
    ids = lm.tokenizer.encode("The cat sat")
    outs = [run(lm, ids, 2.0, 6, 16, seed=s).tokens for s in (0, 0, 1, 2, 3)]
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs}) > 1


def test_caches_come_back_and_the_tree_stays_small(tiny):
    lm = tiny(seed=0)
    runner = ModelRunner(lm)
    res = leapdecode.generate(runner, "Hello there", strategy="look-back", temperature=1.0, seed=0,
                              max_new_tokens=20, strategy_options={"threshold": 2.0, "top_k": 4})
    assert runner.caches_in_use == 0
    # one forward per token (+ the prompt's last; the last token's only at an alarm): an alarm's
    # lookahead is the next step's forward
    assert res.stats["alarms"] > 0
    assert len(res.hypotheses[0].tokens) <= res.stats["target_forwards"] <= len(res.hypotheses[0].tokens) + 1
    assert res.stats["mean_kl_min"] is not None


def test_long_prompt_prefilled_in_chunks(tiny):
    lm = tiny(seed=2)
    ids = (lm.tokenizer.encode("the quick brown fox jumps over the lazy dog. ") * 8)[:300]
    res = run(lm, ids, 1.0, 4, 6, window=16, prefix_window=32)
    want, alarms = reference_look_back(lm, ids, 1.0, 4, 6, window=16, prefix_window=32)
    assert res.hypotheses[0].tokens == want and res.stats["alarms"] == sum(alarms)


# ---------------------------------------------------------------------------- options, API, CLI and server
def test_options_are_typed_and_checked():
    spec = STRATEGIES["look-back"]
    cfg = spec.config()
    assert cfg.strategy == "look-back" and cfg.returns == 1 and cfg.stochastic
    assert "num_return_sequences" in spec.config.option_names()
    assert strategy_config("look-back", {"threshold": 0.7}) == LookBackConfig(threshold=0.7)
    for bad in ({"threshold": -1}, {"top_k": 0}, {"window": 0}, {"prefix_window": 0},
                {"num_return_sequences": 2}, {"top_k": "many"}):
        with pytest.raises(InvalidParameterError, match=next(iter(bad))):
            strategy_config("look-back", bad)


@pytest.mark.parametrize("kwargs, named", [
    ({"temperature": 0.0}, "give a temperature > 0"),
    ({"method": "draft"}, "does not combine with method 'draft'"),
    ({"top_p": 0.9}, "top_p"),
    ({"stop": ["\n"]}, "does not combine with stop"),
    ({"regex": "[a-z]+"}, "does not combine with regex"),
])
def test_what_does_not_combine_is_a_typed_error(tiny, kwargs, named):
    with pytest.raises(InvalidParameterError, match=named):
        leapdecode.generate(ModelRunner(tiny()), "hi", strategy="look-back", max_new_tokens=3,
                            **{"temperature": 1.0, **kwargs})


def test_cli_runs_look_back_as_the_api_does(capsys):
    from leapdecode import cli

    rc = cli.main(["generate", "-m", "tiny-random", "--strategy", "look-back", "--strategy-option", "threshold=2",
                   "--strategy-option", "top_k=4", "--temperature", "1", "--seed", "5", "--max-new-tokens", "10",
                   "--json", "Hello"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = leapdecode.generate(leapdecode.load("tiny-random"), "Hello", strategy="look-back", max_new_tokens=10,
                              temperature=1.0, seed=5, strategy_options={"threshold": 2.0, "top_k": 4})
    assert out["hypotheses"] == [h.to_dict() for h in ref.hypotheses]
    assert out["stats"]["strategy"] == "look-back" and out["stats"]["alarms"] == ref.stats["alarms"]


@pytest.mark.parametrize("argv, named", [
    (["--strategy", "look-back", "--temperature", "1", "--strategy-option", "top_k=0"], "top_k"),
    (["--strategy", "look-back"], "temperature > 0"),
    (["--strategy", "look-back", "--temperature", "1", "--n", "2"], "num_return_sequences"),
])
def test_cli_bad_flags_exit_2_naming_them_before_loading(no_loading, capsys, argv, named):
    from leapdecode import cli

    rc = cli.main(["generate", "-m", "tiny-random", *argv, "hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("leapdecode: error:") and named in err


@pytest.fixture(scope="module")
def server():
    yield from tiny_server("vanilla")


def test_server_runs_look_back_as_the_api_does(server):
    httpx = pytest.importorskip("httpx")
    options = {"threshold": 2.0, "top_k": 4}
    body = {"model": server.model.name, "prompt": "Hello", "max_tokens": 10, "seed": 7,
            "leapdecode": {"strategy": "look-back", "strategy_options": options}}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    ref = leapdecode.generate(leapdecode.load("tiny-random", dtype="fp32"), "Hello", strategy="look-back",
                              max_new_tokens=10, temperature=1.0, seed=7, strategy_options=options)
    assert [c["text"] for c in out["choices"]] == [ref.text]
    assert out["leapdecode"]["strategy"] == "look-back"
    assert server.runner.caches_in_use == 0
    body["leapdecode"]["strategy_options"] = {"top_k": 0}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "leapdecode.strategy_options.top_k", r.text
    body["leapdecode"]["strategy_options"] = options
    body["temperature"] = 0
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_look_back_on_the_transformers_backend_equals_the_reference():
    from helpers.models import EOS, hf_pair

    from leapdecode.models.decoder import LoadedModel
    from leapdecode.models.hf_backend import HFCausalLM

    hf, native = hf_pair()
    hf_lm = LoadedModel(name="hf-backend", model=HFCausalLM(hf, max_seq_len=256), tokenizer=native.tokenizer,
                        eos_token_ids=set(EOS))
    alarmed = 0
    for prompt, seed in [("Hello there", 0), ("The cat sat", 1)]:
        ids = native.tokenizer.encode(prompt)
        res = run(hf_lm, ids, 2.0, 4, 12, seed=seed)
        want, alarms = reference_look_back(native, ids, 2.0, 4, 12, seed=seed)  # the same weights, natively
        assert res.hypotheses[0].tokens == want and res.stats["alarms"] == sum(alarms)
        alarmed += sum(alarms)
    assert alarmed > 0


# ---------------------------------------------------------------------------- a real model
@pytest.mark.integration
def test_look_back_on_smollm2():
    lm = leapdecode.load("smollm2-135m", dtype="fp32", device="cpu", weights="fp32")
    ids = lm.tokenizer.encode("The cat sat on the mat. The cat sat on the mat. The cat")
    greedy = leapdecode.generate(lm, prompt_ids=ids, method="vanilla", max_new_tokens=24).tokens
    res = leapdecode.generate(lm, prompt_ids=ids, strategy="look-back", temperature=1.0, seed=0, max_new_tokens=24,
                              strategy_options={"threshold": 1.0, "top_k": 5})
    assert res.stats["alarms"] > 0 and rep_n(res.tokens, 3) <= rep_n(greedy, 3)
    want, alarms = reference_look_back(lm, ids, 1.0, 5, 8, seed=0)
    first = leapdecode.generate(lm, prompt_ids=ids, strategy="look-back", temperature=1.0, seed=0, max_new_tokens=8,
                                strategy_options={"threshold": 1.0, "top_k": 5})
    assert first.hypotheses[0].tokens == want
