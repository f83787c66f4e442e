"""docs/results.md and the README's headline are what `leapdecode results` makes of the committed
bench summaries (issue 44 item 2); the generator's own behaviour on made-up summaries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from leapdecode.results import page as results_page
from leapdecode.cli import main
from leapdecode.errors import InvalidParameterError

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_page_and_headline_match_the_summaries(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert list((ROOT / "docs" / "results").glob("*.json")), "no bench summary is committed"
    assert main(["results", "--check"]) == 0, "docs/results.md or the README headline is stale: run `leapdecode results`"


def _summary(date: str, machine: str, rows: list[tuple], workload="/x/questions_dev.jsonl", **extra) -> dict:
    return {"machine": f"{machine}, 2 cores, 2 torch threads, torch 2.13.0+cpu", "date": date, "workload": workload,
            "model": "m", "weights": "int4", "attention": "invariant", "batch_invariant": True, "prompts": 3,
            "max_new_tokens": 64, "repeats": 2, "draft": "d", "cpu_flags": ["avx2"], "commit": "abc",
            "command": "leapdecode bench --limit 3", "skipped": ["skipping llama-server-draft: no draft"],
            "rows": [{"name": n, "system": sys_, "tokens_per_s": t, "speedup": sp, "mean_accepted": ma,
                      "identical_pct": ip, "identical": 3, "compared": 3, "unsteady": [],
                      "speedup_by_group": {"mt_bench": sp, "qa": round(sp * 0.9, 3)}}
                     for n, sys_, t, sp, ma, ip in rows], **extra}


ROWS = [("llama-server", "llama.cpp", 17.0, 0.85, 1.0, 67.0), ("pld", "leapdecode", 21.0, 1.05, 1.3, 100.0),
        ("vanilla", "leapdecode", 20.0, 1.0, 1.0, 100.0), ("auto", "leapdecode", 24.0, 1.2, 1.5, 100.0),
        ("hf", "transformers", 10.0, 0.5, 1.0, 100.0), ("llama-server-ngram", "llama.cpp", 17.5, 0.87, 1.1, 67.0)]


def test_page_rows_order_latest_run_and_notes(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    (d / "old.json").write_text(json.dumps(_summary("2026-01-01 10:00:00", "CPU A", ROWS[:3])))
    (d / "new.json").write_text(json.dumps(_summary("2026-02-01 10:00:00", "CPU A", ROWS)))
    (d / "other.json").write_text(json.dumps(_summary("2026-01-15 10:00:00", "CPU B", ROWS[1:3], workload="humaneval")))
    (d / "zz-gpu.md").write_text("## A hand-written section\n\nfigures\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:headline -->\nold\n<!-- /results:headline -->\nrest\n")
    out = tmp_path / "results.md"
    args = ["results", "--dir", str(d), "--out", str(out), "--readme", str(readme), "--no-plots"]
    assert main(args) == 0
    page = out.read_text()
    assert page.index("## CPU A") < page.index("## CPU B") and "2026-01-01" not in page  # the latest run only
    table = [line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| `")]
    assert table[:6] == ["`vanilla`", "`auto`", "`pld`", "`hf`", "`llama-server`", "`llama-server-ngram`"]
    assert "| `auto` | leapdecode | 24.0 | 1.20x | mt_bench 1.20x, qa 1.08x | 1.50 | 100% (3/3) |" in page
    assert "- command: `leapdecode bench --limit 3`" in page and "commit `abc`" in page
    assert "Runners that could not run: llama-server-draft: no draft." in page
    assert "Prompts whose repeats" not in page  # none was unsteady
    assert page.rstrip().endswith("figures")  # the notes come last
    head = readme.read_text()
    assert head.startswith("intro\n<!-- results:headline -->\n- **CPU A (AVX2)** (2026-02-01, questions_dev, 3 prompts)")
    assert "`auto` 1.20x vanilla, 100% identical; llama.cpp's server: 17.5 tokens/s at best (`llama-server-ngram`)" in head
    assert head.endswith("<!-- /results:headline -->\nrest\n") and "old" not in head
    assert main([*args, "--check"]) == 0
    (d / "new.json").write_text(json.dumps(_summary("2026-02-01 10:00:00", "CPU A", ROWS[1:])))
    assert main([*args, "--check"]) == 1  # a changed summary makes the page stale
    assert out.read_text() == page  # --check writes nothing


def test_headline_leads_with_the_spec_bench_run_and_lists_each_workload(tmp_path):
    """A newer run of another workload (here `similar`, described in parentheses) does not replace
    the Spec-Bench dev line: the headline has one line per workload, the dev set first."""
    d = tmp_path / "results"
    d.mkdir()
    (d / "dev.json").write_text(json.dumps(_summary("2026-02-01 10:00:00", "CPU A", ROWS)))
    (d / "sim.json").write_text(json.dumps(_summary("2026-02-02 10:00:00", "CPU A", ROWS[1:4],
                                                    workload="similar (requests of one kind in a row)")))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:headline -->\n<!-- /results:headline -->\n")
    out = tmp_path / "results.md"
    assert main(["results", "--dir", str(d), "--out", str(out), "--readme", str(readme), "--no-plots"]) == 0
    lines = [line for line in readme.read_text().splitlines() if line.startswith("- **CPU A (AVX2)**")]
    assert [line.split(", ")[1] for line in lines] == ["questions_dev", "similar"]
    page = out.read_text()
    assert "### similar: 3 prompts" in page and "- workload: similar (requests of one kind in a row)" in page


def _targets(page: str, ceilings: bool = False) -> dict[str, tuple[str, ...]]:
    """The (first) targets table of a page: target -> (now, met) or (now, met, measured ceiling)."""
    section = page.split("### Against the speedup targets", 1)[1]
    table = section[section.index("| target |"):].split("\n\n")[0]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]
    return {target: (now, met, ceiling) if ceilings else (now, met) for target, _goal, now, met, ceiling in rows}


def _ceiling_report(date: str, cpu: str, workload: str, ceilings: dict) -> dict:
    return {"report": "draft-ceiling", "model": "m", "date": date, "machine": f"{cpu}, 2 cores",
            "workload": workload, "command": f"python scripts/draft_ceiling.py --workload {workload}",
            "ceilings": {name: {"overall": v, "by_group": {}} for name, v in ceilings.items()}}


def test_targets_table_checks_the_latest_runs(tmp_path):
    """Each machine's targets from its latest runs: auto over vanilla on Spec-Bench dev and HumanEval,
    its slowest group, over llama.cpp's fastest speculative row, `suffix` over `sam` on `similar`, the
    bundled head's dev top-1, identity; a missing run is "not measured", never a made-up figure."""
    d = tmp_path / "results"
    (d / "heads").mkdir(parents=True)
    (d / "dev.json").write_text(json.dumps(_summary("2026-02-01 10:00:00", "CPU A", ROWS)))
    he = [("vanilla", "leapdecode", 20.0, 1.0, 1.0, 100.0), ("auto", "leapdecode", 42.0, 2.1, 3.0, 100.0)]
    (d / "he.json").write_text(json.dumps(_summary("2026-02-01 11:00:00", "CPU A", he, workload="humaneval-heldout")))
    sim = [("vanilla", "leapdecode", 20.0, 1.0, 1.0, 100.0), ("sam", "leapdecode", 30.0, 1.5, 2.0, 100.0),
           ("suffix", "leapdecode", 40.0, 2.0, 2.5, 90.0)]
    (d / "sim.json").write_text(json.dumps(_summary("2026-02-01 12:00:00", "CPU A", sim, workload="similar (x)")))
    (d / "heads" / "h.json").write_text(json.dumps({
        "report": "head-accuracy", "model": "m", "date": "2026-02-01", "command": "leapdecode heads accuracy",
        "machine": "CPU A, 2 cores", "tokens_per_prompt": 96,
        "sets": {"bundled": {results_page.DEV_SET: {"top1": [0.55, 0.5, 0.4], "tokens": 10, "prompts": 2}}}}))
    (d / "b.json").write_text(json.dumps(_summary("2026-02-01 10:00:00", "CPU B", ROWS[1:4])))
    (d / "ceilings").mkdir()
    for name, date, workload, c in (
            ("dev-old", "2026-01-01", "questions_dev", {"perfect drafter": 9.0, "copy oracle": 9.0}),
            ("dev", "2026-02-01", "questions_dev", {"perfect drafter": 3.1, "copy oracle": 1.4}),
            ("sim", "2026-02-01", "similar (x)", {"perfect drafter": 4.0, "copy oracle": 2.0,
                                                  "copy oracle with memory": 2.5})):
        (d / "ceilings" / f"{name}.json").write_text(json.dumps(_ceiling_report(date, "CPU A", workload, c)))
    out = tmp_path / "results.md"
    assert main(["results", "--dir", str(d), "--out", str(out), "--readme", "", "--no-plots"]) == 0
    page = out.read_text()
    # the measured ceilings beside the targets: the latest report of each workload on that machine
    c = _targets(page.split("## CPU B")[0], ceilings=True)
    assert c["`auto` over vanilla, questions_dev"][2] == "any drafter 3.10x, copying 1.40x"
    assert c["`auto` over vanilla, humaneval-heldout"][2] == ""  # no report: nothing made up
    assert c["cross-request memory (`suffix`) over `sam`, similar"][2] == "copying with memory over copying alone 1.25x"
    assert "python scripts/draft_ceiling.py --workload questions_dev" in page.split("## CPU B")[0]
    assert all(v[2] == "" for v in _targets(page.split("## CPU B")[1], ceilings=True).values())
    a = _targets(page.split("## CPU B")[0])
    assert a["`auto` over vanilla, questions_dev"] == ("1.20x", "no (75% of it)")
    assert a["`auto` over vanilla, humaneval-heldout"] == ("2.10x", "yes")
    assert a["`auto` on its slowest questions_dev group"] == ("qa 1.08x", "yes")
    peer = "`auto` over llama.cpp's best speculative configuration (tokens/s, same prompts)"
    assert a[peer] == ("1.37x (`llama-server-ngram`)", "no (69% of it)")  # 24.0 / 17.5, the plain server not counted
    assert a["cross-request memory (`suffix`) over `sam`, similar"] == ("1.33x", "yes")
    assert a["the bundled head's top-1, first drafted token, Spec-Bench dev"] == ("0.550", "no (92% of it)")
    assert a["greedy identity with vanilla, every leapdecode row above"] == ("90%", "no")  # suffix's 90%
    b = _targets(page.split("## CPU B")[1])  # a machine with the dev run only: no llama.cpp row there either
    assert b["`auto` over vanilla, humaneval-heldout"] == ("not measured", "")
    assert b[peer] == ("not measured", "") and b["the bundled head's top-1, first drafted token, Spec-Bench dev"][0] == "not measured"
    assert b["greedy identity with vanilla, every leapdecode row above"] == ("100%", "yes")


