"""Typed method configs (``core/config.py``, ``proposers/registry.py``).

Every method's config, every option: an unknown option, a value of the wrong type (a string
for an integer, ``True`` for an integer, NaN) or out of range is an ``InvalidParameterError``
naming the option and the method; ``parse_option`` turns CLI text into each option's type;
``generate`` validates options before any model work; the sampling ``top_k`` and the draft
method's ``top_k`` option are separate; docs/methods.md lists exactly the configs' options.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path

import pytest

import leapdecode
from leapdecode.core.config import MethodConfig, parse_option_assignments
from leapdecode.errors import InvalidParameterError
from leapdecode.proposers import DEFAULT_METHOD, METHODS, method_config, method_spec

DOC = Path(__file__).resolve().parents[1] / "docs" / "methods.md"
CONFIGS = [(name, spec.config) for name, spec in METHODS.items()]
CONFIG_IDS = [name for name, _ in CONFIGS]


def fields_of(cfg_cls):
    """(field, concrete types, nullable) of every option of a config class."""
    hints = typing.get_type_hints(cfg_cls)
    out = []
    for f in dataclasses.fields(cfg_cls):
        ann = hints[f.name]
        args = typing.get_args(ann) if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,)
        concrete = tuple(typing.get_origin(a) or a for a in args if a is not type(None))
        out.append((f, concrete, type(None) in args))
    return out


ALL_FIELDS = [(name, cls, f, kinds, nullable) for name, cls in CONFIGS for f, kinds, nullable in fields_of(cls)]
FIELD_IDS = [f"{name}.{f.name}" for name, _, f, _, _ in ALL_FIELDS]


def raises_naming(option: str, method: str, fn, /, *args, **kwargs) -> str:
    with pytest.raises(InvalidParameterError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert f"'{option}'" in msg, (option, msg)
    assert f"'{method}'" in msg, (method, msg)
    return msg


# ============================================================================ the registry
def test_every_method_has_a_config_and_a_builder():
    assert DEFAULT_METHOD == "auto" and DEFAULT_METHOD in METHODS
    for name, spec in METHODS.items():
        assert spec.name == name and spec.config.method == name
        assert issubclass(spec.config, MethodConfig) and callable(spec.build) and spec.summary
        assert method_spec(name) is spec
        # every config has tree_budget, and defaults that validate
        assert "tree_budget" in spec.config.option_names()
        cfg = spec.config()
        assert spec.config.from_options(cfg.as_dict()) == cfg
        assert method_config(name) == cfg and method_config(cfg) is cfg
    assert {n for n, s in METHODS.items() if s.uses_draft_model} == {"auto", "draft"}
    assert "draft" in METHODS["draft"].config.option_names() and "draft" in METHODS["auto"].config.option_names()


def test_unknown_method_lists_the_methods():
    with pytest.raises(InvalidParameterError) as e:
        method_config("bogus")
    for name in METHODS:
        assert name in str(e.value)
    with pytest.raises(InvalidParameterError):
        method_spec(None)


@pytest.mark.parametrize("method,cls", CONFIGS, ids=CONFIG_IDS)
def test_unknown_option_names_the_option_and_the_method(method, cls):
    raises_naming("bogus_option", method, cls.from_options, {"bogus_option": 1})
    raises_naming("bogus_option", method, method_config, method, {"bogus_option": 1})
    msg = raises_naming("bogus_option", method, method_config, method, {"tree_budget": 3, "bogus_option": 1})
    for opt in cls.option_names():  # and says which options there are
        assert opt in msg
    raises_naming("bogus_option", method, cls.parse_option, "bogus_option", "1")
    with pytest.raises(InvalidParameterError, match="must be strings"):
        cls.from_options({3: 1})
    with pytest.raises(TypeError):  # the constructor itself is keyword-only and strict
        cls(bogus_option=1)


def test_options_must_be_a_mapping():
    for bad in ("k=3", [("k", 3)], 5):
        with pytest.raises(InvalidParameterError, match="options"):
            method_config("jacobi", bad)


# ============================================================================ wrong types
def wrong_values(kinds: tuple, nullable: bool) -> list:
    """Values of the wrong type for an option of these types."""
    out: list = []
    if int in kinds and float not in kinds:
        out += ["3", True, False, 2.5, math.nan, [3]]
    elif float in kinds:
        out += ["0.5", True, math.nan, math.inf, -math.inf, [0.5]]
    elif bool in kinds:
        out += ["true", 1, 0, 1.0, None if not nullable else "yes"]
    elif str in kinds:
        out += [5, True, 1.5, ["a"]]
    elif list in kinds:
        out += ["[[1, 2]]", 5, True, {"a": 1}]
    if not nullable and None not in out:
        out.append(None)
    return out


@pytest.mark.parametrize("method,cls,field,kinds,nullable", ALL_FIELDS, ids=FIELD_IDS)
def test_a_value_of_the_wrong_type_names_the_option(method, cls, field, kinds, nullable):
    values = wrong_values(kinds, nullable)
    assert values, (field.name, kinds)
    for value in values:
        raises_naming(field.name, method, cls.from_options, {field.name: value})
        raises_naming(field.name, method, method_config, method, {field.name: value})


def out_of_range(field, kinds) -> list:
    meta = field.metadata
    low, high, low_open, choices = meta.get("low"), meta.get("high"), meta.get("low_open"), meta.get("choices")
    integer = int in kinds and float not in kinds
    out = []
    if low is not None:
        out.append(low if low_open else (low - 1 if integer else low - 0.5))
        out.append(low - 100)
    if high is not None:
        out.append(high + 1 if integer else high + 0.5)
    if choices:
        out.append("not-a-choice")
    return out


RANGED = [(m, c, f, k, n) for m, c, f, k, n in ALL_FIELDS if out_of_range(f, k)]


@pytest.mark.parametrize("method,cls,field,kinds,nullable", RANGED, ids=[f"{m}.{f.name}" for m, _, f, _, _ in RANGED])
def test_a_value_out_of_range_names_the_option(method, cls, field, kinds, nullable):
    for value in out_of_range(field, kinds):
        raises_naming(field.name, method, cls.from_options, {field.name: value})
    # the bounds themselves are fine (with the option an upper bound of another set low enough)
    meta = field.metadata
    partner = {}
    if field.name.startswith("max_") and "min_" + field.name[4:] in cls.option_names():
        partner = {"min_" + field.name[4:]: 1}
    if meta.get("low") is not None and not meta.get("low_open"):
        assert getattr(cls.from_options({field.name: meta["low"], **partner}), field.name) == meta["low"]
    if meta.get("high") is not None:
        assert getattr(cls.from_options({field.name: meta["high"]}), field.name) == meta["high"]


def test_every_numeric_option_has_a_lower_bound():
    """Counts, lengths and sizes below their minimum would reach a proposer unchecked."""
    for method, cls, field, kinds, nullable in ALL_FIELDS:
        if (int in kinds or float in kinds) and bool not in kinds:
            assert field.metadata.get("low") is not None, f"{method}.{field.name} has no lower bound"


@pytest.mark.parametrize("method,options,option", [
    ("draft", {"min_draft_len": 5, "max_draft_len": 4}, "min_draft_len"),
    ("pld", {"min_ngram": 5, "max_ngram": 4}, "min_ngram"),
    ("rest", {"min_suffix": 5, "max_suffix": 4}, "min_suffix"),
])
def test_options_that_bound_each_other(method, options, option):
    raises_naming(option, method, method_config, method, options)
    ok = {k: v - 1 if k.startswith("min") else v for k, v in options.items()}
    assert method_config(method, ok).as_dict().items() >= ok.items()


def test_a_config_object_as_the_method():
    cfg = METHODS["pld"].config(max_ngram=3)
    assert method_config(cfg) is cfg
    merged = method_config(cfg, {"draft_len": 7})
    assert (merged.max_ngram, merged.draft_len) == (3, 7)
    raises_naming("max_ngram", "pld", method_config, cfg, {"max_ngram": 0})
    raises_naming("max_ngram", "pld", cfg.replace, max_ngram=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_ngram = 5


# ============================================================================ parse_option
def option_text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if isinstance(value, list):
        return repr(value)
    return str(value)


@pytest.mark.parametrize("method,cls,field,kinds,nullable", ALL_FIELDS, ids=FIELD_IDS)
def test_parse_option_round_trips_the_default(method, cls, field, kinds, nullable):
    value = cls.parse_option(field.name, option_text(field.default))
    assert value == field.default and type(value) is type(field.default), (value, field.default)
    assert getattr(cls.from_options({field.name: value}), field.name) == field.default


def test_parse_option_types():
    draft, layerskip, sam = METHODS["draft"].config, METHODS["layerskip"].config, METHODS["sam"].config
    assert draft.parse_option("top_k", "3") == 3 and type(draft.parse_option("top_k", "3")) is int
    assert draft.parse_option("tau", "0.25") == 0.25
    assert draft.parse_option("tau", "1e-2") == 0.01
    for text, want in (("true", True), ("True", True), ("yes", True), ("on", True), ("1", True),
                       ("false", False), ("no", False), ("off", False), ("0", False)):
        assert draft.parse_option("staged", text) is want, text
    assert draft.parse_option("context_window", "none") is None
    assert draft.parse_option("context_window", "null") is None
    assert draft.parse_option("context_window", "64") == 64
    assert draft.parse_option("draft", "tiny-random:1") == "tiny-random:1"
    assert draft.parse_option("draft", "None") is None
    assert layerskip.parse_option("skip", "0.5") == 0.5 and layerskip.parse_option("skip", "3") == 3.0
    assert sam.parse_option("occurrence", "first") == "first"
    assert sam.parse_option("corpus_tokens", "[[1, 2], [3]]") == [[1, 2], [3]]
    assert METHODS["pld"].config.parse_option("tree_budget", "none") is None
    for cls, key, text in ((draft, "top_k", "abc"), (draft, "top_k", "2.5"), (draft, "staged", "maybe"),
                           (draft, "tau", "fast"), (sam, "corpus_tokens", "[1, 2"), (draft, "top_k", "none")):
        raises_naming(key, cls.method, cls.parse_option, key, text)


def test_parse_option_assignments():
    pld = METHODS["pld"].config
    assert parse_option_assignments(pld, ["max_ngram=3", " draft_len = 5 ", "tree_budget=none"]) == {
        "max_ngram": 3, "draft_len": 5, "tree_budget": None}
    assert parse_option_assignments(pld, None) == {} == parse_option_assignments(pld, [])
    for bad in (["max_ngram"], ["=3"], ["max_ngram3"]):
        with pytest.raises(InvalidParameterError, match="KEY=VALUE"):
            parse_option_assignments(pld, bad)
    raises_naming("nope", "pld", parse_option_assignments, pld, ["nope=1"])
    # parsed but out of range: caught when the config is built
    raises_naming("max_ngram", "pld", pld.from_options, parse_option_assignments(pld, ["max_ngram=0"]))


# ============================================================================ before any model work
@pytest.fixture
def no_model_work(monkeypatch):
    """Make every step of a generation that touches a model fail loudly if reached."""
    import leapdecode.api as api
    from leapdecode.models import loader

    def reached(*args, **kwargs):
        raise AssertionError("model work started before the options were validated")

    for name in ("runner_for", "encode_prompt", "build_proposer", "Generation"):
        monkeypatch.setattr(api, name, reached)
    monkeypatch.setattr(loader, "load", reached)
    return reached


@pytest.mark.parametrize("method,options,option", [
    ("vanilla", {"bogus": 1}, "bogus"),
    ("pld", {"bogus": 1}, "bogus"),
    ("pld", {"max_ngram": 0}, "max_ngram"),
    ("draft", {"draft": "no-such-model", "bogus": 1}, "bogus"),  # before the draft would load
    ("draft", {"draft": "no-such-model", "top_k": 0}, "top_k"),
    ("rest", {"datastore": "/no/such/file.npz", "max_suffix": True}, "max_suffix"),
    ("auto", {"explore": math.nan}, "explore"),
    ("layerskip", {"skip": "2"}, "skip"),
])
def test_generate_validates_options_before_any_model_work(tiny, no_model_work, method, options, option):
    model = tiny(seed=0)
    raises_naming(option, method, leapdecode.generate, model, "hi", max_new_tokens=4, method=method,
                  options=options)
    raises_naming(option, method, leapdecode.stream, model, "hi", method=method, options=options)
    raises_naming(option, method, leapdecode.start_generation, model, "hi", method=method, options=options)


def test_a_bad_sampling_parameter_is_caught_before_model_work(tiny, no_model_work):
    with pytest.raises(InvalidParameterError, match="top_k"):
        leapdecode.generate(tiny(seed=0), "hi", top_k=-1, method="pld")
    with pytest.raises(InvalidParameterError, match="method"):
        leapdecode.generate(tiny(seed=0), "hi", method="bogus")


# ============================================================================ two top_k's
def test_sampling_top_k_and_the_draft_top_k_option_are_separate(tiny, fresh_runner):
    model = tiny(seed=0)
    prompt = "the cat sat on the mat; the cat sat on the mat"
    want = leapdecode.generate(model, prompt, max_new_tokens=24, method="vanilla")
    gen = leapdecode.start_generation(fresh_runner(model), prompt, max_new_tokens=24, method="draft", top_k=0,
                                      options={"top_k": 2, "draft": "tiny-random:1"})
    got = gen.run()
    assert got.tokens == want.tokens and got.text == want.text
    assert gen.params.top_k == 0  # sampling: no top-k truncation
    assert gen.proposer.top_k == 2  # the draft tree: two children per node
    # the same through generate()
    res = leapdecode.generate(model, prompt, max_new_tokens=24, method="draft", top_k=0,
                              options={"top_k": 2, "draft": "tiny-random:1"})
    assert res.tokens == want.tokens
    # each is validated on its own terms: top_k=0 is fine for sampling, not for the draft tree
    raises_naming("top_k", "draft", leapdecode.generate, model, prompt, method="draft", top_k=5,
                  options={"top_k": 0, "draft": "tiny-random:1"})
    with pytest.raises(InvalidParameterError, match="top_k") as e:
        leapdecode.generate(model, prompt, method="draft", top_k=-1, options={"top_k": 2, "draft": "tiny-random:1"})
    assert "'draft'" not in str(e.value)  # a sampling error, not the method's option


# ============================================================================ docs/methods.md
def doc_option_tables(text: str) -> dict[str, list[tuple[str, str]]]:
    """``{method: [(option, default), ...]}`` from the ``### `method` options`` tables."""
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^### `([a-z_]+)` options\s*$", line)
        if m:
            current = m.group(1)
            out[current] = []
            continue
        if line.startswith("#"):
            current = None
        m = re.match(r"^\| `([a-z_]+)` \| `([^`]*)` \|", line)
        if current is not None and m:
            out[current].append((m.group(1), m.group(2)))
    return out


