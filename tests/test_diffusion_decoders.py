"""Diffusion decoders (issue 18) on tiny random LLaDA / Dream models.

The contract of the exact decoders: ``ssd`` and ``freedave`` give stepwise decoding's tokens,
every one, in no more forwards; property-tested over random models, prompts, block sizes, answer
lengths and schedules.  A planted error in the selection rule must break the identity (the test
can fail).  The lossy decoders are checked where their output is known: fast-dllm at threshold 1
is stepwise decoding, prophet with an infinite gap is stepwise and with a zero gap commits the
first forward's predictions.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leapdecode.diffusion import DIFFUSION_METHODS, generate, load
from leapdecode.diffusion.common import Canvas, Counter, Greedy
from leapdecode.diffusion.configs import FreeDaveConfig, SsdConfig, StepwiseConfig
from leapdecode.diffusion.tiny import TINY_MASK
from leapdecode.errors import InvalidParameterError

from helpers.diffusion import tiny_dllm as model


def run(family, seed, prompt, method, gen_len, block, **options):
    return generate(model(family, seed), prompt, method=method, options=options, max_new_tokens=gen_len,
                    block_size=block)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llada", "dream"]), seed=st.integers(0, 3),
       prompt=st.lists(st.integers(0, 258), min_size=1, max_size=8),
       gen_len=st.integers(1, 20), block=st.integers(1, 12), max_draft=st.integers(1, 6),
       draft_steps=st.integers(1, 6))
def test_ssd_and_freedave_give_stepwise_tokens_in_no_more_forwards(family, seed, prompt, gen_len, block,
                                                                   max_draft, draft_steps):
    base = run(family, seed, prompt, "stepwise", gen_len, block)
    ssd = run(family, seed, prompt, "ssd", gen_len, block, max_draft=max_draft)
    fd = run(family, seed, prompt, "freedave", gen_len, block, draft_steps=draft_steps)
    assert ssd.canvas == base.canvas
    assert fd.canvas == base.canvas
    assert ssd.text == base.text and fd.tokens == base.tokens
    assert ssd.stats["forwards"] <= base.stats["forwards"] == gen_len
    assert fd.stats["forwards"] <= base.stats["forwards"]
    assert sum(ssd.stats["accepted_per_forward"]) == gen_len
    assert TINY_MASK not in base.canvas


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llada", "dream"]), seed=st.integers(0, 3),
       prompt=st.lists(st.integers(0, 258), min_size=1, max_size=6),
       gen_len=st.integers(2, 24), block=st.integers(2, 12), steps=st.integers(1, 24),
       draft_steps=st.integers(1, 5))
def test_freedave_gives_stepwise_tokens_at_any_schedule(family, seed, prompt, gen_len, block, steps, draft_steps):
    base = run(family, seed, prompt, "stepwise", gen_len, block, steps=steps)
    fd = run(family, seed, prompt, "freedave", gen_len, block, steps=steps, draft_steps=draft_steps)
    assert fd.canvas == base.canvas
    assert fd.stats["forwards"] <= base.stats["forwards"]


def test_the_exact_decoders_save_forwards():
    """Not only never more: on these models they save forwards (measured, then compared)."""
    for family in ("llada", "dream"):
        base = run(family, 1, "Hello world", "stepwise", 32, 8)
        for method in ("ssd", "freedave"):
            res = run(family, 1, "Hello world", method, 32, 8)
            assert res.canvas == base.canvas
            assert res.stats["forwards"] < base.stats["forwards"], (family, method, res.stats)


def test_a_planted_selection_error_breaks_the_identity(monkeypatch):
    """If ssd's verifier used another order than stepwise's, the outputs would differ: the identity
    test above is able to fail."""
    import leapdecode.diffusion.ssd as ssd_mod
    from leapdecode.diffusion.common import ranked_masked

    base = run("llada", 1, "Hello world", "stepwise", 24, 8)
    monkeypatch.setattr(ssd_mod, "ranked_masked", lambda conf, masked: ranked_masked(-conf, masked))
    bad = run("llada", 1, "Hello world", "ssd", 24, 8)
    assert bad.canvas != base.canvas


def test_fast_dllm_at_threshold_one_is_stepwise_and_low_threshold_is_parallel():
    for family in ("llada", "dream"):
        base = run(family, 2, "abc", "stepwise", 16, 8)
        one = run(family, 2, "abc", "fast-dllm", 16, 8, threshold=1.0)
        assert one.canvas == base.canvas and one.stats["forwards"] == 16
        par = run(family, 2, "abc", "fast-dllm", 16, 8, threshold=1e-9)
        assert par.stats["forwards"] == 2  # every masked position of a block in one step
        assert TINY_MASK not in par.canvas
        for cache in ("prefix", "dual"):
            cached = run(family, 2, "abc", "fast-dllm", 16, 8, threshold=1e-9, cache=cache)
            # a whole block per step: the first forward of each block is a full one, so the same tokens
            assert cached.canvas == par.canvas
            approx = run(family, 2, "abc", "fast-dllm", 16, 8, threshold=0.05, cache=cache)
            assert TINY_MASK not in approx.canvas and approx.stats["forwards"] <= 16


def test_prophet_gap_extremes():
    m = model("dream", 0)
    base = run("dream", 0, "xyz", "stepwise", 12, 4)
    never = run("dream", 0, "xyz", "prophet", 12, 4, gap_early=1e9, gap_mid=1e9, gap_late=1e9)
    assert never.canvas == base.canvas and "early_commit_step" not in never.stats
    now = run("dream", 0, "xyz", "prophet", 12, 4, gap_early=0.0)
    assert now.stats["forwards"] == 1 and now.stats["early_commit_step"] == 1
    ids = m.tokenizer("xyz", add_special_tokens=False)["input_ids"]
    canvas = Canvas.start(ids, 12, 4, TINY_MASK)
    first = Greedy.of(Counter(m.network).predict(canvas.x)[0], TINY_MASK)
    assert now.canvas == first.tokens[len(ids):].tolist()


def test_results_and_stats():
    res = run("llada", 0, "Hi", "ssd", 20, 5)
    tok = model("llada", 0).tokenizer
    assert res.text == tok.decode(res.tokens, skip_special_tokens=True)
    assert len(res.canvas) == 20 and res.tokens == res.canvas[: len(res.tokens)]
    s = res.stats
    assert s["method"] == "ssd" and s["rows"] >= s["forwards"] >= 1
    assert s["tokens_per_forward"] == pytest.approx(20 / s["forwards"])
    assert s["wall_s"] > 0
    # chat messages and token ids are prompts too
    ids = tok("Hi", add_special_tokens=False)["input_ids"]
    assert run("llada", 0, ids, "stepwise", 6, 3).canvas == run("llada", 0, "Hi", "stepwise", 6, 3).canvas
    chat = generate(model("llada", 0), [{"role": "user", "content": "Hi"}], max_new_tokens=4, block_size=4)
    assert chat.stats["prompt_tokens"] > len(ids)


def test_configs_and_errors():
    from leapdecode.models.tiny import tiny_loaded

    # the eleven decoders; exact ones are those whose output is stepwise decoding's
    assert set(DIFFUSION_METHODS) == {"stepwise", "fast-dllm", "prophet", "ssd", "freedave", "credit", "localleap",
                                      "adablock", "s2d2", "elastic-cache", "apd"}
    assert {n for n, m in DIFFUSION_METHODS.items() if m.exact} == {"stepwise", "ssd", "freedave"}
    m = model("llada", 0)
    with pytest.raises(InvalidParameterError, match="causal-LM"):
        generate(m, "x", method="draft")
    with pytest.raises(InvalidParameterError, match="unknown diffusion method"):
        generate(m, "x", method="nope")
    with pytest.raises(InvalidParameterError, match="no option"):
        generate(m, "x", method="ssd", options={"draft_len": 3})
    with pytest.raises(InvalidParameterError, match="threshold"):
        generate(m, "x", method="fast-dllm", options={"threshold": 1.5})
    with pytest.raises(InvalidParameterError, match="cache"):
        generate(m, "x", method="fast-dllm", options={"cache": "full"})
    with pytest.raises(InvalidParameterError, match="block_size"):
        generate(m, "x", block_size=0)
    with pytest.raises(InvalidParameterError, match="causal LM"):
        generate(tiny_loaded(), "x")
    with pytest.raises(InvalidParameterError, match="empty"):
        generate(m, "")
    # a config object works as the method
    a = generate(m, "x", method=SsdConfig(max_draft=2), max_new_tokens=6, block_size=3)
    b = generate(m, "x", method=StepwiseConfig(), max_new_tokens=6, block_size=3)
    assert a.canvas == b.canvas
    assert FreeDaveConfig.from_options({"draft_steps": 2}).draft_steps == 2


def test_exact_in_bf16_too():
    m = load("tiny-dream:2", dtype=torch.bfloat16)
    base = generate(m, "bf16", method="stepwise", max_new_tokens=16, block_size=8)
    for method in ("ssd", "freedave"):
        res = generate(m, "bf16", method=method, max_new_tokens=16, block_size=8)
        assert res.canvas == base.canvas and res.stats["forwards"] <= 16


def test_a_canvas_longer_than_the_model_is_a_typed_error():
    from leapdecode.errors import PromptTooLongError

    m = model("llada", 0)
    with pytest.raises(PromptTooLongError):
        generate(m, "x", max_new_tokens=m.network.max_seq_len)
