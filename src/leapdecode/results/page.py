"""``leapdecode results``: docs/results.md generated from committed bench summaries.

The page says what holds *now*: one section per machine (its processor, instruction sets, cores),
and under it the latest bench run of each workload on it: date, commit, the exact command, the
configuration (weights, attention, whether it is batch-invariant), and one row per runner
(leapdecode's vanilla and methods, HF ``generate``, llama.cpp plain and speculative) with tokens/s,
speedup over leapdecode's vanilla, mean accepted tokens per decoding forward and greedy identity
with vanilla; a plot per run.  Hand-written sections of scripts that are not bench runs (the GPU
check, the draft head's accuracy) are Markdown files beside the summaries, appended in name order.
Under each machine, a table holds its latest runs against the speedup targets, with the measured
ceiling of each where ``leapdecode bench --ceiling --save`` reports are in ``docs/results/ceilings/``.

The summaries are ``summary.json`` files of ``leapdecode bench``, kept in ``docs/results/``
(``leapdecode results --add bench_out/RUN/summary.json`` copies one in).  The README's headline
block (between ``<!-- results:headline -->`` and ``<!-- /results:headline -->``) is rewritten from
the same summaries; ``--check`` fails when the page or the block is not what the summaries give
(tests/test_results_page.py runs it on the committed files).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ..errors import InvalidParameterError
from ..models.store import atomic_write, check_output
from .scale import scale_section
from ..bench.workloads import DEFAULT_WORKLOAD_REL

RESULTS_DIR = Path("docs") / "results"
PAGE = Path("docs") / "results.md"
README = Path("README.md")
HEADLINE_START, HEADLINE_END = "<!-- results:headline -->", "<!-- /results:headline -->"
PEER_ORDER = ("hf", "hf-assisted", "hf-pld", "llamacpp", "llamacpp-pld", "llama-server", "llama-server-draft",
              "llama-server-ngram", "llama-server-ngram-simple")
DROPPED_KEYS = ("files", "plots")  # paths of the run's own output directory: not part of a result
DEFAULT_WORKLOAD_NAME = DEFAULT_WORKLOAD_REL.stem  # the Spec-Bench dev set: the headline's first line, the targets' runs


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "results", help="generate docs/results.md from the bench summaries in docs/results/",
        description="Generate the results page (docs/results.md) and the README's headline from committed "
                    "`leapdecode bench` summaries: per machine, the latest run of each workload, with the "
                    "command, commit, configuration and every runner's tokens/s, speedup, mean accepted and "
                    "identity with vanilla. Hand-written Markdown sections in the results directory are "
                    "appended in name order.")
    p.add_argument("--add", type=Path, action="append", metavar="SUMMARY",
                   help="copy a bench run's summary.json into the results directory first (repeatable)")
    p.add_argument("--dir", type=Path, default=RESULTS_DIR, help="the results directory (default: %(default)s)")
    p.add_argument("--out", type=Path, default=PAGE, help="the page to write (default: %(default)s)")
    p.add_argument("--readme", default=str(README),
                   help="README whose headline block is rewritten (default: %(default)s; '' for none)")
    p.add_argument("--no-plots", action="store_true",
                   help="do not draw the plots (docs/img/results-*.png); the page links those already drawn")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when the page or the README's headline differs from what the "
                        "summaries give")
    p.set_defaults(func=cmd_results)
    return p


# --------------------------------------------------------------------------- reading
def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def processor(summary: dict) -> str:
    """The machine's processor name (the part of ``machine`` before the core count)."""
    return str(summary.get("machine", "unknown machine")).split(",")[0].strip()


def isa_tier(flags: list[str]) -> str:
    """The kernels' instruction-set class of a CPU with these ``kernel_library.ISA_FLAGS``."""
    have = set(flags)
    for flag, tier in (("amx_int8", "AMX"), ("avx512_vnni", "AVX512-VNNI"), ("avx512f", "AVX512"), ("avx2", "AVX2")):
        if flag in have:
            return tier
    return "no AVX2"


def cpu_of(summary: dict) -> str:
    """The machine a result belongs to: its processor and, where it recorded its instruction sets, their
    class ("AMD EPYC (AVX2)"): one model name covers machines whose kernels differ (the AVX2-only EPYC VM
    and the Zen 4 EPYC with AVX512-VNNI both say "AMD EPYC")."""
    flags = summary.get("cpu_flags")
    return processor(summary) if flags is None else f"{processor(summary)} ({isa_tier(flags)})"


