"""The one request validator (``leapdecode/request.py``, issue 48 item 3): its rules, the field
path of every error, and the same message on the API, the command line and the server, each with
its own name for the field."""

from __future__ import annotations

import pytest

import leapdecode
from leapdecode.core.sampling import SamplingParams
from leapdecode.errors import GrammarError, InvalidParameterError
from leapdecode.request import GenerationRequest, RequestDefaults, RequestError, validate_request


# ---------------------------------------------------------------------------- the validator
def test_a_plain_request_has_the_defaults():
    r = validate_request()
    assert isinstance(r, GenerationRequest)
    assert r.method.method == "auto" and r.sampling == SamplingParams() and r.max_new_tokens == 256
    assert (r.stop, r.strategy, r.kv_policy, r.structure, r.constraint) == ((), None, None, None, None)
    r = validate_request(method="pld", options={"max_ngram": 4}, stop="END", temperature=0.5, seed=3,
                         regex="[a-z]+", max_new_tokens=9)
    assert (r.method.method, r.method.max_ngram, r.stop, r.sampling.temperature, r.sampling.seed) == \
        ("pld", 4, ("END",), 0.5, 3)
    assert r.structure == {"regex": "[a-z]+"} and r.max_new_tokens == 9


def test_a_strategy_defaults_to_vanilla_and_its_own_temperature():
    beam = validate_request(strategy="beam", strategy_options={"num_beams": 3})
    assert beam.method.method == "vanilla" and beam.strategy.num_beams == 3 and beam.sampling.temperature == 0
    server = RequestDefaults(temperature=1.0)
    assert validate_request(strategy="beam", defaults=server).sampling.temperature == 0  # deterministic: 0
    assert validate_request(strategy="cps-beam", defaults=server).sampling.temperature == 1.0
    assert validate_request(defaults=server).sampling.temperature == 1.0
    with pytest.raises(RequestError) as e:  # the API's default (0) with a sampling strategy
        validate_request(strategy="cps-beam")
    assert e.value.field == "temperature"


def test_front_end_defaults_apply_to_their_methods_only():
    d = RequestDefaults(method="pld", options={"max_ngram": 5}, every_method={"tree_budget": 7, "draft": "x"})
    r = validate_request(defaults=d)
    assert (r.method.method, r.method.max_ngram, r.method.tree_budget) == ("pld", 5, 7)
    r = validate_request(method="draft", defaults=d)  # not the default method: only every_method's
    assert (r.method.method, r.method.draft, r.method.tree_budget) == ("draft", "x", 7)
    r = validate_request(method="pld", options={"max_ngram": 3, "tree_budget": 2}, defaults=d)  # the request's win
    assert (r.method.max_ngram, r.method.tree_budget) == (3, 2)


@pytest.mark.parametrize("fields, path, words", [
    (dict(temperature=-1), "temperature", "temperature must be >= 0"),
    (dict(top_k=-1), "top_k", "top_k must be"),
    (dict(seed="x"), "seed", "seed must be"),
    (dict(max_new_tokens=0), "max_new_tokens", "max_new_tokens must be"),
    (dict(stop=[""]), "stop", "stop must be"),
    (dict(kv_policy="zip"), "kv_policy", "unknown kv_policy"),
    (dict(method="nope"), "method", "unknown method"),
    (dict(method="pld", options={"colour": 1}), "options.colour", "has no option 'colour'"),
    (dict(method="pld", options={"max_ngram": 0}), "options.max_ngram", "max_ngram"),
    (dict(method="pld", options={"min_ngram": 3, "max_ngram": 2}), "options", "min_ngram"),  # only together
    (dict(method="pld", options=[1]), "options", "mapping"),
    (dict(strategy="beams"), "strategy", "unknown strategy"),
    (dict(strategy="beam", strategy_options={"beams": 2}), "strategy_options.beams", "no option 'beams'"),
    (dict(strategy="beam", strategy_options={"num_return_sequences": 9}), "strategy_options.num_return_sequences",
     "num_return_sequences"),
    (dict(strategy_options={"num_beams": 2}), "strategy_options", "need a strategy"),
    (dict(strategy="beam", method="pld"), "method", "does not combine with method 'pld'"),
    (dict(strategy="beam", options={"tree_budget": 3}), "options.tree_budget", "does not combine with options.tree_budget"),
    (dict(strategy="best-of-n", temperature=1.0, options={"tree_budget": 3}), "options.tree_budget", "needs one"),
    (dict(strategy="beam", top_p=0.9), "top_p", "does not combine with top_p"),
    (dict(strategy="beam", stop="x"), "stop", "does not combine with stop"),
    (dict(strategy="beam", kv_policy="int8"), "kv_policy", "does not combine with kv_policy"),
    (dict(strategy="beam", regex="a"), "regex", "does not combine with regex"),
    (dict(strategy="best-of-n", temperature=1.0, json_schema={"type": "object"}), "json_schema",
     "does not combine with json_schema"),
    (dict(strategy="beam", temperature=0.5), "temperature", "deterministic"),
    (dict(regex="a", grammar="start: \"a\""), "grammar", "give at most one of regex and grammar"),
    (dict(json_schema={"type": "object"}, regex="a", grammar="g"), "regex",
     "give at most one of json_schema, regex and grammar"),
])
def test_every_error_names_its_field(fields, path, words):
    with pytest.raises(InvalidParameterError) as e:
        validate_request(**fields)
    assert e.value.field == path and words in str(e.value), (e.value.field, str(e.value))


