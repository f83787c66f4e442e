"""Record every method's tokens on a fixed set of prompts, or compare them with a recording.

A structural change must not change what any method emits.  This runs methods x prompts x
{greedy, seeded sampling} on real models (one runner per model, the generations in one fixed
order, so cross-request memory sees the same history) and writes each generation's tokens;
``--compare FILE`` runs the same set again and names every generation whose tokens differ.

    python scripts/same_tokens.py --out /tmp/before.json            # at the old revision
    python scripts/same_tokens.py --compare /tmp/before.json        # at the new one

Sampled generations use a seed each, so the same code gives the same tokens; a change that keeps
the distribution but draws differently would show here as a difference (this checks more than
exactness needs, which is what a refactor promises).  Each generation's target forwards are
recorded too: since every method emits vanilla's tokens whatever it drafts, the forwards are what
shows that the same trees were drafted (greedy cost-aware sizing follows the measured clock, so
those may differ between two runs of the same code; a seeded sampling run's trees may not).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import leapdecode
from leapdecode.bench.workloads import load_workload, select

# (model, method, options): the methods that run without a trained head or datastore on the small
# model; the bundled EAGLE-3 head on the 1.5B for the level-by-level tree of a trained head
RUNS = [
    ("smollm2-135m", "vanilla", {}),
    ("smollm2-135m", "pld", {}),
    ("smollm2-135m", "sam", {}),
    ("smollm2-135m", "suffix", {}),
    ("smollm2-135m", "recycling", {}),
    ("smollm2-135m", "lookahead", {}),
    ("smollm2-135m", "jacobi", {}),
    ("smollm2-135m", "layerskip", {}),
    ("smollm2-135m", "draft", {"draft": "smollm2-135m"}),
    ("smollm2-135m", "auto", {}),
    ("smollm2-135m", "auto", {"use_memory": True}),
    ("qwen2.5-coder-1.5b", "eagle", {}),
    ("qwen2.5-coder-1.5b", "auto", {}),
]
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8, "top_p": 0.95}}


def run(prompts: int, max_new_tokens: int, only: set[str] | None) -> dict[str, dict]:
    questions = select(load_workload(None)[0], limit=prompts)
    out: dict[str, list[int]] = {}
    runners: dict[str, object] = {}
    for model, method, options in RUNS:
        if only and model not in only:
            continue
        if model not in runners:
            runners[model] = leapdecode.load(model)
        for mode, sampling in MODES.items():
            for i, q in enumerate(questions):
                key = f"{model} {method}{json.dumps(options, sort_keys=True) if options else ''} {mode} {q.question_id}"
                t0 = time.perf_counter()
                res = leapdecode.generate(runners[model], q.turns[0], method=method, options=options or None,
                                          max_new_tokens=max_new_tokens, chat=q.chat, seed=1000 + i, **sampling)
                out[key] = {"tokens": list(res.tokens), "forwards": res.stats.get("target_forwards")}
                print(f"{key}: {len(res.tokens)} tokens, {out[key]['forwards']} forwards, "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the recording here")
    ap.add_argument("--compare", type=Path, help="compare with this recording; exit 1 on any difference")
    ap.add_argument("--prompts", type=int, default=4, help="prompts of the default workload (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--models", help="comma-separated: only these models' runs")
    args = ap.parse_args(argv)
    if not args.out and not args.compare:
        ap.error("give --out or --compare")
    tokens = run(args.prompts, args.max_new_tokens, set(args.models.split(",")) if args.models else None)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(tokens, indent=0))
        tmp.replace(args.out)
    if args.compare:
        before = json.loads(args.compare.read_text())
        missing = [k for k in tokens if k not in before]
        differ = [k for k in tokens if k in before and before[k]["tokens"] != tokens[k]["tokens"]]
        trees = [k for k in tokens if k in before and before[k]["forwards"] != tokens[k]["forwards"]]
        for k in missing:
            print(f"not in the recording: {k}")
        for k in differ:
            print(f"DIFFERENT: {k}")
        for k in trees:  # the same tokens in another number of forwards: other trees were drafted
            print(f"other forwards: {k}: {before[k]['forwards']} -> {tokens[k]['forwards']}")
        print(f"{len(tokens) - len(differ) - len(missing)} of {len(tokens)} generations the same tokens; "
              f"{len(tokens) - len(trees) - len(missing)} in the same number of target forwards")
        return 1 if differ or missing else 0
    print(f"{len(tokens)} generations recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
