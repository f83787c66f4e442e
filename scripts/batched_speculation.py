"""Batched speculation against plain batched decoding (issue 14, section 2).

One ``leapdecode serve --method M --max-batch 16`` per server method (``--methods``, default
vanilla = plain batched decoding, and auto = batched speculation with load-adaptive trees), all
started at once and idle while another is under load.  For each concurrency (``--clients``, default
1, 4, 8, 16), ``--rounds`` rounds: in each round every server gets the same load in turn
(``scripts/loadtest.py``'s streaming clients, no early hang-ups, the same request seed for every
server in a round, the order reversed every other round), a short warm-up then ``--duration``
measured seconds.  So a drift of the machine's speed over minutes (other tenants) hits every
method alike.  Prints per cell the generated tokens/s over all rounds (sums of tokens over sums of
seconds), the mean batch size, each method's ratio to the first, and the geometric mean of the
per-round ratios (a round's methods ran back to back on the same load: a paired comparison) with
its 95% confidence interval (Student's t over the rounds' log ratios; needs scipy, the dev extra).

    python scripts/batched_speculation.py -m smollm2-135m --rounds 3 --duration 10
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadtest import run_loadtest, start_server, stop_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--methods", default="vanilla,auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per method, round and cell")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds of the same load before each measured window "
                    "(the first window of each server: twice as long)")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    methods = [m.strip() for m in args.methods.split(",")]
    servers = {}
    try:
        for m in methods:
            servers[m] = start_server(args.model, 64, ["--method", m, "--max-batch", "16"])
        totals = {(m, c): [0.0, 0.0, [], []] for m in methods for c in clients}  # tokens, seconds, batches, tok/s
        first = set()
        for c in clients:
            for r in range(args.rounds):
                for m in (methods if r % 2 == 0 else methods[::-1]):
                    warm = args.warmup * (1 if m in first else 2)
                    first.add(m)
                    s = run_loadtest(url=servers[m][1], clients=c, duration=args.duration, warmup=warm,
                                     max_tokens=args.max_tokens, disconnect_prob=0.0, check_solo=False, seed=r)
                    t = totals[(m, c)]
                    t[0] += s["generated_tokens"] or 0
                    t[1] += s["elapsed_s"]
                    t[2].append(s["mean_batch_size"] or 0.0)
                    t[3].append(s["tokens_per_s"] or 0.0)
                    print(f"{m:8s} clients {c:2d} round {r}: {s['tokens_per_s']} tok/s, mean batch "
                          f"{s['mean_batch_size']}, completed {s['completed']}", file=sys.stderr, flush=True)
    finally:
        for proc, _, log in servers.values():
            stop_server(proc)
            os.unlink(log)
    rows = {k: {"tokens_per_s": round(v[0] / v[1], 2) if v[1] else 0.0,
                "mean_batch_size": round(sum(v[2]) / len(v[2]), 2) if v[2] else None} for k, v in totals.items()}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent).stdout.strip() or "?"
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, commit {rev}, {os.cpu_count()} CPUs")
    print(f"model {args.model}, max_tokens drawn from [{args.max_tokens // 4}, {args.max_tokens}], {args.rounds} "
          f"rounds of {args.warmup:g} s warm-up + {args.duration:g} s measured per method and cell, "
          f"servers --max-batch 16")
    print("| clients | " + " | ".join(f"{m} tok/s (mean batch)" for m in methods)
          + "".join(f" | {m} / {methods[0]} | per round: geo. mean [95% CI]" for m in methods[1:]) + " |")
    print("|---" * (1 + len(methods) + 2 * (len(methods) - 1)) + "|")
    for c in clients:
        cells = [f"{rows[(m, c)]['tokens_per_s']} ({rows[(m, c)]['mean_batch_size']})" for m in methods]
        base = rows[(methods[0], c)]["tokens_per_s"] or 0
        ratios = []
        for m in methods[1:]:
            ratios.append(f"{(rows[(m, c)]['tokens_per_s'] or 0) / base:.2f}x" if base else "n/a")
            ratios.append(paired_ratio(totals[(m, c)][3], totals[(methods[0], c)][3]))
        print(f"| {c} | " + " | ".join(cells) + "".join(f" | {r}" for r in ratios) + " |")


def paired_ratio(ours: list[float], base: list[float]) -> str:
    """The geometric mean of the rounds' ratios ``ours[r] / base[r]`` and its 95% confidence interval
    (t over the log ratios), as text; the interval needs two rounds and scipy."""
    logs = [math.log(a / b) for a, b in zip(ours, base) if a > 0 and b > 0]
    if not logs:
        return "n/a"
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return f"{math.exp(mean):.3f}x"
    try:
        from scipy.stats import t as student_t
    except ImportError:
        return f"{math.exp(mean):.3f}x (no scipy: no interval)"
    half = student_t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return f"{math.exp(mean):.3f}x [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]"


if __name__ == "__main__":
    main()