def test_a_typed_error_keeps_its_type_and_gains_the_field():
    pytest.importorskip("jsonschema")
    with pytest.raises(GrammarError) as e:
        validate_request(json_schema={"type": "nonsense"})
    assert e.value.field == "json_schema" and "nonsense" in str(e.value)


def test_a_parallel_strategy_takes_a_method_and_its_options():
    r = validate_request(strategy="best-of-n", temperature=0.8, method="pld", options={"max_ngram": 3},
                         stop=["\n"], top_k=5)
    assert (r.method.method, r.method.max_ngram, r.strategy.strategy, r.stop, r.sampling.top_k) == \
        ("pld", 3, "best-of-n", ("\n",), 5)


def test_render_names_fields_in_a_front_ends_words():
    with pytest.raises(RequestError) as e:
        validate_request(strategy="beam", stop="x")
    assert e.value.render(lambda p: f"<{p}>") == "strategy 'beam' does not combine with <stop>"
    assert str(e.value) == e.value.render() == "strategy 'beam' does not combine with stop"
    plain = InvalidParameterError("top_k must be >= 0")
    assert plain.render(lambda p: "--" + p) == "top_k must be >= 0" and plain.field is None


# ---------------------------------------------------------------------------- three front ends, one message
# (the message with {} where the field is named; the field's name in the API, on the command line,
# on the server; the request on each)
CASES = [
    pytest.param("strategy 'beam' does not combine with {}", ("stop", "--stop", "stop"),
                 dict(strategy="beam", stop=["x"]), ["--strategy", "beam", "--stop", "x"],
                 {"stop": ["x"], "leapdecode": {"strategy": "beam"}}, id="search+stop"),
    pytest.param("strategy 'beam' does not combine with {} (a search scores every hypothesis with the target's "
                 "own forwards, method 'vanilla')", ("options.tree_budget", "--tree-budget", "leapdecode.tree_budget"),
                 dict(strategy="beam", options={"tree_budget": 3}), ["--strategy", "beam", "--tree-budget", "3"],
                 {"leapdecode": {"strategy": "beam", "tree_budget": 3}}, id="search+option"),
    pytest.param("strategy 'cps-beam' samples: give a {} > 0", ("temperature", "--temperature", "temperature"),
                 dict(strategy="cps-beam", temperature=0.0), ["--strategy", "cps-beam", "--temperature", "0"],
                 {"temperature": 0, "leapdecode": {"strategy": "cps-beam"}}, id="sampling-search+greedy"),
    pytest.param("strategy 'beam' does not combine with {}", ("json_schema", "--json-object", "response_format"),
                 dict(strategy="beam", json_schema={"type": "object"}), ["--strategy", "beam", "--json-object"],
                 {"response_format": {"type": "json_object"}, "leapdecode": {"strategy": "beam"}}, id="search+json"),
    pytest.param("strategy 'beam' does not combine with {}", ("top_k", "--top-k", "leapdecode.top_k"),
                 dict(strategy="beam", top_k=3), ["--strategy", "beam", "--top-k", "3"],
                 {"leapdecode": {"strategy": "beam", "top_k": 3}}, id="search+top_k"),
]


def _api_error(tiny_model, kwargs) -> InvalidParameterError:
    with pytest.raises(InvalidParameterError) as e:
        leapdecode.start_generation(tiny_model, "hi", max_new_tokens=4, **kwargs)
    return e.value


