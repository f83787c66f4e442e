"""leapdecode's block-quantized kernel (``models/qkernel.py``, ``kernels/qgemm.cpp``; the packing in
``models/kernel_pack.py``, the prefill path in ``models/kernel_prefill.py``, the first-use build in
``models/kernel_library.py``).

1. Formats (4-bit g32; 6-bit g16 offset 32; 6-bit g32 offset 16; 8-bit g32): the weight the
   kernel reads back (``QPart.dequantize``) is exactly ``BlockWeight.dequantize``.  ``QLinear``
   computes what kernels/qgemm.cpp documents, bit for bit (``emulate``: each row's bf16
   activations quantized to int8 per group of G columns, exact integer dot products, then the
   fp32 products and FMAs in the documented order), which is within about 1% of max|y| of the
   float product ``x @ W.T`` (checked < 2%).
2. Batch invariance, bitwise: a row of an M-row product (M = 1..70: one and two kernel passes
   of 64 rows) is the 1-row product of that row, in bf16 and fp32 outputs, with 1 and 2 threads.
   Where ``QLinear`` sends forwards of more than ``DENSE_MIN_ROWS`` rows (prefill chunks) to a
   dense bf16 copy of the weights, the kernel's two-pass case is reached by raising that limit
   (``force_kernel``), and the rows of a real forward are checked bitwise up to the limit and
   within bf16 rounding beyond it (the fp32-output head stays on the kernel: bitwise for any M).
   The GGUF types' own blocks (``gguf_blocks.decode``, in whatever scale form ``pack`` keeps
   them) are exact and batch invariant on the kernel too.
3. The portable C++ path (``-DLD_PORTABLE``) and the AVX2 path (``-mno-avx512f``), each built
   here with kernel_library's compiler and flags, give the same bits as the library ``QLinear`` runs,
   for every format and K-quant blocks.
4. Several parts side by side give the single parts' outputs; a part padded to 16 rows keeps
   its real rows' values and drops the padding.
5. ``pack``'s byte layout (decoded here in numpy as kernels/qgemm.cpp documents it: quad
   vectors of 64 codes), its scale modes (fp32; fp16 where exact; int8 sub-block scales with
   fp16 super-block factors where those are exact fp16), its shape errors, and ``QPart``'s
   ``ModelFileError`` for tensors of the wrong sizes.
6. Tiny models on the kernel (``load("tiny-random", weights="int4")``): tree forwards give the
   1-token logits bitwise, and the packed cache (``save_packed``/``load_packed``) round-trips.

Tests that run the kernel skip, naming the reason, where ``kernel_problem()`` says it cannot
be built here (no C++ compiler, ``LEAPDECODE_NO_QKERNEL``).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leapdecode.errors import ModelFileError
from leapdecode.models import kernel_library, kernel_pack, kernel_prefill, qkernel
from leapdecode.models.store import digest_path
from helpers.kernel_variants import KERNEL_VARIANTS, build_kernel_variant
from leapdecode.models.kernel_library import kernel_problem
from leapdecode.models.kernel_pack import CODES_IQ4, IQ4_VALUES, UNIT_BYTES, BlockWeight, pack, padded
from leapdecode.models.qkernel import MAX_ROWS, QLinear, QPart

from leapdecode.models.invariance import tree_vs_sequential as _tree_vs_one_at_a_time
from helpers.kernels import FORMAT_IDS, FORMATS, random_block, random_x

BF16 = torch.bfloat16
LOOSE = 2e-2  # QLinear vs the float product x @ W.T: at most this fraction of max|y| (int8 activations)


@pytest.fixture
def kernel():
    """Skip (with the reason) where the kernel cannot be built or loaded."""
    problem = kernel_problem()
    if problem is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {problem}")
    return kernel_library.kernel_isa()


@pytest.fixture
def force_kernel(kernel, monkeypatch):
    """Every ``QLinear`` forward on the kernel, whatever its number of rows (no dense prefill path)."""
    monkeypatch.setattr(kernel_prefill, "prefill_on_dense", lambda parts, measure: False)
    return kernel


@pytest.fixture(params=["dense", "kernel"])
def prefill_path(kernel, monkeypatch, request):
    """Forwards of more than ``DENSE_MIN_ROWS`` rows on the bf16 copy ("dense": kept, memory granted)
    or on the kernel, whatever ``prefill_ratios`` measured here."""
    monkeypatch.setattr(kernel_prefill, "prefill_on_dense", lambda parts, measure: request.param == "dense")
    monkeypatch.setenv(kernel_prefill.DENSE_BUDGET_ENV, "1024")
    monkeypatch.setattr(kernel_prefill, "DENSE_BUDGET", kernel_prefill.DenseBudget())
    return request.param


class _threads:
    """``torch.set_num_threads(n)`` for a block, restoring the previous value."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def reference(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 ``x @ W.T (+ bias)`` with the block weight's fp32 values (no activation quantization)."""
    y = x.double() @ torch.from_numpy(w.dequantize()).double().T
    return y if bias is None else y + bias.double()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


