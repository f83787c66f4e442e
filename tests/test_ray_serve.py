"""``leapdecode serve --ray``: the same OpenAI-compatible server as replicas behind Ray Serve.

The option checks run everywhere (no Ray, no model).  The integration test runs the real CLI in
a subprocess (its own session): a local Ray head on 127.0.0.1, two replicas of ``smollm2-135m``,
the real ``openai`` client; greedy answers through Ray must equal ``leapdecode.generate`` in this
process, both replicas must answer, and Ctrl-C (SIGINT) must stop every process the server
started.  It skips when the ``ray`` extra is not installed.  Waits are bounded only so that a
broken server fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from leapdecode import cli
from leapdecode.models import loader
from leapdecode.server import ray_serve

MODEL = "smollm2-135m"
LOAD = dict(weights="int4", device="cpu")  # leapdecode's batch-invariant kernel: the same bits in any batch


@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded or Ray started before the options were checked")

    monkeypatch.setattr(loader, "load", refuse)
    monkeypatch.setattr(ray_serve, "run", refuse)


@pytest.mark.parametrize("argv, named", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--max-replicas", "2"], "--max-replicas needs --ray"),
    (["--ray-address", "auto"], "--ray-address needs --ray"),
    (["--replica-cpus", "0.5"], "--replica-cpus needs --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be >= 1"),
    (["--ray", "--replicas", "3", "--max-replicas", "2"], "--max-replicas (2) must be >= --replicas (3)"),
    (["--ray", "--max-replicas", "0"], "--max-replicas (0) must be >= --replicas (1)"),
    (["--ray", "--replica-cpus", "0"], "--replica-cpus must be > 0"),
    (["--ray", "--threads", "0"], "--threads must be >= 1"),
    (["--ray", "--ray-address", ""], "--ray-address must not be empty"),
    (["--ray", "--ray-address", "auto", "--port", "0"], "--port 0"),
])
def test_bad_ray_options_exit_2_before_anything_starts(nothing_starts, capsys, argv, named):
    rc = cli.main(["serve", "-m", MODEL, *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("leapdecode: error:") and named in err, err


def test_serve_ray_without_ray_says_how_to_install_it(nothing_starts, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if it were not installed
    rc = cli.main(["serve", "-m", MODEL, "--ray", "--replicas", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert "pip install 'leapdecode[ray]'" in err and len(err.splitlines()) == 1, err


def test_serve_help_explains_the_ray_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--ray", "--replicas", "--max-replicas", "--ray-address", "--replica-cpus", "--threads"):
        assert flag in out
    assert "leapdecode[ray]" in out and "docs/ray.md" in out


def test_replica_defaults_fit_this_machine():
    a = cli.build_parser().parse_args(["serve", "--ray", "--replicas", "2", "--max-replicas", "4"])
    from leapdecode.server.cli import check_ray_args

    check_ray_args(a)
    cores = os.cpu_count() or 1
    assert a.threads == max(1, cores // 4) and a.replica_cpus == float(a.threads)
    scale = ray_serve.Scale(a.replicas, a.max_replicas, a.replica_cpus, a.threads)
    assert scale.autoscaling_config(8) == {"min_replicas": 2, "initial_replicas": 2, "max_replicas": 4,
                                           "target_ongoing_requests": 8}


# ---------------------------------------------------------------------------- a real Ray head
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_processes(sid: int) -> list[int]:
    """Processes still in session ``sid`` (the server and everything Ray started under it)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                pass
    return out


def _wait_until_serving(proc: subprocess.Popen, log: Path, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with status {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        if "leapdecode: serving" in log.read_text(errors="replace"):
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.25)
    pytest.fail(f"not serving after {timeout:g} s:\n{log.read_text(errors='replace')[-4000:]}")


@pytest.mark.integration
@pytest.mark.skipif(not hasattr(os, "getsid"), reason="needs POSIX sessions to find Ray's processes")
def test_two_replicas_behind_ray_serve_answer_like_generate():
    pytest.importorskip("ray.serve", reason="the ray extra is not installed: pip install 'leapdecode[ray]'")
    openai = pytest.importorskip("openai")
    import httpx

    from leapdecode import generate, load

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix="ldray-"))  # short: Ray's socket paths live under it
    log = tmp / "serve.log"
    env = {**os.environ, "RAY_TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "leapdecode.cli", "serve", "--ray", "--replicas", "2", "-m", MODEL,
           "--weights", LOAD["weights"], "--device", LOAD["device"],
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        model = load(MODEL, **LOAD)  # the reference, while the replicas start
        _wait_until_serving(proc, log, url, timeout=180)
        print(f"two replicas serving after {time.monotonic() - t0:.1f} s")

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [MODEL]

        messages = [{"role": "user", "content": "Name three colours."}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        want = generate(model, messages, max_new_tokens=24, temperature=0.0)
        assert chat.choices[0].message.content == want.text and want.text.strip()
        assert chat.usage.completion_tokens == len(want.tokens)

        prompt = "The capital of France is"
        pieces = []
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True):
            pieces.extend(c.text for c in chunk.choices)
        want = generate(model, prompt, max_new_tokens=20, temperature=0.0)
        assert "".join(pieces) == want.text and len(pieces) > 1

        seen = set()  # the proxy spreads requests over both replicas (each names itself in a header)
        for _ in range(60):
            r = httpx.get(url + "/health", timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "ok"
            seen.add(r.headers[ray_serve.REPLICA_HEADER])
            if len(seen) == 2:
                break
        assert len(seen) == 2, seen
        assert httpx.get(url + "/metrics", timeout=10).text.startswith("# HELP")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # Ctrl-C: the server shuts Serve and its Ray head down
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 15
        while _session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.25)
        leaked = _session_processes(proc.pid)
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        text = log.read_text(errors="replace") if log.exists() else ""
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, text[-4000:]
    assert not leaked, f"processes left after Ctrl-C: {leaked}"
    print(f"whole test {time.monotonic() - t0:.1f} s")
