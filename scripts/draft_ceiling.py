"""How fast could the decoding phase be?  Ceilings of the speedup over vanilla, per workload.

Runs vanilla (greedy; constrained with ``--json-object``) on the bench's prompts, as
``scripts/decode_phase.py`` does, then replays each output against the target's verification cost
profile (``ModelRunner.verify_cost``: a forward of n tokens costs ``cost(n)``; vanilla pays
``cost(1)`` a token) and prints, in forward-cost units (host time, drafting and the grammar left
out: these are upper bounds):

* **copy oracle**: each step drafts the continuation of the longest suffix of the text (prompt and
  output so far) that occurred before, most recent occurrence (what ``pld`` and ``sam`` copy), cut
  to exactly the tokens the target then accepts: the best any copy drafter with perfect lengths
  could do;
* **copy oracle with memory** (``--memory``): the same, but the text it copies from also holds the
  outputs of the requests before (in the workload's order, as a server's cross-request memory
  would: ``suffix``, ``auto:use_memory=true``), the request's own text winning ties: what earlier
  requests can add to copying at best;
* **perfect drafter**: knows the output and drafts, at every step, the number of its next tokens
  that minimises the total cost (dynamic programming): the ceiling of any drafter on this machine's
  verification costs.

Each ceiling is printed overall and per category; ``--save FILE`` also writes them as a report
that ``leapdecode results`` shows beside the speedup targets (``docs/results/ceilings/``).

    python scripts/draft_ceiling.py --categories extraction --json-object
    python scripts/draft_ceiling.py --workload humaneval-heldout --max-new-tokens 128
    python scripts/draft_ceiling.py --workload similar --limit 24 --max-new-tokens 128 --memory \
        --save docs/results/ceilings/DATE-MACHINE-similar.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from leapdecode.proposers.pld import NGramIndex

MAX_DRAFT = 32  # the most tokens a step may draft (the default tree budgets are 24-32)
MAX_MATCH = 16  # the longest suffix the copy oracle looks for
SEPARATOR = -1  # between remembered outputs: never a token, so no match crosses it


def _match_continuation(index: NGramIndex) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix of ``index``'s text
    that occurred before (pld's n-gram index); [] without one."""
    text = index.text
    for n in range(min(index.max_ngram, len(text) - 1), 0, -1):
        positions = index.lookup(n)
        if positions:
            return text[positions[-1]:positions[-1] + MAX_DRAFT]
    return []


def copy_continuation_at(text: Sequence[int], max_match: int = MAX_MATCH) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix of ``text`` (up to
    ``max_match`` tokens) that occurred before; [] without one."""
    index = NGramIndex(max_match)
    index.extend(text)
    return _match_continuation(index)


def copy_oracle_cost(prompt: Sequence[int], output: Sequence[int], cost: Callable[[int], float],
                     memory: Sequence[Sequence[int]] = ()) -> float:
    """Total verification cost of ``output`` when each step drafts the copy continuation's tokens that
    match the output (none where it is wrong at once); ``memory``: earlier outputs it may copy from
    too (before the prompt, so that on a tie the request's own, more recent text wins)."""
    index, i, total = NGramIndex(MAX_MATCH), 0, 0.0
    for doc in memory:
        index.extend(doc)
        index.append(SEPARATOR)
    index.extend(prompt)
    while i < len(output):
        cont = _match_continuation(index)
        a = 0
        while a < len(cont) and i + a < len(output) and cont[a] == output[i + a]:
            a += 1
        total += cost(1 + a)
        index.extend(output[i:i + a + 1])
        i += a + 1
    return total


def perfect_cost(n_tokens: int, cost: Callable[[int], float]) -> float:
    """The least total cost of emitting ``n_tokens`` tokens in steps of 1 + a tokens (a drafted and
    accepted, 0 <= a < MAX_DRAFT), a step costing ``cost(1 + a)``."""
    best = [0.0] * (n_tokens + 1)
    for i in range(n_tokens - 1, -1, -1):
        best[i] = min(cost(1 + a) + best[min(n_tokens, i + a + 1)] for a in range(MAX_DRAFT))
    return best[0]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--workload", default=None, help="as the bench's --workload (default: Spec-Bench dev)")
    ap.add_argument("--categories", default=None, help="comma-separated categories to keep")
    ap.add_argument("--limit", type=int, default=None, help="questions, sampled as the bench does")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-object", action="store_true", help="constrain every output to a JSON object")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--memory", action="store_true",
                    help="also the copy oracle that may copy from the earlier requests' outputs")
    ap.add_argument("--save", type=Path, help="also write the ceilings as a JSON report (for `leapdecode results`)")
    return ap.parse_args(argv)


