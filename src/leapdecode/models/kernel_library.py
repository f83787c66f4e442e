"""The kernel library's life before its first call: built at first use for this CPU and cached, or one of
the package's prebuilt variants chosen; verified, loaded and bound; and what ``leapdecode doctor`` says of it.

The shared library (``kernels/*.cpp``, sources and flags in ``kernel_build.py``) is compiled on first use with
the system C++ compiler (``-march=native``: the machine that runs it builds it) into the cache, keyed by the
source, the flags and the CPU's flags (``build_key``), and published atomically with its sha256 beside it; a
library is loaded only where that digest matches (``library_intact``).  An installed wheel's prebuilt variant,
the best this CPU runs, is used instead where there is one (``prebuilt_variant``).  Without a compiler
``kernel_problem()`` says why and the loader falls back to torch's kernels.  ``library()`` is the loaded
library, typed from the ABI (``kernel_abi``); the kernels' callers (``qkernel``) look it up there at each call.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ..errors import InvalidParameterError
from . import kernel_abi, kernel_build
from .store import (atomic_write, cache_dir, digest_path, digest_problem, fault_point, owned_temp, say, sweep_stale,
                    writable, write_digest)

# the sources, flags and translation units of the library (models/kernel_build.py; the first-use build is for
# this CPU: -march=native)
SOURCE, ATTENTION_SOURCE, LAYERS_SOURCE = kernel_build.SOURCE, kernel_build.ATTENTION_SOURCE, kernel_build.LAYERS_SOURCE
SOURCES, HEADERS, PARTS = kernel_build.SOURCES, kernel_build.HEADERS, kernel_build.PARTS
CXXFLAGS = kernel_build.BASE_FLAGS + kernel_build.NATIVE_FLAGS
# ~70 s of one core for qgemm.cpp on a 2.7 GHz Zen 4 (in parts at once, ``PARTS``: ~33 s on 2
# cores); the bound only stops a hung compiler (300 s was reached on a loaded 2-core machine, and
# the kernel then looked unavailable: bf16 fallback)
BUILD_TIMEOUT_S = kernel_build.BUILD_TIMEOUT_S


class KernelUnavailable(RuntimeError):
    """The quantized kernel cannot be built or loaded here."""


def cpu_flags() -> str:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``), '' where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


# The instruction sets that decide the kernels' (and torch's) speed on a CPU, as /proc/cpuinfo names
# them: what `leapdecode doctor` and a bench summary report of a machine.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
             "amx_bf16")


def isa_flags() -> list[str]:
    """The instruction sets that decide the kernels' speed here (``ISA_FLAGS`` on this CPU): what a
    measured figure records of its machine."""
    have = set(cpu_flags().split())
    return [f for f in ISA_FLAGS if f in have]


def isa_key() -> str:
    """A short key of the CPU's instruction set (cache key of compiled and packed forms)."""
    return hashlib.sha256(cpu_flags().encode()).hexdigest()[:12]


