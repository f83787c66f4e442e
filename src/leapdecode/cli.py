"""``leapdecode`` command line: generate, chat, methods, strategies, models, bench, serve, datastore.

Errors caused by input (unknown model, bad file, bad parameter, prompt too
long) print one line ``leapdecode: error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from .errors import InvalidParameterError, LeapdecodeError

# subcommands that live in their own packages: module exposing add_parser(subparsers)
PLUGIN_COMMANDS = ["leapdecode.bench.cli", "leapdecode.server.cli", "leapdecode.datastore_cli",
                   "leapdecode.diffusion.cli", "leapdecode.heads_cli", "leapdecode.doctor",
                   "leapdecode.bench.results_page"]


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
    p.add_argument("--weights", default="auto", choices=["auto", "bf16", "fp32", "int8", "int4"],
                   help="weight format of the native backend. auto (default): int4 for a GGUF model on "
                        "a CPU with AVX512-VNNI or AVX2 (the file's own quantized blocks on leapdecode's "
                        "batch-invariant kernel), "
                        "else as --dtype; int4: that kernel (4-bit groups of 32 for a float checkpoint; "
                        "torch's int4 kernel on CUDA); int8: torch's per-channel int8 kernel; bf16/fp32: "
                        "float weights (fast prefill, but greedy speculation is not guaranteed to "
                        "reproduce vanilla bit for bit). A diffusion model (LLaDA/Dream): fp32 by default, "
                        "int8/int4 quantized at load the same way")
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "invariant"],
                   help="native backend: invariant = per-row attention, so a token's logits are the same "
                        "bits in a tree forward as alone (exact speculation together with int8/int4 "
                        "weights); auto (default): invariant with int8/int4 weights, else sdpa")
    p.add_argument("--require-exact", action="store_true",
                   help="refuse (exit 2, naming why) a configuration in which speculative methods are not "
                        "guaranteed to give vanilla's tokens bit for bit: float weights because the int4 kernel "
                        "cannot build here (no C++ compiler), --attention sdpa, the hf backend, a GPU")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    from .proposers import DEFAULT_METHOD, METHODS

    from .strategies.registry import STRATEGIES

    from .diffusion.registry import DIFFUSION_METHODS

    p.add_argument("--method", default=None, choices=list(METHODS) + list(DIFFUSION_METHODS), metavar="METHOD",
                   help=f"decoding method: {', '.join(METHODS)} (default: {DEFAULT_METHOD}; vanilla with "
                        "--strategy); all are lossless. For a diffusion model (LLaDA/Dream checkpoint, "
                        f"tiny-llada, tiny-dream): {', '.join(DIFFUSION_METHODS)} (default: stepwise)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="an option of the method (repeatable); `leapdecode methods` lists each method's options")
    p.add_argument("--draft", help="draft model for --method draft/auto (same as --option draft=NAME)")
    p.add_argument("--tree-budget", type=int, help="max drafted tokens verified per step (--option tree_budget=N)")
    p.add_argument("--datastore", help="REST datastore for --method rest (--option datastore=PATH; see "
                                       "`leapdecode datastore build`)")
    b = p.add_argument_group("decoding strategies (search instead of one greedy/sampled sequence; "
                             "`leapdecode strategies` lists them and their options)")
    b.add_argument("--strategy", choices=list(STRATEGIES), metavar="NAME",
                   help=f"{' | '.join(STRATEGIES)} (default: none: greedy, or sampling with --temperature); "
                        "runs with --method vanilla only; stochastic-beam and cps-beam need --temperature > 0")
    b.add_argument("--num-beams", type=int, metavar="N", help="beam width (--strategy-option num_beams=N)")
    b.add_argument("--n", type=int, metavar="N", dest="num_return_sequences",
                   help="hypotheses returned, best first (--strategy-option num_return_sequences=N)")
    b.add_argument("--length-penalty", type=float, metavar="X",
                   help="beam: score = sum log p / length ** X (--strategy-option length_penalty=X)")
    b.add_argument("--patience", type=float, metavar="X",
                   help="beam: patience factor (--strategy-option patience=X)")
    b.add_argument("--strategy-option", action="append", metavar="KEY=VALUE",
                   help="an option of the strategy (repeatable), e.g. early_stopping=never, diversity_penalty=1.0")
    p.add_argument("--max-new-tokens", type=int, default=256, help="at most this many new tokens (capped at "
                                                                   "the model's context; default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus probability mass")
    p.add_argument("--min-p", type=float, default=0.0, help="sampling: drop tokens below min_p x the top probability")
    p.add_argument("--typical-p", type=float, default=1.0, help="sampling: locally typical mass")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="random seed (sampling)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--kv-policy", metavar="SPEC",
                   help="KV-cache compression for long generations. LOSSY: the output can change (every "
                        "other option here is exact); off by default. streaming:sink=4,window=256 | "
                        "h2o:budget=256,recent=32 | snapkv:budget=256 | scope:prefill=256,decode=128 | "
                        "expected:budget=256 | int8 (docs/methods.md; native backend only)")
    s = p.add_argument_group("structured output (exact under every method; needs the 'structured' extra)")
    s.add_argument("--json-schema", metavar="FILE",
                   help="the output is JSON that validates against this JSON schema (a file, or - for stdin)")
    s.add_argument("--json-object", action="store_true",
                   help='the output is a JSON object (any keys); same as a schema {"type": "object"}')
    s.add_argument("--regex", help="the output matches this regular expression (whole output)")
    s.add_argument("--grammar", metavar="FILE",
                   help="the output follows this grammar: Lark syntax as llguidance reads it, or GBNF "
                        "(llama.cpp's format, recognised by '::=')")


def resolve_method_name(a: argparse.Namespace) -> str:
    """``--method``, or its default: vanilla with a ``--strategy``, else the default method."""
    from .proposers import DEFAULT_METHOD

    if a.method is None:
        a.method = "vanilla" if getattr(a, "strategy", None) else DEFAULT_METHOD
    return a.method


STRATEGY_FLAGS = (("num_beams", "--num-beams"), ("num_return_sequences", "--n"),
                  ("length_penalty", "--length-penalty"), ("patience", "--patience"))


def strategy_options(a: argparse.Namespace) -> dict:
    """The strategy's options from ``--strategy-option KEY=VALUE`` and the shorthand flags, typed by
    its config (an error names a flag given without ``--strategy``)."""
    from .core.config import parse_option_assignments
    from .strategies.registry import strategy_spec

    given = [(key, flag) for key, flag in STRATEGY_FLAGS if getattr(a, key, None) is not None]
    name = getattr(a, "strategy", None)
    if name is None:
        if given or getattr(a, "strategy_option", None):
            flags = [flag for _, flag in given] + (["--strategy-option"] if getattr(a, "strategy_option", None) else [])
            raise LeapdecodeError(f"{', '.join(flags)} need{'s' if len(flags) == 1 else ''} a --strategy "
                                  "(e.g. --strategy beam)")
        return {}
    cls = strategy_spec(name).config
    options = parse_option_assignments(cls, a.strategy_option, flag="--strategy-option")
    for key, flag in given:
        value = getattr(a, key)
        if key not in cls.option_names():
            raise LeapdecodeError(f"{flag}: strategy {name!r} has no option {key!r}; its options: "
                                  f"{', '.join(cls.option_names())}")
        if key in options and options[key] != value:
            raise LeapdecodeError(f"{flag} and --strategy-option {key}= disagree")
        options[key] = value
    return options


def method_options(a: argparse.Namespace) -> dict:
    """The method's options from ``--option KEY=VALUE`` and the shortcut flags, typed by its config."""
    from .api import check_not_diffusion_method
    from .core.config import parse_option_assignments
    from .proposers import method_spec

    resolve_method_name(a)
    check_not_diffusion_method(a.method)

    options = parse_option_assignments(method_spec(a.method).config, a.option)
    for flag, key in (("draft", "draft"), ("tree_budget", "tree_budget"), ("datastore", "datastore")):
        value = getattr(a, flag, None)
        if value is not None:
            if key in options and options[key] != value:
                raise LeapdecodeError(f"--{flag.replace('_', '-')} and --option {key}= disagree")
            options[key] = value
    return options


