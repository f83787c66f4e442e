"""Two EAGLE heads side by side on the same prompts, in one process (docs/benchmarks.md section 27).

    python scripts/eagle_heads_ab.py HEAD_A HEAD_B

HEAD_A / HEAD_B: head directories (`head=` of `--method eagle`). For each configuration (vanilla,
each head with its default cost-aware tree, each with a fixed 8-node tree, B with a fixed 16-node
tree, vanilla again: the spread of the two vanilla rows is the machine's drift), generates 128
greedy tokens for 4 of HumanEval's held-apart prompts ("he") and 6 Spec-Bench dev prompts spread
over the file ("sb"), and prints tokens/s and tokens per target forward of each group.
"""

import sys
import time

import leapdecode
from leapdecode import ModelRunner
from leapdecode.bench.workloads import load_workload


def main() -> None:
    a, b = sys.argv[1], sys.argv[2]
    he, _ = load_workload("humaneval-heldout")
    sb, _ = load_workload(None)
    prompts = [("he", q.turns[0], q.chat) for q in he[:4]]
    prompts += [("sb", q.turns[0], q.chat) for q in sb[:: max(1, len(sb) // 6)][:6]]
    configs = [("vanilla", {}), ("eagle", {"head": a}), ("eagle", {"head": b}),
               ("eagle", {"head": a, "cost_aware": False, "tree_budget": 8}),
               ("eagle", {"head": b, "cost_aware": False, "tree_budget": 8}),
               ("eagle", {"head": b, "cost_aware": False, "tree_budget": 16}), ("vanilla", {})]
    runner = ModelRunner(leapdecode.load("qwen2.5-coder-1.5b"))
    leapdecode.generate(runner, prompts[0][1], method="eagle", options={"head": b}, max_new_tokens=16)  # warm-up
    for method, options in configs:
        res: dict[str, list[float]] = {}
        for group, text, chat in prompts:
            t0 = time.perf_counter()
            r = leapdecode.generate(runner, text, method=method, options=options, max_new_tokens=128, chat=chat)
            d = res.setdefault(group, [0, 0, 0.0])
            d[0] += len(r.tokens)
            d[1] += r.stats.get("target_forwards", 0)
            d[2] += time.perf_counter() - t0
        name = {a: "A", b: "B"}.get(options.get("head"), "")
        rest = {k: v for k, v in options.items() if k != "head"}
        print(method, name, rest, " | ".join(f"{g}: {n / w:.1f} tok/s, accepted/fwd {n / f:.2f}"
                                             for g, (n, f, w) in res.items()), flush=True)


if __name__ == "__main__":
    main()
