"""The bench protocol: load, warm up, run every runner on every prompt (interleaved), report.

Greedy and batch 1 by default.  For each prompt the runners run one after another
(vanilla first: it is the reference for speedup and token identity, and its answer to a
first turn is the history every runner gets for the second turn), ``repeats`` times.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..core.cost_model import machine_description
from ..errors import InvalidParameterError, LeapdecodeError
from ..models.kernel_library import isa_flags
from . import report, stats
from .runners import DRAFT_PEERS, LeapdecodeRunner, Runner, expand_peers, make_peers, split_method_row
from .workloads import Question, load_workload, select

WARMUP_TOKENS = 8
# a leapdecode generation's stats kept per record in results.jsonl (where the time went, what was drafted)
RECORDED_STATS = ("tree_rows", "prefill_s", "draft_s", "verify_s", "auto_arms")


@dataclass
class BenchConfig:
    model: str
    methods: list[str] = field(default_factory=lambda: ["vanilla"])
    peers: list[str] = field(default_factory=list)
    draft: str | None = None
    tree_budget: int | None = None
    dtype: str = "auto"
    weights: str = "auto"
    attention: str = "auto"
    require_exact: bool = False
    device: str = "auto"
    backend: str = "auto"
    workload: str | None = None
    limit: int | None = None
    categories: list[str] | None = None
    seed: int = 0
    max_new_tokens: int = 256
    temperature: float = 0.0
    repeats: int = 1
    out: Path = Path("bench_out")
    plots: bool = True
    progress: bool = True
    json_object: bool = False  # constrain every output to a JSON object (structured output)
    command: str | None = None  # the command line that ran the bench (the CLI sets it), for the results page


def validate_methods(methods: list[str]) -> list[str]:
    """The bench rows: ``vanilla`` first, then each method (or ``METHOD:KEY=VALUE...`` row) once."""
    out = ["vanilla"]
    for m in methods:
        m = m.strip()
        if not m or m in out:
            continue
        split_method_row(m)
        out.append(m)
    return out


def _commit() -> str | None:
    """The source's git commit (with ``+dirty`` for uncommitted changes), else the package version."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"leapdecode {version('leapdecode')}"
    except PackageNotFoundError:
        return None


def encode_turn(loaded, q: Question, history: list[dict], turn: str) -> list[int]:
    """Token ids of one turn: through the chat template (with the history) for chat
    workloads, the plain text for completion workloads or models without a template."""
    from ..core.prompt import encode_prompt

    if q.chat and getattr(loaded.tokenizer, "chat_template", None):
        return encode_prompt(loaded, [*history, {"role": "user", "content": turn}])
    text = "\n\n".join([*(m["content"] for m in history), turn])
    return encode_prompt(loaded, text, chat=False)


