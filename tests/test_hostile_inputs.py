"""Hostile inputs get clean, typed errors (issue 45, ../shared/probe/report.md; the probe ids are in
each test): text that is not valid UTF-8 (a JSON "\\ud800", or bytes the command line hands over as
surrogate escapes) and JSON nested deeper than Python's recursion limit."""

from __future__ import annotations

import json

import pytest

import leapdecode
from leapdecode import cli
from leapdecode.core.prompt import check_stop, encode_prompt
from leapdecode.errors import InvalidParameterError
from leapdecode.models.tiny import tiny_loaded

LONE = "hi \ud800 there"  # a lone surrogate: no UTF-8 encoding exists
ARGV_BYTES = "The capital \udcff\udcfe of France"  # b"\xff\xfe" as Python's argv decoding hands it over


@pytest.fixture(scope="module")
def lm():
    return tiny_loaded(seed=0)


@pytest.mark.parametrize("text", [LONE, ARGV_BYTES])
def test_a_prompt_that_is_not_utf8_is_named(lm, text):
    """Probes G071, PA30, PA31 (the API and the prompt), G074 (--chat)."""
    first = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    with pytest.raises(InvalidParameterError, match=f"the prompt is not valid UTF-8 .* at character {first}"):
        encode_prompt(lm, text)
    with pytest.raises(InvalidParameterError, match="message 1's content is not valid UTF-8"):
        encode_prompt(lm, [{"role": "system", "content": "be nice"}, {"role": "user", "content": text}])
    with pytest.raises(InvalidParameterError, match="not valid UTF-8"):
        leapdecode.generate(lm, text, max_new_tokens=2)
    assert encode_prompt(lm, "hi there")  # the check lets text through


def test_a_stop_string_that_is_not_utf8_is_named():
    """Probe G072-style: an invalid --stop could never match; it is refused."""
    with pytest.raises(InvalidParameterError, match="a stop string is not valid UTF-8"):
        check_stop(["ok", ARGV_BYTES])
    assert check_stop("ok") == ["ok"]


def test_the_cli_names_an_undecodable_prompt_in_one_line(capsys):
    """Probe G071: `leapdecode generate -m M $'The capital \\xff\\xfe of France'` raised a TypeError."""
    rc = cli.main(["generate", "-m", "tiny-random", "--max-new-tokens", "2", ARGV_BYTES])
    out, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "not valid UTF-8" in lines[0], lines


def test_a_deeply_nested_schema_is_a_grammar_error():
    """Probes SO016, SO017, PA36: a schema nested 2,000 (and 100,000) levels deep."""
    pytest.importorskip("jsonschema")  # the structured extra; make test installs it
    from leapdecode.errors import GrammarError
    from leapdecode.constraints.grammar import check_json_schema

    for depth in (2000, 100000):
        text = '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth
        with pytest.raises(GrammarError, match="nested too deeply"):
            check_json_schema(text)
    nested: dict = {}
    for _ in range(2000):
        nested = {"type": "object", "properties": {"a": nested}}
    with pytest.raises(GrammarError, match="nested too deeply"):
        check_json_schema(nested)


def test_a_schema_checks_budget_counts_the_check_not_the_childs_start(tmp_path, monkeypatch):
    """The schema checker's child (``constraints/isolated.py``) says when it is ready, and a check's
    time budget starts after that: a child slow to start (a loaded machine of few cores) does not fail
    the first request with "took more than ... to check"; a child that never starts is an error that
    says so."""
    pytest.importorskip("jsonschema")
    import uuid

    from leapdecode.constraints import isolated

    slow = tmp_path / "slow_child.py"  # starts in 1.5 s, then checks at once
    slow.write_text("import json, sys, time\ntime.sleep(1.5)\nprint(json.dumps({'ready': True}), flush=True)\n"
                    "for line in sys.stdin:\n    print(json.dumps({'ok': True}), flush=True)\n")
    monkeypatch.setattr(isolated, "CHILD", slow)
    checker = isolated.SchemaChecker(timeout_s=1.0)
    try:
        schema = {"type": "object", "title": f"startup {uuid.uuid4()}"}  # never checked before
        assert checker.check(schema) == schema and checker.checks == 1
    finally:
        checker.close()
    mute = tmp_path / "mute_child.py"
    mute.write_text("import time\ntime.sleep(30)\n")
    monkeypatch.setattr(isolated, "CHILD", mute)
    monkeypatch.setattr(isolated, "STARTUP_S", 0.5)
    checker = isolated.SchemaChecker(timeout_s=1.0)
    with pytest.raises(RuntimeError, match="did not start within 0.5 s"):
        checker.check({"type": "object", "title": f"mute {uuid.uuid4()}"})


