"""``s2d2`` (issue 18): self-speculative decoding, the same model drafting in parallel and
verifying in block-size-one mode.

Not exact against ``stepwise`` at the same block size (registered ``exact=False``), but two
degenerate settings are exact by construction and tested as identities: never verifying at
``threshold=1`` is ``stepwise`` (one most-confident token per step), and verifying every step
(``policy=span, min_span=1``, ``threshold=1``) commits exactly the tokens of ``stepwise`` with
``block_size=1`` (the model's own left-to-right decoding), in fewer forwards when drafts are
accepted.  A planted error in the verifier breaks that identity; a confident model built here
shows the saving in forwards.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leapdecode.cli import main
from leapdecode.diffusion import DIFFUSION_METHODS, generate
from leapdecode.diffusion.tiny import TINY_MASK
from leapdecode.errors import InvalidParameterError

from helpers.diffusion import CONFIDENT_TOKEN, confident_dllm as confident, run_dllm as run, tiny_dllm as model


def test_registered_as_not_exact():
    spec = DIFFUSION_METHODS["s2d2"]
    assert spec.exact is False and spec.config.method == "s2d2"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llada", "dream"]), seed=st.integers(0, 3),
       prompt=st.lists(st.integers(0, 258), min_size=1, max_size=6),
       gen_len=st.integers(1, 16), block=st.integers(1, 10))
def test_degenerate_settings_are_stepwise(family, seed, prompt, gen_len, block):
    m = model(family, seed)
    base = run(m, prompt, "stepwise", gen_len, block)
    never = run(m, prompt, "s2d2", gen_len, block, policy="never", threshold=1.0)
    assert never.canvas == base.canvas and never.stats["forwards"] == gen_len
    assert never.stats["committed_per_verification"] == []
    b1 = run(m, prompt, "stepwise", gen_len, 1)
    always = run(m, prompt, "s2d2", gen_len, block, policy="span", min_span=1, threshold=1.0)
    assert always.canvas == b1.canvas
    assert TINY_MASK not in always.canvas
    # every step drafts then verifies: two forwards per step, the rest committed by verification
    verified = always.stats["committed_per_verification"]
    assert sum(verified) == gen_len and all(v >= 1 for v in verified)
    assert always.stats["forwards"] == 2 * len(verified) == 2 * always.stats["denoise_steps"]


def test_a_planted_verifier_error_breaks_the_identity(monkeypatch):
    """If the verifier skipped the span's first position, its tokens would no longer be the
    block-size-one decoding's: the identity above is able to fail."""
    import leapdecode.diffusion.s2d2 as s2d2_mod

    real = s2d2_mod.first_span
    m = model("llada", 1)
    b1 = run(m, "Hello world", "stepwise", 16, 1)
    good = run(m, "Hello world", "s2d2", 16, 8, policy="span", threshold=1.0)
    assert good.canvas == b1.canvas
    monkeypatch.setattr(s2d2_mod, "first_span", lambda masked, s, e: real(masked, s, e)[::-1])
    bad = run(m, "Hello world", "s2d2", 16, 8, policy="span", threshold=1.0)
    assert bad.canvas != b1.canvas


def test_verification_saves_forwards_where_the_drafts_are_confident():
    for family in ("llada", "dream"):
        m = confident(family)
        base = run(m, "abc", "stepwise", 24, 8)
        assert base.canvas == [CONFIDENT_TOKEN] * 24
        # threshold 1 disables confidence commits: every saving below comes from verification
        res = run(m, "abc", "s2d2", 24, 8, threshold=1.0)
        assert res.canvas == base.canvas
        assert res.stats["committed_per_verification"] == [8, 8, 8]  # the score policy verified each block
        assert res.stats["forwards"] == 6 < base.stats["forwards"] == 24
        # and on random weights the score policy declines (high entropy: E[accepted] < penalty)
        rand = run(model(family, 1), "abc", "s2d2", 24, 8, threshold=1.0)
        assert rand.stats["committed_per_verification"] == [] and rand.stats["forwards"] == 24


