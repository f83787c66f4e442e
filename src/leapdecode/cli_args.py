"""The command line's shared arguments: the model flags, the decoding flags (method, strategy,
sampling, structured output) and their translation into a generation's keyword arguments, checked
before any model loads.  ``cli.py`` and every subcommand's module (bench, serve, datastore, heads)
build their parsers from these; nothing here runs a command.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .errors import InvalidParameterError, LeapdecodeError


@dataclass(frozen=True)
class LoadOptions:
    """How the model of ``-m`` loads: the model flags (``add_model_args``) as ``models.loader.load``'s
    keywords, their defaults written here once."""

    dtype: str = "auto"
    weights: str = "auto"
    attention: str = "auto"
    device: str = "auto"
    backend: str = "auto"
    require_exact: bool = False

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "LoadOptions":
        return cls(**{f.name: getattr(a, f.name) for f in fields(cls)})

    def load(self, model: str):
        from .models.loader import load

        return load(model, **asdict(self))


def add_model_args(p: argparse.ArgumentParser, default_model: str | None = None) -> None:
    from .models.registry import DEFAULT_MODEL

    p.add_argument("-m", "--model", default=default_model or DEFAULT_MODEL,
                   help="registered name (see `leapdecode models list`), HF model directory, .gguf file "
                        "or hub id (default: %(default)s)")
    p.add_argument("--backend", choices=["auto", "native", "hf"], default=LoadOptions.backend,
                   help="native: leapdecode's Llama/Qwen2 decoder; hf: transformers fallback "
                        "(auto: native where supported)")
    p.add_argument("--dtype", default=LoadOptions.dtype, help="auto (bf16 with AMX/AVX512-BF16 or CUDA, else fp32), fp32, bf16")
    p.add_argument("--device", default=LoadOptions.device, help="auto, cpu, cuda, cuda:N")
    p.add_argument("--weights", default=LoadOptions.weights, choices=["auto", "bf16", "fp32", "int8", "int4"],
                   help="weight format of the native backend. auto (default): int4 for a GGUF model on "
                        "a CPU with AVX512-VNNI or AVX2 (the file's own quantized blocks on leapdecode's "
                        "batch-invariant kernel), "
                        "else as --dtype; int4: that kernel (4-bit groups of 32 for a float checkpoint; "
                        "torch's int4 kernel on CUDA); int8: torch's per-channel int8 kernel; bf16/fp32: "
                        "float weights (fast prefill, but greedy speculation is not guaranteed to "
                        "reproduce vanilla bit for bit). A diffusion model (LLaDA/Dream): fp32 by default, "
                        "int8/int4 quantized at load the same way")
    p.add_argument("--attention", default=LoadOptions.attention, choices=["auto", "sdpa", "invariant"],
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
OPTION_FLAGS = (("draft", "--draft"), ("tree_budget", "--tree-budget"), ("datastore", "--datastore"))


def strategy_options(a: argparse.Namespace, where: dict[str, str] | None = None) -> dict:
    """The strategy's options from ``--strategy-option KEY=VALUE`` and the shorthand flags, typed by
    its config (an error names a flag given without ``--strategy``); ``where`` records which flag
    set an option (``strategy_options.num_beams`` -> ``--num-beams``)."""
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
    def known(key: str, flag: str) -> None:
        if key not in cls.option_names():
            raise LeapdecodeError(f"{flag}: strategy {name!r} has no option {key!r}; its options: "
                                  f"{', '.join(cls.option_names())}")

    return merge_flags(a, options, given, "strategy_options", "--strategy-option", where, check=known)


def method_options(a: argparse.Namespace, where: dict[str, str] | None = None) -> dict:
    """The method's options from ``--option KEY=VALUE`` and the shortcut flags, typed by its config;
    ``where`` records which flag set an option (``options.tree_budget`` -> ``--tree-budget``)."""
    from .core.config import parse_option_assignments
    from .proposers import method_spec
    from .request import check_method_name

    resolve_method_name(a)
    check_method_name(a.method)

    options = parse_option_assignments(method_spec(a.method).config, a.option)
    return merge_flags(a, options, OPTION_FLAGS, "options", "--option", where)


def merge_flags(a: argparse.Namespace, options: dict, flags, path: str, option_flag: str,
                where: dict[str, str] | None, check=None) -> dict:
    """``options`` (from ``option_flag KEY=VALUE``) with the shortcut ``flags`` given ((key, flag)
    pairs) merged in: a shortcut and ``option_flag`` must agree (``check(key, flag)`` first, if
    given); ``where`` records which flag set an option (``path.key`` -> the flag)."""
    for key, flag in flags:
        value = getattr(a, key, None)
        if value is None:
            continue
        if check is not None:
            check(key, flag)
        if key in options and options[key] != value:
            raise LeapdecodeError(f"{flag} and {option_flag} {key}= disagree")
        options[key] = value
        if where is not None:
            where[f"{path}.{key}"] = flag
    return options


def flag_name(path: str, where: dict[str, str]) -> str:
    """The command line's name of a request field (``request.py``'s paths): the flag that set it."""
    if path in where:
        return where[path]
    head, _, key = path.partition(".")
    if head == "options":
        return f"--option {key}=" if key else "--option"
    if head == "strategy_options":
        return f"--strategy-option {key}=" if key else "--strategy-option"
    return "--" + path.replace("_", "-")


def decoding_request(a: argparse.Namespace):
    """The ``GenerationRequest`` of the decoding flags, validated before any model loads; a bad
    combination is the validator's message with the flags' names (``--stop``, ``--tree-budget``)."""
    from .request import validate_request

    where: dict[str, str] = {}
    options = method_options(a, where)
    sopts = strategy_options(a, where)
    structure = structure_kwargs(a, where)
    try:
        return validate_request(
            method=a.method, options=options or None, strategy=getattr(a, "strategy", None),
            strategy_options=sopts or None, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
            top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, typical_p=a.typical_p,
            repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop, kv_policy=a.kv_policy, **structure)
    except InvalidParameterError as e:  # the validator's words, the flags' names
        raise InvalidParameterError(e.render(lambda path: flag_name(path, where))) from None


def read_text_arg(flag: str, path: str) -> str:
    """The text of a file named on the command line (``-``: standard input), or a clear error."""
    if path == "-":
        return read_stdin_text()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LeapdecodeError(f"{flag} {path}: cannot read it ({e.__class__.__name__}: {e})") from None


def structure_kwargs(a: argparse.Namespace, where: dict[str, str] | None = None) -> dict:
    """``json_schema`` / ``regex`` / ``grammar`` from the structured-output flags (the validator
    refuses more than one); ``where`` records ``--json-object`` as the flag of ``json_schema``."""
    out: dict = {}
    if a.json_schema is not None:
        from .constraints.grammar import check_json_schema

        out["json_schema"] = check_json_schema(read_text_arg("--json-schema", a.json_schema))
    if a.json_object:
        if "json_schema" in out:
            raise LeapdecodeError("give at most one of --json-schema and --json-object")
        out["json_schema"] = {"type": "object"}
        if where is not None:
            where["json_schema"] = "--json-object"
    if a.regex is not None:
        out["regex"] = a.regex
    if a.grammar is not None:
        out["grammar"] = read_text_arg("--grammar", a.grammar)
    return out


def load_from_args(a: argparse.Namespace):
    return LoadOptions.from_args(a).load(a.model)


def read_stdin_text() -> str:
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LeapdecodeError(f"standard input is not valid UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def is_diffusion_model(name: str) -> bool:
    """A tiny random diffusion model's name or a LLaDA/Dream checkpoint directory."""
    from .diffusion.loaded import is_diffusion_checkpoint

    return name.startswith(("tiny-llada", "tiny-dream")) or is_diffusion_checkpoint(name)


