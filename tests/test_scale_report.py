"""The results page's scale section (issue 62): the measurements of ``scripts/scale_bench.py`` reports
and the projection of speculation at those sizes, drawn from committed reports (``results/scale.py``)."""

from __future__ import annotations

import json

import pytest

from leapdecode.results import page as results_page
from leapdecode.errors import InvalidParameterError
from leapdecode.results.scale import projected_speedup, rows_cost, scale_section


def _record(rows_ms: dict, decode_tps: float = 10.0) -> dict:
    return {"gguf_bytes": 1_120_000_000, "cache_bytes": 1_170_000_000,
            "first": {"wall_s": 56.0, "peak": 1_670_000_000},
            "warm": {"load_s": 2.8, "after_run": 1_300_000_000, "prefill_tps": 73.3, "decode_tps": decode_tps,
                     "rows_ms": rows_ms},
            "llama_server": {"ready_s": 2.0, "peak": 1_900_000_000, "prefill_tps": 75.3, "decode_tps": 12.2}}


def test_rows_cost_interpolates_and_extends():
    t = rows_cost(_record({"1": 50.0, "4": 80.0, "8": 120.0, "16": 240.0}))
    assert t(1) == pytest.approx(0.050) and t(2) == pytest.approx(0.060) and t(16) == pytest.approx(0.240)
    assert t(6) == pytest.approx(0.100)


def test_projection_follows_the_row_costs_and_the_draft_cost():
    flat = rows_cost(_record({"1": 50.0, "4": 50.0, "8": 50.0, "16": 50.0}))
    speed, g = projected_speedup(2.0, flat, 0.0)  # alpha 0.5, free rows: the longest chain, ~2 tokens a step
    assert g == 15 and speed == pytest.approx((1 - 0.5 ** 16) / 0.5)
    linear = rows_cost(_record({"1": 50.0, "4": 200.0, "8": 400.0, "16": 800.0}))
    assert projected_speedup(2.0, linear, 0.0) == (1.0, 0)  # a row costs a forward: never pays
    cheap_draft, costly_draft = projected_speedup(3.0, flat, 0.005), projected_speedup(3.0, flat, 0.02)
    assert cheap_draft[0] > costly_draft[0] > 1.0 and costly_draft[1] < cheap_draft[1]


def test_the_page_shows_the_measurements_and_the_projection_apart(tmp_path):
    report = {"report": "scale", "machine": "Test CPU, 2 cores", "cpu_flags": ["avx2"], "date": "2026-12-06",
              "threads": 2, "prompt_tokens": 512, "new_tokens": 64, "command": "python scripts/scale_bench.py --save",
              "shapes": {"qwen2.5-0.5b": _record({"1": 20.0, "4": 30.0, "8": 45.0, "16": 80.0}, decode_tps=40.0),
                         "qwen2.5-1.5b": _record({"1": 59.0, "4": 84.0, "8": 126.0, "16": 246.0}),
                         "qwen2.5-7b": _record({"1": 250.0, "4": 300.0, "8": 380.0, "16": 600.0}, decode_tps=4.0)}}
    (tmp_path / "scale").mkdir()
    (tmp_path / "scale" / "r.json").write_text(json.dumps(report))
    dev = {"machine": "Test CPU, 2 cores", "cpu_flags": ["avx2"], "workload": "questions_dev.jsonl", "date": "2026-12-01",
           "prompts": 13, "model": "qwen2.5-coder-1.5b", "max_new_tokens": 128,
           "rows": [{"name": "vanilla", "system": "leapdecode", "speedup": 1.0, "mean_accepted": 1.0},
                    {"name": "auto", "system": "leapdecode", "speedup": 1.3, "mean_accepted": 1.8},
                    {"name": "llama-server-draft", "system": "llama.cpp", "speedup": 0.3, "mean_accepted": 2.9}]}
    page = results_page.render([], [], plots=False, scale_reports=results_page.read_scale_reports(tmp_path / "scale"))
    assert "## Scale" in page and "| qwen2.5-7b | 1.12 | 56 / 1.67 |" in page
    assert "Projection" not in page  # no Spec-Bench dev run on that machine: nothing to project from
    cpu = results_page.cpu_of(report)
    lines = scale_section({cpu: report}, {cpu: dev})
    text = "\n".join(lines)
    assert text.index("| qwen2.5-7b |") < text.index("**Projection, not a measurement**")
    header = next(line for line in lines if line.startswith("| drafter"))
    assert "qwen2.5-1.5b" in header and "qwen2.5-7b" in header and "qwen2.5-0.5b" not in header
    auto = next(line for line in lines if line.startswith("| `auto` (1.80; 1.30x)"))
    draft = next(line for line in lines if line.startswith("| 0.5B draft model"))
    # the 7B's rows are cheap next to its forward: speculation pays more there than at the 1.5B's shape
    for line in (auto, draft):
        at_15, at_7 = (float(c.split("x")[0]) for c in line.split("|")[2:4])
        assert at_7 > at_15 > 1.0, line


def test_the_row_cost_section_shows_each_variants_curve_per_machine(tmp_path):
    # scripts/row_cost.py --save reports: per machine its latest, each variant's rows in ms and relative to one row
    def report(date: str, avx2_16: float) -> dict:
        return {"report": "row-cost", "machine": "Test CPU, 2 cores", "cpu_flags": ["avx2"], "model": "m",
                "context": 256, "date": date, "command": "python scripts/row_cost.py --save",
                "variants": {"native (-march=native)": {"1": 40.0, "4": 50.0, "16": 120.0},
                             "avx2": {"1": 50.0, "4": 70.0, "16": avx2_16}}}
    (tmp_path / "row_cost").mkdir()
    (tmp_path / "row_cost" / "old.json").write_text(json.dumps(report("2026-12-01", 300.0)))
    (tmp_path / "row_cost" / "new.json").write_text(json.dumps(report("2026-12-06", 200.0)))
    reports = results_page.read_row_cost_reports(tmp_path / "row_cost")
    page = results_page.render([], [], plots=False, row_cost_reports=reports)
    assert "## Verified rows per instruction set" in page and "(2026-12-06, m, 256 tokens of context)" in page
    assert "| kernel | 1 row | 4 rows | 16 rows |" in page
    assert "| avx2 | 50.0 ms | 70.0 ms (1.40x) | 200.0 ms (4.00x) |" in page  # the latest report only
    assert "300.0 ms" not in page and "    python scripts/row_cost.py --save" in page
    assert "Verified rows per instruction set" not in results_page.render([], [], plots=False)
    (tmp_path / "row_cost" / "bad.json").write_text(json.dumps({"report": "scale", "shapes": {}}))
    with pytest.raises(InvalidParameterError, match="not a row-cost report"):
        results_page.read_row_cost_reports(tmp_path / "row_cost")