def for_machine(reports: dict, cpu: str, name: str, *rest: str):
    """The report of machine ``cpu`` (processor ``name``) keyed ``(cpu, *rest)``; a report that recorded no
    instruction sets is keyed by the processor's name alone."""
    return reports.get((cpu, *rest), reports.get((name, *rest)))


def workload_name(summary: dict) -> str:
    w = str(summary.get("workload") or "")
    return Path(w).stem if ("/" in w or w.endswith(".jsonl")) else (w.split(" (")[0] or "workload")


def _check_summary(s, where: str) -> None:
    if not isinstance(s, dict) or not isinstance(s.get("rows"), list) or "machine" not in s:
        raise InvalidParameterError(f"{where}: not a bench summary (no rows or machine)")


def read_summaries(directory: Path) -> list[dict]:
    """Every ``*.json`` bench summary in ``directory``; a file that is not one is named."""
    out = []
    for path in sorted(directory.glob("*.json")):
        try:
            s = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InvalidParameterError(f"{path}: not a bench summary ({e})") from None
        _check_summary(s, str(path))
        out.append(s)
    return out


def add_summary(source: Path, directory: Path) -> Path:
    """Copy a bench summary into ``directory`` as ``DATE-CPU-WORKLOAD.json``, without the run's
    output paths."""
    try:
        s = json.loads(Path(source).read_text())
    except (OSError, ValueError) as e:
        raise InvalidParameterError(f"--add {source}: cannot read a bench summary ({e})") from None
    _check_summary(s, f"--add {source}")
    for k in DROPPED_KEYS:
        s.pop(k, None)
    name = f"{str(s.get('date', ''))[:10]}-{slug(cpu_of(s))}-{slug(workload_name(s))}.json"
    target = directory / name
    atomic_write(target, json.dumps(s, indent=1, ensure_ascii=False) + "\n")
    return target


def latest_runs(summaries: list[dict]) -> dict[str, list[dict]]:
    """Processor -> its latest summary per workload (newest first)."""
    by: dict[tuple[str, str], dict] = {}
    for s in summaries:
        key = (cpu_of(s), workload_name(s))
        if key not in by or str(s.get("date")) > str(by[key].get("date")):
            by[key] = s
    out: dict[str, list[dict]] = {}
    for (cpu, _), s in sorted(by.items()):
        out.setdefault(cpu, []).append(s)
    for runs in out.values():
        runs.sort(key=lambda s: str(s.get("date")), reverse=True)
    return out


def ordered_rows(summary: dict) -> list[dict]:
    """vanilla, auto, the other methods by speedup, then the peers in ``PEER_ORDER``."""
    rows = summary["rows"]
    ours = [r for r in rows if r.get("system") == "leapdecode"]
    peers = [r for r in rows if r.get("system") != "leapdecode"]
    head = [r for name in ("vanilla", "auto") for r in ours if r["name"] == name]
    rest = sorted((r for r in ours if r not in head), key=lambda r: -(r.get("speedup") or 0))
    rank = {n: i for i, n in enumerate(PEER_ORDER)}
    return head + rest + sorted(peers, key=lambda r: rank.get(r["name"], len(rank)))


