#!/usr/bin/env python
"""What a GGML type's own bytes buy on the kernel (issue 63): each type's product against the very same
weights in the wider form the kernel ran them in before it had their layouts (Q2_K and Q3_K as 4-bit codes,
the IQ4 types as 8-bit codes), and Q4_K's beside them, in one process with the rounds alternating.

The weights are random blocks of each type (``gguf_blocks.decode``: the file's numbers), the layers an MLP
and attention of qwen2.5-1.5b's shape (one decoder layer: q/k/v/o, gate/up, down); each row count's time is
the minimum over rounds of a pass over the layer, in ms, with each form's packed bits a weight.  Both forms
give the same outputs (checked here, bit for bit, before timing: the same values, integer dot products).

    python scripts/type_cost.py --rows 1,4,16 --rounds 7
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from leapdecode.models import gguf_blocks
from leapdecode.models.kernel_library import kernel_isa, kernel_problem
from leapdecode.models.kernel_pack import CODES_IQ4, BlockWeight
from leapdecode.models.qkernel import QLinear, QPart

T = gguf.GGMLQuantizationType
HIDDEN, KV, FFN = 1536, 256, 8960
LAYERS = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)]  # [out, in]


def random_raw(qtype, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random ``qtype`` blocks with small finite fp16 fields (as tests/test_gguf_blocks.py makes them)."""
    fields = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}[qtype]
    per, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // per, nbytes), dtype=np.uint8)
    for pos in fields:
        raw[..., pos:pos + 2] = (rng.standard_normal((n, k // per)) * 0.002).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def wider(w: BlockWeight) -> BlockWeight:
    """The same weights in the form the kernel had for them before: Q2_K's and Q3_K's codes as 4-bit codes
    (Q3_K's offset -4 as the offsets -4 d sc), the IQ4 types' values as 8-bit codes."""
    if w.bits == CODES_IQ4:
        return BlockWeight(w.values().astype(np.int8), w.scales, w.zeros, 8, w.group, 0, w.factors)
    if w.bits == 3:
        sc, _, d, _, gps = w.factors
        return BlockWeight(w.codes, w.scales, np.float32(-4) * w.scales, 4, 16, 0, (sc, sc, d, np.float32(-4) * d, gps))
    return BlockWeight(w.codes, w.scales, w.zeros, 4, w.group, 0, w.factors)


def layer_set(qtype, rng) -> list[BlockWeight]:
    return [gguf_blocks.decode(random_raw(qtype, n, k, rng).reshape(-1), int(qtype), n, k) for n, k in LAYERS]


def bits_a_weight(parts: list[QPart]) -> float:
    return 8 * sum(p.nbytes() for p in parts) / sum(p.out_features * p.in_features for p in parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16", help="row counts, comma-separated (default 1,4,16)")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds; the minimum is kept (default 7)")
    ap.add_argument("--types", default="Q2_K,Q3_K,IQ4_NL,IQ4_XS", help="types compared with their wider form")
    args = ap.parse_args()
    problem = kernel_problem()
    if problem:
        raise SystemExit(f"the kernel is not available: {problem}")
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    forms = {"Q4_K": [QLinear([QPart.from_block(w)]) for w in layer_set(T.Q4_K, rng)]}
    for name in args.types.split(","):
        weights = layer_set(T[name], rng)
        forms[name] = [QLinear([QPart.from_block(w)]) for w in weights]
        forms[f"{name} as before"] = [QLinear([QPart.from_block(wider(w))]) for w in weights]
        x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        own, old = forms[name][0], forms[f"{name} as before"][0]
        assert torch.equal(own(x), old(x)), f"{name}: the two forms disagree"
    xs = {m: [torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16) for _, k in LAYERS]
          for m in rows}
    best = {(f, m): float("inf") for f in forms for m in rows}
    for r in range(args.rounds + 1):
        for f, layers in forms.items():
            for m in rows:
                t = time.perf_counter()
                for layer, x in zip(layers, xs[m]):
                    layer(x)
                dt = time.perf_counter() - t
                if r:  # round 0 warms up
                    best[f, m] = min(best[f, m], dt)
    print(f"kernel {kernel_isa()}, {torch.get_num_threads()} threads; one qwen2.5-1.5b layer's linears, ms "
          f"(min of {args.rounds} rounds)")
    print(f"{'form':>20} {'bits/w':>7} " + " ".join(f"{m:>4} rows" for m in rows))
    for f, layers in forms.items():
        print(f"{f:>20} {bits_a_weight([p for q in layers for p in q.parts]):7.2f} "
              + " ".join(f"{1e3 * best[f, m]:9.2f}" for m in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
