"""Random inputs for the block kernel: block weights of each format, bf16 activations, raw GGUF blocks
(tests/test_qkernel.py, test_kernel_build.py and test_gguf_blocks.py)."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from leapdecode.models.kernel_pack import CODES_IQ4, BlockWeight

# (bits, group, offset): Q4_*/Q4_K; Q6_K; Q5_0; Q8_0; Q2_K; Q3_K; IQ4_NL/IQ4_XS
FORMATS = [(4, 32, 0), (6, 16, 32), (6, 32, 16), (8, 32, 0), (2, 16, 0), (3, 16, 4), (CODES_IQ4, 32, 0)]
FORMAT_IDS = ["4b-g32", "6b-g16-o32", "6b-g32-o16", "8b-g32", "2b-g16", "3b-g16-o4", "iq4-g32"]


def random_block(n: int, k: int, bits: int, group: int, offset: int = 0, seed: int = 0) -> BlockWeight:
    """A random ``[n, k]`` block weight of ``bits`` (codes, scales and zeros; seeded)."""
    rng = np.random.default_rng(seed)
    if bits != 8:
        codes = rng.integers(0, {2: 4, 3: 8, 6: 64}.get(bits, 16), (n, k)).astype(np.uint8)
    else:
        codes = rng.integers(-128, 128, (n, k)).astype(np.int8)
    scales = (rng.random((n, k // group)) * 0.02 + 0.001).astype(np.float32)
    zeros = (rng.standard_normal((n, k // group)) * 0.05).astype(np.float32)
    return BlockWeight(codes, scales, zeros, bits, group, offset)


def random_x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """Random ``[m, k]`` bf16 activations (seeded)."""
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


# type -> byte offsets of its fp16 fields in a block (d, and m / dmin where it has one)
FP16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q3_K: (108,), T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
}


def random_raw(qtype: T, n: int, k: int, seed: int, scale: float = 0.01, zero_frac: float = 0.05) -> np.ndarray:
    """Random blocks ``[n, k / block * bytes]`` (uint8) with small finite fp16 fields."""
    per, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    for pos in FP16_FIELDS[qtype]:
        vals = (rng.standard_normal((n, k // per)) * scale).astype(np.float16)
        vals[rng.random(vals.shape) < zero_frac] = 0  # some zero scales too
        raw[..., pos : pos + 2] = vals[..., None].view(np.uint8)
    return raw.reshape(n, -1)
