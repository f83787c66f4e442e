"""A read-only model cache runs, and a killed writer leaves nothing behind (issue 61, parts 3 and 4;
../shared/probe/report-2.md).

F10a / F10e: with ``LEAPDECODE_CACHE`` on a read-only mount, ``leapdecode generate`` died with a
traceback (``OSError: [Errno 30] Read-only file system: .../kernels/.build.lock``) although the
verified kernel library and the packed weights were there (F10a), and the same without the packed
file (F10e).  Now a verified library and packed weights are used without a write lock; what is
missing is packed in memory, said in one line; what cannot be made at all is refused in one line.
The read-only cache is a real one: a read-only bind mount in a private mount namespace
(``unshare -m``, as root: the tests and CI run as root), so the kernel answers ``EROFS``.

F14 / F27 and the other writers: ``kill -9`` while packing left a 0-byte ``.packed-*`` and
safetensors' ``.tmpXXXXXX`` with the bytes (155 MB for smollm2), and during the first kernel build
``.qgemm-build-*/`` and a 0-byte ``.qgemm-*.so``, swept only after an hour or never.  Every
temporary name now carries its owner (``store.owned_temp``: the pid in the name, an ``flock`` held
while it is written) and the next run removes those nobody holds, at once.  Each test kills a
subprocess at a known point (``LEAPDECODE_FAULT_AT``, ``store.fault_point``), checks the kill left
something, runs again, and checks the directory holds no temporary name."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leapdecode.models import kernel_library, store

CLI = "import sys; from leapdecode.cli import main; sys.exit(main(sys.argv[1:]))"
FAULT_ENV = "LEAPDECODE_FAULT_AT"  # store.fault_point kills a process at the stage this names
PERMANENT = {".build.lock", ".locks"}  # lock files stay by design (a lock, not a leftover)


def kernel_needed() -> None:
    problem = kernel_library.kernel_problem()
    if problem is not None:
        pytest.skip(f"no kernel here: {problem}")


def run(args: list[str], cache: Path, fault: str | None = None, prefix: list[str] | None = None,
        env: dict | None = None, script: str = CLI) -> subprocess.CompletedProcess:
    """``leapdecode ARGS`` (or ``script`` with ARGS) in a subprocess on ``cache``, killed at ``fault``."""
    full = dict(os.environ, LEAPDECODE_CACHE=str(cache), **(env or {}))
    full.pop(FAULT_ENV, None)
    if fault:
        full[FAULT_ENV] = fault
    return subprocess.run([*(prefix or []), sys.executable, "-c", script, *args], env=full, capture_output=True,
                          timeout=300)


def leftovers(directory: Path) -> list[str]:
    """Every temporary name under ``directory`` (all of leapdecode's and safetensors' start with a
    dot), lock files aside."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob(".*")
                  if not (set(p.relative_to(directory).parts) & PERMANENT))


def killed(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr.decode()[-2000:])


