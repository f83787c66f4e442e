"""The results page's scale section (issue 62): ``scripts/scale_bench.py --save`` reports (GGUFs of real
shapes with random blocks, leapdecode beside llama.cpp's server on the same file), and a projection of
what speculation would give at those sizes, kept apart from the measurements.

The projection is a model, not a measurement.  A drafter whose greedy drafts the 1.5B accepted at
``a`` tokens per target forward on this machine's Spec-Bench dev run is read as a chain whose every
drafted token is accepted with probability ``alpha = 1 - 1/a`` (what an unbounded chain with that
acceptance gives).  At each shape, a chain of ``g`` drafted tokens then yields
``(1 - alpha**(g + 1)) / (1 - alpha)`` tokens a step for ``t(g + 1) + g * t_draft`` seconds, where
``t(n)`` is the measured cost of a forward of ``n`` verified rows at that shape (interpolated between
1, 4, 8 and 16) and ``t_draft`` a draft model's one-token forward (the 0.5B shape's decoding step; 0
for model-free drafters and heads, whose drafting the model leaves out); the projected speedup is the
best ``g``'s tokens a second over vanilla's ``1 / t(1)``.  The same model at the 1.5B's shape stands
beside the speedup measured there, so its error can be read.
"""

from __future__ import annotations

DRAFT_SHAPE = "qwen2.5-0.5b"  # the draft model's shape: its decoding step is a drafted token's cost
MEASURED_SHAPE = "qwen2.5-1.5b"  # the shape of the model the acceptance was measured on
MAX_CHAIN = 15  # drafted tokens a step: the measured row costs reach 16 rows
# (label, the dev run's row whose acceptance stands for it, drafts with a model)
PROJECTED = (("0.5B draft model (llama.cpp's draft row's acceptance)", "llama-server-draft", True),
             ("`auto`", "auto", False), ("EAGLE head", "eagle", False), ("`pld` (model-free)", "pld", False))


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def rows_cost(record: dict):
    """``t(n)`` in seconds from a shape's measured row costs (linear between the measured sizes)."""
    points = sorted((int(n), ms / 1000) for n, ms in record["warm"]["rows_ms"].items())

    def t(n: float) -> float:
        for (n0, t0), (n1, t1) in zip(points, points[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (n - n1) / (n1 - n0)

    return t


def projected_speedup(accepted: float, t, t_draft: float) -> tuple[float, int]:
    """(speedup over vanilla, drafted tokens a step) of the best chain under the section's model."""
    alpha = min(max(1.0 - 1.0 / accepted, 0.0), 0.999) if accepted > 1 else 0.0
    best = (1.0, 0)
    for g in range(1, MAX_CHAIN + 1):
        tokens = (1 - alpha ** (g + 1)) / (1 - alpha)
        speed = tokens * t(1) / (t(g + 1) + g * t_draft)
        if speed > best[0]:
            best = (speed, g)
    return best


def measurement_table(shapes: dict) -> list[str]:
    lines = ["| shape | GGUF GB | first load s / peak GB | cache GB | warm load s | resident GB after a run | "
             "prefill t/s (llama.cpp) | decode t/s (llama.cpp) | verified rows 1 / 4 / 8 / 16, ms | "
             "llama.cpp ready s / peak GB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in shapes.items():
        w, p, first = r["warm"], r.get("llama_server") or {}, r["first"]
        rows = " / ".join(f"{r['warm']['rows_ms'][k]:.0f}" for k in sorted(w["rows_ms"], key=int))
        lines.append(
            f"| {name} | {_gb(r['gguf_bytes'])} | {first['wall_s']:.0f} / {_gb(first['peak'])} | "
            f"{_gb(r['cache_bytes'])} | {w['load_s']:.1f} | {_gb(w.get('after_run'))} | "
            f"{w['prefill_tps']:.1f} ({_f(p.get('prefill_tps'))}) | {w['decode_tps']:.2f} ({_f(p.get('decode_tps'), '.2f')}) | "
            f"{rows} | {_f(p.get('ready_s'))} / {_gb(p.get('peak'))} |")
    return lines


def projection_table(shapes: dict, dev_rows: dict[str, dict]) -> list[str]:
    draft = shapes.get(DRAFT_SHAPE)
    t_draft = 1.0 / draft["warm"]["decode_tps"] if draft else None
    targets = [n for n in shapes if n != DRAFT_SHAPE]
    lines = ["| drafter (accepted a forward on the 1.5B; speedup measured there) | "
             + " | ".join(f"{n}" for n in targets) + " |", "|---|" + "---:|" * len(targets)]
    for label, row, model_draft in PROJECTED:
        r = dev_rows.get(row)
        if r is None or not r.get("mean_accepted") or (model_draft and t_draft is None):
            continue
        cells = []
        for n in targets:
            speed, g = projected_speedup(r["mean_accepted"], rows_cost(shapes[n]), t_draft if model_draft else 0.0)
            cells.append(f"{speed:.2f}x ({g})")
        measured = f"{r['speedup']:.2f}x" if row != "llama-server-draft" else "llama.cpp's own: " + f"{r['speedup']:.2f}x"
        lines.append(f"| {label} ({r['mean_accepted']:.2f}; {measured}) | " + " | ".join(cells) + " |")
    return lines


def scale_section(latest: dict[str, dict], dev_runs: dict[str, dict]) -> list[str]:
    """Per machine (``cpu``), its latest scale report (``latest[cpu]``): its command, the measurements,
    and the projection from that machine's latest Spec-Bench dev run (``dev_runs[cpu]``, a bench
    summary) where there is one."""
    if not latest:
        return []
    parts = ["## Scale: model sizes straight from the GGUF, beside llama.cpp", "",
             "GGUFs of real model shapes in Q4_K_M's mixture with **random** blocks and qwen2.5-coder-1.5b's "
             "tokenizer (`scripts/scale_bench.py`): random weights make random text, so nothing compares outputs. "
             "leapdecode loads each straight from the file (first load on an empty cache; the warm load maps the "
             "packed weights), prefills the prompt and decodes greedily; llama.cpp's server runs the same file, "
             "prompt tokens and threads. Peaks are the processes' own (`VmHWM`).", ""]
    for cpu, r in sorted(latest.items()):
        parts += [f"### {cpu} ({str(r.get('date'))[:10]}, {r.get('threads')} threads, {r.get('prompt_tokens')} prompt "
                  f"tokens, {r.get('new_tokens')} new)", "", f"    {r.get('command') or ''}", ""]
        parts += measurement_table(r["shapes"]) + [""]
        dev = dev_runs.get(cpu)
        if dev is not None and MEASURED_SHAPE in r["shapes"]:
            rows = {row.get("name"): row for row in dev.get("rows", [])}
            parts += [f"**Projection, not a measurement** (the model in `results/scale.py`): speculation's "
                      f"speedup over vanilla at each shape from the acceptance measured on qwen2.5-coder-1.5b "
                      f"({dev.get('date', '')[:10]}, {dev.get('prompts')} Spec-Bench dev prompts) and the row costs "
                      f"above; in brackets the drafted tokens a step it picks.", ""]
            parts += projection_table(r["shapes"], rows) + [""]
    return parts
