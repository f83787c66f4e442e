"""The static decoding step (models/static_step.py): forwards padded to fixed shapes, replayed from
CUDA graphs on a GPU.  On the CPU the padded forward runs without capture (``static_steps =
"padded"``), which is where the padding is proven: with batch-invariant linear layers, padded rows
and a longer span change no bit of a real row's logits, keys or values, and every method gives
vanilla's tokens.  The ``cuda`` tests run on a GPU only (scripts/gpu_check.py runs them there)."""

from __future__ import annotations

import pytest
import torch

import leapdecode
from leapdecode.core.runner import ModelRunner
from leapdecode.models.static_step import (EXACT_ROWS, pad_inputs, padded_forward, plan_chunks, resolve_mode,
                                           row_bucket, span_bucket, span_of)
from leapdecode.models.tiny import tiny_loaded

from helpers.models import make_batch_invariant

TREE = [-1, 0, 0, 1, 3, 2, -1]  # two roots, branches, a chain under node 1


def invariant_model(seed: int = 3, mode: str = "padded", layers: int = 2):
    """A tiny model whose linear layers are batch-invariant (a row's result does not depend on the
    other rows), with masked SDPA attention: what the static step needs to be exact."""
    lm = tiny_loaded(seed=seed, layers=layers)
    make_batch_invariant(lm.model)
    lm.model.attention = "sdpa"
    lm.model.static_steps = mode
    return lm


def context(model, n: int = 300, max_len: int = 700, seed: int = 0):
    cache = model.new_cache(max_len=max_len)
    ids = torch.randint(0, model.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)).to(model.device)
    for i in range(0, n, 200):
        model.forward(ids[:, i : i + 200], cache, logits_for=slice(0, 0))
        cache.commit()
    return cache


def test_buckets_and_modes():
    assert [row_bucket(t) for t in (1, 2, 3, 5, 9, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]
    assert row_bucket(65) is None and row_bucket(3, (16,)) == 16 and row_bucket(17, (16,)) is None
    assert [span_bucket(n, 8192) for n in (1, 256, 257, 600, 5000)] == [256, 256, 512, 1024, 8192]
    assert span_bucket(600, 700) == 700  # never past the cache
    assert plan_chunks(1, "exact") == [(0, 1, EXACT_ROWS)] and plan_chunks(40, "buckets") == [(0, 40, 64)]
    assert plan_chunks(40, "exact") == [(0, 16, 16), (16, 32, 16), (32, 40, 16)]
    assert plan_chunks(65, "exact") == plan_chunks(65, "buckets") == []  # prefill chunks stay eager
    assert span_of("exact", 300, 700) == 700 and span_of("buckets", 300, 700) == 512
    with pytest.raises(ValueError, match="static_shapes"):
        plan_chunks(3, "tight")
    assert resolve_mode("auto", torch.device("cpu")) == "off"
    assert resolve_mode("auto", torch.device("cuda")) == "graphs"
    with pytest.raises(ValueError, match="static_steps"):
        resolve_mode("fast", torch.device("cpu"))


def test_padded_rows_and_spans_change_no_real_row():
    """The same tree through every bucket that holds it, and over two spans: the real rows' logits
    and the keys and values they store are the same bits."""
    model = invariant_model().model
    toks = torch.tensor([[5, 9, 17, 33, 65, 129, 200]])
    outs, kvs = [], []
    for rows in (7, 8, 16, 64):
        for span in (512, 700):
            cache = context(model)
            positions, _ = cache.plan_append(TREE, 7)
            ins = pad_inputs(cache, toks, positions, rows, span)
            logits, states = padded_forward(model, cache, ins, states=True, logits=True)
            outs.append((logits[:7], states[:, :7]))
            kvs.append((cache.k[:, :, :, : cache.total].clone(), cache.v[:, :, :, : cache.total].clone()))
    for (lg, st), (k, v) in zip(outs[1:], kvs[1:]):
        assert torch.equal(lg, outs[0][0]) and torch.equal(st, outs[0][1])
        assert torch.equal(k, kvs[0][0]) and torch.equal(v, kvs[0][1])


def test_pad_inputs_masks_the_tree_and_parks_padded_rows_past_the_forward():
    model = invariant_model().model
    cache = context(model, n=40, max_len=300)
    positions, mask = cache.plan_append(TREE, 7)
    ins = pad_inputs(cache, torch.arange(7), positions, 16, 256)
    assert ins.slots.tolist() == list(range(40, 56))  # the forward's own 7 slots, then 9 free ones
    assert ins.tokens[7:].eq(0).all() and ins.positions[7:].eq(0).all()
    assert torch.equal(ins.mask[:7, :47], mask)  # plan_append's own tree mask, committed slots included
    assert not ins.mask[:7, 47:].any()
    assert ins.mask[7:, 0].all() and ins.mask[7:].sum() == 9  # padded rows see slot 0 only
    with pytest.raises(ValueError, match="do not fit"):
        pad_inputs(cache, torch.arange(7), positions, 16, 32)  # a span shorter than the slots in use


def test_static_forward_matches_the_eager_forward():
    """``forward`` through the static step: the same logits (up to the attention kernels' rounding),
    hidden states and ``logits_for`` selection as the eager route, and the eager route where the
    padded rows have no room."""
    lm = invariant_model()
    model = lm.model
    toks = torch.tensor([[5, 9, 17, 33, 65, 129, 200]])
    got = {}
    for mode in ("padded", "off"):
        model.static_steps = mode
        cache = context(model)
        hidden: list = []
        got[mode] = (model.forward(toks, cache, parents=TREE, hidden_states=hidden), hidden,
                     model.forward(toks[:, :2], cache, logits_for=[1]), cache)
    (a, ha, sa, ca), (b, hb, sb, _) = got["padded"], got["off"]
    assert a.shape == b.shape == (1, 7, model.vocab_size) and sa.shape == sb.shape == (1, 1, model.vocab_size)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sa, sb, atol=1e-4, rtol=1e-4)
    assert len(ha) == len(hb) == model.n_layers + 1
    for x, y in zip(ha, hb):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    assert ca.static is not None and ca.static.runs == 2
    model.static_steps = "padded"
    full = context(model, n=40, max_len=47)  # 7 rows fit, their bucket of 8 pads past the cache: eager
    runs = full.static.runs if full.static is not None else 0
    model.forward(toks, full, parents=TREE)
    assert (full.static.runs if full.static is not None else 0) == runs
    with pytest.raises(ValueError, match="static_steps"):
        model.static_steps = "sometimes"
        model.forward(toks, full)


