"""The model cache on disk: where it is, locks, atomic writes, checksums and integrity checks.

The cache root is ``$LEAPDECODE_CACHE`` or ``~/.cache/leapdecode``.  Anything written into
it is first built in a unique staging directory in the root and then renamed into place,
under a per-key ``fcntl`` lock, so concurrent processes and crashes never leave a
half-written entry behind.  Every temporary file or folder carries its owner (``owned_temp``:
the writer's process id in its name and an ``flock`` held while it writes), so the next run
removes a killed writer's leftovers at once, whatever their age (``sweep_stale``).  A converted
model directory holds ``model.safetensors``, ``config.json``, tokenizer files and
``leapdecode.json`` (``META_FILE``); whether one is
complete is checked cheaply on every use (metadata, and the safetensors header against the
file size), never by hashing gigabytes.

Progress messages and bars for the slow steps live here too: every step below uses them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from ..errors import ModelFileError

CACHE_ENV = "LEAPDECODE_CACHE"
DEFAULT_CACHE = "~/.cache/leapdecode"
CHUNK = 8 << 20  # 8 MiB streaming chunks
# of the converted directory; bump to force reconversion.  3 (issue 63): the heads' width and Llama
# 3.1's rope factors from the file; 2 (issue 62): configuration and tokenizer only, the weights read
# from the GGUF; 1 also held a float32 copy of the weights (WEIGHTS_FILE)
FORMAT_VERSION = 3
WEIGHTS_FILE = "model.safetensors"  # a Hugging Face directory's weights (and format 1's float copy)
META_FILE = "leapdecode.json"


# --------------------------------------------------------------------------- messages
def say(msg: str) -> None:
    print(f"leapdecode: {msg}", file=sys.stderr, flush=True)


def human_size(n: int | float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


@contextlib.contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
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
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


# --------------------------------------------------------------------------- the cache root
def _cache_origin(root: Path) -> str:
    value = os.environ.get(CACHE_ENV)
    return f"{CACHE_ENV}={value}" if value else f"the cache directory {root} ({CACHE_ENV} is not set)"


def cache_dir() -> Path:
    """The cache root: ``$LEAPDECODE_CACHE`` or ``~/.cache/leapdecode``.

    A ``ModelFileError`` naming the variable when it points at something other than a
    directory (it need not exist yet)."""
    root = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()
    if root.exists() and not root.is_dir():
        raise ModelFileError(
            f"{_cache_origin(root)}: {root} is a file, not a directory; point {CACHE_ENV} at a "
            "directory (it is created if missing) or remove the file"
        )
    return root


def make_dir(path: Path) -> Path:
    """``mkdir -p`` inside the cache; a ``ModelFileError`` naming ``$LEAPDECODE_CACHE`` on failure."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        root = cache_dir()
        raise ModelFileError(
            f"{_cache_origin(root)}: cannot create {path} ({e.strerror or type(e).__name__}); "
            f"point {CACHE_ENV} at a writable directory"
        ) from None
    return path


# --------------------------------------------------------------------------- locking / atomic output
@contextlib.contextmanager
def lock(key: str) -> Iterator[None]:
    """An exclusive per-key lock (``fcntl.flock``) so one process prepares ``key`` at a time."""
    locks = make_dir(cache_dir() / ".locks")
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: rely on the atomic rename alone
        yield
        return
    try:
        f = open(locks / f"{key}.lock", "a+")
    except OSError as e:  # probe F10e: a read-only cache where something is missing
        raise ModelFileError(
            f"{_cache_origin(cache_dir())}: cannot write in {locks} ({e.strerror or type(e).__name__}) to prepare "
            f"{key}; point {CACHE_ENV} at a writable directory (or fill the read-only cache from a writable copy)"
        ) from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process preparing {key} ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tmp_prefix(key: str) -> str:
    return f".tmp-{key}--"


