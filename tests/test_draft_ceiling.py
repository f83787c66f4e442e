"""``leapdecode bench --ceiling`` (bench/ceiling.py) and its replays: the copy oracle drafts what an earlier occurrence continues
and pays for exactly the accepted part; the perfect drafter's dynamic programme finds the cheapest
split of an output into steps (checked against brute force on small cases)."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leapdecode.bench import ceiling as ceiling_module
from leapdecode.cli import build_parser, main


@pytest.fixture(scope="module")
def ceiling():
    return ceiling_module


def config(*argv: str):
    from leapdecode.bench.cli import ceiling_from_args

    return ceiling_from_args(build_parser().parse_args(["bench", "--ceiling", *argv]))


def test_copy_continuation_is_the_most_recent_longest_match(ceiling):
    # suffix [1, 2] occurred twice: the later occurrence (followed by 7) wins over the earlier (5)
    assert ceiling.copy_continuation_at([1, 2, 5, 1, 2, 7, 1, 2]) == [7, 1, 2]
    # the longest suffix wins: [3, 1, 2] continues with 9 though [1, 2] alone would give 7
    assert ceiling.copy_continuation_at([3, 1, 2, 9, 1, 2, 7, 3, 1, 2])[:1] == [9]
    assert ceiling.copy_continuation_at([4, 5, 6]) == []


def test_copy_oracle_pays_one_step_per_accepted_run(ceiling):
    unit = lambda n: 1.0  # noqa: E731 (every forward costs one: the cost counts steps)
    # the output repeats the prompt: after one plain step (nothing to copy from "9"), one step copies the rest
    assert ceiling.copy_oracle_cost([1, 2, 3, 9], [1, 2, 3, 9], unit) == 2.0
    # nothing ever repeats: one step per token
    assert ceiling.copy_oracle_cost([100], [1, 2, 3, 4, 5], unit) == 5.0
    # rows cost: the copied step of 4 tokens (3 drafted) costs cost(4)
    assert ceiling.copy_oracle_cost([1, 2, 3, 9], [1, 2, 3, 9], lambda n: 1.0 + 0.5 * (n - 1)) == 1.0 + 2.5


def test_copy_oracle_with_memory_copies_from_earlier_outputs(ceiling):
    unit = lambda n: 1.0  # noqa: E731
    # an earlier request's output holds what this one writes; its own prompt does not
    assert ceiling.copy_oracle_cost([100], [1, 2, 3, 4, 5], unit) == 5.0
    assert ceiling.copy_oracle_cost([100], [1, 2, 3, 4, 5], unit, memory=[[7, 1, 2, 3, 4, 5]]) == 2.0
    # a match of equal length: the request's own, more recent text wins ("1 2" -> 8, not 9)
    assert ceiling.copy_oracle_cost([1, 2, 8, 1, 2], [8, 0], unit, memory=[[1, 2, 9]]) == 1.0
    # a longer match in the memory wins ("3 1 2" -> 9); no match crosses from one output into the next
    assert ceiling.copy_oracle_cost([1, 2, 8, 3, 1, 2], [9, 7], unit) == 2.0
    assert ceiling.copy_oracle_cost([1, 2, 8, 3, 1, 2], [9, 7], unit, memory=[[3, 1, 2, 9], [7]]) == 1.0
    assert ceiling.copy_oracle_cost([5], [6, 7, 8], unit, memory=[[5, 6], [7, 8]]) == 2.0


def test_options(capsys):
    c = config("--workload", "similar", "--limit", "24", "--memory", "--categories", "a, b")
    assert (c.workload, c.limit, c.memory, c.max_new_tokens, c.save, c.categories) == (
        "similar", 24, True, 256, None, ["a", "b"])
    assert not config().memory and config().replay == []
    # the speed bench's flags are refused with --ceiling, and --ceiling's without it
    for argv, named in ((["--ceiling", "--peers", "hf"], "--peers"), (["--ceiling", "--repeats", "2"], "--repeats"),
                        (["--memory"], "--memory"), (["--save", "x.json"], "--save")):
        assert main(["bench", "-m", "tiny-random", *argv]) == 2
        assert named in capsys.readouterr().err


def test_report_is_what_the_results_page_reads(ceiling):
    from leapdecode.results import page as results_page

    c = config("--workload", "similar", "--limit", "4", "--memory", "--save", "x.json")
    spent = {"copy oracle": {"extract": 50.0, "tests": 20.0}, "copy oracle with memory": {"extract": 40.0, "tests": 20.0}}
    r = ceiling.report(c, "m", "similar (requests of one kind in a row)", "CPU A, 2 cores", ["avx2"],
                       {1: 1.0, 4: 1.5}, {"extract": 100, "tests": 40}, spent)
    assert r["ceilings"]["copy oracle"] == {"overall": 2.0, "by_group": {"extract": 2.0, "tests": 2.0}}
    assert r["ceilings"]["copy oracle with memory"]["overall"] == pytest.approx(140 / 60, abs=1e-4)
    assert r["relative_cost"] == {"1": 1.0, "4": 1.5} and r["tokens"] == 140
    key = ("CPU A (AVX2)", "m", "similar")
    assert results_page.latest_ceilings([r]) == {key: r}


def test_ceiling_end_to_end_tiny(tmp_path, capsys):
    """``bench --ceiling`` on a tiny model: vanilla's outputs kept (``--outputs``) and reused, the table
    printed, the report saved for the results page with the command that made it."""
    wl = tmp_path / "q.jsonl"
    wl.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Say hello.", "Again."]}) + "\n")
    argv = ["bench", "--ceiling", "-m", "tiny-random", "--dtype", "fp32", "--workload", str(wl), "--max-new-tokens",
            "6", "--memory", "--replay", "pld", "--outputs", str(tmp_path / "o.json"), "--save", str(tmp_path / "r.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "question 1: " in out and "| perfect drafter |" in out and "| replayed pld |" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["report"] == "draft-ceiling" and r["max_new_tokens"] == 6 and r["tokens"] > 0
    assert set(r["ceilings"]) == {"copy oracle", "copy oracle with memory", "perfect drafter"} and "pld" in r["replays"]
    assert r["ceilings"]["perfect drafter"]["overall"] >= 1.0
    assert main(argv) == 0  # the kept outputs: vanilla does not run again
    assert "question 1: " not in capsys.readouterr().out


@functools.lru_cache(maxsize=None)
def _brute(n: int, slope: float, max_draft: int) -> float:
    if n == 0:
        return 0.0
    return min(1.0 + slope * a + _brute(max(n - a - 1, 0), slope, max_draft) for a in range(max_draft))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), slope=st.sampled_from([0.0, 0.1, 0.35, 1.0, 2.0]))
def test_perfect_drafter_is_the_cheapest_split(ceiling, n, slope):
    cost = lambda k: 1.0 + slope * (k - 1)  # noqa: E731
    assert ceiling.perfect_cost(n, cost) == pytest.approx(_brute(n, slope, ceiling.MAX_DRAFT))
    assert ceiling.perfect_cost(n, cost) <= n  # never worse than vanilla (a = 0 every step)


def test_replay_follows_the_output_and_charges_each_tree(ceiling):
    """A replayed model-free method: each step's tree is verified against the output (the accepted
    path is the output's next tokens), a step costs cost(1 + tree size), and the proposer learns from
    the verdicts as in a generation."""
    from leapdecode.core.cost_model import VerifyCost

    free = VerifyCost([1, 64], [1.0, 1.0])  # rows cost nothing: sam drafts its whole continuation
    prompt = [5, 1, 2, 3, 4, 6, 7, 8, 9, 5]
    output = [1, 2, 3, 4, 6, 7, 8, 9, 11]  # the prompt's text again, then a new token
    make = ceiling.replay_proposer("sam:cost_aware=false:draft_len=16")
    total, steps = ceiling.replay_cost(make, prompt, output, lambda n: 1.0, free, max_new_tokens=64)
    # step 1 drafts the continuation after "5" (1 2 3 4 6 7 8 9 5 ...): 8 accepted, then 11 from the target
    assert (total, steps) == (1.0, 1)
    unit_rows = lambda n: float(n)  # noqa: E731 (each row costs a forward)
    total, steps = ceiling.replay_cost(make, prompt, output, unit_rows, free, max_new_tokens=64)
    assert steps == 1 and total == 1.0 + 16  # a 16-node chain (the copy runs past the prompt's end)
    # nothing to copy: one step per token, no tree
    total, steps = ceiling.replay_cost(make, [100], [1, 2, 3], unit_rows, free, max_new_tokens=64)
    assert (total, steps) == (3.0, 3)


def test_replay_stops_at_max_new_tokens_and_the_output_end(ceiling):
    from leapdecode.core.cost_model import VerifyCost

    free = VerifyCost([1, 64], [1.0, 1.0])
    make = ceiling.replay_proposer("pld:cost_aware=false")
    prompt, output = [1, 2, 3, 1, 2], [3, 1, 2, 3, 1, 2]
    # the budget shrinks near max_new_tokens: one step of 5 drafted nodes (all accepted) and the
    # target's 6th token, not the method's 24-node tree
    total, steps = ceiling.replay_cost(make, prompt, output, lambda n: float(n), free, max_new_tokens=len(output))
    assert (total, steps) == (6.0, 1)
    # an output that ends (its end-of-sequence token) before max_new_tokens: nothing past it is accepted
    total, steps = ceiling.replay_cost(make, prompt, output[:4], lambda n: 1.0, free, max_new_tokens=64)
    assert steps == 1 and total == 1.0


def test_replay_methods_are_model_free(ceiling):
    from leapdecode.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="needs the model"):
        ceiling.replay_proposer("eagle")
    with pytest.raises(InvalidParameterError, match="unknown method"):
        ceiling.replay_proposer("nonsense")
    c = config("--replay", "sam,pld", "--outputs", "o.json")
    assert c.replay == ["sam", "pld"] and str(c.outputs) == "o.json"


def test_replay_of_memory_uses_earlier_outputs(ceiling):
    """One runner memory per replayed row: suffix drafts a later request from an earlier output."""
    from leapdecode.core.cost_model import VerifyCost

    free = VerifyCost([1, 64], [1.0, 1.0])
    make = ceiling.replay_proposer("suffix:cost_aware=false")
    out = [7, 8, 9, 10, 11, 12, 13, 14]
    first = ceiling.replay_cost(make, [1], out, lambda n: 1.0, free, max_new_tokens=64)
    second = ceiling.replay_cost(make, [2], out, lambda n: 1.0, free, max_new_tokens=64)
    assert first[1] == len(out) and second[1] < first[1]


def test_outputs_file_is_reused_only_for_the_same_options(ceiling, tmp_path):
    from leapdecode.errors import InvalidParameterError

    said = []
    a = config("--limit", "4", "--outputs", str(tmp_path / "o.json"))
    assert ceiling.load_outputs(a, said.append) is None  # none yet
    (tmp_path / "o.json").write_text(json.dumps({"key": ceiling.outputs_key(a), "outputs": []}))
    assert ceiling.load_outputs(a, said.append)["outputs"] == [] and not said
    b = config("--limit", "5", "--outputs", str(tmp_path / "o.json"))
    assert ceiling.load_outputs(b, said.append) is None and "other options" in said[0]  # vanilla runs again
    (tmp_path / "o.json").write_text("{broken")
    with pytest.raises(InvalidParameterError, match="not a readable outputs file"):
        ceiling.load_outputs(a, said.append)


def test_the_script_is_the_bench_mode_with_its_own_default(monkeypatch):
    """scripts/draft_ceiling.py runs ``leapdecode bench --ceiling`` with 192 new tokens unless told, and
    its reports name it as their command."""
    import runpy
    import sys
    from pathlib import Path

    seen = []
    monkeypatch.setattr(ceiling_module, "run_ceiling", lambda cfg, say: seen.append(cfg))
    script = Path(__file__).resolve().parents[1] / "scripts" / "draft_ceiling.py"
    for argv, tokens in (([], 192), (["--limit", "2", "--max-new-tokens", "64"], 64)):
        monkeypatch.setattr(sys, "argv", ["scripts/draft_ceiling.py", *argv])
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
        assert done.value.code == 0 and seen[-1].max_new_tokens == tokens
    command = seen[-1].command  # (runpy puts the script's full path first)
    assert command.startswith("python ") and command.endswith("draft_ceiling.py --limit 2 --max-new-tokens 64")
