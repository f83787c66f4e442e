"""Outputs of a bench run: results.jsonl, summary.json, report.md, PNG plots, the rich table.

Every file is written to a temporary name in the output directory and renamed into place,
so an interrupted run never leaves a half-written file behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from .stats import UNSTEADY
from .workloads import GROUP_LABELS
from ..models.store import atomic_output

SYSTEM_COLORS = {"leapdecode": "#1f77b4", "hf": "#ff7f0e", "llama.cpp": "#2ca02c"}


# --------------------------------------------------------------------------- atomic files
def _atomic(path: Path, write: Callable[[Path], None]) -> Path:
    with atomic_output(Path(path)) as tmp:
        write(tmp)
    return Path(path)


def write_text(path: Path, text: str) -> Path:
    return _atomic(path, lambda t: t.write_text(text, encoding="utf-8"))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return write_text(path, body)


def write_json(path: Path, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- formatting
def fmt_x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def fmt_f(v: float | None, nd: int = 2) -> str:
    return "—" if v is None else f"{v:.{nd}f}"


def fmt_pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}%"


def group_label(g: str) -> str:
    return GROUP_LABELS.get(g, g)


def table_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows shared by the markdown report and the terminal table."""
    groups = summary["groups"]
    greedy = summary.get("temperature", 0.0) <= 0
    header = ["method", "system", *[group_label(g) for g in groups], "mean accepted", "speedup", "tokens/s"]
    if greedy:
        header.append("identical")
    header.append("peak RSS (MB)")
    rows = []
    for r in summary["rows"]:
        row = [r["name"], r["system"], *[fmt_x(r["speedup_by_group"].get(g)) for g in groups],
               fmt_f(r["mean_accepted"]), fmt_x(r["speedup"]), fmt_f(r["tokens_per_s"], 1)]
        if greedy:
            ident = fmt_pct(r["identical_pct"])
            if r.get("first_divergences"):
                ident += f" (first diff at {', '.join(str(d) for d in r['first_divergences'][:3])}"
                ident += ", ...)" if len(r["first_divergences"]) > 3 else ")"
            row.append(ident)
        row.append(fmt_f(r.get("peak_rss_mb"), 0))
        rows.append(row)
    return header, rows


def unsteady_note(rows: list[dict]) -> str | None:
    """The report's line naming each row's unsteady prompts (``stats.UNSTEADY``), or None."""
    unsteady = [f"{r['name']}: {', '.join(r['unsteady'])}" for r in rows if r.get("unsteady")]
    if not unsteady:
        return None
    return (f"**Unsteady prompts** (their repeats differ by more than {UNSTEADY:g}x in tokens/s: the machine was "
            "busy, or a one-off cost was timed; read their rows with care): " + "; ".join(unsteady))


def markdown(summary: dict) -> str:
    s = summary
    header, rows = table_rows(s)
    lines = [
        f"# leapdecode bench: {s['model']}",
        "",
        f"- model: `{s['model']}` ({s['backend']} backend, weights {s.get('weights', s['dtype'])}, "
        f"attention {s.get('attention', '—')}, {s['device']}); draft: `{s.get('draft') or '—'}`",
        f"- workload: `{s['workload']}`: {s['questions']} questions, {s['prompts']} prompts "
        f"(question x turn), categories: {', '.join(s['categories'])}",
        f"- decoding: {'greedy' if s['temperature'] <= 0 else 'sampling, temperature ' + str(s['temperature'])}, "
        f"batch 1, max {s['max_new_tokens']} new tokens, {s['repeats']} repeat(s) per prompt (medians), "
        "runners interleaved per prompt after one warm-up generation each",
        f"- machine: {s.get('machine', '')}",
        f"- date: {s.get('date', '')}, total bench time {s.get('elapsed_s', 0):.0f} s",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    note = unsteady_note(s["rows"])
    if note:
        lines += ["", note]
    lines += [
        "",
        "Speedup (Spec-Bench): mean over prompts of new tokens / wall time, divided by the same "
        "mean for leapdecode's `vanilla` decoding of the same model, dtype and device (per task "
        "group: over that group's prompts; MT-bench pools its 8 categories). Mean accepted: tokens "
        "decided per target forward pass, an end-of-sequence token included (1.00 for vanilla; — where "
        "the system does not expose it).",
    ]
    if s["temperature"] <= 0:
        lines.append(
            "Identical: share of prompts whose tokens equal vanilla's exactly; first diff: token "
            "index of the first difference. llama.cpp rounds differently (its own kernels and "
            "activation blocks), so it is not expected to match token for token.")
        if not s.get("batch_invariant", True):
            lines.append(
                f"**Greedy identity is not guaranteed in this configuration** (weights "
                f"{s.get('weights')}, attention {s.get('attention')}: not batch-invariant, so a "
                "tree forward can round a logit differently from a one-token forward).")
    lines.append(
        "Peak RSS: the largest resident set size of the bench process sampled every 5 ms during a "
        "runner's generations (every loaded model counts, so it grows with each system loaded), "
        "not the increment of one run.")
    if s.get("structured"):
        lines += ["", *structured_lines(s["structured"])]
    if s.get("skipped"):
        lines += ["", "Skipped:", *[f"- {m}" for m in s["skipped"]]]
    if s.get("plots"):
        lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in s["plots"]]]
    return "\n".join(lines) + "\n"


