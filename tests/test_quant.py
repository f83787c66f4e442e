"""Weight-only int8 / int4 layers (``models/quant.py``) and ``load(..., weights=...)``.

1. The kernels' layouts: an ``Int4Linear`` built from codes, scales and zeros multiplies by
   ``(q - 8) * scale + zero`` (and not by any other arrangement of the same numbers: a
   swapped layout must fail the same check); an ``Int8Linear`` by ``q * scale``.  The
   tolerance is what bf16 allows: the kernels take bf16 inputs, accumulate in fp32 and round
   the output to bf16, so an output is within half a bf16 ulp (2^-9 relative) of the exact
   product of the bf16 input with the dequantized weight, plus fp32 accumulation error.
2. Batch invariance, bitwise: row i of an M-row product equals the 1-row product of row i,
   for M = 1..16, any group size, with bias, on misaligned inputs, with 1 or 2 threads.
3. Whole model: logits of a token tree's nodes against feeding each node's path one token
   at a time.  Every linear layer is batch invariant (2.), and so is the rest of the model
   with attention swapped for an fp32 elementwise one (asserted strictly); but CPU
   ``scaled_dot_product_attention`` is not: its output for a query depends on the key length
   and on how many queries share the call (measured: 1 bf16 ulp of the attention output,
   ~0.1-0.25 in the logits, already at a 12-token context), which the ``xfail(strict=True)``
   test keeps visible until the model's attention is made batch invariant.
4. ``load("tiny-random", weights="int4"/"int8")`` generates; greedy ``sam``/``pld`` give
   vanilla's tokens; bad ``weights=`` values and conflicts are ``InvalidParameterError``s.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import leapdecode
from leapdecode.errors import InvalidParameterError
from leapdecode.models import native
from leapdecode.models.invariance import tree_mismatches, tree_vs_sequential
from leapdecode.models.loader import load
from leapdecode.models.linear import PackedLinear
from leapdecode.models.architecture import ModelConfig
from leapdecode.models.native import NativeCausalLM
from leapdecode.models import kernel_library
from leapdecode.models.qkernel import QLinear
from leapdecode.models.quant import Int4Linear, Int8Linear, kernel_problem, quantize_model
from leapdecode.models.tiny import tiny_native
from helpers.exactness import PROMPTS

BF16 = torch.bfloat16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bf16_bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """What a bf16-in, fp32-accumulate, bf16-out product may differ from the exact one by: the
    output's rounding to bf16 (8 significant bits: at most 2^-8 relative) plus fp32 accumulation
    error (about K * 2^-24 relative to sum |x||w|, taken generously as 2^-14)."""
    return 2.0**-8 * ref.abs() + 2.0**-14 * (x.float().abs() @ w.abs().t())


def _random_codes(n: int, k: int, group: int, seed: int = 0):
    g = _gen(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.05 + 0.005).to(BF16)
    zeros = (torch.randn(n, k // group, generator=g) * 0.1).to(BF16)
    weight = (codes.float() - 8) * scales.float().repeat_interleave(group, 1) + zeros.float().repeat_interleave(group, 1)
    return codes, scales, zeros, weight


# ------------------------------------------------------------------ 1. layouts, accuracy
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_from_codes_multiplies_by_q_minus_8_times_scale_plus_zero(group):
    n, k = 48, 256
    codes, scales, zeros, weight = _random_codes(n, k, group)
    layer = Int4Linear.from_codes(codes, scales, zeros)
    x = torch.randn(5, k, generator=_gen(1)).to(BF16)
    y = layer(x)
    assert y.dtype == BF16 and y.shape == (5, n)
    ref = x.float() @ weight.t()
    assert ((y.float() - ref).abs() <= _bf16_bound(x, weight, ref)).all()
    # the check has power: scale and zero swapped, or q without the -8, are far off
    swapped = Int4Linear.from_codes(codes, zeros, scales)
    assert not ((swapped(x).float() - ref).abs() <= _bf16_bound(x, weight, ref)).all()
    # the weight read back through the kernel is the given one, rounded to bf16
    deq = layer.dequantize()
    assert deq.shape == (n, k)
    assert ((deq - weight).abs() <= 2.0**-8 * weight.abs()).all()


def test_int4_from_codes_maps_a_q4k_style_block():
    # a GGUF Q4_K sub-block: w = d*sc*q - dmin*m  ->  scale = d*sc, zero = 8*scale - dmin*m
    n, k, group = 16, 64, 32
    g = _gen(3)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    sc = torch.randint(1, 64, (n, k // group), generator=g).float()
    m = torch.randint(0, 64, (n, k // group), generator=g).float()
    for d, dmin, exact in [(2.0**-7, 2.0**-8, False), (2.0**-7, 2.0**-3, True)]:
        scale, zero = d * sc, 8 * d * sc - dmin * m
        layer = Int4Linear.from_codes(q, scale, zero)
        want = d * sc.repeat_interleave(group, 1) * q.float() - dmin * m.repeat_interleave(group, 1)
        # the kernel keeps scale and zero in bf16 (8 significant bits, rounding <= 2^-8 relative):
        # 8*d*sc - dmin*m needs up to 10 bits here, so the weight is exact only up to their
        # rounding (plus the read-back's rounding to bf16)
        s, z = scale.repeat_interleave(group, 1), zero.repeat_interleave(group, 1)
        err = (layer.dequantize() - want).abs()
        assert (err <= 2.0**-8 * ((q.float() - 8).abs() * s + z.abs() + want.abs())).all()
        if exact:  # dmin*m a multiple of 8*d: zero = (sc - m) / 16 fits in bf16, no parameter error
            assert (err <= 2.0**-8 * want.abs()).all()
        else:  # and the parameter rounding is real (this is not a vacuous bound)
            assert (err > 2.0**-8 * want.abs()).any()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_from_float_is_close_to_the_float_layer(group):
    n, k = 64, 256
    w = torch.randn(n, k, generator=_gen(2)) * 0.05
    bias = torch.randn(n, generator=_gen(3)) * 0.1
    layer = Int4Linear.from_float(w, bias, group_size=group)
    codes, scales, zeros = Int4Linear.quantize(w, group)
    step, zero = scales.repeat_interleave(group, 1), zeros.repeat_interleave(group, 1)
    w_q = (codes.float() - 8) * step + zero  # the weight the kernel uses (fp32)
    # min/max asymmetric rounding: half a step off at most, plus what rounding the step and
    # zero to bf16 (<= 2^-8 relative) can push the group's ends out of range
    assert ((w_q - w).abs() <= 0.5 * step + 2.0**-8 * (zero.abs() + 16 * step)).all()
    assert ((layer.dequantize() - w_q).abs() <= 2.0**-8 * w_q.abs()).all()  # read back in bf16
    assert w_q.unique().numel() > 16  # really per group, not one grid for the whole matrix
    x = torch.randn(7, k, generator=_gen(4)).to(BF16)
    ref = x.float() @ w_q.t() + bias.to(BF16).float()
    y = layer(x).float()
    # the kernel's rounding, then the bias added in bf16 (one more rounding)
    assert ((y - ref).abs() <= 2 * _bf16_bound(x, w_q, ref) + 2.0**-8 * bias.abs()).all()
    # and near the float layer: int4 noise, a few percent of the output's spread
    exact = torch.nn.functional.linear(x.float(), w, bias)
    assert (y - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_int8_multiplies_by_q_times_scale():
    n, k = 259, 64  # odd N is fine for int8 (e.g. the tiny model's head)
    w = torch.randn(n, k, generator=_gen(5)) * 0.2
    layer = Int8Linear.from_float(w)
    deq = layer.dequantize()
    assert torch.equal(deq, layer.qweight.float() * layer.scales.float()[:, None])
    assert (layer.qweight.abs() <= 127).all() and layer.qweight.abs().max() >= 126
    # symmetric per-channel rounding: half a step off at most (the step is the bf16 scale)
    assert ((deq - w).abs() <= 0.5 * layer.scales.float()[:, None] + 1e-7).all()
    x = torch.randn(6, k, generator=_gen(6)).to(BF16)
    ref = x.float() @ deq.t()
    y = layer(x)
    assert y.dtype == BF16
    assert ((y.float() - ref).abs() <= _bf16_bound(x, deq, ref)).all()
    # fp32 in, fp32 out (computed in bf16)
    assert layer(x.float()).dtype == torch.float32


def test_unsupported_shapes_are_refused_not_crashed():
    assert Int8Linear.unsupported(64, 40) is not None  # the CPU kernel would read past K
    assert Int4Linear.unsupported(259, 64) is not None  # N % 16
    assert Int4Linear.unsupported(64, 96, group_size=64) is not None  # K % group
    assert Int4Linear.unsupported(64, 64, group_size=48) is not None
    assert Int4Linear.unsupported(64, 64, 32) is None and Int8Linear.unsupported(7, 64) is None
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8Linear.from_float(torch.randn(8, 40))
    with pytest.raises(ValueError, match="group size"):
        Int4Linear.from_float(torch.randn(64, 96), group_size=64)
    with pytest.raises(ValueError, match="0..15"):
        Int4Linear.from_codes(torch.full((16, 32), 16, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1))


# ------------------------------------------------------------------ 2. batch invariance
def _layers():
    w = torch.randn(96, 256, generator=_gen(7)) * 0.05
    b = torch.randn(96, generator=_gen(8))
    return {
        "int8": Int8Linear.from_float(w),
        "int8+bias": Int8Linear.from_float(w, b),
        "int4-g32": Int4Linear.from_float(w, group_size=32),
        "int4-g64+bias": Int4Linear.from_float(w, b, group_size=64),
        "int4-g128": Int4Linear.from_float(w, group_size=128),
    }


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(_layers()))
def test_quantized_linear_rows_do_not_depend_on_the_batch(name, threads):
    layer = _layers()[name]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = _gen(9)
        for m in range(1, 17):
            x = torch.randn(m, 256, generator=g).to(BF16)
            y = layer(x)
            for i in range(m):
                assert torch.equal(y[i], layer(x[i : i + 1].clone())[0]), f"{name}: row {i} of M={m}"
        # a batch of 3-D input, and an input at a misaligned address (the int8 kernel uses aligned loads)
        x = torch.randn(2, 5, 256, generator=g).to(BF16)
        assert torch.equal(layer(x)[1, 3], layer(x[1, 3:4])[0])
        buf = torch.randn(3 * 256 + 1, generator=g).to(BF16)
        shifted = buf[1:].view(3, 256)
        assert shifted.data_ptr() % 32
        assert torch.equal(layer(shifted), layer(shifted.clone()))
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ 3. whole model
_tree_vs_sequential = tree_vs_sequential  # (models/invariance.py)
_mismatches = tree_mismatches


def _fp32_attention(q, k, v, attn_mask=None, enable_gqa=False, scale=None):
    """Attention without matrix products: fp32 elementwise products summed over a fixed axis, so a
    query's result does not depend on the other queries nor (masked keys adding exact zeros) on
    how many keys follow its visible ones."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    scores = (q.float()[..., :, None, :] * k[..., None, :, :]).sum(-1)
    scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return (p[..., None] * v[..., None, :, :]).sum(-2).to(q.dtype)


