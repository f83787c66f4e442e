"""What a drafting head's step pays for besides its decoder layer (docs/benchmarks.md section 31):

1. FR-Spec's subset of qwen2.5-coder-1.5b's output head (the first 32,768 rows): a bf16 copy of
   the dequantized rows on oneDNN (what ``subset_head`` built before) against the quantized rows
   themselves (``QLinear.first_rows``, what it builds now), and the whole quantized head;
2. the EAGLE-3 head's linear layer shapes on per-row int8 weights: torch's ``Int8Linear``
   (``_weight_int8pack_mm``) against the block kernel's 8-bit codes (``heads.common.int8_linear``).

Each: mean ms over ``--calls`` calls after a few warm-ups, at 1 and 4 rows.

    python scripts/head_draft_cost.py
"""
import argparse
import time

import torch
from torch import nn

import leapdecode
from leapdecode.models.linear import make_linear
from leapdecode.models.quant import Int8Linear
from leapdecode.proposers.heads.common import int8_linear


def ms(f, x, calls: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            f(x)
        t0 = time.perf_counter()
        for _ in range(calls):
            f(x)
        return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32768, help="rows of the subset head")
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    model = leapdecode.load("qwen2.5-coder-1.5b").model
    head = model.lm_head
    bf16 = make_linear(head.dequantize()[: args.vocab].to(torch.bfloat16))
    rows = head.first_rows(args.vocab)
    hidden = head.in_features
    print(f"| rows | bf16 copy of {args.vocab} rows | quantized rows | whole quantized head |")
    print("|---:|---:|---:|---:|")
    for m in (1, 4):
        x = torch.randn(m, hidden, dtype=torch.bfloat16)
        print(f"| {m} | {ms(bf16, x, args.calls):.2f} ms | {ms(rows, x, args.calls):.2f} ms | {ms(head, x, args.calls):.2f} ms |")
    print("\n| layer [out, in] | rows | torch Int8Linear | block kernel, 8-bit g32 |")
    print("|---|---:|---:|---:|")
    torch.manual_seed(0)
    for n, k in ((hidden, 2 * hidden), (3 * hidden, hidden), (hidden, hidden), (hidden, hidden // 2), (hidden, 3 * hidden)):
        lin = nn.Linear(k, n, bias=False)
        nn.init.normal_(lin.weight, std=0.02)
        a, b = Int8Linear.from_float(lin.weight), int8_linear(lin)
        cells = []
        for m in (1, 4):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            cells.append((ms(a, x, 4 * args.calls), ms(b, x, 4 * args.calls)))
        print(f"| [{n}, {k}] | 1 / 4 | {cells[0][0]:.3f} / {cells[1][0]:.3f} ms | {cells[0][1]:.3f} / {cells[1][1]:.3f} ms |")


if __name__ == "__main__":
    main()