def test_add_copies_a_summary_without_its_paths(tmp_path):
    src = tmp_path / "summary.json"
    src.write_text(json.dumps(_summary("2026-03-04 05:06:07", "Intel(R) Xeon(R) Processor", ROWS,
                                       files={"report": "/tmp/x"}, plots=["/tmp/p.png"])))
    d = tmp_path / "results"
    target = results_page.add_summary(src, d)
    assert target.name == "2026-03-04-intel-r-xeon-r-processor-avx2-questions-dev.json"
    kept = json.loads(target.read_text())
    assert "files" not in kept and "plots" not in kept and kept["rows"][0]["name"] == "llama-server"


def test_bad_files_are_named(tmp_path, capsys):
    d = tmp_path / "results"
    d.mkdir()
    (d / "broken.json").write_text("{")
    with pytest.raises(InvalidParameterError, match="broken.json: not a bench summary"):
        results_page.read_summaries(d)
    assert main(["results", "--dir", str(tmp_path / "none"), "--out", str(tmp_path / "r.md"), "--readme", ""]) == 2
    assert "no such results directory" in capsys.readouterr().err
    readme = tmp_path / "R.md"
    readme.write_text("no block")
    (d / "broken.json").unlink()
    assert main(["results", "--dir", str(d), "--out", str(tmp_path / "r.md"), "--readme", str(readme)]) == 2
    assert "the README has no <!-- results:headline -->" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()  # nothing half-written


