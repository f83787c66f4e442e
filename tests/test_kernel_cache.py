"""A damaged compiled kernel in the model cache is never loaded (issue 45, finding 1 of
../shared/probe/report.md: probe F07 `truncate -s 4096 C/kernels/qgemm-*.so` gave a bus error, F08
zeros inside it a segmentation fault, F06/F06b random bytes a silent float fallback, the libm copy of
the F17-F24 row an AttributeError traceback; F25: `models verify` did not look at it).  The library is loaded
only when its sha256 equals the digest its build recorded beside it; otherwise it is removed and
built again, once; a failure is remembered, not retried from hot paths.

The tests work on a copy of the cache (``LEAPDECODE_CACHE``) with ``build_library`` replaced by a copy
of the real library (no compiler run); a check that let the damaged file through would crash this
process inside the loader, or leave the test's assertions unmet."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path

import pytest

from leapdecode.models import kernel_library
from leapdecode.models.store import digest_path, write_digest

pytestmark = pytest.mark.skipif(kernel_library.kernel_problem() is not None,
                                reason=f"no kernel here: {kernel_library.kernel_problem()}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty model cache and a fake build that copies this process's real library into it
    (with its digest, as ``build_library`` writes it); returns (target path, list of builds)."""
    real = kernel_library.cached_library_path()
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path))
    target = kernel_library.cached_library_path()
    assert target != real and not target.exists()
    builds: list[Path] = []

    def fake_build(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(real, path.with_suffix(".tmp"))
        write_digest(path.with_suffix(".tmp"), path)
        os.replace(path.with_suffix(".tmp"), path)
        builds.append(path)

    monkeypatch.setattr(kernel_library, "build_library", fake_build)
    return target, builds


def test_an_intact_library_loads_without_a_build(cache):
    target, builds = cache
    kernel_library.build_library(target)
    assert kernel_library.library_intact(target)
    lib = kernel_library.open_library()
    assert lib.ld_simd() in (0, 1, 2) and len(builds) == 1  # the one above: none at load


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "foreign", "no digest"])
def test_a_damaged_library_is_built_again_not_loaded(cache, damage):
    """Probe 1 (kernel corruption): truncated to 4096 bytes, zeros written inside, another valid
    shared library in its place, or a library without its recorded digest."""
    target, builds = cache
    kernel_library.build_library(target)
    if damage == "truncated":
        os.truncate(target, 4096)
    elif damage == "zeroed":
        with open(target, "r+b") as f:
            f.seek(4096)
            f.write(bytes(65536))
    elif damage == "foreign":
        shutil.copyfile(_libm(), target)
    else:
        digest_path(target).unlink()
    assert not kernel_library.library_intact(target)
    assert kernel_library.cached_library_problem() is not None
    lib = kernel_library.open_library()
    assert len(builds) == 2 and kernel_library.library_intact(target) and lib.ld_simd() in (0, 1, 2)
    assert kernel_library.cached_library_problem() is None


def _libm() -> str:
    """A real shared library of the system (the C math library) to plant in the kernel's place."""
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib/aarch64-linux-gnu"):
        for name in ("libm.so.6",):
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    pytest.skip("no libm.so.6 found to plant")


