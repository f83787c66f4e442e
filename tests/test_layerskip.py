"""Layer-skip self-speculation (``method="layerskip"``, CLaSp).

1. CLaSp's DP: exact against brute force when the objective is monotone in an additive per-layer
   score; on a real (tiny) model its reported score is the true objective of the subset it picks,
   and that subset beats naive choices;
2. the DP's probe rows reproduce the verification forward's hidden states (``hidden_states=``),
   which do not change the logits; the generation loop hands them to ``observe`` exactly when the
   proposer asks (``wants_hidden``), and nothing is left on the model object;
3. drafting and the DP leave the shared KV cache exactly as they found it;
4. lossless: greedy tokens equal vanilla (hypothesis over prompts, models, budgets, parameters);
   under sampling the first token is distributed as the target's;
5. with nothing skipped the draft is the target: every drafted token is accepted;
6. bad parameters and the HF backend raise clear errors.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.generate import Generation
from leapdecode.core.proposer import DecodeContext, Proposer
from leapdecode.core.sampling import SamplingParams, target_probs
from leapdecode.core.tree import TokenTree
from leapdecode.errors import InvalidParameterError
from leapdecode.proposers import METHODS, build_proposer, method_config
from leapdecode.proposers.layerskip import LayerSkipProposer, clasp_dp, resolve_skip

PROMPT = "def add(a, b):\n    return a + b\n\nhello world, the cat sat on the mat."
WORDS = ["the cat ", "sat on ", "the mat ", "abc", "xyz ", "aa", "\n", "def f(x):", " return x"]


def context(model, prompt_ids, max_new=16, seed=0, **sampling):
    """A prefilled target cache (all but the root), as the generation loop leaves it."""
    cache = model.model.new_cache(max_len=len(prompt_ids) + max_new + 64)
    model.model.forward(torch.tensor([prompt_ids[:-1]]), cache, logits_for=slice(0, 0))
    cache.commit()
    gen = torch.Generator().manual_seed(seed)
    return DecodeContext(ModelRunner(model), cache, SamplingParams(**sampling), gen, len(prompt_ids), max_new)


def make(model, **options):
    """The layerskip proposer the registry builds for ``options`` (validated like ``generate``'s)."""
    return build_proposer(method_config("layerskip", options), ModelRunner(model))


def attributes(model) -> tuple:
    """What is set on a model object (a proposer must leave nothing there)."""
    return set(vars(model)), set(vars(model.model))


def ids(model, text=PROMPT):
    return model.tokenizer.encode(text)


# ----------------------------------------------------------------------------- the DP
def brute_force(run_layer, x0, n_layers, n_skip, final):
    """Cosine of the final state to ``final`` for every subset of ``n_skip`` skipped layers."""
    out = {}
    for skip in itertools.combinations(range(n_layers), n_skip):
        h = x0[None]
        for i in range(n_layers):
            if i not in skip:
                h = run_layer(i, h)
        out[skip] = float(F.cosine_similarity(h[0].float(), final.float(), dim=0))
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(0, n),
    st.lists(st.floats(0.05, 3.0), min_size=n, max_size=n, unique=True),
    st.integers(0, 2**31 - 1))))
def test_dp_is_exact_when_the_objective_is_additive(case):
    # layer i adds w_i along its own direction u_i (orthonormal, randomly rotated); from x0 = u_L the
    # final cosine is sqrt(1 + kept energy) / |x_L|, so the best skip set drops the smallest |w_i|.
    # Each DP cell's comparison is then exact, so the DP must find the brute-force optimum.
    n, m, w, seed = case
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n + 3, n + 3, generator=g, dtype=torch.float64))
    u = u.T  # rows orthonormal
    steps = torch.tensor(w, dtype=torch.float64)[:, None] * u[:n]

    def run_layer(i, h):
        return h + steps[i]

    x0 = u[n]
    targets = torch.stack([x0 + steps[: i + 1].sum(0) for i in range(n)])
    skip, score = clasp_dp(run_layer, x0, n, m, targets)
    table = brute_force(run_layer, x0, n, m, targets[-1])
    best = max(table, key=table.get)
    assert tuple(skip) == best == tuple(sorted(sorted(range(n), key=lambda i: w[i])[:m]))
    assert score == pytest.approx(table[best], abs=1e-9)
    # the extra-row form (targets computed alongside) agrees
    skip2, score2 = clasp_dp(run_layer, x0, n, m, None)
    assert skip2 == skip and score2 == pytest.approx(score, abs=1e-9)


