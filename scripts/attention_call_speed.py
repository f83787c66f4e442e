"""One query's attention over n cached keys, the call the batch-invariant attention makes per
token row and layer: SDPA with ``enable_gqa``, the query heads of each key head as that head's
rows (``Block.one_query``, the fallback route), and leapdecode's attention kernel
(``qkernel.attend_rows``, the default route on the CPU), for one token and for ``--rows`` tokens
of a chain in one call.  Shapes of qwen2.5-coder-1.5b (12 query heads, 2 key heads, head dim
128, bf16); min over ``--repeats`` runs of ``--calls`` calls.

    python scripts/attention_call_speed.py --keys 1600
    python scripts/attention_call_speed.py --keys 300 --rows 16 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from leapdecode.models.native import Block
from leapdecode.models.kernel_library import kernel_problem
from leapdecode.models.qkernel import attend_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1600)
    ap.add_argument("--rows", type=int, default=16, help="tokens of one call of the kernel (a chain)")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    n, rows = args.keys, args.rows
    k = torch.randn(1, 2, n + rows, 128, generator=g).bfloat16()
    v = torch.randn(1, 2, n + rows, 128, generator=g).bfloat16()
    q = torch.randn(1, 12, rows, 128, generator=g).bfloat16()
    q1 = q[:, :, :1]
    calls = {
        "sdpa enable_gqa, 1 token": lambda: F.scaled_dot_product_attention(q1, k[:, :, :n], v[:, :, :n], enable_gqa=True),
        "grouped (Block.one_query), 1 token": lambda: Block.one_query(None, q1, k[:, :, :n], v[:, :, :n]),
        f"grouped (Block.one_query), {rows} tokens": lambda: [Block.one_query(None, q[:, :, i : i + 1], k[:, :, : n + i],
                                                                               v[:, :, : n + i]) for i in range(rows)],
    }
    if kernel_problem() is None:
        one = (torch.arange(n), torch.tensor([0, n]))
        chain = [torch.arange(n + i) for i in range(rows)]
        many = (torch.cat(chain), torch.tensor([0] + [len(c) for c in chain]).cumsum(0))
        calls["kernel (attend_rows), 1 token"] = lambda: attend_rows(q1, k, v, *one)
        calls[f"kernel (attend_rows), {rows} tokens"] = lambda: attend_rows(q, k, v, *many)
    print(f"{torch.get_num_threads()} threads, {n} keys")
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / args.calls)
        print(f"{name}: {best * 1e6:.0f} us per call")


if __name__ == "__main__":
    main()