def test_one_processor_name_with_other_instruction_sets_is_another_machine(tmp_path):
    """"AMD EPYC" names both the AVX2-only VM and the Zen 4 with AVX512-VNNI: their runs get a section
    each (by the instruction sets the summary recorded), and a report that recorded its instruction
    sets goes to its own machine's targets; one that recorded none goes by the processor's name."""
    d = tmp_path / "results"
    (d / "ceilings").mkdir(parents=True)
    (d / "avx2.json").write_text(json.dumps(_summary("2026-02-01 10:00:00", "AMD EPYC", ROWS)))
    (d / "vnni.json").write_text(json.dumps(_summary("2026-02-02 10:00:00", "AMD EPYC", ROWS[1:4],
                                                     cpu_flags=["avx2", "avx512f", "avx512_vnni"])))
    vnni = _ceiling_report("2026-02-02", "AMD EPYC", "questions_dev", {"perfect drafter": 2.0})
    (d / "ceilings" / "vnni.json").write_text(json.dumps({**vnni, "cpu_flags": ["avx2", "avx512f", "avx512_vnni"]}))
    out = tmp_path / "results.md"
    assert main(["results", "--dir", str(d), "--out", str(out), "--readme", "", "--no-plots"]) == 0
    page = out.read_text()
    assert "## AMD EPYC (AVX2)" in page and "## AMD EPYC (AVX512-VNNI)" in page
    avx2, vnni_part = page.split("## AMD EPYC (AVX512-VNNI)") if page.index("(AVX2)") < page.index("(AVX512-VNNI)") \
        else page.split("## AMD EPYC (AVX2)")[::-1]
    assert "llama-server-ngram" in avx2 and "llama-server-ngram" not in vnni_part  # each its own runs
    assert _targets(vnni_part, ceilings=True)["`auto` over vanilla, questions_dev"][2] == "any drafter 2.00x"
    assert _targets(avx2, ceilings=True)["`auto` over vanilla, questions_dev"][2] == ""


