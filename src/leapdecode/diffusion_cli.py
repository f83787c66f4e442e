"""``leapdecode diffusion``: generate with a diffusion LM, list the diffusion methods.

    leapdecode diffusion generate -m PATH|tiny-llada|tiny-dream --method ssd --option max_draft=8 \\
        --max-new-tokens 64 --block-size 32 [--chat] [--json] [--stats] PROMPT
    leapdecode diffusion methods [--markdown]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .core.config import parse_option_assignments
from .errors import InvalidParameterError
from .diffusion.api import generate, load, method_config
from .diffusion.loaded import WEIGHTS
from .diffusion.registry import DIFFUSION_METHODS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("diffusion", help="diffusion language models (LLaDA, Dream): generate, methods",
                              description="Masked-diffusion LMs decoded by filling masked positions in parallel "
                                          "(docs/diffusion.md).")
    sub = p.add_subparsers(dest="diffusion_action", metavar="ACTION")
    g = sub.add_parser("generate", help="fill an answer after a prompt",
                       description="Greedy. stepwise is the baseline; ssd and freedave give its tokens exactly "
                                   "in fewer forwards; fast-dllm and prophet are faster and may differ.")
    g.add_argument("-m", "--model", required=True,
                   help="LLaDA or Dream checkpoint directory (config.json + safetensors), or tiny-llada[:SEED] / "
                        "tiny-dream[:SEED] (random, for trying things)")
    g.add_argument("--method", default="stepwise", metavar="METHOD",
                   help=f"{', '.join(DIFFUSION_METHODS)} (default: %(default)s)")
    g.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="an option of the method (repeatable); `leapdecode diffusion methods` lists them")
    g.add_argument("--max-new-tokens", type=int, default=64, help="answer length (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=32, help="semi-autoregressive block (default: %(default)s)")
    g.add_argument("--dtype", choices=list(DTYPES), help="float weights' dtype (default fp32)")
    g.add_argument("--weights", choices=list(WEIGHTS),
                   help="weight format: fp32 (default), bf16, int8 or int4 (quantized at load time; docs/diffusion.md)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--json", action="store_true", help='print {"text", "tokens", "stats"} as one JSON object')
    g.add_argument("--stats", action="store_true", help="print statistics to stderr")
    g.add_argument("--json-schema", metavar="FILE",
                   help="structured output (stepwise only; docs/diffusion.md): the answer is JSON valid against "
                        "this schema (a file, - for stdin)")
    g.add_argument("--json-object", action="store_true", help="structured output: the answer is a JSON object")
    g.add_argument("--regex", help="structured output: the answer matches this regular expression (whole answer)")
    g.add_argument("--grammar", metavar="FILE",
                   help="structured output: the answer follows this grammar (Lark syntax as llguidance reads it, "
                        "or GBNF; a file, - for stdin)")
    g.add_argument("prompt", help="prompt text, or - to read stdin")
    g.set_defaults(func=cmd_generate)
    mt = sub.add_parser("methods", help="diffusion methods and their options")
    mt.add_argument("--markdown", action="store_true", help="print the option tables as Markdown")
    mt.set_defaults(func=cmd_methods)
    b = sub.add_parser("bench", help="forwards/token, tokens/s and quality of the decoders at several thresholds",
                       description="Every diffusion decoder (threshold methods at each --thresholds value) on "
                                   "HumanEval prompts: forwards per generated token, tokens/s, exact match with "
                                   "stepwise, NLL of the output under the AR parent, single-line infilling "
                                   "exact match; writes results.jsonl, summary.json, report.md and "
                                   "quality_vs_speed.png (docs/diffusion.md, Benchmark).")
    b.add_argument("-m", "--model", required=True, help="diffusion checkpoint directory or tiny-llada / tiny-dream")
    b.add_argument("--parent", help="AR model of the same vocabulary: scores the outputs (NLL) and is apd's "
                                    "helper (default: the parent in a train-dllm checkpoint's train_state.json)")
    b.add_argument("--methods", help="comma-separated diffusion methods (default: all; stepwise always runs)")
    b.add_argument("--thresholds", default="0.5,0.7,0.9",
                   help="thresholds swept for the threshold methods (default: %(default)s)")
    b.add_argument("--prompts", type=int, default=3, help="HumanEval prompts (default: %(default)s)")
    b.add_argument("--prompt-tokens", type=int, default=48, help="each prompt's last N tokens (default: %(default)s)")
    b.add_argument("--max-new-tokens", type=int, default=32, help="answer positions (default: %(default)s)")
    b.add_argument("--block-size", type=int, default=16, help="semi-autoregressive block (default: %(default)s)")
    b.add_argument("--infill", type=int, default=4, help="single-line infilling tasks, 0 for none "
                                                         "(default: %(default)s)")
    b.add_argument("--infill-methods", help="comma-separated row labels that run the infilling tasks "
                                            "(default: every row)")
    b.add_argument("--context-tokens", type=int, default=48, help="infilling context on each side (default: "
                                                                  "%(default)s)")
    b.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    b.add_argument("--weights", choices=list(WEIGHTS), default="fp32",
                   help="the diffusion model's weight format (default: %(default)s)")
    b.add_argument("--out", default="bench_out/diffusion", help="output directory (default: %(default)s)")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--quiet", action="store_true", help="no per-row lines on stderr")
    b.add_argument("--json", action="store_true", help="print the summary as JSON")
    b.set_defaults(func=cmd_bench)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    t = subparsers.add_parser("train-dllm", help="adapt a causal model into a diffusion LM (Dream-style)",
                              description="Masked-diffusion training of a native causal model's weights with "
                                          "shifted predictions and attention-mask annealing (docs/diffusion.md). "
                                          "Writes a Dream-layout checkpoint that `leapdecode diffusion generate "
                                          "-m OUT` decodes.")
    t.add_argument("-m", "--model", default="smollm2-135m", help="causal parent (default: %(default)s)")
    t.add_argument("--data", nargs="*", default=["stdlib"],
                   help="text files, or 'stdlib' for the Python standard library's sources (default)")
    t.add_argument("-o", "--out", required=True, help="checkpoint directory to write")
    t.add_argument("--minutes", type=float, default=30.0, help="time budget (default: %(default)s)")
    t.add_argument("--max-steps", type=int, help="stop after this many steps instead of the time budget (0: only "
                                                 "convert and evaluate, the untrained baseline)")
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--anneal", type=float, default=0.3, help="fraction of the run over which the attention "
                                                              "mask opens from causal to full")
    t.add_argument("--max-tokens", type=int, default=4_000_000, help="training text read, in tokens")
    t.add_argument("--checkpoint-minutes", type=float, default=5.0,
                   help="write a checkpoint (atomically) this often (default: %(default)s)")
    t.add_argument("--warmup", type=int, default=50, help="learning-rate warm-up steps (default: %(default)s)")
    t.add_argument("--eval-chunks", type=int, default=32,
                   help="held-out chunks evaluated at the end (default: %(default)s)")
    t.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    t.add_argument("--fresh", action="store_true",
                   help="start over even if --out holds a checkpoint of this run (default: resume it)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)
    return p


def cmd_train(a: argparse.Namespace) -> int:
    from pathlib import Path

    from .models.loader import load as load_causal
    from .diffusion.train import stdlib_files, token_chunks, train_dllm

    for name, value in (("--seq-len", a.seq_len), ("--batch-size", a.batch_size)):
        if value < 2:
            raise InvalidParameterError(f"{name} must be >= 2, got {value}")
    if a.minutes <= 0 or (a.max_steps is not None and a.max_steps < 0):
        raise InvalidParameterError("--minutes must be > 0 and --max-steps >= 0")
    if a.threads is not None and a.threads < 1 or a.eval_chunks < 1 or a.warmup < 0 or a.lr <= 0:
        raise InvalidParameterError("--threads and --eval-chunks must be >= 1, --warmup >= 0, --lr > 0")
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    files: list[Path] = []
    for item in a.data:
        if item == "stdlib":  # shuffled by --seed: --max-tokens then reads a sample of the whole library
            import random

            lib = stdlib_files()
            random.Random(a.seed).shuffle(lib)
            files.extend(lib)
        else:
            path = Path(item)
            if not path.is_file():
                raise InvalidParameterError(f"--data {item!r} is neither 'stdlib' nor a file")
            files.append(path)
    parent = load_causal(a.model, dtype="fp32", weights="fp32", device="cpu", backend="native")
    eos = next(iter(sorted(parent.eos_token_ids)), None)
    chunks = token_chunks(parent.tokenizer, files, a.seq_len, a.max_tokens, eos)
    state = train_dllm(parent, chunks, a.out, minutes=a.minutes, max_steps=a.max_steps, batch_size=a.batch_size,
                       lr=a.lr, warmup=a.warmup, anneal=a.anneal, seed=a.seed,
                       checkpoint_minutes=a.checkpoint_minutes, progress=not a.no_progress,
                       eval_chunks=a.eval_chunks, fresh=a.fresh)
    print(json.dumps({k: v for k, v in state.items() if k != "losses"}))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from pathlib import Path

    from .bench.diffusion import DiffusionBenchConfig, print_summary, run_diffusion_bench

    def csv(s: str | None) -> list[str] | None:
        return [x.strip() for x in s.split(",") if x.strip()] if s else None

    try:
        thresholds = tuple(float(x) for x in csv(a.thresholds) or [])
    except ValueError:
        raise InvalidParameterError(f"--thresholds: comma-separated numbers, got {a.thresholds!r}") from None
    if a.threads is not None:
        if a.threads < 1:
            raise InvalidParameterError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    cfg = DiffusionBenchConfig(model=a.model, out=Path(a.out), parent=a.parent, methods=csv(a.methods),
                               thresholds=thresholds, prompts=a.prompts, prompt_tokens=a.prompt_tokens,
                               max_new_tokens=a.max_new_tokens, block_size=a.block_size, infill=a.infill,
                               infill_methods=csv(a.infill_methods), context_tokens=a.context_tokens,
                               plots=not a.no_plots, weights=a.weights)
    summary = run_diffusion_bench(cfg, say=None if a.quiet else lambda s: print(s, file=sys.stderr, flush=True))
    print_summary(summary, a.json)
    return 0


def read_structure_file(flag: str, path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidParameterError(f"{flag} {path}: cannot read it ({e.__class__.__name__}: {e})") from None


def structure_args(a: argparse.Namespace) -> dict:
    """``json_schema`` / ``regex`` / ``grammar`` from ``--json-schema/--json-object/--regex/--grammar``
    (at most one), checked before the model loads."""
    from .diffusion.constrained import check_structure

    schema, obj = getattr(a, "json_schema", None), getattr(a, "json_object", False)
    regex, grammar = getattr(a, "regex", None), getattr(a, "grammar", None)
    given = [f for f, v in (("--json-schema", schema), ("--json-object", obj or None), ("--regex", regex),
                            ("--grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise InvalidParameterError(f"give at most one of {', '.join(given)}")
    if schema is not None:
        out = {"json_schema": read_structure_file("--json-schema", schema)}
    elif obj:
        out = {"json_schema": {"type": "object"}}
    elif regex is not None:
        out = {"regex": regex}
    elif grammar is not None:
        out = {"grammar": read_structure_file("--grammar", grammar)}
    else:
        return {}
    check_structure(**out)
    return out


def cmd_generate(a: argparse.Namespace) -> int:
    from .diffusion.constrained import check_supported

    method_config(a.method)  # a causal-LM or unknown method: a typed error naming the diffusion methods
    options = parse_option_assignments(DIFFUSION_METHODS[a.method].config, a.option)
    cfg = method_config(a.method, options)  # validated before the model loads
    structure = structure_args(a)
    if structure:
        check_supported(cfg)
    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    dtype = getattr(a, "dtype", None)
    model = load(a.model, dtype=None if dtype is None else DTYPES[dtype], weights=getattr(a, "weights", None))
    res = generate(model, prompt, method=cfg, max_new_tokens=a.max_new_tokens, block_size=a.block_size,
                   chat=a.chat, **structure)
    stats = {k: v for k, v in res.stats.items() if not isinstance(v, list)}
    if a.json:
        print(json.dumps({"text": res.text, "tokens": res.tokens, "stats": res.stats}, ensure_ascii=False))
    else:
        print(res.text)
    if a.stats:
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()),
              file=sys.stderr)
    return 0


def methods_markdown() -> str:
    out = []
    for name, spec in DIFFUSION_METHODS.items():
        out.append(f"### `{name}` options\n")
        out.append(f"{spec.summary}; {'exact (stepwise tokens)' if spec.exact else 'approximate'}.\n")
        out.append("| option | default | meaning |\n|---|---|---|")
        for opt, default, help_text in spec.config.options_table():
            out.append(f"| `{opt}` | `{default}` | {help_text} |")
        out.append("")
    return "\n".join(out)


def cmd_methods(a: argparse.Namespace) -> int:
    if a.markdown:
        print(methods_markdown())
        return 0
    for name, spec in DIFFUSION_METHODS.items():
        print(f"{name:10s} {'exact ' if spec.exact else 'approx'}  {spec.summary}")
        for opt, default, help_text in spec.config.options_table():
            print(f"    {opt}={default}: {help_text}")
    return 0