def test_dp_edge_counts():
    run = lambda i, h: h * 2.0 + i  # noqa: E731
    x0 = torch.ones(3)
    assert clasp_dp(run, x0, 4, 0)[0] == []
    assert clasp_dp(run, x0, 4, 4)[0] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        clasp_dp(run, x0, 4, 5)


def dp_on_model(model, n_skip, text=PROMPT):
    """Run the proposer's DP at the last prompt token; brute-force the same objective for every
    subset of at most ``n_skip`` skipped layers (keyed by the sorted tuple)."""
    prompt = ids(model, text)
    ctx = context(model, prompt)
    prop = LayerSkipProposer(model, skip=n_skip)
    prop.begin(ctx, prompt)
    n = model.model.n_layers
    x0 = model.model.embed(torch.tensor([prompt[-2]]))[0].detach()
    with torch.inference_mode(), prop.sibling_rows(1) as run_layer:
        full = x0[None]
        for i in range(n):
            full = run_layer(i, full)
        table = {}
        for m in range(n_skip + 1):
            table.update(brute_force(run_layer, x0, n, m, full[0]))
    assert ctx.cache.n_pending == 0
    skipped = tuple(sorted(set(range(n)) - set(prop.layers)))
    return skipped, prop.last_score, table


def greedy_elimination(table, n_layers, n_skip):
    """Baseline: skip one more layer at a time, each time the one that keeps the final state closest."""
    chosen: tuple = ()
    for _ in range(n_skip):
        chosen = max((tuple(sorted(chosen + (i,))) for i in range(n_layers) if i not in chosen), key=table.get)
    return chosen


