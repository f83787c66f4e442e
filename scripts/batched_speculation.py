"""Batched speculation against plain batched decoding (issue 14, section 2).

For each concurrency (``--clients``, default 1, 4, 8, 16) and each server method (``--methods``,
default vanilla = plain batched decoding, and auto = batched speculation with load-adaptive
trees), starts ``leapdecode serve --method M --max-batch 16`` and runs ``scripts/loadtest.py``'s
load (streaming clients, no early hang-ups, a warm-up with the same load first), then prints the
total generated tokens/s and the mean batch size per cell, and each method's ratio to vanilla.

    python scripts/batched_speculation.py -m smollm2-135m --duration 20 --warmup 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadtest import run_loadtest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--methods", default="vanilla,auto")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    rows: dict[tuple[str, int], dict] = {}
    for c in clients:
        for m in methods:
            s = run_loadtest(model=args.model, clients=c, duration=args.duration, warmup=args.warmup,
                             max_tokens=args.max_tokens, disconnect_prob=0.0, max_queue=64, check_solo=False,
                             server_args=["--method", m, "--max-batch", "16"])
            rows[(m, c)] = s
            print(f"{m:8s} clients {c:2d}: {s['tokens_per_s']} tok/s, mean batch {s['mean_batch_size']}, "
                  f"completed {s['completed']}, p50 latency {s['latency_p50_s']} s", file=sys.stderr, flush=True)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent).stdout.strip() or "?"
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, commit {rev}, {os.cpu_count()} CPUs")
    print(f"model {args.model}, max_tokens drawn from [{args.max_tokens // 4}, {args.max_tokens}], "
          f"{args.warmup:g} s warm-up + {args.duration:g} s measured per cell, server --max-batch 16")
    print("| clients | " + " | ".join(f"{m} tok/s (mean batch)" for m in methods)
          + "".join(f" | {m} / {methods[0]}" for m in methods[1:]) + " |")
    print("|---" * (1 + len(methods) + len(methods) - 1) + "|")
    for c in clients:
        cells = [f"{rows[(m, c)]['tokens_per_s']} ({rows[(m, c)]['mean_batch_size']})" for m in methods]
        base = rows[(methods[0], c)]["tokens_per_s"] or 0
        ratios = [f"{(rows[(m, c)]['tokens_per_s'] or 0) / base:.2f}x" if base else "n/a" for m in methods[1:]]
        print(f"| {c} | " + " | ".join(cells) + "".join(f" | {r}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
