"""Contrastive and adaptive decoders (issue 16, section 2): contrastive search, contrastive decoding
with an amateur model, DoLa.

transformers moved contrastive search and DoLa to the Hub (``transformers-community/...``) in 4.56
and the installed version does not ship them, so each strategy is checked against a brute-force
reference written here from its paper, scoring with full forwards of the transformers model (or of
plain native forwards) on every candidate sequence: no token tree, no cache reuse.  Each reference
has planted variants (a wrong hidden state, a missing context, no plausibility constraint, the
wrong layer) that the comparison must reject, so the equivalence tests can fail.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers.models import EOS, hf_pair, prompt_ids, small_vocab

import leapdecode
from leapdecode.core.runner import ModelRunner
from leapdecode.errors import InvalidParameterError
from leapdecode.strategies.registry import STRATEGIES, ContrastiveSearchConfig, strategy_config
from helpers.server import tiny_server

PROMPTS = ["Hello there", "The cat", "a", "def f(x):"]


# ---------------------------------------------------------------------------- contrastive search
def hf_states(hf, ids: list[int]):
    """transformers' fp32 next-token logits after ``ids`` and the last-layer hidden states of every
    position (``hidden_states[-1]``: after the final norm), from one full forward."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0, -1].float(), out.hidden_states[-1][0].float()


def reference_contrastive_search(hf, ids: list[int], k: int, alpha: float, max_new: int, eos=EOS,
                                 planted: str | None = None) -> list[int]:
    """Contrastive search as the paper defines it, every candidate scored by its own full forward.
    ``planted``: "no-prompt" leaves the prompt out of the context, "wrong-layer" compares the hidden
    states of the layer before the last, "no-alpha" drops the (1 - alpha) weight of the probability."""
    seq = list(ids)
    out: list[int] = []
    for _ in range(max_new):
        logits, ctx = hf_states(hf, seq)
        if planted == "no-prompt":
            ctx = ctx[len(ids):] if len(seq) > len(ids) else ctx[-1:]
        probs = torch.softmax(logits, dim=-1)
        top_p, top_ids = torch.topk(probs, k)
        best, best_tok = None, None
        for p, v in zip(top_p.tolist(), top_ids.tolist()):
            with torch.no_grad():
                o = hf(torch.tensor([seq + [v]]), output_hidden_states=True)
            h = (o.hidden_states[-2] if planted == "wrong-layer" else o.hidden_states[-1])[0, -1].float()
            c = ctx if planted != "wrong-layer" else o.hidden_states[-2][0, :-1].float()
            cos = torch.nn.functional.cosine_similarity(h[None], c, dim=-1)
            weight = 1.0 if planted == "no-alpha" else 1.0 - alpha
            score = weight * p - alpha * float(cos.max())
            if best is None or score > best:
                best, best_tok = score, v
        out.append(best_tok)
        seq.append(best_tok)
        if best_tok in eos:
            break
    return out


CS_CASES = [(4, 0.6, 12), (2, 0.3, 10), (6, 0.8, 10), (3, 0.5, 8)]


@pytest.mark.parametrize("k, alpha, max_new", CS_CASES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_contrastive_search_equals_a_brute_force_reference(k, alpha, max_new, prompt):
    hf, lm = hf_pair()
    ids = prompt_ids(lm, prompt)
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="contrastive-search", max_new_tokens=max_new,
                              strategy_options={"top_k": k, "penalty_alpha": alpha})
    want = reference_contrastive_search(hf, ids, k, alpha, max_new)
    assert res.hypotheses[0].tokens == want
    assert res.tokens == [t for t in want if t not in EOS]
    # one tree forward per generated token (k candidates each), plus the prompt's last token
    assert res.stats["target_forwards"] == len(want) + 1
    assert res.stats["tree_nodes"] == k * len(want)


@functools.lru_cache(maxsize=None)
def _cs_outputs(k: int, alpha: float, max_new: int, planted: str | None) -> tuple:
    hf, lm = hf_pair()
    return tuple(tuple(reference_contrastive_search(hf, prompt_ids(lm, p), k, alpha, max_new, planted=planted))
                 for p in PROMPTS)