def test_dp_on_tiny_models_against_brute_force(tiny):
    # real (random) layers: the DP is an approximation, so it is judged against brute force and
    # against a greedy baseline over many cases; a DP that chose badly (e.g. picked the *worst*
    # candidate per cell, or backtracked wrongly) fails every one of these
    cases = [(seed, text) for seed in range(6) for text in (PROMPT, "the cat sat on the mat")]
    optimal = dp_total = greedy_total = 0.0
    n = 0
    for seed, text in cases:
        model = tiny(seed=seed, layers=8)
        for m in (1, 2, 3, 5):
            skipped, score, table = dp_on_model(model, m, text)
            assert len(skipped) == m
            # the score the DP reports is the true objective of the subset it returns
            assert score == pytest.approx(table[skipped], abs=2e-5)
            ranked = sorted((v for key, v in table.items() if len(key) == m), reverse=True)
            assert table[skipped] >= ranked[len(ranked) // 8] - 1e-6, (seed, m, table[skipped], ranked[:8])
            optimal += table[skipped] >= ranked[0] - 1e-6
            dp_total += table[skipped]
            greedy_total += table[greedy_elimination(table, 8, m)]
            n += 1
    assert optimal / n >= 0.7, optimal / n
    assert dp_total >= greedy_total - 1e-6, (dp_total / n, greedy_total / n)


# ----------------------------------------------------------------------------- hidden states
def test_hidden_states_option_and_probe_rows(tiny):
    model = tiny(seed=0, layers=4)
    net = model.model
    prompt = ids(model)
    cache = net.new_cache(max_len=256)
    plain = net.forward(torch.tensor([prompt]), cache)
    cache.rollback()
    hs: list = []
    logits = net.forward(torch.tensor([prompt]), cache, hidden_states=hs)
    assert torch.equal(logits, plain) and len(hs) == net.n_layers + 1
    assert hs[0].shape == (1, len(prompt), net.cfg.hidden_size)
    cache.rollback()
    again: list = []
    net.forward(torch.tensor([prompt]), cache, hidden_states=again)
    assert all(torch.equal(a, b) for a, b in zip(again, hs))
    cache.rollback()
    # the DP's probe rows of the last committed token reproduce the full forward's states for it
    ctx = context(model, prompt + [5])  # commits the whole prompt; its last token is the probe
    prop = LayerSkipProposer(model, skip=1)
    prop.begin(ctx, prompt + [5])
    with torch.inference_mode(), prop.sibling_rows(3) as run_layer:
        x = hs[0][0, -1].expand(3, -1)
        for i in range(net.n_layers):
            x = run_layer(i, x)
            torch.testing.assert_close(x, hs[i + 1][0, -1].expand(3, -1), atol=1e-4, rtol=1e-4)
    assert ctx.cache.n_pending == 0 and ctx.cache.length == len(prompt)


class _HiddenSpy(Proposer):
    """Proposes a fixed chain and asks for the hidden states of every other verification forward."""

    name = "spy"

    def __init__(self, chain):
        super().__init__(len(chain))
        self.chain, self.calls, self.seen = list(chain), 0, []

    def propose(self, tokens, budget):
        self.calls += 1
        return TokenTree.chain(self.chain[:budget])

    def wants_hidden(self):
        return self.calls % 2 == 1

    def observe(self, tokens, tree, verdict, logits, hidden=None):
        self.seen.append((tokens[: len(tokens) - len(verdict.tokens)], list(tree.tokens), hidden))


def test_the_loop_hands_hidden_states_to_observe(tiny):
    """The verification forward's per-layer states reach ``observe`` when the proposer asks for them
    (after ``propose``), and only then; they are the states of a plain forward over the same tokens;
    nothing is set on the model object."""
    model = tiny(seed=0, layers=4)
    net = model.model
    prompt = ids(model)
    before = attributes(model)
    spy = _HiddenSpy([5, 6, 7])
    Generation(ModelRunner(model), prompt, SamplingParams(), spy, method="spy", max_new_tokens=12).run()
    assert len(spy.seen) >= 2
    for step, (context, drafted, hidden) in enumerate(spy.seen):
        if step % 2 == 1:
            assert hidden is None
            continue
        # the forward verified [root] + the drafted chain on top of the context (whose last token is the root)
        assert hidden is not None and len(hidden) == net.n_layers + 1
        n = 1 + len(drafted)
        assert all(h.shape == (1, n, net.cfg.hidden_size) for h in hidden)
        plain: list = []
        net.forward(torch.tensor([context + drafted]), net.new_cache(max_len=len(context) + n + 8),
                    hidden_states=plain)
        for h, p in zip(hidden, plain):
            torch.testing.assert_close(h, p[:, -n:], atol=1e-4, rtol=1e-4)
    assert attributes(model) == before


def test_begin_probe_and_capture_choose_alike(tiny):
    # the first DP (probe with the full path as an extra row) and a DP on captured verify states
    # must see the same targets: same layers, same score
    model = tiny(seed=1, layers=6)
    prompt = ids(model)
    ctx = context(model, prompt)
    a = LayerSkipProposer(model, skip=2)
    a.begin(ctx, prompt)
    hs: list = []
    b = LayerSkipProposer(model, skip=2, update_every=1)
    b.begin(ctx, prompt)
    ctx.cache.truncate(ctx.cache.length - 1)
    model.model.forward(torch.tensor([[prompt[-2]]]), ctx.cache, hidden_states=hs)
    ctx.cache.commit()
    b._optimise(prompt[-2], torch.stack([h[0, 0] for h in hs[1:]]), x0=hs[0][0, 0])
    assert a.layers == b.layers
    assert a.last_score == pytest.approx(b.last_score, abs=1e-5)


# ----------------------------------------------------------------------------- shared cache
@pytest.mark.parametrize("greedy", [True, False])
def test_drafting_and_dp_leave_the_cache_untouched(tiny, greedy):
    model = tiny(seed=0, layers=4)
    net = model.model
    prompt = ids(model)
    sampling = {} if greedy else {"temperature": 0.8}
    ctx = context(model, prompt, **sampling)
    cache = ctx.cache

    def snapshot():
        n = cache.length
        return n, cache.n_pending, cache.k[:, :, :, :n].clone(), cache.v[:, :, :, :n].clone()

    def root_logits():
        out = net.forward(torch.tensor([[prompt[-1], 7, 9]]), cache)
        cache.rollback()
        return out

    before, ref = snapshot(), root_logits()
    prop = LayerSkipProposer(model, skip=2, k=5, min_conf=0.0, update_every=1)
    prop.begin(ctx, prompt)  # runs the DP
    tree = prop.propose(list(prompt), 8)
    assert len(tree) == 5 and prop.wants_hidden()  # the verification forward's states are wanted
    after = snapshot()
    assert after[:2] == before[:2] and torch.equal(after[2], before[2]) and torch.equal(after[3], before[3])
    assert torch.equal(root_logits(), ref)
    # the verification forward right after a draft equals one on a cache that never saw a draft
    flat = torch.tensor([[prompt[-1]] + tree.tokens])
    captured: list = []
    got = net.forward(flat, cache, hidden_states=captured)
    fresh = context(model, prompt).cache
    want = net.forward(flat, fresh)
    assert torch.equal(got, want)
    assert len(captured) == net.n_layers + 1
    from leapdecode.core.verifier import verify

    verdict = verify(tree, got[0], ctx.params, generator=ctx.generator)
    cache.commit([0] + [a + 1 for a in verdict.accepted])
    tokens = list(prompt) + verdict.tokens
    mid = snapshot()
    prop.observe(tokens, tree, verdict, got[0], captured)  # runs the DP on the captured states
    assert not prop.wants_hidden() and prop.stats()["layerskip_dp_runs"] == 2
    end = snapshot()
    assert end[:2] == mid[:2] and torch.equal(end[2], mid[2]) and torch.equal(end[3], mid[3])
    prop.end()


# ----------------------------------------------------------------------------- lossless
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=10), st.text(max_size=8),
       st.sampled_from([(0, 2), (1, 4), (2, 6)]), st.integers(0, 5), st.integers(1, 7),
       st.sampled_from([None, 1, 3, 12]), st.sampled_from([1, 3]), st.sampled_from([0.0, 0.4]),
       st.sampled_from([1.0, 1.3]), st.integers(6, 40), st.sampled_from([0, 64]))