def _share(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def structured_lines(g: dict) -> list[str]:
    """The structured-output section: schema support, compile time, validity, grammar time."""
    lines = [
        "## Structured output",
        "",
        f"- grammar engine: llguidance; schemas supported: {g['supported']} of {g['schemas']} "
        f"({fmt_pct(100 * g['supported'] / g['schemas'] if g['schemas'] else None)}); compile time p50 "
        f"{fmt_f(g['compile_ms_p50'])} ms, p95 {fmt_f(g['compile_ms_p95'])} ms",
        "",
        "| runner | outputs | ended (EOS) | valid of ended | cut by the token limit | grammar us/token "
        "| grammar share of wall |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in g["rows"]:
        checked = r["ended"] - r.get("unchecked", 0)
        lines.append(f"| {r['runner']} | {r['outputs']} | {r['ended']} | {r['valid']}/{checked} "
                     f"| {r['cut_by_limit']} | {fmt_f(r['grammar_us_per_token'], 1)} "
                     f"| {_share(r['grammar_share_of_wall'])} |")
    lines += ["", "Valid: the output parses as JSON and validates against its schema (`jsonschema`); an "
              "output cut by the token limit is incomplete and not counted, nor is one whose schema uses a "
              "regex dialect Python's `re` cannot check. Grammar time: masks, draft "
              "pruning, forced drafts and state moves (leapdecode), or the logits processor (hf)."]
    return lines


def print_table(summary: dict, console) -> None:
    from rich.table import Table

    header, rows = table_rows(summary)
    t = Table(title=f"leapdecode bench: {summary['model']} ({summary['prompts']} prompts, "
                    f"max {summary['max_new_tokens']} new tokens)")
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i < 2 else "right")
    for r in rows:
        t.add_row(*r)
    console.print(t)
    g = summary.get("structured")
    if g:
        console.print(f"structured output: {g['supported']}/{g['schemas']} schemas supported, compile p50 "
                      f"{fmt_f(g['compile_ms_p50'])} ms", markup=False, highlight=False)
        for r in g["rows"]:
            console.print(f"  {r['runner']}: valid {r['valid']}/{r['ended']} ended, {r['cut_by_limit']} cut by the "
                          f"limit, grammar {fmt_f(r['grammar_us_per_token'], 1)} us/token "
                          f"({_share(r['grammar_share_of_wall'])} of wall)", markup=False, highlight=False)


# --------------------------------------------------------------------------- plots
def _save(fig, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    return _atomic(path, lambda t: fig.savefig(str(t), format="png", dpi=120, bbox_inches="tight"))


def plots(summary: dict, out: Path) -> list[Path]:
    """speedup_by_category.png and tokens_per_s.png; [] when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return []
    files = []
    rows = [r for r in summary["rows"] if r["name"] != summary["reference"]]
    cats = summary["categories"]

    # speedup per category: grouped bars, one bar per method / peer
    fig = Figure(figsize=(max(6.0, 0.9 * len(cats) * max(1, len(rows)) ** 0.5 + 2), 4.2))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(cats))]
        ys = [r["speedup_by_category"].get(c) or 0.0 for c in cats]
        ax.bar(xs, ys, width, label=r["name"])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="vanilla")
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=35, ha="right")
    ax.set_ylabel("speedup over vanilla")
    ax.set_title(f"{summary['model']}: speedup by category")
    ax.legend(fontsize=8)
    files.append(_save(fig, out / "speedup_by_category.png"))

    # tokens/s of every row, coloured by system
    allrows = summary["rows"]
    fig = Figure(figsize=(6.4, 0.45 * len(allrows) + 1.4))
    ax = fig.add_subplot()
    names = [r["name"] for r in allrows][::-1]
    vals = [r["tokens_per_s"] or 0.0 for r in allrows][::-1]
    colors = [SYSTEM_COLORS.get(r["system"], "#7f7f7f") for r in allrows][::-1]
    ax.barh(names, vals, color=colors)
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.1f}", va="center", fontsize=8)
    ax.set_xlabel("tokens/s (mean over prompts)")
    ax.set_title(f"{summary['model']}: leapdecode vs peers")
    handles = {r["system"] for r in allrows}
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=SYSTEM_COLORS.get(s, "#7f7f7f"), label=s) for s in sorted(handles)],
              fontsize=8, loc="lower right")
    files.append(_save(fig, out / "tokens_per_s.png"))
    return files