@pytest.mark.parametrize("planted", ["no-prompt", "wrong-layer", "no-alpha"])
def test_contrastive_search_reference_comparison_catches_planted_errors(planted):
    # the same comparison as above, against a reference with one deliberate error: some case must differ
    hf, lm = hf_pair()
    differs = False
    for k, alpha, max_new in CS_CASES[:3]:
        got = tuple(tuple(leapdecode.generate(ModelRunner(lm), prompt_ids=prompt_ids(lm, p),
                                              strategy="contrastive-search", max_new_tokens=max_new,
                                              strategy_options={"top_k": k, "penalty_alpha": alpha}).hypotheses[0].tokens)
                    for p in PROMPTS)
        if got != _cs_outputs(k, alpha, max_new, planted):
            differs = True
            break
    assert differs, f"the planted error {planted!r} went unnoticed"


@pytest.mark.parametrize("options", [{"top_k": 1, "penalty_alpha": 0.6}, {"top_k": 5, "penalty_alpha": 0.0}])
def test_contrastive_search_without_a_penalty_is_greedy(options, tiny):
    lm = tiny(seed=3)
    greedy = leapdecode.generate(ModelRunner(lm), "The cat", method="vanilla", max_new_tokens=12)
    res = leapdecode.generate(ModelRunner(lm), "The cat", strategy="contrastive-search", max_new_tokens=12,
                              strategy_options=options)
    assert res.tokens == greedy.tokens and res.text == greedy.text


def test_contrastive_search_penalizes_repetition(tiny):
    # the tiny model's greedy text repeats; contrastive search's (alpha 0.6) repeats less
    lm = tiny(seed=0)
    greedy = leapdecode.generate(ModelRunner(lm), "Hello", method="vanilla", max_new_tokens=40)
    cs = leapdecode.generate(ModelRunner(lm), "Hello", strategy="contrastive-search", max_new_tokens=40,
                             strategy_options={"top_k": 6, "penalty_alpha": 0.6})

    def repeats(tokens):
        return sum(1 for a, b in zip(tokens, tokens[1:]) if a == b)

    assert cs.tokens != greedy.tokens
    assert repeats(cs.tokens) < repeats(greedy.tokens)
    assert cs.stats["mean_degeneration_penalty"] > 0


def test_contrastive_search_on_the_transformers_backend_equals_the_reference():
    from leapdecode.models.decoder import LoadedModel
    from leapdecode.models.hf_backend import HFCausalLM

    hf, native = hf_pair()
    lm = LoadedModel(name="hf-backend", model=HFCausalLM(hf, max_seq_len=256), tokenizer=native.tokenizer,
                     eos_token_ids=set(EOS))
    ids = prompt_ids(lm, "The cat")
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="contrastive-search", max_new_tokens=10,
                              strategy_options={"top_k": 4, "penalty_alpha": 0.6})
    assert res.hypotheses[0].tokens == reference_contrastive_search(hf, ids, 4, 0.6, 10)


# ---------------------------------------------------------------------------- contrastive decoding
def full_logits(lm, ids: list[int]) -> torch.Tensor:
    """fp32 next-token logits after ``ids`` from one plain forward on a fresh cache."""
    model = lm.model
    cache = model.new_cache(max_len=len(ids) + 1)
    return model.forward(torch.tensor([ids]), cache, logits_for=slice(-1, None))[0, -1].float()


def reference_cd(expert, amateur, ids: list[int], alpha: float, tau: float, k: int, max_new: int,
                 eos, planted: str | None = None) -> list[tuple[list[int], float]]:
    """The contrastive objective searched as the module describes, every score from full forwards of
    both models on the whole sequence (no tree, no cache).  ``planted``: "no-head" drops the
    plausibility constraint, "no-tau" ignores the amateur temperature, "plus" adds the amateur."""
    running = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    for step in range(max_new):
        cands = []
        for i, (toks, score) in enumerate(running):
            lp_e = torch.log_softmax(full_logits(expert, ids + toks), -1)
            lp_a = torch.log_softmax(full_logits(amateur, ids + toks) / (1.0 if planted == "no-tau" else tau), -1)
            diff = lp_e + lp_a if planted == "plus" else lp_e - lp_a
            for t in range(lp_e.shape[0]):
                if planted == "no-head" or lp_e[t] >= lp_e.max() + torch.log(torch.tensor(alpha)):
                    cands.append((score + float(diff[t]), i, t))
        cands.sort(key=lambda c: (-c[0], c[1]))
        nxt = []
        for score, i, t in cands[:k]:
            toks = running[i][0] + [t]
            (finished if t in eos or step + 1 >= max_new else nxt).append((toks, score))
        running = nxt
        if not running or len(finished) >= k:
            break
    return sorted(finished, key=lambda h: -h[1])


