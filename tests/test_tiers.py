"""The test tiers (tests/conftest.py's table): every test file in exactly one tier, every test moved out of
its file's tier named by a function that exists, the tiers registered as markers in pyproject.toml, and
the rule that gives a test its tier."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest
from conftest import FILE_TIERS, TEST_TIERS, TIERS, pytest_ignore_collect, tier_of

TESTS = Path(__file__).resolve().parent


def tier_problems(files: list[str], file_tiers: dict[str, tuple[str, ...]]) -> list[str]:
    """What is wrong with ``file_tiers`` for the test files ``files``: a file in no tier or in two, a listed
    file that does not exist."""
    problems = []
    for name in files:
        tiers = [tier for tier, listed in file_tiers.items() if name in listed]
        if len(tiers) != 1:
            problems.append(f"{name} is in {len(tiers)} tiers {tiers}: list it under one in tests/conftest.py")
    for tier, listed in file_tiers.items():
        problems += [f"{name} (tier {tier}) is no test file" for name in set(listed) - set(files)]
        problems += [f"{name} is listed twice in tier {tier}" for name in set(listed) if listed.count(name) > 1]
    return problems


def test_every_test_file_is_in_exactly_one_tier():
    assert tuple(FILE_TIERS) == TIERS
    files = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert len(files) > 80
    assert tier_problems(files, FILE_TIERS) == []


def test_the_check_finds_a_file_in_no_tier_or_in_two():
    tiers = {"unit": ("test_a.py", "test_b.py"), "server": ("test_b.py", "test_gone.py")}
    assert tier_problems(["test_a.py", "test_b.py", "test_c.py"], tiers) == [
        "test_b.py is in 2 tiers ['unit', 'server']: list it under one in tests/conftest.py",
        "test_c.py is in 0 tiers []: list it under one in tests/conftest.py",
        "test_gone.py (tier server) is no test file"]


def test_every_test_moved_out_of_its_files_tier_exists():
    for key, tier in TEST_TIERS.items():
        file, function = key.split("::")
        path = TESTS / file
        assert path.exists(), key
        names = {n.name for n in ast.parse(path.read_text(encoding="utf-8")).body
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert function in names, f"{key}: no such test (renamed? update TEST_TIERS in tests/conftest.py)"
        assert tier in TIERS and tier_of(file, "", set()) != tier, key


def test_the_tiers_are_the_registered_tier_markers():
    config = tomllib.loads((TESTS.parent / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]
    markers = [line.split(":")[0] for line in config["ini_options"]["markers"] if ": tier:" in line]
    assert tuple(markers) == TIERS
    assert "--strict-markers" in config["ini_options"]["addopts"].split()


def test_a_tests_own_marker_then_the_test_table_then_its_file_give_its_tier(monkeypatch):
    monkeypatch.setattr(conftest, "FILE_TIERS", {"unit": ("test_a.py",), "server": ("test_b.py",)})
    monkeypatch.setattr(conftest, "TEST_TIERS", {"test_a.py::test_slow": "exactness"})
    assert tier_of("test_a.py", "test_fast", set()) == "unit"
    assert tier_of("test_a.py", "test_slow", set()) == "exactness"
    assert tier_of("test_a.py", "test_slow", {"integration"}) == "integration"
    assert tier_of("test_b.py", "test_x", set()) == "server"
    assert tier_of("test_c.py", "test_x", set()) is None
    with pytest.raises(pytest.UsageError, match="two tiers"):
        tier_of("test_a.py", "test_fast", {"unit", "server"})


def test_one_tier_alone_skips_importing_the_files_without_its_tests(monkeypatch, tmp_path):
    monkeypatch.setattr(conftest, "FILE_TIERS", {**{t: () for t in TIERS}, "unit": ("test_a.py",),
                                                 "kernels": ("test_b.py", "test_c.py", "test_d.py")})
    monkeypatch.setattr(conftest, "TEST_TIERS", {"test_c.py::test_quick": "unit"})
    for name, text in [("test_a.py", ""), ("test_b.py", ""), ("test_c.py", ""),
                       ("test_d.py", "@pytest.mark.unit\ndef test_quick(): pass\n")]:
        (tmp_path / name).write_text(text)

    def ignored(name, markexpr):
        return pytest_ignore_collect(tmp_path / name, SimpleNamespace(getoption=lambda opt, default: markexpr))

    files = ("test_a.py", "test_b.py", "test_c.py", "test_d.py")
    assert [ignored(n, "unit") for n in files] == [None, True, None, None]
    assert ignored("test_a.py", "kernels") is True and ignored("test_b.py", "kernels") is None
    assert ignored("test_b.py", "not integration") is None and ignored("test_b.py", "") is None