def test_plots_of_runs_no_longer_on_the_page_are_removed(tmp_path):
    pytest.importorskip("matplotlib")
    d = tmp_path / "results"
    d.mkdir()
    (d / "dev.json").write_text(json.dumps(_summary("2026-02-01 10:00:00", "CPU A", ROWS)))
    img = tmp_path / "img"
    img.mkdir()
    (img / "results-cpu-a-questions-dev.png").write_bytes(b"a machine key without its instruction sets")
    (img / "other.png").write_bytes(b"not the generator's")
    assert main(["results", "--dir", str(d), "--out", str(tmp_path / "results.md"), "--readme", ""]) == 0
    assert sorted(p.name for p in img.iterdir()) == ["other.png", "results-cpu-a-avx2-questions-dev.png"]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
def test_N_RES6_out_where_nothing_can_be_written_is_one_line(tmp_path, capsys):
    """`results --out /proc/x.md` is a usage error like every other command's --out there (probe N-RES6:
    it was a FileNotFoundError traceback on the temporary file beside the page), and nothing is done
    first: an --add given with it copies nothing."""
    args = ["results", "--dir", str(ROOT / "docs" / "results"), "--readme", "", "--no-plots"]
    assert main([*args, "--out", "/proc/x.md"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("leapdecode: error: --out /proc/x.md: nothing can be written in /proc (")
    assert len(err.strip().splitlines()) == 1
    assert not list(Path("/proc").glob(".x.md.*"))
    d = tmp_path / "results"
    d.mkdir()
    run = tmp_path / "summary.json"
    run.write_text(json.dumps(_summary("2026-02-01 10:00:00", "CPU A", ROWS)))
    (tmp_path / "a-file").write_text("")
    assert main(["results", "--dir", str(d), "--add", str(run), "--out", str(tmp_path / "a-file" / "x.md"),
                 "--readme", "", "--no-plots"]) == 2
    assert "--out " in capsys.readouterr().err
    assert list(d.iterdir()) == []  # the --add was not done: nothing half-written
    assert main(["results", "--dir", str(d), "--out", "/proc/x.md", "--readme", "", "--check"]) == 1  # writes nothing


def test_N_RES7_check_with_and_without_plots_agree(tmp_path, monkeypatch, capsys):
    """On the committed page (every plot drawn and committed) `--check --no-plots` passes as `--check`
    does (probe N-RES7: it said a fresh clone was out of date, its page differing only in the image
    links), and both fail once a summary changes. `--no-plots` links the plots already drawn, so a page
    written without matplotlib keeps them, and a run whose plot was never drawn gets no broken link."""
    monkeypatch.chdir(ROOT)
    assert main(["results", "--check"]) == 0
    assert main(["results", "--check", "--no-plots"]) == 0
    for part in ("docs/results", "docs/img"):
        shutil.copytree(ROOT / part, tmp_path / part)
    shutil.copy(ROOT / "docs" / "results.md", tmp_path / "docs" / "results.md")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    monkeypatch.chdir(tmp_path)
    committed = Path("docs/results.md").read_text()
    assert main(["results", "--no-plots"]) == 0
    assert Path("docs/results.md").read_text() == committed  # the plots' links are kept
    for summary in Path("docs/results").glob("*.json"):  # every run, so the page's latest ones too
        s = json.loads(summary.read_text())
        s["rows"][0]["tokens_per_s"] = (s["rows"][0].get("tokens_per_s") or 0) + 1000.0
        summary.write_text(json.dumps(s))
    capsys.readouterr()
    assert main(["results", "--check"]) == 1
    assert main(["results", "--check", "--no-plots"]) == 1
    assert capsys.readouterr().err.count("out of date: docs/results.md") == 2
    shutil.rmtree("docs/img")
    assert main(["results", "--no-plots"]) == 0
    assert "![" not in Path("docs/results.md").read_text()  # no link to a plot that was never drawn


def test_row_cost_section_shows_each_variant_against_its_instructions_peak():
    from leapdecode.results.page import row_cost_section

    report = {"report": "row-cost", "machine": "Some CPU, 2 cores", "date": "2026-12-06", "model": "m", "context": 256,
              "command": "python scripts/row_cost.py --save",
              "variants": {"avx512-vnni": {"1": 40.0, "8": 80.0}, "avx2": {"1": 50.0, "8": 160.0}},
              "macs_per_row": 1_000_000_000, "weight_bytes": 800_000_000, "isa": {"avx512-vnni": "vnni512", "avx2": "avx2"},
              "peaks": {"threads": 2, "vnni512": 200e9, "avx2": 100e9, "read": 25e9, "copy": 40e9}}
    text = "\n".join(row_cost_section([report]))
    assert "| avx512-vnni | 40.0 ms | 80.0 ms (2.00x) |" in text
    # 8 rows x 1 G multiply-adds in 80 ms = 100 G/s = 50% of 200 G/s; one row's 0.8 GB in 40 ms = 20 GB/s
    assert "| avx512-vnni | vpdpbusd zmm | 100 G/s (50%) | 20.0 GB/s (80% of streaming read, 50% of memcpy" in text
    assert "| avx2 | vpmaddubsw + vpaddw ymm | 50 G/s (50%) | 16.0 GB/s (64% of streaming read, 40% of memcpy" in text
    del report["peaks"]  # an older report: the times only
    assert "G/s" not in "\n".join(row_cost_section([report]))