@functools.lru_cache(maxsize=None)
def cd_pair():
    """An expert (2 layers, hidden 64) and an amateur (1 layer, hidden 32) of the same vocabulary."""
    from leapdecode.models.tiny import tiny_loaded

    expert = tiny_loaded(name="tiny-expert", seed=5, weight_std=0.3)
    amateur = tiny_loaded(name="tiny-amateur", seed=6, layers=1, hidden=32, heads=2, kv_heads=1, weight_std=0.3)
    return expert, amateur


def cd_runner(expert, amateur) -> ModelRunner:
    runner = ModelRunner(expert)
    runner.add_draft("amateur", amateur)
    return runner


CD_CASES = [(0.1, 1.0, 1, 12), (0.3, 0.5, 1, 10), (0.1, 1.0, 3, 8), (0.05, 2.0, 4, 7), (1.0, 1.0, 1, 6)]


@pytest.mark.parametrize("alpha, tau, k, max_new", CD_CASES)
@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_contrastive_decoding_equals_a_brute_force_reference(alpha, tau, k, max_new, prompt):
    expert, amateur = cd_pair()
    ids = expert.tokenizer.encode(prompt)
    res = leapdecode.generate(cd_runner(expert, amateur), prompt_ids=ids, strategy="contrastive",
                              max_new_tokens=max_new, num_beams=k, num_return_sequences=k if k > 1 else None,
                              strategy_options={"amateur": "amateur", "alpha": alpha, "amateur_temperature": tau})
    want = reference_cd(expert, amateur, ids, alpha, tau, k, max_new, expert.eos_token_ids)
    assert len(res.hypotheses) == min(len(want), k)
    assert [h.tokens for h in res.hypotheses] == [w[0] for w in want][: len(res.hypotheses)]
    assert [h.score for h in res.hypotheses] == pytest.approx([w[1] for w in want][: len(res.hypotheses)],
                                                              rel=1e-4, abs=1e-4)
    assert res.stats["amateur"] == "tiny-amateur" and res.stats["amateur_forwards"] >= 1
    if alpha == 1.0:  # only the expert's argmax is plausible: greedy decoding of the expert
        greedy = leapdecode.generate(ModelRunner(expert), prompt_ids=ids, method="vanilla", max_new_tokens=max_new)
        assert res.tokens == greedy.tokens


@pytest.mark.parametrize("planted", ["no-head", "no-tau", "plus"])
def test_contrastive_decoding_reference_comparison_catches_planted_errors(planted):
    expert, amateur = cd_pair()
    differs = False
    for alpha, tau, k, max_new in CD_CASES[:4]:
        for prompt in PROMPTS[:3]:
            ids = expert.tokenizer.encode(prompt)
            res = leapdecode.generate(cd_runner(expert, amateur), prompt_ids=ids, strategy="contrastive",
                                      max_new_tokens=max_new, num_beams=k,
                                      strategy_options={"amateur": "amateur", "alpha": alpha,
                                                        "amateur_temperature": tau})
            bad = reference_cd(expert, amateur, ids, alpha, tau, k, max_new, expert.eos_token_ids, planted=planted)
            if res.hypotheses[0].tokens != bad[0][0]:
                differs = True
                break
        if differs:
            break
    assert differs, f"the planted error {planted!r} went unnoticed"


def test_contrastive_decoding_differs_from_the_experts_greedy_and_gives_caches_back():
    expert, amateur = cd_pair()
    runner = cd_runner(expert, amateur)
    ids = expert.tokenizer.encode("The cat")
    greedy = leapdecode.generate(ModelRunner(expert), prompt_ids=ids, method="vanilla", max_new_tokens=16)
    res = leapdecode.generate(runner, prompt_ids=ids, strategy="contrastive", max_new_tokens=16,
                              strategy_options={"amateur": "amateur"})
    assert res.tokens != greedy.tokens
    assert runner.caches_in_use == 0
    # cancelled half way: both caches come back
    search = leapdecode.start_generation(runner, prompt_ids=ids, strategy="contrastive", max_new_tokens=16,
                                         strategy_options={"amateur": "amateur"})
    search.step(), search.step()
    assert runner.caches_in_use == 2
    search.cancel()
    search.run()
    assert runner.caches_in_use == 0 and search.result.finish_reason == "cancelled"


