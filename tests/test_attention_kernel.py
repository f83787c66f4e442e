"""leapdecode's attention kernel (``models/kernels/attention.cpp``, ``qkernel.attend_rows``): the
invariant attention of the native decoder on the CPU.

What it must do: compute softmax attention (close to an fp64 reference), and give every query row
the same bits whatever else shares the call (other rows, tree shapes, thread counts) and whatever
build computes it (AVX-512 or portable C++).  The model-level consequence (a tree forward's
logits equal one token at a time) is checked in tests/test_invariant_attention.py for both the
kernel and the SDPA-per-row fallback.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.kernel_variants import build_kernel_variant
from leapdecode.models import kernel_library
from leapdecode.models.loader import load
from leapdecode.models.kernel_library import kernel_problem
from leapdecode.models.qkernel import attend_rows, attention_supported

pytestmark = pytest.mark.skipif(kernel_problem() is not None, reason=f"no kernel here: {kernel_problem()}")

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(seed: int, hq: int, hkv: int, d: int, slots: int, t: int, dtype: torch.dtype, batch_cache: int = 1):
    g = torch.Generator().manual_seed(seed)
    # a cache with a batch dimension and spare slots, sliced as KVCache.write returns it
    keys = (torch.randn(batch_cache, hkv, slots + 7, d, generator=g) * 2).to(dtype)[:1, :, :slots]
    values = torch.randn(batch_cache, hkv, slots + 7, d, generator=g).to(dtype)[:1, :, :slots]
    q = torch.randn(1, t, hq, d, generator=g).to(dtype).transpose(1, 2)  # as rotary_qkv leaves it
    return q, keys, values


def _lists(seed: int, slots: int, t: int) -> list[torch.Tensor]:
    """``t`` increasing slot lists (a prefix, some ancestors, itself), as attended_slots makes."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(t):
        keep = torch.rand(slots, generator=g) < 0.7
        keep[int(torch.randint(0, slots, (1,), generator=g))] = True
        out.append(torch.nonzero(keep).flatten())
    return out


def _flat(lists):
    return torch.cat(lists), torch.tensor([0] + [len(x) for x in lists]).cumsum(0)


def _reference(q, keys, values, lists) -> torch.Tensor:
    hq, hkv, d = q.shape[1], keys.shape[1], q.shape[-1]
    out = []
    for t, idx in enumerate(lists):
        k = keys[0, :, idx].double().repeat_interleave(hq // hkv, dim=0)
        v = values[0, :, idx].double().repeat_interleave(hq // hkv, dim=0)
        s = (q[0, :, t].double()[:, None, :] * k).sum(-1) / math.sqrt(d)
        out.append((torch.softmax(s, -1)[:, :, None] * v).sum(1).reshape(-1))
    return torch.stack(out)[None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(12, 2, 128), (4, 2, 16), (9, 3, 64), (2, 2, 256)])
def test_attention_matches_an_fp64_reference(dtype, hq, hkv, d):
    q, keys, values = _inputs(0, hq, hkv, d, 90, 5, dtype)
    lists = _lists(0, 90, 5)
    got = attend_rows(q, keys, values, *_flat(lists))
    assert got.shape == (1, 5, hq * d) and got.dtype == dtype
    ref = _reference(q, keys, values, lists)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    assert (got.double() - ref).abs().max() < tol


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), t=st.integers(1, 20), slots=st.integers(1, 200),
       shape=st.sampled_from([(12, 2, 128), (4, 2, 64), (3, 1, 32), (2, 2, 16)]), dtype=st.sampled_from(DTYPES))
