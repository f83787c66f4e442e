"""``apd`` (issue 18): adaptive parallel decoding, drafts from the dLLM's marginals accepted while
they match the multiplicative mixture ``p_D^R * p_AR^(1-R)`` with a small autoregressive helper.

Not exact against ``stepwise`` (registered ``exact=False``).  Tested: ``weight=1`` with one token
per step is ``stepwise`` at block size 1 token for token (no helper needed); ``weight=0`` is the
helper's own greedy decoding (compared with ``leapdecode.generate``'s vanilla decoding of the
helper); where the helper agrees with a confident dLLM (built here) every draft is accepted and
the forwards drop to one per block, and a disagreeing helper forces single commits.
"""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leapdecode
from leapdecode.cli import main
from leapdecode.diffusion import DIFFUSION_METHODS, generate
from leapdecode.diffusion.tiny import TINY_MASK
from leapdecode.errors import InvalidParameterError, UnknownModelError
from leapdecode.models.tiny import tiny_loaded

from helpers.diffusion import CONFIDENT_TOKEN, confident_dllm as confident, tiny_dllm as model


def run(m, prompt, gen_len, block, method="apd", **options):
    return generate(m, prompt, method=method, options=options, max_new_tokens=gen_len, block_size=block)


def test_registered_as_not_exact():
    assert DIFFUSION_METHODS["apd"].exact is False


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llada", "dream"]), seed=st.integers(0, 3),
       prompt=st.lists(st.integers(0, 258), min_size=1, max_size=6),
       gen_len=st.integers(1, 16), block=st.integers(1, 10))
def test_dllm_alone_one_token_per_step_is_stepwise_at_block_size_one(family, seed, prompt, gen_len, block):
    m = model(family, seed)
    b1 = run(m, prompt, gen_len, 1, method="stepwise")
    res = run(m, prompt, gen_len, block, weight=1.0, max_parallel=1)
    assert res.canvas == b1.canvas and res.stats["forwards"] == gen_len
    assert res.stats["helper_forwards"] == 0  # weight 1 never runs (nor loads) a helper
    # all drafts accepted at weight 1: one forward per block
    par = run(m, prompt, gen_len, block, weight=1.0)
    assert par.stats["forwards"] == len(range(0, gen_len, block)) and TINY_MASK not in par.canvas


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_helper_alone_is_the_helpers_greedy_decoding(family):
    helper = leapdecode.load("tiny-random:0", dtype=torch.float32, device="cpu")
    ids = helper.tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    ref = leapdecode.generate(helper, prompt_ids=ids, method="vanilla", max_new_tokens=20)
    assert len(ref.tokens) == 20  # no early end of sequence: the whole answer is compared
    res = run(model(family, 1), ids, 20, 8, helper="tiny-random:0", weight=0.0)
    assert res.canvas == ref.tokens
    assert res.stats["helper_forwards"] == res.stats["forwards"] == 20  # the first target differs every step


def test_agreement_sets_the_number_of_parallel_commits(monkeypatch):
    import leapdecode.diffusion.apd as apd_mod

    uniform = tiny_loaded("tiny-random:uniform", seed=0)
    with torch.no_grad():
        uniform.model.norm.zero_()  # zero hidden state: uniform next-token distribution, no opinion
    monkeypatch.setattr(apd_mod, "load_helper", lambda name, dtype, device: uniform)
    for family in ("llada", "dream"):
        m = confident(family)
        base = run(m, "abc", 24, 8, method="stepwise")
        res = run(m, "abc", 24, 8, helper="uniform", weight=0.7)
        assert res.canvas == base.canvas == [CONFIDENT_TOKEN] * 24
        assert res.stats["committed_per_step"] == [8, 8, 8] and res.stats["forwards"] == 3 < 24
        capped = run(m, "abc", 24, 8, helper="uniform", weight=0.7, max_parallel=3)
        assert capped.stats["committed_per_step"] == [3, 3, 2] * 3
    # a helper that disagrees with every draft (a random one, weight near 0): one token per step
    monkeypatch.setattr(apd_mod, "load_helper", lambda name, dtype, device: tiny_loaded("tiny-random:1", seed=1))
    res = run(confident("llada"), "abc", 16, 8, helper="random", weight=0.01)
    assert res.stats["forwards"] == 16 and CONFIDENT_TOKEN not in res.canvas[:4]


def test_max_lookahead_cuts_the_canvas():
    m = model("dream", 2)
    full = run(m, "xyz", 12, 12, weight=1.0, max_parallel=1)
    cut = run(m, "xyz", 12, 12, weight=1.0, max_parallel=1, max_lookahead=2)
    assert TINY_MASK not in cut.canvas and cut.stats["forwards"] == 12
    assert cut.canvas != full.canvas  # the dLLM sees 2 masked positions, not the whole answer
    par = run(m, "xyz", 12, 12, weight=1.0, max_lookahead=4)
    assert par.stats["committed_per_step"] == [4, 4, 4]  # drafts stop where the canvas is cut


def test_bad_options_are_typed_errors():
    m = model("llada", 0)
    for options, name in (({"weight": 1.5}, "weight"), ({"weight": -0.1}, "weight"),
                          ({"max_parallel": 0}, "max_parallel"), ({"max_lookahead": 0}, "max_lookahead"),
                          ({"helper_weight": 1}, "helper_weight")):
        with pytest.raises(InvalidParameterError, match=name):
            generate(m, "x", method="apd", options=options)
    with pytest.raises(InvalidParameterError, match="helper"):
        generate(m, "x", method="apd", max_new_tokens=4, block_size=4)  # weight < 1 needs a helper
    with pytest.raises(UnknownModelError):
        generate(m, "x", method="apd", options={"helper": "tiny-random:x"}, max_new_tokens=4, block_size=4)


def test_cli_matches_the_api(capsys):
    for family in ("llada", "dream"):
        rc = main(["diffusion", "generate", "-m", f"tiny-{family}:1", "--method", "apd", "--option",
                   "helper=tiny-random:0", "--option", "weight=0.5", "--max-new-tokens", "10", "--block-size", "5",
                   "--json", "Hello"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        ref = generate(f"tiny-{family}:1", "Hello", method="apd", options={"helper": "tiny-random:0", "weight": 0.5},
                       max_new_tokens=10, block_size=5)
        assert out["tokens"] == ref.tokens and out["stats"]["method"] == "apd"
        assert out["stats"]["committed_per_step"] == ref.stats["committed_per_step"]
    assert main(["diffusion", "generate", "-m", "tiny-llada", "--method", "apd", "x"]) == 2
    assert "helper" in capsys.readouterr().err
