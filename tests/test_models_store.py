"""The model cache's integrity checks and ``load()``'s answers to bad input: corrupt
safetensors files, a cache path that is a file, non-string names, unavailable devices,
the hub download leaving the process environment alone, and ``LoadedModel`` identity."""

from __future__ import annotations

import json
import os
import struct
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from leapdecode.errors import InvalidParameterError, LeapdecodeError, ModelFileError, UnknownModelError
from leapdecode.models import loader, store
from leapdecode.models.loader import LoadedModel, load, resolve_device


def _weights(path: Path) -> Path:
    save_file({"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)},
              str(path), metadata={"format": "pt"})
    return path


def _hf_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _weights(root / "model.safetensors")
    return root


# ----------------------------------------------------------------------- safetensors header check
def test_valid_safetensors_passes(tmp_path):
    assert store.safetensors_problem(_weights(tmp_path / "w.safetensors")) is None
    empty = tmp_path / "none.safetensors"
    save_file({}, str(empty))
    assert store.safetensors_problem(empty) is None


@pytest.mark.parametrize("cut", [1, 8, 100, None])
def test_truncated_safetensors_is_caught(tmp_path, cut):
    f = _weights(tmp_path / "w.safetensors")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1] if cut is None else data[:cut])
    problem = store.safetensors_problem(f)
    assert problem is not None and "truncated" in problem


def test_padded_or_garbled_safetensors_is_caught(tmp_path):
    f = _weights(tmp_path / "w.safetensors")
    good = f.read_bytes()
    f.write_bytes(good + b"\0" * 4)
    assert "declares" in store.safetensors_problem(f)
    (n,) = struct.unpack("<Q", good[:8])
    f.write_bytes(good[:8] + b"{" + b"x" * (n - 1) + good[8 + n:])  # header is not JSON
    assert "corrupt header" in store.safetensors_problem(f)
    header = json.loads(good[8:8 + n])
    header["a"]["shape"] = [3, 5]  # the byte range no longer fits the shape
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    f.write_bytes(good[:8] + raw + good[8 + n:])
    assert "'a'" in store.safetensors_problem(f)
    f.write_bytes(b"")
    assert "truncated" in store.safetensors_problem(f)


def test_weights_problem_names_the_bad_shard(tmp_path):
    _weights(tmp_path / "model-00001-of-00002.safetensors")
    bad = _weights(tmp_path / "model-00002-of-00002.safetensors")
    assert store.weights_problem(tmp_path) is None
    bad.write_bytes(bad.read_bytes()[:-10])
    got = store.weights_problem(tmp_path)
    assert got is not None and got[0] == bad


# ----------------------------------------------------------------------- corrupt local model directories
def test_load_reports_a_truncated_local_model_file(tmp_path):
    d = _hf_dir(tmp_path / "my-model")
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-7])
    with pytest.raises(ModelFileError) as err:
        load(str(d))
    msg = str(err.value)
    assert str(w) in msg and "truncated" in msg and "again" in msg


def test_hub_snapshot_is_checked_too(tmp_path, monkeypatch):
    import huggingface_hub

    d = _hf_dir(tmp_path / "snap")
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes() + b"junk")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(d))
    with pytest.raises(ModelFileError) as err:
        loader._download_from_hub("org/model")
    assert str(w) in str(err.value) and "org/model" in str(err.value)


# ----------------------------------------------------------------------- the hub download and os.environ
def test_hub_download_leaves_the_environment_alone(monkeypatch):
    import huggingface_hub

    for var in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    seen = {}

    def offline(repo_id, **kw):
        seen.update(kw)
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    before = dict(os.environ)
    with pytest.raises(UnknownModelError, match="org/model"):
        loader._download_from_hub("org/model")
    assert dict(os.environ) == before
    assert seen["etag_timeout"] == loader.HUB_ETAG_TIMEOUT_S
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "42")  # the user's own setting wins
    with pytest.raises(UnknownModelError):
        loader._download_from_hub("org/model")
    assert seen["etag_timeout"] == 42


# ----------------------------------------------------------------------- bad arguments to load()
@pytest.mark.parametrize("name", [123, None, 1.5, ["tiny-random"], b"tiny-random", "", "   "])
def test_load_rejects_a_bad_model_argument(name):
    with pytest.raises(InvalidParameterError) as err:
        load(name)
    assert "model" in str(err.value)


def test_load_accepts_a_path_object(tmp_path):
    d = _hf_dir(tmp_path / "p")
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFileError, match="truncated"):  # got past the argument check
        load(d)


