"""``credit`` (CreditDecoding), ``localleap`` (LocalLeap) and ``adablock`` (AdaBlock-dLLM), and
``leapdecode generate`` routing a diffusion model to the diffusion decoders (issue 18).

None of the three is exact.  What is checked: each runs from the API and both CLIs on tiny LLaDA
and Dream models; at its degenerate setting (one token per step, no credit, fixed blocks) each is
stepwise decoding token for token (property-tested); at loose settings each equals the decoder
it reduces to (fast-dllm with the same threshold) where the paper's addition is switched off; each
needs fewer forwards than stepwise on a model whose confidences are high; the paper's mechanism
does what it claims on hand-built cases (credit crosses a threshold plain confidence never
reaches; relaxed commits next to anchors; blocks end at a predicted delimiter); planted errors
break the stepwise identity (the identity test can fail); bad options are typed errors (exit 2).
"""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leapdecode.cli import main
from leapdecode.diffusion import DIFFUSION_METHODS, generate
from leapdecode.diffusion import adablock, credit, localleap
from leapdecode.diffusion.common import Canvas, Counter, Greedy
from leapdecode.diffusion.configs import AdaBlockConfig, CreditConfig, LocalLeapConfig
from leapdecode.diffusion.tiny import TINY_MASK, TINY_VOCAB, tiny_model
from leapdecode.errors import InvalidParameterError

METHODS = ["credit", "localleap", "adablock"]
# the setting at which each reduces to stepwise decoding
DEGENERATE = {"credit": {"threshold": 1.0, "fusion": 0.0},
              "localleap": {"threshold": 1.0},
              "adablock": {"threshold": 1.0, "delimiter_threshold": 2.0}}
from helpers.diffusion import tiny_dllm as model

MODELS = {}  # confident() models, by (family, seed, scale)


def confident(family: str, seed: int = 1, scale: float = 8.0):
    """A tiny model whose output head is scaled up: the same greedy predictions at any canvas, but
    peaked distributions (median top-1 probability ~0.6 for llada, ~0.9 for dream at scale 8)."""
    key = (family, seed, scale)
    if key not in MODELS:
        m = tiny_model(family, seed=seed)
        with torch.no_grad():
            m.network.head.weight.mul_(scale)
        MODELS[key] = m
    return MODELS[key]


def run(m, prompt, method, gen_len, block, **options):
    return generate(m, prompt, method=method, options=options, max_new_tokens=gen_len, block_size=block)


def test_registered_not_exact():
    for name in METHODS:
        assert name in DIFFUSION_METHODS and DIFFUSION_METHODS[name].exact is False


# ------------------------------------------------------------------ degenerate settings = stepwise
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llada", "dream"]), seed=st.integers(0, 3),
       prompt=st.lists(st.integers(0, 258), min_size=1, max_size=8),
       gen_len=st.integers(1, 20), block=st.integers(1, 12))
def test_degenerate_settings_give_stepwise_tokens(family, seed, prompt, gen_len, block):
    m = model(family, seed)
    base = run(m, prompt, "stepwise", gen_len, block)
    for name in METHODS:
        res = run(m, prompt, name, gen_len, block, **DEGENERATE[name])
        assert res.canvas == base.canvas, name
        assert res.tokens == base.tokens and res.text == base.text
        assert res.stats["forwards"] == gen_len
        assert res.stats["committed_per_forward"] == [1] * gen_len
    assert TINY_MASK not in base.canvas


def test_localleap_relaxed_threshold_is_ignored_without_anchors():
    # threshold 1: no anchor ever, so the relaxed threshold cannot apply
    m = model("llada", 2)
    base = run(m, "def f(x):", "stepwise", 16, 8)
    res = run(m, "def f(x):", "localleap", 16, 8, threshold=1.0, relaxed_threshold=0.01, radius=16)
    assert res.canvas == base.canvas


def test_credit_with_fusion_reorders_at_threshold_one():
    # the credit itself changes which position commits (else the identity above proves little)
    differs = 0
    for family in ("llada", "dream"):
        for seed in range(3):
            m = model(family, seed)
            base = run(m, "def fib(n):", "stepwise", 20, 7)
            res = run(m, "def fib(n):", "credit", 20, 7, threshold=1.0)
            assert res.stats["forwards"] == 20
            differs += res.canvas != base.canvas
    assert differs >= 2