def remove_stale(key: str) -> None:
    """Staging directories of ``key`` left by a crash (the caller holds its lock, so none is live)."""
    for p in cache_dir().glob(_tmp_prefix(key) + "*"):
        shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def staging(key: str) -> Iterator[Path]:
    """A unique staging directory in the cache root (``owned_temp``), always removed at the end; the
    staging directories of killed writers (any key) go first (issue 61: a conversion killed mid-write)."""
    root = make_dir(cache_dir())
    sweep_stale(root, ".tmp-", max_age_s=None)
    with owned_temp(root, _tmp_prefix(key), folder=True) as tmp:
        yield tmp


def publish(staged: Path, target: Path, staging_dir: Path) -> None:
    """Atomically move ``staged`` to ``target``; an outdated target is moved into
    ``staging_dir`` (removed with it) first."""
    make_dir(target.parent)
    if target.exists():
        os.rename(target, staging_dir / "replaced")
    os.rename(staged, target)


def share_permissions(directory: Path) -> None:
    """Group/other permissions as the umask allows (some writers create 0600 files; the
    cache may be shared)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.iterdir():
        f.chmod(0o666 & ~umask)


@contextlib.contextmanager
def atomic_output(path: Path, durable: bool = False) -> Iterator[Path]:
    """A temporary file beside ``path`` to write (by path, in place: ``np.savez``, ``savefig``...);
    renamed over ``path`` when the block ends, deleted if it fails, so a reader never sees half a file.
    The temporary file is an ``owned_temp`` (a killed writer's is removed by the next write of
    ``path``); it gets a normal file's mode (``mkstemp`` makes 0600 ones; the cache may be shared);
    ``durable`` flushes it to disk before the rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path.parent, f".{path.name}.", max_age_s=None)
    with owned_temp(path.parent, f".{path.name}.", suffix=".tmp" + path.suffix) as tmp:
        yield tmp
        fault_point(f"write:{path.name}")
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)


