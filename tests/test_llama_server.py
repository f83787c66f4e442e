"""llama.cpp's server as a bench peer (bench/peers/llama_server.py): the command of each configuration,
the runner against a stand-in server process, and the failures that become one skip line."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from leapdecode.bench.peers import llama_server
from leapdecode.bench.peers import expand_peers, make_peers
from leapdecode.bench.peers.llamacpp import LlamaServerRunner
from leapdecode.models.loader import load

# A stand-in for llama-server: answers /health, and /completion with the prompt's last token + 1,
# 2, ... (or an EOS when the prompt ends with 7), with llama-server's fields; records its argv.
FAKE_SERVER = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
with open(ARGV_FILE, "a") as f:
    f.write(json.dumps(argv) + "\n")
if EXIT_AT_START:
    sys.stderr.write("error: failed to load model\n")
    sys.exit(3)
port = int(argv[argv.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send({"status": "ok"})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = req["prompt"][-1]
        toks = [last + 1 + i for i in range(req["n_predict"])]
        if last == 7:
            toks = [last + 1, EOS, 99]
        self._send({"tokens": toks, "content": "", "stop_type": "limit",
                    "timings": {"predicted_n": len(toks), "draft_n": 4, "draft_n_accepted": 2}})
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def fake_server(tmp_path: Path, eos: int, exit_at_start: bool = False) -> tuple[Path, Path]:
    argv_file = tmp_path / "argv.jsonl"
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\nARGV_FILE = {str(argv_file)!r}\nEOS = {eos}\n"
                      f"EXIT_AT_START = {exit_at_start}\n" + FAKE_SERVER)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, argv_file


def test_server_rows_are_a_peer_family():
    assert expand_peers(["llama-server"]) == ["llama-server", "llama-server-draft", "llama-server-ngram"]
    assert expand_peers(["llama-server-ngram-simple"]) == ["llama-server-ngram-simple"]


def test_commands_of_the_configurations(tmp_path):
    b, m, d = tmp_path / "llama-server", tmp_path / "m.gguf", tmp_path / "d.gguf"
    plain = llama_server.server_command(b, "llama-server", m, 4096, 2, 8080)
    assert plain[:3] == [str(b), "-m", str(m)] and "--spec-type" not in plain and "--no-cache-prompt" in plain
    assert plain[plain.index("-t") + 1] == "2" and plain[plain.index("-c") + 1] == "4096"
    ngram = llama_server.server_command(b, "llama-server-ngram", m, 4096, 2, 8080)
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-mod"
    draft = llama_server.server_command(b, "llama-server-draft", m, 4096, 2, 8080, draft_gguf=d)
    assert draft[draft.index("--spec-draft-model") + 1] == str(d)
    assert draft[draft.index("--spec-type") + 1] == "draft-simple"  # without it the draft is loaded, never used
    assert draft[draft.index("--spec-draft-threads") + 1] == "1"  # on 2 cores the draft gets one thread
    assert llama_server.server_command(b, "llama-server-draft", m, 4096, 8, 1, draft_gguf=d)[-1] == "8"
    with pytest.raises(llama_server.ServerUnavailable, match="draft"):
        llama_server.server_command(b, "llama-server-draft", m, 4096, 2, 8080)
    with pytest.raises(ValueError, match="unknown"):
        llama_server.server_command(b, "llama-server-eagle", m, 4096, 2, 8080)


def test_forwards_from_timings():
    assert llama_server.forwards_from_timings({"predicted_n": 100}) == 100
    assert llama_server.forwards_from_timings({"predicted_n": 100, "draft_n": 80, "draft_n_accepted": 40}) == 60
    assert llama_server.forwards_from_timings({}) is None


def test_runner_against_a_stand_in_server(tmp_path, monkeypatch):
    loaded = load("tiny-random")
    eos = next(iter(loaded.eos_token_ids))
    binary, argv_file = fake_server(tmp_path, eos)
    monkeypatch.setenv(llama_server.SERVER_ENV, str(binary))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "d.gguf").write_bytes(b"GGUF")
    said: list[str] = []
    runners = make_peers(expand_peers(["llama-server"]), loaded, str(tmp_path / "m.gguf"), str(tmp_path / "d.gguf"),
                         512, said.append)
    try:
        assert [r.name for r in runners] == ["llama-server", "llama-server-draft", "llama-server-ngram"], said
        assert all(isinstance(r, LlamaServerRunner) and r.system == "llama.cpp" for r in runners)
        out = runners[0].run([1, 2, 3], max_new_tokens=5)
        assert out.tokens == [4, 5, 6, 7, 8] and out.finish_reason == "length" and out.wall_s > 0
        assert out.target_forwards == 3 and out.extra == {"draft_n": 4, "draft_n_accepted": 2}
        stop = runners[0].run([1, 7], max_new_tokens=5)  # the server's EOS ends the tokens
        assert stop.tokens == [8] and stop.finish_reason == "stop"
    finally:
        for r in runners:
            r.close()
    argvs = [json.loads(line) for line in argv_file.read_text().splitlines()]
    assert [a[a.index("--spec-draft-model") + 1] for a in argvs if "--spec-draft-model" in a] == \
        [str(tmp_path / "d.gguf")]
    assert all(r.server.proc.poll() is not None for r in runners)  # closed: no server left running


def test_a_server_that_dies_at_start_is_one_skip_line(tmp_path, monkeypatch):
    loaded = load("tiny-random")
    binary, _ = fake_server(tmp_path, 0, exit_at_start=True)
    monkeypatch.setenv(llama_server.SERVER_ENV, str(binary))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    said: list[str] = []
    assert make_peers(["llama-server"], loaded, str(tmp_path / "m.gguf"), None, 512, said.append) == []
    assert said == ["skipping llama-server: llama-server exited with 3: error: failed to load model"]
    assert llama_server.exit_text(-4) == "was killed by SIGILL"


def test_missing_pieces_are_skip_lines(tmp_path, monkeypatch):
    loaded = load("tiny-random")
    said: list[str] = []
    path = os.environ.get("PATH", "")
    monkeypatch.setenv(llama_server.SERVER_ENV, str(tmp_path / "nowhere"))
    assert make_peers(["llama-server"], loaded, "tiny-random", None, 512, said.append) == []
    assert "is not an executable file" in said[-1]
    # no build yet and none asked for
    monkeypatch.delenv(llama_server.SERVER_ENV)
    monkeypatch.setenv("LEAPDECODE_CACHE", str(tmp_path / "cache"))
    assert make_peers(["llama-server"], loaded, "tiny-random", None, 512, said.append, build=False) == []
    assert "not built on this machine" in said[-1]
    # a build without cmake or a compiler says so before downloading anything
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert make_peers(["llama-server"], loaded, "tiny-random", None, 512, said.append) == []
    assert said[-1] == "skipping llama-server: cmake is not installed (needed to build llama.cpp's server)"
    assert not (tmp_path / "cache" / "peers").exists() or not any((tmp_path / "cache" / "peers").iterdir())
    # the draft row without a draft GGUF
    binary, _ = fake_server(tmp_path, 0)
    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv(llama_server.SERVER_ENV, str(binary))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert make_peers(["llama-server-draft"], loaded, str(tmp_path / "m.gguf"), None, 512, said.append) == []
    assert said[-1] == ("skipping llama-server-draft: llama-server-draft: no draft GGUF is known for this model; "
                        "pass --draft NAME")


@pytest.mark.skipif(llama_server.with_parent_death(["x"]) == ["x"], reason="needs Linux and util-linux's setpriv")
def test_a_killed_bench_takes_its_servers_with_it(tmp_path):
    """A bench killed with SIGKILL (no finally runs) leaves no llama-server behind: the server is
    started with a parent-death signal."""
    import signal
    import subprocess
    import time

    binary, _ = fake_server(tmp_path, 0)
    pid_file = tmp_path / "pid"
    port = llama_server.free_port()
    parent = subprocess.Popen([sys.executable, "-c", f"""
import time
from leapdecode.bench.peers import llama_server
s = llama_server.LlamaServer([{str(binary)!r}, "--port", "{port}"], {port})
open({str(pid_file)!r}, "w").write(str(s.proc.pid))
time.sleep(60)
"""])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and parent.poll() is None, "the stand-in server did not start"
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    os.kill(pid, 0)  # running
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        try:  # (reaped by init once it exits; a zombie still answers kill 0)
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
                break
        except OSError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the server outlived its killed bench")
