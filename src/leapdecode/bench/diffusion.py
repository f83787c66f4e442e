"""``leapdecode diffusion bench``: speed and quality of the diffusion decoders on one model
(issue 18, docs/diffusion.md "Benchmark").

For each decoder configuration (a method at several thresholds) and each prompt, greedy decoding
of ``max_new_tokens`` positions, measured against ``stepwise`` (LLaDA's one-token-per-step
low-confidence remasking, "Large Language Diffusion Models", Nie et al., 2025) on the same prompt:

- **forwards per generated token** (network calls / answer positions; ``rows`` counts every canvas
  of a batched verification) and **tokens/s** (answer positions / wall time);
- **exact match with stepwise** (the whole answer canvas identical) and the share of answer
  positions that agree;
- **NLL of the output under the AR parent** (nats per token of the answer up to its first EOS,
  conditioned on the prompt), the model's own quality yardstick: ParallelBench's lesson
  ("ParallelBench: Understanding the Trade-offs of Parallel Decoding in Diffusion LLMs", 2025) is
  that parallel commits break the dependencies between the tokens committed
  together, which a left-to-right scorer sees;
- **infilling exact match**: single-line infilling built from HumanEval's canonical solutions (the
  construction of HumanEval-infilling's single-line benchmark, "Efficient Training of Language
  Models to Fill in the Middle", Bavarian et al., 2022): one line of the solution masked, the text
  before it (prompt + earlier lines) and after it given, the number of masked positions equal to
  the line's token count (oracle length, as diffusion infilling evaluations do); exact match of
  the filled tokens.  (The ``human-eval-infilling`` package on PyPI, 2.15.0, holds no code or
  data, only metadata: the tasks are built here from HumanEval's solutions.)

Prompts are HumanEval's (the ``human-eval`` package of the bench extra, MIT licence), cut to their
last ``prompt_tokens`` tokens so that a CPU run stays short; a model trained by ``train-dllm`` on
the standard library has never seen them.  Outputs: ``results.jsonl`` (one record per prompt and
configuration), ``summary.json``, ``report.md`` (the table) and ``quality_vs_speed.png``, each
written to a temporary name and renamed into place.
"""

from __future__ import annotations

import gzip
import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..errors import InvalidParameterError, MissingExtraError
from ..models.store import atomic_output, atomic_write
from ..diffusion.api import load, method_config
from ..diffusion.common import Canvas, Clock, Counter
from ..diffusion.loaded import DiffusionModel
from ..diffusion.registry import DIFFUSION_METHODS

# the methods whose speed/quality knob is a confidence threshold, swept by --thresholds
THRESHOLD_METHODS = ("fast-dllm", "credit", "localleap", "adablock", "s2d2", "elastic-cache")  # localleap: + relaxed
DEFAULT_THRESHOLDS = (0.5, 0.7, 0.9)


@dataclass(frozen=True)
class BenchEntry:
    """One row of the benchmark: a method with its options, and the label the table shows."""

    label: str
    method: str
    options: dict = field(default_factory=dict)


def default_entries(thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS, methods: list[str] | None = None,
                    helper: str | None = None) -> list[BenchEntry]:
    """``stepwise`` first, then every other method (or ``methods``) with its defaults, the
    threshold methods once per threshold; ``apd`` only with a ``helper`` (the AR parent)."""
    names = list(DIFFUSION_METHODS) if methods is None else list(methods)
    unknown = [m for m in names if m not in DIFFUSION_METHODS]
    if unknown:
        raise InvalidParameterError(f"unknown diffusion methods {unknown}; known: {', '.join(DIFFUSION_METHODS)}")
    if not thresholds or any(not 0 < t <= 1 for t in thresholds):
        raise InvalidParameterError(f"thresholds must lie in (0, 1], got {list(thresholds)}")
    out = [BenchEntry("stepwise", "stepwise")]
    for m in names:
        if m == "stepwise":
            continue
        if m == "apd":
            if helper is None:
                if methods is not None:
                    raise InvalidParameterError("apd needs an AR helper: pass --parent")
                continue
            out.append(BenchEntry("apd", "apd", {"helper": helper}))
        elif m == "localleap":  # its relaxed threshold keeps the default ratio 0.75 / 0.9
            out.extend(BenchEntry(f"{m} t={t:g}", m, {"threshold": t, "relaxed_threshold": round(t * 5 / 6, 4)})
                       for t in thresholds)
        elif m in THRESHOLD_METHODS:
            out.extend(BenchEntry(f"{m} t={t:g}", m, {"threshold": t}) for t in thresholds)
        else:
            out.append(BenchEntry(m, m))
    for e in out:
        method_config(e.method, dict(e.options))  # every option checked before anything runs
    return out