def test_a_foreign_library_with_a_forged_digest_is_a_clean_error(cache, monkeypatch):
    """A loadable library that is not ours, digest and all (and rebuilt the same way): after one
    rebuild, ``KernelUnavailable`` naming the file, never an ``AttributeError``."""
    target, builds = cache
    libm = _libm()

    def foreign_build(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(libm, path)
        write_digest(path, path)
        builds.append(path)

    monkeypatch.setattr(kernel_library, "build_library", foreign_build)
    with pytest.raises(kernel_library.KernelUnavailable, match="even after building it again"):
        kernel_library.open_library()
    assert len(builds) == 2


def test_a_failed_load_is_remembered(monkeypatch):
    calls = []

    def failing() -> ctypes.CDLL:
        calls.append(1)
        raise kernel_library.KernelUnavailable("no compiler here")

    monkeypatch.setattr(kernel_library, "open_library", failing)
    monkeypatch.delenv(kernel_library.REQUIRE_ENV, raising=False)  # (CI sets it: kernel_problem would raise)
    kernel_library.loaded_library.cache_clear()
    try:
        for _ in range(3):
            with pytest.raises(kernel_library.KernelUnavailable, match="no compiler here"):
                kernel_library.library()
        assert kernel_library.kernel_problem() == "no compiler here"
        assert len(calls) == 1
    finally:
        kernel_library.loaded_library.cache_clear()  # the next test loads the real library again


def test_the_damage_is_named_for_models_verify(cache):
    """``models verify`` appends ``cached_library_problem`` to a model's own checks."""
    target, _ = cache
    assert kernel_library.cached_library_problem() is None  # not built yet: nothing wrong
    kernel_library.build_library(target)
    assert kernel_library.cached_library_problem() is None
    os.truncate(target, 4096)
    problem = kernel_library.cached_library_problem()
    assert problem is not None and str(target) in problem and "damaged" in problem


def test_losing_the_exact_kernel_is_said_once(monkeypatch, capsys):
    """Issue 44/45 (probes F09, F09b, F09c, F06, F06b, F10a: the fallback was silent, whatever the method): where the kernel cannot
    run, ``weights="auto"`` on a GGUF model says once, naming why, that float weights run instead and
    exactness is not guaranteed; an explicit ``weights="int4"`` says it runs torch's re-quantized
    int4; a model without a GGUF, or a GPU, says nothing."""
    import torch

    from leapdecode.errors import InvalidParameterError
    from leapdecode.models import loader

    monkeypatch.setattr(loader, "_WARNED", set())
    monkeypatch.setattr(kernel_library, "kernel_problem", lambda: "no C++ compiler found (set CXX or install g++)")
    cpu = torch.device("cpu")
    assert loader.auto_weights(cpu, "native", object(), "auto") is None
    assert loader.auto_weights(cpu, "native", object(), "auto") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no C++ compiler" in err[0] and "not guaranteed" in err[0], err
    assert loader.auto_weights(cpu, "native", None, "auto") is None  # no GGUF: float weights were asked for
    assert loader.auto_weights(torch.device("cuda"), "native", object(), "auto") is None
    assert capsys.readouterr().err == ""
    try:
        loader.resolve_weights("int4", None, cpu)
    except InvalidParameterError:
        pass  # torch's int4 kernel may be missing too: then a clean error, after the warning
    err = capsys.readouterr().err
    assert "torch's int4 kernel instead" in err and "no C++ compiler" in err


def test_a_read_only_cache_builds_the_kernel_elsewhere(cache, monkeypatch, capsys):
    """Issue 44 (probe F10a: another user on a shared, read-only cache): the library is built in a
    temporary directory, said once, not a ``PermissionError`` from inside a forward."""
    import tempfile

    target, builds = cache
    monkeypatch.setattr(kernel_library, "writable", lambda directory: False)
    monkeypatch.setattr(tempfile, "tempdir", str(target.parent.parent / "tmp"))  # not the machine's /tmp
    lib = kernel_library.open_library()
    assert lib.ld_simd() in (0, 1, 2)
    assert len(builds) == 1 and builds[0].parent != target.parent and builds[0].name == target.name
    assert "not writable" in capsys.readouterr().err


BUILDER = """
import os, shutil, sys, time
from pathlib import Path
from leapdecode.models import kernel_library, store
real, count, start = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
def fake_build(path):
    with open(count, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1.5)  # a build takes a while: the other process arrives meanwhile
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{os.getpid()}.tmp")
    shutil.copyfile(real, tmp)
    store.write_digest(tmp, path)
    os.replace(tmp, path)
kernel_library.build_library = fake_build
while time.time() < start:
    time.sleep(0.01)
print(kernel_library.open_library().ld_simd() in (0, 1, 2))
"""


def test_two_processes_build_the_kernel_once(tmp_path):
    """Issue 44: concurrent processes (server replicas, test workers) starting on an empty cache:
    one builds, the other waits for it and loads its library."""
    import subprocess
    import sys
    import time

    real = kernel_library.cached_library_path()
    count = tmp_path / "builds"
    env = dict(os.environ, LEAPDECODE_CACHE=str(tmp_path / "cache"))
    start = time.time() + 12  # both have imported torch by then
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(real), str(count), str(start)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 and out.strip() == "True" for p, (out, _) in zip(procs, outs)), outs
    assert len(count.read_text().split()) == 1


