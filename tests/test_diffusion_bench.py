"""The diffusion benchmark (``leapdecode diffusion bench`` / ``leapdecode bench -m DIFFUSION``):
rows and options, the exact decoders measured equal to stepwise, the parent's NLL against an
independent computation, the infilling tasks, the summary arithmetic, atomic files, the CLIs.
Tiny random models: seconds."""

import json

import pytest
import torch
import torch.nn.functional as F

from leapdecode.bench.diffusion import (BenchEntry, DiffusionBenchConfig, ParentScorer, decode_canvas,
                                        default_entries, humaneval_records, infill_tasks, run_diffusion_bench,
                                        summarize)
from leapdecode.models.store import atomic_write as write_atomic
from leapdecode.errors import InvalidParameterError


def test_entries_stepwise_first_thresholds_swept_apd_only_with_a_helper():
    e = default_entries((0.5, 0.9))
    assert e[0] == BenchEntry("stepwise", "stepwise")
    labels = [x.label for x in e]
    assert "fast-dllm t=0.5" in labels and "fast-dllm t=0.9" in labels and "ssd" in labels
    assert not any(x.method == "apd" for x in e)
    assert any(x.method == "apd" and x.options == {"helper": "p"} for x in default_entries((0.5,), helper="p"))
    ll = [x for x in e if x.method == "localleap"]
    assert all(x.options["relaxed_threshold"] <= x.options["threshold"] for x in ll)
    with pytest.raises(InvalidParameterError):
        default_entries((0.0,))
    with pytest.raises(InvalidParameterError):
        default_entries((0.5,), methods=["pld"])
    with pytest.raises(InvalidParameterError, match="helper"):
        default_entries((0.5,), methods=["apd"])


def test_infill_tasks_are_one_line_of_the_solution_with_its_context():
    from leapdecode.diffusion import load

    tok = load("tiny-dream").tokenizer
    records = humaneval_records()
    tasks = infill_tasks(tok, records, 3, context_tokens=1000, skip=2)
    assert len(tasks) == 3 and [t.key for t in tasks][0] == records[2]["task_id"]
    for t in tasks:
        r = next(r for r in records if r["task_id"] == t.key)
        whole = tok.decode(t.prefix + t.middle + t.suffix)
        assert whole == r["prompt"] + r["canonical_solution"]
        middle = tok.decode(t.middle)
        assert middle.endswith("\n") and middle.count("\n") == 1 and middle.strip()
        assert middle in r["canonical_solution"]
    short = infill_tasks(tok, records, 1, context_tokens=5)
    assert len(short[0].prefix) == 5 and len(short[0].suffix) == 5


def test_an_infilled_canvas_keeps_its_suffix_and_fills_only_the_gap():
    from leapdecode.diffusion import load

    model = load("tiny-llada:3")
    prefix, suffix = [10, 11, 12], [40, 41, 42, 43]
    filled, counts = decode_canvas(model, BenchEntry("stepwise", "stepwise"), prefix, 5, 4, suffix)
    assert len(filled) == 5 and model.mask_token_id not in filled and counts["forwards"] == 5
    # the suffix is seen: another suffix changes what fills the gap (bidirectional attention)
    other, _ = decode_canvas(model, BenchEntry("stepwise", "stepwise"), prefix, 5, 4, [200, 201, 202, 203])
    assert other != filled


def test_parent_nll_is_the_next_token_loss_of_the_answer():
    from leapdecode.models.loader import load as load_causal

    parent = load_causal("tiny-random", dtype="fp32", weights="fp32", device="cpu", backend="native")
    scorer = ParentScorer(parent)
    prompt, answer = [5, 6, 7, 8], [9, 10, 11]
    ids = prompt + answer
    ref = []
    for k in range(len(prompt), len(ids)):  # one fresh forward per answer token
        logits = parent.model.forward(torch.tensor([ids[:k]]), parent.model.new_cache())[0, -1]
        ref.append(float(F.cross_entropy(logits[None].float(), torch.tensor([ids[k]]))))
    assert scorer.nll(prompt, answer) == pytest.approx(sum(ref) / len(ref), rel=1e-4)
    assert scorer.nll(prompt, []) is None
    with pytest.raises(InvalidParameterError, match="vocabularies"):
        scorer.nll(prompt, [scorer.vocab])


def test_summary_arithmetic():
    rows = [
        {"kind": "completion", "label": "stepwise", "method": "stepwise", "options": {}, "forwards": 8, "rows": 8,
         "wall_s": 2.0, "exact": True, "agree": 1.0, "nll": 2.0},
        {"kind": "completion", "label": "fast", "method": "fast-dllm", "options": {"threshold": 0.5},
         "forwards": 2, "rows": 2, "wall_s": 0.5, "exact": False, "agree": 0.75, "nll": 3.0},
        {"kind": "infill", "label": "fast", "method": "fast-dllm", "options": {}, "forwards": 1, "rows": 1,
         "wall_s": 0.1, "exact": True, "agree": 1.0},
        {"kind": "infill", "label": "fast", "method": "fast-dllm", "options": {}, "forwards": 1, "rows": 1,
         "wall_s": 0.1, "exact": False, "agree": 0.5},
    ]
    s = {r["label"]: r for r in summarize(rows, ["stepwise", "fast"], 8)["rows"]}
    assert s["stepwise"]["forwards_per_token"] == 1.0 and s["stepwise"]["tokens_per_s"] == 4.0
    f = s["fast"]
    assert f["forwards_per_token"] == 0.25 and f["speedup"] == 4.0 and f["exact_match"] == 0.0
    assert f["agreement"] == 0.75 and f["nll"] == 3.0 and f["infill_exact"] == 0.5 and f["infill_agreement"] == 0.75
    assert s["stepwise"]["infill_exact"] is None