def decoding_kwargs(a: argparse.Namespace) -> dict:
    """Keyword arguments for ``leapdecode.api.start_generation``, validated before any model loads."""
    from .core.sampling import SamplingParams
    from .core.generate import check_max_new_tokens
    from .proposers import method_config

    options = method_options(a)
    method_config(a.method, options)  # unknown or invalid options fail here, before loading
    strategy = getattr(a, "strategy", None)
    extra: dict = {}
    if strategy is not None:
        from .api import check_strategy_combination
        from .strategies.registry import strategy_config

        scfg = strategy_config(strategy, strategy_options(a))
        check_strategy_combination(scfg, method_config(a.method, options),
                                   SamplingParams(a.temperature, a.top_k, a.top_p, a.min_p, a.typical_p,
                                                  a.repetition_penalty, a.seed), a.stop, a.kv_policy,
                                   structured=any(getattr(a, f, None) for f in ("json_schema", "json_object",
                                                                                  "regex", "grammar")))
        extra = {"strategy": scfg}
    else:
        strategy_options(a)  # a strategy flag without --strategy is an error
    SamplingParams(a.temperature, a.top_k, a.top_p, a.min_p, a.typical_p, a.repetition_penalty, a.seed)
    from .core.kv_policy import parse_kv_policy

    kv_policy = parse_kv_policy(getattr(a, "kv_policy", None))  # a bad spec fails here, before loading
    check_max_new_tokens(a.max_new_tokens)
    return dict(method=a.method, options=options, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, typical_p=a.typical_p,
                repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop,
                kv_policy=kv_policy, **structure_kwargs(a), **extra)


def read_text_arg(flag: str, path: str) -> str:
    """The text of a file named on the command line (``-``: standard input), or a clear error."""
    if path == "-":
        return read_stdin_text()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LeapdecodeError(f"{flag} {path}: cannot read it ({e.__class__.__name__}: {e})") from None


