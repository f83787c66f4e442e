#!/usr/bin/env python
"""Teacher-forced top-1 agreement of leapdecode's native kernel path with llama.cpp on the same GGUF
(issue 63: ">= 99% of teacher-forced tokens").

For each model and prompt (the chat template applied to the first turn of the first ``--prompts``
Spec-Bench development questions), llama.cpp's server decodes ``--tokens`` tokens greedily from the
GGUF; leapdecode then runs the prompt followed by llama.cpp's tokens through its default configuration
(the GGUF's blocks on the batch-invariant kernel) in forwards of 64 tokens, and counts the positions
where its own top-1 token is llama.cpp's next token.  Also reported: the first position where the two
greedy outputs would part (leapdecode's own greedy decoding compared token by token).

    python scripts/llama_agreement.py --models smollm2-135m,gemma3-270m --prompts 10 --tokens 64
    python scripts/llama_agreement.py --models /path/to/model.gguf --out agreement.json

Needs llama.cpp's server (``leapdecode bench --peers llama-server`` builds it once per machine).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "questions_dev.jsonl"


def prompts(n: int, path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def measure(name: str, questions: list[str], tokens: int, threads: int, **load) -> dict:
    import torch

    import leapdecode
    from leapdecode.bench.peers.llama_server import LlamaServer, free_port, server_binary, server_command
    from leapdecode.models.loader import model_files

    lm = leapdecode.load(name, **load)
    model = lm.model
    _, gguf = model_files(name)
    binary = server_binary()
    if binary is None:
        raise SystemExit("llama.cpp's server is not built here: run `leapdecode bench --peers llama-server` once")
    agree = total = 0
    parted = []
    with gguf() as gguf_path:
        port = free_port()
        server = LlamaServer(server_command(binary, "llama-server", gguf_path, 4096, threads, port), port)
        try:
            for i, question in enumerate(questions):
                text = lm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                        add_generation_prompt=True)
                ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
                theirs = server.complete(ids, tokens, 0.0, None)["tokens"]
                seq = ids + theirs
                cache = model.new_cache(max_len=len(seq) + 8)
                logits = []
                with torch.inference_mode():
                    for start in range(0, len(seq) - 1, 64):
                        logits.append(model(torch.tensor([seq[start:min(start + 64, len(seq) - 1)]]), cache)[0])
                        cache.commit()
                top1 = torch.cat(logits).argmax(-1)[len(ids) - 1:].tolist()
                hits = sum(a == b for a, b in zip(top1, theirs))
                agree, total = agree + hits, total + len(theirs)
                ours = leapdecode.generate(lm, prompt_ids=ids, max_new_tokens=tokens, method="vanilla").tokens
                part = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                parted.append(part)
                print(f"{name} prompt {i}: {hits}/{len(theirs)} top-1 agree; greedy outputs equal for {part} tokens",
                      file=sys.stderr)
        finally:
            server.close()
    return {"model": name, "weights": lm.weights, "backend": lm.model.backend, "prompts": len(questions), "tokens": total,
            "agreement": agree / max(total, 1), "greedy_equal_tokens": parted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-1.5b",
                    help="comma-separated registered names or GGUF paths")
    ap.add_argument("--prompts", type=int, default=10, help="Spec-Bench development questions (first turns)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens llama.cpp decodes per prompt")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--data", type=Path, default=DATA, help="a Spec-Bench questions file")
    ap.add_argument("--weights", default="auto", help="leapdecode's weights (auto: the GGUF's blocks on the kernel; "
                                                      "fp32, bf16: float weights read from the GGUF)")
    ap.add_argument("--backend", default="auto", help="native, hf (transformers' model of the GGUF) or auto")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args()
    questions = prompts(a.prompts, a.data)
    load = {"weights": a.weights} if a.backend != "hf" else {"dtype": "fp32" if a.weights == "auto" else a.weights}
    results = [measure(m, questions, a.tokens, a.threads, backend=a.backend, **load) for m in a.models.split(",") if m]
    for r in results:
        print(f"{r['model']} ({r['backend']}, {r['weights']}): {100 * r['agreement']:.1f}% of {r['tokens']} teacher-forced tokens agree with llama.cpp; "
              f"greedy outputs equal for {r['greedy_equal_tokens']} tokens")
    if a.out:
        a.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