def test_a_request_body_nested_too_deep_is_a_400():
    """Probe HS70: a body with arrays nested 10,000 deep was a 500 (RecursionError)."""
    from leapdecode.server.errors import ApiError
    from leapdecode.server.prepare import parse_json

    raw = ('{"model": "m", "foo": ' + "[" * 10000 + "]" * 10000 + "}").encode()
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert e.value.status == 400 and "nested too deeply" in e.value.message
    assert parse_json(json.dumps({"a": [[1]]}).encode()) == {"a": [[1]]}


@pytest.mark.parametrize("argv", [
    ["bench", "-m", "tiny-random", "--methods", "vanilla", "--limit", "1", "--max-new-tokens", "2", "--no-plots",
     "--no-progress", "--workload", "humaneval", "--out", "{file}"],                        # B19
    ["bench", "-m", "tiny-random", "--methods", "vanilla", "--limit", "1", "--max-new-tokens", "2", "--no-plots",
     "--no-progress", "--workload", "humaneval", "--out", "/proc/leapdecode-bench"],        # B13
    ["datastore", "build", "-m", "tiny-random", "-o", "/proc/x.npz", "{file}"],             # D05
    ["train-head", "-m", "tiny-random", "--kind", "medusa", "--out", "/proc/th", "--steps", "1",
     "--max-prompts", "1", "--no-install"],                                                  # T03
    ["heads", "export", "--storage", "bf16", "{head}", "/proc/hx"],                           # H04
    ["heads", "export", "--storage", "bf16", "{head}", "{file}"],                             # H07
])
def test_an_output_path_that_cannot_be_written_is_named_before_any_work(argv, tmp_path, capsys, monkeypatch):
    """Issue 45 (probes B13, B19, D05, T03, H04, H07): an output under an unwritable place, or onto
    an existing file where a directory is written, was a FileNotFoundError / FileExistsError
    traceback, after the model had loaded."""
    import leapdecode.models.loader as loader

    afile = tmp_path / "exists.txt"
    afile.write_text("mine")
    head = tmp_path / "head"
    head.mkdir()
    argv = [x.format(file=afile, head=head) for x in argv]
    monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded a model before checking --out"))
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ("--out" in lines[0] or "-o" in lines[0] or "OUT_DIR" in lines[0]), lines
    assert afile.read_text() == "mine"


