"""One query's attention over n cached keys, the call the batch-invariant attention makes per
token row and layer: SDPA with ``enable_gqa`` against the query heads of each key head as that
head's rows (``Block.one_query``).  Shapes of qwen2.5-coder-1.5b (12 query heads, 2 key heads,
head dim 128, bf16).

    python scripts/attention_call_speed.py --keys 1600
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from leapdecode.models.native import Block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1600)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 2048, 128, generator=g).bfloat16()
    v = torch.randn(1, 2, 2048, 128, generator=g).bfloat16()
    q = torch.randn(1, 12, 1, 128, generator=g).bfloat16()
    n = args.keys
    calls = {
        "sdpa enable_gqa": lambda: F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True),
        "grouped (Block.one_query)": lambda: Block.one_query(None, q, k[:, :, :n], v[:, :, :n]),
    }
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        print(f"{name}: {(time.perf_counter() - t0) / args.calls * 1e6:.0f} us per call ({n} keys)")


if __name__ == "__main__":
    main()