def test_require_kernel_turns_a_missing_kernel_into_an_error(monkeypatch):
    """Issue 44: CI runs with LEAPDECODE_REQUIRE_KERNEL=1, so that a kernel-gated test fails rather
    than skips where the kernel cannot run."""
    monkeypatch.setattr(kernel_library, "library",
                        lambda: (_ for _ in ()).throw(kernel_library.KernelUnavailable("no compiler")))
    monkeypatch.delenv(kernel_library.REQUIRE_ENV, raising=False)
    assert kernel_library.kernel_problem() == "no compiler"
    monkeypatch.setenv(kernel_library.REQUIRE_ENV, "1")
    with pytest.raises(kernel_library.KernelUnavailable, match="required"):
        kernel_library.kernel_problem()


def test_a_killed_writers_leftovers_are_swept(cache, tmp_path):
    """Issue 45 (probes F14, F27): ``kill -9`` mid-write left ``packed/.packed-*`` and
    ``kernels/.qgemm-build-*`` / ``.qgemm-*.so`` that nothing removed once the real file existed.
    Temporary names older than an hour go when the kernel is opened; a live writer's (younger) stay."""
    import time

    from leapdecode.models.store import sweep_stale

    target, _ = cache
    kernel_library.build_library(target)
    kernels = target.parent
    old_dir, old_so, young = kernels / ".qgemm-build-x1", kernels / ".qgemm-abc.so", kernels / ".qgemm-young.so"
    old_dir.mkdir()
    (old_dir / "part0.o").write_bytes(b"o")
    old_so.write_bytes(b"")
    young.write_bytes(b"")
    hour_ago = time.time() - 2 * 3600
    for p in (old_dir, old_so):
        os.utime(p, (hour_ago, hour_ago))
    kernel_library.open_library()
    assert not old_dir.exists() and not old_so.exists() and young.exists() and target.exists()
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / ".packed-a.safetensors").write_bytes(b"x" * 10)
    (packed / "model-key.safetensors").write_bytes(b"x")
    os.utime(packed / ".packed-a.safetensors", (hour_ago, hour_ago))
    os.utime(packed / "model-key.safetensors", (hour_ago, hour_ago))
    assert sweep_stale(packed, ".packed-") == 1
    assert [p.name for p in packed.iterdir()] == ["model-key.safetensors"]


