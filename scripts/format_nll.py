"""Quality of each weight format: mean negative log-likelihood per token of fixed texts
(HumanEval prompts with their canonical solutions, Spec-Bench dev questions) under each
format, against the fp32 dequantization of the same GGUF (``--weights fp32``).

Texts are fed in chunks of at most 64 tokens, the forward size decoding and tree
verification use, so every format runs the kernels it decodes with.

    python scripts/format_nll.py -m qwen2.5-coder-1.5b --formats fp32,bf16,int4 --texts 40
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import time

import torch

import leapdecode
from leapdecode.bench.workloads import humaneval_path

CHUNK = 64


def texts(n: int, dev_questions: str | None) -> list[str]:
    with gzip.open(humaneval_path(), "rt") as f:
        problems = [json.loads(line) for line in f]
    out = [p["prompt"] + p["canonical_solution"] for p in problems[: n // 2 if dev_questions else n]]
    if dev_questions:
        with open(dev_questions) as f:
            qs = [json.loads(line) for line in f]
        out += [" ".join(q["turns"]) if "turns" in q else q.get("prompt", "") for q in qs[: n - len(out)]]
    return [t for t in out if t.strip()]


@torch.inference_mode()
def nll(model, text: str, max_tokens: int) -> tuple[float, int]:
    """Summed NLL of tokens 1..n of ``text`` and n (fed in chunks of CHUNK tokens)."""
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    net = model.model
    cache = net.new_cache(max_len=len(ids) + 8)
    total = 0.0
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = ids[start:start + CHUNK]
        logits = net(torch.tensor([chunk]), cache)[0].float()
        cache.commit()
        targets = ids[start + 1:start + 1 + len(chunk)]
        lp = torch.log_softmax(logits[: len(targets)], dim=-1)
        total -= float(lp[torch.arange(len(targets)), torch.tensor(targets)].sum())
    return total, len(ids) - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--formats", default="fp32,bf16,int4")
    ap.add_argument("--texts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--dev-questions", default=None, help="Spec-Bench jsonl to take half the texts from")
    a = ap.parse_args()
    corpus = texts(a.texts, a.dev_questions)
    results = {}
    for fmt in a.formats.split(","):
        t0 = time.perf_counter()
        model = leapdecode.load(a.model, weights=fmt)
        s = n = 0
        for text in corpus:
            ds, dn = nll(model, text, a.max_tokens)
            s, n = s + ds, n + dn
        results[fmt] = s / n
        print(f"{fmt:5s} weights={model.weights} attention={getattr(model.model, 'attention', '-')}: "
              f"mean NLL {s / n:.5f} nats/token over {n} tokens of {len(corpus)} texts "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del model
    ref = results.get("fp32")
    if ref:
        for fmt, v in results.items():
            print(f"{fmt:5s} {v:.5f}  {100 * (v - ref) / ref:+.3f}% vs fp32  ppl {math.exp(v):.4f}")


if __name__ == "__main__":
    main()