@pytest.mark.parametrize("name", ["localleap", "adablock"])
def test_planted_error_breaks_the_identity(name, monkeypatch):
    """Least confident first instead of most: the stepwise identity must fail."""
    from leapdecode.diffusion import common

    def wrong(confidence, masked):
        return common.ranked_masked(-confidence, masked)

    monkeypatch.setattr(localleap if name == "localleap" else adablock, "ranked_masked", wrong)
    m = model("llada", 1)
    base = run(m, "def fib(n):", "stepwise", 12, 6)
    assert run(m, "def fib(n):", name, 12, 6, **DEGENERATE[name]).canvas != base.canvas


def test_planted_credit_on_the_wrong_token_breaks_the_fusion(monkeypatch):
    """Credit given to the second-best token instead of the top-1 changes the output."""
    m = model("dream", 0)
    good = run(m, "def fib(n):", "credit", 20, 7, threshold=1.0, fusion=2.0)

    def wrong(credit_table, raw, rows, decay, alpha):
        credit_table.mul_(decay)
        credit_table[rows, (raw.tokens[rows] + 1) % TINY_VOCAB] += raw.confidence[rows].pow(alpha)

    monkeypatch.setattr(credit, "add_credit", wrong)
    assert run(m, "def fib(n):", "credit", 20, 7, threshold=1.0, fusion=2.0).canvas != good.canvas


# ------------------------------------------------------------- loose settings, paper's part switched off
@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.9])
def test_without_their_addition_they_are_fast_dllm(family, threshold):
    m = confident(family) if threshold == 0.9 else model(family, 1)
    ref = run(m, "def fib(n):", "fast-dllm", 24, 8, threshold=threshold)
    for name, opts in (("credit", {"threshold": threshold, "fusion": 0.0}),
                       ("localleap", {"threshold": threshold, "relaxed_threshold": threshold}),
                       ("adablock", {"threshold": threshold, "delimiter_ids": []})):
        res = run(m, "def fib(n):", name, 24, 8, **opts)
        assert res.canvas == ref.canvas, name
        assert res.stats["forwards"] == ref.stats["forwards"], name


# ------------------------------------------------------------------------- fewer forwards when confident
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_fewer_forwards_than_stepwise_on_a_confident_model(family):
    m = confident(family)
    base = run(m, "def fib(n):", "stepwise", 24, 8)
    assert base.stats["forwards"] == 24
    for name in METHODS:
        res = run(m, "def fib(n):", name, 24, 8)  # the papers' default thresholds
        assert res.stats["forwards"] < base.stats["forwards"], name
        assert sum(res.stats["committed_per_forward"]) == 24
        assert TINY_MASK not in res.canvas and len(res.canvas) == 24


