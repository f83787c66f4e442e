#!/usr/bin/env python
"""Scale bench (issue 62 part 2): GGUFs of real model shapes with random blocks, loaded and timed by
leapdecode beside llama.cpp's server on the same file and threads.

Random weights make random text: nothing here compares outputs.  Each shape is written as a GGUF in
Q4_K_M's mixture (Q4_K, with Q6_K for the output head and for ``attn_v`` / ``ffn_down`` on the layers
llama.cpp's ``use_more_bits`` gives them) holding random codes and small random scales, with an
installed model's tokenizer and chat template (the embedding and head sized to its vocabulary).
Per shape, each in a fresh process:

* leapdecode, first load on an empty cache (the kernel library copied in): wall seconds and peak
  resident memory (``VmHWM``), and what the cache then holds on disk;
* leapdecode, warm load: seconds to ``load()``, resident memory after it (steady), a prompt of
  ``--prompt-tokens`` tokens prefilled and ``--new-tokens`` decoded greedily (tokens/s of each), the
  peak; and what 1/4/8/16 verified rows cost (``measure_verify_cost``: a forward of that many tree
  nodes at the prompt's context, in milliseconds and relative to one row);
* llama.cpp's server (built by ``leapdecode bench``'s builder, once per machine): seconds until it
  answers, the same prompt tokens with ``n_predict`` = ``--new-tokens`` (its own prompt and decode
  tokens/s), its peak resident memory.

    python scripts/scale_bench.py --out bench_out/scale                    # every shape
    python scripts/scale_bench.py --shapes qwen2.5-1.5b --out /tmp/scale    # one

Writes ``scale.json`` into ``--out`` (a report: one record per shape, a shape run again replaces its
record) and prints each figure as it comes; ``--save`` also copies the report to
``docs/results/scale/DATE-MACHINE.json``, from which ``leapdecode results`` draws the results page's
scale table and its projection of speculation at these sizes.  The GGUFs and caches are written into
``--work`` (default: ``--out``/work) and removed after each shape unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# the shapes of the issue: (architecture, hidden, layers, heads, kv heads, head dim, ffn, rope theta,
# attention biases); the vocabulary is the tokenizer's
SHAPES = {
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 64, 4864, 1e6, True),  # a draft model's cost, for the projection
    "qwen2.5-1.5b": ("qwen2", 1536, 28, 12, 2, 128, 8960, 1e6, True),
    "qwen2.5-3b": ("qwen2", 2048, 36, 16, 2, 128, 11008, 1e6, True),
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 128, 18944, 1e6, True),
    "llama-3.1-8b": ("llama", 4096, 32, 32, 8, 128, 14336, 5e5, False),
    "qwen3-8b-shape": ("qwen2", 4096, 36, 32, 8, 128, 12288, 1e6, True),  # Qwen3-8B's layer shapes
    "qwen3-1.7b": ("qwen3", 2048, 28, 16, 8, 128, 6144, 1e6, False),  # with its per-head q/k norms
    "qwen2.5-14b": ("qwen2", 5120, 48, 40, 8, 128, 13824, 1e6, True),
    # a mixture of experts: OLMoE-1B-7B's sizes (64 experts of width 1024, the top 8; 6.9B weights, 1.3B a token)
    # as a Qwen3-MoE (per-head q/k norms), the ffn column being an expert's width
    "olmoe-1b-7b-shape": ("qwen3moe", 2048, 16, 16, 16, 128, 1024, 1e4, False),
}
EXPERTS = {"olmoe-1b-7b-shape": (64, 8)}  # a mixture of experts' shapes: (experts, experts a token)
DEFAULT_SHAPES = "qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b,llama-3.1-8b,qwen3-8b-shape"
TOKENIZER_MODEL = "qwen2.5-coder-1.5b"  # whose GGUF lends its tokenizer and chat template
ROWS = (1, 4, 8, 16)


# --------------------------------------------------------------------------- writing a GGUF
def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for which layers' attn_v and ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` rows of random ``qtype`` blocks whose weights are of the order of 0.02: random code
    bytes, with the fp16 super-block scale (and min) fields small and positive."""
    import gguf

    per, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    T = gguf.GGMLQuantizationType
    if qtype == T.Q4_K:  # d, dmin fp16 at 0 and 2: w = d sc q - dmin m, sc and m 6-bit, q 4-bit
        fields, scale = (0, 2), 2e-4
    elif qtype == T.Q6_K:  # d fp16 at 208: w = d sc (q - 32), sc int8, q 6-bit
        fields, scale = (208,), 1e-5
    elif qtype == T.Q8_0:  # d fp16 at 0: w = d q, q int8
        fields, scale = (0,), 3e-4
    elif qtype == T.Q2_K:  # d, dmin fp16 at 80 and 82: w = d sc q - dmin m, sc and m 4-bit, q 2-bit
        fields, scale = (80, 82), 5e-4
    elif qtype == T.Q3_K:  # d fp16 at 108: w = d sc (q - 4), sc 6-bit signed, q 3-bit
        fields, scale = (108,), 4e-4
    elif qtype == T.IQ4_NL:  # d fp16 at 0: w = d kv[q], kv within +-127
        fields, scale = (0,), 2e-4
    elif qtype == T.IQ4_XS:  # d fp16 at 0: w = d sc kv[q], sc 6-bit signed
        fields, scale = (0,), 1e-5
    else:
        raise ValueError(f"no random blocks for {qtype!r}")
    for at in fields:
        d = (scale * rng.uniform(0.5, 1.5, size=raw.shape[:2])).astype(np.float16)
        raw[:, :, at:at + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    return raw.reshape(rows, -1)


MIXES = ("Q4_K_M", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "Q4_K")  # --type: Q4_K_M's mixture, or one type throughout


def tensor_plan(shape: tuple, vocab: int, mix: str = "Q4_K_M") -> list[tuple[str, tuple[int, ...], object]]:
    """(name, torch-order shape, ggml type or None for F32) of every tensor, in llama.cpp's order; a
    K-quant tensor whose rows are not whole 256-weight super-blocks is Q8_0 (llama.cpp falls back too:
    Qwen2.5-0.5B's hidden size is 896).  ``mix``: Q4_K_M's mixture, or that type for every matrix but the
    output head (Q6_K)."""
    import gguf

    T = gguf.GGMLQuantizationType
    arch, hidden, layers, heads, kv_heads, head_dim, ffn, _theta, bias = shape
    q, kv = heads * head_dim, kv_heads * head_dim
    main = T.Q4_K if mix == "Q4_K_M" else T[mix]
    plan = [("token_embd.weight", (vocab, hidden), main)]
    for i in range(layers):
        more = (T.Q6_K if use_more_bits(i, layers) else T.Q4_K) if mix == "Q4_K_M" else main
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (hidden,), None), (b + "attn_q.weight", (q, hidden), main),
                 (b + "attn_k.weight", (kv, hidden), main), (b + "attn_v.weight", (kv, hidden), more),
                 (b + "attn_output.weight", (hidden, q), main), (b + "ffn_norm.weight", (hidden,), None)]
        if arch == "qwen3moe":  # the router in F32 (llama.cpp keeps it so), the experts stacked [experts, rows, cols]
            experts = next(e for name, (e, _) in EXPERTS.items() if SHAPES[name] == shape)
            plan += [(b + "ffn_gate_inp.weight", (experts, hidden), None),
                     (b + "ffn_gate_exps.weight", (experts, ffn, hidden), main),
                     (b + "ffn_up_exps.weight", (experts, ffn, hidden), main),
                     (b + "ffn_down_exps.weight", (experts, hidden, ffn), more)]
        else:
            plan += [(b + "ffn_gate.weight", (ffn, hidden), main), (b + "ffn_up.weight", (ffn, hidden), main),
                     (b + "ffn_down.weight", (hidden, ffn), more)]
        if bias:
            plan += [(b + f"attn_{p}.bias", (n,), None) for p, n in (("q", q), ("k", kv), ("v", kv))]
        if arch in ("qwen3", "qwen3moe"):
            plan += [(b + "attn_q_norm.weight", (head_dim,), None), (b + "attn_k_norm.weight", (head_dim,), None)]
    plan += [("output_norm.weight", (hidden,), None), ("output.weight", (vocab, hidden), T.Q6_K)]
    return [(n, s, T.Q8_0 if q is not None and s[-1] % 256 else q) for n, s, q in plan]


