"""Superposed decoding (issue 16, section 2; "Superposed Decoding: Multiple Generations from a Single
Autoregressive Inference Pass", Shen et al., 2024) and the native decoder's ``embeds=`` hook.

* the hook: ``forward(embeds=embed(tokens))`` gives the bits of ``forward(tokens)`` (chains and
  trees), and the token ids are then only the shape;
* with one draft (its superposition is exactly its token's embedding) and no n-gram model,
  superposed decoding is greedy decoding; with one draft and an n-gram model it is an independent
  greedy expansion of the interpolated scores over ordinary token forwards;
* with k drafts, a brute-force reference written here after the authors' ``Superpose.forward``
  (its flattened top-2k over drafts x vocabulary, its alive/finished pools, its mixing matrix over
  the vocabulary, every distribution from a full forward of the whole embedding sequence on a
  fresh cache), with planted variants the comparison must reject;
* the n-gram corpus option, the typed options, and the API, CLI and server round trips.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from helpers.models import EOS, hf_pair

import leapdecode
from leapdecode.core.runner import ModelRunner
from leapdecode.errors import InvalidParameterError
from leapdecode.strategies.registry import STRATEGIES, SuperposedConfig, strategy_config
from helpers.server import tiny_server

CORPUS = "the cat sat on the mat and the dog sat on the log. the cat ate the rat. " * 4
PROMPTS = [(0, "the cat sat on the mat. the cat"), (3, "the dog"), (5, "Hello there")]


# ---------------------------------------------------------------------------- the embeds= hook
def test_forward_with_the_token_embeddings_is_forward_with_the_tokens(tiny):
    model = tiny(seed=1).model
    ids = [5, 17, 99, 3, 250, 42]
    a, b = model.new_cache(max_len=32), model.new_cache(max_len=32)
    want = model.forward(torch.tensor([ids]), a)
    got = model.forward(torch.zeros((1, len(ids)), dtype=torch.long), b, embeds=model.embed(torch.tensor([ids])))
    assert torch.equal(got, want)
    a.commit(), b.commit()
    # a tree of pending nodes: two children of the committed end, one grandchild
    parents, toks = [-1, -1, 0], [7, 8, 9]
    want = model.forward(torch.tensor([toks]), a, parents=parents)
    got = model.forward(torch.tensor([[1, 1, 1]]), b, parents=parents, embeds=model.embed(torch.tensor(toks)))
    assert torch.equal(got, want)
    a.commit([0, 2]), b.commit([0, 2])  # the first child and its child
    # the committed keys and values are the same too: the next token's logits agree
    assert torch.equal(model.forward(torch.tensor([[11]]), a), model.forward(torch.tensor([[11]]), b))
    # and a superposed embedding is another input
    c = model.new_cache(max_len=8)
    mix = 0.5 * model.embed(torch.tensor([7])) + 0.5 * model.embed(torch.tensor([8]))
    assert not torch.equal(model.forward(torch.tensor([[7]]), c, embeds=mix[None]), want[:, :1])


# ---------------------------------------------------------------------------- references
def ngram_tables(sources: list[list[int]], orders: int) -> dict:
    """context -> Counter of next tokens, for context lengths 1..orders, counted per source."""
    tables: dict = {}
    for ids in sources:
        for n in range(1, orders + 1):
            for i in range(n, len(ids)):
                tables.setdefault(tuple(ids[i - n : i]), Counter())[ids[i]] += 1
    return tables


def ngram_prob(tables: dict, seq: list[int], v: int, weights: list[float]) -> float:
    total = 0.0
    for i, w in enumerate(weights):
        ctx = tuple(seq[len(seq) - (i + 1):]) if len(seq) >= i + 1 else None
        if ctx is not None and ctx in tables:
            c = tables[ctx]
            total += w * c[v] / sum(c.values())
    return total


def last_logits(lm, embeds: torch.Tensor) -> torch.Tensor:
    """fp32 logits after a whole sequence of input embeddings, one plain forward on a fresh cache."""
    model = lm.model
    cache = model.new_cache(max_len=embeds.shape[0] + 1)
    return model.forward(torch.zeros((1, embeds.shape[0]), dtype=torch.long), cache, embeds=embeds[None],
                         logits_for=slice(-1, None))[0, -1].float()


def reference_superposed(lm, ids: list[int], k: int, alpha: float, temp: float, n_tok: int, weights: list[float],
                         penalty: float, max_new: int, corpus: list[int] | None = None,
                         planted: str | None = None) -> list[tuple[list[int], float]]:
    """The authors' Superpose.forward, step by step (see the module docstring); returns the best
    ``k`` drafts, finished and alive, best score first.  ``planted``: "uniform" superposes the drafts with equal
    weights, "no-penalty" drops the penalty fallback (unsupported drafts die), "no-renorm" keeps
    the top tokens' probabilities unnormalized, "lm-only" ignores the n-gram model."""
    emb = lm.model.embed.weight.float()
    eos = lm.eos_token_ids
    tables = ngram_tables([ids] + ([corpus] if corpus else []), len(weights))
    inputs = [emb[t] for t in ids]
    alive: list[tuple[list[int], float]] = [([], 0.0)]
    fin: list[tuple[list[int], float]] = []
    for step in range(max_new):
        logits = last_logits(lm, torch.stack(inputs))
        probs = torch.softmax(logits / temp, dim=-1)
        keep = torch.topk(probs, n_tok).indices
        kept = torch.zeros_like(probs)
        kept[keep] = probs[keep]
        if planted != "no-renorm":
            kept = kept / kept.sum()
        cands = []  # (score, draft index, token)
        for d, (toks, score) in enumerate(alive):
            lp = torch.log(kept)
            if alpha > 0 and planted != "lm-only":
                ng = torch.zeros_like(kept)
                for v in keep.tolist():
                    ng[v] = ngram_prob(tables, ids + toks, v, weights)
                s = (1 - alpha) * lp + alpha * torch.log(ng)
                if not torch.isfinite(s).any() and planted != "no-penalty":
                    s = (1 - alpha) * lp - penalty
            else:
                s = lp
            for v in keep.tolist():
                if torch.isfinite(s[v]):
                    cands.append((score + float(s[v]), d, v))
        cands.sort(key=lambda c: -c[0])
        new_alive = []
        for value, d, v in cands[: 2 * k]:
            draft = (alive[d][0] + [v], value)
            if v in eos:
                fin.append(draft)
            elif len(new_alive) < k:
                new_alive.append(draft)
        fin = sorted(fin, key=lambda h: -h[1])[:k]
        alive = new_alive
        if not alive:
            break
        # the mixing matrix over the vocabulary, the authors' way
        w = torch.softmax(torch.tensor([s for _, s in alive], dtype=torch.float64), dim=0)
        if planted == "uniform":
            w = torch.full_like(w, 1.0 / len(alive))
        mix = torch.zeros(emb.shape[0], dtype=torch.float64)
        for (toks, _), wd in zip(alive, w.tolist()):
            mix[toks[-1]] += wd
        mix = mix / mix.sum()
        inputs.append((mix.float() @ emb) if len({t[-1] for t, _ in alive}) > 1 else emb[alive[0][0][-1]])
    return sorted(fin + alive, key=lambda h: -h[1])[:k]


