"""The bench protocol: load, warm up, run every runner on every prompt (interleaved), report.

Greedy and batch 1 by default.  For each prompt the runners run one after another
(vanilla first: it is the reference for speedup and token identity, and its answer to a
first turn is the history every runner gets for the second turn), ``repeats`` times.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..cli_args import LoadOptions
from ..core.cost_model import machine_description
from ..errors import InvalidParameterError, LeapdecodeError
from ..models.kernel_library import isa_flags
from . import report, stats
from .record import BenchRecord
from .peers import DRAFT_PEERS, expand_peers, make_peers
from .runners import LeapdecodeRunner, Runner, RunOutput, split_method_row
from .workloads import Question, load_workload, select

WARMUP_TOKENS = 8


@dataclass
class BenchConfig:
    model: str
    methods: list[str] = field(default_factory=lambda: ["vanilla"])
    peers: list[str] = field(default_factory=list)
    draft: str | None = None
    tree_budget: int | None = None
    load_options: LoadOptions = field(default_factory=LoadOptions)  # how the model loads (the model flags)
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


def check_config(cfg: BenchConfig) -> None:
    if cfg.max_new_tokens < 1:
        raise InvalidParameterError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.repeats < 1:
        raise InvalidParameterError(f"--repeats must be >= 1, got {cfg.repeats}")
    if cfg.temperature < 0:
        raise InvalidParameterError(f"--temperature must be >= 0, got {cfg.temperature}")


def run_bench(cfg: BenchConfig, console=None, say: Callable[[str], None] | None = None) -> dict:
    """Run the bench; writes results.jsonl, summary.json, report.md and plots to ``cfg.out``
    and returns the summary."""
    from rich.console import Console

    console = console or Console(stderr=True)
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        (say or (lambda m: console.print(f"leapdecode: {m}", markup=False, highlight=False, soft_wrap=True)))(msg)

    check_config(cfg)
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
    loaded = cfg.load_options.load(cfg.model)
    questions, grammar = bench_questions(loaded, questions, cfg, structured, note)
    drafts: dict = {}  # the draft models the rows loaded, by name (each loads once)
    runners = make_runners(loaded, methods, peers, cfg, drafts, note)
    started = list(runners)  # (a runner dropped on the way is closed too)
    try:
        warm_up(runners, loaded, questions, cfg, note)
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        records: list[BenchRecord] = []
        order = [r.name for r in runners]
        n_prompt = 0  # the prompts run (a sampled run's seed counts them)
        total = sum(len(q.turns) for q in questions) * cfg.repeats * len(runners)
        with BenchProgress(console, cfg.progress, total) as progress:
            session = Session(loaded, runners, cfg, progress, note)
            for q in questions:
                n_prompt += run_question(session, q, n_prompt, records)
                # partial results survive an interrupt
                report.write_jsonl(out / "results.jsonl", [r.to_dict() for r in records])
    finally:  # an interrupted or failed bench leaves no peer server running
        for r in started:
            r.close()
    if not records:
        raise LeapdecodeError("no prompt could be benchmarked: " + "; ".join(notes[-3:]))

    summary = stats.summarize([r.to_dict() for r in records], order=order)
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
    write_outputs(summary, records, out, cfg.plots, note)
    return summary


def bench_questions(loaded, questions: list[Question], cfg: BenchConfig, structured: bool,
                    note: Callable[[str], None]) -> tuple[list[Question], dict[str, Any]]:
    """The questions the bench runs (``--limit``, ``--categories``; under structured output those whose
    schema the grammar engine supports), and the grammar engine's statistics (structured output)."""
    grammar: dict[str, Any] = {}
    if structured:  # compile every schema once: what the engine supports, and how fast
        questions, grammar = compile_structures(loaded, questions, cfg.categories)
        note(f"structured output: the grammar engine supports {grammar['supported']} of {grammar['schemas']} "
             f"schemas (compile p50 {grammar['compile_ms_p50']} ms)")
        if not questions:
            raise LeapdecodeError("no question's schema is supported by the grammar engine")
    return select(questions, cfg.limit, cfg.categories, cfg.seed), grammar


