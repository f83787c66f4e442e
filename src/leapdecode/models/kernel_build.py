"""Compiling the kernel library (issue 64): its sources, flags and translation units, and the
instruction-set variants a package build compiles ahead of time (``setup.py``) so that an installed
wheel runs exactly on a machine with no compiler.

This module imports nothing of the package and no third-party module: ``setup.py`` loads it by path in
an isolated build environment.  ``models/kernel_library.py`` uses it for the first-use build (``-march=native``,
into the cache) and to choose a prebuilt variant at run time (``best_variant``).  Every variant computes
the same bits (each code path's arithmetic is documented and tested bit for bit against the others).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

KERNELS = Path(__file__).with_name("kernels")
SOURCE = KERNELS / "qgemm.cpp"
ATTENTION_SOURCE = KERNELS / "attention.cpp"  # the invariant attention (``attend_rows``)
LAYERS_SOURCE = KERNELS / "layers.cpp"  # a decoder's layers in one call (``LayerStack``)
SOURCES = (SOURCE, ATTENTION_SOURCE, LAYERS_SOURCE)  # compiled into one shared library
ABI_HEADER = KERNELS / "ld_abi.h"  # every exported function and struct, declared once (models/kernel_abi.py reads it)
ISA_HEADER = KERNELS / "ld_isa.h"  # the one place that decides the instruction-set path (LD_SIMD, LD_AMX)
HEADERS = (KERNELS / "bf16.h", ABI_HEADER, ISA_HEADER)  # included by the sources
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
NATIVE_FLAGS = ("-march=native",)  # the first-use build: the machine that runs it builds it
# The library's translation units, compiled at the same time (qgemm.cpp's LD_PART: its few-row
# functions of each code format apart from the rest; a fresh 2-core machine's first start waits
# about half as long as for one compiler process)
PARTS = ((SOURCE, ("-DLD_PART=0",)), (SOURCE, ("-DLD_PART=4",)), (SOURCE, ("-DLD_PART=6",)),
         (SOURCE, ("-DLD_PART=8",)), (SOURCE, ("-DLD_PART=2",)), (SOURCE, ("-DLD_PART=9",)),
         (ATTENTION_SOURCE, ()), (LAYERS_SOURCE, ()))
# The variants a package build compiles, best first: (name, compiler flags, the /proc/cpuinfo flags a CPU
# needs to run it).  x86-64-v4 is AVX-512 F/BW/CD/DQ/VL on top of v3 (AVX2, FMA, F16C, BMI1/2, LZCNT,
# MOVBE); the kernels' AVX-512 path needs VNNI besides, the AVX2 path's avx2-vnni variant AVX-VNNI (vpdpbusd
# on ymm: most laptop and desktop CPUs since 2021 without AVX-512), and the AMX variant the tiles (Sapphire Rapids and later
# Xeons: products of 12 or more rows on tiles; the library asks Linux for them at first use and, refused, runs
# the AVX-512 path).
VARIANTS = (
    ("amx", ("-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-mtune=generic"),
     ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "avx512f", "avx512bw", "avx512cd", "avx512dq",
      "avx512vl", "avx512_vnni", "amx_tile", "amx_int8")),
    ("avx512-vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
     ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "avx512f", "avx512bw", "avx512cd", "avx512dq",
      "avx512vl", "avx512_vnni")),
    ("avx2-vnni", ("-march=x86-64-v3", "-mavxvnni", "-mtune=generic"),
     ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "avx_vnni")),
    ("avx2", ("-march=x86-64-v3", "-mtune=generic"), ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe")),
    ("portable", ("-march=x86-64", "-mtune=generic", "-DLD_PORTABLE"), ()),
)
PREBUILT = KERNELS / "prebuilt"  # where a package build puts them: qgemm-<variant>.so and manifest.json
BUILD_TIMEOUT_S = 1800  # only stops a hung compiler (300 s was reached on a loaded 2-core machine)


class BuildError(RuntimeError):
    """A compile or link failed (``output``: the compiler's messages)."""

    def __init__(self, message: str, output: str = "", code: int = 1) -> None:
        super().__init__(message)
        self.output, self.code = output, code


def sources_digest() -> str:
    """sha256 of the sources and headers: a prebuilt library is used only with the sources it was built from."""
    h = hashlib.sha256()
    for p in SOURCES + HEADERS:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def compile_objects(cxx: str, work: Path, flags: tuple[str, ...] = NATIVE_FLAGS) -> list[str]:
    """Compile every part of ``PARTS`` with ``BASE_FLAGS`` + ``flags`` to an object file in ``work``, all at
    once; returns their paths (``BuildError`` with the compiler's output where one fails)."""
    cflags = [f for f in BASE_FLAGS if f != "-shared"] + list(flags)
    jobs = []
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    try:
        for i, (src, extra) in enumerate(PARTS):
            obj, err = work / f"part{i}.o", work / f"part{i}.err"
            with open(err, "w") as f:  # a file, not a pipe: a chatty compiler never blocks on it
                jobs.append((str(obj), err, subprocess.Popen([cxx, *cflags, *extra, "-c", str(src), "-o", str(obj)],
                                                             stdout=subprocess.DEVNULL, stderr=f)))
        for _, err, proc in jobs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise BuildError(f"{cxx} failed", err.read_text(), proc.returncode)
    finally:
        for _, _, proc in jobs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [obj for obj, _, _ in jobs]


def link_command(cxx: str, objects: list[str], target: Path, flags: tuple[str, ...] = NATIVE_FLAGS) -> list[str]:
    return [cxx, *BASE_FLAGS, *flags, *objects, "-o", str(target)]


def compile_library(cxx: str, target: Path, work: Path, flags: tuple[str, ...] = NATIVE_FLAGS) -> None:
    """``compile_objects`` in ``work``, then link them into ``target``."""
    objects = compile_objects(cxx, work, flags)
    link = subprocess.run(link_command(cxx, objects, target, flags), capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    if link.returncode != 0:
        raise BuildError(f"{cxx} failed to link", link.stderr, link.returncode)


def build_prebuilt(cxx: str, out: Path, say=print, names: tuple[str, ...] | None = None) -> dict:
    """Every variant of ``VARIANTS`` (or those ``names``) into ``out`` (``qgemm-<name>.so``) with a
    ``manifest.json`` naming the sources' digest and each variant's CPU flags: what a package build ships.
    Returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"sources": sources_digest(), "compiler": cxx, "variants": {}}
    for name, flags, needs in VARIANTS:
        if names is not None and name not in names:
            continue
        work = out / f".work-{name}"
        work.mkdir(exist_ok=True)
        say(f"leapdecode: compiling the kernel's {name} variant")
        t0 = time.monotonic()
        try:
            compile_library(cxx, out / f"qgemm-{name}.so", work, flags)
        except BuildError as e:
            if name == "portable":
                raise
            # an older compiler without an instruction set's flags: the package goes on without that variant
            lines = e.output.strip().splitlines()
            say(f"leapdecode: the {name} variant did not compile ({lines[-1] if lines else e}): left out")
            continue
        finally:
            for p in work.iterdir():
                p.unlink()
            work.rmdir()
        manifest["variants"][name] = {"file": f"qgemm-{name}.so", "cpu_flags": list(needs), "flags": list(flags),
                                      "seconds": round(time.monotonic() - t0, 1)}
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")
    return manifest


def shipped_variants(prebuilt: Path | None = None) -> dict[str, Path]:
    """The prebuilt variants in ``prebuilt`` (default ``PREBUILT``) built from these very sources, by name:
    their libraries ({} in a source checkout, or where the sources changed since)."""
    prebuilt = PREBUILT if prebuilt is None else prebuilt
    try:
        manifest = json.loads((prebuilt / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(manifest, dict) or manifest.get("sources") != sources_digest():
        return {}
    variants = manifest.get("variants") or {}
    return {name: prebuilt / str(v.get("file")) for name, v in variants.items()
            if isinstance(v, dict) and (prebuilt / str(v.get("file"))).is_file()}


def best_variant(cpu_flags: set[str], prebuilt: Path | None = None, only: str | None = None) -> tuple[str, Path] | None:
    """The best prebuilt variant this CPU runs (its flags ``cpu_flags``; ``only``: that variant or none), built
    from these very sources, as (name, library), or None (no prebuilt variants: a source checkout, or
    sources changed since); ``prebuilt``: the folder (default ``PREBUILT``)."""
    shipped = shipped_variants(prebuilt)
    for name, _, needs in VARIANTS:  # best first
        if (only is None or name == only) and name in shipped and set(needs) <= cpu_flags:
            return name, shipped[name]
    return None