def test_a_tree_cut_into_16_row_forwards_gives_the_bits_of_one_forward():
    """``"exact"`` runs a 40-node tree as three padded forwards of 16 rows (the later ones attending
    to the earlier ones' pending nodes); ``"buckets"`` as one of 64 rows: the same logits, hidden
    states and cache contents, bit for bit (batch-invariant linear layers)."""
    model = invariant_model().model
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, model.vocab_size, (1, 40), generator=g)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 40)]
    got = {}
    for shapes in ("exact", "buckets"):
        model.static_shapes = shapes
        cache = context(model)
        hidden: list = []
        logits = model.forward(toks, cache, parents=parents, hidden_states=hidden)
        got[shapes] = (logits, torch.cat(hidden), cache.k[:, :, :, : cache.total].clone(), cache.static.runs)
    model.static_shapes = "exact"
    for a, b in zip(got["exact"][:3], got["buckets"][:3]):
        assert torch.equal(a, b)
    assert got["exact"][3] == 3 and got["buckets"][3] == 1  # the context's forwards (200, 100 tokens) ran eager
    assert got["exact"][0].shape == (1, 40, model.vocab_size)


@pytest.mark.parametrize("shapes", ["exact", "buckets"])
def test_every_method_gives_vanillas_tokens_through_the_static_step(shapes):
    lm = invariant_model(seed=5)
    lm.model.static_shapes = shapes
    ids = list(range(40, 90)) * 2
    runner = ModelRunner(lm)
    runner.add_draft("twin", tiny_loaded(seed=5))
    base = leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=48, method="vanilla")
    assert len(base.tokens) == 48
    for method, options in (("pld", None), ("draft", {"draft": "twin"}), ("auto", None)):
        r = leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=48, method=method, options=options)
        assert r.tokens == base.tokens, method


def test_padding_that_leaks_is_caught():
    """The check above can fail: padded rows that attend to everything (a wrong mask) change a
    real row's keys in the next layer only if they are read, so plant a leak into a real row."""
    model = invariant_model().model
    toks = torch.tensor([[5, 9, 17]])
    res = []
    for rows in (4, 16):
        cache = context(model)
        positions, _ = cache.plan_append(None, 3)
        ins = pad_inputs(cache, toks, positions, rows, 512)
        ins.mask[0, cache.total : cache.total + rows - 3] = True  # row 0 sees the padded rows' slots
        res.append(padded_forward(model, cache, ins, states=False, logits=True)[0][:3])
    assert not torch.equal(res[0], res[1])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
def test_cuda_graphs_replay_the_eager_forward_and_follow_replaced_weights():
    lm = tiny_loaded(seed=2, dtype=torch.bfloat16, device="cuda")
    model = lm.model
    toks = torch.tensor([[5, 9, 17, 33, 65, 129, 200]], device="cuda")
    out = {}
    for mode in ("graphs", "off"):
        model.static_steps = mode
        cache = context(model)
        out[mode] = (model.forward(toks, cache, parents=TREE), cache)
    torch.testing.assert_close(out["graphs"][0], out["off"][0], atol=0.05, rtol=0.05)
    cache = out["graphs"][1]
    assert cache.static.captures == 1 and cache.static.runs == 1
    model.static_steps = "graphs"
    cache.rollback()
    again = model.forward(toks, cache, parents=TREE)
    assert torch.equal(again, out["graphs"][0]) and cache.static.captures == 1  # replayed, same bits
    cache.rollback()
    with torch.no_grad():
        model.layers[0].wo = torch.nn.Linear(model.cfg.n_heads * model.cfg.head_dim, model.cfg.hidden_size,
                                             bias=False, device="cuda", dtype=torch.bfloat16)
    changed = model.forward(toks, cache, parents=TREE)
    assert cache.static.captures == 2 and not torch.equal(changed, again)


@pytest.mark.cuda
@cuda
def test_cuda_graphs_greedy_methods_match_vanilla_on_one_shape():
    """With the default "exact" shapes every forward has one shape, so a token's logits cannot depend on the
    bucket; pld and a twin draft then give vanilla's tokens."""
    lm = tiny_loaded(seed=4, dtype=torch.bfloat16, device="cuda")
    lm.model.static_steps = "graphs"  # static_shapes "exact": the default
    ids = list(range(40, 90)) * 2
    runner = ModelRunner(lm)
    runner.add_draft("twin", tiny_loaded(seed=4, dtype=torch.bfloat16, device="cuda"))
    base = leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=48, method="vanilla")
    for method, options in (("pld", None), ("draft", {"draft": "twin"})):
        r = leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=48, method=method, options=options)
        assert r.tokens == base.tokens, method
