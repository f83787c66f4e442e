"""What the linear layers of a model cost per forward as the number of rows (tree tokens) grows,
in the default weight format: every block's linear layers, then the head, ms (min of repeats).

    python scripts/qlinear_rows.py -m qwen2.5-coder-1.5b --rows 1,2,4,8,16,32,64
"""

from __future__ import annotations

import argparse
import time

import torch

import leapdecode
from leapdecode.models.quant import BLOCK_LINEARS


def timed(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    model = leapdecode.load(a.model, weights=a.weights).model
    layers = [getattr(b, n) for b in model.layers for n in BLOCK_LINEARS]
    print(f"{a.model}: weights {getattr(model, 'quantization', None) or model.dtype}, {len(layers)} linear layers + head")
    print("| rows | layers ms | head ms | total ms | x 1 row |")
    print("|---:|---:|---:|---:|---:|")
    base = None
    for m in (int(r) for r in a.rows.split(",")):
        xs = {lin.in_features: torch.randn(m, lin.in_features).to(torch.bfloat16) for lin in layers}
        t_layers = timed(lambda: [lin(xs[lin.in_features]) for lin in layers], a.repeats)
        x = torch.randn(m, model.cfg.hidden_size).to(torch.bfloat16)
        t_head = timed(lambda: model.lm_head(x), a.repeats)
        total = t_layers + t_head
        base = base or total
        print(f"| {m} | {t_layers:.1f} | {t_head:.1f} | {total:.1f} | {total / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
