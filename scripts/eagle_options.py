"""EAGLE option sweep on held-apart HumanEval prompts, in one process (docs/benchmarks.md section 20).

    python scripts/eagle_options.py [PROMPT_INDICES] [CONFIG_INDICES]
    python scripts/eagle_options.py 0,1,2,3,4,5,6,7 3,14 --specbench --new 96   # chat prompts

``--specbench``: the prompts are 8 Spec-Bench dev questions (``select(limit=8, seed=1)``, one per
category drawn), their first turns through the chat template, instead of HumanEval.

Loads qwen2.5-coder-1.5b with its trained eagle head (the store's or the bundled one), warms up,
then for each configuration generates 128 greedy tokens for each of the chosen prompts of
``--workload humaneval-heldout`` (default the first four) and prints tokens/s, tokens per target
forward and the eagle stats.  Vanilla runs first and last (the spread is the machine's noise).
"""

import argparse
import time

import leapdecode
from leapdecode import ModelRunner
from leapdecode.bench.workloads import load_workload, select

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", nargs="?", default="0,1,2,3", help="prompt indices")
    ap.add_argument("configs", nargs="?", default=None, help="indices into CONFIGS (default all)")
    ap.add_argument("--specbench", action="store_true", help="Spec-Bench dev chat prompts instead of HumanEval")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    a = ap.parse_args()
    qs = select(load_workload(None)[0], limit=8, seed=1) if a.specbench else load_workload("humaneval-heldout")[0]
    idx = [int(x) for x in a.prompts.split(",")]
    configs = CONFIGS if a.configs is None else [CONFIGS[int(i)] for i in a.configs.split(",")]
    prompts = [qs[i].turns[0] for i in idx]
    chat = True if a.specbench else None
    runner = ModelRunner(leapdecode.load("qwen2.5-coder-1.5b"))
    leapdecode.generate(runner, prompts[0], method="eagle", max_new_tokens=16, chat=chat)  # warm-up
    for method, options in configs:
        tokens = wall = forwards = 0
        stats: dict[str, float] = {}
        for p in prompts:
            t0 = time.perf_counter()
            r = leapdecode.generate(runner, p, method=method, options=options, max_new_tokens=a.new, chat=chat)
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