def doc_summary_options(text: str) -> dict[str, set[str]]:
    """``{method: {option, ...}}`` named in the last column of the methods summary table."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^\| `([a-z_]+)`( \([^|]*\))? \|", line)
        if not m or m.group(1) not in METHODS:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4:
            continue
        out.setdefault(m.group(1), set()).update(re.findall(r"`([a-z_]+)`", cells[-1]))
    return out


def test_docs_option_tables_match_the_configs():
    text = DOC.read_text()
    tables = doc_option_tables(text)
    if not tables:  # not generated yet: the configs' own tables must at least be complete
        pytest.fail("docs/methods.md has no generated option tables (`leapdecode methods --markdown`)")
    assert set(tables) == set(METHODS), (sorted(tables), sorted(METHODS))
    for name, spec in METHODS.items():
        want = [(opt, default) for opt, default, _ in spec.config.options_table()]
        assert tables[name] == want, (name, tables[name], want)
        assert [opt for opt, _ in want] == spec.config.option_names()


def test_docs_summary_table_names_only_real_options():
    summary = doc_summary_options(DOC.read_text())
    assert set(summary) == set(METHODS), sorted(summary)
    for name, options in summary.items():
        unknown = options - set(METHODS[name].config.option_names())
        assert not unknown, f"docs/methods.md's summary table lists {sorted(unknown)} for {name!r}: not options"


def test_options_table_rows():
    for name, spec in METHODS.items():
        rows = spec.config.options_table()
        assert [r[0] for r in rows] == spec.config.option_names()
        for opt, default, help_text in rows:
            assert help_text, f"{name}.{opt} has no help text"
            field = next(f for f in dataclasses.fields(spec.config) if f.name == opt)
            # (tree_budget's None means the method's own budget, which the table shows instead)
            want = spec.config.tree_budget_default_text() if opt == "tree_budget" else repr(field.default)
            assert default == want
