"""Time to first token of a chat's second turn, with and without the prefix cache.

Each Spec-Bench dev question (``--workload``) has two turns.  The first turn is answered
(``--answer-tokens`` new tokens, greedy); the second turn's prompt holds the first question, that
answer and the second question, as a chat client sends it.  With the prefix cache on a model
that prefills cut-invariantly (``NativeCausalLM.prefill_cut_invariant``) the first turn's prompt
and answer are kept in 16-token blocks, so the second turn computes only what is new; without
it (or with ``--whole-chunks``: the prefill of a model that does not) the second turn prefills
everything again.  A fresh runner per setting, the same questions in the same order; TTFT is the
time from ``start_generation`` to the first text piece, prefill included.  Greedy tokens of the
two settings are compared (they must be identical).

    python scripts/multiturn_ttft.py -m qwen2.5-coder-1.5b --questions 8 --answer-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=128, help="new tokens of the first turn's answer")
    ap.add_argument("--method", default="vanilla")
    ap.add_argument("--whole-chunks", action="store_true",
                    help="prefill in 256-token chunks as a model that does not prefill cut-invariantly")
    ap.add_argument("--workload", type=Path,
                    default=Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "questions_dev.jsonl")
    args = ap.parse_args()

    import leapdecode
    from leapdecode.api import start_generation
    from leapdecode.core.runner import ModelRunner
    from leapdecode.models.native import NativeCausalLM

    if args.whole_chunks:
        NativeCausalLM.prefill_cut_invariant = property(lambda self: False)
    model = leapdecode.load(args.model)
    rows = [json.loads(line) for line in args.workload.read_text().splitlines() if line.strip()]
    chats = [r["turns"][:2] for r in rows if len(r.get("turns", [])) >= 2][: args.questions]
    print(f"model {args.model}: prefill in forwards of "
          f"{leapdecode.core.generate.prefill_chunk(model.model)} tokens; {len(chats)} two-turn chats", flush=True)

    def ask(runner, msgs, max_new):
        t0 = time.perf_counter()
        gen = start_generation(runner, msgs, max_new_tokens=max_new, method=args.method)
        ttft = None
        for piece in gen:
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
        res = gen.result
        return (ttft if ttft is not None else time.perf_counter() - t0), res

    def run(cache_bytes: int):
        runner = ModelRunner(model, prefix_cache_bytes=cache_bytes)
        out = []
        for q1, q2 in chats:
            _, first = ask(runner, [{"role": "user", "content": q1}], args.answer_tokens)
            msgs = [{"role": "user", "content": q1}, {"role": "assistant", "content": first.text},
                    {"role": "user", "content": q2}]
            ttft, second = ask(runner, msgs, 8)
            out.append((ttft, second.prompt_tokens, second.stats.get("prefix_reused", 0), first.tokens + second.tokens))
        return out

    run(0)  # warm-up: kernels, allocator, the verification profile
    off, on = run(0), run(512 << 20)
    print("| prefix cache | turn-2 prompt tokens (mean) | reused (mean) | TTFT p50 (s) | TTFT mean (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (("off", off), ("on", on)):
        print(f"| {name} | {statistics.mean(x[1] for x in r):.0f} | {statistics.mean(x[2] for x in r):.0f} | "
              f"{statistics.median(x[0] for x in r):.3f} | {statistics.mean(x[0] for x in r):.3f} |")
    same = sum(a[3] == b[3] for a, b in zip(off, on))
    print(f"turn-2 TTFT speedup (mean): {statistics.mean(x[0] for x in off) / statistics.mean(x[0] for x in on):.2f}x; "
          f"identical tokens (both turns): {same}/{len(off)}")


if __name__ == "__main__":
    main()
