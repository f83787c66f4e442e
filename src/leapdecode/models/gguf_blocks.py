"""GGUF block formats -> ``BlockWeight`` (codes, fp32 scales and offsets) without re-quantizing.

Every GGML block type used by the registered models is a set of small integer codes with one
scale (and for some an offset) per group of 16 or 32 weights.  This module reads those codes
and computes the per-group scale ``s`` and offset ``z`` in fp32 so that ``w = s * q + z`` is the
value llama.cpp's dequantization gives (the products ``d * sc`` and ``dmin * m`` of an fp16 and
a 6- or 8-bit integer are exact in fp32):

* Q4_0  ``d * (q - 8)``        -> 4-bit codes q, s = d, z = -8 d          (group 32)
* Q4_1  ``d * q + m``          -> 4-bit, s = d, z = m                      (group 32)
* Q5_0  ``d * (q - 16)``       -> 6-bit storage, value q - 16, s = d       (group 32)
* Q5_1  ``d * q + m``          -> 6-bit storage, s = d, z = m              (group 32)
* Q8_0  ``d * q``              -> 8-bit, s = d                             (group 32)
* Q4_K  ``d sc q - dmin m``    -> 4-bit, s = d sc, z = -dmin m             (group 32)
* Q5_K  ``d sc q - dmin m``    -> 6-bit storage, s = d sc, z = -dmin m     (group 32)
* Q6_K  ``d sc (q - 32)``      -> 6-bit storage, value q - 32, s = d sc    (group 16)
* Q2_K  ``d sc q - dmin m``    -> 2-bit, s = d sc, z = -dmin m             (group 16)
* Q3_K  ``d sc (q - 4)``       -> 3-bit, value q - 4, s = d sc             (group 16)
* IQ4_NL ``d kv[q]``           -> IQ4 indices q (``CODES_IQ4``: the kernel looks up the type's
                                  16 signed values kv), s = d                 (group 32)
* IQ4_XS ``d sc kv[q]``        -> IQ4 indices q, s = d sc                  (group 32)

Packed, a weight takes about the file's bits: Q2_K 3.13 bits a weight (the file 2.63: the kernel keeps
an int8 scale and offset per 16 weights where the file has 4 bits each), Q3_K 3.56 (3.44), IQ4_NL
4.5 (4.5), IQ4_XS 4.56 (4.25).  Any other type (F32, F16, BF16, the other IQ types, TQ*, MXFP4) is dequantized with the ``gguf``
package and re-quantized to symmetric 8-bit codes in groups of 32 (``requantize_q8``): near-lossless,
but not the file's numbers, and 10 bits a weight packed (fp32 scales and offsets per group).  The block layouts
follow ggml's ``ggml-quants.c`` (``dequantize_row_*``); tests/test_gguf_blocks.py checks every
decoder against the ``gguf`` package's own dequantization.
"""

from __future__ import annotations

import numpy as np

from .kernel_pack import CODES_IQ4, BlockWeight

# GGMLQuantizationType values (gguf.constants)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16 = 10, 11, 12, 13, 14, 20, 23, 30
NATIVE_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q2_K: "Q2_K", Q3_K: "Q3_K",
                Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS"}