# ------------------------------------------------------------------------------ hand-built mechanisms
class FixedNet:
    """A stand-in network whose logits do not depend on the canvas: ``logits[i]`` at every row."""

    shift = False

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def predict(self, x: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        return self.logits.unsqueeze(0).expand(x.shape[0], -1, -1).clone()


def peaked(length: int, vocab: int, token: int, p: float) -> torch.Tensor:
    """Logits whose top-1 is ``token`` with probability ``p`` (the mask token excluded), the rest uniform."""
    others = vocab - 2  # every token but ``token`` and the mask
    logits = torch.zeros(length, vocab, dtype=torch.float64)
    logits[:, token] = torch.log(torch.tensor(p * others / (1 - p), dtype=torch.float64))
    return logits


def test_credit_crosses_a_threshold_plain_confidence_never_reaches():
    """top-1 probability 0.6 everywhere, threshold 0.7: fast-dllm commits one per step; with credit,
    C = 0.6**0.5 after step 1 (fused p ~0.67 < 0.7: one commit), C = 0.6**0.5 * (1 + 0.65) after
    step 2 (fused p ~0.73 > 0.7): every remaining position commits."""
    n, vocab, mask = 8, 16, 15
    logits = peaked(n + 2, vocab, 5, 0.6)
    cfg = CreditConfig(threshold=0.7)
    c = 0.6 ** 0.5
    for credit_value, expect_above in ((c, False), (c * 1.65, True)):
        table = torch.zeros(1, vocab, dtype=torch.float64)
        table[0, 5] = credit_value
        fused = credit.fuse(logits[:1], table, cfg.fusion, mask)
        boosted = 21.0 * (1 + credit_value) ** 0.7  # exp(logit + 0.7 log(1 + C)); the 14 others weigh 1 each
        assert int(fused.tokens[0]) == 5
        assert float(fused.confidence[0]) == pytest.approx(boosted / (boosted + 14), rel=1e-12)
        assert (float(fused.confidence[0]) > 0.7) is expect_above

    def decode(method, cfg):
        canvas = Canvas.start([1, 2], n, n, mask)
        fwd = Counter(FixedNet(logits))
        stats = {}
        method.decode(canvas, fwd, cfg, stats) if method is credit else method.decode(canvas, fwd, cfg)
        return canvas, fwd, stats

    from leapdecode.diffusion import fast_dllm
    from leapdecode.diffusion.configs import FastDllmConfig

    canvas, fwd, stats = decode(credit, cfg)
    assert canvas.answer == [5] * n and fwd.forwards == 2 and stats["committed_per_forward"] == [1, n - 1]
    canvas, fwd, _ = decode(fast_dllm, FastDllmConfig(threshold=0.7))
    assert canvas.answer == [5] * n and fwd.forwards == n
    canvas, fwd, stats = decode(credit, CreditConfig(threshold=0.7, fusion=0.0))
    assert fwd.forwards == n


def test_credit_decays_and_accumulates():
    table = torch.zeros(3, 4, dtype=torch.float64)
    raw = Greedy(torch.tensor([1, 2, 3]), torch.tensor([0.25, 0.64, 0.81], dtype=torch.float64))
    rows = torch.tensor([0, 2])  # row 1 is committed: no credit
    credit.add_credit(table, raw, rows, 0.5, 0.5)
    credit.add_credit(table, raw, rows, 0.5, 0.5)
    expect = torch.zeros(3, 4, dtype=torch.float64)
    expect[0, 1] = 0.5 * 1.5
    expect[2, 3] = 0.9 * 1.5
    assert torch.allclose(table, expect)


def test_localleap_selection_by_hand():
    conf = torch.tensor([0.0, 0.2, 0.95, 0.8, 0.7, 0.5, 0.8, 0.3, 0.85, 0.1], dtype=torch.float64)
    pred = Greedy(torch.arange(10), conf)
    masked = torch.ones(10, dtype=torch.bool)
    masked[0] = False
    cfg = LocalLeapConfig(threshold=0.9, relaxed_threshold=0.75, radius=2)
    # anchor 2 (0.95); within 2 of it (0..4): 3 (0.8) passes 0.75, 4 (0.7) does not; 6 and 8 are
    # outside the radius and below 0.9
    assert sorted(localleap.select(pred, masked, cfg).tolist()) == [2, 3]
    wide = LocalLeapConfig(threshold=0.9, relaxed_threshold=0.75, radius=6)
    assert sorted(localleap.select(pred, masked, wide).tolist()) == [2, 3, 6, 8]
    none = LocalLeapConfig(threshold=0.99, relaxed_threshold=0.5, radius=9)  # no anchor: only the top one
    assert localleap.select(pred, masked, none).tolist() == [2]


def test_adablock_block_length_by_hand():
    L, start = 40, 10
    tokens = torch.full((L,), 7)
    conf = torch.full((L,), 0.5, dtype=torch.float64)
    tokens[14], conf[14] = 198, 0.4
    tokens[17], conf[17] = 198, 0.6
    tokens[30], conf[30] = 198, 0.99  # outside the window
    pred = Greedy(tokens, conf)
    cfg = AdaBlockConfig(delimiter_threshold=0.3)  # window 0.25 * 32 = 8 positions: 10..17
    assert adablock.block_length(pred, start, 30, 32, 4, cfg) == 8  # up to and including position 17
    assert adablock.block_length(pred, start, 30, 32, 4, AdaBlockConfig(delimiter_threshold=0.7)) == 4
    assert adablock.block_length(pred, start, 3, 32, 4, cfg) == 3  # window capped by what is left
    assert adablock.block_length(pred, start, 30, 32, 4, AdaBlockConfig(delimiter_ids=[7])) == 1
    assert adablock.block_length(pred, start, 30, 32, 4, AdaBlockConfig(delimiter_ids=[])) == 4


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_adablock_adapts_and_each_block_is_stepwise(family):
    """Every token a delimiter at threshold 0: blocks end at the most confident prediction of the
    window, so they vary; at threshold 1 the output is stepwise decoding over those blocks."""
    m = model(family, 1)
    res = run(m, "def fib(n):", "adablock", 24, 6, threshold=1.0, delimiter_threshold=0.0,
              delimiter_ids=list(range(TINY_VOCAB)))
    lengths = res.stats["block_lengths"]
    assert sum(lengths) == 24 and len(set(lengths)) > 1 and res.stats["forwards"] == 24
    # stepwise decoding with those block boundaries, written here
    ids = list(m.tokenizer("def fib(n):", add_special_tokens=False)["input_ids"])
    x = torch.tensor(ids + [TINY_MASK] * 24)
    start = len(ids)
    with torch.inference_mode():
        for n in lengths:
            for _ in range(n):
                pred = Greedy.of(m.network.predict(x.unsqueeze(0))[0], TINY_MASK)
                conf = torch.where(x == TINY_MASK, pred.confidence, torch.tensor(-1.0, dtype=torch.float64))
                conf[: start] = -1.0
                conf[start + n :] = -1.0
                best = int(conf.argmax())
                x[best] = pred.tokens[best]
            start += n
    assert res.canvas == x[len(ids):].tolist()


# -------------------------------------------------------------------------------------- API and CLIs
@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("name", METHODS)
def test_api_and_both_clis_agree(family, name, capsys):
    options = {"threshold": 0.3, "relaxed_threshold": 0.1} if name == "localleap" else {"threshold": 0.3}
    api = generate(f"tiny-{family}:1", "Hello", method=name, max_new_tokens=10, block_size=5, options=options)
    assert api.stats["method"] == name and 1 <= api.stats["forwards"] <= 10
    for argv in (["diffusion", "generate"], ["generate"]):
        opts = [a for k, v in options.items() for a in ("--option", f"{k}={v}")]
        rc = main(argv + ["-m", f"tiny-{family}:1", "--method", name, *opts,
                          "--max-new-tokens", "10", "--block-size", "5", "--json", "Hello"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        assert out["tokens"] == api.tokens and out["text"] == api.text
        assert out["stats"]["forwards"] == api.stats["forwards"] and out["stats"]["method"] == name


def test_generate_routes_a_diffusion_model_with_stepwise_by_default(capsys):
    assert main(["generate", "-m", "tiny-llada", "--max-new-tokens", "4", "--block-size", "2", "--stats", "x"]) == 0
    err = capsys.readouterr().err
    assert "method=stepwise" in err and "forwards=4" in err and "block_size=2" in err


def test_bad_options_are_typed_errors(capsys):
    bad = [("credit", {"threshold": 0.0}), ("credit", {"threshold": 1.5}), ("credit", {"decay": 2.0}),
           ("credit", {"fusion": -1.0}), ("credit", {"alpha": 0.0}), ("credit", {"nope": 1}),
           ("localleap", {"relaxed_threshold": 0.95}), ("localleap", {"radius": -1}),
           ("localleap", {"radius": 1.5}), ("adablock", {"delimiter_ids": ["\n"]}),
           ("adablock", {"delimiter_ids": [True]}), ("adablock", {"window": 0.0}),
           ("adablock", {"delimiter_threshold": -0.1}), ("adablock", {"threshold": float("nan")})]
    for name, opts in bad:
        with pytest.raises(InvalidParameterError):
            generate("tiny-llada", "x", method=name, options=opts, max_new_tokens=2)
    cases = [
        (["generate", "-m", "tiny-llada", "--method", "credit", "--option", "decay=7", "x"], "decay"),
        (["generate", "-m", "tiny-llada", "--method", "adablock", "--option", "delimiter_ids=newline", "x"],
         "delimiter_ids"),
        (["diffusion", "generate", "-m", "tiny-dream", "--method", "localleap", "--option", "radius=x", "x"],
         "radius"),
        (["generate", "-m", "tiny-dream", "--method", "pld", "x"], "causal-LM"),
        (["generate", "-m", "smollm2-135m", "--method", "credit", "x"], "diffusion-LM method"),
        (["generate", "-m", "tiny-llada", "--temperature", "0.5", "--stop", "a", "x"], "--temperature, --stop"),
        (["generate", "-m", "smollm2-135m", "--block-size", "4", "x"], "--block-size"),
        (["chat", "-m", "smollm2-135m", "--method", "localleap"], "diffusion-LM method"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        assert needle in capsys.readouterr().err, argv