def test_contrastive_decoding_refuses_what_it_cannot_do(tiny):
    expert, amateur = cd_pair()
    runner = ModelRunner(expert)
    with pytest.raises(InvalidParameterError, match="needs an amateur model"):
        leapdecode.generate(runner, "hi", strategy="contrastive", max_new_tokens=4)
    with pytest.raises(InvalidParameterError, match="does not combine with method 'draft'"):
        leapdecode.generate(runner, "hi", strategy="contrastive", method="draft", max_new_tokens=4,
                            strategy_options={"amateur": "amateur"})
    with pytest.raises(InvalidParameterError, match="deterministic"):
        leapdecode.generate(runner, "hi", strategy="contrastive", temperature=0.7, max_new_tokens=4)
    for bad in ({"alpha": 0}, {"alpha": 1.5}, {"amateur_temperature": 0}, {"num_beams": 2, "num_return_sequences": 3},
                {"amateur": 3}):
        with pytest.raises(InvalidParameterError, match=next(iter(bad))):
            strategy_config("contrastive", bad)
    # a runner that loads no models (a server's) refuses an amateur it does not hold
    closed = ModelRunner(expert, allow_draft_loading=False)
    with pytest.raises(InvalidParameterError, match="not loaded here"):
        leapdecode.generate(closed, "hi", strategy="contrastive", max_new_tokens=4,
                            strategy_options={"amateur": "qwen2.5-coder-0.5b"})
    # another vocabulary
    from leapdecode.models.decoder import LoadedModel
    from leapdecode.models.tiny import tiny_native

    other = LoadedModel(name="vocab-300", model=tiny_native(vocab_size=300), tokenizer=expert.tokenizer,
                        eos_token_ids=set(expert.eos_token_ids))
    r = ModelRunner(expert)
    r.add_draft("other", other)
    with pytest.raises(InvalidParameterError, match="vocabulary"):
        leapdecode.generate(r, "hi", strategy="contrastive", max_new_tokens=4, strategy_options={"amateur": "other"})
    assert r.caches_in_use == 0


# ---------------------------------------------------------------------------- DoLa
def hf_deep(layers: int = 6, seed: int = 2, std: float = 0.1):
    """A tiny transformers Llama with ``layers`` layers (tied embeddings) and the native model with its weights."""
    return hf_pair(seed, std, layers)


def reference_dola(hf, ids: list[int], layers: list[int], max_new: int, relative_top: float = 0.1,
                   penalty: float = 1.0, final_norm: bool = False, eos=EOS, planted: str | None = None) -> list[int]:
    """DoLa greedy decoding written from the paper and the authors' code, on full transformers forwards.
    ``planted``: "norm" applies the final norm unasked, "min" contrasts the least divergent layer,
    "no-head" drops the plausibility constraint, "static" always contrasts the first candidate."""
    seq = list(ids)
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            o = hf(torch.tensor([seq]), output_hidden_states=True)
            final = o.logits[0, -1].float()
            early = {}
            for j in layers:
                h = o.hidden_states[j][0, -1]
                if final_norm or planted == "norm":
                    h = hf.model.norm(h)
                early[j] = hf.lm_head(h).float()
        p_final = torch.softmax(final, -1)
        div = {}
        for j in layers:
            q = torch.softmax(early[j], -1)
            m = (p_final + q) / 2
            kl = lambda a: float((m * (m.log() - a.log())).sum()) / m.shape[0]  # noqa: E731
            div[j] = 0.5 * (kl(p_final) + kl(q))
        if planted == "static" or len(layers) == 1:
            chosen = layers[0]
        else:
            chosen = (min if planted == "min" else max)(layers, key=lambda j: div[j])
        lp_final = torch.log_softmax(final, -1)
        lp_base = torch.log_softmax(early[chosen], -1)
        scores = lp_final - lp_base
        if planted != "no-head":
            scores[lp_final < lp_final.max() + torch.log(torch.tensor(relative_top))] = -float("inf")
        for t in set(seq):
            scores[t] = scores[t] * penalty if scores[t] < 0 else scores[t] / penalty
        tok = int(torch.argmax(scores))
        out.append(tok)
        seq.append(tok)
        if tok in eos:
            break
    return out


DOLA_CASES = [  # options, the candidate layers they give on the 6-layer model (tied embeddings)
    ({}, [3, 5]),
    ({"dola_layers": "low"}, [2]),
    ({"dola_layers": [0, 1, 2, 3, 4, 5]}, [0, 1, 2, 3, 4, 5]),
    ({"dola_layers": [1, 4], "repetition_penalty": 1.2}, [1, 4]),
    ({"dola_layers": [0, 2, 4], "final_norm": True, "relative_top": 0.3}, [0, 2, 4]),
]