BLOCK_BYTES = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
               Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
               IQ4_NL: (32, 18), IQ4_XS: (256, 136)}


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis' 2 bytes, as fp32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles first, then high nibbles (Q4_0/Q4_1/Q5_*)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of fifth bits -> [..., 32] bits (bit j of the little-endian uint32)."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def decode(raw: np.ndarray, qtype: int, n: int, k: int) -> BlockWeight:
    """A ``[n, k]`` tensor's raw blocks (``n * k / block * bytes`` uint8) as a ``BlockWeight``."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGML type {qtype} has no direct block mapping")
    per, nbytes = BLOCK_BYTES[qtype]
    if k % per:
        raise ValueError(f"row length {k} is not a multiple of the block size {per}")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per, nbytes)
    if qtype in (Q2_K, Q3_K, IQ4_NL, IQ4_XS):
        return _decode_low(b, qtype, n, k)
    if qtype in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        d = _f16(b[..., 0:2])  # [n, k / 32]
        if qtype == Q8_0:
            codes = b[..., 2:].view(np.int8).reshape(n, k)
            return BlockWeight(codes, d, np.zeros_like(d), 8, 32)
        m = _f16(b[..., 2:4]) if qtype in (Q4_1, Q5_1) else None
        if qtype in (Q4_0, Q4_1):
            q = _nibbles(b[..., nbytes - 16:])
            codes = q.reshape(n, k)
            return BlockWeight(codes, d, -8.0 * d if qtype == Q4_0 else m, 4, 32)
        qh = b[..., (4 if qtype == Q5_1 else 2):(8 if qtype == Q5_1 else 6)]
        q = _nibbles(b[..., nbytes - 16:]) | (_high_bits(qh) << 4)
        codes = q.reshape(n, k)
        if qtype == Q5_0:
            return BlockWeight(codes, d, np.zeros_like(d), 6, 32, offset=16)
        return BlockWeight(codes, d, m, 6, 32)
    if qtype in (Q4_K, Q5_K):
        d = _f16(b[..., 0:2])[..., None]
        dmin = _f16(b[..., 2:4])[..., None]
        sc, mn = _scale_min_k4(b[..., 4:16])
        s = (d * sc.astype(np.float32)).reshape(n, k // 32)
        z = -(dmin * mn.astype(np.float32)).reshape(n, k // 32)
        factors = (sc.reshape(n, k // 32).astype(np.int8), mn.reshape(n, k // 32).astype(np.int8),
                   d.reshape(n, -1), -dmin.reshape(n, -1), 8)
        if qtype == Q4_K:
            qs = b[..., 16:144].reshape(n, -1, 4, 32)  # 4 chunks of 32 bytes -> sub-blocks 2c, 2c+1
            q = np.stack([qs & 15, qs >> 4], axis=3)  # [n, blocks, 4, 2, 32]
            return BlockWeight(q.reshape(n, k), s, z, 4, 32, factors=factors)
        qh = b[..., 16:48]  # [n, blocks, 32]
        qs = b[..., 48:176].reshape(n, -1, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=3)  # [n, blocks, 4, 2, 32]
        shifts = np.arange(8, dtype=np.uint8).reshape(4, 2)  # sub-block 2c + h uses bit 2c + h of qh[l]
        hb = (qh[:, :, None, None, :] >> shifts[None, None, :, :, None]) & 1
        return BlockWeight((q | (hb << 4)).reshape(n, k), s, z, 6, 32, factors=factors)
    # Q6_K: ql[128], qh[64], scales[16] (int8), d (fp16)
    ql = b[..., 0:128].reshape(n, -1, 2, 2, 32)  # [half, ql part (l or l + 32), l]
    qh = b[..., 128:192].reshape(n, -1, 2, 32)  # [half, l]
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [n, blocks, 16]
    d = _f16(b[..., 208:210])[..., None]
    # element 128 h + 32 j + l, j = 0..3: low nibble of ql[h, j % 2] for j < 2, high for j >= 2;
    # two high bits (qh[h, l] >> 2 j) & 3
    low = np.stack([ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], axis=3)
    high = np.stack([(qh >> (2 * j)) & 3 for j in range(4)], axis=3)  # [n, blocks, half, j, l]
    q = (low | (high << 4)).reshape(n, k)
    s = (d * sc).reshape(n, k // 16)
    factors = (sc.reshape(n, k // 16).astype(np.int8), np.zeros((n, k // 16), np.int8), d.reshape(n, -1),
               np.zeros_like(d.reshape(n, -1)), 16)
    return BlockWeight(q, s, np.zeros_like(s), 6, 16, offset=32, factors=factors)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's [..., 64] bytes of 2-bit codes -> [..., 256]: per 32 bytes, four runs of 32
    codes (bits 0-1 of every byte, then bits 2-3, 4-5, 6-7)."""
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    return ((qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3).reshape(*qs.shape[:-1], 256)


def _decode_low(b: np.ndarray, qtype: int, n: int, k: int) -> BlockWeight:
    """Q2_K, Q3_K, IQ4_NL and IQ4_XS blocks (``b``: ``[n, blocks, bytes]``) in the kernel's 2-bit,
    3-bit and IQ4 forms, with the file's numbers (see the module's docstring)."""
    if qtype == IQ4_NL:  # d (fp16), 16 bytes: element j < 16 the low nibble of byte j, j >= 16 the high one of j - 16
        d = _f16(b[..., 0:2])
        return BlockWeight(_nibbles(b[..., 2:18]).reshape(n, k), d, np.zeros_like(d), CODES_IQ4, 32)
    if qtype == IQ4_XS:  # d, 2 bytes of the scales' high bits, 4 of their low nibbles, 8 x 16 bytes as IQ4_NL's
        d = _f16(b[..., 0:2])  # [n, blocks]
        high = (b[..., 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, blocks, 8]
        low = np.stack([b[..., 4:8] & 15, b[..., 4:8] >> 4], axis=-1).reshape(n, -1, 8)
        sc = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
        codes = _nibbles(b[..., 8:136].reshape(n, -1, 8, 16)).reshape(n, k)
        s = (d[..., None] * sc.astype(np.float32)).reshape(n, k // 32)
        factors = (sc.reshape(n, k // 32), np.zeros((n, k // 32), np.int8), d, np.zeros_like(d), 8)
        return BlockWeight(codes, s, np.zeros_like(s), CODES_IQ4, 32, factors=factors)
    if qtype == Q2_K:  # 16 bytes of scales (low nibble sc, high nibble m), 64 of 2-bit codes, d, dmin
        sc, m = (b[..., 0:16] & 15).astype(np.int8), (b[..., 0:16] >> 4).astype(np.int8)
        d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])  # [n, blocks]
        s = (d[..., None] * sc.astype(np.float32)).reshape(n, k // 16)
        z = -(dmin[..., None] * m.astype(np.float32)).reshape(n, k // 16)
        factors = (sc.reshape(n, -1), m.reshape(n, -1), d, -dmin, 16)
        return BlockWeight(_crumbs(b[..., 16:80]).reshape(n, k), s, z, 2, 16, factors=factors)
    # Q3_K: 32 bytes of third bits (bit j of byte l: element 32 j + l), 64 of 2-bit codes, 12 of
    # 6-bit scales (16 low nibbles, then 16 pairs of high bits), d; value (q | third << 2) - 4
    hmask, scales, d = b[..., 0:32], b[..., 96:108], _f16(b[..., 108:110])
    third = (hmask[..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [n, blocks, 8, 32]
    codes = _crumbs(b[..., 32:96]) | (third.reshape(n, -1, 256) << 2)
    low = np.stack([scales[..., 0:8] & 15, scales[..., 0:8] >> 4], axis=-2).reshape(n, -1, 16)
    high = (scales[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [n, blocks, 4, 4]
    sc = (low | (high.reshape(n, -1, 16) << 4)).astype(np.int8) - np.int8(32)
    s = (d[..., None] * sc.astype(np.float32)).reshape(n, k // 16)
    factors = (sc.reshape(n, -1), np.zeros_like(sc.reshape(n, -1)), d, np.zeros_like(d), 16)
    return BlockWeight(codes.reshape(n, k), s, np.zeros_like(s), 3, 16, offset=4, factors=factors)


def requantize_q8(w: np.ndarray, group: int = 32) -> BlockWeight:
    """Symmetric 8-bit codes in groups of ``group`` (``s = max|w| / 127``, z = 0) for a float
    weight: the format for block types without a direct mapping."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // group, group)
    s = np.abs(g).max(axis=-1) / 127.0
    safe = np.where(s > 0, s, 1.0)
    q = np.clip(np.rint(g / safe[..., None]), -127, 127).astype(np.int8)
    return BlockWeight(q.reshape(n, k), s.astype(np.float32), np.zeros_like(s, dtype=np.float32), 8, group)


def quantize_q4(w: np.ndarray, group: int = 32) -> BlockWeight:
    """Asymmetric 4-bit codes in groups of ``group`` from a float weight (min/max, as gpt-fast's
    group-wise int4): ``s = (max - min) / 15``, ``z = min``, ``q = round((w - z) / s)``."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // group, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    s = (hi - lo) / 15.0
    safe = np.where(s > 0, s, 1.0)
    q = np.clip(np.rint((g - lo[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return BlockWeight(q.reshape(n, k), s.astype(np.float32), lo.astype(np.float32), 4, group)


def tensor_weight(raw: np.ndarray, qtype: int, n: int, k: int, fallback_group: int = 32) -> tuple[BlockWeight, str]:
    """A 2-D weight ``[n, k]`` from its raw bytes in the file (``raw``: ``[n, bytes per row]`` uint8)
    -> (``BlockWeight``, how): the direct mapping where there is one, else the ``gguf`` package's
    dequantization re-quantized to 8 bits (``requantize_q8``)."""
    if qtype in BLOCK_BYTES:
        return decode(raw.reshape(-1), qtype, n, k), NATIVE_TYPES[qtype]
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(qtype)
    dense = np.asarray(dequantize(np.ascontiguousarray(raw).reshape(n, -1), kind), dtype=np.float32).reshape(n, k)
    return requantize_q8(dense, fallback_group), f"{kind.name}->Q8"


def file_bits(qtype: int) -> float:
    """Bits a weight of a GGML type takes in the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    per, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return 8 * nbytes / per


def requantized_warning(kinds: dict[str, int]) -> str | None:
    """One warning naming the block types of a packed model that are not run in their own blocks
    (``kinds``: weights per ``tensor_weight`` "how", e.g. ``"IQ2_XXS->Q8"``) and what that costs;
    None when every type is."""
    from gguf import GGMLQuantizationType

    total = sum(kinds.values()) or 1
    others = sorted((k.removesuffix("->Q8"), n) for k, n in kinds.items() if k.endswith("->Q8"))
    if not others:
        return None
    names = ", ".join(f"{name} ({100 * n / total:.0f}% of the weights, {file_bits(GGMLQuantizationType[name]):.2g} "
                      f"bits a weight in the file)" for name, n in others)
    return (f"warning: {names} not run in the file's own blocks: re-quantized to 8-bit codes, 10 bits a weight "
            "to read (fp32 scales) and near-lossless but not the file's numbers (llama.cpp's output on this file is then not "
            "matched exactly); the types run as they are: " + ", ".join(NATIVE_TYPES.values()))