@pytest.mark.parametrize("template, names, api, argv, body", CASES)
def test_a_bad_combination_reads_the_same_on_every_front_end(template, names, api, argv, body, tiny, capsys,
                                                             no_loading):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from leapdecode import cli
    from leapdecode.server.app import create_app
    from leapdecode.server.config import ServeConfig

    api_name, cli_name, server_name = names
    model = tiny()
    assert str(_api_error(model, api)) == template.format(api_name)

    assert cli.main(["generate", "-m", "tiny-random", *argv, "hi"]) == 2  # refused before loading
    assert capsys.readouterr().err.strip() == "leapdecode: error: " + template.format(cli_name)

    app = create_app(model, ServeConfig(default_method="vanilla", max_queue=4, request_timeout=60))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": app.state.config.model_name, "prompt": "hi",
                                                 "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"], err["param"]) == (template.format(server_name), server_name)
    assert app.state.engine.counters["submitted"] == 0  # refused before queueing


def test_the_cli_and_the_server_validate_with_request_py(monkeypatch, tiny, no_loading):
    """Not a copy of the rules: with the validator's search rule removed, no front end refuses."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from leapdecode import cli_args, request
    from leapdecode.server.app import create_app
    from leapdecode.server.config import ServeConfig

    monkeypatch.setattr(request, "_check_search", lambda *a, **k: None)
    assert validate_request(strategy="beam", stop=["x"]).stop == ("x",)
    from leapdecode import cli

    a = cli.build_parser().parse_args(["generate", "--strategy", "beam", "--stop", "x", "hi"])
    assert cli_args.decoding_request(a).stop == ("x",)
    model = tiny()
    app = create_app(model, ServeConfig(default_method="vanilla", max_queue=4, request_timeout=60))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": app.state.config.model_name, "prompt": "hi",
                                                 "max_tokens": 2, "stop": ["x"], "leapdecode": {"strategy": "beam"}})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- a diffusion model's fields, once
TAKES = "its decoders are greedy and take "


@pytest.mark.parametrize("api, argv, names", [
    (dict(temperature=0.5), ["--temperature", "0.5"], ("temperature", "--temperature")),
    (dict(top_k=3, strategy="beam"), ["--top-k", "3", "--strategy", "beam"], ("top_k, strategy", "--top-k, --strategy")),
    (dict(num_return_sequences=2), ["--n", "2"], ("num_return_sequences", "--n")),
    (dict(strategy_options={"num_beams": 2}), ["--strategy-option", "num_beams=2"],
     ("strategy_options", "--strategy-option")),
])
def test_a_diffusion_model_refuses_the_same_fields_on_the_api_and_the_cli(api, argv, names, capsys):
    from leapdecode import cli

    with pytest.raises(RequestError) as e:
        leapdecode.generate("tiny-llada", "hi", max_new_tokens=4, **api)
    assert str(e.value).startswith(f"{names[0]}: not for a diffusion model ('tiny-llada'); {TAKES}method, options, ")
    assert cli.main(["generate", "-m", "tiny-llada", *argv, "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"leapdecode: error: {names[1]}: not for a diffusion model ('tiny-llada'); {TAKES}"
                          "--method, --option, --max-new-tokens"), err


def test_the_cli_maps_every_method_option_flag_a_diffusion_model_refuses(capsys):
    from leapdecode import cli

    for flag in ("--draft", "--tree-budget", "--datastore"):
        assert cli.main(["generate", "-m", "tiny-llada", flag, "3", "hi"]) == 2
        assert capsys.readouterr().err.strip().startswith(f"leapdecode: error: {flag}: not for a diffusion model")


def test_both_front_ends_take_the_rule_from_request_py(monkeypatch):
    """Not a copy: with ``temperature`` taken out of the rule, neither the API nor the CLI refuses it."""
    from leapdecode import cli_args, request

    monkeypatch.setattr(request, "DIFFUSION_UNSUPPORTED",
                        {k: v for k, v in request.DIFFUSION_UNSUPPORTED.items() if k != "temperature"})
    request.check_diffusion_fields({"temperature": 0.7}, "m")  # no error
    assert leapdecode.generate("tiny-llada", "hi", max_new_tokens=2, temperature=0.7).tokens is not None
    from leapdecode import cli

    a = cli.build_parser().parse_args(["generate", "-m", "tiny-llada", "--temperature", "0.7", "hi"])
    cli_args.check_diffusion_flags(a)  # no error
    with pytest.raises(RequestError, match="^top_k: not for a diffusion model"):
        request.check_diffusion_fields({"temperature": 0.7, "top_k": 2}, "m")