def make_runners(loaded, methods: list[str], peers: list[str], cfg: BenchConfig, drafts: dict,
                 note: Callable[[str], None]) -> list[Runner]:
    """A runner per bench row: leapdecode's methods (vanilla first), then the peers that can run here."""
    runners: list[Runner] = [LeapdecodeRunner(loaded, m, draft=cfg.draft, tree_budget=cfg.tree_budget, drafts=drafts)
                             for m in methods]
    if peers:
        runners += make_peers(peers, loaded, cfg.model, cfg.draft, n_ctx=loaded.max_seq_len, say=note)
    return runners


def warm_up(runners: list[Runner], loaded, questions: list[Question], cfg: BenchConfig,
            note: Callable[[str], None]) -> None:
    """One short generation per runner on the longest first-turn prompt that fits, so that every
    one-off cost (the kernel build, the prefill path's measurement and the dense copies a long prompt
    triggers, the verification-cost probe, a draft's lazy load and prefill, a peer's start-up) is paid
    before any timed prompt (tests/test_bench.py plants one); a peer whose warm-up fails is dropped."""
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


class BenchProgress:
    """The bench's progress: rich's bar in a terminal, and a line per generation in a log file or a
    pipe (where rich draws the bar only at the end); nothing with ``enabled`` False."""

    def __init__(self, console, enabled: bool, total: int) -> None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.console, self.total = console, total
        self.bar = Progress(TextColumn("[bold]bench[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                            disable=not enabled, transient=False)
        self.lines = enabled and not console.is_terminal

    def __enter__(self) -> "BenchProgress":
        self.bar.__enter__()
        self.task = self.bar.add_task("", total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    @property
    def completed(self) -> float:
        return self.bar.tasks[0].completed

    def starting(self, label: str) -> None:
        self.bar.update(self.task, description=label)

    def advance(self, n: int = 1) -> None:
        self.bar.advance(self.task, n)

    def set_completed(self, n: float) -> None:
        self.bar.update(self.task, completed=n)

    def ran(self, label: str, res: RunOutput) -> None:
        self.advance()
        if self.lines:
            self.console.print(f"bench {int(self.completed)}/{self.total} {label}: {res.new_tokens} tokens in "
                               f"{res.wall_s:.1f} s", markup=False, highlight=False, soft_wrap=True)


@dataclass
class Session:
    """What running the bench's prompts needs: the target, the runners (a peer that fails is dropped
    from the list), the configuration, the progress and the notes."""

    loaded: Any
    runners: list[Runner]
    cfg: BenchConfig
    progress: BenchProgress
    note: Callable[[str], None]


def run_question(p: Session, q: Question, n_prompt: int, records: list[BenchRecord]) -> int:
    """Every turn of ``q`` on every runner (the history of a turn: vanilla's answers to the turns
    before), into ``records``; returns the prompts run.  A prompt over the context, or one that fails
    in leapdecode, ends the question: its later turns would have no history."""
    history: list[dict] = []
    done = 0
    for turn_no, turn in enumerate(q.turns, start=1):
        ids = encode_turn(p.loaded, q, history, turn)
        left = len(q.turns) - turn_no + 1  # the turns not run, this one included
        if len(ids) + 1 > p.loaded.max_seq_len:
            p.note(f"question {q.question_id} turn {turn_no}: prompt of {len(ids)} tokens exceeds the "
                   f"context ({p.loaded.max_seq_len}); skipped")
            p.progress.advance(p.cfg.repeats * len(p.runners) * left)
            break
        done_before = p.progress.completed
        rows, answer, failed = run_prompt(p, q, turn_no, ids, n_prompt + done)
        if failed:
            p.note(f"question {q.question_id} turn {turn_no} ({len(ids)} prompt tokens) skipped: {failed}")
            p.progress.set_completed(done_before + p.cfg.repeats * len(p.runners) * left)
            break
        records += rows
        history += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        done += 1
    return done


def run_prompt(p: Session, q: Question, turn_no: int, ids: list[int], prompt_no: int):
    """One prompt, ``repeats`` times, each time on every runner in turn (vanilla first: the reference
    for token identity, and its answer the history of the next turn) -> (records, vanilla's answer,
    None), or ([], "", why) when leapdecode failed on it (the prompt is dropped for every runner, so
    that all rows cover the same prompts)."""
    cfg = p.cfg
    greedy = cfg.temperature <= 0
    rows: list[BenchRecord] = []
    reference: RunOutput | None = None
    marks = {r.name: r.mark() for r in p.runners} if cfg.repeats > 1 else {}
    for rep in range(cfg.repeats):
        seed = None if greedy else cfg.seed * 1_000_003 + prompt_no * 101 + rep
        for r in list(p.runners):
            label = f"{r.name} q{q.question_id} t{turn_no} r{rep + 1}"
            p.progress.starting(f"{r.name:<14} q{q.question_id} t{turn_no} r{rep + 1}")
            if rep:
                r.rewind(marks[r.name])  # a repeat drafts from what the first run could
            try:
                res = r.run(ids, cfg.max_new_tokens, cfg.temperature, seed, structure_of(q))
            except LeapdecodeError:
                raise
            except Exception as e:
                if r.system == "leapdecode":
                    return [], "", f"{r.name}: {type(e).__name__}: {e}"
                p.note(f"dropping {r.name}: {type(e).__name__}: {e}")
                p.runners.remove(r)
                continue
            if r.name == "vanilla" and reference is None:
                reference = res
            rows.append(BenchRecord.of_run(res, method=r.name, system=r.system, model=p.loaded.name, q=q,
                                           turn=turn_no, repeat=rep, prompt_tokens=len(ids),
                                           reference=reference.tokens if greedy and reference else None))
            p.progress.ran(label, res)
    return rows, reference.text if reference else "", None


def write_outputs(summary: dict, records: list[BenchRecord], out: Path, plots: bool,
                  note: Callable[[str], None]) -> None:
    """results.jsonl, summary.json, report.md and the plots; the summary names the files."""
    plot_files: list[Path] = []
    if plots:
        plot_files = report.plots(summary, out)
        if not plot_files:
            note("no plots: matplotlib is not installed (pip install 'leapdecode[bench]')")
    summary["plots"] = [str(p) for p in plot_files]
    summary["files"] = {"results": str(out / "results.jsonl"), "summary": str(out / "summary.json"),
                        "report": str(out / "report.md")}
    report.write_jsonl(out / "results.jsonl", [r.to_dict() for r in records])
    report.write_json(out / "summary.json", summary)
    report.write_text(out / "report.md", report.markdown(summary))


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


def structured_rows(records: list[BenchRecord], order: list[str]) -> list[dict]:
    """Per runner: outputs that ended (EOS) and those valid among them, outputs cut by the token
    limit, and the grammar engine's time per generated token and as a share of the wall time."""
    out = []
    for name in order:
        rs = [r.structured for r in records if r.method == name and r.structured is not None]
        if not rs:
            continue
        timed = [(r, s) for r in records if r.method == name and (s := r.structured) is not None
                 and s.constraint_s is not None]
        ended = [s for s in rs if s.ended]
        grammar_s = sum(s.constraint_s for _, s in timed)
        tokens = sum(r.new_tokens for r, _ in timed)
        wall = sum(r.wall_s for r, _ in timed)
        out.append({"runner": name, "outputs": len(rs), "ended": len(ended),
                    "valid": sum(1 for s in ended if s.valid), "unchecked": sum(1 for s in ended if s.valid is None),
                    "cut_by_limit": len(rs) - len(ended),
                    "grammar_us_per_token": round(1e6 * grammar_s / tokens, 1) if tokens else None,
                    "grammar_share_of_wall": round(grammar_s / wall, 4) if wall else None})
    return out


def batch_invariant(loaded) -> bool:
    """The configuration computes a token's logits with the same bits in a tree forward as
    alone (``models/invariance.exactness_problem``): quantized weights on the batch-invariant
    kernels with the invariant attention."""
    from ..models.invariance import exactness_problem

    return exactness_problem(loaded.model) is None