def test_a_damaged_packed_file_is_packed_again_not_loaded(tmp_path, monkeypatch, capsys):
    """Issue 45 (probes F04, F04b): random bytes written into the middle of a packed int4 file gave
    NaN logits and 40 x token 0 with exit 0. ``save_packed`` records the file's digests; a load checks
    the sampled one (milliseconds) and packs again on a mismatch; ``models verify`` checks the whole."""

    from leapdecode.models import blockquant, store
    from leapdecode.models.store import digest_path, digest_problem
    from leapdecode.models.tiny import tiny_native

    monkeypatch.setattr(store, "DIGEST_SAMPLE_BYTES", 16)  # a tiny file: windows with gaps between them
    model = tiny_native(seed=4)
    blockquant.quantize_native(model)
    path = tmp_path / "tiny.safetensors"
    blockquant.save_packed(*blockquant.packed_contents(model), path)
    assert digest_problem(path) is None and digest_problem(path, full=True) is None
    good = path.read_bytes()
    size = len(good)
    with open(path, "r+b") as f:  # damage where a sampled window lies
        f.seek(size // 2)
        f.write(bytes(4096))
    assert "damaged" in digest_problem(path)
    path.write_bytes(good)
    with open(path, "r+b") as f:  # one byte between the windows: only the whole-file check sees it
        f.seek(size // 64 // 2)
        f.write(bytes([good[size // 64 // 2] ^ 0xFF]))
    assert digest_problem(path) is None and "damaged" in digest_problem(path, full=True)
    digest_path(path).unlink()
    assert "no readable digest" in digest_problem(path)

    # load_int4 packs again instead of loading it
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    write_tiny_config(model_dir)

    class Repacking(Exception):
        pass

    def repack(*a, **k):
        raise Repacking

    monkeypatch.setattr(blockquant, "packed_path", lambda d, k: path)
    monkeypatch.setattr(blockquant, "load_packed", lambda *a: pytest.fail("loaded damaged packed weights"))
    monkeypatch.setattr(blockquant.NativeCausalLM, "from_pretrained", repack)
    with pytest.raises(Repacking):
        blockquant.load_int4(model_dir, "key", None, None)
    assert "packing again" in capsys.readouterr().err and not path.exists()


def write_tiny_config(model_dir: Path) -> None:
    """The tiny model's config.json, as a converted model directory holds it."""
    from leapdecode.models.tiny import tiny_config

    cfg = tiny_config()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "tie_word_embeddings": True}))


def test_packed_weights_are_keyed_by_the_model_not_the_cache_path(tmp_path, monkeypatch):
    """Probe F28: a cache moved or copied elsewhere keeps using its packed files (the key is the
    model's name and source, not the absolute path), and older packed files of a model are pruned."""
    from leapdecode.models import blockquant

    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "one" / "models" / "m", tmp_path / "two" / "models" / "m"
    assert blockquant.packed_path(a, "sha") == blockquant.packed_path(b, "sha")
    assert blockquant.packed_path(a, "sha") != blockquant.packed_path(a, "other")
    packed = tmp_path / "cache" / "packed"
    packed.mkdir(parents=True)
    old = []
    for i, key in enumerate(("k1", "k2", "k3")):  # three earlier packings of m, oldest first
        p = packed / f"m-{key}-int4-v1-isa.safetensors"
        p.write_bytes(b"x")
        digest_path(p).write_text("{}")
        os.utime(p, (1000 + i, 1000 + i))
        old.append(p)
    other_model = packed / "m2-k9-int4-v1-isa.safetensors"
    other_model.write_bytes(b"x")
    new = blockquant.packed_path(a, "sha")
    new.write_bytes(b"x")
    assert blockquant.prune_packed(new) == [old[1], old[0]]
    assert sorted(p.name for p in packed.glob("*.safetensors")) == sorted([new.name, old[2].name, other_model.name])
    assert not digest_path(old[0]).exists()


def test_packed_weights_that_cannot_be_written_are_used_from_memory(tmp_path, monkeypatch, capsys):
    """Probes F10e, F12b: a read-only cache or a full disk while writing the packed weights is a
    warning, and the model runs from memory (it was a traceback)."""
    from leapdecode.models import blockquant
    from leapdecode.models.tiny import tiny_native

    if kernel_library.kernel_problem() is not None:
        pytest.skip(f"the block kernel cannot run here: {kernel_library.kernel_problem()}")
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    write_tiny_config(model_dir)

    def disk_full(tensors, layout, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blockquant.NativeCausalLM, "from_pretrained", lambda *a, **k: tiny_native())
    monkeypatch.setattr(blockquant, "save_packed", disk_full)
    model = blockquant.load_int4(model_dir, "key", None, None)
    assert model.quantization == "int4"
    assert "warning: cannot keep the packed weights" in capsys.readouterr().err
    assert not list((tmp_path / "cache").rglob("*.safetensors"))