def run(lm, ids, max_new, runner=None, **options):
    return leapdecode.generate(runner or ModelRunner(lm), prompt_ids=ids, strategy="superposed",
                               max_new_tokens=max_new, strategy_options=options)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ngram") / "corpus.txt"
    path.write_text(CORPUS)
    return str(path)


# ---------------------------------------------------------------------------- one draft
@pytest.mark.parametrize("model_seed, prompt", PROMPTS)
def test_one_draft_without_an_ngram_model_is_greedy_decoding(tiny, model_seed, prompt):
    lm = tiny(seed=model_seed)
    ids = lm.tokenizer.encode(prompt)
    greedy = leapdecode.generate(ModelRunner(lm), prompt_ids=ids, method="vanilla", max_new_tokens=16).tokens
    res = run(lm, ids, 16, num_drafts=1, alpha=0)
    assert res.tokens == greedy and len(res.hypotheses) == 1


def reference_one_draft(lm, ids, alpha, temp, n_tok, weights, penalty, max_new, corpus) -> list[int]:
    """Greedy expansion of the interpolated scores with ordinary token forwards (no embeddings)."""
    model = lm.model
    tables = ngram_tables([ids, corpus], len(weights))
    out: list[int] = []
    for _ in range(max_new):
        seq = ids + out
        cache = model.new_cache(max_len=len(seq) + 1)
        logits = model.forward(torch.tensor([seq]), cache, logits_for=slice(-1, None))[0, -1].float()
        lp = torch.log_softmax(logits / temp, dim=-1)
        top_lp, top = torch.topk(lp, n_tok)
        top_lp = top_lp - torch.logsumexp(top_lp, 0)
        ng = torch.tensor([ngram_prob(tables, seq, v, weights) for v in top.tolist()])
        s = (1 - alpha) * top_lp + alpha * torch.log(ng)
        if not torch.isfinite(s).any():
            s = (1 - alpha) * top_lp - penalty
        tok = int(top[int(torch.argmax(s))])
        out.append(tok)
        if tok in lm.eos_token_ids:
            break
    return out


