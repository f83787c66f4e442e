"""The decoding phase alone: seconds after the prefill, per method, on one workload's prompts.

``leapdecode bench`` reports tokens/s including each prompt's prefill, which is the same work for
every method; on short outputs after long prompts (JSON extraction: a third of vanilla's time is
prefill) that hides what a change to drafting or tree sizing did.  This script runs the bench's
prompts (first turns as asked, second turns with vanilla's answer as history, as the bench does),
every method on its own runner (as the bench's runners: each learns its own costs and
statistics), interleaved per prompt, checks that each method's greedy tokens equal vanilla's, and
prints per method: decoding seconds (wall minus prefill), its speedup over vanilla's, prefill
seconds, target forwards, verified draft rows, and where the decoding seconds went (drafting, the
forwards with their verification, the grammar's share).

    python scripts/decode_phase.py --categories extraction --json-object --methods auto,sam,pld
    python scripts/decode_phase.py --workload humaneval-heldout --methods auto,eagle --max-new-tokens 128
    python scripts/decode_phase.py --categories extraction --json-object --methods pld,pld:cost_aware=false

A method row takes options as in the bench: ``METHOD:KEY=VALUE[:KEY=VALUE...]`` (``split_method_row``).
"""

from __future__ import annotations

import argparse

import leapdecode
from leapdecode.bench.runners import split_method_row
from leapdecode.bench.suite import encode_turn
from leapdecode.bench.workloads import load_workload, select
from leapdecode.core.runner import ModelRunner


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """The options that pick the model and the bench's prompts (shared with ``draft_ceiling.py``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--workload", default=None, help="as the bench's --workload (default: Spec-Bench dev)")
    ap.add_argument("--categories", default=None, help="comma-separated categories to keep")
    ap.add_argument("--limit", type=int, default=None, help="questions, sampled as the bench does")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-object", action="store_true", help="constrain every output to a JSON object")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    return ap


def workload_questions(a: argparse.Namespace) -> list:
    """The bench's questions that ``workload_parser``'s options select."""
    questions, _ = load_workload(a.workload)
    questions = select(questions, a.limit, a.categories.split(",") if a.categories else None, a.seed)
    if a.json_object:  # as the bench: a workload's own schemas (SchemaStore) stay
        for q in questions:
            q.meta.setdefault("json_schema", {"type": "object"})
    return questions


def main() -> None:
    ap = workload_parser(__doc__)
    ap.add_argument("--methods", default="auto,sam,pld", help="comma-separated method rows (vanilla is the reference)")
    a = ap.parse_args()
    rows = ["vanilla"] + [r for r in a.methods.split(",") if r and r != "vanilla"]
    specs = {r: split_method_row(r) for r in rows}  # an unknown method or option fails here, before the model loads

    model = leapdecode.load(a.model)
    questions = workload_questions(a)
    runners = {r: ModelRunner(model, prefix_cache_bytes=0) for r in rows}
    totals = {r: {"decode": 0.0, "prefill": 0.0, "forwards": 0, "rows": 0, "draft": 0.0, "verify": 0.0,
                  "constraint": 0.0} for r in rows}
    tokens = 0
    for q in questions:
        history: list[dict] = []
        schema = {"json_schema": q.meta["json_schema"]} if "json_schema" in q.meta else {}
        for turn in q.turns:
            ids = encode_turn(model, q, history, turn)
            reference = None
            for row in rows:
                name, options = specs[row]
                res = leapdecode.generate(runners[row], prompt_ids=ids, max_new_tokens=a.max_new_tokens,
                                          method=name, options=options or None, **schema)
                if reference is None:
                    reference = res
                    tokens += len(res.tokens)
                elif res.tokens != reference.tokens:
                    raise SystemExit(f"{row} gave other tokens than vanilla on question {q.question_id}")
                st, t = res.stats, totals[row]
                t["decode"] += st["wall_s"] - st["prefill_s"]
                t["prefill"] += st["prefill_s"]
                t["forwards"] += st["target_forwards"]
                t["rows"] += st["tree_rows"]
                t["draft"] += st["draft_s"]
                t["verify"] += st["verify_s"]
                t["constraint"] += st.get("constraint_s", 0.0)
            print(f"question {q.question_id}: {len(reference.tokens)} tokens", flush=True)
            history += [{"role": "user", "content": turn}, {"role": "assistant", "content": reference.text}]
    base = totals["vanilla"]["decode"]
    print(f"\n{a.model}, {tokens} tokens (every method: vanilla's)\n")
    # of the decoding seconds: drafting (the step's planning: proposer, forced tokens, pruning), the
    # forward and its verification, and the grammar's share of both (masks, pruning, pushes)
    print("| method | decoding s | speedup | prefill s | forwards | draft rows | drafting s | forward+verify s | grammar s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row, t in totals.items():
        print(f"| {row} | {t['decode']:.2f} | {base / t['decode']:.2f}x | {t['prefill']:.2f} | {t['forwards']} | {t['rows']} "
              f"| {t['draft']:.2f} | {t['verify']:.2f} | {t['constraint']:.2f} |")


if __name__ == "__main__":
    main()