def test_a_run_on_tiny_models_writes_the_table_and_the_plot(tmp_path):
    cfg = DiffusionBenchConfig(model="tiny-dream:1", out=tmp_path / "b", parent="tiny-random",
                               methods=["stepwise", "ssd", "freedave", "fast-dllm", "apd"], thresholds=(0.5, 0.9),
                               prompts=2, prompt_tokens=12, max_new_tokens=8, block_size=4, infill=2,
                               context_tokens=12)
    summary = run_diffusion_bench(cfg)
    rows = {r["label"]: r for r in summary["rows"]}
    assert list(rows) == ["stepwise", "ssd", "freedave", "fast-dllm t=0.5", "fast-dllm t=0.9", "apd"]
    assert rows["stepwise"]["forwards_per_token"] == 1.0 and rows["stepwise"]["exact_match"] == 1.0
    for exact in ("ssd", "freedave"):  # the exact decoders measure as exact, in no more forwards
        assert rows[exact]["exact_match"] == 1.0 and rows[exact]["forwards_per_token"] <= 1.0
        assert rows[exact]["nll"] == pytest.approx(rows["stepwise"]["nll"])
    assert all(r["nll"] is not None and r["nll"] > 0 for r in rows.values())
    assert all(r["infill_exact"] is not None for r in rows.values())
    results = [json.loads(line) for line in (tmp_path / "b" / "results.jsonl").read_text().splitlines()]
    assert len(results) == 6 * (2 + 2)
    for r in results:  # exact is recomputed from the tokens, not assumed
        if r["kind"] == "completion":
            ref = next(x for x in results if x["label"] == "stepwise" and x["prompt"] == r["prompt"]
                       and x["kind"] == "completion")
            assert r["exact"] == (r["tokens"] == ref["tokens"])
        else:
            assert r["exact"] == (r["tokens"] == r["target"])
    report = (tmp_path / "b" / "report.md").read_text()
    assert "| `ssd` |" in report and "forwards/token" in report
    png = (tmp_path / "b" / "quality_vs_speed.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["quality_vs_speed.png", "report.md",
                                                                   "results.jsonl", "summary.json"]
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["config"]["parent"] == "tiny-random"
    assert summary["parent_greedy_nll"] is not None and "own greedy" in report


def test_parent_greedy_is_vanilla_greedy_decoding():
    from leapdecode import generate
    from leapdecode.bench.diffusion import parent_greedy
    from leapdecode.models.loader import load as load_causal

    parent = load_causal("tiny-random", dtype="fp32", weights="fp32", device="cpu", backend="native")
    prompt = [72, 101, 108, 108, 111]
    ref = generate(parent, prompt_ids=prompt, max_new_tokens=10, method="vanilla").tokens
    assert parent_greedy(parent, prompt, 10, set(parent.eos_token_ids)) == ref[:10]


def test_planted_error_a_wrong_reference_is_seen_as_a_mismatch(tmp_path, monkeypatch):
    """The exact-match column can fail: a decoder that changes one answer token scores 0%."""
    import leapdecode.bench.diffusion as bench

    real = bench.decode_canvas

    def planted(model, entry, prefix, n, block_size, suffix=()):
        filled, counts = real(model, entry, prefix, n, block_size, suffix)
        if entry.method == "ssd":
            filled = filled[:-1] + [(filled[-1] + 1) % 250]
        return filled, counts

    monkeypatch.setattr(bench, "decode_canvas", planted)
    cfg = DiffusionBenchConfig(model="tiny-llada", out=tmp_path / "b", methods=["ssd"], prompts=2,
                               prompt_tokens=8, max_new_tokens=6, block_size=3, infill=0, plots=False)
    rows = {r["label"]: r for r in run_diffusion_bench(cfg)["rows"]}
    assert rows["ssd"]["exact_match"] == 0.0 and rows["ssd"]["agreement"] == pytest.approx(5 / 6)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = write_atomic(tmp_path / "report.md", "old")
    with pytest.raises(TypeError):
        write_atomic(path, None)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_cli_diffusion_bench_and_bench_routing(tmp_path, capsys):
    from leapdecode.cli import main

    rc = main(["diffusion", "bench", "-m", "tiny-llada", "--methods", "fast-dllm", "--thresholds", "0.7",
               "--prompts", "1", "--prompt-tokens", "8", "--max-new-tokens", "6", "--block-size", "3",
               "--infill", "1", "--out", str(tmp_path / "a"), "--no-plots", "--quiet", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in out["rows"]] == ["stepwise", "fast-dllm t=0.7"]
    rc = main(["bench", "-m", "tiny-dream", "--methods", "ssd", "--limit", "1", "--max-new-tokens", "6",
               "--block-size", "3", "--infill", "0", "--out", str(tmp_path / "b"), "--no-plots", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| `ssd` |" in text and (tmp_path / "b" / "report.md").is_file()
    assert main(["bench", "-m", "tiny-dream", "--peers", "hf"]) == 2
    assert main(["diffusion", "bench", "-m", "tiny-dream", "--thresholds", "x"]) == 2
    assert main(["diffusion", "bench", "-m", "tiny-dream", "--thresholds", "1.5"]) == 2
    assert main(["diffusion", "bench", "-m", "tiny-dream", "--methods", "pld"]) == 2
