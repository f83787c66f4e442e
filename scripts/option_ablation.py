"""Compare generate() option sets (a method's options switched on and off) on Spec-Bench
prompts, interleaved per prompt; prints each run and the mean tokens/s ratio to the first set.

    python scripts/option_ablation.py -m qwen2.5-coder-1.5b --new 96 --prompts 6 \\
        "method='vanilla'" "method='draft'" "method='draft', draft_vocab=0" "method='draft', adaptive=False"

Each set is the body of a Python ``dict(...)``: ``method`` and that method's options (its typed
config's fields, see ``leapdecode methods``).  The prompts are the first turn of the first
question of each of six Spec-Bench task groups in the workload file (greedy, chat template).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import leapdecode
from leapdecode.bench.workloads import find_default_workload

GROUPS = ["writing", "translation", "summarization", "qa", "math_reasoning", "rag"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sets", nargs="+", help="option sets, e.g. \"method='draft', draft_vocab=0\"")
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--workload", type=Path, default=None)
    ap.add_argument("--new", type=int, default=96, help="max new tokens")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--group", default=None,
                    help="take the first PROMPTS questions of this one task group instead (e.g. rag)")
    a = ap.parse_args()
    sets = [eval(f"dict({s})") for s in a.sets]  # a developer's script: the sets are typed by hand
    path = a.workload or find_default_workload()
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if a.group:
        prompts = [q["turns"][0] for q in questions if q["category"] == a.group][: a.prompts]
    else:
        first: dict[str, str] = {}
        for q in questions:
            first.setdefault(q["category"], q["turns"][0])
        prompts = [first[g] for g in GROUPS if g in first][: a.prompts]
    model = leapdecode.load(a.model)
    leapdecode.generate(model, "hi", max_new_tokens=8, method="draft")  # warm-up, loads the draft
    ratios: list[list[float]] = [[] for _ in sets]
    for p in prompts:
        base = None
        for i, opts in enumerate(sets):
            opts = dict(opts)
            method = opts.pop("method", "auto")
            r = leapdecode.generate(model, [{"role": "user", "content": p}], max_new_tokens=a.new, method=method,
                                    options=opts)
            s = r.stats
            base = base or s["tokens_per_s"]
            ratios[i].append(s["tokens_per_s"] / base)
            print(opts, s["new_tokens"], "tok/s", s["tokens_per_s"], "mean accepted", s["mean_accepted"],
                  "prompt", s["prompt_tokens"], "wall", s["wall_s"], "prefill", s["prefill_s"],
                  "draft_s", s["draft_s"], "verify_s", s["verify_s"], s.get("auto_arms", ""), flush=True)
    for opts, r in zip(sets, ratios):
        print(f"mean tokens/s ratio {sum(r) / len(r):.3f}  {opts}")


if __name__ == "__main__":
    main()