def report(a: argparse.Namespace, model: str, workload: str, machine: str, cpu_flags: list[str] | None,
           relative: dict[int, float], tokens: dict[str, int], spent: dict[str, dict[str, float]]) -> dict:
    """The ceilings as ``leapdecode results`` reads them: per ceiling its speedup overall and per group."""
    n = sum(tokens.values())
    return {"report": "draft-ceiling", "model": model, "workload": workload, "limit": a.limit,
            "max_new_tokens": a.max_new_tokens, "machine": machine, "cpu_flags": cpu_flags, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": "python scripts/draft_ceiling.py " + shlex.join(sys.argv[1:]), "tokens": n,
            "relative_cost": {str(k): round(v, 4) for k, v in sorted(relative.items())},
            "ceilings": {name: {"overall": round(n / sum(by.values()), 4),
                                "by_group": {g: round(tokens[g] / c, 4) for g, c in by.items()}}
                         for name, by in spent.items()}}


def main() -> None:
    import leapdecode
    from leapdecode.bench.suite import encode_turn
    from leapdecode.bench.workloads import load_workload, select
    from leapdecode.core.cost_model import machine_description
    from leapdecode.core.runner import ModelRunner
    from leapdecode.models.qkernel import isa_flags
    from leapdecode.models.store import atomic_write

    a = parse_args()
    questions, workload = load_workload(a.workload)  # (an unknown workload or category fails before the model loads)
    questions = select(questions, a.limit, a.categories.split(",") if a.categories else None, a.seed)
    if a.json_object:  # as the bench: a workload's own schemas stay
        for q in questions:
            q.meta.setdefault("json_schema", {"type": "object"})
    model = leapdecode.load(a.model)
    runner = ModelRunner(model, prefix_cache_bytes=0)
    outputs = []  # (group, prompt ids, output ids) in the workload's order
    for q in questions:
        history: list[dict] = []
        schema = {"json_schema": q.meta["json_schema"]} if "json_schema" in q.meta else {}
        for turn in q.turns:
            ids = encode_turn(model, q, history, turn)
            res = leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=a.max_new_tokens, method="vanilla",
                                      **schema)
            outputs.append((q.category, ids, res.tokens))
            print(f"question {q.question_id}: {len(res.tokens)} tokens", flush=True)
            history += [{"role": "user", "content": turn}, {"role": "assistant", "content": res.text}]
    verify = runner.verify_cost(model.model.new_cache(max_len=1024))
    rel = verify.relative()
    unit = verify(1)

    def cost(n: int) -> float:
        return verify(n) / unit

    rows = [("copy oracle", lambda i, ids, out: copy_oracle_cost(ids, out, cost))]
    if a.memory:
        rows.append(("copy oracle with memory",
                     lambda i, ids, out: copy_oracle_cost(ids, out, cost, [o for _, _, o in outputs[:i]])))
    rows.append(("perfect drafter", lambda i, ids, out: perfect_cost(len(out), cost)))
    groups = sorted({g for g, _, _ in outputs})
    spent = {name: {g: 0.0 for g in groups} for name, _ in rows}
    tokens = {g: 0 for g in groups}
    for i, (g, ids, out) in enumerate(outputs):
        tokens[g] += len(out)
        for name, f in rows:
            spent[name][g] += f(i, ids, out)
    n_tokens = sum(tokens.values())
    print(f"\n{a.model}, {len(outputs)} outputs, {n_tokens} tokens; verification cost relative to one token: "
          + ", ".join(f"{n}: {v:.2f}" for n, v in sorted(rel.items())))
    print("| decoding phase | cost (1-token forwards) | speedup ceiling | " + " | ".join(groups) + " |")
    print("|---|---:|---:|" + "---:|" * len(groups))
    print(f"| vanilla | {n_tokens:.1f} | 1.00x |" + " 1.00x |" * len(groups))
    for name, _ in rows:
        total = sum(spent[name].values())
        print(f"| {name} | {total:.1f} | {n_tokens / total:.2f}x | "
              + " | ".join(f"{tokens[g] / spent[name][g]:.2f}x" for g in groups) + " |")
    if a.save is not None:
        flags = isa_flags() if model.device.type == "cpu" else None
        r = report(a, a.model, workload, machine_description(model.device), flags, rel, tokens, spent)
        atomic_write(a.save, json.dumps(r, indent=2) + "\n")
        print(f"saved {a.save}")


if __name__ == "__main__":
    main()