def test_greedy_identity(tiny, words, noise, model_spec, skip, k, budget, update_every, min_conf, penalty, n_new,
                         draft_vocab):
    seed, layers = model_spec
    model = tiny(seed=seed, layers=layers)
    prompt = "".join(words) + noise
    if not model.tokenizer.encode(prompt):
        prompt = "x"
    skip = min(skip, layers - 1)
    before = attributes(model)
    want = leapdecode.generate(model, prompt, max_new_tokens=n_new, repetition_penalty=penalty, method="vanilla")
    got = leapdecode.generate(model, prompt, max_new_tokens=n_new, method="layerskip", repetition_penalty=penalty,
                              options=dict(tree_budget=budget, skip=skip, k=k, update_every=update_every,
                                           min_conf=min_conf, draft_vocab=draft_vocab))
    assert got.tokens == want.tokens
    assert got.finish_reason == want.finish_reason
    s = got.stats
    assert s["draft_forwards"] == s["draft_nodes"]  # one forward per drafted token, none wasted
    assert attributes(model) == before  # nothing left on the model objects


def test_chat_prompt_and_one_token_prompt(tiny):
    model = tiny(seed=0, layers=4)
    for prompt, chat in ((PROMPT, True), ("x", False)):
        want = leapdecode.generate(model, prompt, chat=chat, max_new_tokens=24, method="vanilla").tokens
        got = leapdecode.generate(model, prompt, chat=chat, max_new_tokens=24, method="layerskip")
        assert got.tokens == want
    # a one-token prompt has no committed token to probe: the first step drafts nothing
    assert got.stats["layerskip_dp_runs"] >= 1


@pytest.mark.parametrize("draft_vocab", [0, 64])  # 64: a frequency-ranked subset head (-inf elsewhere)
def test_sampling_first_token_is_distributed_as_the_target(tiny, chi2, draft_vocab):
    model = tiny(seed=0, layers=4)
    params = dict(temperature=1.0, top_k=8)
    prompt = ids(model)
    logits = model.model.forward(torch.tensor([prompt]), model.model.new_cache(max_len=128))[0, -1]
    p = target_probs(logits[None], SamplingParams(**params))[0]
    counts = torch.zeros_like(p)
    accepted = 0
    for seed in range(300):
        r = leapdecode.generate(model, None, prompt_ids=prompt, max_new_tokens=3, seed=seed, method="layerskip",
                                options=dict(skip=2, min_conf=0.0, draft_vocab=draft_vocab), **params)
        counts[r.tokens[0]] += 1
        accepted += r.stats["accept_hist"].get("0", 0) < r.stats["target_forwards"]
    _, _, pval = chi2(counts, p)
    assert pval > 1e-3
    assert accepted > 0  # some drafted tokens were accepted, so the test exercised rejection sampling