# ------------------------------------------------------------------ workloads
def humaneval_records() -> list[dict]:
    """HumanEval's 164 problems (task_id, prompt, canonical_solution) from the installed
    ``human-eval`` distribution."""
    from .workloads import WorkloadError, humaneval_path

    try:
        path = humaneval_path()
    except WorkloadError as e:
        raise MissingExtraError(str(e)) from None
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass
class Prompt:
    key: str
    ids: list[int]


@dataclass
class InfillTask:
    key: str
    prefix: list[int]
    middle: list[int]
    suffix: list[int]


def completion_prompts(tokenizer, records: list[dict], n: int, prompt_tokens: int) -> list[Prompt]:
    """The first ``n`` problems' prompts, each cut to its last ``prompt_tokens`` tokens."""
    out = []
    for r in records[:n]:
        ids = list(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"])
        out.append(Prompt(r["task_id"], ids[-prompt_tokens:]))
    return out


def infill_tasks(tokenizer, records: list[dict], n: int, context_tokens: int, max_line_tokens: int = 24,
                 skip: int = 0) -> list[InfillTask]:
    """Single-line infilling from canonical solutions: for each problem (from ``skip`` on), the
    middle non-blank line of its solution (with its newline) is the span to fill; the text before
    it and after it, tokenized separately (so the three parts join to a tokenization of the whole),
    are cut to ``context_tokens`` on each side.  Lines longer than ``max_line_tokens`` are passed
    over (the problem is skipped)."""
    out = []
    for r in records[skip:]:
        if len(out) >= n:
            break
        full = r["prompt"] + r["canonical_solution"]
        start = len(r["prompt"])
        lines = full[start:].splitlines(keepends=True)
        body = [i for i, ln in enumerate(lines) if ln.strip()]
        if not body:
            continue
        pick = body[len(body) // 2]
        a = start + sum(len(ln) for ln in lines[:pick])
        b = a + len(lines[pick])
        enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        middle = enc(full[a:b])
        if not middle or len(middle) > max_line_tokens:
            continue
        out.append(InfillTask(r["task_id"], enc(full[:a])[-context_tokens:], middle,
                              enc(full[b:])[:context_tokens]))
    return out


# ------------------------------------------------------------------ decoding
def decode_canvas(model: DiffusionModel, entry: BenchEntry, prefix: list[int], n: int, block_size: int,
                  suffix: list[int] = ()) -> tuple[list[int], dict]:
    """Fill ``n`` masked positions between ``prefix`` and ``suffix`` (none for a completion) with
    ``entry``'s decoder; returns the filled positions and the counts (forwards, rows, wall_s)."""
    cfg = method_config(entry.method, dict(entry.options))
    canvas = Canvas.start(list(prefix), n, block_size, model.mask_token_id, device=model.device)
    if suffix:
        canvas.x = torch.cat([canvas.x, torch.tensor(list(suffix), dtype=torch.long, device=model.device)])
    fwd = Counter(model.network)
    spec = DIFFUSION_METHODS[cfg.method]
    extra: dict[str, Any] = {}
    clock = Clock()
    with torch.inference_mode():
        if "stats" in inspect.signature(spec.decode).parameters:
            spec.decode(canvas, fwd, cfg, stats=extra)
        else:
            spec.decode(canvas, fwd, cfg)
    wall = clock.elapsed()
    filled = canvas.x[canvas.prompt_len : canvas.prompt_len + n].tolist()
    counts = {"forwards": fwd.forwards, "rows": fwd.rows, "wall_s": wall}
    if "helper_forwards" in extra:  # apd: the AR helper's forwards, not in ``forwards`` (the dLLM's)
        counts["helper_forwards"] = extra["helper_forwards"]
    return filled, counts


class ParentScorer:
    """NLL (nats per token) of a continuation under the AR parent, a native causal ``LoadedModel``."""

    def __init__(self, parent) -> None:
        self.parent = parent
        self.vocab = int(parent.model.cfg.vocab_size)

    def nll(self, prompt: list[int], answer: list[int]) -> float | None:
        if not answer:
            return None
        if max(answer) >= self.vocab or max(prompt) >= self.vocab:
            raise InvalidParameterError(f"the parent {self.parent.name!r} has {self.vocab} tokens: it cannot "
                                        f"score this model's output (different vocabularies)")
        model = self.parent.model
        ids = torch.tensor([list(prompt) + list(answer)], dtype=torch.long)
        with torch.inference_mode():
            logits = model.forward(ids, model.new_cache(max_len=ids.shape[1]))[0]
        pred = logits[len(prompt) - 1 : -1].float()
        return float(F.cross_entropy(pred, ids[0, len(prompt) :], reduction="mean"))


def parent_greedy(parent, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """The AR parent's own greedy continuation of ``prompt`` (``n`` tokens, cut at EOS): the
    reference point of the NLL column (one full forward per token; short answers only)."""
    model = parent.model
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            x = torch.tensor([ids], dtype=torch.long)
            ids.append(int(model.forward(x, model.new_cache(max_len=x.shape[1]))[0, -1].argmax()))
    return until_eos(ids[len(prompt) :], eos)


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


@dataclass
class DiffusionBenchConfig:
    model: str
    out: Path
    parent: str | None = None  # an AR model of the same vocabulary: NLL of outputs, and apd's helper
    methods: list[str] | None = None  # None: all
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS
    prompts: int = 3
    prompt_tokens: int = 48
    max_new_tokens: int = 32
    block_size: int = 16
    infill: int = 4
    infill_methods: list[str] | None = None  # labels; None: every entry
    context_tokens: int = 48
    plots: bool = True
    progress: bool = True
    weights: str = "fp32"  # the diffusion model's weight format (loaded.WEIGHTS)

    def check(self) -> None:
        for name in ("prompts", "prompt_tokens", "max_new_tokens", "block_size", "context_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.infill, bool) or not isinstance(self.infill, int) or self.infill < 0:
            raise InvalidParameterError(f"infill must be an integer >= 0, got {self.infill!r}")


def parent_of(model: DiffusionModel) -> str | None:
    """The AR parent named in a ``train-dllm`` checkpoint's train_state.json, if any."""
    path = getattr(model, "path", None)
    state = Path(path) / "train_state.json" if path else None
    if state is not None and state.is_file():
        return json.loads(state.read_text()).get("parent")
    return None


def run_diffusion_bench(cfg: DiffusionBenchConfig, say: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark and write its files; returns the summary (also summary.json)."""
    from ..models.loader import load as load_causal

    cfg.check()
    say = say or (lambda s: None)
    model = load(cfg.model, weights=cfg.weights)
    parent_name = cfg.parent or parent_of(model)
    entries = default_entries(tuple(cfg.thresholds), cfg.methods, helper=parent_name)
    if cfg.infill_methods is not None:
        labels = {e.label for e in entries}
        bad = [m for m in cfg.infill_methods if m not in labels]
        if bad:
            raise InvalidParameterError(f"infill methods {bad} are not rows of this benchmark: {sorted(labels)}")
    scorer = None
    if parent_name is not None:
        parent = load_causal(parent_name, dtype="fp32", weights="fp32", device="cpu", backend="native")
        scorer = ParentScorer(parent)
    records = humaneval_records()
    tok = model.tokenizer
    prompts = completion_prompts(tok, records, cfg.prompts, cfg.prompt_tokens)
    tasks = infill_tasks(tok, records, cfg.infill, cfg.context_tokens, skip=cfg.prompts) if cfg.infill else []
    eos = set(model.eos_token_ids)
    rows: list[dict] = []
    reference: dict[str, list[int]] = {}
    t_start = time.perf_counter()
    for e in entries:
        for p in prompts:
            filled, counts = decode_canvas(model, e, p.ids, cfg.max_new_tokens, cfg.block_size)
            if e.method == "stepwise":
                reference[p.key] = filled
            ref = reference[p.key]
            answer = until_eos(filled, eos)
            rows.append({"kind": "completion", "label": e.label, "method": e.method, "options": e.options,
                         "prompt": p.key, "tokens": filled, **counts,
                         "exact": filled == ref,
                         "agree": sum(a == b for a, b in zip(filled, ref)) / len(ref),
                         "answer_tokens": len(answer),
                         "nll": scorer.nll(p.ids, answer) if scorer is not None else None})
            say(f"{e.label:24s} {p.key:14s} forwards {counts['forwards']:3d} {counts['wall_s']:.2f}s "
                f"{'= stepwise' if filled == ref else 'differs'}  ({time.perf_counter() - t_start:.0f}s)")
        if tasks and (cfg.infill_methods is None or e.label in cfg.infill_methods):
            for t in tasks:
                filled, counts = decode_canvas(model, e, t.prefix, len(t.middle), cfg.block_size, t.suffix)
                rows.append({"kind": "infill", "label": e.label, "method": e.method, "options": e.options,
                             "prompt": t.key, "tokens": filled, "target": t.middle, **counts,
                             "exact": filled == t.middle,
                             "agree": sum(a == b for a, b in zip(filled, t.middle)) / len(t.middle)})
                say(f"{e.label:24s} infill {t.key:14s} {'exact' if filled == t.middle else 'wrong'} "
                    f"({time.perf_counter() - t_start:.0f}s)")
    summary = summarize(rows, [e.label for e in entries], cfg.max_new_tokens)
    if scorer is not None:
        greedy = [scorer.nll(p.ids, parent_greedy(scorer.parent, p.ids, cfg.max_new_tokens, eos)) for p in prompts]
        summary["parent_greedy_nll"] = _mean(greedy)
    summary["config"] = {"model": cfg.model, "weights": cfg.weights, "parent": parent_name, "prompts": len(prompts),
                         "prompt_tokens": cfg.prompt_tokens, "max_new_tokens": cfg.max_new_tokens,
                         "block_size": cfg.block_size, "infill_tasks": len(tasks),
                         "context_tokens": cfg.context_tokens, "threads": torch.get_num_threads(),
                         "device": str(model.device), "seconds": round(time.perf_counter() - t_start, 1)}
    out = Path(cfg.out)
    atomic_write(out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    files = {"results": str(out / "results.jsonl"), "report": str(out / "report.md"),
             "summary": str(out / "summary.json")}
    if cfg.plots:
        files["plot"] = str(plot(summary, out / "quality_vs_speed.png"))
    summary["files"] = files
    atomic_write(out / "report.md", markdown(summary))
    atomic_write(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(rows: list[dict], labels: list[str], max_new_tokens: int) -> dict:
    """Per label: means over prompts (completion) and over infilling tasks."""
    table = []
    ref_tps = None
    for label in labels:
        comp = [r for r in rows if r["label"] == label and r["kind"] == "completion"]
        inf = [r for r in rows if r["label"] == label and r["kind"] == "infill"]
        if not comp:
            continue
        positions = max_new_tokens * len(comp)
        wall = sum(r["wall_s"] for r in comp)
        tps = positions / wall if wall > 0 else None
        if label == "stepwise":
            ref_tps = tps
        table.append({
            "label": label, "method": comp[0]["method"], "options": comp[0]["options"],
            "forwards_per_token": sum(r["forwards"] for r in comp) / positions,
            "rows_per_token": sum(r["rows"] for r in comp) / positions,
            "tokens_per_s": tps,
            "speedup": (tps / ref_tps) if tps and ref_tps else None,
            "exact_match": sum(r["exact"] for r in comp) / len(comp),
            "agreement": _mean([r["agree"] for r in comp]),
            "nll": _mean([r["nll"] for r in comp]),
            "infill_exact": (sum(r["exact"] for r in inf) / len(inf)) if inf else None,
            "infill_agreement": _mean([r["agree"] for r in inf]) if inf else None,
        })
    return {"rows": table}


def _f(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def print_summary(summary: dict, as_json: bool, indent: int = 1) -> None:
    """A run's summary on standard output: its JSON, or the Markdown table and the files written."""
    if as_json:
        print(json.dumps(summary, indent=indent))
        return
    print(markdown(summary))
    for k, v in summary["files"].items():
        print(f"{k}: {v}")


def markdown(summary: dict) -> str:
    c = summary.get("config", {})
    head = (f"Model `{c.get('model')}`, AR parent `{c.get('parent')}`; {c.get('prompts')} HumanEval prompts "
            f"(last {c.get('prompt_tokens')} tokens) x {c.get('max_new_tokens')} positions, block "
            f"{c.get('block_size')}; {c.get('infill_tasks')} single-line infilling tasks; "
            f"{c.get('threads')} thread(s), {c.get('device')}; {c.get('seconds')} s."
            + (f" The parent's own greedy continuations score {summary['parent_greedy_nll']:.3f} nats/token "
               f"under it (the NLL column's reference point)." if summary.get("parent_greedy_nll") is not None
               else "") + "\n\n")
    lines = ["| decoder | forwards/token | rows/token | tokens/s | speedup | = stepwise | agreement | "
             "NLL (parent) | infill exact | infill agreement |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(f"| `{r['label']}` | {r['forwards_per_token']:.3f} | {r['rows_per_token']:.3f} | "
                     f"{_f(r['tokens_per_s'], '.1f')} | {_f(r['speedup'], '.2f')}x | {r['exact_match']:.0%} | "
                     f"{_f(r['agreement'], '.0%')} | {_f(r['nll'], '.3f')} | {_f(r['infill_exact'], '.0%')} | "
                     f"{_f(r['infill_agreement'], '.0%')} |")
    return head + "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> Path:
    """Quality against speed: forwards per generated token (x, lower is faster) against exact match
    with stepwise and against the parent's NLL of the output (two panels)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingExtraError("the plot needs matplotlib: pip install 'leapdecode[bench]' (or pass --no-plots)") \
            from None
    rows = summary["rows"]
    has_nll = any(r["nll"] is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if has_nll else 1, figsize=(12 if has_nll else 6.5, 4.8), squeeze=False)
    panels = [("exact_match", "exact match with stepwise")] + ([("nll", "NLL under the AR parent (nats/token)")]
                                                                if has_nll else [])
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cmap = plt.get_cmap("tab20")
    markers = "osD^v<>pPhX*"
    for ax, (key, ylabel) in zip(axes[0], panels):
        for k, m in enumerate(methods):  # one colour and marker per method; its thresholds joined by a line
            pts = sorted((r["options"].get("threshold", 0.0), r["forwards_per_token"], r[key])
                         for r in rows if r["method"] == m and r[key] is not None)
            if not pts:
                continue
            xs, ys = [p[1] for p in pts], [p[2] for p in pts]
            ax.plot(xs, ys, marker=markers[k % len(markers)], color=cmap(k % 20), linewidth=0.8, markersize=6,
                    alpha=0.85, label=m)
            for t, x, y in pts:
                if t:
                    ax.annotate(f"{t:g}", (x, y), fontsize=6, xytext=(3, -8), textcoords="offset points",
                                color=cmap(k % 20))
        if key == "nll" and summary.get("parent_greedy_nll") is not None:
            ax.axhline(summary["parent_greedy_nll"], color="grey", linestyle="--", linewidth=1,
                       label="the parent's own greedy output")
        ax.legend(fontsize=7, ncol=2)
        ax.set_xlabel("forwards per generated token (lower is faster)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    c = summary.get("config", {})
    fig.suptitle(f"diffusion decoders on {Path(str(c.get('model', ''))).name}: quality vs speed", fontsize=10)
    fig.tight_layout()

    try:
        with atomic_output(Path(path)) as tmp:
            fig.savefig(str(tmp), dpi=110, format="png")
        return Path(path)
    finally:
        plt.close(fig)