def test_every_row_has_the_bits_it_has_alone(seed, t, slots, shape, dtype):
    hq, hkv, d = shape
    q, keys, values = _inputs(seed, hq, hkv, d, slots, t, dtype)
    lists = _lists(seed, slots, t)
    together = attend_rows(q, keys, values, *_flat(lists))
    for i in range(t):
        alone = attend_rows(q[:, :, i : i + 1], keys, values, *_flat([lists[i]]))
        assert torch.equal(alone[0, 0], together[0, i]), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_thread_count_does_not_change_the_bits(dtype):
    q, keys, values = _inputs(3, 12, 2, 128, 400, 9, dtype)
    lists = _lists(3, 400, 9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend_rows(q, keys, values, *_flat(lists))
        torch.set_num_threads(2)
        two = attend_rows(q, keys, values, *_flat(lists))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_large_scores_and_far_keys_stay_finite_and_exact_enough():
    # scores spread over ~200: most weights underflow to 0, the max must still be subtracted
    q, keys, values = _inputs(5, 4, 2, 64, 300, 2, torch.float32)
    q = q * 40
    lists = _lists(5, 300, 2)
    got = attend_rows(q, keys, values, *_flat(lists))
    assert torch.isfinite(got).all()
    assert (got.double() - _reference(q, keys, values, lists)).abs().max() < 1e-4


def test_unsupported_inputs_are_refused_or_routed_elsewhere():
    q, keys, values = _inputs(0, 4, 2, 24, 10, 1, torch.float32)  # head size not a multiple of 16
    assert not attention_supported(q, keys)
    q, keys, values = _inputs(0, 4, 2, 32, 10, 1, torch.float16)
    assert not attention_supported(q, keys)
    q, keys, values = _inputs(0, 4, 2, 32, 10, 2, torch.float32)
    assert attention_supported(q, keys)
    with pytest.raises(ValueError, match="offsets"):
        attend_rows(q, keys, values, torch.arange(3), torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="ld_attend_rows failed"):  # a row with no slot
        attend_rows(q, keys, values, torch.arange(3), torch.tensor([0, 3, 3]))


@pytest.fixture(scope="module", params=["avx2", "portable"])  # (the other paths of KERNEL_VARIANTS: qgemm.cpp only)
def other_build(request, tmp_path_factory):
    """kernels/attention.cpp built as the plain C++ loops (``-DLD_PORTABLE``) and as the AVX2 path
    (``-mno-avx512f``, so an AVX-512 machine checks it too)."""
    return build_kernel_variant(tmp_path_factory, kernel_library.ATTENTION_SOURCE, ("ld_attend_rows",), request.param)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_other_builds_give_the_same_bits(other_build, dtype, monkeypatch):
    q, keys, values = _inputs(7, 12, 2, 128, 130, 6, dtype)
    lists = _lists(7, 130, 6)
    fast = attend_rows(q, keys, values, *_flat(lists))
    monkeypatch.setattr(kernel_library, "library", lambda: other_build)
    slow = attend_rows(q, keys, values, *_flat(lists))
    assert torch.equal(fast, slow)


def test_the_other_builds_agree_on_far_apart_and_non_finite_scores(other_build, monkeypatch):
    # queries 60x larger: most exponents fall below the polynomial's -87 clamp; one row's query
    # holds a NaN and one an inf (every output of theirs is NaN, on every build alike)
    q, keys, values = _inputs(11, 12, 2, 64, 77, 5, torch.float32)
    q = q * 60
    q[0, 3, 1, 5] = float("nan")
    q[0, 7, 2, 0] = float("inf")
    lists = _lists(11, 77, 5)
    fast = attend_rows(q, keys, values, *_flat(lists))
    monkeypatch.setattr(kernel_library, "library", lambda: other_build)
    slow = attend_rows(q, keys, values, *_flat(lists))
    assert torch.equal(fast.isnan(), slow.isnan()) and fast.isnan().any() and not fast.isnan().all()
    assert torch.equal(fast.nan_to_num(0.0), slow.nan_to_num(0.0))


def test_the_model_uses_the_kernel_and_stays_close_to_per_row_sdpa(monkeypatch):
    # the default quantized model's invariant attention runs the kernel; the SDPA-per-row path
    # (attention_kernel=False) is the same attention with other roundings
    from leapdecode.models import native

    model = load("tiny-random", weights="int8").model
    assert model.attention == "invariant" and model.attention_kernel
    calls = []
    monkeypatch.setattr(native, "attend_rows", lambda *a: calls.append(1) or attend_rows(*a))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (1, 30), generator=g)
    toks = torch.randint(0, 256, (1, 6), generator=g)
    parents = [-1, 0, 0, 1, 3, 2]
    out, counted = {}, {}
    try:
        for kernel in (True, False):
            model.attention_kernel = kernel
            cache = model.new_cache(max_len=64)
            model.forward(prompt, cache)
            cache.commit()
            before = len(calls)
            out[kernel] = model.forward(toks, cache, parents=parents)[0]
            counted[kernel] = len(calls) - before
    finally:
        model.attention_kernel = True
    assert counted == {True: model.n_layers, False: 0}
    # bf16 activations: within the rounding that test_invariant_attention allows stock attention
    assert (out[True] - out[False]).abs().max() < 0.5
    assert out[True].argmax(-1).eq(out[False].argmax(-1)).float().mean() > 0.8


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 12), k=st.sampled_from([16, 64, 576, 1536]))
def test_rms_norm_kernel_rows_are_invariant_and_match_torch_closely(seed, rows, k):
    from leapdecode.models.qkernel import rms_norm_bf16

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 3).bfloat16()
    w = torch.randn(k, generator=g).bfloat16()
    got = rms_norm_bf16(x, w, 1e-6)
    for i in range(rows):
        assert torch.equal(rms_norm_bf16(x[i : i + 1], w, 1e-6)[0], got[i])
    # rows of a wider tensor (a strided view) and leading dimensions: the same bits, the same shape
    wide = torch.zeros(rows, k + 16, dtype=x.dtype)
    wide[:, :k] = x
    assert torch.equal(rms_norm_bf16(wide[:, :k], w, 1e-6), got)
    assert torch.equal(rms_norm_bf16(x.view(1, rows, k), w, 1e-6), got.view(1, rows, k))
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float() * w.float()
    # the same two roundings; a 1-ulp difference of the normalizer may move a value by one bf16 ulp
    assert ((got.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()


def test_rms_norm_takes_the_kernel_for_bf16_rows_only(monkeypatch):
    from leapdecode.models import native

    calls = []
    real = native.rms_norm_bf16
    monkeypatch.setattr(native, "rms_norm_bf16", lambda *a: calls.append(1) or real(*a))
    w = torch.randn(32).bfloat16()
    native.rms_norm(torch.randn(2, 32).bfloat16(), w, 1e-6)
    native.rms_norm(torch.randn(2, 32), w.float(), 1e-6)
    assert calls == [1]
    # under autograd the torch ops run (the kernel has no backward)
    wg = torch.nn.Parameter(w.clone())
    y = native.rms_norm(torch.randn(2, 32).bfloat16(), wg, 1e-6)
    assert y.requires_grad and calls == [1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_matches_apply_rope_and_the_cache_write_bitwise(dtype):
    from leapdecode.models.kv_cache import KVCache
    from leapdecode.models.native import apply_rope
    from leapdecode.models.qkernel import rope_store

    hq, hkv, d, t = 6, 2, 32, 5
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(1, t, (hq + 2 * hkv) * d, generator=g) * 4).to(dtype)
    ang = torch.rand(t, d // 2, generator=g) * 50
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    cache = KVCache(2, hkv, d, 40, dtype=dtype)
    cache.plan_append(None, 3)
    cache.commit()
    cache.plan_append(None, t)
    keys, values = cache.layer_kv(1, cache.total)
    q = rope_store(qkv, cos, sin, hq, hkv, keys, values, cache.total - t)
    qr, kr, vr = qkv.split((hq * d, hkv * d, hkv * d), -1)
    as_heads = lambda x, h: x.view(1, t, h, d).transpose(1, 2)  # noqa: E731
    assert torch.equal(q, apply_rope(as_heads(qr, hq), cos, sin))
    assert torch.equal(keys[:, :, 3:], apply_rope(as_heads(kr, hkv), cos, sin))
    assert torch.equal(values[:, :, 3:], as_heads(vr, hkv))
    assert not keys[:, :, :3].any() and not cache.k[0].any()  # other slots and layers untouched


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_fused_route_gives_the_logits_of_the_unfused_kernel_route(weights, monkeypatch):
    # rope + store in one call, then the attention kernel, against rotary_qkv + KVCache.write +
    # the attention kernel (the route taken when a KV policy observes the cache): the same bits;
    # and the layers in one call (LayerStack, the default route) the same bits as both
    from leapdecode.models import native

    model = load("tiny-random", weights=weights).model
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 256, (1, 50), generator=g)
    toks = torch.randint(0, 256, (1, 7), generator=g)
    parents = [-1, 0, 1, 1, 2, 4, 0]
    calls = []
    real = native.rope_store
    monkeypatch.setattr(native, "rope_store", lambda *a: calls.append(1) or real(*a))
    out = {}
    for route in ("stack", "fused", "unfused"):
        model.layers_kernel = route == "stack"
        if route == "unfused":
            monkeypatch.setattr(native.Block, "attend", lambda self, qkv, cos, sin, cache, layer, mask, rows:
                                self.attention(*self.rotary_qkv(qkv, cos, sin), cache, layer, mask, rows))
        cache = model.new_cache(max_len=80)
        model.forward(prompt, cache)
        cache.commit()
        before = len(calls)
        out[route] = model.forward(toks, cache, parents=parents)[0]
        # (the stack runs where every projection is a QLinear; torch's int8 kernel: layer by layer)
        layer_calls = route == "fused" or (route == "stack" and weights != "int4")
        assert len(calls) - before == (model.n_layers if layer_calls else 0)
    model.layers_kernel = True
    assert (model._stack[1] is not None) == (weights == "int4")
    assert torch.equal(out["stack"], out["fused"]) and torch.equal(out["fused"], out["unfused"])