class _FunctionalWithAttention:
    """``torch.nn.functional`` with ``scaled_dot_product_attention`` replaced."""

    scaled_dot_product_attention = staticmethod(_fp32_attention)

    def __getattr__(self, name):
        return getattr(F, name)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_everything_but_attention_is_batch_invariant(weights, monkeypatch):
    # with SDPA swapped for a batch-invariant attention, a tree forward gives exactly the
    # logits of feeding each node's path one token at a time: short and long contexts
    monkeypatch.setattr(native, "F", _FunctionalWithAttention())
    assert _mismatches(load("tiny-random", weights=weights).model) == {}


@pytest.mark.xfail(strict=True, reason=(
    "CPU F.scaled_dot_product_attention (bf16) is not batch invariant: a query's output depends on "
    "the key length and on the number of queries in the call (1 bf16 ulp of the attention output, "
    "~0.1-0.25 in these logits), already at a 12-token context; every other op is invariant "
    "(test_everything_but_attention_is_batch_invariant)"))
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_tree_logits_equal_one_token_at_a_time_with_stock_attention(weights):
    assert _mismatches(load("tiny-random", weights=weights, attention="sdpa").model) == {}


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_tree_logits_equal_one_token_at_a_time_by_default(weights):
    # attention="auto" picks the batch-invariant attention for quantized weights
    model = load("tiny-random", weights=weights).model
    assert model.attention == "invariant"
    assert _mismatches(model) == {}