def check_output(path: str | os.PathLike, flag: str, directory: bool) -> Path:
    """An output path checked before any work (issue 45, probes B13, B19, D05, T03, H04, H07): a
    directory (``directory``) or a file, in a place where something can be written (the nearest
    existing folder takes a file; nothing is created here); an existing path of the other kind, or
    an unwritable place, is an ``InvalidParameterError`` naming ``flag``."""
    from ..errors import InvalidParameterError

    p = Path(path).expanduser()
    if directory and p.exists() and not p.is_dir():
        raise InvalidParameterError(f"{flag} {p} exists and is not a directory")
    if not directory and p.is_dir():
        raise InvalidParameterError(f"{flag} {p} is a directory; give the path of the file to write")
    folder = p if directory else p.parent
    while not folder.exists() and folder != folder.parent:  # the nearest existing folder: nothing is created
        folder = folder.parent
    if not folder.is_dir():
        raise InvalidParameterError(f"{flag} {p}: {folder} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(prefix=".leapdecode-probe-", dir=folder):
            pass
    except OSError as e:
        raise InvalidParameterError(f"{flag} {p}: nothing can be written in {folder} ({e.strerror or e})") from None
    return p


# --------------------------------------------------------------------------- temporary files with an owner
STALE_AFTER_S = 3600  # a temporary name without an owner (an earlier version's) older than this was left by a crash
_OWNED = re.compile(r"pid[0-9]+-[a-z0-9_]{8}")  # owned_temp's mark: "pid" PID "-" and mkstemp's 8 random characters


@contextlib.contextmanager
def owned_temp(directory: Path, prefix: str, suffix: str = "", folder: bool = False) -> Iterator[Path]:
    """A new temporary file (``folder``: a folder) in ``directory``, named ``prefix`` + ``pid<PID>-``
    + 8 random characters + ``suffix``, removed when the block ends (unless renamed away by then).

    While the block runs this process holds an exclusive ``flock`` on it, which the kernel releases
    when the process ends however it ends (``kill -9`` included): ``sweep_stale`` removes an owned
    name that nobody holds at once, whatever its age, and never one whose writer is still at work
    (pids are reused and may belong to another machine or container sharing the cache; a lock is
    neither).  Write the file in place (by path: its inode carries the lock); a library that writes
    its own temporary file and renames it (safetensors' ``save_file`` makes ``.tmpXXXXXX``) writes
    into an owned folder instead.  An ``OSError`` where nothing can be created (a read-only cache)."""
    for _ in range(3):  # a sweep in another process may take a name in the instant before it is locked
        if folder:
            made = Path(tempfile.mkdtemp(prefix=f"{prefix}pid{os.getpid()}-", suffix=suffix, dir=directory))
            try:
                fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                made.rmdir()
                raise
        else:
            fd, name = tempfile.mkstemp(prefix=f"{prefix}pid{os.getpid()}-", suffix=suffix, dir=directory)
            made = Path(name)
        if _hold(fd, made):
            break
        os.close(fd)
    else:  # pragma: no cover - three sweeps lost in a row
        raise OSError(f"cannot keep a temporary file in {directory}: removed as it was made")
    try:
        yield made
    finally:
        try:
            _remove(made)
        finally:
            os.close(fd)


def _hold(fd: int, path: Path) -> bool:
    """Lock ``fd`` (waiting out a sweep that holds it) and check that ``path`` still names it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: owned names are swept by age alone
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # no flock on this filesystem (some network ones): swept by age alone
        return True
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _remove(path: Path) -> None:
    """Remove a file or a folder (a link as a file); missing already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _remove_if_unowned(path: Path) -> bool:
    """Remove an owned temporary name whose writer is gone (nobody holds its lock); False where its
    writer is alive (or it cannot be opened or removed, e.g. in a read-only cache)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return False
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | (os.O_DIRECTORY if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its writer is at work
        except OSError:  # no flock on this filesystem (some network ones): the age rule
            if time.time() - path.lstat().st_mtime <= STALE_AFTER_S:
                return False
        _remove(path)  # under the lock: a writer that made this name in the meantime sees it gone (_hold)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def sweep_stale(directory: Path, prefix: str, max_age_s: float | None = STALE_AFTER_S) -> int:
    """Remove what killed writers left in ``directory`` under names that start with ``prefix`` (a
    writer's temporary names: ``.packed-``, ``.qgemm-``, ``.tmp-``, ``.NAME.``): an ``owned_temp``
    whose owner is gone at once, whatever its age; a name without an owner (an earlier version's)
    once older than ``max_age_s`` (None: never; a folder a user chose may hold such names of their
    own).  A live writer's files stay; a read-only directory keeps everything.  Returns how many went."""
    removed = 0
    try:
        entries = [p for p in directory.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return 0
    for stale in entries:
        with contextlib.suppress(OSError):  # another process may remove it first; a read-only cache keeps it
            if _OWNED.search(stale.name, len(prefix)):
                removed += _remove_if_unowned(stale)
            elif max_age_s is not None and time.time() - stale.lstat().st_mtime > max_age_s:
                _remove(stale)
                removed += 1
    return removed


FAULT_ENV = "LEAPDECODE_FAULT_AT"  # tests only: the stage at which fault_point kills the process


def fault_point(stage: str) -> None:
    """The tests' ``kill -9`` at a known point of a write (issue 61): SIGKILL this process when
    ``$LEAPDECODE_FAULT_AT`` is ``stage`` (``convert``, ``pack``, ``kernel-build``, ``write:NAME`` for
    ``atomic_output``'s file NAME), so a test can check what the next run leaves without timing
    races.  Does nothing unless that variable is set."""
    if os.environ.get(FAULT_ENV) == stage:
        os.kill(os.getpid(), signal.SIGKILL)


def writable(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` (made if missing): a read-only cache is not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        sweep_stale(directory, ".leapdecode-probe-", max_age_s=None)
        with owned_temp(directory, ".leapdecode-probe-"):
            return True
    except OSError:
        return False


def atomic_write(path: Path, data: str | bytes, durable: bool = False) -> Path:
    """``data`` (text as UTF-8) into ``path`` through ``atomic_output``."""
    with atomic_output(path, durable) as tmp:
        if isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
    return Path(path)


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- checksums
DIGEST_SAMPLES = 64  # evenly spaced windows of DIGEST_SAMPLE_BYTES: a load's quick check of a large file
DIGEST_SAMPLE_BYTES = 1 << 16


def sampled_sha256(path: Path) -> str:
    """The sha256 of a file's size and of ``DIGEST_SAMPLES`` windows spread evenly over it (a few MB
    read: milliseconds). Any damage longer than the gap between windows (the file's size / 64)
    changes it; ``file_sha256`` catches the rest."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for i in range(DIGEST_SAMPLES):
            f.seek(i * size // DIGEST_SAMPLES)
            h.update(f.read(DIGEST_SAMPLE_BYTES))
    return h.hexdigest()


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".digest.json")


def write_digest(written: Path, final: Path) -> None:
    """Record the digests of ``written`` (a finished temporary file) for ``final`` (where it is about to
    be renamed): size, sampled and full sha256. Written first, so a file is never in place without."""
    record = {"size": written.stat().st_size, "sampled": sampled_sha256(written), "sha256": file_sha256(written, show=False)}
    atomic_write(digest_path(final), json.dumps(record))


def digest_problem(path: Path, full: bool = False) -> str | None:
    """Why ``path`` is not the file whose digest was recorded beside it (None: it is): no digest, another
    size, other sampled windows, or (``full``) another sha256 of the whole file."""
    try:
        record = json.loads(digest_path(path).read_text())
        size = path.stat().st_size
    except (OSError, ValueError):
        return "has no readable digest (written by an earlier version, or damaged)"
    if not isinstance(record, dict) or record.get("size") != size:
        return f"is {size} bytes, not the {record.get('size') if isinstance(record, dict) else '?'} its digest records"
    if sampled_sha256(path) != record.get("sampled") or (full and file_sha256(path, show=False) != record.get("sha256")):
        return "differs from the bytes written (damaged)"
    return None


def file_sha256(path: Path, show: bool = True) -> str:
    """The sha256 of a file (hex), streamed (``show``: with a progress bar)."""
    h = hashlib.sha256()
    bar = progress(f"hashing {path.name}", path.stat().st_size) if show else contextlib.nullcontext(lambda n: None)
    with bar as advance, open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            advance(len(chunk))
    return h.hexdigest()


HASHES_FILE = "file-hashes.json"  # in the cache root: a local file's sha256 by its path and stat (``known_sha256``)
HASHES_KEPT = 256  # files remembered, the newest first


def known_sha256(path: Path) -> str:
    """``file_sha256(path)``, remembered in the cache under the file's path, size, modification time
    (ns), inode and device: a local ``.gguf`` of several GB was hashed again at every load (seconds
    for a 7B's 4.7 GB) to find its converted copy.  A file written since (another mtime or size) is
    hashed again; a cache that cannot be written still answers, hashing every time."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_dev}"
    record = cache_dir() / HASHES_FILE
    try:
        known = json.loads(record.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    if isinstance(known.get(key), str):
        return known[key]
    sha = file_sha256(path)
    known = {key: sha, **{k: v for k, v in known.items() if k != key and not k.startswith(f"{path}|")}}
    try:
        with atomic_output(record) as tmp:
            tmp.write_text(json.dumps(dict(list(known.items())[:HASHES_KEPT]), indent=0))
    except OSError:  # a read-only cache: hashed, not remembered
        pass
    return sha


# --------------------------------------------------------------------------- integrity of converted files
# bytes per element of the safetensors dtypes (sub-byte float formats are not size-checked)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
                "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
                "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a ``.safetensors`` file, judged from its header alone (None: nothing).

    The header must parse, every tensor's byte range must match its dtype and shape, and the
    file size must equal 8 + header length + the data size the header declares: a truncated
    or padded file fails here in microseconds, without reading the weights."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"is truncated ({size} bytes, too short for a safetensors header)"
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                return f"is truncated or not a safetensors file (header length {n}, file size {size})"
            raw = f.read(n)
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as e:
        return f"has a corrupt header ({type(e).__name__}: {e})"
    data_size = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            dtype, shape = info["dtype"], [int(d) for d in info["shape"]]
        except (TypeError, KeyError, ValueError):
            return f"has a corrupt header (bad entry for tensor {name!r})"
        numel = 1
        for d in shape:
            numel *= d
        if begin < 0 or end < begin or (dtype in _DTYPE_BYTES and end - begin != numel * _DTYPE_BYTES[dtype]):
            return f"has a corrupt header (tensor {name!r}: {dtype} {shape} at bytes {begin}..{end})"
        data_size = max(data_size, end)
    expected = 8 + n + data_size
    if size != expected:
        how = "truncated" if size < expected else "corrupt"
        return (f"is {how}: {size} bytes, but its header declares {expected} "
                f"(8 + {n} header + {data_size} data)")
    return None


def weights_problem(directory: Path) -> tuple[Path, str] | None:
    """The first ``*.safetensors`` file in ``directory`` that fails ``safetensors_problem``,
    with the reason; None when all pass (or there are none)."""
    for f in sorted(directory.glob("*.safetensors")):
        problem = safetensors_problem(f)
        if problem is not None:
            return f, problem
    return None


def small_file_digests(directory: Path) -> dict[str, str]:
    """sha256 of each file of a converted model but its weights and its metadata (config,
    tokenizer, generation config, chat template), recorded in its metadata at conversion."""
    return {f.name: file_sha256(f, show=False) for f in sorted(directory.iterdir())
            if f.is_file() and f.name not in (WEIGHTS_FILE, META_FILE)}


def model_files_problem(path: Path) -> str | None:
    """Why the small files of the converted model in ``path`` are damaged (issue 45, probes F17,
    F21, F23-F25), or None: each JSON file parses, the chat template parses, and where the
    conversion recorded their sha256 (``small_file_digests``) each still matches."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        meta = {}
    recorded = meta.get("files") if isinstance(meta, dict) else None
    for name, digest in (recorded or {}).items():
        f = path / name
        try:
            if file_sha256(f, show=False) != digest:
                return f"{f} differs from the file the conversion wrote (sha256 mismatch)"
        except OSError as e:
            return f"{f} cannot be read ({e.strerror or e})"
    for f in sorted(path.glob("*.json")):
        try:
            json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"{f} is not valid JSON ({' '.join(str(e).split())[:120]})"
    template = path / "chat_template.jinja"
    if template.is_file():
        from jinja2 import Environment, TemplateSyntaxError

        try:
            Environment().parse(template.read_text(encoding="utf-8"))
        except (OSError, ValueError, TemplateSyntaxError) as e:
            return f"{template} does not parse ({e})"
    return None


def has_current_meta(path: Path, sha256: str | None = None) -> bool:
    """``path/leapdecode.json`` is of this format version (and converted from ``sha256``)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict):
        return False
    return meta.get("format") == FORMAT_VERSION and not (sha256 and meta.get("source_sha256") != sha256)


def converted_problem(path: Path, sha256: str | None = None) -> str | None:
    """Why ``path`` is not a complete, current converted model (None: it is one)."""
    if not path.is_dir():
        return "not converted yet"
    float_copy = path / WEIGHTS_FILE
    if float_copy.is_file():  # format 1 (issue 62)
        with contextlib.suppress(OSError):
            return (f"the cache holds a float32 copy of its weights ({human_size(float_copy.stat().st_size)}) from an "
                    "earlier version, no longer needed (the GGUF is read directly now): removing it")
    if not has_current_meta(path, sha256):
        return f"{path / META_FILE} is missing or outdated"
    if not (path / "config.json").is_file():
        return f"{path / 'config.json'} is missing"
    return None


def is_complete(path: Path, sha256: str | None = None) -> bool:
    return converted_problem(path, sha256) is None