def compiler() -> str | None:
    """The C++ compiler a build would use (``$CXX``, g++, c++, clang++), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def build_library(target: Path) -> None:
    """Compile the library into an ``owned_temp`` folder beside ``target`` (objects, compiler output and
    the library: a build killed at any point leaves one folder, removed by the next open, probe F27),
    record its digest and rename it into place."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler found (set CXX or install g++)")
    say("building the quantized kernel for this CPU (once per machine and version; under a minute)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with owned_temp(target.parent, ".qgemm-", folder=True) as work:
            objects = _compile_parts(cxx, work, target)
            fault_point("kernel-build")
            built = work / target.name
            _run([cxx, *CXXFLAGS, *objects, "-o", str(built)], cxx, target)
            write_digest(built, target)  # first: a library is never there without its digest
            os.replace(built, target)
        with contextlib.suppress(OSError):
            build_log(target).unlink(missing_ok=True)  # an earlier failure's output is history now
        _prune_builds(target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"cannot build the kernel: {e}") from None


KEEP_BUILDS = 3  # kernel libraries kept in the cache: this build and the most recent others


def _prune_builds(target: Path) -> None:
    """Remove the cache's older kernel libraries (other versions or CPUs), keeping ``target`` and
    the ``KEEP_BUILDS - 1`` most recently built others (each ~2 MB; a process that has one
    loaded keeps its mapping)."""
    others = []
    for p in target.parent.glob("qgemm-*.so"):
        with contextlib.suppress(OSError):  # (another process may remove it first)
            if p != target:
                others.append((p.stat().st_mtime, p))
    for _, p in sorted(others, reverse=True)[KEEP_BUILDS - 1:]:
        _discard(p)


def library_intact(target: Path) -> bool:
    """Whether the cached library is the one its build wrote: its sha256 equals the digest recorded
    beside it (``store.write_digest``; a truncated, zeroed or replaced file, or one without its digest,
    is not loaded: a damaged shared library can crash the process inside the loader)."""
    return digest_problem(target, full=True) is None


def _compile_parts(cxx: str, work: Path, target: Path) -> list[str]:
    """Compile every part of ``PARTS`` for this CPU to an object file in ``work``, all at once; returns their
    paths (a failure keeps the compiler's output beside ``target``: ``build_log``)."""
    try:
        return kernel_build.compile_objects(cxx, work)
    except kernel_build.BuildError as e:
        raise KernelUnavailable(f"{e}: {_last_line(_keep_log(e.output, target), e.code)}") from None


def _run(cmd: list[str], cxx: str, target: Path) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise KernelUnavailable(f"{cxx} failed: {_last_line(_keep_log(proc.stderr, target), proc.returncode)}")


def build_log(target: Path | None = None) -> Path:
    """Where the compiler's output of the last failed build of ``target`` (default: this machine's
    library) is kept, beside it (for ``doctor``)."""
    return (target or cached_library_path()).with_suffix(".log")


def _keep_log(output: str, target: Path) -> str:
    """Keep a failed build's compiler output in ``build_log(target)`` (where that is writable)."""
    with contextlib.suppress(OSError):
        atomic_write(build_log(target), output)
    return output


def _last_line(stderr: str, code: int) -> str:
    return stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {code}"


@functools.lru_cache(maxsize=None)
def build_key() -> str:
    """What the compiled kernels depend on: their sources, the flags and the CPU's flags (the name
    of the cached library; also part of a measured cost profile's key, ``core/cost_model.py``)."""
    sources = b"".join(src.read_bytes() for src in SOURCES + HEADERS)
    return hashlib.sha256(sources + " ".join(CXXFLAGS).encode() + cpu_flags().encode()).hexdigest()[:16]


_BUILD_LOCK = threading.Lock()  # one build at a time in a process (build_in_background's thread and callers)


def cached_library_path() -> Path:
    """Where this machine's library is built and cached (``<cache>/kernels/qgemm-<build_key>.so``)."""
    return cache_dir() / "kernels" / f"qgemm-{build_key()}.so"


def build_in_background() -> None:
    """Start building the kernel library in a background thread where it is not built yet
    (``load`` calls this before a model's first conversion: the ~1 minute compile overlaps it)."""
    if os.environ.get("LEAPDECODE_NO_QKERNEL") or compiler() is None or cached_library_path().is_file():
        return
    threading.Thread(target=kernel_problem, name="leapdecode-kernel-build", daemon=True).start()


def cached_library_problem() -> str | None:
    """What is wrong with this machine's cached kernel library (None: intact, or not built yet)."""
    target = cached_library_path()
    if target.is_file() and not library_intact(target):
        return (f"the compiled kernel library {target} is damaged or unverified (its sha256 is not the one its "
                "build recorded); it is built again at the next load")
    return None


def discard_cached_library() -> bool:
    """Remove this machine's cached kernel library if it is damaged (``cached_library_problem``);
    True when one was removed (``models fetch --repair``)."""
    if cached_library_problem() is None:
        return False
    _discard(cached_library_path())
    return True


def library() -> ctypes.CDLL:
    """The kernel library, built and loaded once per process; a failure is remembered too (raised
    again at once, never retried from a hot path)."""
    lib = loaded_library()
    if isinstance(lib, KernelUnavailable):
        raise KernelUnavailable(str(lib))
    return lib


@functools.lru_cache(maxsize=None)
def loaded_library() -> "ctypes.CDLL | KernelUnavailable":
    """``open_library()``'s library, or the ``KernelUnavailable`` it raised, once per process
    (``loaded_library.cache_clear()`` opens it again)."""
    try:
        return open_library()
    except KernelUnavailable as e:
        return e


def open_library() -> ctypes.CDLL:
    """Load the cached library where it is intact (``library_intact``), without the build lock: a
    verified library in a read-only cache runs (probe F10a); else build it (under the lock; in a
    temporary folder outside a cache that cannot be written) and load it.  A damaged or foreign
    library in the cache is removed and built again, once."""
    if os.environ.get("LEAPDECODE_NO_QKERNEL"):
        raise KernelUnavailable("disabled by LEAPDECODE_NO_QKERNEL")
    prebuilt = prebuilt_library()
    if prebuilt is not None:
        return prebuilt
    target = cached_library_path()
    sweep_stale(target.parent, ".qgemm-")  # left by a process that ended mid-build
    for attempt in (1, 2):
        if not (target.is_file() and library_intact(target)):
            target = _buildable(target)
            with _build_lock(target.parent):
                if target.is_file() and not library_intact(target):
                    say(f"the cached kernel library {target} is damaged or unverified (its sha256 is not the one its "
                        "build recorded): building it again")
                    _discard(target)
                if not target.is_file():
                    build_library(target)
        try:
            return _bind(ctypes.CDLL(str(target)))
        except (OSError, AttributeError, kernel_abi.AbiMismatch) as e:
            if attempt == 2:
                raise KernelUnavailable(f"cannot load {target} even after building it again: {e}") from None
            say(f"cannot load the cached kernel library {target} ({e}): building it again")
            _discard(target)
            if target.is_file():  # a read-only cache keeps it: build elsewhere
                target = _elsewhere(target)
    raise AssertionError("unreachable")


def build_native(force: bool = False) -> Path:
    """``leapdecode kernels build --native``: build this CPU's library (``-march=native``) into the cache now,
    again with ``force`` even where an intact one is there, and check that it loads; returns its path.  A
    package with prebuilt variants uses it with ``LEAPDECODE_KERNEL=native``; a source checkout by default."""
    if compiler() is None:
        raise KernelUnavailable("no C++ compiler (g++, c++ or clang++; or $CXX) to build the kernel for this CPU")
    target = _buildable(cached_library_path())
    with _build_lock(target.parent):
        if force or not (target.is_file() and library_intact(target)):
            _discard(target)
            build_library(target)
    try:
        _bind(ctypes.CDLL(str(target)))
    except (OSError, AttributeError, kernel_abi.AbiMismatch) as e:
        raise KernelUnavailable(f"built {target}, but it does not load: {e}") from None
    return target


# "native": build for this CPU at first use even where the package ships variants; a variant's name
# (kernel_build.VARIANTS: "avx2", "portable", ...): that prebuilt variant where the CPU runs it
KERNEL_ENV = "LEAPDECODE_KERNEL"


def prebuilt_variant() -> tuple[str, Path] | None:
    """The package's prebuilt variant this CPU runs (``kernel_build.best_variant``: a wheel's, built at
    install), as (name, library); None in a source checkout, or with ``LEAPDECODE_KERNEL=native``."""
    wanted = os.environ.get(KERNEL_ENV, "").strip().lower() or None
    if wanted == "native":
        return None
    names = [n for n, _, _ in kernel_build.VARIANTS]
    if wanted is not None and wanted not in names:
        raise InvalidParameterError(f"{KERNEL_ENV}={wanted!r}: expected 'native' or one of {', '.join(names)}")
    return kernel_build.best_variant(set(cpu_flags().split()), only=wanted)


def prebuilt_library() -> ctypes.CDLL | None:
    """The package's prebuilt variant this CPU runs (``prebuilt_variant``), loaded and bound; None where
    there is none, or where it does not load (said)."""
    choice = prebuilt_variant()
    if choice is None:
        return None
    name, path = choice
    try:
        return _bind(ctypes.CDLL(str(path)))
    except (OSError, AttributeError, kernel_abi.AbiMismatch) as e:
        say(f"cannot load the package's {name} kernel variant ({e}): building one for this CPU instead")
        return None


def _buildable(target: Path) -> Path:
    """``target``, or where a cache that cannot be written builds it instead (``_elsewhere``)."""
    return target if writable(target.parent) else _elsewhere(target)


def _elsewhere(target: Path) -> Path:
    """The library's place in this user's temporary folder, for a cache that cannot be written (said once)."""
    fallback = Path(tempfile.gettempdir()) / f"leapdecode-kernels-{os.getuid()}" / target.name
    say(f"the kernel cache {target.parent} is not writable: using a kernel built in {fallback.parent} instead")
    sweep_stale(fallback.parent, ".qgemm-")
    return fallback


def _discard(target: Path) -> None:
    """Remove a cached library and its digest (either may be missing)."""
    for p in (target, digest_path(target)):
        with contextlib.suppress(OSError):
            p.unlink()


@contextlib.contextmanager
def _build_lock(directory: Path):
    """One build at a time: this process's ``_BUILD_LOCK``, and across processes (server replicas,
    test workers) an exclusive ``flock`` on ``directory/.build.lock``; whoever waited finds the library
    built (``open_library`` checks again under the lock)."""
    with _BUILD_LOCK:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".build.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Type the library's functions from the ABI's one declaration (``kernel_abi``): ``AttributeError``
    where one is missing (not our library), ``AbiMismatch`` where its version or a struct differs."""
    return kernel_abi.bind(lib)


REQUIRE_ENV = "LEAPDECODE_REQUIRE_KERNEL"  # "1": a kernel that cannot run is an error, never a fallback


def kernel_problem() -> str | None:
    """Why the kernel cannot run here (None: it can).  With ``LEAPDECODE_REQUIRE_KERNEL=1`` (CI) a
    kernel that cannot run raises ``KernelUnavailable`` instead: every fallback and every test that
    would skip without the kernel fails, naming why."""
    try:
        library()
    except KernelUnavailable as e:
        if os.environ.get(REQUIRE_ENV) == "1":
            raise KernelUnavailable(f"{e} ({REQUIRE_ENV}=1: the kernel is required here)") from None
        return str(e)
    return None


def kernel_status() -> dict:
    """What ``leapdecode doctor`` shows of the kernel: the compiler, where the library is cached
    (and whether it is built and intact, whether the cache is writable), the code path it runs,
    and why it cannot run (with the kept compiler output of a failed build)."""
    target = cached_library_path()
    problem = kernel_problem()
    log = build_log()
    prebuilt = prebuilt_variant()
    return {
        "variant": f"the package's prebuilt {prebuilt[0]} variant" if prebuilt else "built for this CPU (-march=native)",
        "compiler": compiler(), "library": str(prebuilt[1] if prebuilt else target),
        "built": bool(prebuilt) or target.is_file(),
        "intact": target.is_file() and library_intact(target), "cache_writable": writable(target.parent),
        "isa": kernel_isa() if problem is None else None, "problem": problem,
        "build_log": str(log) if log.is_file() else None,
    }


def kernel_isa() -> str:
    """'amx' (AVX512-VNNI, with AMX tiles for products of many rows), 'avx512-vnni', 'avx2-vnni' (AVX2 with
    AVX-VNNI), 'avx2' or 'portable':
    which code path the compiled kernel runs (the same results on each)."""
    lib = library()
    simd = lib.ld_simd()
    if simd == 1 and lib.ld_amx():
        return "amx"
    return {1: "avx512-vnni", 2: "avx2", 3: "avx2-vnni"}.get(simd, "portable")