def write_gguf(path: Path, name: str, tokenizer_gguf: Path, seed: int = 0, mix: str = "Q4_K_M") -> None:
    """A GGUF of shape ``name`` with random blocks and ``tokenizer_gguf``'s tokenizer, written tensor by
    tensor (nothing of it held at once)."""
    import gguf

    shape = SHAPES[name]
    arch, hidden, layers, heads, kv_heads, head_dim, ffn, theta, _bias = shape
    source = gguf.GGUFReader(str(tokenizer_gguf))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"random {name} (leapdecode scale bench)")
    writer.add_block_count(layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    if name in EXPERTS:
        writer.add_expert_count(EXPERTS[name][0])
        writer.add_expert_used_count(EXPERTS[name][1])
        writer.add_expert_feed_forward_length(ffn)
    writer.add_file_type(gguf.LlamaFileType["MOSTLY_" + {"Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S"}.get(mix, mix)])
    for key, field in source.fields.items():  # the tokenizer and chat template, as the source has them
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    del source
    plan = tensor_plan(shape, vocab, mix)
    for tname, tshape, qtype in plan:
        if qtype is None:
            writer.add_tensor_info(tname, tshape, np.dtype(np.float32), 4 * int(np.prod(tshape)))
        else:
            per, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = tshape[-1] // per * nbytes  # a quantized tensor's shape is given in bytes
            rows = int(np.prod(tshape[:-1]))
            writer.add_tensor_info(tname, (*tshape[:-1], row_bytes), np.dtype(np.uint8), rows * row_bytes,
                                   raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, tshape, qtype in plan:
        if qtype is None:
            data = (np.ones(tshape, np.float32) if tname.endswith("norm.weight")
                    else (0.02 * rng.standard_normal(tshape)).astype(np.float32))
        else:
            rows = int(np.prod(tshape[:-1]))
            data = np.concatenate([random_blocks(qtype, min(4096, rows - r), tshape[-1], rng)
                                   for r in range(0, rows, 4096)])
            data = data.reshape(*tshape[:-1], -1)
        writer.write_tensor_data(data)
    writer.close()


# --------------------------------------------------------------------------- measuring leapdecode
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from leapdecode.models.loader import load
path, mode, prompt_tokens, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def rss():
    return {k: int(v.split()[0]) << 10 for k, v in (l.split(":", 1) for l in open("/proc/self/status"))
            if k in ("VmRSS", "VmHWM")}
t1 = time.perf_counter()
lm = load(path)
out = {"load_s": time.perf_counter() - t1, "process_s": time.perf_counter() - t0, "weights": lm.weights,
       "after_load": rss()["VmRSS"]}
if mode == "warm":
    import torch, leapdecode
    from leapdecode.core.cost_model import measure_verify_cost
    ids = torch.randint(100, 100000, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    leapdecode.generate(lm, prompt_ids=ids[:32], max_new_tokens=4, method="vanilla")  # warm the kernels
    r = leapdecode.generate(lm, prompt_ids=ids, max_new_tokens=new_tokens, method="vanilla")
    s = r.stats
    out.update(prefill_tps=prompt_tokens / s["prefill_s"], new_tokens=s["new_tokens"],
               decode_tps=(s["new_tokens"] - 1) / max(s["wall_s"] - s["prefill_s"], 1e-9), prompt_ids=ids)
    model = lm.model
    cache = model.new_cache(max_len=prompt_tokens + 64)
    for start in range(0, prompt_tokens, 64):
        model.forward(torch.tensor([ids[start:start + 64]]), cache)
        cache.commit()
    cost = measure_verify_cost(lm, cache, sizes=tuple(int(n) for n in sys.argv[5].split(",")))
    out["rows_ms"] = {str(n): 1000 * cost.profile(n) for n in cost.sizes}
    out["after_run"] = rss()["VmRSS"]
out["peak"] = rss()["VmHWM"]  # this process's own peak (ru_maxrss would count the parent it was forked from)
print("RESULT " + json.dumps(out))
"""


def run_child(gguf: Path, mode: str, cache: Path, args) -> dict:
    env = {**os.environ, "LEAPDECODE_CACHE": str(cache)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(gguf), mode, str(args.prompt_tokens),
                           str(args.new_tokens), ",".join(map(str, ROWS))], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"leapdecode {mode} load of {gguf.name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {**json.loads(lines[-1][7:]), "wall_s": wall}


def cache_with_kernel(cache: Path) -> Path:
    """An empty cache holding this machine's verified kernel library (no compiler run)."""
    from leapdecode.models import kernel_library, store

    real = Path(kernel_library.kernel_status()["library"])
    (cache / "kernels").mkdir(parents=True)
    for f in (real, store.digest_path(real)):
        shutil.copy2(f, cache / "kernels" / f.name)
    return cache


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- llama.cpp's server
def llama_server(gguf: Path, prompt_ids: list[int], new_tokens: int, threads: int) -> dict:
    from leapdecode.bench.peers.llama_server import LlamaServer, free_port, server_binary, server_command

    binary = server_binary()
    if binary is None:
        return {"skipped": "llama.cpp's server is not built here (leapdecode bench --peers llama-server builds it)"}
    port = free_port()
    t0 = time.perf_counter()
    server = LlamaServer(server_command(binary, "llama-server", gguf, len(prompt_ids) + new_tokens + 64, threads, port),
                         port, start_timeout_s=900)
    try:
        ready_s = time.perf_counter() - t0
        server.complete(prompt_ids[:32], 4, 0.0, 0)  # warm
        timings = server.complete(prompt_ids, new_tokens, 0.0, 0)["timings"]
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
        peak = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) << 10
        steady = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) << 10
    finally:
        server.close()
    return {"ready_s": ready_s, "prefill_tps": timings["prompt_per_second"], "decode_tps": timings["predicted_per_second"],
            "peak": peak, "steady": steady}


# --------------------------------------------------------------------------- the run
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--out", type=Path, required=True, help="folder for scale.json")
    ap.add_argument("--work", type=Path, help="folder for the GGUFs and caches (default: OUT/work)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--type", default="Q4_K_M", choices=MIXES,
                    help="the GGUFs' types: Q4_K_M's mixture (default), or one type for every matrix but the head "
                         "(Q6_K); a shape's record is then keyed SHAPE@TYPE")
    ap.add_argument("--no-peer", action="store_true", help="leapdecode only")
    ap.add_argument("--keep", action="store_true", help="keep each shape's GGUF and caches")
    ap.add_argument("--save", action="store_true", help="copy the report to docs/results/scale/ for the results page")
    args = ap.parse_args()
    import torch

    from leapdecode.core.cost_model import machine_description
    from leapdecode.models import registry
    from leapdecode.models.kernel_library import isa_flags
    from leapdecode.models.store import atomic_write

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = registry.assembled_gguf(TOKENIZER_MODEL)
    machine = machine_description(torch.device("cpu"))
    results_path = args.out / "scale.json"
    report = json.loads(results_path.read_text()) if results_path.is_file() else {}
    if report.get("report") != "scale" or report.get("machine") != machine:
        report = {"report": "scale", "shapes": {}}
    report.update(machine=machine, cpu_flags=isa_flags(), threads=torch.get_num_threads(),
                  prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                  command="python scripts/scale_bench.py " + " ".join(sys.argv[1:]))
    results = report["shapes"]
    for name in shapes:
        key = name if args.type == "Q4_K_M" else f"{name}@{args.type}"
        gguf = work / f"random-{key}.gguf"
        print(f"== {name}: writing {gguf.name} ...", flush=True)
        t0 = time.perf_counter()
        write_gguf(gguf, name, tokenizer, mix=args.type)
        size = gguf.stat().st_size
        print(f"   {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
        cache = cache_with_kernel(Path(tempfile.mkdtemp(prefix=f"cache-{name}-", dir=work)))
        first = run_child(gguf, "first", cache, args)
        disk = du(cache) - du(cache / "kernels")
        print(f"   first load {first['wall_s']:.0f} s, peak {first['peak'] / 1e9:.2f} GB, cache {disk / 1e9:.2f} GB", flush=True)
        warm = run_child(gguf, "warm", cache, args)
        prompt_ids = warm.pop("prompt_ids")
        print(f"   warm load {warm['load_s']:.1f} s, steady {warm['after_load'] / 1e9:.2f} GB; prefill "
              f"{warm['prefill_tps']:.1f} t/s, decode {warm['decode_tps']:.2f} t/s; rows ms {warm['rows_ms']}", flush=True)
        peer = {"skipped": "--no-peer"} if args.no_peer else llama_server(gguf, prompt_ids, args.new_tokens,
                                                                            torch.get_num_threads())
        if "skipped" not in peer:
            print(f"   llama-server ready {peer['ready_s']:.1f} s, peak {peer['peak'] / 1e9:.2f} GB; prefill "
                  f"{peer['prefill_tps']:.1f} t/s, decode {peer['decode_tps']:.2f} t/s", flush=True)
        results[key] = {"type": args.type, "shape": dict(zip(("architecture", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn",
                                            "rope_theta", "attention_bias"), SHAPES[name])),
                         "gguf_bytes": size, "first": first, "cache_bytes": disk, "warm": warm, "llama_server": peer,
                         "date": time.strftime("%Y-%m-%d")}
        report["date"] = time.strftime("%Y-%m-%d")
        atomic_write(results_path, json.dumps(report, indent=1) + "\n")
        if not args.keep:
            gguf.unlink()
            shutil.rmtree(cache, ignore_errors=True)
    print(f"wrote {results_path}")
    if args.save:
        from leapdecode.results.page import RESULTS_DIR, slug

        saved = RESULTS_DIR / "scale" / f"{report['date']}-{slug(machine.split(',')[0])}.json"
        saved.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(saved, json.dumps(report, indent=1) + "\n")
        print(f"saved {saved} (run `leapdecode results` to redraw the page)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