def test_quantize_model_swaps_the_layers_and_keeps_head_weight():
    model = tiny_native(seed=1)
    embed = model.embed.weight.detach().clone()
    quantize_model(model, "int4")
    block = model.layers[0]
    assert all(isinstance(getattr(block, n), Int4Linear) for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert isinstance(model.lm_head, Int8Linear) and model.quant_fallbacks == {}
    assert model.dtype == BF16 and model.quantization == "int4"
    assert torch.equal(model.head_weight, embed.to(BF16))  # tied: the embedding
    # untied: the head's own float weight is kept for proposers (vocabulary-subset heads)
    cfg = ModelConfig(vocab_size=272, hidden_size=64, intermediate_size=128, n_layers=1, n_heads=4,
                      n_kv_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=True)
    untied = NativeCausalLM(cfg, max_seq_len=64)
    with torch.no_grad():
        for p in untied.parameters():
            p.copy_(torch.randn(p.shape, generator=_gen(11)) * 0.1)
    head = untied.lm_head.weight.detach().clone()
    quantize_model(untied, "int8")
    assert isinstance(untied.lm_head, Int8Linear) and untied.layers[0].wqkv.bias is not None
    assert untied.head_weight.shape == (272, 64) and torch.equal(untied.head_weight, head.to(BF16))
    cache = untied.new_cache()
    assert untied.forward(torch.tensor([[1, 2, 3]]), cache).shape == (1, 3, 272)


def test_layers_a_kernel_cannot_take_stay_bf16():
    model = tiny_native(seed=2)  # K = 64 (attention, gate/up) and 128 (down)
    with pytest.warns(UserWarning, match="kept in bf16"):
        quantize_model(model, "int4", group_size=128)
    assert set(model.quant_fallbacks) == {f"layers.{i}.{n}" for i in range(2) for n in ("wqkv", "wo", "w_gate_up")}
    assert "multiple of the group size" in model.quant_fallbacks["layers.0.wqkv"]
    assert isinstance(model.layers[0].w_down, Int4Linear)
    assert isinstance(model.layers[0].wqkv, (PackedLinear, torch.nn.Linear))
    logits = model.forward(torch.tensor([[5, 6, 7]]), model.new_cache())
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "int8")
    packed = tiny_native(seed=2, dtype=BF16).pack_for_cpu()
    if isinstance(packed.layers[0].wqkv, PackedLinear):
        with pytest.raises(ValueError, match="before pack_for_cpu"):
            quantize_model(packed, "int8")


