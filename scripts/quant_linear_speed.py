"""Time one linear layer of Qwen2.5-1.5B's shapes: bf16 ``F.linear``, the oneDNN-packed
``PackedLinear``, ``Int8Linear`` and ``Int4Linear`` (``models/quant.py``) at M rows.

    .venv/bin/python scripts/quant_linear_speed.py [--threads 2] [--rows 1,4,8,16,32] [--head]

Prints, per layer shape and M, the median time of one call (ms, over ``--repeats`` timed
batches of calls after a warm-up) and whether each row of the M-row output equals the
1-row output of that row bitwise ("inv").  A busy machine inflates and scatters the times:
compare columns of one run, and repeat it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from leapdecode.models.native import PackedLinear, can_pack
from leapdecode.models.quant import Int4Linear, Int8Linear

# (name, out_features N, in_features K) of Qwen2.5-1.5B's layers
SHAPES = [
    ("wqkv 1536->2048", 2048, 1536),
    ("wo 1536->1536", 1536, 1536),
    ("w_gate_up 1536->17920", 17920, 1536),
    ("w_down 8960->1536", 1536, 8960),
]
HEAD = ("lm_head 1536->151936", 151936, 1536)


def layers(n: int, k: int, group: int) -> dict:
    w = torch.randn(n, k) * 0.02
    wb = w.to(torch.bfloat16)
    out = {"bf16": lambda x: F.linear(x, wb)}
    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    lin.weight = torch.nn.Parameter(wb, requires_grad=False)
    if can_pack(lin):
        out["bf16-packed"] = PackedLinear(lin)
    out["int8"] = Int8Linear.from_float(w)
    out[f"int4-g{group}"] = Int4Linear.from_float(w, group_size=group)
    return out


def time_call(fn, x, repeats: int, budget_s: float) -> float:
    """Median seconds per call over ``repeats`` batches (batch size sized to ~budget_s/repeats)."""
    fn(x)
    t0 = time.perf_counter()
    fn(x)
    one = max(time.perf_counter() - t0, 1e-6)
    per_batch = max(1, int(budget_s / repeats / one))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn(x)
        samples.append((time.perf_counter() - t0) / per_batch)
    return statistics.median(samples)


def invariant(fn, x) -> bool:
    y = fn(x)
    return all(torch.equal(y[i], fn(x[i : i + 1].clone())[0]) for i in range(x.shape[0]))


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budget", type=float, default=0.25, help="seconds of calls per (layer, M)")
    ap.add_argument("--group", type=int, default=32, help="int4 group size")
    ap.add_argument("--head", action="store_true", help="also the 151936-row output head (slow to build)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"capability {torch.backends.cpu.get_cpu_capability()}")
    for name, n, k in SHAPES + ([HEAD] if args.head else []):
        variants = layers(n, k, args.group)
        print(f"\n{name}  (bf16 weight {n * k * 2 / 1e6:.1f} MB)")
        print(f"{'M':>4} " + " ".join(f"{v:>14}" for v in variants) + "   speed-up over bf16-packed (or bf16)")
        g = torch.Generator().manual_seed(0)
        for m in rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            ms = {v: 1e3 * time_call(fn, x, args.repeats, args.budget) for v, fn in variants.items()}
            inv = {v: invariant(fn, x) for v, fn in variants.items()}
            base = ms.get("bf16-packed", ms["bf16"])
            cells = " ".join(f"{ms[v]:9.3f}{' inv' if inv[v] else ' ---'} " for v in variants)
            ups = "  ".join(f"{v} {base / ms[v]:.2f}x" for v in variants if v.startswith("int"))
            print(f"{m:>4} {cells}   {ups}")


if __name__ == "__main__":
    main()