@pytest.mark.parametrize("options, layers", DOLA_CASES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_dola_equals_a_reference_on_the_transformers_model(options, layers, prompt):
    hf, lm = hf_deep()
    ids = prompt_ids(lm, prompt)
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="dola", max_new_tokens=12,
                              strategy_options=options)
    want = reference_dola(hf, ids, layers, 12, relative_top=options.get("relative_top", 0.1),
                          penalty=options.get("repetition_penalty", 1.0), final_norm=options.get("final_norm", False))
    assert res.hypotheses[0].tokens == want
    assert sorted(res.stats["premature_layers"]) == layers
    assert sum(res.stats["premature_layers"].values()) == len(want)
    assert res.stats["target_forwards"] == len(want)  # the prompt's last token, then one per token but the last


@pytest.mark.parametrize("planted", ["norm", "min", "no-head", "static"])
def test_dola_reference_comparison_catches_planted_errors(planted):
    hf, lm = hf_deep()
    differs = False
    for options, layers in DOLA_CASES:
        if planted in ("min", "static") and len(layers) == 1:
            continue
        for prompt in PROMPTS:
            ids = prompt_ids(lm, prompt)
            got = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="dola", max_new_tokens=12,
                                      strategy_options=options).hypotheses[0].tokens
            bad = reference_dola(hf, ids, layers, 12, relative_top=options.get("relative_top", 0.1),
                                 penalty=options.get("repetition_penalty", 1.0),
                                 final_norm=options.get("final_norm", False), planted=planted)
            if got != bad:
                differs = True
                break
        if differs:
            break
    assert differs, f"the planted error {planted!r} went unnoticed"


@pytest.mark.parametrize("n, tied, low, high", [
    (32, True, list(range(2, 16, 2)), list(range(16, 32, 2))),
    (48, False, list(range(0, 20, 2)), list(range(28, 48, 2))),
    (2, True, [1], [1]),
    (1, True, [0], [0]),
    (6, False, [0, 2], [3, 5]),
    (28, True, [2, 4, 6, 8, 10, 12], [14, 16, 18, 20, 22, 24, 26]),  # qwen2.5-coder-1.5b's depth
])
def test_dola_candidate_buckets(n, tied, low, high):
    from leapdecode.strategies.dola import candidate_layers

    assert candidate_layers("low", n, tied) == low
    assert candidate_layers("high", n, tied) == high


def test_dola_refuses_what_it_cannot_do(tiny):
    from leapdecode.models.decoder import LoadedModel
    from leapdecode.models.hf_backend import HFCausalLM
    from leapdecode.strategies.dola import candidate_layers

    hf, native = hf_pair()
    lm = tiny()
    for bad in ({"dola_layers": "middle"}, {"dola_layers": []}, {"dola_layers": [-1]}, {"dola_layers": [True]},
                {"relative_top": 0}, {"repetition_penalty": 0}, {"num_return_sequences": 2}):
        with pytest.raises(InvalidParameterError, match=next(iter(bad))):
            strategy_config("dola", bad)
    with pytest.raises(InvalidParameterError, match="dola_layers"):  # layer 2 is the final layer of a 2-layer model
        leapdecode.generate(ModelRunner(lm), "hi", strategy="dola", max_new_tokens=3,
                            strategy_options={"dola_layers": [0, 2]})
    with pytest.raises(InvalidParameterError, match="holds no layer"):
        candidate_layers("low", 3, True)
    hf_lm = LoadedModel(name="hf-backend", model=HFCausalLM(hf, max_seq_len=256), tokenizer=native.tokenizer,
                        eos_token_ids=set(EOS))
    with pytest.raises(InvalidParameterError, match="native backend"):
        leapdecode.generate(ModelRunner(hf_lm), "hi", strategy="dola", max_new_tokens=3)
    with pytest.raises(InvalidParameterError, match="does not combine with method 'pld'"):
        leapdecode.generate(ModelRunner(lm), "hi", strategy="dola", method="pld", max_new_tokens=3)
    with pytest.raises(InvalidParameterError, match="repetition_penalty"):  # the sampling one: use the option
        leapdecode.generate(ModelRunner(lm), "hi", strategy="dola", repetition_penalty=1.2, max_new_tokens=3)