def test_nothing_skipped_accepts_every_draft(tiny):
    # the draft runs every layer on the shared cache: if its attention to the committed prefix or to
    # its own earlier draft tokens were off, drafts would be rejected
    model = tiny(seed=2, layers=4)
    r = leapdecode.generate(model, "def f(x):", max_new_tokens=60, method="layerskip",
                            options=dict(skip=0, k=4, min_conf=0.0))
    assert r.tokens == leapdecode.generate(model, "def f(x):", max_new_tokens=60, method="vanilla").tokens
    assert len(r.tokens) == 60
    assert r.stats["layerskip_accept_rate"] > 0.95, r.stats
    assert r.stats["mean_accepted"] > 4.5
    assert r.stats["layerskip_dp_runs"] == 0


def test_confidence_stops_drafting(tiny):
    model = tiny(seed=2, layers=4)
    kw = dict(max_new_tokens=60, method="layerskip")
    lax = leapdecode.generate(model, "def f(x):", options=dict(k=6, skip=2, min_conf=0.0), **kw)
    strict = leapdecode.generate(model, "def f(x):", options=dict(k=6, skip=2, min_conf=0.999), **kw)
    assert lax.tokens == strict.tokens and len(lax.tokens) == 60
    lax_nodes, strict_nodes = (r.stats["draft_nodes"] / r.stats["target_forwards"] for r in (lax, strict))
    assert lax_nodes > 4
    assert strict_nodes < lax_nodes / 2, (lax_nodes, strict_nodes)


# ----------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("opts", [
    {"skip": -1}, {"skip": 4}, {"skip": 9}, {"skip": 1.5}, {"skip": 1.0 + 1e-9}, {"skip": float("nan")},
    {"skip": True}, {"skip": "2"}, {"k": 0}, {"k": -2}, {"k": 2.5}, {"min_conf": 1.0}, {"min_conf": -0.1},
    {"min_conf": "x"}, {"update_every": 0}, {"bogus": 1}, {"draft_vocab": -1}, {"draft_vocab": 2.0},
])
def test_bad_parameters(tiny, opts):
    model = tiny(seed=0, layers=4)
    with pytest.raises(InvalidParameterError):
        make(model, **opts)
    with pytest.raises(InvalidParameterError):
        leapdecode.generate(model, "hi", max_new_tokens=2, method="layerskip", options=opts)


def test_bad_budget(tiny):
    with pytest.raises(InvalidParameterError, match="tree_budget"):
        LayerSkipProposer(tiny(seed=0, layers=4), tree_budget=0)


def test_skip_resolution():
    assert resolve_skip(None, 28) == 8 and resolve_skip(0.5, 28) == 14 and resolve_skip(3, 28) == 3
    assert resolve_skip(0.01, 28) == 1 and resolve_skip(0.99, 4) == 3 and resolve_skip(2.0, 4) == 2
    assert resolve_skip(None, 2) == 1


def test_hf_backend_is_refused(tiny):
    import transformers  # a dependency of leapdecode: missing is a failure, not a skip
    from leapdecode.models.hf_backend import HFCausalLM
    from leapdecode.models.loader import LoadedModel

    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = HFCausalLM(transformers.LlamaForCausalLM(cfg).eval(), max_seq_len=128)
    base = tiny(seed=0)
    model = LoadedModel("tiny-hf", hf, base.tokenizer, eos_token_ids=base.eos_token_ids)
    with pytest.raises(InvalidParameterError, match="layerskip needs the native backend"):
        make(model)
    with pytest.raises(InvalidParameterError, match="layerskip needs the native backend"):
        leapdecode.generate(model, "hi", max_new_tokens=4, method="layerskip")


def test_registered(tiny):
    assert "layerskip" in METHODS
    model = tiny(seed=0, layers=4)
    p = make(model, tree_budget=5, skip=2, k=3)
    assert isinstance(p, LayerSkipProposer) and p.default_budget == 5 and p.n_skip == 2 and p.k == 3
    assert make(model, skip=2.0).n_skip == 2  # a whole float is a count
    r = leapdecode.generate(model, PROMPT, max_new_tokens=12, method="layerskip", options={"skip": 0.5})
    assert r.stats["layerskip_skip"] == 2 and len(r.stats["layerskip_skipped_layers"]) == 2
