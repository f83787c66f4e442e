"""leapdecode's block-quantized kernel (``models/qkernel.py``, ``kernels/qgemm.cpp``).

1. Formats (4-bit g32; 6-bit g16 offset 32; 6-bit g32 offset 16; 8-bit g32): the weight the
   kernel reads back (``QPart.dequantize``) is exactly ``BlockWeight.dequantize``, and
   ``QLinear`` multiplies by it (within fp32 accumulation error, against an fp64 reference).
2. Batch invariance, bitwise: a row of an M-row product (M = 1..70: one and two kernel passes
   of 64 rows) is the 1-row product of that row, in bf16 and fp32 outputs, with 1 and 2 threads.
   Where ``QLinear`` sends forwards of more than ``DENSE_MIN_ROWS`` rows (prefill chunks) to a
   dense bf16 copy of the weights, the kernel's two-pass case is reached by raising that limit
   (``force_kernel``), and the rows of a real forward are checked bitwise up to the limit and
   within bf16 rounding beyond it.  The GGUF types' own blocks (``gguf_blocks.decode``, in
   whatever scale form ``pack`` keeps them) are exact and batch invariant on the kernel too.
3. Several parts side by side give the single parts' outputs; a part padded to 16 rows keeps
   its real rows' values and drops the padding.
4. ``pack``'s byte layout (decoded here in numpy as kernels/qgemm.cpp documents it), its shape
   errors, and ``QPart``'s ``ModelFileError`` for tensors of the wrong sizes.
5. Tiny models on the kernel (``load("tiny-random", weights="int4")``): tree forwards give the
   1-token logits bitwise, and the packed cache (``save_packed``/``load_packed``) round-trips.

Tests that run the kernel skip, naming the reason, where ``kernel_problem()`` says it cannot
be built here (no C++ compiler, ``LEAPDECODE_NO_QKERNEL``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leapdecode.errors import ModelFileError
from leapdecode.models import qkernel
from leapdecode.models.qkernel import MAX_ROWS, BlockWeight, QLinear, QPart, kernel_problem, pack, padded

BF16 = torch.bfloat16
# (bits, group, offset): Q4_*/Q4_K; Q6_K; Q5_0; Q8_0
FORMATS = [(4, 32, 0), (6, 16, 32), (6, 32, 16), (8, 32, 0)]
FORMAT_IDS = ["4b-g32", "6b-g16-o32", "6b-g32-o16", "8b-g32"]


@pytest.fixture
def kernel():
    """Skip (with the reason) where the kernel cannot be built or loaded."""
    problem = kernel_problem()
    if problem is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {problem}")
    return qkernel.kernel_isa()


@pytest.fixture
def force_kernel(kernel, monkeypatch):
    """Every ``QLinear`` forward on the kernel, whatever its number of rows (no dense prefill path)."""
    monkeypatch.setattr(qkernel, "DENSE_MIN_ROWS", 1 << 30, raising=False)
    return kernel


def invariant_rows() -> int:
    """The most rows a ``QLinear`` forward runs on the batch-invariant kernel."""
    return getattr(qkernel, "DENSE_MIN_ROWS", 1 << 30)


class _threads:
    """``torch.set_num_threads(n)`` for a block, restoring the previous value."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def random_block(n: int, k: int, bits: int, group: int, offset: int = 0, seed: int = 0) -> BlockWeight:
    rng = np.random.default_rng(seed)
    if bits == 4:
        codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    elif bits == 6:
        codes = rng.integers(0, 64, (n, k)).astype(np.uint8)
    else:
        codes = rng.integers(-128, 128, (n, k)).astype(np.int8)
    scales = (rng.random((n, k // group)) * 0.02 + 0.001).astype(np.float32)
    zeros = (rng.standard_normal((n, k // group)) * 0.05).astype(np.float32)
    return BlockWeight(codes, scales, zeros, bits, group, offset)


def random_x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(BF16)


def reference(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 ``x @ W.T (+ bias)`` with the block weight's fp32 values."""
    y = x.double() @ torch.from_numpy(w.dequantize()).double().T
    return y if bias is None else y + bias.double()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


# ------------------------------------------------------------------ 1. formats, accuracy
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_kernel_weight_is_the_block_weight_exactly(kernel, fmt):
    bits, group, offset = fmt
    for n, k, seed in ((16, group, 0), (80, 256, 1), (48, 96 if group == 32 else 80, 2)):
        w = random_block(n, k, bits, group, offset, seed)
        part = QPart.from_block(w)
        got = part.dequantize()
        assert got.dtype == torch.float32 and got.shape == (n, k)
        assert np.array_equal(got.numpy(), w.dequantize()), (n, k)
        # the values are what the format says: s * (code - offset) + z
        v = w.codes.astype(np.float32) - (offset if bits == 6 else 0)
        expect = np.repeat(w.scales, group, 1) * v + np.repeat(w.zeros, group, 1)
        assert np.array_equal(w.dequantize(), expect)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_qlinear_multiplies_by_the_block_weight(kernel, fmt, with_bias):
    bits, group, offset = fmt
    n, k = 80, 256
    w = random_block(n, k, bits, group, offset, seed=3)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)) if with_bias else None
    x = random_x(7, k)
    layer = QLinear([QPart.from_block(w)], bias, out_fp32=True)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (7, n)
    ref = reference(x, w, bias)
    assert rel_err(y, ref) < 1e-5
    # bf16 output: the fp32 one rounded
    y16 = QLinear([QPart.from_block(w)], bias)(x)
    assert y16.dtype == BF16 and torch.equal(y16, y.to(BF16))
    # leading dimensions are kept; other input dtypes are cast to bf16
    assert torch.equal(layer(x.view(1, 7, k)), y.view(1, 7, n))
    assert torch.equal(layer(x.float()), y)
    # the check has power: the same numbers in another arrangement are far off
    wrong = BlockWeight(w.codes[:, ::-1].copy(), w.scales, w.zeros, bits, group, offset)
    assert rel_err(QLinear([QPart.from_block(wrong)], bias, out_fp32=True)(x), ref) > 1e-2
    swapped = BlockWeight(w.codes, w.zeros, w.scales, bits, group, offset)
    assert rel_err(QLinear([QPart.from_block(swapped)], bias, out_fp32=True)(x), ref) > 1e-2


# ------------------------------------------------------------------ 2. batch invariance
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_rows_are_bitwise_independent_of_the_batch(force_kernel, fmt):
    bits, group, offset = fmt
    n, k, rows = 80, 128, 70  # 5 column units: a block of 4 and a block of 1; 70 > MAX_ROWS rows
    assert rows > MAX_ROWS
    w = random_block(n, k, bits, group, offset, seed=5)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6))
    x = random_x(rows, k, seed=7)
    rng = np.random.default_rng(8)
    singles_by_threads = {}
    for out_fp32 in (False, True):
        layer = QLinear([QPart.from_block(w)], bias, out_fp32=out_fp32)
        for threads in (1, 2):
            with _threads(threads):
                singles = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
                for m in range(1, rows + 1):
                    idx = torch.from_numpy(rng.permutation(rows)[:m])
                    y = layer(x[idx])
                    assert torch.equal(y, singles[idx]), (out_fp32, threads, m)
                assert torch.equal(layer(x), singles)
            singles_by_threads[(out_fp32, threads)] = singles
        # and the thread count changes nothing either
        assert torch.equal(singles_by_threads[(out_fp32, 1)], singles_by_threads[(out_fp32, 2)])
    assert rel_err(singles_by_threads[(True, 1)], reference(x, w, bias)) < 1e-5


def bf16_bound(x: torch.Tensor, w: BlockWeight, ref: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """How far a bf16 computation of ``x @ W.T + bias`` may be from the exact one: output and
    bias roundings to bf16 (2^-8 relative each) and the weights rounded to bf16 (2^-9 relative)."""
    mag = x.double().abs() @ torch.from_numpy(np.abs(w.dequantize())).double().T
    if bias is not None:
        mag = mag + bias.double().abs()
    return 2.0**-7 * ref.abs() + 2.0**-8 * mag + 1e-6


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_forwards_are_invariant_up_to_the_limit_and_right_beyond(kernel, fmt):
    # the layer as the model runs it: up to invariant_rows() rows (decoding, tree verification)
    # every row is its 1-row result bitwise; larger forwards (prefill chunks) give the product
    bits, group, offset = fmt
    n, k = 48, 96
    w = random_block(n, k, bits, group, offset, seed=40)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(41))
    x = random_x(140, k, seed=42)
    limit = min(invariant_rows(), 140)
    assert limit >= MAX_ROWS
    for out_fp32 in (False, True):
        layer = QLinear([QPart.from_block(w)], bias, out_fp32=out_fp32)
        singles = torch.cat([layer(x[i : i + 1]) for i in range(140)])
        for m in sorted({1, 2, 17, MAX_ROWS - 1, MAX_ROWS, limit}):
            assert torch.equal(layer(x[:m]), singles[:m]), m
        for m in (65, 100, 140):
            y = layer(x[:m])
            assert y.shape == (m, n) and y.dtype == (torch.float32 if out_fp32 else BF16)
            ref = reference(x[:m], w, bias)
            assert ((y.double() - ref).abs() <= bf16_bound(x[:m], w, ref, bias)).all(), m
            # the bound has power: the scales and offsets swapped are far outside it
            if m == 100:
                swapped = BlockWeight(w.codes, w.zeros, w.scales, bits, group, offset)
                bad = QLinear([QPart.from_block(swapped)], bias, out_fp32=out_fp32)(x[:m])
                assert not ((bad.double() - ref).abs() <= bf16_bound(x[:m], w, ref, bias)).all()


GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_blocks_on_the_kernel(force_kernel, name):
    # the GGUF formats' own scales (fp16 d and m, the K-quants' d * sc and dmin * m), whatever
    # form pack() keeps them in: exact weights, the product, and bitwise batch invariance
    import gguf

    from leapdecode.models.gguf_blocks import decode
    from test_gguf_blocks import random_raw

    qtype = gguf.GGMLQuantizationType[name]
    per = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = 48, 2 * per
    w = decode(random_raw(qtype, n, k, seed=50, scale=0.05), int(qtype), n, k)
    part = QPart.from_block(w)
    assert np.array_equal(part.dequantize().numpy(), w.dequantize())
    x = random_x(70, k, seed=51)
    for out_fp32 in (False, True):
        layer = QLinear([part], out_fp32=out_fp32)
        y = layer(x)
        singles = torch.cat([layer(x[i : i + 1]) for i in range(70)])
        assert torch.equal(y, singles)
        for m in (1, 2, 33, 64, 65):
            assert torch.equal(layer(x[70 - m :]), singles[70 - m :]), m
        if out_fp32:
            ref = reference(x, w)
            mag = x.double().abs() @ torch.from_numpy(np.abs(w.dequantize())).double().T
            assert ((y.double() - ref).abs() <= 1e-6 * mag).all()
            assert rel_err(y, ref) < 1e-5


def test_set_num_threads_is_restored():
    before = torch.get_num_threads()
    with _threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FORMATS), units=st.integers(1, 9), ngroups=st.integers(1, 4),
       m=st.integers(1, 2 * MAX_ROWS + 3), seed=st.integers(0, 2**16), out_fp32=st.booleans())
def test_random_shapes_are_exact_and_batch_invariant(force_kernel, fmt, units, ngroups, m, seed, out_fp32):
    bits, group, offset = fmt
    n, k = 16 * units, group * ngroups
    w = random_block(n, k, bits, group, offset, seed)
    part = QPart.from_block(w)
    assert np.array_equal(part.dequantize().numpy(), w.dequantize())
    layer = QLinear([part], out_fp32=out_fp32)
    x = random_x(m, k, seed + 1)
    y = layer(x)
    assert y.shape == (m, n)
    for i in sorted({0, m // 2, m - 1}):
        assert torch.equal(y[i : i + 1], layer(x[i : i + 1])), i
    if out_fp32:
        assert rel_err(y, reference(x, w)) < 1e-5


# ------------------------------------------------------------------ 3. parts, padding
@pytest.mark.parametrize("out_fp32", [False, True])
def test_parts_side_by_side_equal_the_single_parts(force_kernel, out_fp32):
    k = 128
    w1 = random_block(48, k, 4, 32, 0, seed=10)
    w2 = random_block(32, k, 6, 16, 32, seed=11)  # another format and group
    w3 = random_block(16, k, 8, 32, 0, seed=12)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(13))
    x = random_x(70, k, seed=14)
    fused = QLinear([QPart.from_block(w) for w in (w1, w2, w3)], bias, out_fp32=out_fp32)
    assert fused.out_features == 96 and fused.in_features == k
    y = fused(x)
    singles = [QLinear([QPart.from_block(w)], b, out_fp32=out_fp32)(x)
               for w, b in zip((w1, w2, w3), bias.split([48, 32, 16]))]
    assert torch.equal(y, torch.cat(singles, dim=-1))
    # two parts only, no bias
    pair = QLinear([QPart.from_block(w2), QPart.from_block(w1)], out_fp32=out_fp32)
    assert torch.equal(pair(x), torch.cat([QLinear([QPart.from_block(w)], out_fp32=out_fp32)(x)
                                           for w in (w2, w1)], dim=-1))
    # and it is the product with the stacked weight
    stacked = np.concatenate([w.dequantize() for w in (w1, w2, w3)])
    assert np.array_equal(fused.dequantize().numpy(), stacked)
    if out_fp32:
        ref = x.double() @ torch.from_numpy(stacked).double().T + bias.double()
        assert rel_err(y, ref) < 1e-5
    for i in (0, 63, 64, 69):
        assert torch.equal(fused(x[i : i + 1]), y[i : i + 1])


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_a_part_padded_to_16_rows_keeps_its_rows(kernel, fmt):
    bits, group, offset = fmt
    n, k = 259, 64
    w = random_block(n, k, bits, group, offset, seed=20)
    part = QPart.from_block(w)
    assert part.out_features == 272 and part.in_features == k
    bias = torch.randn(n, generator=torch.Generator().manual_seed(21))
    layer = QLinear([part], bias, out_fp32=True, out_features=n)
    assert layer.out_features == n and layer.padded_features == 272
    x = random_x(9, k, seed=22)
    y = layer(x)
    assert y.shape == (9, n)
    assert rel_err(y, reference(x, w, bias)) < 1e-5
    assert np.array_equal(layer.dequantize().numpy(), w.dequantize())
    # the padding rows are zero weights: the unpadded layer gives them 0, and the same real rows
    full = QLinear([part], out_fp32=True)(x)
    assert full.shape == (9, 272)
    assert torch.equal(full[:, n:], torch.zeros(9, 272 - n))
    assert torch.equal(full[:, :n], QLinear([part], out_fp32=True, out_features=n)(x))
    assert torch.equal(part.dequantize()[n:], torch.zeros(272 - n, k))
    # bf16 output, 3-D input
    y16 = QLinear([part], bias, out_features=n)(x.view(3, 3, k))
    assert y16.shape == (3, 3, n) and torch.equal(y16.reshape(9, n), y.to(BF16))


def test_padded_adds_zero_weight_rows():
    for bits, group, offset in FORMATS:
        w = random_block(20, 64, bits, group, offset, seed=23)
        p = padded(w)
        assert p.shape == (32, 64) and p.codes.dtype == w.codes.dtype
        assert np.array_equal(p.codes[:20], w.codes) and np.array_equal(p.scales[:20], w.scales)
        assert np.array_equal(p.values()[20:], np.zeros((12, 64), np.int32))
        assert np.array_equal(p.dequantize()[20:], np.zeros((12, 64), np.float32))
        assert np.array_equal(p.dequantize()[:20], w.dequantize())
    w = random_block(32, 64, 4, 32, seed=24)
    assert padded(w) is w


def test_qlinear_refuses_inconsistent_parts_bias_and_out_features():
    a = QPart.from_block(random_block(32, 64, 4, 32, seed=25))
    b = QPart.from_block(random_block(16, 128, 4, 32, seed=26))
    c = QPart.from_block(random_block(20, 64, 8, 32, seed=27))  # padded to 32
    with pytest.raises(ValueError, match="in_features"):
        QLinear([a, b])
    with pytest.raises(ValueError, match="in_features"):
        QLinear([])
    with pytest.raises(ValueError, match="out_features"):
        QLinear([a, c], out_features=65)
    with pytest.raises(ValueError, match="out_features"):
        QLinear([a, c], out_features=32)  # would drop all of the last part
    with pytest.raises(ValueError, match="bias"):
        QLinear([a, c], torch.zeros(64), out_features=52)
    layer = QLinear([a, c], torch.arange(52.0), out_features=52)
    assert layer.out_features == 52 and layer.padded_features == 64
    assert torch.equal(layer.bias, torch.cat([torch.arange(52.0), torch.zeros(12)]))
    assert "parts=[32x4b/g32, 32x8b/g32]" in repr(layer)


# ------------------------------------------------------------------ 4. layout, sizes
def unpack(p: dict, bits: int, group: int, n: int, k: int) -> np.ndarray:
    """The codes ``[n, k]`` from ``pack``'s bytes, read as kernels/qgemm.cpp documents the
    layout: units of 16 rows, one block per (unit, group) of G/2 pair vectors; element i of pair
    vector p is (row 16 u + i / 2, column G g + 2 p + i % 2); 4-bit: pair vectors p, p + 1 share
    32 bytes (low nibble: p, high nibble: p + 1)."""
    raw = p["codes"].numpy()
    ng = k // group
    per = 8 * group if bits == 4 else 16 * group
    out = np.zeros((n, k), np.int32)
    for u in range(n // 16):
        for g in range(ng):
            blk = raw[(u * ng + g) * per : (u * ng + g + 1) * per]
            for pv in range(group // 2):
                for i in range(32):
                    if bits == 4:
                        byte = int(blk[(pv >> 1) * 32 + i])
                        code = byte >> 4 if pv & 1 else byte & 15
                    else:
                        code = int(blk[pv * 32 + i])
                        if bits == 8:
                            code = code - 256 if code > 127 else code
                    out[16 * u + i // 2, group * g + 2 * pv + i % 2] = code
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_pack_writes_the_documented_layout(fmt):
    bits, group, offset = fmt
    n, k = 32, 2 * group
    w = random_block(n, k, bits, group, offset, seed=30)
    p = pack(w)
    assert p["codes"].dtype == torch.uint8
    assert p["codes"].numel() == (n * k // 2 if bits == 4 else n * k)
    assert p["scales"].shape == p["zeros"].shape == (n // 16, k // group, 16)
    assert np.array_equal(unpack(p, bits, group, n, k), w.codes.astype(np.int32))
    # scales[u, g, j] is row 16 u + j's scale of group g
    assert np.array_equal(p["scales"].numpy().transpose(0, 2, 1).reshape(n, k // group), w.scales)
    assert np.array_equal(p["zeros"].numpy().transpose(0, 2, 1).reshape(n, k // group), w.zeros)
    # QPart keeps exactly those tensors
    part = QPart.from_block(w)
    assert torch.equal(part.codes, p["codes"]) and torch.equal(part.scales, p["scales"])
    spec = part.spec()
    assert {key: spec[key] for key in ("bits", "group", "offset", "out_features", "in_features")} == {
        "bits": bits, "group": group, "offset": offset, "out_features": n, "in_features": k}
    assert part.nbytes() == sum(t.numel() * t.element_size() for t in part.buffers())
    assert part.nbytes() >= p["codes"].numel() + 2 * p["scales"].numel()


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(FORMATS), row=st.integers(0, 47), col=st.integers(0, 63), code=st.integers(1, 15))
def test_one_code_lands_where_the_layout_says(fmt, row, col, code):
    bits, group, offset = fmt
    n, k = 48, 64
    codes = np.zeros((n, k), np.uint8 if bits != 8 else np.int8)
    codes[row, col] = code
    w = BlockWeight(codes, np.ones((n, k // group), np.float32), np.zeros((n, k // group), np.float32), bits,
                    group, offset)
    raw = pack(w)["codes"].numpy()
    ng, per = k // group, (8 * group if bits == 4 else 16 * group)
    u, g, pv, i = row // 16, col // group, (col % group) // 2, 2 * (row % 16) + col % 2
    if bits == 4:
        pos = (u * ng + g) * per + (pv >> 1) * 32 + i
        assert raw[pos] == (code << 4 if pv & 1 else code)
    else:
        pos = (u * ng + g) * per + pv * 32 + i
        assert raw[pos] == code
    assert np.count_nonzero(raw) == 1


def test_pack_refuses_shapes_and_formats_it_cannot_lay_out():
    ok = random_block(32, 64, 4, 32)
    pack(ok)
    bad = [
        random_block(20, 64, 4, 32),  # rows not a multiple of 16
        BlockWeight(ok.codes[:, :48], ok.scales[:, :1], ok.zeros[:, :1], 4, 32),  # 48 columns, groups of 32
        BlockWeight(ok.codes, np.ones((32, 8), np.float32), np.zeros((32, 8), np.float32), 4, 8),  # group 8
        BlockWeight(ok.codes, ok.scales, ok.zeros, 5, 32),  # 5-bit codes
        BlockWeight(ok.codes, ok.scales, ok.zeros, 2, 32),
        BlockWeight(ok.codes, np.ones((32, 1), np.float32), np.zeros((32, 1), np.float32), 4, 64),  # group 64
    ]
    for w in bad:
        with pytest.raises(ValueError, match="cannot pack"):
            pack(w)
    with pytest.raises(ValueError, match="cannot pack"):
        QPart.from_block(bad[1])


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_qpart_refuses_tensors_of_the_wrong_size(fmt):
    bits, group, offset = fmt
    n, k = 32, 64
    p = pack(random_block(n, k, bits, group, offset, seed=31))
    args = dict(bits=bits, group=group, offset=offset, out_features=n, in_features=k)
    QPart(**p, **args)  # the right sizes
    cases = [
        ({**p, "codes": p["codes"][:-1]}, args),
        ({**p, "codes": torch.cat([p["codes"], p["codes"][:32]])}, args),
        ({**p, "scales": p["scales"][:, :1]}, args),
        ({**p, "zeros": p["zeros"][:1]}, args),
        ({**p, "scales": p["scales"].reshape(n // 16, -1, 8)}, args),
        (p, {**args, "out_features": 2 * n}),
        (p, {**args, "in_features": 2 * k}),
        (p, {**args, "bits": 4 if bits != 4 else 8}),
    ]
    for tensors, a in cases:
        with pytest.raises(ModelFileError, match="wrong sizes"):
            QPart(**tensors, **a)


# ------------------------------------------------------------------ 5. tiny models
TREE = [-1, 0, 1, 1, 3, 0, 5, 6, 2, 8]  # branches, and a chain of depth 5
CHAIN = list(range(-1, 11))


def _tree_vs_one_at_a_time(model, prompt_len: int, parents: list[int], seed: int) -> list:
    """Nodes whose logits in one tree forward differ (bitwise) from feeding their root-to-node
    path one token at a time after the same committed prompt."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (1, prompt_len), generator=g)
    toks = torch.randint(0, 256, (1, len(parents)), generator=g)
    cache = model.new_cache(max_len=prompt_len + len(parents) + 8)
    model.forward(prompt, cache)
    cache.commit()
    tree = model.forward(toks, cache, parents=parents)[0]
    cache.rollback()
    bad = []
    for node in range(len(parents)):
        path, j = [], node
        while j >= 0:
            path.append(j)
            j = parents[j]
        for j in reversed(path):
            out = model.forward(toks[:, j : j + 1], cache)[0, 0]
        cache.rollback()
        if not torch.equal(out, tree[node]):
            bad.append((node, (out - tree[node]).abs().max().item()))
    return bad


def _linears(model) -> list:
    return [getattr(b, name) for b in model.layers for name in ("wqkv", "wo", "w_gate_up", "w_down")] + [
        model.lm_head]


def test_tiny_int4_model_runs_on_the_kernel_and_trees_match_one_token_forwards(kernel):
    from leapdecode.models.loader import load

    lm = load("tiny-random", weights="int4")
    model = lm.model
    assert model.quantization == "int4" and model.attention == "invariant"
    layers = _linears(model)
    assert all(isinstance(m, QLinear) for m in layers), [type(m).__name__ for m in layers]
    assert model.lm_head.out_fp32 and model.lm_head.out_features == model.vocab_size == 259
    assert model.embed.weight.dtype == BF16
    # the head runs on the kernel: its weight is the embedding's 4-bit quantization
    head = model.lm_head.dequantize()
    assert head.shape == (259, model.cfg.hidden_size)
    err = (head - model.embed.weight.float()).abs()
    assert err.max() < 0.1 * model.embed.weight.float().abs().max() and err.max() > 0
    # tree forwards and 1-token forwards: the same logits, bit for bit
    for seed, prompt_len in ((0, 5), (1, 30), (2, 100)):  # 100: prefilled through stock SDPA
        for parents in (TREE, CHAIN):
            assert _tree_vs_one_at_a_time(model, prompt_len, parents, seed) == [], (prompt_len, parents)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (1, 12), generator=g)
    cache = model.new_cache(max_len=32)
    logits = model.forward(prompt, cache)
    assert logits.dtype == torch.float32 and logits.shape == (1, 12, 259) and torch.isfinite(logits).all()


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_packed_cache_round_trip_gives_the_same_logits(kernel, tmp_path, qkv_bias):
    from leapdecode.models.blockquant import load_packed, quantize_native, save_packed
    from leapdecode.models.tiny import tiny_native

    model = tiny_native(seed=4, qkv_bias=qkv_bias)
    kinds = quantize_native(model)
    assert set(kinds) == {"int4-g32"} and kinds["int4-g32"] > 0
    model.attention = "invariant"
    with pytest.raises(ValueError, match="already quantized"):
        quantize_native(model)
    path = tmp_path / "tiny.safetensors"
    save_packed(model, path)
    assert path.is_file() and not list(tmp_path.glob(".packed-*"))
    again = load_packed(path, model.cfg, model.max_seq_len)
    again.attention = "invariant"
    assert again.quantization == "int4"
    assert all(isinstance(m, QLinear) for m in _linears(again))
    if qkv_bias:
        assert model.layers[0].wqkv.bias is not None
        assert torch.equal(again.layers[0].wqkv.bias, model.layers[0].wqkv.bias)
    for a, b in zip(_linears(model), _linears(again)):
        assert torch.equal(a.dequantize(), b.dequantize())
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (1, 20), generator=g)
    toks = torch.randint(0, 256, (1, len(TREE)), generator=g)
    out = []
    for m in (model, again):
        cache = m.new_cache(max_len=64)
        first = m.forward(prompt, cache)
        cache.commit()
        out.append((first, m.forward(toks, cache, parents=TREE)))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    # and the file is what it is read from: a damaged one is a ModelFileError
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelFileError):
        load_packed(path, model.cfg, model.max_seq_len)