def test_train_head_refuses_bad_layers_and_malformed_data_before_any_work(tmp_path, lm):
    """Issue 45 (probes T07, T11): `--eagle-layers 999` was refused only after the whole
    self-distillation; a malformed JSONL `--data` file was a JSONDecodeError traceback."""
    from leapdecode.training.train import Recipe, train_head

    with pytest.raises(InvalidParameterError, match="--eagle-layers"):
        train_head(lm, Recipe(kind="eagle3", eagle_layers=(999,)), tmp_path / "a", progress=False,
                   install_head=False, log=lambda m: pytest.fail(f"started work: {m}"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(InvalidParameterError, match="line 2"):
        train_head(lm, Recipe(kind="medusa", data=(str(bad),), steps=1, max_prompts=1), tmp_path / "b",
                   progress=False, install_head=False, log=lambda m: None)


def test_damaged_model_files_are_named(tmp_path):
    """Issue 45 (probes F17, F20, F21, F23, F24): a broken tokenizer.json, tokenizer_config.json or
    generation_config.json, or a chat template that does not parse, were raw tracebacks."""
    from safetensors.torch import save_file

    from leapdecode.errors import ModelFileError
    from leapdecode.models.tiny import byte_tokenizer, tiny_native

    model_dir = tmp_path / "m"
    model = tiny_native(seed=0)
    tok = byte_tokenizer()

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 259, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(model_dir)
    state = {"model.embed_tokens.weight": model.embed.weight.detach().clone(), "model.norm.weight": model.norm.detach().clone()}
    for i, b in enumerate(model.layers):
        q, k, v = b.wqkv.weight.detach().split((64, 32, 32))
        g, u = b.w_gate_up.weight.detach().chunk(2)
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": q.clone(), p + "self_attn.k_proj.weight": k.clone(),
                      p + "self_attn.v_proj.weight": v.clone(), p + "self_attn.o_proj.weight": b.wo.weight.detach().clone(),
                      p + "mlp.gate_proj.weight": g.clone(), p + "mlp.up_proj.weight": u.clone(),
                      p + "mlp.down_proj.weight": b.w_down.weight.detach().clone(),
                      p + "input_layernorm.weight": b.attn_norm.detach().clone(),
                      p + "post_attention_layernorm.weight": b.mlp_norm.detach().clone()})
    save_file(state, str(model_dir / "model.safetensors"))
    lm = leapdecode.load(str(model_dir), weights="fp32")
    assert encode_prompt(lm, [{"role": "user", "content": "hi"}])  # intact: loads and templates
    for fname, junk in (("tokenizer.json", "not a tokenizer"), ("tokenizer_config.json", "{broken"),
                        ("generation_config.json", "{broken")):
        saved = (model_dir / fname).read_bytes() if (model_dir / fname).exists() else None
        (model_dir / fname).write_text(junk)
        with pytest.raises(ModelFileError, match="is damaged"):
            leapdecode.load(str(model_dir), weights="fp32")
        if saved is None:
            (model_dir / fname).unlink()
        else:
            (model_dir / fname).write_bytes(saved)
    lm.tokenizer.chat_template = "{% for %}"
    with pytest.raises(ModelFileError, match="chat template is broken"):
        encode_prompt(lm, [{"role": "user", "content": "hi"}])
    lm.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidParameterError, match="refused these messages: roles must alternate"):
        encode_prompt(lm, [{"role": "user", "content": "hi"}])


def test_an_engine_panic_is_one_line_without_its_backtrace(tiny):
    """Probe HR21: a schema of 12,000 properties makes the grammar engine panic; the error names the
    limit in one line, without the Rust backtrace and build paths that a 400 would send a client."""
    pytest.importorskip("llguidance")
    from leapdecode.core.runner import ModelRunner
    from leapdecode.errors import GrammarError
    from leapdecode.constraints.grammar import compile_constraint

    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(12000)}}
    with pytest.raises(GrammarError) as e:
        compile_constraint(ModelRunner(tiny(seed=0)), json_schema=schema)
    msg = str(e.value)
    assert msg.startswith("the grammar engine failed on it, probably because it is too large")
    assert "<backtrace>" not in msg and "typeobject.c" not in msg and "\n" not in msg and len(msg) < 300


@pytest.mark.parametrize("structure", [{"regex": "(a{1000}){1000}"}, {"grammar": 'start: "x"{1000000}'}])
def test_a_grammar_the_engine_cannot_follow_is_a_grammar_error(tiny, structure, capsys, tmp_path):
    """Probes SO025-SO040 (SO026 is the nested regex here; the API's PA37, PA38; the server's HR11,
    HR17, HR19): a huge repetition compiles, then hits
    the engine's limits while generating: a GrammarError naming the limit (CLI exit 2), not a
    RuntimeError traceback."""
    pytest.importorskip("llguidance")
    import leapdecode
    from leapdecode.cli import main
    from leapdecode.errors import GrammarError

    with pytest.raises(GrammarError, match="hit one of its limits while generating"):
        leapdecode.generate(tiny(seed=0), "hi", max_new_tokens=8, **structure)
    flag, value = next(iter(structure.items()))
    if flag == "grammar":  # --grammar reads a file
        (tmp_path / "g.lark").write_text(value)
        value = str(tmp_path / "g.lark")
    assert main(["generate", "-m", "tiny-random", "--max-new-tokens", "8", f"--{flag}", value, "hi"]) == 2
    err = capsys.readouterr().err
    assert "error: the grammar engine hit one of its limits while generating" in err and "Traceback" not in err