# ------------------------------------------------------------------ the kernel's arithmetic in numpy
def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 ``fmaf(a, b, c)``, one rounding: the fp64 product of two fp32 values is exact, the
    sum's fp64 rounding error is recovered exactly (TwoSum) and used to round the sum to odd,
    and a round-to-odd fp64 value rounds to the correctly rounded fp32 (53 >= 24 + 2 bits)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = np.broadcast_to(c, p.shape).astype(np.float64)
    hi = p + c
    bv = hi - p
    lo = (p - (hi - bv)) + (c - bv)
    odd = (hi.view(np.int64) & 1) == 1
    beside = np.nextafter(hi, np.where(lo > 0, np.inf, -np.inf))
    return np.where((lo == 0) | odd, hi, beside).astype(np.float32)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's int8 activations of ``x [m, k]`` (bf16 values): per row and group of ``group``
    columns, ``dx = max|x| / 127`` (fp32) and ``xq = nearbyint(x / dx)`` clamped to +-127 (ties to
    even), ``dx = 0`` and ``xq = 0`` for an all-zero group.  ``xq [m, k / group, group]`` int64, ``dx
    [m, k / group]`` fp32."""
    xf = x.to(BF16).float().numpy()
    m, k = xf.shape
    xf = xf.reshape(m, k // group, group)
    dx = np.abs(xf).max(-1) / np.float32(127)
    assert dx.dtype == np.float32
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(xf / dx[..., None])  # fp32 quotient, rounded half to even
    q = np.where(dx[..., None] > 0, np.clip(q, -127, 127), 0).astype(np.int64)
    return q, dx


def emulate(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None, out_fp32: bool = True) -> torch.Tensor:
    """What kernels/qgemm.cpp documents ``QLinear`` computes, in numpy: per group g,
    ``val = sum_k value * xq`` (exact), ``a = dx * float(val)``, ``b = dx * float(sum_k xq)`` (fp32
    products), ``acc = fma(s, a, acc)``, ``acc = fma(z, b, acc)``; then ``acc (+ bias)`` in fp32, or
    rounded to bf16.  (``val`` is the kernel's ``dot - off * isum`` on the stored codes.)"""
    shape = x.shape
    n, k = w.shape
    ng = k // w.group
    xq, dx = quantize_activations(x.reshape(-1, k), w.group)
    vals = w.values().astype(np.int64).reshape(n, ng, w.group)
    dot = np.einsum("mgk,ngk->mng", xq, vals)  # exact integers
    a = dx[:, None, :] * dot.astype(np.float32)  # fp32 products (|dot| < 2^24: exact conversions)
    b = dx * xq.sum(-1).astype(np.float32)
    assert a.dtype == b.dtype == np.float32
    acc = np.zeros((xq.shape[0], n), np.float32)
    for g in range(ng):
        acc = fma32(w.scales[None, :, g], a[:, :, g], acc)
        acc = fma32(w.zeros[None, :, g], b[:, g, None], acc)
    if bias is not None:
        acc = acc + bias.float().numpy()
    y = torch.from_numpy(acc).reshape(*shape[:-1], n)
    return y if out_fp32 else y.to(BF16)


def quantization_bound(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """How far ``y`` may be from the float product: each activation moves by at most dx / 2 (its
    int8 rounding), plus fp32 roundings (1e-5 of the magnitudes) and the output's bf16 rounding."""
    x2 = x.reshape(-1, w.shape[1])
    _, dx = quantize_activations(x2, w.group)
    absw = torch.from_numpy(np.abs(w.dequantize())).double()
    step = torch.from_numpy(np.repeat(dx, w.group, 1)).double() / 2 * (1 + 2.0**-20)
    mag = x2.double().abs() @ absw.T + (0 if bias is None else bias.double().abs())
    bound = step @ absw.T + 1e-5 * mag + 1e-30
    if y.dtype == BF16:
        bound = bound + 2.0**-8 * y.reshape(bound.shape).double().abs()
    return bound.reshape(y.shape)


def check_output(y: torch.Tensor, x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None,
                 loose: bool = True) -> None:
    """``y`` is the documented arithmetic bit for bit; every output is within the activations'
    quantization error of the float product and (``loose``) within 2% of max|y| of it."""
    expect = emulate(x, w, bias, out_fp32=y.dtype == torch.float32)
    assert y.dtype == expect.dtype and y.shape == expect.shape
    if not torch.equal(y, expect):
        diff = (y.double() - expect.double()).abs()
        pytest.fail(f"{int((diff > 0).sum())} of {y.numel()} outputs differ from the documented arithmetic, "
                    f"by up to {diff.max().item():.3g} (max|y| {expect.abs().max().item():.3g})")
    ref = reference(x.reshape(-1, w.shape[1]), w, bias).reshape(y.shape)
    assert ((y.double() - ref).abs() <= quantization_bound(x, w, bias, y)).all()
    if loose:
        assert rel_err(y, ref) < LOOSE


def test_fma32_rounds_once():
    # a product just below a tie of fp32 sums: 256 + 2^-15 + 2^-16 - 2^-62; the fp64 sum is the
    # tie itself (to even: 256 + 2^-14), the one rounding of fmaf goes down
    a = np.float32(2.0**-8 * (1 + 2.0**-23))
    b = np.float32(2.0**-8 * (1 - 2.0**-23))
    c = np.float32(256 + 2.0**-15)
    assert float(a) * float(b) == 2.0**-16 - 2.0**-62
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(256 + 2.0**-14)
    assert fma32(a, b, c) == c
    assert fma32(a, -b, -c) == -c
    assert fma32(np.float32(2.0**-8), np.float32(2.0**-8), c) == np.float32(256 + 2.0**-14)  # the tie: to even
    # random operands, against exact rational arithmetic
    from fractions import Fraction

    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(200).astype(np.float32) * np.float32(s) for s in (1, 1e-3, 1))
    got = fma32(a, b, c)
    for i in range(200):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        r = got[i]
        err = abs(Fraction(float(r)) - exact)
        for other in (np.nextafter(r, np.float32(-np.inf)), np.nextafter(r, np.float32(np.inf))):
            assert err <= abs(Fraction(float(other)) - exact), i


def test_activation_quantization_follows_the_documented_rounding(kernel):
    # dx = 2^-4 for the groups below (max|x| = 127/16, exact in bf16): x / dx is exact
    step = 2.0**-4
    x = torch.zeros(3, 64)
    x[0, :32] = torch.tensor([127, -3.5, 2.5, 0.5, -0.5, 1.5, 126.5, -126.5] + [0] * 24) * step  # ties
    x[0, 32:] = -127 * step  # a negative max
    x[1, 32:40] = torch.tensor([1e-3, 1.0, -1e-4, 0, 0, 0, 0, 0])  # all of row 1's first group zero
    x = x.to(BF16)
    assert torch.equal(x[0, :8].float() / step, torch.tensor([127, -3.5, 2.5, 0.5, -0.5, 1.5, 126.5, -126.5]))
    xq, dx = quantize_activations(x, 32)
    assert dx[0, 0] == dx[0, 1] == np.float32(step) and dx[1, 0] == dx[2, 0] == dx[2, 1] == 0
    assert xq[0, 0, :8].tolist() == [127, -4, 2, 0, 0, 2, 126, -126]  # half to even
    assert (xq[0, 1] == -127).all() and (xq[1, 0] == 0).all() and (xq[2] == 0).all()
    assert xq[1, 1, :3].tolist() == [0, 127, 0]
    # and the kernel quantizes so: codes that single out each column see its xq exactly
    for bits, group, offset in FORMATS:
        w = random_block(32, 64, bits, group, offset, seed=60)
        check_output(QLinear([QPart.from_block(w)], out_fp32=True)(x), x, w)
    # one weight row per column: y[m, j] = s * (value 1 * xq[m, j]) * dx[m] exactly (zeros 0)
    codes = np.zeros((64, 64), np.int8)
    np.fill_diagonal(codes, 1)
    eye = BlockWeight(codes, np.ones((64, 2), np.float32), np.zeros((64, 2), np.float32), 8, 32)
    y = QLinear([QPart.from_block(eye)], out_fp32=True)(x)
    assert torch.equal(y, torch.from_numpy(xq.reshape(3, 64).astype(np.float32) * np.repeat(dx, 32, 1)))
    # an all-zero input gives the bias, exactly
    bias = torch.randn(64, generator=torch.Generator().manual_seed(61))
    assert torch.equal(QLinear([QPart.from_block(eye)], bias, out_fp32=True)(torch.zeros(2, 64)), bias.expand(2, 64))


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
        # the values are what the format says: s * (code - offset) + z, IQ4: s * IQ4_VALUES[code] + z
        v = IQ4_VALUES[w.codes].astype(np.float32) if bits == CODES_IQ4 else w.codes.astype(np.float32) - offset
        expect = np.repeat(w.scales, group, 1) * v + np.repeat(w.zeros, group, 1)
        assert np.array_equal(w.dequantize(), expect)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_qlinear_computes_the_documented_product(kernel, fmt, with_bias):
    bits, group, offset = fmt
    n, k = 80, 256
    w = random_block(n, k, bits, group, offset, seed=3)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4)) if with_bias else None
    x = random_x(7, k)
    x[3, 64:96] = 0  # an all-zero group
    layer = QLinear([QPart.from_block(w)], bias, out_fp32=True)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (7, n)
    check_output(y, x, w, bias)  # bitwise the documented arithmetic; < 2% of max|y| from x @ W.T
    ref = reference(x, w, bias)
    assert 1e-4 < rel_err(y, ref) < 1e-2  # the int8 activations' error: there, and about 0.5%
    # bf16 output: the fp32 one rounded
    y16 = QLinear([QPart.from_block(w)], bias)(x)
    assert y16.dtype == BF16 and torch.equal(y16, y.to(BF16))
    check_output(y16, x, w, bias)
    # leading dimensions are kept; other input dtypes are cast to bf16
    assert torch.equal(layer(x.view(1, 7, k)), y.view(1, 7, n))
    assert torch.equal(layer(x.float()), y)
    # a strided input (rows of a wider tensor, as a slice leaves them) gives its rows' bits
    wide = torch.zeros(7, 2 * k, dtype=x.dtype)
    wide[:, 5 : 5 + k] = x
    assert torch.equal(layer(wide[:, 5 : 5 + k]), y)
    with pytest.raises(ValueError, match=f"rows of {k} values, got a tensor of shape \\(7, {k // 2}\\)"):
        layer(x[:, : k // 2])
    # the checks have power: the same numbers in another arrangement are far off
    wrong = BlockWeight(w.codes[:, ::-1].copy(), w.scales, w.zeros, bits, group, offset)
    assert rel_err(QLinear([QPart.from_block(wrong)], bias, out_fp32=True)(x), ref) > 0.1
    swapped = BlockWeight(w.codes, w.zeros, w.scales, bits, group, offset)
    assert rel_err(QLinear([QPart.from_block(swapped)], bias, out_fp32=True)(x), ref) > 0.1
    # and the emulation is no float product: the float reference is not bitwise it
    assert not torch.equal(reference(x, w, bias).float(), emulate(x, w, bias))


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
        check_output(singles_by_threads[(out_fp32, 1)], x, w, bias)


def bf16_bound(x: torch.Tensor, w: BlockWeight, ref: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """How far a bf16 computation of ``x @ W.T + bias`` may be from the exact one: output and
    bias roundings to bf16 (2^-8 relative each) and the weights rounded to bf16 (2^-9 relative)."""
    mag = x.double().abs() @ torch.from_numpy(np.abs(w.dequantize())).double().T
    if bias is not None:
        mag = mag + bias.double().abs()
    return 2.0**-7 * ref.abs() + 2.0**-8 * mag + 1e-6


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_forwards_are_invariant_up_to_the_limit_and_right_beyond(prefill_path, fmt):
    # the layer as the model runs it: up to DENSE_MIN_ROWS rows (decoding, tree verification)
    # every row is its 1-row result bitwise; larger forwards (prefill chunks) are too on the
    # kernel's prefill path, and on the bf16 copy give the product within bf16 roundings; the
    # fp32-output head stays on the kernel for any rows
    bits, group, offset = fmt
    n, k = 48, 96
    w = random_block(n, k, bits, group, offset, seed=40)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(41))
    x = random_x(140, k, seed=42)
    limit = kernel_prefill.DENSE_MIN_ROWS if prefill_path == "dense" else 140
    assert limit >= MAX_ROWS
    for out_fp32 in (False, True):
        layer = QLinear([QPart.from_block(w)], bias, out_fp32=out_fp32)
        singles = torch.cat([layer(x[i : i + 1]) for i in range(140)])
        check_output(singles, x, w, bias)
        for m in sorted({1, 2, 17, MAX_ROWS - 1, MAX_ROWS, limit}):
            assert torch.equal(layer(x[:m]), singles[:m]), m
        for m in (65, 100, 140):
            y = layer(x[:m])
            assert y.shape == (m, n) and y.dtype == (torch.float32 if out_fp32 else BF16)
            if out_fp32 or m <= limit:
                assert torch.equal(y, singles[:m]), m
                continue
            ref = reference(x[:m], w, bias)
            assert ((y.double() - ref).abs() <= bf16_bound(x[:m], w, ref, bias)).all(), m
            # the bound has power: the scales and offsets swapped are far outside it
            if m == 100:
                swapped = BlockWeight(w.codes, w.zeros, w.scales, bits, group, offset)
                bad = QLinear([QPart.from_block(swapped)], bias, out_fp32=out_fp32)(x[:m])
                assert not ((bad.double() - ref).abs() <= bf16_bound(x[:m], w, ref, bias)).all()


GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
FACTORED = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # a super-block's fp16 d (and dmin) times int8 scales
NO_OFFSETS = ("Q3_K", "Q6_K", "IQ4_XS")  # factored, with every zsup +0 (Q3_K, Q6_K: a code offset): scale mode 3 for the kernel


def gguf_block(name: str, n: int, blocks: int, seed: int) -> BlockWeight:
    """``gguf_blocks.decode`` of random raw ``name`` blocks, ``[n, blocks * block size]``."""
    import gguf

    from leapdecode.models.gguf_blocks import decode
    from helpers.kernels import random_raw

    qtype = gguf.GGMLQuantizationType[name]
    k = blocks * gguf.GGML_QUANT_SIZES[qtype][0]
    return decode(random_raw(qtype, n, k, seed=seed, scale=0.05), int(qtype), n, k)


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_gguf_blocks_on_the_kernel(force_kernel, name):
    # the GGUF formats' own scales (fp16 d and m, the K-quants' d * sc and dmin * m), whatever
    # form pack() keeps them in: exact weights, the documented product, bitwise batch invariance
    w = gguf_block(name, 48, 2, seed=50)
    k = w.shape[1]
    part = QPart.from_block(w)
    assert part.smode == (2 if name in FACTORED else 1)  # the file's fp16 scales are exact
    # Q3_K, Q6_K and IQ4_XS have no offsets: the kernel gets scale mode 3 (its few-row path skips their bytes)
    assert part.pointers()[5] == (3 if name in NO_OFFSETS else part.smode)
    assert np.array_equal(part.dequantize().numpy(), w.dequantize())
    x = random_x(70, k, seed=51)
    for out_fp32 in (False, True):
        layer = QLinear([part], out_fp32=out_fp32)
        y = layer(x)
        singles = torch.cat([layer(x[i : i + 1]) for i in range(70)])
        assert torch.equal(y, singles)
        for m in (1, 2, 33, 64, 65):
            assert torch.equal(layer(x[70 - m :]), singles[70 - m :]), m
        check_output(y, x, w)


def test_set_num_threads_is_restored():
    before = torch.get_num_threads()
    with _threads(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(FORMATS), units=st.integers(1, 9), ngroups=st.integers(1, 4),
       m=st.integers(1, 2 * MAX_ROWS + 3), seed=st.integers(0, 2**16), out_fp32=st.booleans(),
       xscale=st.sampled_from([1.0, 2.0**-120, 2.0**100]))
def test_random_shapes_are_exact_and_batch_invariant(force_kernel, fmt, units, ngroups, m, seed, out_fp32, xscale):
    bits, group, offset = fmt
    n, k = 16 * units, group * ngroups
    w = random_block(n, k, bits, group, offset, seed)
    part = QPart.from_block(w)
    assert np.array_equal(part.dequantize().numpy(), w.dequantize())
    layer = QLinear([part], out_fp32=out_fp32)
    x = (random_x(m, k, seed + 1).float() * xscale).to(BF16)  # tiny: subnormal products and sums
    y = layer(x)
    assert y.shape == (m, n)
    for i in sorted({0, m // 2, m - 1}):
        assert torch.equal(y[i : i + 1], layer(x[i : i + 1])), i
    check_output(y, x, w, loose=False)  # a 1-group row may be more than 2% off: the per-output bound


# ------------------------------------------------------------------ 3. the other code paths
# ld_simd() of each other build of kernels/qgemm.cpp (helpers/kernel_variants.py: KERNEL_VARIANTS)
VARIANT_SIMD = {"portable": 0, "avx2": 2, "avx2-vnni": 3, "no-amx": 1}


@pytest.fixture(scope="module", params=sorted(KERNEL_VARIANTS))
def other_path(request, tmp_path_factory):
    """The portable and the AVX2 builds of kernels/qgemm.cpp, and where the CPU has them the AVX2 build with
    AVX-VNNI and (on an AMX CPU) the tile-less AVX-512 build, loaded."""
    lib = build_kernel_variant(tmp_path_factory, kernel_library.SOURCE, ("ld_qgemm", "ld_work_bytes"), request.param)
    lib.ld_simd.restype = ctypes.c_int
    assert lib.ld_simd() == VARIANT_SIMD[request.param], request.param
    return lib


def call_qgemm(lib, part: QPart, x: torch.Tensor, bias: torch.Tensor | None, out_fp32: bool) -> torch.Tensor:
    """``lib.ld_qgemm`` on one part with the arguments ``QLinear.forward`` passes."""
    x2 = x.to(BF16).contiguous()
    m, k, n = x2.shape[0], part.in_features, part.out_features
    y = torch.empty(m, n, dtype=torch.float32 if out_fp32 else BF16)
    work = torch.empty(lib.ld_work_bytes(k, part.group), dtype=torch.uint8)
    b = None if bias is None else bias.float().contiguous()
    rc = lib.ld_qgemm(x2.data_ptr(), m, k, k, *part.pointers(), n, None if b is None else b.data_ptr(),
                      y.data_ptr(), n, int(out_fp32), torch.get_num_threads(), work.data_ptr())
    assert rc == 0
    return y


GGUF_CASES = ["Q4_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"]
PORTABLE_CASES = FORMATS + [(name,) for name in GGUF_CASES]


@pytest.mark.parametrize("case", PORTABLE_CASES, ids=FORMAT_IDS + GGUF_CASES)
def test_other_code_paths_give_the_same_bits(force_kernel, other_path, case):
    # (where the library QLinear runs takes the same path, two builds of it are compared)
    if len(case) == 1:
        w = gguf_block(case[0], 80, 1, seed=70)
    else:
        w = random_block(80, 128, *case, seed=70)
    n, k = w.shape
    part = QPart.from_block(w)
    if len(case) == 1:
        assert part.smode == (1 if case[0] == "IQ4_NL" else 2)  # the factored K-quant scales (IQ4_NL: fp16 d)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(71))
    x = random_x(70, k, seed=72)
    x[4, :32] = 0
    for out_fp32 in (False, True):
        layer = QLinear([part], bias, out_fp32=out_fp32)
        for m in (1, 5, 14, 20, 70):  # (AMX: 14 on tiles; 20 = 16 on tiles + 4 not; 70 = 4 x 16 + 6)
            y = layer(x[:m])
            assert torch.equal(call_qgemm(kernel_library.library(), part, x[:m], bias, out_fp32), y), m
            for threads in (1, 2):
                with _threads(threads):
                    assert torch.equal(call_qgemm(other_path, part, x[:m], bias, out_fp32), y), (m, threads)
        check_output(y, x, w, bias)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", [0, 9, 31])  # first, middle and last value of a group
def test_a_non_finite_activation_makes_its_row_nan_on_every_path(force_kernel, other_path, bad, where):
    # the SIMD quantizers' max drops a NaN operand unless NaNs are looked for apart
    w = random_block(32, 128, 4, 32, seed=80)
    part = QPart.from_block(w)
    x = random_x(6, 128, seed=81)
    x[2, 64 + where] = bad
    layer = QLinear([part], None, out_fp32=True)
    y = layer(x)
    assert torch.isnan(y[2]).all()
    good = [0, 1, 3, 4, 5]
    assert not torch.isnan(y[good]).any()
    assert torch.equal(y[good], layer(x[good]))  # the other rows keep their bits
    for lib in (kernel_library.library(), other_path):
        z = call_qgemm(lib, part, x, None, True)
        assert torch.equal(z.isnan(), y.isnan()) and torch.equal(z[good], y[good])


# ------------------------------------------------------------------ 4. parts, padding
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
    for w, b, ys in zip((w1, w2, w3), bias.split([48, 32, 16]), singles):
        check_output(ys, x, w, b)  # each part quantizes the activations in its own groups
    # two parts only, no bias
    pair = QLinear([QPart.from_block(w2), QPart.from_block(w1)], out_fp32=out_fp32)
    assert torch.equal(pair(x), torch.cat([QLinear([QPart.from_block(w)], out_fp32=out_fp32)(x)
                                           for w in (w2, w1)], dim=-1))
    # and it is the product with the stacked weight
    stacked = np.concatenate([w.dequantize() for w in (w1, w2, w3)])
    assert np.array_equal(fused.dequantize().numpy(), stacked)
    ref = x.double() @ torch.from_numpy(stacked).double().T + bias.double()
    assert rel_err(y, ref) < LOOSE
    for i in (0, 63, 64, 69):
        assert torch.equal(fused(x[i : i + 1]), y[i : i + 1])


@pytest.mark.parametrize("out_fp32", [False, True])
def test_row_subsets_give_the_layers_own_bits(force_kernel, out_fp32):
    """``first_rows`` (views of the packed rows) and ``gather_rows`` (copies of the 16-row units
    that hold the rows asked for) give exactly the full layer's outputs for those rows, across
    parts of different formats, with a bias, a padded last part, and any number of rows."""
    k = 128
    ws = [random_block(48, k, 4, 32, 0, seed=30), random_block(32, k, 6, 16, 32, seed=31),
          random_block(20, k, 8, 32, 0, seed=32)]  # the last part padded to 32 rows
    bias = torch.randn(100, generator=torch.Generator().manual_seed(33))
    layer = QLinear([QPart.from_block(w) for w in ws], bias, out_fp32=out_fp32, out_features=100)
    x = random_x(13, k, seed=34)
    full = layer(x)
    for n in (1, 16, 40, 48, 49, 80, 95, 100):
        sub = layer.first_rows(n)
        assert sub.out_features == n
        assert torch.equal(sub(x), full[:, :n]), n
        for i in (0, 7, 12):  # and its rows alone
            assert torch.equal(sub(x[i : i + 1]), full[i : i + 1, :n])
    # a prefix of whole units shares the layer's tensors
    head = layer.first_rows(32)
    assert head.parts[0].codes.data_ptr() == layer.parts[0].codes.data_ptr()
    assert head.parts[0].codes.numel() * 48 == layer.parts[0].codes.numel() * 32
    for ids in ([99], [3, 97, 50, 51, 3 + 16, 47, 48], list(range(100))[::-7], [80, 79]):
        rows, cols = layer.gather_rows(torch.tensor(ids))
        y = rows(x)
        assert torch.equal(y[:, cols], full[:, ids]), ids
        starts = [0, 48, 80]  # the parts' first rows: a unit is (part, row within it // 16)
        units = {(j, (i - starts[j]) // 16) for i in ids for j in [max(j for j, s0 in enumerate(starts) if i >= s0)]}
        assert rows.out_features == 16 * len(units)  # only the units that hold the rows
    with pytest.raises(ValueError):
        layer.first_rows(101)
    with pytest.raises(ValueError):
        layer.gather_rows(torch.tensor([100]))


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
    check_output(y, x, w, bias)
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
        if bits != CODES_IQ4:  # (IQ4's table has no 0: a padded row's scale 0 makes its weights 0)
            assert np.array_equal(p.values()[20:], np.zeros((12, 64), np.int32))
        assert np.array_equal(p.scales[20:], np.zeros((12, 64 // group), np.float32))
        assert np.array_equal(p.dequantize()[20:], np.zeros((12, 64), np.float32))
        assert np.array_equal(p.dequantize()[:20], w.dequantize())
    w = random_block(32, 64, 4, 32, seed=24)
    assert padded(w) is w


def test_qlinear_refuses_inconsistent_parts_bias_and_out_features(kernel):  # QLinear asks the library its work size
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


# ------------------------------------------------------------------ 5. layout, scale modes, sizes
def unpack(p: dict, bits: int, group: int, n: int, k: int) -> np.ndarray:
    """The codes ``[n, k]`` (8-bit: the signed values) from ``pack``'s bytes, read as
    kernels/qgemm.cpp documents the layout: units of 16 rows, one block per (unit, group) of G/4
    quad vectors of 64 codes; element e of quad q is (row 16 u + e / 4, column G g + 4 q + e % 4);
    4-bit: quads q, q + 1 (q even) share 64 bytes (low nibble: q, high nibble: q + 1); 6-bit: the
    low nibbles so (8 G bytes), then the high 2 bits of quads q..q+3 (q % 4 == 0) in 64 bytes
    (bits 2j, 2j+1 of byte e: element e of quad q + j); 8-bit: one byte, value + 128; 2-bit: quads
    q..q+3 share 64 bytes as the 6-bit's high bits (4 G bytes); 3-bit: so its low 2 bits, then 8 bytes a
    quad of third bits (bit e % 8 of byte e / 8: element e); IQ4: indices laid out as 4-bit codes."""
    raw = p["codes"].numpy()
    ng = k // group
    per = UNIT_BYTES[bits] * group
    assert raw.size == (n // 16) * ng * per
    out = np.zeros((n, k), np.int32)
    for u in range(n // 16):
        for g in range(ng):
            blk = raw[(u * ng + g) * per : (u * ng + g + 1) * per]
            for q in range(group // 4):
                for e in range(64):
                    if bits == 8:
                        code = int(blk[q * 64 + e]) - 128
                    elif bits in (2, 3):
                        code = (int(blk[(q >> 2) * 64 + e]) >> (2 * (q & 3))) & 3
                        if bits == 3:
                            code |= ((int(blk[4 * group + 8 * q + e // 8]) >> (e % 8)) & 1) << 2
                    else:
                        byte = int(blk[(q >> 1) * 64 + e])
                        code = byte >> 4 if q & 1 else byte & 15
                        if bits == 6:
                            code |= ((int(blk[8 * group + (q >> 2) * 64 + e]) >> (2 * (q & 3))) & 3) << 4
                    out[16 * u + e // 4, group * g + 4 * q + e % 4] = code
    return out


def by_row(t: torch.Tensor) -> np.ndarray:
    """``[N/16, cols, 16]`` (entry [u, c, j]: row 16 u + j) as ``[N, cols]``."""
    u, cols, _ = t.shape
    return t.numpy().transpose(0, 2, 1).reshape(16 * u, cols)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_pack_writes_the_documented_layout(fmt):
    bits, group, offset = fmt
    n, k = 32, 2 * group
    w = random_block(n, k, bits, group, offset, seed=30)
    p = pack(w)
    assert p["codes"].dtype == torch.uint8
    assert p["codes"].numel() == n * k * UNIT_BYTES[bits] // 16
    assert p["scales"].shape == p["zeros"].shape == (n // 16, k // group, 16)
    assert np.array_equal(unpack(p, bits, group, n, k), w.codes.astype(np.int32))
    # random fp32 scales: scale mode 0, scales[u, g, j] is row 16 u + j's scale of group g
    assert p["smode"] == 0 and p["scales"].dtype == p["zeros"].dtype == torch.float32
    assert np.array_equal(by_row(p["scales"]), w.scales) and np.array_equal(by_row(p["zeros"]), w.zeros)
    # QPart keeps exactly those tensors
    part = QPart.from_block(w)
    assert torch.equal(part.codes, p["codes"]) and torch.equal(part.scales, p["scales"])
    spec = part.spec()
    assert {key: spec[key] for key in ("bits", "group", "offset", "out_features", "in_features", "smode")} == {
        "bits": bits, "group": group, "offset": offset, "out_features": n, "in_features": k, "smode": 0}
    assert part.nbytes() == sum(t.numel() * t.element_size() for t in part.buffers())
    assert part.nbytes() >= p["codes"].numel() + 2 * p["scales"].numel()


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FORMATS), row=st.integers(0, 47), col=st.integers(0, 63), code=st.integers(1, 63))
def test_one_code_lands_where_the_layout_says(fmt, row, col, code):
    bits, group, offset = fmt
    n, k = 48, 64
    top = {2: 4, 3: 8, 6: 64, 8: 64}.get(bits, 16)
    code = (code - 1) % (top - 1) + 1
    value = -code if bits == 8 and code % 2 else code  # 8-bit: negative values too
    codes = np.zeros((n, k), np.uint8 if bits != 8 else np.int8)
    codes[row, col] = value
    w = BlockWeight(codes, np.ones((n, k // group), np.float32), np.zeros((n, k // group), np.float32), bits,
                    group, offset)
    raw = pack(w)["codes"].numpy()
    per = UNIT_BYTES[bits] * group
    u, g, q, e = row // 16, col // group, (col % group) // 4, 4 * (row % 16) + col % 4
    base = (u * (k // group) + g) * per
    if bits == 8:  # every other byte holds value 0 as 128
        expect = np.full_like(raw, 128)
        expect[base + q * 64 + e] = value + 128
    elif bits in (2, 3):
        expect = np.zeros_like(raw)
        expect[base + (q >> 2) * 64 + e] = (code & 3) << (2 * (q & 3))
        if bits == 3:
            expect[base + 4 * group + 8 * q + e // 8] = (code >> 2) << (e % 8)
    else:
        expect = np.zeros_like(raw)
        expect[base + (q >> 1) * 64 + e] = (code & 15) << (4 if q & 1 else 0)
        if bits == 6:
            expect[base + 8 * group + (q >> 2) * 64 + e] = (code >> 4) << (2 * (q & 3))
    assert np.array_equal(raw, expect), np.flatnonzero(raw != expect)


def factored(n: int, k: int, seed: int, gps: int = 8, dsup=None, zsup=None, pow2: bool = False) -> BlockWeight:
    """A K-quant-like 4-bit weight: scales = dsup * sc, zeros = zsup * mc per super-block of
    ``gps`` groups of 32 (int8 sc, mc, 0..63 or with ``pow2`` 1..32; fp32 products), with fp16
    dsup, zsup unless given."""
    rng = np.random.default_rng(seed)
    ng = k // 32
    if pow2:
        sc, mc = ((1 << rng.integers(0, 6, (n, ng))).astype(np.int8) for _ in range(2))
    else:
        sc, mc = (rng.integers(0, 64, (n, ng)).astype(np.int8) for _ in range(2))
    if dsup is None:
        dsup = (rng.random((n, -(-ng // gps))) * 1e-3).astype(np.float16).astype(np.float32)
    if zsup is None:
        zsup = -(rng.random((n, -(-ng // gps))) * 1e-3).astype(np.float16).astype(np.float32)
    idx = np.arange(ng) // gps
    scales = dsup[:, idx] * sc.astype(np.float32)
    zeros = zsup[:, idx] * mc.astype(np.float32)
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    return BlockWeight(codes, scales, zeros, 4, 32, factors=(sc, mc, dsup, zsup, gps))


def test_pack_scale_modes(kernel):
    n, k = 32, 512
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    w0 = random_block(n, k, 4, 32, seed=32)
    w1 = BlockWeight(w0.codes, f16(w0.scales), f16(w0.zeros), 4, 32)
    w2 = factored(n, k, seed=33)
    sc, mc, dsup, zsup, gps = w2.factors
    cases = [
        (w0, 0),  # fp32 scales fp16 cannot hold
        (w1, 1),  # fp16 values (the legacy GGUF types' d, m, -8 d)
        (BlockWeight(w0.codes, w1.scales, w0.zeros, 4, 32), 0),  # fp16 scales, fp32 zeros
        (BlockWeight(w0.codes, w0.scales, w1.zeros, 4, 32), 0),  # and the other way round
        (w2, 2),  # K-quants: int8 sc, mc and fp16 dsup, zsup
        (factored(n, k, 34, dsup=f16(dsup) * np.float32(1 + 2.0**-20)), 0),  # dsup no fp16: fp32 products
        (factored(n, k, 35, zsup=f16(zsup) * np.float32(1 + 2.0**-20)), 0),  # zsup no fp16
        (factored(n, k, 36, dsup=np.full_like(dsup, 1e5)), 0),  # dsup past fp16's range
        (factored(n, 384, 37), 0),  # 12 groups: no whole super-blocks of 8; fp32 products
        (factored(n, 384, 37, pow2=True), 1),  # ... whose products are fp16 values
    ]
    for w, mode in cases:
        p = pack(w)
        assert p["smode"] == mode, mode
        part = QPart.from_block(w)
        assert part.smode == mode and part.scales.dtype == {0: torch.float32, 1: torch.float16, 2: torch.int8}[mode]
        if mode < 2:
            assert "dsup" not in p and part.dsup is None and part.gps == 1
            assert np.array_equal(by_row(p["scales"]).astype(np.float32), w.scales)
            assert np.array_equal(by_row(p["zeros"]).astype(np.float32), w.zeros)
        # whatever the mode: the same weights and the documented product
        assert np.array_equal(part.dequantize().numpy(), w.dequantize()), mode
        x = random_x(5, w.shape[1], seed=38)
        check_output(QLinear([part], out_fp32=True)(x), x, w)
    # mode 2's tensors: sc, mc int8 [N/16, K/G, 16]; dsup, zsup fp16 [N/16, K/G/gps, 16]
    p = pack(w2)
    assert p["gps"] == gps == 8 and p["scales"].dtype == p["zeros"].dtype == torch.int8
    assert p["dsup"].dtype == p["zsup"].dtype == torch.float16 and p["dsup"].shape == (n // 16, k // 32 // gps, 16)
    assert np.array_equal(by_row(p["scales"]), sc) and np.array_equal(by_row(p["zeros"]), mc)
    assert np.array_equal(by_row(p["dsup"]).astype(np.float32), dsup)
    assert np.array_equal(by_row(p["zsup"]).astype(np.float32), zsup)
    idx = np.arange(k // 32) // gps
    assert np.array_equal(by_row(p["dsup"]).astype(np.float32)[:, idx] * sc.astype(np.float32), w2.scales)
    # and QPart checks them
    args = dict(bits=4, group=32, offset=0, out_features=n, in_features=k)
    QPart(**p, **args)
    for bad in ({**p, "dsup": p["dsup"][:, :1]}, {**p, "zsup": p["zsup"].float()}, {**p, "dsup": None},
                {**p, "gps": 3}):
        with pytest.raises(ModelFileError, match="super-block"):
            QPart(**bad, **args)
    with pytest.raises(ModelFileError, match="scale mode"):
        QPart(**{**p, "scales": p["scales"].float()}, **args)


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
        (p, {**args, "bits": 8 if bits in (4, CODES_IQ4) else 4}),  # codes of another size
    ]
    for tensors, a in cases:
        with pytest.raises(ModelFileError, match="wrong sizes"):
            QPart(**tensors, **a)


# ------------------------------------------------------------------ 6. tiny models
TREE = [-1, 0, 1, 1, 3, 0, 5, 6, 2, 8]  # branches, and a chain of depth 5
CHAIN = list(range(-1, 11))


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
    from leapdecode.models.blockquant import load_packed, packed_contents, quantize_native, save_packed
    from leapdecode.models.tiny import tiny_native

    model = tiny_native(seed=4, qkv_bias=qkv_bias)
    kinds = quantize_native(model)
    assert set(kinds) == {"int4-g32"} and kinds["int4-g32"] > 0
    model.attention = "invariant"
    with pytest.raises(ValueError, match="already quantized"):
        quantize_native(model)
    path = tmp_path / "tiny.safetensors"
    save_packed(*packed_contents(model), path)
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


def test_kernel_arguments_follow_moved_buffers(force_kernel):
    # QLinear keeps its parts' kernel arguments (pointers) between calls; moving the buffers
    # (share_memory(), to()) must make it build them again
    w = random_block(32, 64, 4, 32, 0, seed=90)
    layer = QLinear([QPart.from_block(w)])
    x = random_x(3, 64, seed=91)
    y = layer(x)
    before = layer._calls()[0][0][0]
    assert before == layer.parts[0].codes.data_ptr()
    layer.share_memory()
    assert layer.parts[0].codes.data_ptr() != before  # really moved
    assert layer._calls()[0][0][0] == layer.parts[0].codes.data_ptr()
    assert torch.equal(layer(x), y)


# --------------------------------------------------------------------------- the prefill path
def test_prefill_path_follows_the_measured_ratios(kernel, monkeypatch):
    # a layer's forwards of more than DENSE_MIN_ROWS rows go to the bf16 copy only where the
    # measured ratios, weighted by its parts' sizes, say the kernel is slower; no copy is built
    # otherwise (its memory is never spent)
    fast4 = QPart.from_block(random_block(64, 96, 4, 32, seed=50))  # 6144 weights
    slow6 = QPart.from_block(random_block(32, 96, 6, 16, 32, seed=51))  # 3072 weights
    x = random_x(kernel_prefill.DENSE_MIN_ROWS + 6, 96, seed=52)
    monkeypatch.delenv(kernel_prefill.PREFILL_ENV, raising=False)
    monkeypatch.setenv(kernel_prefill.DENSE_BUDGET_ENV, "64")  # copies allowed (none by default)
    monkeypatch.setattr(kernel_prefill, "DENSE_BUDGET", kernel_prefill.DenseBudget())
    measure = qkernel.measure_prefill_ratio  # (what QLinear passes; the ratios are replaced here)
    for r4, r6, dense in ((0.8, 1.3, False), (0.8, 1.5, True), (1.1, 0.5, False), (1.2, 1.01, True)):
        monkeypatch.setattr(kernel_prefill, "prefill_ratios", lambda measure, r4=r4, r6=r6: {(4, 32): r4, (6, 16): r6})
        assert kernel_prefill.prefill_on_dense([fast4, slow6], measure) is (6144 * r4 + 3072 * r6 > 9216)
        assert kernel_prefill.prefill_on_dense([fast4, slow6], measure) is dense
        layer = QLinear([fast4, slow6])
        y = layer(x)
        assert (layer._dense is not None) is dense
        rows = torch.cat([layer(x[i : i + 1]) for i in range(0, x.shape[0], 7)])
        assert torch.equal(y[::7], rows) is not dense  # the kernel: each row its 1-row bits
    for forced in ("dense", "kernel"):  # the variable overrides the measurement
        monkeypatch.setenv(kernel_prefill.PREFILL_ENV, forced)
        assert kernel_prefill.prefill_on_dense([fast4], measure) is (forced == "dense")


def test_bf16_prefill_copies_stay_within_their_memory_budget(kernel, monkeypatch, capsys):
    """Issue 62: the bf16 copies a prefill may run on cost 2 bytes a weight (a 7B's: 14 GB beside its
    4 GB of blocks). None is kept by default; with ``LEAPDECODE_DENSE_BUDGET_MB`` they are kept while all
    of them fit; past it a layer prefills on the kernel, said once; a layer's bytes come back when it
    is collected."""
    import gc

    monkeypatch.setenv(kernel_prefill.PREFILL_ENV, "dense")
    budget = kernel_prefill.DenseBudget()
    monkeypatch.setattr(kernel_prefill, "DENSE_BUDGET", budget)
    one = 2 * 64 * 96  # one layer's bf16 copy
    monkeypatch.setenv(kernel_prefill.DENSE_BUDGET_ENV, str(2.5 * one / 2**20))  # room for two
    x = random_x(kernel_prefill.DENSE_MIN_ROWS + 6, 96, seed=53)
    layers = [QLinear([QPart.from_block(random_block(64, 96, 4, 32, seed=60 + i))]) for i in range(3)]
    outs = [layer(x) for layer in layers]
    assert [layer._dense is not None for layer in layers] == [True, True, False]
    assert budget.used == 2 * one and budget.refused == one
    rows = torch.cat([layers[2](x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(outs[2], rows)  # the refused layer prefilled on the kernel: each row its 1-row bits
    err = capsys.readouterr().err
    assert err.count("prefill runs on the int4 kernel") == 1 and kernel_prefill.DENSE_BUDGET_ENV in err
    del layers, outs
    gc.collect()
    assert budget.used == 0
    monkeypatch.delenv(kernel_prefill.DENSE_BUDGET_ENV)
    default = kernel_prefill.DenseBudget()
    monkeypatch.setattr(kernel_prefill, "DENSE_BUDGET", default)
    layer = QLinear([QPart.from_block(random_block(64, 96, 4, 32, seed=70))])
    assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])]))  # on the kernel
    assert layer._dense is None and default.limit == 0 and "prefill runs" not in capsys.readouterr().err
    monkeypatch.setenv(kernel_prefill.DENSE_BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match=kernel_prefill.DENSE_BUDGET_ENV):
        assert kernel_prefill.DenseBudget().limit


def test_prefill_ratios_are_measured_once_and_kept(kernel, monkeypatch, tmp_path):
    calls = []

    def measured(bits, group, rounds=3):
        calls.append((bits, group))
        return 0.5 + bits / 10 + group / 100

    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path))
    kernel_prefill.prefill_ratios.cache_clear()
    try:
        first = kernel_prefill.prefill_ratios(measured)
        assert sorted(calls) == sorted(kernel_pack.FORMATS)
        assert first[(4, 32)] == pytest.approx(0.5 + 0.4 + 0.32)
        kernel_prefill.prefill_ratios.cache_clear()  # a new process: read back from the file
        assert kernel_prefill.prefill_ratios(measured) == pytest.approx(first) and len(calls) == len(first)
        stored = (tmp_path / "kernels" / "prefill.json").read_text()
        assert kernel_library.build_key() in stored
        (tmp_path / "kernels" / "prefill.json").write_text("{not json")  # a corrupt file: measured again
        kernel_prefill.prefill_ratios.cache_clear()
        assert kernel_prefill.prefill_ratios(measured) == pytest.approx(first) and len(calls) == 2 * len(first)
        # entries of other builds past their age are dropped when the file is written; recent ones stay
        import json
        import time

        path = tmp_path / "kernels" / "prefill.json"
        old = {"time": time.time() - kernel_prefill.PREFILL_PROFILE_MAX_AGE_S - 1, "ratios": {}}
        recent = {"time": time.time() - 60, "ratios": {}}
        path.write_text(json.dumps({"stale-build-t2": old, "other-build-t2": recent, "odd": "x"}))
        kernel_prefill.prefill_ratios.cache_clear()
        kernel_prefill.prefill_ratios(measured)
        kept = json.loads(path.read_text())
        assert "stale-build-t2" not in kept and "odd" not in kept and kept["other-build-t2"] == recent
        assert len(kept) == 2 and len(calls) == 3 * len(first)
    finally:
        kernel_prefill.prefill_ratios.cache_clear()


def test_measured_prefill_ratio_is_a_sane_time_ratio(kernel):
    r = qkernel.measure_prefill_ratio(4, 32, rounds=1)
    assert 0.02 < r < 50.0


def _fake_compiler(tmp_path, monkeypatch, first_lines: str) -> None:
    """kernel_library's compiler: a script that runs ``first_lines``, then writes an empty file where ``-o`` says."""
    fake = tmp_path / "fake-cxx"
    fake.write_text(f'#!/bin/sh\n{first_lines}\nfor a; do [ "$prev" = "-o" ] && : > "$a"; prev="$a"; done\n')
    fake.chmod(0o755)
    monkeypatch.setattr(kernel_library, "compiler", lambda: str(fake))


def test_a_failing_compiler_is_a_clear_error_and_leaves_no_temp_files(tmp_path, monkeypatch):
    # the build compiles qgemm.cpp's parts and attention.cpp at once (kernel_library.PARTS); one part's
    # error names the compiler and its last message, and neither the object files nor the
    # half-written library stay behind
    _fake_compiler(tmp_path, monkeypatch, 'case "$*" in *LD_PART=6*) echo "qgemm.cpp:1: error: boom" >&2; exit 1;; esac')
    target = tmp_path / "kernels" / "qgemm-test.so"
    with pytest.raises(kernel_library.KernelUnavailable, match="fake-cxx failed: qgemm.cpp:1: error: boom"):
        kernel_library.build_library(target)
    # only the compiler's output stays, kept for `leapdecode doctor`
    assert sorted(p.name for p in target.parent.iterdir()) == ["qgemm-test.log"]
    assert "qgemm.cpp:1: error: boom" in kernel_library.build_log(target).read_text()


def test_the_build_links_every_part_it_compiled(tmp_path, monkeypatch):
    # a compiler that records its calls: one compile per part (each with -c and its own object),
    # then one link of exactly those objects into the target
    log = tmp_path / "calls"
    _fake_compiler(tmp_path, monkeypatch, f'echo "$*" >> {log}')
    target = tmp_path / "kernels" / "qgemm-test.so"
    target.parent.mkdir()
    kernel_library.build_log(target).write_text("an earlier failure")
    kernel_library.build_library(target)
    calls = log.read_text().splitlines()
    compiles = [c for c in calls if " -c " in c]
    links = [c for c in calls if " -c " not in c]
    assert len(compiles) == len(kernel_library.PARTS) and len(links) == 1
    assert all("-shared" not in c for c in compiles)
    objects = [c.split(" -o ")[1] for c in compiles]
    assert len(set(objects)) == len(objects) and all(o in links[0].split() for o in objects)
    assert sorted(c.split("-DLD_PART=")[1][0] for c in compiles if "LD_PART" in c) == ["0", "2", "4", "6", "8", "9"]
    # the library and the digest its build recorded (tests/test_kernel_cache.py), nothing else (an
    # earlier failure's log is gone)
    assert target.exists() and sorted(p.name for p in target.parent.iterdir()) == [target.name, digest_path(target).name]


def test_a_build_keeps_only_the_most_recent_other_libraries(tmp_path, monkeypatch):
    # libraries of earlier versions pile up in the cache (one per source change): a build keeps
    # itself and the KEEP_BUILDS - 1 newest others, and touches nothing else
    import os

    _fake_compiler(tmp_path, monkeypatch, ":")
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    old = []
    for i in range(5):
        p = kernels / f"qgemm-old{i}.so"
        p.write_bytes(b"x")
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
        old.append(p.name)
    (kernels / "notes.txt").write_text("mine")
    target = kernels / "qgemm-new.so"
    kernel_library.build_library(target)
    kept = sorted(p.name for p in kernels.iterdir())
    assert kept == sorted([target.name, digest_path(target).name, "notes.txt",
                           *old[5 - (kernel_library.KEEP_BUILDS - 1):]])


# every instruction-set path of the kernel sources, whatever this CPU runs: a syntax-only compile
# (templates instantiated, no code generated: ~1 s each), so an edit that breaks the AVX-512 path
# fails here on an AVX2 machine and the other way round; LD_PART=0 checks the split build's guards
PATH_FLAGS = {"avx512-vnni": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
              "amx": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"),
              "avx2": ("-mavx2", "-mfma", "-mf16c"), "avx2-vnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
              "portable": ("-DLD_PORTABLE",)}


@pytest.mark.parametrize("part", [None, 0, "attention", "layers"])
@pytest.mark.parametrize("path", sorted(PATH_FLAGS))
def test_every_path_of_the_kernel_sources_compiles(path, part):
    import platform
    import subprocess

    cxx = kernel_library.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if path != "portable" and not x86:
        pytest.skip(f"the {path} path is x86 code; this is {platform.machine()}")
    source = {"attention": kernel_library.ATTENTION_SOURCE,
              "layers": kernel_library.LAYERS_SOURCE}.get(part, kernel_library.SOURCE)
    extra = (f"-DLD_PART={part}",) if isinstance(part, int) else ()
    flags = [f for f in kernel_library.CXXFLAGS if f not in ("-march=native", "-shared")]
    march = ("-march=x86-64-v2",) if x86 else ()
    proc = subprocess.run([cxx, *flags, *march, *PATH_FLAGS[path], *extra, "-fsyntax-only", str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_package_data_ships_every_kernel_source_and_header():
    # a wheel holds what pyproject's package-data names: a header left out (bf16.h once was) makes an
    # installed package's first kernel build fail
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["leapdecode.models"]
    package = kernel_library.SOURCE.parents[1]
    needed = [p.relative_to(package).as_posix() for p in (*kernel_library.SOURCES, *kernel_library.HEADERS)]
    assert set(needed) == {p.relative_to(package).as_posix() for p in kernel_library.SOURCE.parent.iterdir()
                           if p.suffix in (".cpp", ".h")}  # SOURCES and HEADERS name every file there
    assert all(any(fnmatch.fnmatch(n, g) for g in globs) for n in needed), (needed, globs)