def run_bench(cfg: BenchConfig, console=None, say: Callable[[str], None] | None = None) -> dict:
    """Run the bench; writes results.jsonl, summary.json, report.md and plots to ``cfg.out``
    and returns the summary."""
    from rich.console import Console

    from ..models.loader import load

    console = console or Console(stderr=True)
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        (say or (lambda m: console.print(f"leapdecode: {m}", markup=False, highlight=False, soft_wrap=True)))(msg)

    if cfg.max_new_tokens < 1:
        raise InvalidParameterError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.repeats < 1:
        raise InvalidParameterError(f"--repeats must be >= 1, got {cfg.repeats}")
    if cfg.temperature < 0:
        raise InvalidParameterError(f"--temperature must be >= 0, got {cfg.temperature}")
    methods = validate_methods(cfg.methods)
    try:
        peers = expand_peers(cfg.peers)
    except ValueError as e:
        raise InvalidParameterError(str(e)) from None
    questions, workload_desc = load_workload(cfg.workload)
    if cfg.json_object:
        for q in questions:
            q.meta.setdefault("json_schema", {"type": "object"})
    structured = any("json_schema" in q.meta for q in questions)

    t_start = time.perf_counter()
    loaded = load(cfg.model, dtype=cfg.dtype, device=cfg.device, backend=cfg.backend, weights=cfg.weights,
                  attention=cfg.attention, require_exact=cfg.require_exact)
    grammar: dict[str, Any] = {}
    if structured:  # compile every schema once: what the engine supports, and how fast
        questions, grammar = compile_structures(loaded, questions, cfg.categories)
        note(f"structured output: the grammar engine supports {grammar['supported']} of {grammar['schemas']} "
             f"schemas (compile p50 {grammar['compile_ms_p50']} ms)")
        if not questions:
            raise LeapdecodeError("no question's schema is supported by the grammar engine")
    questions = select(questions, cfg.limit, cfg.categories, cfg.seed)
    drafts: dict = {}
    runners: list[Runner] = [LeapdecodeRunner(loaded, m, draft=cfg.draft, tree_budget=cfg.tree_budget, drafts=drafts)
                             for m in methods]
    if peers:
        runners += make_peers(peers, loaded, cfg.model, cfg.draft, n_ctx=loaded.max_seq_len, say=note)
    started = list(runners)  # (a runner dropped on the way is closed too)
    try:
        greedy = cfg.temperature <= 0

        # warm-up: one short generation per runner on the longest first-turn prompt that fits, so that
        # every one-off cost (the kernel build, the prefill path's measurement and the dense copies a
        # long prompt triggers, the verification-cost probe, a draft's lazy load and prefill, a peer's
        # start-up) is paid before any timed prompt (tests/test_bench.py plants one)
        fitting = [(q, ids) for q in questions
                   if len(ids := encode_turn(loaded, q, [], q.turns[0])) + WARMUP_TOKENS < loaded.max_seq_len]
        warm_q, first = max(fitting, key=lambda c: len(c[1])) if fitting else \
            (questions[0], encode_turn(loaded, questions[0], [], questions[0].turns[0]))
        for r in list(runners):
            try:
                mark = r.mark()
                r.run(first, min(WARMUP_TOKENS, cfg.max_new_tokens), cfg.temperature, cfg.seed, structure_of(warm_q))
            except LeapdecodeError:
                raise
            except Exception as e:
                if r.system == "leapdecode":
                    raise
                note(f"skipping {r.name}: warm-up failed ({type(e).__name__}: {e})")
                runners.remove(r)
                continue
            r.rewind(mark)  # the warm-up prompt is timed later: its text is not in a memory then

        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        records: list[dict] = []
        total = sum(len(q.turns) for q in questions) * cfg.repeats * len(runners)
        order = [r.name for r in runners]

        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        progress = Progress(TextColumn("[bold]bench[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                            disable=not cfg.progress, transient=False)
        plain_lines = cfg.progress and not console.is_terminal  # a line per generation instead of the bar
        n_prompt = 0
        with progress:
            task = progress.add_task("", total=total)
            for q in questions:
                history: list[dict] = []
                for turn_no, turn in enumerate(q.turns, start=1):
                    ids = encode_turn(loaded, q, history, turn)
                    if len(ids) + 1 > loaded.max_seq_len:
                        note(f"question {q.question_id} turn {turn_no}: prompt of {len(ids)} tokens exceeds the "
                             f"context ({loaded.max_seq_len}); skipped")
                        progress.advance(task, cfg.repeats * len(runners) * (len(q.turns) - turn_no + 1))
                        break
                    ref_tokens: list[int] | None = None
                    ref_text = ""
                    n_before = len(records)
                    done_before = progress.tasks[0].completed
                    failed = None
                    marks = {r.name: r.mark() for r in runners} if cfg.repeats > 1 else {}
                    for rep in range(cfg.repeats):
                        if failed:
                            break
                        seed = None if greedy else cfg.seed * 1_000_003 + n_prompt * 101 + rep
                        for r in list(runners):
                            progress.update(task, description=f"{r.name:<14} q{q.question_id} t{turn_no} r{rep + 1}")
                            if rep:
                                r.rewind(marks[r.name])  # a repeat drafts from what the first run could
                            try:
                                res = r.run(ids, cfg.max_new_tokens, cfg.temperature, seed, structure_of(q))
                            except LeapdecodeError:
                                raise
                            except Exception as e:
                                if r.system == "leapdecode":
                                    # an engine failure on one prompt: drop the prompt for every
                                    # runner (so all rows cover the same prompts) and go on
                                    failed = f"{r.name}: {type(e).__name__}: {e}"
                                    break
                                note(f"dropping {r.name}: {type(e).__name__}: {e}")
                                runners.remove(r)
                                continue
                            if r.name == "vanilla" and ref_tokens is None:
                                ref_tokens, ref_text = res.tokens, res.text
                            div = (stats.first_divergence(res.tokens, ref_tokens)
                                   if greedy and ref_tokens is not None else None)
                            n = res.new_tokens
                            gs = res.extra.get("stats") or {}  # a leapdecode generation's own stats
                            # tokens decided per forward: a leapdecode generation's own count (its
                            # end-of-sequence token included: vanilla is 1.00), else the new tokens
                            decided = gs.get("decided_tokens", n)
                            records.append({
                                "method": r.name, "model": loaded.name, "system": r.system,
                                "question_id": q.question_id, "category": q.category, "group": q.group,
                                "turn": turn_no, "repeat": rep, "prompt_tokens": len(ids), "new_tokens": n,
                                "wall_s": round(res.wall_s, 5),
                                "tokens_per_s": round(n / res.wall_s, 4) if res.wall_s > 0 else 0.0,
                                "target_forwards": res.target_forwards,
                                "decided_tokens": decided,
                                "mean_accepted": (round(decided / res.target_forwards, 4)
                                                  if res.target_forwards else None),
                                "identical": (div is None) if greedy and ref_tokens is not None else None,
                                "first_divergence": div,
                                "finish_reason": res.finish_reason,
                                "peak_rss_mb": res.peak_rss_mb,
                                "peak_gpu_mb": res.peak_gpu_mb,
                                **{k: gs[k] for k in RECORDED_STATS if k in gs},
                                **({"valid": output_valid(res.text, q.meta["json_schema"])
                                    if res.finish_reason == "stop" else None,
                                    "ended": res.finish_reason == "stop",
                                    "constraint_s": res.constraint_s} if "json_schema" in q.meta else {}),
                            })
                            progress.advance(task)
                            if plain_lines:  # a log file or a pipe: rich draws the bar only at the end
                                console.print(f"bench {int(progress.tasks[0].completed)}/{total} {r.name} "
                                              f"q{q.question_id} t{turn_no} r{rep + 1}: {n} tokens in "
                                              f"{res.wall_s:.1f} s", markup=False, highlight=False, soft_wrap=True)
                    if failed:
                        del records[n_before:]
                        note(f"question {q.question_id} turn {turn_no} ({len(ids)} prompt tokens) skipped: {failed}")
                        progress.update(task, completed=done_before
                                        + cfg.repeats * len(runners) * (len(q.turns) - turn_no + 1))
                        break
                    history += [{"role": "user", "content": turn}, {"role": "assistant", "content": ref_text}]
                    n_prompt += 1
                report.write_jsonl(out / "results.jsonl", records)  # partial results survive an interrupt
    finally:  # an interrupted or failed bench leaves no peer server running
        for r in started:
            r.close()
    if not records:
        raise LeapdecodeError("no prompt could be benchmarked: " + "; ".join(notes[-3:]))

    summary = stats.summarize(records, order=order)
    if structured:
        summary["structured"] = {**grammar, "rows": structured_rows(records, order)}
    summary.update({
        "model": loaded.name, "backend": loaded.backend, "dtype": str(loaded.dtype).replace("torch.", ""), "weights": loaded.weights,
        "attention": getattr(loaded.model, "attention", "-"), "batch_invariant": batch_invariant(loaded),
        "device": str(loaded.device), "draft": drafts_used(cfg.draft, loaded, drafts, runners),
        "methods": methods, "peers": [r.name for r in runners if r.system != "leapdecode"],
        "workload": workload_desc, "questions": len(questions), "prompts": n_prompt,
        "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "repeats": cfg.repeats,
        "seed": cfg.seed, "machine": machine_description(loaded.device), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "elapsed_s": round(time.perf_counter() - t_start, 1), "skipped": notes,
        "python": sys.version.split()[0], "cpu_flags": isa_flags(), "commit": _commit(),
        "command": cfg.command,
    })
    plot_files: list[Path] = []
    if cfg.plots:
        plot_files = report.plots(summary, out)
        if not plot_files:
            note("no plots: matplotlib is not installed (pip install 'leapdecode[bench]')")
    summary["plots"] = [str(p) for p in plot_files]
    summary["files"] = {"results": str(out / "results.jsonl"), "summary": str(out / "summary.json"),
                        "report": str(out / "report.md")}
    report.write_jsonl(out / "results.jsonl", records)
    report.write_json(out / "summary.json", summary)
    report.write_text(out / "report.md", report.markdown(summary))
    return summary


def structure_of(q: Question) -> dict | None:
    """``compile_constraint`` keywords for a question's output (None: free text)."""
    return {"json_schema": q.meta["json_schema"]} if "json_schema" in q.meta else None


def drafts_used(named: str | None, loaded, drafts: dict, runners: list[Runner]) -> str | None:
    """The draft models the run's rows used: those leapdecode's rows loaded (``auto`` with a trained
    head loads none), and the draft of a peer row that runs one (HF assisted, llama.cpp's draft row)."""
    used = set(drafts)
    if any(r.system != "leapdecode" and r.name in DRAFT_PEERS for r in runners):
        used.add(named or loaded.draft_name)
    used.discard(None)
    return ", ".join(sorted(used)) or None


def compile_structures(loaded, questions: list[Question], categories: list[str] | None):
    """The questions whose schema the grammar engine supports, and compile statistics."""
    from ..core.runner import ModelRunner
    from ..errors import GrammarError
    from ..constraints.grammar import compile_constraint

    questions = select(questions, None, categories)  # an unknown category is named here (probe B24)
    runner = ModelRunner(loaded, prefix_cache_bytes=0)
    compile_constraint(runner, json_schema={"type": "object"})  # builds the tokenizer view once
    kept, times, refused = [], [], 0
    for q in questions:
        if "json_schema" not in q.meta:
            kept.append(q)
            continue
        t0 = time.perf_counter()
        try:
            compile_constraint(runner, json_schema=q.meta["json_schema"])
        except GrammarError:
            refused += 1
            continue
        times.append(time.perf_counter() - t0)
        kept.append(q)
    times.sort()
    pct = (lambda p: round(1e3 * times[min(len(times) - 1, int(p * len(times)))], 2)) if times else (lambda p: None)
    return kept, {"schemas": len(times) + refused, "supported": len(times), "refused": refused,
                  "compile_ms_p50": pct(0.5), "compile_ms_p95": pct(0.95)}


def output_valid(text: str, schema: dict) -> bool | None:
    """The output parses as JSON and validates against the schema (``jsonschema``); None when
    Python cannot check it (a pattern in an ECMA-262 regex dialect that ``re`` does not read, a
    ``$ref`` to a remote schema)."""
    import jsonschema

    try:
        instance = json.loads(text)
    except ValueError:
        return False
    try:
        jsonschema.validators.validator_for(schema)(schema).validate(instance)
    except jsonschema.ValidationError:
        return False
    except Exception:  # noqa: BLE001  a pattern re cannot read (re.error), a remote $ref (referencing)
        return None
    return True


def structured_rows(records: list[dict], order: list[str]) -> list[dict]:
    """Per runner: outputs that ended (EOS) and those valid among them, outputs cut by the token
    limit, and the grammar engine's time per generated token and as a share of the wall time."""
    out = []
    for name in order:
        rs = [r for r in records if r["method"] == name and "valid" in r]
        if not rs:
            continue
        ended = [r for r in rs if r.get("ended", r["valid"] is not None)]
        unchecked = sum(1 for r in ended if r["valid"] is None)
        grammar_s = [r["constraint_s"] for r in rs if r.get("constraint_s") is not None]
        tokens = sum(r["new_tokens"] for r in rs if r.get("constraint_s") is not None)
        wall = sum(r["wall_s"] for r in rs if r.get("constraint_s") is not None)
        out.append({"runner": name, "outputs": len(rs), "ended": len(ended),
                    "valid": sum(1 for r in ended if r["valid"]), "unchecked": unchecked,
                    "cut_by_limit": len(rs) - len(ended),
                    "grammar_us_per_token": round(1e6 * sum(grammar_s) / tokens, 1) if tokens else None,
                    "grammar_share_of_wall": round(sum(grammar_s) / wall, 4) if wall else None})
    return out


def batch_invariant(loaded) -> bool:
    """The configuration computes a token's logits with the same bits in a tree forward as
    alone (``models/invariance.exactness_problem``): quantized weights on the batch-invariant
    kernels with the invariant attention."""
    from ..models.invariance import exactness_problem

    return exactness_problem(loaded.model) is None
