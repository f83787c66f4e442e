"""`leapdecode models list` in a pipe or a log (issue 61 item 6): every registered name whole, whatever
the width, so a newcomer can copy it; `--json` is the list as JSON."""

from __future__ import annotations

import json

import pytest

from leapdecode.cli import main
from leapdecode.models import registry


@pytest.mark.parametrize("columns", ["20", "40", "200"])
def test_models_list_in_a_pipe_shows_every_name_whole(monkeypatch, capsys, columns):
    monkeypatch.setenv("COLUMNS", columns)  # a narrow log or terminal: rich cut the names to `qwen2.5-coder-…`
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["name", "draft"]
    for name, entry in registry.REGISTRY.items():
        line = next((line for line in lines if line.split()[:1] == [name]), None)
        assert line is not None, f"{name} is not whole at the start of a line:\n{out}"
        assert line.split()[1] == (entry.draft or "-")  # the draft's name whole too
        assert entry.description in line


def test_models_list_json_parses(capsys):
    assert main(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(registry.REGISTRY)
    assert all({"description", "draft", "installed", "converted", "default"} <= set(r) for r in rows)


def test_models_json_is_an_option_of_list_only(capsys):
    assert main(["models", "verify", "smollm2-135m", "--json"]) == 2
    assert "--json is an option of `models list`" in capsys.readouterr().err