# the flags of `generate` whose request fields are not their own names (``request.py``'s paths)
DIFFUSION_FLAG_PATHS = {"strategy_option": ("strategy_options", "--strategy-option"),
                        "num_return_sequences": ("num_return_sequences", "--n"),
                        "draft": ("options.draft", "--draft"), "tree_budget": ("options.tree_budget", "--tree-budget"),
                        "datastore": ("options.datastore", "--datastore")}


def check_diffusion_flags(a: argparse.Namespace) -> None:
    """``request.check_diffusion_fields`` on the flags of ``generate -m <diffusion model>``, named as
    flags; and the causal loader's own flags, which a diffusion model does not take either."""
    from .request import DIFFUSION_UNSUPPORTED, check_diffusion_fields

    paths = {path: attr for attr, (path, _) in DIFFUSION_FLAG_PATHS.items()}
    where = {path: flag for path, flag in DIFFUSION_FLAG_PATHS.values()}
    given = {path: getattr(a, paths.get(path, path), default) for path, default in DIFFUSION_UNSUPPORTED.items()}
    try:
        check_diffusion_fields(given, repr(a.model))
    except InvalidParameterError as e:
        raise InvalidParameterError(e.render(lambda path: flag_name(path, where)) + " (and --dtype, --weights, "
                                    "--json, --stats, --json-object)") from None
    loader = [flag for flag, value in (("--backend", a.backend), ("--attention", a.attention)) if value != "auto"]
    if loader:
        raise InvalidParameterError(f"{', '.join(loader)}: not for a diffusion model ({a.model!r}); it loads with "
                                    "--dtype and --weights")
