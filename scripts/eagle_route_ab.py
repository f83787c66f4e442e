"""The EAGLE draft layer on the kernels' route (``KernelDraftKV``) against the torch route
(``DraftKV``), alternating in one process on held-apart HumanEval prompts (docs/benchmarks.md
section 36): per route, tokens/s, target forwards, and the drafting time per step.

    python scripts/eagle_route_ab.py [--prompts 4] [--rounds 2] [--new 128]
"""

import argparse
import time

import leapdecode
from leapdecode import ModelRunner
from leapdecode.bench.workloads import load_workload
from leapdecode.proposers.heads import eagle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    a = ap.parse_args()
    qs, _ = load_workload("humaneval-heldout")
    prompts = [q.turns[0] for q in qs[: a.prompts]]
    runner = ModelRunner(leapdecode.load("qwen2.5-coder-1.5b"))
    leapdecode.generate(runner, prompts[0], method="eagle", max_new_tokens=16)  # warm-up
    kernel_of = eagle.KernelDraftKV.of
    totals: dict = {}
    for r in range(a.rounds):
        for route in (("kernel", "torch") if r % 2 == 0 else ("torch", "kernel")):
            eagle.KernelDraftKV.of = kernel_of if route == "kernel" else (lambda *args, **kw: None)
            t = totals.setdefault(route, {"tokens": 0, "wall": 0.0, "forwards": 0, "draft": 0.0, "steps": 0})
            for p in prompts:
                t0 = time.perf_counter()
                out = leapdecode.generate(runner, p, method="eagle", max_new_tokens=a.new)
                t["wall"] += time.perf_counter() - t0
                t["tokens"] += len(out.tokens)
                t["forwards"] += out.stats["target_forwards"]
                t["draft"] += out.stats["eagle_draft_s"]
                t["steps"] += out.stats["eagle_steps"]
                assert out.stats["eagle_layer_kernel"] == (route == "kernel")
    eagle.KernelDraftKV.of = kernel_of
    print("| route | tokens/s | tokens per target forward | drafting ms per step |")
    print("|---|---:|---:|---:|")
    for route, t in totals.items():
        print(f"| {route} | {t['tokens'] / t['wall']:.1f} | {t['tokens'] / t['forwards']:.2f} | "
              f"{1e3 * t['draft'] / t['steps']:.2f} |")


if __name__ == "__main__":
    main()
