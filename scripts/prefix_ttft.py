"""Time to first token with and without the prefix cache (issue 14, section 1).

Requests that share a long system prompt (a reference document, as in a RAG or assistant
deployment) and differ in the user's question.  For each setting (prefix cache off, on) a fresh
runner answers the same questions in the same order; the time to first token (TTFT) is the time
from ``start_generation`` to the first text piece, prefill included.  The first request of the
"on" run fills the cache; the others reuse every whole 256-token chunk of the shared prefix.

The shared document is the source of a Python standard-library module (real text, the same on
every machine); the questions are the first Spec-Bench dev questions (``--workload``).

    python scripts/prefix_ttft.py -m smollm2-135m --questions 12 --doc-tokens 1536
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--doc-tokens", type=int, default=1536, help="length of the shared system prompt (tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--workload", type=Path,
                    default=Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "questions_dev.jsonl")
    args = ap.parse_args()

    import argparse as doc_module  # the shared document: this module's source

    import leapdecode
    from leapdecode.api import start_generation
    from leapdecode.core.generate import encode_prompt
    from leapdecode.core.runner import ModelRunner

    model = leapdecode.load(args.model)
    tok = model.tokenizer
    doc_ids = tok.encode(inspect.getsource(doc_module))[: args.doc_tokens]
    system = "Answer using this reference document when it helps.\n\n" + tok.decode(doc_ids)
    questions = [json.loads(line)["turns"][0] for line in args.workload.read_text().splitlines() if line.strip()]
    questions = questions[: args.questions]

    reused: list[int] = []

    def run(cache_bytes: int) -> list[float]:
        runner = ModelRunner(model, prefix_cache_bytes=cache_bytes)
        ttfts: list[float] = []
        for q in questions:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            t0 = time.perf_counter()
            gen = start_generation(runner, msgs, max_new_tokens=args.max_new_tokens, method="vanilla")
            for piece in gen:
                if piece:
                    break
            ttfts.append(time.perf_counter() - t0)
            gen.close()
            reused.append(gen.result.stats.get("prefix_reused", 0))
        return ttfts

    run(0)  # warm-up (kernels, allocator)
    rows = {"off": run(0)}
    reused.clear()
    rows["on"] = run(512 << 20)
    prompt_lens = [len(encode_prompt(model, [{"role": "system", "content": system}, {"role": "user", "content": q}]))
                   for q in questions]
    print(f"model {args.model}, {len(questions)} requests sharing a {len(doc_ids)}-token document "
          f"(prompts {min(prompt_lens)}-{max(prompt_lens)} tokens), max_new_tokens {args.max_new_tokens}")
    print("| prefix cache | TTFT first request (s) | TTFT p50 of the others (s) | TTFT mean of the others (s) |")
    print("|---|---|---|---|")
    for name, t in rows.items():
        print(f"| {name} | {t[0]:.3f} | {statistics.median(t[1:]):.3f} | {statistics.mean(t[1:]):.3f} |")
    print(f"prompt tokens reused from the cache per request (on): {reused}")
    off, on = statistics.median(rows["off"][1:]), statistics.median(rows["on"][1:])
    print(f"speedup of the median TTFT with the prefix cache: {off / on:.2f}x")


if __name__ == "__main__":
    main()
