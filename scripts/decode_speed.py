"""Vanilla greedy decode speed: leapdecode native vs HF transformers `generate`, same weights
and dtype, plus the achieved weight bandwidth (weight bytes read per decoded token).

    python scripts/decode_speed.py -m qwen2.5-coder-1.5b --dtype bf16 --new 64   # bf16 weights, HF in bf16
    python scripts/decode_speed.py -m qwen2.5-coder-1.5b --new 96 --skip-hf --stat best   # the default format

``--dtype auto`` (the default) loads the default format (``weights="auto"``); an explicit dtype
loads that dtype's float weights.  HF runs in bf16 unless ``--dtype fp32``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import leapdecode
from leapdecode.core.generate import encode_prompt

PROMPT = "Write a Python function that merges two sorted lists into one sorted list, with a docstring and tests."


def weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every linear layer (the output head included)
    and the norms; of the input embedding only one row is gathered, so it is left out."""
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) or hasattr(m, "packed"):
            elt = m.packed.element_size() if hasattr(m, "packed") else m.weight.element_size()
            total += m.in_features * m.out_features * elt
    for name, p in model.named_parameters(recurse=True):
        if p.dim() == 1:  # norms and biases
            total += p.numel() * p.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--stat", choices=["median", "best"], default="median",
                    help="which of the repeats' decode rates to report")
    a = ap.parse_args()

    out = {"model": a.model, "dtype": a.dtype, "new_tokens": a.new, "threads": torch.get_num_threads()}
    lm = leapdecode.load(a.model, dtype=a.dtype, backend="native")
    ids = encode_prompt(lm, PROMPT, chat=True)
    leapdecode.generate(lm, PROMPT, chat=True, max_new_tokens=8, method="vanilla")  # warm-up
    rates, tokens = [], None
    for _ in range(a.repeats):
        r = leapdecode.generate(lm, PROMPT, chat=True, max_new_tokens=a.new, method="vanilla")
        rates.append(r.stats["new_tokens"] / (r.stats["wall_s"] - r.stats.get("prefill_s", 0.0)))
        tokens = r.tokens
    nbytes = weight_bytes(lm.model)
    native = max(rates) if a.stat == "best" else sorted(rates)[len(rates) // 2]
    out["native_tok_s"] = round(native, 3)
    out["weight_bytes"] = nbytes
    out["native_GB_s"] = round(native * nbytes / 1e9, 2)
    del lm
    if not a.skip_hf:
        from transformers import AutoModelForCausalLM

        from leapdecode.models.registry import ensure_converted

        path = ensure_converted(a.model)
        dt = torch.float32 if a.dtype == "fp32" else torch.bfloat16
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt).eval()
        x = torch.tensor([ids])
        kw = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
        with torch.inference_mode():
            hf.generate(x, max_new_tokens=8, min_new_tokens=8, **kw)
            hrates = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
                t_prefill = time.perf_counter() - t0
                t0 = time.perf_counter()
                g = hf.generate(x, max_new_tokens=a.new, min_new_tokens=a.new, **kw)
                dt_s = time.perf_counter() - t0 - t_prefill
                hrates.append((a.new - 1) / dt_s)
        hf_tokens = g[0, len(ids):].tolist()
        out["hf_generate_tok_s"] = round(sorted(hrates)[len(hrates) // 2], 3)
        out["speedup_vs_hf"] = round(native / out["hf_generate_tok_s"], 2)
        n = min(len(tokens), len(hf_tokens))
        diff = [i for i in range(n) if tokens[i] != hf_tokens[i]]
        out["greedy_identical"] = not diff and len(tokens) == len(hf_tokens)
        out["first_divergence"] = diff[0] if diff else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
