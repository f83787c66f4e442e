"""EAGLE option sweep on held-apart HumanEval prompts, in one process (docs/benchmarks.md section 20).

    python scripts/eagle_options.py [PROMPT_INDICES] [CONFIG_INDICES]

Loads qwen2.5-coder-1.5b with its trained eagle head (the store's or the bundled one), warms up,
then for each configuration generates 128 greedy tokens for each of the chosen prompts of
``--workload humaneval-heldout`` (default the first four) and prints tokens/s, tokens per target
forward and the eagle stats.  Vanilla runs first and last (the spread is the machine's noise).
"""

import sys
import time

import leapdecode
from leapdecode import ModelRunner
from leapdecode.bench.workloads import load_workload

CONFIGS = [("vanilla", {}), ("eagle", {}), ("eagle", {"cost_aware": False, "tree_budget": 4}),
           ("eagle", {"cost_aware": False, "tree_budget": 6}), ("eagle", {"cost_aware": False, "tree_budget": 8}),
           ("eagle", {"draft_vocab": 8192}), ("eagle", {"cost_aware": False, "tree_budget": 6, "draft_vocab": 8192}),
           ("eagle", {"cost_aware": False, "tree_budget": 6, "head_weights": "bf16"}), ("vanilla", {}),
           ("eagle", {"draft_vocab": 16384}), ("eagle", {"head_weights": "int4"}),
           ("eagle", {"head_weights": "int4", "draft_vocab": 16384}),
           ("eagle", {"cost_aware": False, "tree_budget": 6, "head_weights": "int8"}),
           ("eagle", {"cost_aware": False, "tree_budget": 6, "head_weights": "int4"}),
           ("eagle", {"cost_aware": False, "tree_budget": 6, "draft_vocab": 16384})]


def main() -> None:
    qs, _ = load_workload("humaneval-heldout")
    idx = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [0, 1, 2, 3]
    configs = CONFIGS if len(sys.argv) <= 2 else [CONFIGS[int(i)] for i in sys.argv[2].split(",")]
    prompts = [qs[i].turns[0] for i in idx]
    runner = ModelRunner(leapdecode.load("qwen2.5-coder-1.5b"))
    leapdecode.generate(runner, prompts[0], method="eagle", max_new_tokens=16)  # warm-up
    for method, options in configs:
        tokens = wall = forwards = 0
        stats: dict[str, float] = {}
        for p in prompts:
            t0 = time.perf_counter()
            r = leapdecode.generate(runner, p, method=method, options=options, max_new_tokens=128)
            wall += time.perf_counter() - t0
            tokens += len(r.tokens)
            forwards += r.stats.get("target_forwards", 0)
            for k, v in r.stats.items():
                if isinstance(v, (int, float)) and ("eagle" in k or "draft" in k):
                    stats[k] = stats.get(k, 0) + v
        print(f"{method} {options}: {tokens / wall:.1f} tok/s, accepted/fwd {tokens / forwards:.2f}, "
              + ", ".join(f"{k}={v:.3g}" for k, v in stats.items()), flush=True)


if __name__ == "__main__":
    main()
