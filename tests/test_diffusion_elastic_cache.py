"""``elastic-cache`` (issue 18): KV cache refreshed when the tracked token's attention drifts,
from the next layer onward.

Not exact (registered ``exact=False``): cached keys/values go stale by design.  Tested here: the
cached forward itself (queries for a few rows against cached keys/values of the others) gives the
full forward's logits when nothing is stale, and a wrong rope position in it would not; with
``refresh=always``, ``threshold=1`` and a window covering the block it is ``stepwise`` token for
token; ``gamma=0`` (the drift test never fires) is ``refresh=block``; the drift test does fire and
recomputes from a boundary layer; a confident model built here takes fewer forwards.
"""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leapdecode.cli import main
from leapdecode.diffusion import DIFFUSION_METHODS, generate, load
from leapdecode.diffusion.tiny import TINY_MASK, tiny_model
from leapdecode.errors import InvalidParameterError

from helpers.diffusion import CONFIDENT_TOKEN, confident_dllm as confident, run_dllm as run, tiny_dllm as model


def test_registered_as_not_exact():
    assert DIFFUSION_METHODS["elastic-cache"].exact is False


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_cached_forward_is_the_full_forward_when_nothing_is_stale(family):
    from leapdecode.diffusion import elastic_cache as ec

    net = tiny_model(family, seed=3).network  # its own copy: the planted error below edits it
    x = torch.randint(0, 259, (20,), generator=torch.Generator().manual_seed(0))
    x[12:] = TINY_MASK
    full = net.predict(x)[0]
    cache = ec.LayerCache(net)
    rows_all = torch.arange(20)
    ec.forward_step(cache, x, rows_all, rows_all, 0, 0.9, drift_test=False)  # fills the cache
    window = torch.tensor([12, 13, 15])
    window_rows = window - int(net.shift)
    rows = torch.unique(torch.cat((window, window_rows, torch.tensor([2]))))
    raw, started, work = ec.forward_step(cache, x, rows, window_rows, None, 0.9, drift_test=False)
    assert started is None and work == len(rows) * len(net.blocks)
    assert torch.allclose(raw, full[window], atol=1e-5, rtol=1e-5)
    # planted error: the cached rows' rope positions off by one -> different logits (the check can fail)
    net.rope_cos, net.rope_sin = torch.roll(net.rope_cos, 1, dims=0), torch.roll(net.rope_sin, 1, dims=0)
    bad, _, _ = ec.forward_step(cache, x, rows, window_rows, None, 0.9, drift_test=False)
    assert not torch.allclose(bad, full[window], atol=1e-3)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llada", "dream"]), seed=st.integers(0, 3),
       prompt=st.lists(st.integers(0, 258), min_size=1, max_size=6),
       gen_len=st.integers(1, 16), block=st.integers(1, 10))
def test_refresh_always_at_threshold_one_is_stepwise(family, seed, prompt, gen_len, block):
    m = model(family, seed)
    base = run(m, prompt, "stepwise", gen_len, block)
    res = run(m, prompt, "elastic-cache", gen_len, block, refresh="always", threshold=1.0, window=block)
    assert res.canvas == base.canvas
    assert res.stats["forwards"] == gen_len and res.stats["recomputed"] == 1.0
    # gamma 0: the drift test never fires (cosines of attention rows are >= 0): refresh=block
    drift0 = run(m, prompt, "elastic-cache", gen_len, block, gamma=0.0, threshold=1.0)
    blockwise = run(m, prompt, "elastic-cache", gen_len, block, refresh="block", threshold=1.0)
    assert drift0.canvas == blockwise.canvas and drift0.stats["refresh_layers"] == []
    assert TINY_MASK not in drift0.canvas


def test_the_drift_test_refreshes_from_a_boundary_layer():
    m = load("tiny-llada:1")  # 2 layers: a refresh can only start at layer 1
    never = run(m, "Hello world", "elastic-cache", 24, 8, threshold=1.0, refresh="block")
    strict = run(m, "Hello world", "elastic-cache", 24, 8, threshold=1.0, gamma=1.0)
    layers = strict.stats["refresh_layers"]
    assert layers and set(layers) == {1}
    assert never.stats["recomputed"] < strict.stats["recomputed"] < 1.0
    deep = tiny_model("dream", seed=2, layers=4)
    res = run(deep, "Hello world", "elastic-cache", 24, 8, threshold=1.0, gamma=1.0)
    assert res.stats["refresh_layers"] and all(1 <= layer <= 3 for layer in res.stats["refresh_layers"])


def test_fewer_forwards_where_confidence_is_high():
    for family in ("llada", "dream"):
        m = confident(family)
        base = run(m, "abc", "stepwise", 24, 8)
        res = run(m, "abc", "elastic-cache", 24, 8)
        assert res.canvas == base.canvas == [CONFIDENT_TOKEN] * 24
        assert res.stats["forwards"] == 3 < base.stats["forwards"]  # one step per block
        narrow = run(m, "abc", "elastic-cache", 24, 8, window=2)  # the window caps each step's commits
        assert narrow.canvas == base.canvas and narrow.stats["forwards"] == 12


def test_bad_options_are_typed_errors():
    m = model("llada", 0)
    for options, name in (({"refresh": "sometimes"}, "refresh"), ({"window": 0}, "window"),
                          ({"gamma": 1.5}, "gamma"), ({"gamma": -0.1}, "gamma"), ({"threshold": 0}, "threshold"),
                          ({"beta": 4}, "beta")):
        with pytest.raises(InvalidParameterError, match=name):
            generate(m, "x", method="elastic-cache", options=options)


def test_cli_matches_the_api(capsys):
    for family in ("llada", "dream"):
        rc = main(["diffusion", "generate", "-m", f"tiny-{family}:1", "--method", "elastic-cache", "--option",
                   "gamma=0.95", "--max-new-tokens", "10", "--block-size", "5", "--json", "Hello"])
        assert rc == 0
        out = json.loads(capsys.readouterr().out)
        ref = generate(f"tiny-{family}:1", "Hello", method="elastic-cache", options={"gamma": 0.95},
                       max_new_tokens=10, block_size=5)
        assert out["tokens"] == ref.tokens and out["stats"]["method"] == "elastic-cache"
        assert out["stats"]["refresh_layers"] == ref.stats["refresh_layers"]
    assert main(["diffusion", "generate", "-m", "tiny-llada", "--method", "elastic-cache", "--option",
                 "window=0", "x"]) == 2
    assert "window" in capsys.readouterr().err