# --------------------------------------------------------------------------- rendering
def _num(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _row_label(r: dict) -> str:
    return f"`{r['name']}`"


def run_section(s: dict, plot: str | None) -> str:
    rows = ordered_rows(s)
    lines = [f"### {workload_name(s)}: {s.get('prompts')} prompts x {s.get('max_new_tokens')} new tokens",
             "",
             f"- measured {s.get('date')} on {s.get('machine')}" + (f", commit `{s['commit']}`" if s.get("commit") else ""),
             f"- model `{s.get('model')}`, weights {s.get('weights')}, attention {s.get('attention')}, "
             + ("batch-invariant (greedy speculation is exact by construction)" if s.get("batch_invariant")
                else "**not batch-invariant** (speculative output is not guaranteed identical to vanilla's)"),
             f"- greedy, {s.get('repeats')} run(s) per prompt (medians); draft model: {s.get('draft') or 'none'}"]
    described = str(s.get("workload") or "")
    if described and "/" not in described and described != workload_name(s):  # a named workload's description
        lines.append(f"- workload: {described}")
    if s.get("command"):
        lines.append(f"- command: `{s['command']}`")
    lines += ["", "| runner | system | tokens/s | vs vanilla | by task group | mean accepted | identical to vanilla |",
              "|---|---|---:|---:|---|---:|---:|"]
    for r in rows:
        ident = "" if r.get("identical_pct") is None else f"{r['identical_pct']:.0f}% ({r.get('identical')}/{r.get('compared')})"
        groups = ", ".join(f"{g} {_num(v, '.2f')}x" for g, v in (r.get("speedup_by_group") or {}).items())
        lines.append(f"| {_row_label(r)} | {r.get('system')} | {_num(r.get('tokens_per_s'), '.1f')} | "
                     f"{_num(r.get('speedup'), '.2f')}x | {groups} | {_num(r.get('mean_accepted'), '.2f')} | {ident} |")
    unsteady = [f"`{r['name']}` {len(r['unsteady'])}" for r in rows if r.get("unsteady")]
    if unsteady:
        lines += ["", "Prompts whose repeats were more than 1.5x apart (a busy machine, or a runner that learns "
                      f"across requests): {', '.join(unsteady)}."]
    skipped = [n for n in s.get("skipped") or [] if n.startswith("skipping")]
    if skipped:
        lines += ["", "Runners that could not run: " + "; ".join(n.removeprefix("skipping ") for n in skipped) + "."]
    if plot:
        lines += ["", f"![tokens/s of each runner]({plot})"]
    return "\n".join(lines)


def plot_name(s: dict) -> str:
    return f"results-{slug(cpu_of(s))}-{slug(workload_name(s))}.png"


HEADS_DIR = "heads"  # docs/results/heads/: `leapdecode heads accuracy --save` reports
DEV_SET, HUMANEVAL_SET = "spec-bench dev", "humaneval held-apart"  # (training.accuracy's set names)


CEILINGS_DIR = "ceilings"  # docs/results/ceilings/: `leapdecode bench --ceiling --save` reports


def _read_reports(directory: Path, kind: str, field: str, made_by: str) -> list[dict]:
    """Every report of ``kind`` (``*.json`` with a dict ``field``) in ``directory`` (none: [])."""
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InvalidParameterError(f"{path}: not a {kind} report ({e})") from None
        if not isinstance(r, dict) or r.get("report") != kind or not isinstance(r.get(field), dict):
            raise InvalidParameterError(f"{path}: not a {kind} report ({made_by})")
        out.append(r)
    return out


def read_head_reports(directory: Path) -> list[dict]:
    """Every ``leapdecode heads accuracy`` report (``*.json``) in ``directory`` (none: [])."""
    return _read_reports(directory, "head-accuracy", "sets", "leapdecode heads accuracy --save")


SCALE_DIR = "scale"  # docs/results/scale/: `scripts/scale_bench.py --save` reports


def read_scale_reports(directory: Path) -> list[dict]:
    """Every ``scripts/scale_bench.py --save`` report (``*.json``) in ``directory`` (none: [])."""
    return _read_reports(directory, "scale", "shapes", "scripts/scale_bench.py --save")


def latest_scale_reports(reports: list[dict]) -> dict[str, dict]:
    """Machine -> its latest scale report."""
    return _latest(reports, cpu_of)


def _latest(reports: list[dict], key) -> dict:
    """``key(report)`` -> the latest (by date) of the reports with that key."""
    latest: dict = {}
    for r in reports:
        k = key(r)
        if k not in latest or str(r.get("date")) > str(latest[k].get("date")):
            latest[k] = r
    return latest


ROW_COST_DIR = "row_cost"  # docs/results/row_cost/: `scripts/row_cost.py --save` reports


def read_row_cost_reports(directory: Path) -> list[dict]:
    """Every ``scripts/row_cost.py --save`` report (``*.json``) in ``directory`` (none: [])."""
    return _read_reports(directory, "row-cost", "variants", "scripts/row_cost.py --save")


# what each peak of `scripts/isa_peak.cpp` measures, by its key in a row-cost report's "peaks"
PEAK_NAMES = {"vnni512": "vpdpbusd zmm", "vnni256": "vpdpbusd ymm (AVX-VNNI)", "avx2": "vpmaddubsw + vpaddw ymm",
              "amx": "AMX tdpbsud", "read": "streaming read", "copy": "memcpy (read + written)"}


def row_cost_section(reports: list[dict]) -> list[str]:
    """Per machine (its latest report), what a forward of n verified rows costs on each kernel variant it
    runs, in ms and relative to one row; where the report measured them, the int8 multiply-adds a second
    of its products against the peak of the instruction each variant uses, and one row's weight bytes a
    second against the memory bandwidth."""
    latest = _latest(reports, cpu_of)
    if not latest:
        return []
    lines = ["## Verified rows per instruction set", "",
             "The engine's own verification profile (a forward of n tree nodes after a prompt, `measure_verify_cost`) on "
             "each variant of the kernel a wheel ships that the machine runs, and on the first-use `-march=native` "
             "build; every variant gives the same bits.", ""]
    for cpu, r in sorted(latest.items()):
        sizes = sorted({int(n) for v in r["variants"].values() for n in v})
        lines += [f"### {cpu} ({r.get('date')}, {r.get('model')}, {r.get('context')} tokens of context)", "",
                  f"    {r.get('command')}", "",
                  "| kernel | " + " | ".join(f"{n} row{'s' if n > 1 else ''}" for n in sizes) + " |",
                  "|---|" + "---:|" * len(sizes)]
        for name, ms in r["variants"].items():
            one = ms.get(str(sizes[0]))
            cells = [f"{ms[str(n)]:.1f} ms" + (f" ({ms[str(n)] / one:.2f}x)" if one and n != sizes[0] else "")
                     if str(n) in ms else "-" for n in sizes]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += _peak_lines(r, sizes)
    return lines


def _peak_lines(r: dict, sizes: list[int]) -> list[str]:
    """A row-cost report's products against its measured peaks (none measured: no lines)."""
    peaks, macs, nbytes = r.get("peaks") or {}, r.get("macs_per_row"), r.get("weight_bytes")
    if not peaks or not macs:
        return []
    threads = peaks.get("threads")
    lines = [f"Peaks measured on the same machine ({threads} threads, `scripts/isa_peak.cpp`: independent chains of one "
             "instruction, so its throughput; multiply-adds of an int8 activation and a code byte a second): "
             + ", ".join(f"{PEAK_NAMES.get(k, k)} {v / 1e9:,.0f} G{'B' if k in ('read', 'copy') else ''}/s"
                         for k, v in peaks.items() if k != "threads" and v and v > 0) + ".", "",
             f"A verified row is {macs / 1e9:.2f} G multiply-adds of the linear layers and reads {nbytes / 1e9:.2f} GB of "
             "packed weights; the products' rate at n rows is n x that over the forward's time (attention and the "
             "rest included, so a lower bound):", "",
             "| kernel | instruction | " + " | ".join(f"{n} rows" for n in sizes if n >= 8) + " | 1 row: weights read |",
             "|---|---|" + "---:|" * (len([n for n in sizes if n >= 8]) + 1)]
    for name, ms in r["variants"].items():
        key = (r.get("isa") or {}).get(name)
        peak = peaks.get(key) if key else None
        cells = []
        for n in sizes:
            if n < 8:
                continue
            rate = n * macs / (ms[str(n)] / 1000) if str(n) in ms else None
            cells.append("-" if rate is None else f"{rate / 1e9:,.0f} G/s" + (f" ({100 * rate / peak:.0f}%)" if peak else ""))
        one = ms.get(str(sizes[0])) if sizes[0] == 1 else None
        rate = nbytes / (one / 1000) if one and nbytes else None
        shares = [f"{100 * rate / peaks[k]:.0f}% of {PEAK_NAMES[k]}" for k in ("read", "copy") if rate and peaks.get(k)]
        cells.append("-" if rate is None else f"{rate / 1e9:.1f} GB/s" + (f" ({', '.join(shares)})" if shares else ""))
        lines.append(f"| {name} | {PEAK_NAMES.get(key, '-') if key else '-'} | " + " | ".join(cells) + " |")
    return lines + [""]


def read_ceiling_reports(directory: Path) -> list[dict]:
    """Every ``leapdecode bench --ceiling --save`` report (``*.json``) in ``directory`` (none: [])."""
    return _read_reports(directory, "draft-ceiling", "ceilings", "leapdecode bench --ceiling --save")


def latest_ceilings(reports: list[dict]) -> dict[tuple[str, str, str], dict]:
    """(processor, model, workload name) -> its latest ceiling report."""
    return _latest(reports, lambda r: (cpu_of(r), str(r.get("model")), workload_name(r)))


def head_table(results: dict[str, dict]) -> list[str]:
    """Markdown rows, one per prompt set (Spec-Bench dev together first, HumanEval, then each
    category), a column per head, of ``{head label: {set: {"top1": [...], "tokens", "prompts"}}}``."""
    labels = list(results)
    names: list[str] = []
    for r in results.values():
        names += [n for n in r if n not in names]
    fixed = [n for n in (DEV_SET, HUMANEVAL_SET) if n in names]
    lines = ["| prompts | " + " | ".join(f"`{lab}`: top-1 of drafted tokens 1 / 2 / 3" for lab in labels) + " |",
             "|---|" + "---|" * len(labels)]
    for n in fixed + sorted(n for n in names if n not in fixed):
        cells = []
        for lab in labels:
            r = results[lab].get(n)
            cells.append(" / ".join("-" if x is None else f"{x:.3f}" for x in r["top1"]) if r else "-")
        first = next(results[lab][n] for lab in labels if n in results[lab])
        lines.append(f"| {n} ({first['prompts']} prompts, {first['tokens']} tokens) | " + " | ".join(cells) + " |")
    return lines


def latest_head_reports(reports: list[dict]) -> dict[tuple[str, str], dict]:
    """(processor, model) -> its latest head-accuracy report."""
    return _latest(reports, lambda r: (cpu_of(r), str(r.get("model"))))


def heads_section(reports: list[dict]) -> list[str]:
    """Per machine and model, the latest head-accuracy report: its command and table."""
    latest = latest_head_reports(reports)
    if not latest:
        return []
    parts = ["## Draft heads: teacher-forced accuracy", "",
             "The top-1 of a head's first, second and third drafted token on the target's own greedy text "
             "(what a chain of drafts gets right before a tree or the cost model), per Spec-Bench dev category "
             "and on HumanEval's held-apart problems; `leapdecode train-head` writes the same after every run.", ""]
    for (cpu, model), r in sorted(latest.items()):
        parts += [f"### {model} on {cpu} ({str(r.get('date'))[:10]}, {r.get('tokens_per_prompt')} tokens a prompt)",
                  "", f"    {r.get('command') or ''}", ""] + head_table(r["sets"]) + [""]
    return parts


# The speedup targets the project measures itself against (on a 2-core CPU, greedy, batch 1, 128 new
# tokens), checked on each machine against its latest runs: what holds, and by how much the rest is missed.
GOAL_DEV, GOAL_HUMANEVAL, GOAL_GROUP, GOAL_PEER, GOAL_MEMORY, GOAL_HEAD_TOP1 = 1.6, 2.0, 0.97, 2.0, 1.3, 0.6
HUMANEVAL_WORKLOAD, MEMORY_WORKLOAD = "humaneval-heldout", "similar"
LLAMA_SPECULATIVE = ("llama-server-draft", "llama-server-ngram", "llama-server-ngram-simple", "llamacpp-pld")


def _row(s: dict | None, name: str) -> dict | None:
    return next((r for r in (s or {}).get("rows", []) if r["name"] == name), None)


def _verdict(value: float | None, goal: float, text: str) -> tuple[str, str]:
    if value is None:
        return "not measured", ""
    return text, "yes" if value >= goal else f"no ({value / goal:.0%} of it)"


# ceilings of a speedup target: the draft-ceiling rows shown for it
SPEED_CEILINGS = (("perfect drafter", "any drafter"), ("copy oracle", "copying"))


def _ceiling(report: dict | None, rows=SPEED_CEILINGS, group: str | None = None) -> str:
    """``any drafter 2.10x, copying 1.30x`` from a draft-ceiling report (overall, or one group's)."""
    got = []
    for name, label in rows:
        c = ((report or {}).get("ceilings") or {}).get(name) or {}
        v = c.get("overall") if group is None else (c.get("by_group") or {}).get(group)
        if v is not None:
            got.append(f"{label} {v:.2f}x")
    return ", ".join(got)


def target_rows(runs: list[dict], head_report: dict | None,
                ceilings: dict[str, dict] | None = None) -> list[tuple[str, str, str, str, str]]:
    """(target, goal, now, met, measured ceiling) for one machine's latest runs, head-accuracy report
    and draft-ceiling reports (workload name -> report)."""
    by = {workload_name(s): s for s in runs}
    dev, he, mem = by.get(DEFAULT_WORKLOAD_NAME), by.get(HUMANEVAL_WORKLOAD), by.get(MEMORY_WORKLOAD)
    ceilings = ceilings or {}
    out = []
    dev_auto = _row(dev, "auto")
    for label, auto, goal, name in ((f"`auto` over vanilla, {DEFAULT_WORKLOAD_NAME}", dev_auto, GOAL_DEV,
                                     DEFAULT_WORKLOAD_NAME),
                                    (f"`auto` over vanilla, {HUMANEVAL_WORKLOAD}", _row(he, "auto"), GOAL_HUMANEVAL,
                                     HUMANEVAL_WORKLOAD)):
        v = auto.get("speedup") if auto else None
        out.append((label, f">= {goal:.2f}x", *_verdict(v, goal, f"{v:.2f}x" if v else ""),
                    _ceiling(ceilings.get(name))))
    groups = (dev_auto or {}).get("speedup_by_group") or {}
    worst = min(groups, key=groups.get) if groups else None
    out.append((f"`auto` on its slowest {DEFAULT_WORKLOAD_NAME} group", f">= {GOAL_GROUP:.2f}x",
                *_verdict(groups.get(worst), GOAL_GROUP, f"{worst} {groups[worst]:.2f}x" if worst else ""), ""))
    peers = [r for r in (dev or {}).get("rows", []) if r["name"] in LLAMA_SPECULATIVE]
    best = max(peers, key=lambda r: r.get("tokens_per_s") or 0) if peers else None
    ratio = dev_auto["tokens_per_s"] / best["tokens_per_s"] if dev_auto and best and best.get("tokens_per_s") else None
    out.append(("`auto` over llama.cpp's best speculative configuration (tokens/s, same prompts)",
                f">= {GOAL_PEER:.2f}x", *_verdict(ratio, GOAL_PEER, f"{ratio:.2f}x (`{best['name']}`)" if ratio else ""),
                ""))
    # the memory as a method (``suffix``: earlier requests' outputs and the request's own text) against
    # the request's own automaton alone (``sam``)
    sam, suffix = _row(mem, "sam"), _row(mem, "suffix")
    gain = suffix["speedup"] / sam["speedup"] if suffix and sam and sam.get("speedup") else None
    # its ceiling: what copying from earlier outputs too saves over copying from the request alone
    copy = ((ceilings.get(MEMORY_WORKLOAD) or {}).get("ceilings") or {})
    alone, both = (copy.get("copy oracle") or {}).get("overall"), (copy.get("copy oracle with memory") or {}).get("overall")
    out.append((f"cross-request memory (`suffix`) over `sam`, {MEMORY_WORKLOAD}", f">= {GOAL_MEMORY:.2f}x",
                *_verdict(gain, GOAL_MEMORY, f"{gain:.2f}x" if gain else ""),
                f"copying with memory over copying alone {both / alone:.2f}x" if alone and both else ""))
    dev_set = ((head_report or {}).get("sets") or {}).get("bundled", {}).get(DEV_SET)
    top1 = dev_set["top1"][0] if dev_set else None
    out.append(("the bundled head's top-1, first drafted token, Spec-Bench dev", f">= {GOAL_HEAD_TOP1:.2f}",
                *_verdict(top1, GOAL_HEAD_TOP1, f"{top1:.3f}" if top1 is not None else ""), ""))
    ours = [r for s in runs for r in s["rows"] if r.get("system") == "leapdecode" and r.get("identical_pct") is not None]
    ident = min((r["identical_pct"] for r in ours), default=None)
    out.append(("greedy identity with vanilla, every leapdecode row above", "100%",
                *(("not measured", "") if ident is None else
                  (f"{ident:.0f}%", "yes" if ident >= 100 else "no")), ""))
    return out


def targets_section(runs: list[dict], head_report: dict | None, ceilings: dict[str, dict] | None = None) -> list[str]:
    rows = target_rows(runs, head_report, ceilings)
    lines = ["### Against the speedup targets", "",
             "The targets leapdecode measures itself against on a 2-core CPU (greedy, batch 1, 128 new tokens), "
             "from the runs above" + (" and the head table below" if head_report else "") + "."]
    if ceilings:
        lines += ["", "The ceilings replay vanilla's own outputs against this machine's measured verification costs "
                  "(`leapdecode bench --ceiling`; drafting and host time left out, so they are upper bounds): a "
                  "drafter that always knew the next tokens (*any drafter*), one that copies the longest earlier "
                  "match of the text with perfect lengths (*copying*), and that copy from earlier requests' outputs "
                  "too (*with memory*):", ""]
        lines += [f"    {r.get('command')}" for _, r in sorted(ceilings.items()) if r.get("command")]
    lines += ["", "| target | goal | now | met | measured ceiling |", "|---|---:|---:|---|---|"]
    lines += [f"| {t} | {g} | {n} | {m} | {c} |" for t, g, n, m, c in rows]
    return lines


def render(summaries: list[dict], notes: list[tuple[str, str]], plots: bool,
           head_reports: list[dict] | None = None, ceiling_reports: list[dict] | None = None,
           drawn: frozenset[str] = frozenset(), scale_reports: list[dict] | None = None,
           row_cost_reports: list[dict] | None = None) -> str:
    """The page. A run's plot is linked where ``plots`` (they are being drawn) or where its file name is
    in ``drawn`` (the plots already in the page's ``img/``: see ``cmd_results``)."""
    parts = ["# Results: what holds now",
             "",
             "Generated by `leapdecode results` from the bench summaries in `docs/results/` (do not edit by hand: "
             "run a bench, `leapdecode results --add bench_out/RUN/summary.json`, commit both). One section per "
             "machine, the latest run of each workload on it. Speedups are over leapdecode's own vanilla decoding "
             "in the same run; llama.cpp runs the same GGUF on the same prompt tokens. History lives in "
             "docs/lab-notes/.",
             ""]
    latest_heads = latest_head_reports(head_reports or [])
    latest_ceils = latest_ceilings(ceiling_reports or [])
    for cpu, runs in latest_runs(summaries).items():
        flags = runs[0].get("cpu_flags")
        parts += [f"## {cpu}", ""]
        if flags is not None:
            parts += [f"Instruction sets: {' '.join(flags) or 'none of the SIMD ones the kernels use'}.", ""]
        for s in runs:
            parts += [run_section(s, f"img/{plot_name(s)}" if plots or plot_name(s) in drawn else None), ""]
        model = next((s.get("model") for s in runs if workload_name(s) == DEFAULT_WORKLOAD_NAME), None)
        if model is not None:  # the targets are about the Spec-Bench dev run's model
            name = processor(runs[0])
            head = for_machine(latest_heads, cpu, name, str(model))
            ceilings = {w: r for w in {w for (_, m, w) in latest_ceils if m == str(model)}
                        if (r := for_machine(latest_ceils, cpu, name, str(model), w)) is not None}
            parts += targets_section([s for s in runs if s.get("model") == model], head, ceilings) + [""]
    parts += heads_section(head_reports or [])
    dev_runs = {cpu: s for cpu, runs in latest_runs(summaries).items() for s in runs
                if workload_name(s) == DEFAULT_WORKLOAD_NAME}
    parts += scale_section(latest_scale_reports(scale_reports or []), dev_runs)
    parts += row_cost_section(row_cost_reports or [])
    for name, text in notes:
        parts += [text.strip(), ""]
    return "\n".join(parts).rstrip() + "\n"


def headline(summaries: list[dict]) -> str:
    """The README's headline: per machine, one line per workload (the Spec-Bench dev set first, the
    chat case the project is measured on; then the newest first): vanilla, auto and the best peer."""
    lines = []
    for cpu, runs in latest_runs(summaries).items():
        for s in sorted(runs, key=lambda r: workload_name(r) != DEFAULT_WORKLOAD_NAME):
            lines += _headline_line(cpu, s)
    return "\n".join(lines)


def _headline_line(cpu: str, s: dict) -> list[str]:
    """One run's headline line (none without a vanilla row)."""
    rows = {r["name"]: r for r in s["rows"]}
    van = rows.get("vanilla")
    if van is None:
        return []
    text = (f"- **{cpu}** ({str(s.get('date'))[:10]}, {workload_name(s)}, {s.get('prompts')} prompts): "
            f"vanilla {van['tokens_per_s']:.1f} tokens/s")
    ours = [r for r in s["rows"] if r.get("system") == "leapdecode" and r["name"] != "vanilla"]
    if ours:
        best = rows.get("auto") or max(ours, key=lambda r: r.get("speedup") or 0)
        text += (f"; `{best['name']}` {best['speedup']:.2f}x vanilla"
                 + (f", {best['identical_pct']:.0f}% identical" if best.get("identical_pct") is not None else ""))
    cpp = [r for r in s["rows"] if r["name"].startswith("llama-server")]
    if cpp:
        fastest = max(cpp, key=lambda r: r.get("tokens_per_s") or 0)
        text += (f"; llama.cpp's server: {fastest['tokens_per_s']:.1f} tokens/s at best "
                 f"(`{fastest['name']}`)")
    return [text + "."]


def replace_headline(readme: str, block: str) -> str:
    if HEADLINE_START not in readme or HEADLINE_END not in readme:
        raise InvalidParameterError(f"the README has no {HEADLINE_START} ... {HEADLINE_END} block")
    head, rest = readme.split(HEADLINE_START, 1)
    _, tail = rest.split(HEADLINE_END, 1)
    return f"{head}{HEADLINE_START}\n{block}\n{HEADLINE_END}{tail}"


def draw(s: dict, path: Path) -> bool:
    """A bar chart of each runner's tokens/s (False: matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = ordered_rows(s)
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    colors = ["#4c72b0" if r.get("system") == "leapdecode" else "#999999" for r in rows]
    ax.barh([r["name"] for r in rows][::-1], [r.get("tokens_per_s") or 0 for r in rows][::-1], color=colors[::-1])
    ax.set_xlabel("tokens/s (median per prompt, mean over prompts)")
    ax.set_title(f"{cpu_of(s)}: {workload_name(s)}, {str(s.get('date'))[:10]}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def cmd_results(a: argparse.Namespace) -> int:
    directory = a.dir
    out = a.out
    if not a.check:  # the places written, checked before anything is (probe N-RES6: a traceback on /proc)
        out = check_output(out, "--out", directory=False)
        if a.add:
            check_output(directory, "--dir", directory=True)
    if a.add and not a.check:
        for src in a.add:
            print(f"added {add_summary(src, directory)}", file=sys.stderr)
    if not directory.is_dir():
        raise InvalidParameterError(f"{directory}: no such results directory")
    summaries = read_summaries(directory)
    notes = [(p.name, p.read_text()) for p in sorted(directory.glob("*.md"))]
    # --no-plots draws nothing, but the page still links the plots already drawn beside it (probe N-RES7).
    # Dropping every link made `--check --no-plots` call a fresh clone's page (its plots are committed) out of
    # date when only the image links differed, and made `leapdecode results --no-plots` (say, without
    # matplotlib) strip the committed page of its images; comparing modulo the links would have mended
    # --check only. A run whose plot was never drawn gets no link (never a link to a missing image). Neither
    # --check looks inside the images.
    drawn = frozenset(p.name for p in (out.parent / "img").glob("results-*.png")) if a.no_plots else frozenset()
    page = render(summaries, notes, plots=not a.no_plots, head_reports=read_head_reports(directory / HEADS_DIR),
                  ceiling_reports=read_ceiling_reports(directory / CEILINGS_DIR), drawn=drawn,
                  scale_reports=read_scale_reports(directory / SCALE_DIR),
                  row_cost_reports=read_row_cost_reports(directory / ROW_COST_DIR))
    readme_path = Path(a.readme) if a.readme else None
    readme_old = readme_path.read_text() if readme_path and readme_path.is_file() else None
    readme_new = replace_headline(readme_old, headline(summaries)) if readme_old is not None else None
    if a.check:
        stale = [str(p) for p, old, new in ((out, out.read_text() if out.is_file() else None, page),
                                            (readme_path, readme_old, readme_new)) if p and old != new]
        if stale:
            print(f"out of date: {', '.join(stale)} (run `leapdecode results`)", file=sys.stderr)
            return 1
        return 0
    if readme_new is not None and readme_new != readme_old:
        check_output(readme_path, "--readme", directory=False)  # before the page is written
    atomic_write(out, page)
    if readme_new is not None and readme_new != readme_old:
        atomic_write(readme_path, readme_new)
    if not a.no_plots:
        img = out.parent / "img"
        wanted = {plot_name(s) for runs in latest_runs(summaries).values() for s in runs}
        if all(draw(s, img / plot_name(s)) for runs in latest_runs(summaries).values() for s in runs):
            for old in img.glob("results-*.png"):  # the page's plots are these: no other results-*.png
                if old.name not in wanted:
                    old.unlink()
        else:
            print("no plots: matplotlib is not installed (pip install 'leapdecode[bench]')", file=sys.stderr)
    print(f"wrote {out}" + (f" and the headline of {readme_path}" if readme_new is not None else ""), file=sys.stderr)
    return 0