@pytest.mark.parametrize("model_seed, prompt", PROMPTS)
@pytest.mark.parametrize("alpha, temp, n_tok", [(0.54, 0.06, 9), (0.9, 1.0, 5), (0.3, 0.5, 20)])
def test_one_draft_with_an_ngram_model_is_the_independent_greedy_expansion(tiny, corpus_file, model_seed, prompt,
                                                                           alpha, temp, n_tok):
    lm = tiny(seed=model_seed)
    ids = lm.tokenizer.encode(prompt)
    weights = [0.01, 0.04, 0.15, 0.18, 0.12]
    res = run(lm, ids, 16, num_drafts=1, alpha=alpha, lm_temperature=temp, n_token_sample=n_tok,
              ngram_corpus=corpus_file)
    want = reference_one_draft(lm, ids, alpha, temp, n_tok, weights, 200.0, 16, lm.tokenizer.encode(CORPUS))
    assert res.hypotheses[0].tokens == want


# ---------------------------------------------------------------------------- k drafts
K_CASES = [
    dict(num_drafts=3),
    dict(num_drafts=2, alpha=0.8, lm_temperature=1.0, n_token_sample=6),
    dict(num_drafts=4, alpha=0.0, lm_temperature=0.5, n_token_sample=8),
    dict(num_drafts=3, alpha=0.5, lm_temperature=0.2, n_token_sample=4, ngram_weights=[0.5, 0.5], penalty=5.0),
    dict(num_drafts=3, n_token_sample=64, lm_temperature=1.0),  # wide enough for the corpus's bytes to matter
]


def _ref_args(opts: dict) -> dict:
    cfg = SuperposedConfig(**opts)
    return dict(k=cfg.num_drafts, alpha=cfg.alpha, temp=cfg.lm_temperature, n_tok=cfg.n_token_sample,
                weights=list(cfg.ngram_weights), penalty=cfg.penalty)


@pytest.mark.parametrize("opts", K_CASES)
@pytest.mark.parametrize("model_seed, prompt", PROMPTS)
@pytest.mark.parametrize("with_corpus", [False, True])
def test_k_drafts_equal_a_brute_force_reference(tiny, corpus_file, opts, model_seed, prompt, with_corpus):
    lm = tiny(seed=model_seed)
    ids = lm.tokenizer.encode(prompt)
    options = {**opts, **({"ngram_corpus": corpus_file} if with_corpus else {})}
    res = run(lm, ids, 12, **options)
    want = reference_superposed(lm, ids, max_new=12, corpus=lm.tokenizer.encode(CORPUS) if with_corpus else None,
                                **_ref_args(opts))
    assert [h.tokens for h in res.hypotheses] == [t for t, _ in want]
    assert [h.score for h in res.hypotheses] == pytest.approx([s for _, s in want], rel=1e-6, abs=5e-3)
    assert len({tuple(h.tokens) for h in res.hypotheses}) == len(res.hypotheses)  # the drafts are distinct
    assert len(res.hypotheses) == opts["num_drafts"]


