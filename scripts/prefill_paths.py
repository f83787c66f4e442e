"""Prefill on the quantized kernel against prefill on the bf16 copy of the weights (``--weights
int4``, the default on a CPU with AVX512-VNNI), in one process.

``layers``: every block's linear layers at each row count (``QLinear.rowwise``: the kernel;
``QLinear.dense()``: the bf16 copy through oneDNN), ms and ms per row, min of rounds.
``generate``: ``leapdecode.generate(..., max_new_tokens=1)`` on slices of ``--tokens`` tokens of this
repository's docs (a new slice each call, so no prefix is reused), with every layer's prefill on
the copy, on the kernel, or each as ``qkernel.prefill_on_dense`` decides (the default), min of
rounds in tokens/s.

    python scripts/prefill_paths.py layers --rows 64,128,256
    python scripts/prefill_paths.py generate --tokens 500 --rounds 3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import leapdecode
from leapdecode.models import qkernel
from leapdecode.models.quant import BLOCK_LINEARS

ROOT = Path(__file__).resolve().parent.parent


def best_of(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["layers", "generate"])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    runner = leapdecode.load(a.model, weights="int4")
    model = runner.model
    if a.mode == "layers":
        layers = [getattr(b, n) for b in model.layers for n in BLOCK_LINEARS]
        print(f"{a.model}: {len(layers)} block linear layers, {torch.get_num_threads()} threads")
        print("| rows | kernel ms (per row) | bf16 copy ms (per row) | kernel / copy |")
        print("|---:|---:|---:|---:|")
        for m in (int(r) for r in a.rows.split(",")):
            xs = {l.in_features: torch.randn(m, l.in_features).to(torch.bfloat16) for l in layers}
            kern = best_of(lambda: [l.rowwise(xs[l.in_features]) for l in layers], a.rounds) * 1e3
            dense = best_of(lambda: [l.dense()[0](xs[l.in_features]) for l in layers], a.rounds) * 1e3
            print(f"| {m} | {kern:.0f} ({kern / m:.2f}) | {dense:.0f} ({dense / m:.2f}) | {kern / dense:.2f} |", flush=True)
        return
    linears = [l for l in model.modules() if isinstance(l, qkernel.QLinear) and not l.out_fp32]
    measured = {id(l): qkernel.prefill_on_dense(l.parts) for l in linears}
    print(f"{a.model}: {sum(measured.values())} of {len(linears)} block layers prefill on the bf16 copy as measured "
          f"({qkernel.prefill_ratios()})")
    text = "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    ids = runner.tokenizer(text)["input_ids"]
    if len(ids) < a.tokens * 3 * (a.rounds + 1):
        raise SystemExit(f"the docs hold {len(ids)} tokens: fewer --tokens or --rounds")
    best: dict[str, float] = {}
    start = 0
    for r in range(a.rounds + 1):  # the first round warms up (and builds the copies)
        for path in ("copy", "kernel", "measured"):
            for l in linears:
                l._on_dense = measured[id(l)] if path == "measured" else path == "copy"
            t = time.perf_counter()
            leapdecode.generate(runner, prompt_ids=ids[start:start + a.tokens], max_new_tokens=1, method="vanilla",
                                chat=False)
            dt = time.perf_counter() - t
            start += a.tokens
            if r:
                best[path] = min(best.get(path, float("inf")), dt)
    print("| prefill path | seconds | tokens/s |")
    print("|---|---:|---:|")
    for path, s in best.items():
        print(f"| {path} | {s:.2f} | {a.tokens / s:.0f} |")


if __name__ == "__main__":
    main()