# ---------------------------------------------------------------------------- API, CLI and server
def test_every_section_2_strategy_is_registered_with_one_output_by_default():
    for name in ("contrastive-search", "contrastive", "dola", "adadec"):
        spec = STRATEGIES[name]
        cfg = spec.config()
        assert cfg.strategy == name and cfg.returns == 1 and not cfg.stochastic
        assert "num_return_sequences" in spec.config.option_names()  # the server sets it from n
    assert strategy_config(ContrastiveSearchConfig(top_k=3), {"penalty_alpha": 0.2}) == ContrastiveSearchConfig(
        top_k=3, penalty_alpha=0.2)
    with pytest.raises(InvalidParameterError, match="num_return_sequences"):
        strategy_config("contrastive-search", {"num_return_sequences": 2})


@pytest.mark.parametrize("argv, name, options", [
    (["--strategy", "contrastive-search", "--strategy-option", "top_k=3", "--strategy-option", "penalty_alpha=0.5"],
     "contrastive-search", {"top_k": 3, "penalty_alpha": 0.5}),
    (["--strategy", "dola", "--strategy-option", "dola_layers=[0,1]", "--strategy-option", "repetition_penalty=1.2"],
     "dola", {"dola_layers": [0, 1], "repetition_penalty": 1.2}),
    (["--strategy", "dola", "--strategy-option", "dola_layers=low"], "dola", {"dola_layers": "low"}),
    (["--strategy", "adadec", "--strategy-option", "entropy_threshold=0.4"], "adadec", {"entropy_threshold": 0.4}),
])
def test_cli_runs_the_strategies_as_the_api_does(capsys, argv, name, options):
    from leapdecode import cli

    rc = cli.main(["generate", "-m", "tiny-random", *argv, "--max-new-tokens", "8", "--json", "Hello"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = leapdecode.generate(leapdecode.load("tiny-random"), "Hello", strategy=name, max_new_tokens=8,
                              strategy_options=options)
    assert out["hypotheses"] == [h.to_dict() for h in ref.hypotheses]
    assert out["stats"]["strategy"] == name and out["text"] == ref.text


@pytest.mark.parametrize("argv, named", [
    (["--strategy", "dola", "--strategy-option", "dola_layers=middle"], "dola_layers"),
    (["--strategy", "contrastive-search", "--n", "2"], "num_return_sequences"),
    (["--strategy", "contrastive-search", "--strategy-option", "penalty_alpha=2"], "penalty_alpha"),
    (["--strategy", "contrastive", "--method", "draft"], "does not combine with method 'draft'"),
    (["--strategy", "contrastive", "--strategy-option", "alpha=0"], "alpha"),
    (["--strategy", "dola", "--temperature", "0.5"], "deterministic"),
    (["--strategy", "dola", "--repetition-penalty", "1.2"], "--repetition-penalty"),
])
def test_cli_bad_flags_exit_2_naming_them_before_loading(no_loading, capsys, argv, named):
    from leapdecode import cli

    rc = cli.main(["generate", "-m", "tiny-random", *argv, "hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("leapdecode: error:") and named in err


@pytest.fixture(scope="module")
def server():
    from leapdecode.models.tiny import tiny_loaded

    amateur = tiny_loaded(name="tiny-amateur", seed=6, layers=1, hidden=32, heads=2, kv_heads=1)
    for srv in tiny_server("vanilla", drafts={"tiny-amateur": amateur}):
        srv.amateur = amateur
        yield srv


@pytest.mark.parametrize("name, options", [
    ("contrastive-search", {"top_k": 3}),
    ("contrastive", {"amateur": "tiny-amateur", "alpha": 0.2}),
    ("dola", {"dola_layers": [0, 1]}),
    ("adadec", {"entropy_threshold": 0.4, "lookahead_length": 3}),
])
def test_server_runs_the_strategies_as_the_api_does(server, name, options):
    httpx = pytest.importorskip("httpx")
    body = {"model": server.model.name, "prompt": "Hello", "max_tokens": 8,
            "leapdecode": {"strategy": name, "strategy_options": options}}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    ref_model = leapdecode.load("tiny-random", dtype="fp32")
    runner = ModelRunner(ref_model)
    runner.add_draft("tiny-amateur", server.amateur)
    ref = leapdecode.generate(runner, "Hello", strategy=name, max_new_tokens=8, strategy_options=options)
    assert [c["text"] for c in out["choices"]] == [ref.text]
    assert out["leapdecode"]["strategy"] == name
    assert server.runner.caches_in_use == 0


def test_server_refuses_an_amateur_it_did_not_load(server):
    httpx = pytest.importorskip("httpx")
    body = {"model": server.model.name, "prompt": "Hello", "max_tokens": 4,
            "leapdecode": {"strategy": "contrastive", "strategy_options": {"amateur": "qwen2.5-coder-0.5b"}}}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "not loaded here" in r.json()["error"]["message"]
    body["leapdecode"] = {"strategy": "dola", "strategy_options": {"dola_layers": "middle"}}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "leapdecode.strategy_options.dola_layers", r.text
    assert server.runner.caches_in_use == 0


# ---------------------------------------------------------------------------- long prompts, a real model
def test_long_prompts_prefilled_in_chunks():
    # contrastive search's context spans every prefill chunk (no prefix-cache read); DoLa reads its
    # layers from the prompt's last token only, so it still reuses the chunks another request stored
    hf, lm = hf_pair()
    ids = [(i * 7) % 250 for i in range(600)]
    runner = ModelRunner(lm)
    res = leapdecode.generate(runner, prompt_ids=ids, strategy="contrastive-search", max_new_tokens=5,
                              strategy_options={"top_k": 3, "penalty_alpha": 0.6})
    assert res.hypotheses[0].tokens == reference_contrastive_search(hf, ids, 3, 0.6, 5)
    assert res.stats["prefix_reused"] == 0
    again = leapdecode.generate(runner, prompt_ids=ids, strategy="contrastive-search", max_new_tokens=5,
                                strategy_options={"top_k": 3, "penalty_alpha": 0.6})
    assert again.stats["prefix_reused"] == 0 and again.tokens == res.tokens
    hf6, lm6 = hf_deep()
    runner6 = ModelRunner(lm6)
    first = leapdecode.generate(runner6, prompt_ids=ids, strategy="dola", max_new_tokens=5)
    second = leapdecode.generate(runner6, prompt_ids=ids, strategy="dola", max_new_tokens=5)
    assert first.stats["prefix_reused"] == 0 and second.stats["prefix_reused"] == 512
    assert first.hypotheses[0].tokens == second.hypotheses[0].tokens == reference_dola(hf6, ids, [3, 5], 5)


@pytest.mark.integration
def test_contrastive_search_on_smollm2_equals_the_reference():
    from leapdecode.models.hf_backend import transformers_model

    lm = leapdecode.load("smollm2-135m", dtype="fp32", device="cpu", weights="fp32")
    hf = transformers_model(lm.path, lm.gguf, torch.float32).eval()  # transformers' own copy, from the GGUF
    ids = lm.tokenizer.encode("The capital of France is")
    res = leapdecode.generate(lm, prompt_ids=ids, strategy="contrastive-search", max_new_tokens=8,
                              strategy_options={"top_k": 4, "penalty_alpha": 0.6})
    assert res.hypotheses[0].tokens == reference_contrastive_search(hf, ids, 4, 0.6, 8, eos=set(lm.eos_token_ids))


# ---------------------------------------------------------------------------- AdaDec
def reference_adadec(lm, ids: list[int], threshold: float, L: int, B: int, max_new: int,
                     planted: str | None = None) -> tuple[list[int], int]:
    """AdaDec as the module describes it, every distribution from a full forward of the whole
    sequence.  ``planted``: "sum" ranks by the summed (not mean) log-probability, "low" pauses below
    the threshold instead of above, "no-lookahead" ranks by the candidate's own probability only."""
    eos = lm.eos_token_ids
    out: list[int] = []
    pauses = 0
    while len(out) < max_new:
        lp = torch.log_softmax(full_logits(lm, ids + out), -1)
        h = float(-(lp.exp() * lp).sum())
        pause = h < threshold if planted == "low" else h >= threshold
        if not pause:
            tok = int(torch.argmax(lp))
        else:
            pauses += 1
            top, cands = torch.topk(lp, B)
            best, tok = None, None
            for s, v in zip(top.tolist(), cands.tolist()):
                total, n, seq = s, 1, ids + out + [v]
                if v not in eos and planted != "no-lookahead":
                    for _ in range(L):
                        nl = torch.log_softmax(full_logits(lm, seq), -1)
                        r = int(torch.argmax(nl))
                        total, n, seq = total + float(nl[r]), n + 1, seq + [r]
                        if r in eos:
                            break
                score = total if planted == "sum" else total / n
                if best is None or score > best:
                    best, tok = score, v
        out.append(tok)
        if tok in eos:
            break
    return out, pauses


ADADEC_CASES = [(0.5, 5, 3, 12), (0.3, 2, 2, 10), (0.7, 3, 4, 12), (0.0, 1, 3, 8), (100.0, 5, 3, 8)]


@pytest.mark.parametrize("threshold, L, B, max_new", ADADEC_CASES)
@pytest.mark.parametrize("seed, prompt", [(0, "Hello"), (3, "The cat"), (5, "def f(x):")])
def test_adadec_equals_a_brute_force_reference(tiny, threshold, L, B, max_new, seed, prompt):
    lm = tiny(seed=seed)
    ids = lm.tokenizer.encode(prompt)
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="adadec", max_new_tokens=max_new,
                              strategy_options={"entropy_threshold": threshold, "lookahead_length": L,
                                                "lookahead_beam_size": B})
    want, pauses = reference_adadec(lm, ids, threshold, L, B, max_new)
    assert res.hypotheses[0].tokens == want
    assert res.stats["pauses"] == pauses
    if threshold == 100.0:  # never pauses: greedy decoding
        assert pauses == 0
        assert res.tokens == leapdecode.generate(ModelRunner(lm), prompt_ids=ids, method="vanilla",
                                                 max_new_tokens=max_new).tokens
    if threshold == 0.0:
        assert pauses == len(want)


@pytest.mark.parametrize("threshold, L, B", [(0.5, 4, 3), (0.9, 3, 2), (0.0, 6, 7)])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_adadec_where_lookaheads_end_early(threshold, L, B, seed):
    # an 8-token vocabulary whose last token ends the text: rollouts stop at different lengths
    lm = small_vocab(8, seed=seed, std=0.5)
    ids = [1, 2, 3]
    res = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="adadec", max_new_tokens=10,
                              strategy_options={"entropy_threshold": threshold, "lookahead_length": L,
                                                "lookahead_beam_size": B})
    want, pauses = reference_adadec(lm, ids, threshold, L, B, 10)
    assert res.hypotheses[0].tokens == want and res.stats["pauses"] == pauses


def _adadec_cases(tiny):
    for threshold, L, B, max_new in ADADEC_CASES[:4]:
        for seed, prompt in [(0, "Hello"), (3, "The cat"), (5, "def f(x):")]:
            lm = tiny(seed=seed)
            yield lm, lm.tokenizer.encode(prompt), threshold, L, B, max_new
    for seed in range(4):
        for threshold, L, B in [(0.5, 4, 3), (0.0, 6, 7)]:
            yield small_vocab(8, seed=seed, std=0.5), [1, 2, 3], threshold, L, B, 10


@pytest.mark.parametrize("planted", ["sum", "low", "no-lookahead"])
def test_adadec_reference_comparison_catches_planted_errors(tiny, planted):
    differs = False
    for lm, ids, threshold, L, B, max_new in _adadec_cases(tiny):
        got = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, strategy="adadec", max_new_tokens=max_new,
                                  strategy_options={"entropy_threshold": threshold, "lookahead_length": L,
                                                    "lookahead_beam_size": B}).hypotheses[0].tokens
        if got != reference_adadec(lm, ids, threshold, L, B, max_new, planted=planted)[0]:
            differs = True
            break
    assert differs, f"the planted error {planted!r} went unnoticed"


def test_adadec_refuses_bad_options_and_speculation(tiny):
    for bad in ({"entropy_threshold": -1}, {"lookahead_length": 0}, {"lookahead_beam_size": 0},
                {"num_return_sequences": 2}):
        with pytest.raises(InvalidParameterError, match=next(iter(bad))):
            strategy_config("adadec", bad)
    with pytest.raises(InvalidParameterError, match="does not combine with method 'draft'"):
        leapdecode.generate(ModelRunner(tiny()), "hi", strategy="adadec", method="draft", max_new_tokens=3)


@pytest.mark.parametrize("name", ["contrastive-search", "contrastive", "dola", "adadec"])
@pytest.mark.parametrize("kwargs, named", [
    ({"method": "draft"}, "does not combine with method 'draft'"),
    ({"method": "pld"}, "does not combine with method 'pld'"),
    ({"stop": ["\n"]}, "does not combine with stop"),
    ({"kv_policy": "int8"}, "kv_policy"),
    ({"regex": "[a-z]+"}, "does not combine with regex"),
    ({"top_p": 0.9}, "top_p"),
    ({"temperature": 0.8}, "deterministic"),
])
def test_what_does_not_combine_is_a_typed_error(tiny, name, kwargs, named):
    with pytest.raises(InvalidParameterError, match=named):
        leapdecode.generate(ModelRunner(tiny()), "hi", strategy=name, max_new_tokens=3, **kwargs)