def test_drafts_that_end_join_the_finished_pool():
    from helpers.models import small_vocab

    ids = [1, 2, 3]
    stopped = 0
    for seed in range(6):
        lm = small_vocab(8, seed=seed, std=0.5)  # token 7 ends the text
        res = run(lm, ids, 10, num_drafts=3, alpha=0.0, lm_temperature=1.0, n_token_sample=8)
        want = reference_superposed(lm, ids, 3, 0.0, 1.0, 8, [0.1], 200.0, 10)
        assert [h.tokens for h in res.hypotheses] == [t for t, _ in want]
        assert [h.score for h in res.hypotheses] == pytest.approx([s for _, s in want], rel=1e-6, abs=5e-3)
        for h in res.hypotheses:
            assert (h.finish_reason == "stop") == (h.tokens[-1] == 7)
            assert 7 not in h.tokens[:-1]
        stopped += sum(h.finish_reason == "stop" for h in res.hypotheses)
    assert stopped > 0, "no draft ended: the finished pool went untested"


@pytest.mark.parametrize("planted", ["uniform", "no-penalty", "no-renorm", "lm-only"])
def test_reference_comparison_catches_planted_errors(tiny, corpus_file, planted):
    for model_seed, prompt in PROMPTS:
        lm = tiny(seed=model_seed)
        ids = lm.tokenizer.encode(prompt)
        for opts in K_CASES:
            res = run(lm, ids, 12, ngram_corpus=corpus_file, **opts)
            want = reference_superposed(lm, ids, max_new=12, corpus=lm.tokenizer.encode(CORPUS), planted=planted,
                                        **_ref_args(opts))
            if [h.tokens for h in res.hypotheses] != [t for t, _ in want] or [h.score for h in res.hypotheses] != \
                    pytest.approx([s for _, s in want], rel=1e-6, abs=5e-3):
                return
    pytest.fail(f"the planted error {planted!r} went unnoticed")


def test_the_corpus_steers_the_drafts_and_is_counted_once(tiny, corpus_file):
    lm = tiny(seed=5)
    ids = lm.tokenizer.encode("the dog")
    runner = ModelRunner(lm)
    wide = {"n_token_sample": 64, "lm_temperature": 1.0}  # (a random model's top 9 are rarely the corpus's bytes)
    plain = run(lm, ids, 12, runner=runner, **wide)
    steered = run(lm, ids, 12, runner=runner, ngram_corpus=corpus_file, **wide)
    assert [h.tokens for h in plain.hypotheses] != [h.tokens for h in steered.hypotheses]
    assert steered.stats["penalized"] < plain.stats["penalized"]
    assert len(runner.memory) == 1  # the corpus's counts
    again = run(lm, ids, 12, runner=runner, ngram_corpus=corpus_file, **wide)
    assert len(runner.memory) == 1 and [h.tokens for h in again.hypotheses] == [h.tokens for h in steered.hypotheses]
    assert runner.caches_in_use == 0
    # one forward per step after the prompt's: k drafts from one pass
    assert steered.stats["target_forwards"] == 12


# ---------------------------------------------------------------------------- options, API, CLI and server
def test_options_are_typed_and_checked(tmp_path):
    spec = STRATEGIES["superposed"]
    cfg = spec.config()
    assert cfg.strategy == "superposed" and cfg.returns == 3 and not cfg.stochastic
    assert strategy_config("superposed", {"num_drafts": 5, "num_return_sequences": 2}).returns == 2
    for bad, named in [({"ngram_weights": []}, "ngram_weights"), ({"ngram_weights": [1] * 7}, "ngram_weights"),
                       ({"ngram_weights": [-1.0]}, "ngram_weights"), ({"ngram_weights": "x"}, "ngram_weights"),
                       ({"ngram_corpus": str(tmp_path / "missing.txt")}, "ngram_corpus"),
                       ({"num_return_sequences": 4}, "num_return_sequences"), ({"num_drafts": 0}, "num_drafts"),
                       ({"alpha": 1.5}, "alpha"), ({"lm_temperature": 0}, "lm_temperature"),
                       ({"n_token_sample": 0}, "n_token_sample"), ({"penalty": -1}, "penalty")]:
        with pytest.raises(InvalidParameterError, match=named):
            strategy_config("superposed", bad)


