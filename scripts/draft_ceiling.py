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
* **perfect drafter**: knows the output and drafts, at every step, the number of its next tokens
  that minimises the total cost (dynamic programming): the ceiling of any drafter on this machine's
  verification costs.

    python scripts/draft_ceiling.py --categories extraction --json-object
    python scripts/draft_ceiling.py --workload humaneval-heldout --max-new-tokens 128
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from leapdecode.proposers.pld import NGramIndex

MAX_DRAFT = 32  # the most tokens a step may draft (the default tree budgets are 24-32)
MAX_MATCH = 16  # the longest suffix the copy oracle looks for


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


def copy_oracle_cost(prompt: Sequence[int], output: Sequence[int], cost: Callable[[int], float]) -> float:
    """Total verification cost of ``output`` when each step drafts the copy continuation's tokens that
    match the output (none where it is wrong at once)."""
    index, i, total = NGramIndex(MAX_MATCH), 0, 0.0
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


def main() -> None:
    import leapdecode
    from leapdecode.bench.suite import encode_turn
    from leapdecode.core.runner import ModelRunner

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_phase import workload_parser, workload_questions

    a = workload_parser(__doc__).parse_args()
    model = leapdecode.load(a.model)
    questions = workload_questions(a)
    runner = ModelRunner(model, prefix_cache_bytes=0)
    outputs = []
    for q in questions:
        history: list[dict] = []
        schema = {"json_schema": q.meta["json_schema"]} if "json_schema" in q.meta else {}
        for turn in q.turns:
            ids = encode_turn(model, q, history, turn)
            res = leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=a.max_new_tokens, method="vanilla",
                                      **schema)
            outputs.append((ids, res.tokens))
            print(f"question {q.question_id}: {len(res.tokens)} tokens", flush=True)
            history += [{"role": "user", "content": turn}, {"role": "assistant", "content": res.text}]
    verify = runner.verify_cost(model.model.new_cache(max_len=1024))
    rel = verify.relative()
    unit = verify(1)

    def cost(n: int) -> float:
        return verify(n) / unit

    n_tokens = sum(len(out) for _, out in outputs)
    copy = sum(copy_oracle_cost(ids, out, cost) for ids, out in outputs)
    perfect = sum(perfect_cost(len(out), cost) for _, out in outputs)
    print(f"\n{a.model}, {len(outputs)} outputs, {n_tokens} tokens; verification cost relative to one token: "
          + ", ".join(f"{n}: {v:.2f}" for n, v in sorted(rel.items())))
    print("| decoding phase | cost (1-token forwards) | speedup ceiling |")
    print("|---|---:|---:|")
    print(f"| vanilla | {n_tokens:.1f} | 1.00x |")
    print(f"| copy oracle | {copy:.1f} | {n_tokens / copy:.2f}x |")
    print(f"| perfect drafter | {perfect:.1f} | {n_tokens / perfect:.2f}x |")


if __name__ == "__main__":
    main()
