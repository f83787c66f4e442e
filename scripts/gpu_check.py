"""The prepared GPU check (issue 47): leapdecode's engine on one CUDA GPU, in one run of a few
minutes with nothing to download.

It builds a model of qwen2.5-coder-1.5b's exact configuration with random weights (a step's speed
does not depend on the weights' values) through transformers, saves it with a tokenizer of the
same vocabulary size, loads it with ``leapdecode.load`` (the engine's own CUDA path, bf16) and
measures, on the same weights:

1. ``hf``: transformers' ``generate`` (greedy, batch 1) tokens/s;
2. ``vanilla``: leapdecode's vanilla decoding in each configuration: ``eager`` (``static_steps=
   "off"``), ``graphs`` (CUDA graphs of one shape, ``static_shapes="exact"``, the default) and
   ``graphs-buckets`` (``"buckets"``: the cheapest shape per forward; models/static_step.py),
   tokens/s of the decoding phase, against the memory-bandwidth limit (bytes of weights read per
   token / the measured copy bandwidth);
3. ``verify``: the cost of one forward of 1-64 rows (a chain after a 512-token context) relative to
   one row, eager and graphs;
4. ``invariance``: whether a token's logits have the same bits whatever the row bucket it is in
   (the property speculative decoding's exactness rests on);
5. ``identity``: greedy pld and draft (a draft model with the target's own weights) against
   vanilla, token for token, in each configuration, plus their speed;
6. ``tests``: ``pytest tests/test_static_step.py tests/test_head_training.py`` on the GPU (their
   CUDA-marked tests: graph capture, and ``train-head`` with the target on the GPU).

Every section is timed, its failure recorded rather than fatal, and ``gpu_check.json`` plus
``gpu_check.md`` (the table for docs/results.md) are rewritten after each, so a run stopped at its
limit still leaves what it measured.

    python scripts/gpu_check.py --out $OUT                  # on the GPU machine
    python scripts/gpu_check.py --out /tmp/gc --tiny        # anywhere: a tiny model, the CPU, no graphs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
import leapdecode  # noqa: E402
from leapdecode.core.runner import ModelRunner  # noqa: E402
from leapdecode.models.static_step import ROW_BUCKETS  # noqa: E402

LABELS = {"eager": "leapdecode eager", "graphs": "leapdecode CUDA graphs, one shape (exact, default)",
          "graphs-buckets": "leapdecode CUDA graphs, row buckets", "padded": "leapdecode padded, one shape",
          "padded-buckets": "leapdecode padded, row buckets"}


def configure(lm, name: str) -> None:
    """Set the decoder to a configuration: eager, graphs[-buckets] or padded[-buckets]."""
    mode, _, policy = name.partition("-")
    lm.model.static_steps = "off" if mode == "eager" else mode
    lm.model.static_shapes = policy or "exact"

# Qwen2.5-Coder-1.5B-Instruct's config.json (the registry's default target), architecture fields only
QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
    "hidden_act": "silu", "initializer_range": 0.02, "use_sliding_window": False, "torch_dtype": "bfloat16",
}
TINY = dict(QWEN_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, initializer_range=0.2)


def synthetic_tokenizer(vocab_size: int):
    """A byte-level tokenizer padded with filler tokens to ``vocab_size`` (so every id the random
    model emits decodes), with a ChatML template; nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[s] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<f{len(vocab)}>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def build_model(cfg: dict, directory: Path, device: str, seed: int):
    """A random ``Qwen2ForCausalLM`` of ``cfg`` saved to ``directory`` (safetensors, bf16) with a
    tokenizer; returns the transformers model (on ``device``, bf16, eval)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    config.architectures = cfg["architectures"]
    with torch.device(device):
        hf = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    hf.save_pretrained(directory, safe_serialization=True)
    synthetic_tokenizer(cfg["vocab_size"]).save_pretrained(directory)
    return hf


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 10."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times[2:])


def weight_bytes(model) -> int:
    """Bytes a decoding step reads: every weight once (a tied embedding counted once, as the head
    reads it whole; the embedding lookup reads one row)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    """A prompt that repeats itself (so prompt lookup finds matches), ids past the byte range."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(300, vocab, (max(8, n // 4),), generator=g).tolist()
    return (base * 5)[:n]


def decode_rate(result) -> float:
    s = result.stats
    decode = s["wall_s"] - s["prefill_s"]
    return round((s["new_tokens"] - 1) / decode, 2) if decode > 0 else 0.0


def run_generate(lm, ids, n, method="vanilla", options=None):
    runner = ModelRunner(lm)
    if method == "draft":
        runner.add_draft("self", lm)
        options = {"draft": "self", **(options or {})}
    return leapdecode.generate(runner, prompt_ids=ids, max_new_tokens=n, method=method, options=options)


# ------------------------------------------------------------------------------------- sections
def section_hf(ctx) -> dict:
    hf, ids, n, dev = ctx["hf"], ctx["ids"], ctx["tokens"], ctx["device"]
    x = torch.tensor([ids], device=dev)
    kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(x, **dict(kw, max_new_tokens=8, min_new_tokens=8))  # warm-up
        sync(dev)
        t0 = time.perf_counter()
        out = hf.generate(x, **kw)
        sync(dev)
        wall = time.perf_counter() - t0
    ctx["hf_tokens"] = out[0, len(ids):].tolist()
    return {"tokens_per_s": round(n / wall, 2), "wall_s": round(wall, 3), "attn": hf.config._attn_implementation}


def section_vanilla(ctx) -> dict:
    lm, ids, n = ctx["lm"], ctx["ids"], ctx["tokens"]
    out = {}
    limit = ctx["bandwidth"] / ctx["weight_bytes"]
    for mode in ctx["modes"]:
        configure(lm, mode)
        run_generate(lm, ids, 16)  # warm-up (and, with graphs, the captures of a first generation)
        rates, result = [], None
        for _ in range(3):
            result = run_generate(lm, ids, n)
            rates.append(decode_rate(result))
        rate = statistics.median(rates)
        out[mode] = {"decode_tokens_per_s": rate, "runs": rates, "tokens_per_s": result.stats["tokens_per_s"],
                     "of_bandwidth_limit": round(rate / limit, 3)}
        ctx.setdefault("vanilla_tokens", {})[mode] = result.tokens
    out["bandwidth_limit_tokens_per_s"] = round(limit, 1)
    hf = ctx["results"].get("hf", {}).get("tokens_per_s")
    for mode in ctx["modes"]:
        if hf:
            out[mode]["vs_hf"] = round(out[mode]["tokens_per_s"] / hf, 2)
    if "hf_tokens" in ctx:
        out["same_tokens_as_hf"] = {m: ctx["vanilla_tokens"][m] == ctx["hf_tokens"] for m in ctx["modes"]}
    return out


def timed_forward(lm, cache, t: int, reps: int, dev) -> float:
    """Median seconds of a forward of a ``t``-token chain after the committed context (rolled back)."""
    toks = torch.arange(300, 300 + t, device=dev)[None]
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        lm.model.forward(toks, cache)
        sync(dev)
        times.append(time.perf_counter() - t0)
        cache.rollback()
    return statistics.median(times[2:])


def context_cache(lm, n: int):
    cache = lm.model.new_cache(max_len=2048)
    ids = torch.tensor(prompt_ids(lm.model.vocab_size, n, 7), device=lm.device)
    for i in range(0, n, 256):
        lm.model.forward(ids[None, i : i + 256], cache, logits_for=slice(0, 0))
        cache.commit()
    return cache


def section_verify(ctx) -> dict:
    lm, dev = ctx["lm"], ctx["device"]
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    out = {}
    for mode in ctx["modes"]:
        configure(lm, mode)
        cache = context_cache(lm, 512)
        ms = {t: timed_forward(lm, cache, t, ctx["reps"], dev) for t in sizes}
        out[mode] = {"ms": {t: round(v * 1e3, 3) for t, v in ms.items()},
                     "vs_one_row": {t: round(v / ms[1], 3) for t, v in ms.items()}}
    return out


def section_invariance(ctx) -> dict:
    """A token's logits alone against the same token as row 0 and as the last real row of a forward
    of each bucket (the other rows random tokens of a chain): bitwise equal, and the largest difference."""
    lm, dev = ctx["lm"], ctx["device"]
    out = {}
    for mode in ctx["modes"]:
        configure(lm, mode)
        cache = context_cache(lm, 512)
        vocab = lm.model.vocab_size
        probe = torch.tensor([[vocab - 5]], device=dev)
        alone = lm.model.forward(probe, cache)[0, 0]
        cache.rollback()
        rows = {}
        for b in ROW_BUCKETS:
            first = torch.cat([probe, torch.randint(300, vocab, (1, b - 1), device=dev)], 1)
            got_first = lm.model.forward(first, cache)[0, 0]
            cache.rollback()
            # the probe as a sibling of b - 1 other roots: each row sees only the context and itself
            last = torch.cat([torch.randint(300, vocab, (1, b - 1), device=dev), probe], 1)
            got_last = lm.model.forward(last, cache, parents=[-1] * b)[0, -1]
            cache.rollback()
            rows[b] = {"first_equal": bool(torch.equal(alone, got_first)),
                       "last_equal": bool(torch.equal(alone, got_last)),
                       "max_abs_diff": float(max((alone - got_first).abs().max(), (alone - got_last).abs().max()))}
        out[mode] = {"all_equal": all(r["first_equal"] and r["last_equal"] for r in rows.values()), "rows": rows}
    return out


def section_identity(ctx) -> dict:
    lm, n = ctx["lm"], ctx["id_tokens"]
    out = {}
    for name in ctx["modes"]:
        configure(lm, name)
        entry = {}
        for p, seed in enumerate((11, 12)):
            ids = prompt_ids(lm.model.vocab_size, 96, seed)
            base = run_generate(lm, ids, n)
            for method in ("pld", "draft"):
                r = run_generate(lm, ids, n, method)
                same = r.tokens == base.tokens
                first = next((i for i, (a, b) in enumerate(zip(r.tokens, base.tokens)) if a != b), None)
                e = entry.setdefault(method, {"identical": 0, "prompts": 0, "first_divergence": [], "mean_accepted": [],
                                              "speedup": []})
                e["prompts"] += 1
                e["identical"] += int(same)
                e["first_divergence"].append(first)
                e["mean_accepted"].append(r.stats["mean_accepted"])
                e["speedup"].append(round(r.stats["tokens_per_s"] / base.stats["tokens_per_s"], 3))
        out[name] = entry
    return out


def section_tests(ctx) -> dict:
    if ctx["device"].type != "cuda":
        return {"skipped": "not on a GPU"}
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "test_static_step.py"), str(ROOT / "tests" / "test_head_training.py")],
                       capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=240)
    tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
    return {"returncode": p.returncode, "tail": tail}


SECTIONS = [("hf", section_hf), ("vanilla", section_vanilla), ("verify", section_verify),
            ("invariance", section_invariance), ("identity", section_identity), ("tests", section_tests)]


# ------------------------------------------------------------------------------------- report
def markdown(res: dict) -> str:
    env = res["env"]
    lines = [f"GPU check, {env['date']}: {env['device_name']}, torch {env['torch']}, transformers "
             f"{env['transformers']}; model: {env['model']} (random weights, bf16), prompt {env['prompt_tokens']} "
             f"tokens, {env['tokens']} new tokens; `{env['command']}`", ""]
    van, hf = res.get("vanilla", {}), res.get("hf", {})
    if hf.get("tokens_per_s") or any(isinstance(v, dict) for v in van.values()):
        lines += ["| decoder | tokens/s (whole generation) | decode tokens/s | of bandwidth limit | vs HF |",
                  "|---|---|---|---|---|"]
        if hf.get("tokens_per_s"):
            lines.append(f"| HF transformers `generate` ({hf.get('attn')}) | {hf['tokens_per_s']} | | | 1.00 |")
        for mode, label in LABELS.items():
            v = van.get(mode)
            if isinstance(v, dict):
                lines.append(f"| {label} | {v['tokens_per_s']} | {v['decode_tokens_per_s']} | "
                             f"{v['of_bandwidth_limit']:.0%} | {v.get('vs_hf', '')} |")
        if van.get("bandwidth_limit_tokens_per_s"):
            lines += ["", f"Bandwidth limit: {van['bandwidth_limit_tokens_per_s']} tokens/s "
                          f"({env['weight_gb']} GB of weights per token at {env['bandwidth_tb_s']} TB/s measured copy bandwidth)."]
    ver = res.get("verify", {})
    modes = [m for m in ver if isinstance(ver[m], dict) and "ms" in ver[m]]
    if modes:
        sizes = list(ver[modes[0]]["ms"])
        lines += ["", "| rows | " + " | ".join(f"{m} ms (x one row)" for m in modes) + " |",
                  "|---|" + "---|" * len(modes)]
        for t in sizes:
            lines.append(f"| {t} | " + " | ".join(f"{ver[m]['ms'][t]} ({ver[m]['vs_one_row'][t]}x)" for m in modes) + " |")
    inv = res.get("invariance", {})
    for mode, v in inv.items():
        if isinstance(v, dict) and "rows" in v:
            bad = [str(b) for b, r in v["rows"].items() if not (r["first_equal"] and r["last_equal"])]
            lines.append(f"\nInvariance ({mode}): a token's logits {'bitwise equal at every row bucket' if not bad else 'differ at row buckets ' + ', '.join(bad)}"
                         f" (largest difference {max(r['max_abs_diff'] for r in v['rows'].values()):.3g}).")
    ident = res.get("identity", {})
    if any(isinstance(v, dict) and v and "error" not in v for v in ident.values()):
        lines += ["", "| configuration | method | identical to vanilla | first divergence | mean accepted | speedup |",
                  "|---|---|---|---|---|---|"]
        for name, entry in ident.items():
            if not isinstance(entry, dict) or "error" in entry:
                continue
            for method, e in entry.items():
                lines.append(f"| {name} | {method} | {e['identical']}/{e['prompts']} | {e['first_divergence']} | "
                             f"{e['mean_accepted']} | {e['speedup']} |")
    tests = res.get("tests", {})
    if "returncode" in tests:
        lines.append(f"\nCUDA tests (tests/test_static_step.py): exit {tests['returncode']}; {tests['tail'][-1] if tests['tail'] else ''}")
    errors = [f"{k}: {v['error']}" for k, v in res.items() if isinstance(v, dict) and "error" in v]
    if errors:
        lines += ["", "Failed sections:"] + [f"- {e}" for e in errors]
    return "\n".join(lines) + "\n"


def write(out: Path, res: dict) -> None:
    for name, text in (("gpu_check.json", json.dumps(res, indent=1, default=str)), ("gpu_check.md", markdown(res))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and gpu_check.md")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same family (a smoke run, any device)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per speed run (default 128)")
    ap.add_argument("--identity-tokens", type=int, default=96, help="new tokens per identity run (default 96)")
    ap.add_argument("--reps", type=int, default=12, help="timed forwards per verification size (default 12)")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: " + ",".join(n for n, _ in SECTIONS))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a.out.mkdir(parents=True, exist_ok=True)
    cfg = TINY if a.tiny else QWEN_1_5B
    import transformers

    res: dict = {"env": {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": "tiny (2 layers, width 64)" if a.tiny else "qwen2.5-coder-1.5b configuration",
        "tokens": a.tokens, "prompt_tokens": 96, "command": "python scripts/gpu_check.py " + " ".join(argv or sys.argv[1:])}}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "model"
        t0 = time.perf_counter()
        hf = build_model(cfg, directory, str(dev), a.seed)
        lm = leapdecode.load(str(directory), device=str(dev), dtype="bfloat16", backend="native", weights="bf16")
        lm.eos_token_ids = set()  # random weights: never stop early, every run is --tokens long
        res["env"]["build_load_s"] = round(time.perf_counter() - t0, 1)
        bw = copy_bandwidth(dev)
        wb = weight_bytes(lm.model)
        res["env"].update(weight_gb=round(wb / 1e9, 3), bandwidth_tb_s=round(bw / 1e12, 3))
        modes = ["eager", "graphs", "graphs-buckets"] if dev.type == "cuda" else ["eager", "padded", "padded-buckets"]
        ctx = {"hf": hf, "lm": lm, "device": dev, "tokens": a.tokens, "id_tokens": a.identity_tokens, "reps": a.reps,
               "ids": prompt_ids(cfg["vocab_size"], 96, 5), "modes": modes, "bandwidth": bw, "weight_bytes": wb,
               "results": res}
        skip = set(filter(None, a.skip.split(",")))
        for name, fn in SECTIONS:
            if name in skip:
                continue
            t0 = time.perf_counter()
            print(f"[gpu_check] {name} ...", flush=True)
            try:
                res[name] = fn(ctx)
            except Exception as e:  # recorded, and the next section runs
                res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
                print(res[name]["trace"], flush=True)
            res[name]["section_s"] = round(time.perf_counter() - t0, 1)
            if name == "hf":
                del ctx["hf"], hf  # its weights off the GPU before leapdecode is timed
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            write(a.out, res)
            print(f"[gpu_check] {name} done in {res[name]['section_s']} s", flush=True)
    res["env"]["total_s"] = round(time.perf_counter() - t_start, 1)
    write(a.out, res)
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
