"""The GPU head recipe's prompt mix (scripts/head_prompt_mix.py): nothing from the prompts that
acceptance is reported on, the same mix for the same seed, follow-ups only on translations, and
an atomic gzipped JSONL."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from leapdecode.bench.workloads import held_apart
from leapdecode.training.data import humaneval_prompts

from helpers.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "head_prompt_mix.py"


@pytest.fixture(scope="module")
def mix():
    return load_script("head_prompt_mix")


@pytest.fixture(scope="module")
def items(mix):
    return mix.build(seed=3, math_n=40, code_n=60)


@pytest.fixture(scope="module")
def with_general(mix):
    return mix.build(seed=3, math_n=40, code_n=60, general_n=80)


def _text(item: dict) -> str:
    return item.get("chat") or item.get("prompt") or ""


def test_no_held_apart_humaneval_prompt_is_in_the_mix(items):
    he = humaneval_prompts()
    held = [p for i, p in enumerate(he) if held_apart(i)]
    trained = [p for i, p in enumerate(he) if not held_apart(i)]
    assert held and trained
    texts = [_text(it) for it in items]
    for p in held:
        assert not any(p.strip() in t for t in texts), p[:60]
    # the other HumanEval prompts are there, as completions and as chat requests
    assert sum(any(p.strip() in t for t in texts) for p in trained) == len(trained)
    assert sum("prompt" in it for it in items) == len(trained)


def test_every_kind_is_present_and_follow_ups_are_translations(items):
    chats = [it["chat"] for it in items if "chat" in it]
    assert any(c.startswith(("Write a Python function `", "Implement `")) for c in chats)  # stdlib functions
    assert any("step by step" in c or "final answer" in c or "each step" in c for c in chats)  # arithmetic
    assert any("Summarize" in c for c in chats)  # documentation paragraphs
    follow = [it for it in items if "then" in it]
    assert follow
    for it in follow:
        assert "Translate the following text into" in it["chat"]
        assert "{a}" in it["then"] and "English" in it["then"]
    assert all(set(it) <= {"chat", "prompt", "then"} and len(_text(it)) > 10 for it in items)


def test_general_prompts_cover_topics_and_two_round_tasks(mix, items, with_general):
    extra = [it for it in with_general if it not in items]
    assert len(extra) == 80
    assert len({t for t in mix.TOPICS if any(t in it["chat"] for it in extra)}) > 20
    assert len({it["chat"] for it in extra}) == 80  # distinct
    two = [it for it in extra if "then" in it]
    assert two and all("{a}" in it["then"] for it in two)
    everything = mix.general_items(__import__("random").Random(0), 10**6)
    assert len(everything) == len(mix.TOPICS) * (len(mix.GENERAL) + len(mix.TWO_ROUND))
    assert {it["then"] for it in everything if "then" in it} == {then for _, then in mix.TWO_ROUND}
    # the default mix (what the bundled head's run used) has none of them
    assert not any(any(t in it.get("chat", "") for t in ("Compose a short poem", "tour guide")) for it in items)


def test_same_seed_same_mix_other_seed_other_order(mix, items):
    assert mix.build(seed=3, math_n=40, code_n=60) == items
    other = mix.build(seed=4, math_n=40, code_n=60)
    assert other != items


def test_math_problems_vary(mix):
    import random

    rng = random.Random(0)
    probs = {mix.math_problem(rng) for _ in range(50)}
    assert len(probs) > 45


def test_cli_writes_a_gzipped_jsonl_atomically(tmp_path):
    out = tmp_path / "sub" / "prompts.jsonl.gz"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--math", "5", "--code", "5"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in gzip.open(out, "rt", encoding="utf-8")]
    assert len(lines) > 100 and str(len(lines)) in r.stdout
    assert not list(out.parent.glob("*.tmp"))