def test_score_policy_options_change_the_decision():
    m = model("dream", 2)
    never = run(m, "xyz", "s2d2", 12, 6, threshold=1.0, score_threshold=1e9)
    assert never.stats["committed_per_verification"] == []
    always = run(m, "xyz", "s2d2", 12, 6, threshold=1.0, penalty=0.0, score_threshold=0.0)
    assert len(always.stats["committed_per_verification"]) == always.stats["denoise_steps"]
    dynamic = run(m, "xyz", "s2d2", 12, 6, threshold=1.0, score_type="dynamic", penalty=0.0)
    assert dynamic.canvas == always.canvas  # nothing above threshold 1: the same score
    span = run(m, "xyz", "s2d2", 12, 6, threshold=1.0, policy="span", min_span=7)
    assert span.stats["committed_per_verification"] == []  # no span of a 6-block reaches 7
    # hysteresis: never switched on above an unreachable score; once on below any score, always on
    off = run(m, "xyz", "s2d2", 12, 6, threshold=1.0, policy="hysteresis", hysteresis_on=1e9)
    assert off.stats["committed_per_verification"] == []
    on = run(m, "xyz", "s2d2", 12, 6, threshold=1.0, policy="hysteresis", hysteresis_on=-1e9, hysteresis_off=-2e9)
    assert on.canvas == always.canvas
    assert len(on.stats["committed_per_verification"]) == on.stats["denoise_steps"]


def test_hysteresis_keeps_verifying_until_the_score_drops_below_off():
    """The reference's score_hysteresis rule, on a score sequence fed by hand."""
    from leapdecode.diffusion import s2d2 as s2d2_mod
    from leapdecode.diffusion.configs import S2d2Config

    cfg = S2d2Config(policy="hysteresis", hysteresis_on=1.0, hysteresis_off=-1.0)
    scores = iter([0.5, 1.5, 0.0, -0.5, -1.5, 0.5, 2.0])
    real = s2d2_mod.verify_score
    try:
        s2d2_mod.verify_score = lambda *a: next(scores)
        state: dict = {}
        got = [s2d2_mod.should_verify(cfg, None, None, None, [0], state) for _ in range(7)]
    finally:
        s2d2_mod.verify_score = real
    assert got == [False, True, True, True, False, False, True]


def test_bad_options_are_typed_errors():
    m = model("llada", 0)
    for options, name in (({"policy": "sometimes"}, "policy"), ({"min_span": 0}, "min_span"),
                          ({"threshold": 0.0}, "threshold"), ({"threshold": 1.5}, "threshold"),
                          ({"score_type": "both"}, "score_type"), ({"penalty": -1.0}, "penalty"),
                          ({"hysteresis_on": -2.0}, "hysteresis_on"),
                          ({"max_draft": 3}, "max_draft")):
        with pytest.raises(InvalidParameterError, match=name):
            generate(m, "x", method="s2d2", options=options)


def test_cli_matches_the_api(capsys):
    for family in ("llada", "dream"):
        rc = main(["diffusion", "generate", "-m", f"tiny-{family}:1", "--method", "s2d2", "--option", "policy=span",
                   "--option", "threshold=1.0", "--max-new-tokens", "10", "--block-size", "5", "--json", "Hello"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        ref = generate(f"tiny-{family}:1", "Hello", method="s2d2", options={"policy": "span", "threshold": 1.0},
                       max_new_tokens=10, block_size=5)
        assert out["tokens"] == ref.tokens and out["stats"]["method"] == "s2d2"
        assert out["stats"]["forwards"] == ref.stats["forwards"]
    assert main(["diffusion", "generate", "-m", "tiny-llada", "--method", "s2d2", "--option", "policy=x", "x"]) == 2
    assert "policy" in capsys.readouterr().err
