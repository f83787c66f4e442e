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

Any other type (F32, F16, BF16, Q2_K, Q3_K, IQ*) is dequantized with the ``gguf`` package and
re-quantized to symmetric 8-bit codes in groups of 32 (``requantize_q8``): a near-lossless
choice that costs 8.5 bits a weight (docs/lab-notes/benchmarks.md).  The block layouts follow ggml's
``ggml-quants.c`` (``dequantize_row_*``); tests/test_gguf_blocks.py checks every decoder
against the ``gguf`` package's own dequantization.
"""

from __future__ import annotations

import numpy as np

from .qkernel import BlockWeight

# GGMLQuantizationType values (gguf.constants)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30
NATIVE_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K",
                Q5_K: "Q5_K", Q6_K: "Q6_K"}
BLOCK_BYTES = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
               Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}


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