def test_cuda_unavailable_is_an_invalid_parameter(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(InvalidParameterError, match="CUDA is not available"):
            resolve_device(dev)
    with pytest.raises(InvalidParameterError, match="CUDA is not available"):
        load("tiny-random", device="cuda")
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("dev", ["gpu", "cuda:x", "", "cpu:zero", 1.5])
def test_unknown_device_is_an_invalid_parameter(dev):
    with pytest.raises(InvalidParameterError, match="device"):
        resolve_device(dev)
    with pytest.raises(InvalidParameterError):
        load("tiny-random", device=dev)


def test_cuda_index_out_of_range(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(InvalidParameterError, match="1 CUDA device"):
        resolve_device("cuda:3")


def test_cpu_still_resolves():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert load("tiny-random", device="cpu", dtype="fp32").device == torch.device("cpu")


def test_unknown_dtype_type_is_an_invalid_parameter():
    with pytest.raises(InvalidParameterError, match="dtype"):
        loader.resolve_dtype(["bf16"], torch.device("cpu"))


# ----------------------------------------------------------------------- the cache path is a file
def test_cache_path_that_is_a_file(tmp_path, monkeypatch):
    f = tmp_path / "cachefile"
    f.write_text("not a directory")
    monkeypatch.setenv("LEAPDECODE_CACHE", str(f))
    with pytest.raises(LeapdecodeError) as err:
        load("smollm2-135m")
    assert isinstance(err.value, ModelFileError)
    assert "LEAPDECODE_CACHE" in str(err.value) and str(f) in str(err.value)
    with pytest.raises(ModelFileError, match="LEAPDECODE_CACHE"):
        with store.lock("x"):
            pass
    assert f.read_text() == "not a directory"


def test_cache_dir_unset_and_default_is_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("LEAPDECODE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "leapdecode").write_text("")
    with pytest.raises(ModelFileError) as err:
        store.cache_dir()
    assert "LEAPDECODE_CACHE" in str(err.value) and str(tmp_path / ".cache" / "leapdecode") in str(err.value)


# ----------------------------------------------------------------------- LoadedModel identity
def test_loaded_model_compares_and_hashes_by_identity():
    a = LoadedModel(name="m", model=None, tokenizer=None)
    b = LoadedModel(name="m", model=None, tokenizer=None)
    assert a == a and a != b and len({a, b}) == 2
    table = weakref.WeakKeyDictionary()
    table[a] = 1
    table[b] = 2
    assert table[a] == 1 and table[b] == 2
    del b
    assert len(table) == 1


def test_atomic_write_and_output(tmp_path):
    # the one atomic writer (temp file beside the target, renamed): a normal file's mode, and a
    # failure inside the block leaves the old file whole and no temporary file behind
    import os
    import stat

    from leapdecode.models.store import atomic_output, atomic_write

    path = tmp_path / "sub" / "report.md"
    atomic_write(path, "one")
    assert path.read_text() == "one"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    atomic_write(path, b"two", durable=True)
    assert path.read_bytes() == b"two"
    with pytest.raises(RuntimeError):
        with atomic_output(path) as tmp:
            assert tmp.parent == path.parent and tmp.suffix == ".md"  # (savefig reads the suffix)
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert path.read_text() == "two"
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.md"]


def test_a_local_files_hash_is_remembered_by_its_path_and_stat(tmp_path, monkeypatch):
    """Issue 62: a local .gguf was hashed in full at every load to find its converted copy; its hash
    is now remembered until the file changes (size, modification time, inode)."""
    import hashlib
    import os

    from leapdecode.models import store

    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(1000))
    hashed = []
    real = store.file_sha256
    monkeypatch.setattr(store, "file_sha256", lambda p, show=True: hashed.append(p) or real(p, show=False))
    first = store.known_sha256(f)
    assert first == hashlib.sha256(f.read_bytes()).hexdigest() and len(hashed) == 1
    assert store.known_sha256(f) == first and len(hashed) == 1  # remembered: not read again
    f.write_bytes(b"GGUF" + bytes(999) + b"x")  # the same size, another content and modification time
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    assert store.known_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest() != first and len(hashed) == 2
    (tmp_path / "cache" / store.HASHES_FILE).write_text("{not json")  # a damaged record: hashed again, rewritten
    assert store.known_sha256(f) != first and len(hashed) == 3
    assert store.known_sha256(f) != first and len(hashed) == 3
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [store.HASHES_FILE]  # nothing else left