@pytest.mark.parametrize("kwargs, named", [
    ({"temperature": 0.7}, "deterministic"),
    ({"method": "pld"}, "does not combine with method 'pld'"),
    ({"stop": ["\n"]}, "does not combine with stop"),
    ({"kv_policy": "int8"}, "kv_policy"),
])
def test_what_does_not_combine_is_a_typed_error(tiny, kwargs, named):
    with pytest.raises(InvalidParameterError, match=named):
        leapdecode.generate(ModelRunner(tiny()), "hi", strategy="superposed", max_new_tokens=3, **kwargs)


def test_the_transformers_backend_is_refused():
    from leapdecode.models.decoder import LoadedModel
    from leapdecode.models.hf_backend import HFCausalLM

    hf, native = hf_pair()
    hf_lm = LoadedModel(name="hf-backend", model=HFCausalLM(hf, max_seq_len=256), tokenizer=native.tokenizer,
                        eos_token_ids=set(EOS))
    with pytest.raises(InvalidParameterError, match="native backend"):
        leapdecode.generate(ModelRunner(hf_lm), "hi", strategy="superposed", max_new_tokens=3)


def test_cli_runs_superposed_as_the_api_does(capsys, corpus_file):
    from leapdecode import cli

    rc = cli.main(["generate", "-m", "tiny-random", "--strategy", "superposed", "--n", "2", "--strategy-option",
                   "num_drafts=3", "--strategy-option", "ngram_weights=[0.2,0.3]", "--strategy-option",
                   f"ngram_corpus={corpus_file}", "--max-new-tokens", "8", "--json", "the cat"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = leapdecode.generate(leapdecode.load("tiny-random"), "the cat", strategy="superposed", max_new_tokens=8,
                              num_return_sequences=2, strategy_options={"num_drafts": 3, "ngram_weights": [0.2, 0.3],
                                                                        "ngram_corpus": corpus_file})
    assert len(out["hypotheses"]) == 2
    assert out["hypotheses"] == [h.to_dict() for h in ref.hypotheses]
    assert out["stats"]["strategy"] == "superposed"


@pytest.mark.parametrize("argv, named", [
    (["--strategy", "superposed", "--strategy-option", "ngram_weights=[]"], "ngram_weights"),
    (["--strategy", "superposed", "--strategy-option", "ngram_corpus=/no/such/file"], "ngram_corpus"),
    (["--strategy", "superposed", "--n", "4"], "num_return_sequences"),
    (["--strategy", "superposed", "--temperature", "0.5"], "deterministic"),
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


def test_server_returns_the_drafts_as_n_choices(server):
    httpx = pytest.importorskip("httpx")
    options = {"num_drafts": 3, "alpha": 0.5}
    body = {"model": server.model.name, "prompt": "the cat", "max_tokens": 8, "n": 3,
            "leapdecode": {"strategy": "superposed", "strategy_options": options}}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    ref = leapdecode.generate(leapdecode.load("tiny-random", dtype="fp32"), "the cat", strategy="superposed",
                              max_new_tokens=8, strategy_options=options)
    assert [c["text"] for c in out["choices"]] == [h.text for h in ref.hypotheses]
    assert [c["score"] for c in out["leapdecode"]["choices"]] == [h.score for h in ref.hypotheses]
    assert out["leapdecode"]["strategy"] == "superposed"
    assert server.runner.caches_in_use == 0
    body["leapdecode"]["strategy_options"] = {"ngram_weights": [2, -1]}
    r = httpx.post(server.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "leapdecode.strategy_options.ngram_weights", r.text


# ---------------------------------------------------------------------------- a real model
@pytest.mark.integration
def test_superposed_on_smollm2():
    lm = leapdecode.load("smollm2-135m")  # the default weights (GGUF blocks, invariant attention)
    ids = lm.tokenizer.encode("def fibonacci(n):")
    greedy = leapdecode.generate(lm, prompt_ids=ids, method="vanilla", max_new_tokens=12).tokens
    one = run(lm, ids, 12, num_drafts=1, alpha=0)
    assert one.tokens == greedy  # the superposition of one token is that token's embedding, bitwise
    res = run(lm, ids, 12, num_drafts=3)
    assert len(res.hypotheses) == 3 and len({tuple(h.tokens) for h in res.hypotheses}) == 3
    assert res.stats["target_forwards"] == 12