# ------------------------------------------------------------------ 4. load() and generate
def _divergences(lm, prompts) -> list:
    """(method, prompt, first differing token) wherever sam or pld departs from vanilla.  Fixed
    tree shapes (``cost_aware=False``): cost-aware chains follow the measured verification costs,
    which the loop keeps learning from its own steps, so their trees (and whether a non-invariant
    kernel flips a token in them) would depend on the machine's timings."""
    out = []
    for prompt in prompts:
        vanilla = leapdecode.generate(lm, prompt, max_new_tokens=40, method="vanilla")
        assert 0 < len(vanilla.tokens) <= 40
        for method in ("sam", "pld"):
            got = leapdecode.generate(lm, prompt, max_new_tokens=40, method=method, options={"cost_aware": False})
            if got.tokens != vanilla.tokens:
                first = next(i for i, (a, b) in enumerate(zip(got.tokens, vanilla.tokens)) if a != b)
                out.append((method, prompt, first))
    return out


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_load_weights_generates_and_speculation_is_lossless(weights, monkeypatch):
    lm = load("tiny-random", weights=weights)
    assert lm.weights == weights and lm.dtype == BF16
    # int4 on the CPU runs leapdecode's block kernel (models/qkernel.py) where it builds
    int4_layer = QLinear if (weights == "int4" and kernel_library.kernel_problem() is None) else Int4Linear
    assert isinstance(lm.model.layers[0].w_down, int4_layer if weights == "int4" else Int8Linear)
    assert lm.model.attention == "invariant"  # attention="auto" with quantized weights
    # with a batch-invariant attention, verifying drafts changes no token
    monkeypatch.setattr(native, "F", _FunctionalWithAttention())
    assert _divergences(lm, PROMPTS[:3]) == []


@pytest.mark.xfail(strict=True, reason=(
    "with CPU scaled_dot_product_attention (not batch invariant) a bf16 model's tree verification "
    "can flip a greedy token: here sam and pld (fixed trees) on 'aaaa bbbb aaaa bbbb' (int8) depart "
    "from vanilla at token 14"))
def test_speculation_is_lossless_with_stock_attention():
    found = [d for w in ("int4", "int8")
             for d in _divergences(load("tiny-random", weights=w, attention="sdpa"), PROMPTS)]
    assert found == []


def test_load_weights_float_values_keep_todays_dtypes():
    assert load("tiny-random", weights="fp32").dtype == torch.float32
    assert load("tiny-random", weights="bf16").weights == "bf16"
    assert load("tiny-random", weights="bf16", dtype="bf16").dtype == BF16
    assert load("tiny-random", dtype="fp32").weights == "fp32"  # weights="auto": as before


@pytest.mark.parametrize("bad", ["int3", "INT8", "", None, 8])
def test_load_rejects_unknown_weights(bad):
    with pytest.raises(InvalidParameterError, match=repr(bad).replace("(", r"\(")):
        load("tiny-random", weights=bad)


def test_load_rejects_conflicts_and_missing_kernels():
    with pytest.raises(InvalidParameterError, match="bf16 activations"):
        load("tiny-random", weights="int8", dtype="fp32")
    with pytest.raises(InvalidParameterError, match="conflicts"):
        load("tiny-random", weights="fp32", dtype="bf16")
    with pytest.raises(InvalidParameterError, match="cannot run on device 'meta'"):
        load("tiny-random", weights="int4", device="meta")
    assert kernel_problem("int8", "cpu") is None and kernel_problem("int4", "cpu") is None
    assert "meta" in kernel_problem("int4", "meta")


def test_no_warning_when_every_layer_is_quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load("tiny-random:3", weights="int8")