def ok(proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "Traceback" not in err, (proc.returncode, err[-3000:])
    return err


# --------------------------------------------------------------------------- a cache and a model on disk
def _real_library() -> Path:
    kernel_needed()
    status = kernel_library.kernel_status()
    return Path(status["library"])


def generate(model_dir: Path) -> list[str]:
    """``leapdecode generate``'s arguments for a few greedy tokens of ``model_dir`` on the int4 kernel."""
    return ["generate", "-m", str(model_dir), "--weights", "int4", "--method", "vanilla", "--max-new-tokens", "6", "hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama in Hugging Face format (a local model: packed into the cache like a GGUF's)."""
    from helpers.models import tiny_hf_dir

    return tiny_hf_dir(tmp_path_factory.mktemp("tiny-model") / "m")


# --------------------------------------------------------------------------- a read-only cache
def read_only(directory: Path) -> list[str]:
    """The command prefix that runs a command with ``directory`` read-only: a bind mount of it onto
    itself, remounted read-only, in a private mount namespace (the rest of the machine sees nothing)."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(directory)]


@pytest.fixture(scope="module")
def read_only_mount(tmp_path_factory):
    """Skips (with the reason, shown by ``-rs``) where no read-only bind mount can be made: not root,
    no ``unshare``, or a container without mount namespaces."""
    d = tmp_path_factory.mktemp("ro-probe")
    try:
        probe = subprocess.run([*read_only(d), "sh", "-c", 'touch "$0/x"', str(d)], capture_output=True, text=True,
                               timeout=30)
    except OSError as e:
        pytest.skip(f"no read-only bind mount here ({e})")
    if probe.returncode == 0 or "Read-only" not in probe.stderr:
        pytest.skip(f"no read-only bind mount here (unshare -m, mount --bind as root: {probe.stderr.strip()[:300]})")
    return read_only


@pytest.fixture(scope="module")
def warm_cache(model_dir, tmp_path_factory, cache_with_kernel):
    """A cache that ran the tiny model once (the kernel library, its packed weights and digests),
    with that run's output."""
    cache = cache_with_kernel(tmp_path_factory.mktemp("warm") / "cache")
    proc = run(generate(model_dir), cache)
    ok(proc)
    assert list((cache / "packed").glob("*.safetensors")), sorted(cache.rglob("*"))
    return cache, proc.stdout


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def test_F10a_read_only_cache_with_everything_present(warm_cache, model_dir, read_only_mount, tmp_path):
    """The verified library and packed weights are used as they are: the same tokens, nothing
    written, nothing said (it was ``OSError: Read-only file system: .../kernels/.build.lock``)."""
    warm, expected = warm_cache
    cache = tmp_path / "cache"
    shutil.copytree(warm, cache)
    before = snapshot(cache)
    proc = run(generate(model_dir), cache, prefix=read_only_mount(cache))
    err = ok(proc)
    assert proc.stdout == expected
    assert "leapdecode:" not in err, err  # no build, no packing, no warning
    assert snapshot(cache) == before


def test_F10e_read_only_cache_without_the_packed_weights(warm_cache, model_dir, read_only_mount, tmp_path):
    """The packed file is missing and cannot be written: packed in memory, said in one line, the
    same tokens (it was the same traceback as F10a)."""
    warm, expected = warm_cache
    cache = tmp_path / "cache"
    shutil.copytree(warm, cache)
    for f in (cache / "packed").iterdir():
        f.unlink()
    before = snapshot(cache)
    proc = run(generate(model_dir), cache, prefix=read_only_mount(cache))
    err = ok(proc)
    assert proc.stdout == expected
    said = [line for line in err.splitlines() if "not writable" in line]
    assert len(said) == 1 and str(cache / "packed") in said[0] and "in memory" in said[0], err
    assert "warning" not in err and snapshot(cache) == before


def test_F10e_read_only_cache_without_the_kernel_builds_it_in_the_temporary_folder(
        model_dir, read_only_mount, tmp_path, warm_cache):
    """No library in the read-only cache: built (here by a stand-in compiler that copies the real
    library) in the temporary folder, said once, the same tokens."""
    warm, expected = warm_cache
    cache = tmp_path / "cache"
    shutil.copytree(warm, cache)
    for f in (cache / "kernels").iterdir():
        f.unlink()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = run(generate(model_dir), cache, prefix=read_only_mount(cache),
               env={"CXX": str(fake_compiler(tmp_path)), "TMPDIR": str(tmp)})
    err = ok(proc)
    assert proc.stdout == expected
    said = [line for line in err.splitlines() if "not writable" in line]
    assert len(said) == 1 and str(cache / "kernels") in said[0] and str(tmp) in said[0], err
    assert list(cache.joinpath("kernels").iterdir()) == [] and list(tmp.rglob("qgemm-*.so"))


def test_F10e_read_only_cache_without_a_converted_model_is_one_line(read_only_mount, tmp_path):
    """What must be converted and cannot be written is refused in one line naming the read-only
    cache (the lock file could not be opened: a traceback)."""
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    cache = tmp_path / "cache"
    (cache / ".locks").mkdir(parents=True)
    proc = run(["generate", "-m", str(gguf), "--max-new-tokens", "2", "hi"], cache, prefix=read_only_mount(cache))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leapdecode: error:"), err
    assert str(cache) in lines[0] and "Read-only" in lines[0] and "writable" in lines[0]


# --------------------------------------------------------------------------- kill -9 at each stage
def test_F14_kill_while_packing_leaves_nothing_after_the_next_run(model_dir, tmp_path, cache_with_kernel):
    kernel_needed()
    cache = cache_with_kernel(tmp_path / "cache")
    args = generate(model_dir)
    killed(run(args, cache, fault="pack"))
    assert leftovers(cache / "packed"), "the kill left nothing to sweep: the test would prove nothing"
    ok(run(args, cache))
    assert leftovers(cache) == []
    packed = sorted(p.name for p in (cache / "packed").iterdir())
    assert len(packed) == 2 and packed[1] == packed[0] + ".digest.json", packed


def fake_compiler(directory: Path) -> Path:
    """A stand-in for the C++ compiler: ``-c`` makes an empty object, a link copies this machine's
    real library (so the real build code runs, in seconds)."""
    real = _real_library()
    cxx = directory / "fake-cxx"
    cxx.write_text(f"""#!/bin/sh
out=""; prev=""; compile=0
for a in "$@"; do
  [ "$prev" = "-o" ] && out="$a"
  [ "$a" = "-c" ] && compile=1
  prev="$a"
done
if [ "$compile" = 1 ]; then : > "$out"; else cp "{real}" "$out"; fi
""")
    cxx.chmod(0o755)
    return cxx


OPEN_KERNEL = "from leapdecode.models import kernel_library; print(kernel_library.kernel_problem())"


def test_F27_kill_during_the_first_kernel_build_leaves_nothing_after_the_next_run(tmp_path):
    cache = tmp_path / "cache"
    env = {"CXX": str(fake_compiler(tmp_path))}
    killed(run([], cache, fault="kernel-build", env=env, script=OPEN_KERNEL))
    assert leftovers(cache / "kernels"), "the kill left nothing to sweep: the test would prove nothing"
    proc = run([], cache, env=env, script=OPEN_KERNEL)
    ok(proc)
    assert proc.stdout.decode().strip() == "None"
    assert leftovers(cache) == []
    library = f"qgemm-{kernel_library.build_key()}.so"
    assert sorted(p.name for p in (cache / "kernels").iterdir() if p.name not in PERMANENT) == [
        library, library + ".digest.json"]


CONVERT = """
import json, sys
from pathlib import Path
from safetensors.torch import save_file
import torch
from leapdecode.models import convert, registry

def fake_gguf_to_hf(gguf_path, out):  # transformers' loader stands aside: the write path is the real one
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"w": torch.zeros(1 << 20)}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return {"architecture": "LlamaForCausalLM", "parameters": 1, "chat_template": False, "dtype": "float32"}

convert.gguf_to_hf = fake_gguf_to_hf
print(registry.convert_gguf_file(sys.argv[1]))
"""


def test_kill_during_a_conversion_leaves_nothing_after_the_next_run(tmp_path):
    """GGUF -> model directory, killed with its weights written in the staging folder; the next run
    converts another file, and the killed one's staging folder goes too (it was kept: only the same
    model's next conversion removed it)."""
    cache = tmp_path / "cache"
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + b"a" * 64)
    b.write_bytes(b"GGUF" + b"b" * 64)
    killed(run([str(a)], cache, fault="convert", script=CONVERT))
    assert leftovers(cache), "the kill left nothing to sweep: the test would prove nothing"
    ok(run([str(b)], cache, script=CONVERT))
    assert leftovers(cache) == []
    ok(run([str(a)], cache, script=CONVERT))
    assert leftovers(cache) == [] and len(list((cache / "gguf").iterdir())) == 2


def test_kill_during_a_datastore_build_leaves_nothing_after_the_next_run(model_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    out = tmp_path / "out"
    out.mkdir()
    args = ["datastore", "build", str(corpus), "--model", str(model_dir), "--out", str(out / "ds.npz"), "--no-progress"]
    killed(run(args, tmp_path / "cache", fault="write:ds.npz"))
    assert leftovers(out), "the kill left nothing to sweep: the test would prove nothing"
    ok(run(args, tmp_path / "cache"))
    assert leftovers(out) == [] and [p.name for p in out.iterdir()] == ["ds.npz"]


def test_kill_during_a_head_export_leaves_nothing_after_the_next_run(tmp_path):
    from leapdecode.models.tiny import tiny_loaded
    from leapdecode.proposers.heads.common import fingerprint
    from leapdecode.proposers.heads.medusa import MedusaHeads
    from leapdecode.proposers.heads.store import MANIFEST, WEIGHTS, save_head

    model = tiny_loaded()
    src = save_head(tmp_path / "src", MedusaHeads.for_target(model, heads=2),
                    {"target": {"name": model.name, "fingerprint": fingerprint(model)}, "steps": 0, "data": {}})
    out = tmp_path / "out"
    args = ["heads", "export", str(src), str(out), "--storage", "int8"]
    killed(run(args, tmp_path / "cache", fault=f"write:{WEIGHTS}"))
    assert leftovers(out), "the kill left nothing to sweep: the test would prove nothing"
    ok(run(args, tmp_path / "cache"))
    assert leftovers(out) == [] and sorted(p.name for p in out.iterdir()) == sorted([WEIGHTS, MANIFEST])


# --------------------------------------------------------------------------- the owner rule itself
HOLDER = """
import sys, time
from pathlib import Path
from leapdecode.models import store
with store.owned_temp(Path(sys.argv[1]), ".packed-", folder=True) as d:
    (d / "bytes").write_bytes(b"x" * 1000)
    print(d.name, flush=True)
    time.sleep(600)
"""


def test_F14_a_live_writers_temporary_files_stay_and_a_killed_ones_go_at_once(tmp_path):
    """The sweep keeps what a live process holds, whatever its age; it removes what nobody holds at
    once, even under a pid that is alive (reused pids: this process's own) or from an hour ago."""
    from leapdecode.models.store import owned_temp, sweep_stale

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        name = holder.stdout.readline().strip()
        assert name.startswith(f".packed-pid{holder.pid}-")
        old = time.time() - 2 * store.STALE_AFTER_S
        os.utime(tmp_path / name, (old, old))
        reused = tmp_path / f".packed-pid{os.getpid()}-abcdefgh"  # nobody holds it, though the pid lives
        reused.write_bytes(b"")
        with owned_temp(tmp_path, ".packed-") as mine:
            assert sweep_stale(tmp_path, ".packed-") == 1
            assert mine.exists() and (tmp_path / name).exists() and not reused.exists()
        assert not mine.exists()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert sweep_stale(tmp_path, ".packed-", max_age_s=None) == 1
        assert list(tmp_path.iterdir()) == []
    finally:
        holder.kill()
        holder.wait()


def test_json_written_atomically_sweeps_its_own_dead_temporary_files(tmp_path):
    """``atomic_output`` (the datastore, a head's files, the verification-cost profile, prefill.json):
    a killed writer's temporary file is removed by the next write of the same file; another file's,
    or a user's own dot-file, stays."""
    dead = tmp_path / ".p.json.pid1-abcdefgh.tmp.json"
    dead.write_text("{")
    other = tmp_path / ".q.json.pid1-abcdefgh.tmp.json"
    other.write_text("{")
    own = tmp_path / ".p.json.swp"
    own.write_text("user's")
    old = time.time() - 2 * store.STALE_AFTER_S
    os.utime(own, (old, old))
    store.atomic_write(tmp_path / "p.json", json.dumps({"a": 1}))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["p.json", other.name, own.name])
