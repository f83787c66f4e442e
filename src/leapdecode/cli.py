"""``leapdecode`` command line: generate, chat, models, bench, serve, datastore.

Errors caused by input (unknown model, bad file, bad parameter, prompt too
long) print one line ``leapdecode: error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from .errors import LeapdecodeError

# subcommands that live in their own packages: module exposing add_parser(subparsers)
PLUGIN_COMMANDS = ["leapdecode.bench.cli", "leapdecode.server.cli", "leapdecode.proposers.datastore_cli"]


def add_model_args(p: argparse.ArgumentParser, default_model: str | None = None) -> None:
    from .models.registry import DEFAULT_MODEL

    p.add_argument("-m", "--model", default=default_model or DEFAULT_MODEL,
                   help="registered name (see `leapdecode models list`), HF model directory, .gguf file "
                        "or hub id (default: %(default)s)")
    p.add_argument("--backend", choices=["auto", "native", "hf"], default="auto",
                   help="native: leapdecode's Llama/Qwen2 decoder; hf: transformers fallback "
                        "(auto: native where supported)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 with AMX/AVX512-BF16 or CUDA, else fp32), fp32, bf16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    from .proposers import METHODS

    p.add_argument("--method", default="auto" if "auto" in METHODS else "vanilla",
                   help=f"decoding method: {', '.join(METHODS)} (default: %(default)s); all are lossless")
    p.add_argument("--draft", help="draft model for draft-based methods (default: the model's registered pair)")
    p.add_argument("--tree-budget", type=int, help="max drafted tokens verified per step")
    p.add_argument("--datastore", help="REST datastore for --method rest (see `leapdecode datastore build`)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--typical-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def decoding_kwargs(a: argparse.Namespace) -> dict:
    options = {}
    if getattr(a, "datastore", None):
        if a.method != "rest":
            raise LeapdecodeError("--datastore applies to --method rest")
        options["datastore"] = a.datastore
    return dict(**options, method=a.method, draft=a.draft, tree_budget=a.tree_budget, max_new_tokens=a.max_new_tokens,
                temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                typical_p=a.typical_p, repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop)


def load_from_args(a: argparse.Namespace):
    from .core.sampling import SamplingParams
    from .models.loader import load

    # bad parameters fail before a model is loaded
    if getattr(a, "temperature", None) is not None:
        SamplingParams(a.temperature, a.top_k, a.top_p, a.min_p, a.typical_p, a.repetition_penalty, a.seed)
        if a.max_new_tokens < 1:
            raise LeapdecodeError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")

    return load(a.model, dtype=a.dtype, device=a.device, backend=a.backend)


# ---------------------------------------------------------------- commands
def cmd_generate(a: argparse.Namespace) -> int:
    from .core.generate import Generation

    prompt = a.prompt if a.prompt != "-" else sys.stdin.read()
    kwargs = decoding_kwargs(a)
    model = load_from_args(a)
    gen = Generation(model, prompt, chat=a.chat, **kwargs)
    if a.json:
        res = gen.run()
        print(json.dumps({"text": res.text, "tokens": res.tokens, "finish_reason": res.finish_reason,
                          "stats": res.stats}, ensure_ascii=False))
    else:
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if a.stats:
            print(json.dumps(gen.result.stats), file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from .core.generate import Generation

    kwargs = decoding_kwargs(a)
    model = load_from_args(a)
    messages: list[dict] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print(f"chatting with {model.name} ({a.method}); empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        gen = Generation(model, messages, **kwargs)
        sys.stdout.write("bot> ")
        try:
            for piece in gen:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            gen.cancel()
        sys.stdout.write("\n")
        if gen.result is not None:
            messages.append({"role": "assistant", "content": gen.result.text})
            if a.stats:
                s = gen.result.stats
                print(f"[{s['new_tokens']} tokens, {s['tokens_per_s']} tok/s, "
                      f"{s['mean_accepted']} accepted/forward]", file=sys.stderr)


def cmd_models(a: argparse.Namespace) -> int:
    from .models import registry

    if a.action == "list":
        rows = registry.list_models()
        if a.json:
            print(json.dumps(rows, indent=2))
            return 0
        from rich.console import Console
        from rich.table import Table

        t = Table(title="embedded models")
        for col in ("name", "description", "draft", "installed", "converted"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["name"], r.get("description", ""), r.get("draft") or "",
                      "yes" if r.get("installed") else "no", "yes" if r.get("converted") else "no")
        Console().print(t)
        return 0
    if not a.name:
        raise LeapdecodeError(f"`models {a.action}` needs a model NAME")
    if a.action == "fetch":
        path = registry.fetch(a.name)
        print(path)
        return 0
    ok, message = registry.verify(a.name)
    print(message)
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leapdecode",
        description="Fast LLM generation that does not change what the model says: speculative, "
                    "tree and parallel decoding, verified losslessly against the target model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a continuation of a prompt",
                       description="Generate text. Greedy by default; every --method gives the same "
                                   "tokens as --method vanilla (greedy) or the same distribution (sampling).")
    add_model_args(g)
    add_decoding_args(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--json", action="store_true", help='print {"text", "tokens", "stats"} as one JSON object')
    g.add_argument("--stats", action="store_true", help="print generation statistics to stderr")
    g.add_argument("prompt", help="prompt text, or - to read stdin")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams the reply")
    add_model_args(c)
    add_decoding_args(c)
    c.add_argument("--system", help="system message")
    c.add_argument("--stats", action="store_true", help="print speed after each reply")
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="embedded models: list | fetch NAME | verify NAME")
    m.add_argument("action", choices=["list", "fetch", "verify"])
    m.add_argument("name", nargs="?")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    for modname in PLUGIN_COMMANDS:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:  # that part is not there (yet): no such subcommand
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except LeapdecodeError as e:
        print(f"leapdecode: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("leapdecode: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