def structure_kwargs(a: argparse.Namespace) -> dict:
    """``json_schema`` / ``regex`` / ``grammar`` from the structured-output flags (at most one)."""
    given = [f for f, v in (("--json-schema", a.json_schema), ("--json-object", a.json_object or None),
                            ("--regex", a.regex), ("--grammar", a.grammar)) if v is not None]
    if len(given) > 1:
        raise LeapdecodeError(f"give at most one of {', '.join(given)}")
    if a.json_schema is not None:
        from .strategies.grammar import check_json_schema

        return {"json_schema": check_json_schema(read_text_arg("--json-schema", a.json_schema))}
    if a.json_object:
        return {"json_schema": {"type": "object"}}
    if a.regex is not None:
        return {"regex": a.regex}
    if a.grammar is not None:
        return {"grammar": read_text_arg("--grammar", a.grammar)}
    return {}


def load_from_args(a: argparse.Namespace):
    from .models.loader import load

    return load(a.model, dtype=a.dtype, device=a.device, backend=a.backend, weights=a.weights,
                attention=a.attention, require_exact=a.require_exact)


def read_stdin_text() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LeapdecodeError(f"standard input is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


# ---------------------------------------------------------------- commands
def is_diffusion_model(name: str) -> bool:
    """A tiny random diffusion model's name or a LLaDA/Dream checkpoint directory."""
    from .diffusion.loaded import is_diffusion_checkpoint

    return name.startswith(("tiny-llada", "tiny-dream")) or is_diffusion_checkpoint(name)


# flags of `generate` that a diffusion model's decoders do not take, with their defaults
DIFFUSION_UNSUPPORTED = (("temperature", "--temperature", 0.0), ("top_k", "--top-k", 0), ("top_p", "--top-p", 1.0),
                         ("min_p", "--min-p", 0.0), ("typical_p", "--typical-p", 1.0),
                         ("repetition_penalty", "--repetition-penalty", 1.0), ("seed", "--seed", None),
                         ("stop", "--stop", None), ("kv_policy", "--kv-policy", None), ("strategy", "--strategy", None),
                         ("strategy_option", "--strategy-option", None), ("num_beams", "--num-beams", None),
                         ("num_return_sequences", "--n", None), ("length_penalty", "--length-penalty", None),
                         ("patience", "--patience", None), ("draft", "--draft", None),
                         ("tree_budget", "--tree-budget", None), ("datastore", "--datastore", None),
                         ("grammar_aligned", "--grammar-aligned", None), ("backend", "--backend", "auto"),
                         ("attention", "--attention", "auto"))


def generate_diffusion(a: argparse.Namespace) -> int:
    """``generate -m <diffusion model>``: the diffusion decoders (``leapdecode diffusion generate``)."""
    from .diffusion.cli import cmd_generate as diffusion_generate

    given = [flag for key, flag, default in DIFFUSION_UNSUPPORTED if getattr(a, key, default) != default]
    if given:
        raise InvalidParameterError(f"{', '.join(given)}: not for a diffusion model ({a.model!r}); its decoders are "
                                    "greedy and take --method, --option, --max-new-tokens, --block-size, --dtype, "
                                    "--weights, --chat, --json, --stats, --json-schema, --json-object, --regex, "
                                    "--grammar")
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
    from .api import start_generation

    if is_diffusion_model(a.model):
        return generate_diffusion(a)
    if a.block_size is not None:
        raise LeapdecodeError("--block-size is for diffusion models (LLaDA/Dream checkpoints, tiny-llada, tiny-dream)")
    kwargs = decoding_kwargs(a)
    prompt = a.prompt if a.prompt != "-" else read_stdin_text()
    if a.grammar_aligned is not None:
        if "strategy" in kwargs:
            raise LeapdecodeError("--grammar-aligned does not combine with --strategy")
        return grammar_aligned(a, kwargs, prompt)
    model = load_from_args(a)
    gen = start_generation(model, prompt, chat=a.chat, **kwargs)
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


def grammar_aligned(a: argparse.Namespace, kwargs: dict, prompt: str) -> int:
    """``generate --grammar-aligned N``: N ASAp samples, one line each (a JSON object with --json)."""
    structure = {k: kwargs[k] for k in ("json_schema", "regex", "grammar") if k in kwargs}
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
    from .strategies.asap import ASApSampler

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
    from .api import runner_for, start_generation
    from .core.generate import check_text

    kwargs = decoding_kwargs(a)
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
        gen = start_generation(runner, messages, **kwargs)
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


def cmd_models(a: argparse.Namespace) -> int:
    from .errors import InvalidParameterError
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

    m = sub.add_parser("models", help="embedded models: list | fetch NAME [--repair] | verify NAME")
    m.add_argument("action", choices=["list", "fetch", "verify"])
    m.add_argument("name", nargs="?")
    m.add_argument("--json", action="store_true")
    m.add_argument("--repair", action="store_true",
                   help="fetch: reinstall damaged weights, convert again a damaged copy, remove damaged packed "
                        "weights and kernel library, then verify")
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
