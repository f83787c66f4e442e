#!/usr/bin/env python
"""Load test for ``leapdecode serve``: N concurrent streaming clients with random disconnects.

Starts ``leapdecode serve -m MODEL`` in a subprocess on a free loopback port
(or uses ``--url``), then runs ``--clients`` concurrent clients for
``--duration`` seconds (or ``--max-requests`` requests).  Each client loops:
a streamed chat or text completion with a random ``max_tokens``; some requests
hang up early (after a few chunks, or while still queued) to exercise
cancellation.  A 429 is fine (the bounded queue is full): the client backs
off briefly and tries again.

Invariants checked (exit status 1 when one fails):
* every request either completed (a finish_reason and ``data: [DONE]``), got
  429, or was hung up by the client on purpose; nothing else;
* the server is alive afterwards (``/health``), with an empty queue;
* its RSS (``process_resident_memory_bytes`` from ``/metrics``), measured
  after a warm-up and again after the run and a settle, grew by less than
  ``--rss-slack-mb`` MB.

Reports requests/s, p50/p95 latency (completed requests) and the RSS before/after.

    python scripts/loadtest.py                       # tiny-random, 32 clients, 10 s
    python scripts/loadtest.py --url http://127.0.0.1:8000 --model-id qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPTS = ["Hello", "Write a haiku about the sea.", "def fib(n):", "The quick brown fox",
           "List three colours:", "Once upon a time"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, max_queue: int, extra: list[str] | None = None, timeout: float = 180.0,
                 launcher: list[str] | None = None, env: dict[str, str] | None = None):
    """``leapdecode serve`` in a subprocess (``launcher``: the command that stands for ``leapdecode
    serve``, e.g. a script wrapping it; ``env``: the process's environment); returns (process, base
    url, log path) once it answers ``/health``."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w+b", prefix="leapdecode-serve-", suffix=".log", delete=False) as log:
        cmd = [*(launcher or [sys.executable, "-m", "leapdecode.cli", "serve"]), "-m", model, "--host", "127.0.0.1",
               "--port", str(port), "--max-queue", str(max_queue), "--log-level", "warning", *(extra or [])]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}:\n"
                               + Path(log.name).read_text(errors="replace")[-3000:])
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not come up within {timeout:g} s")


def stop_server(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """The unlabelled samples (and a few labelled totals) of /metrics."""
    r = await client.get("/metrics", timeout=10)
    r.raise_for_status()
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


async def wait_idle(client: httpx.AsyncClient, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            h = (await client.get("/health", timeout=5)).json()
            if h.get("queue_depth") == 0 and not h.get("busy"):
                return True
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.1)
    return False


async def one_request(client: httpx.AsyncClient, model_id: str, rng: random.Random, max_tokens: int,
                      disconnect_prob: float) -> tuple[str, float, float | None, str, tuple | None]:
    """One streamed request: (outcome, latency, time to first chunk, detail, greedy), ``greedy``
    being (path, request, streamed text) for a completed greedy request (else None)."""
    chat = rng.random() < 0.5
    body: dict = {"model": model_id, "stream": True, "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens),
                  "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1000)}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    hang_up_after = rng.randint(1, 6) if rng.random() < disconnect_prob else None  # chunks
    hang_up_queued = rng.random() < disconnect_prob / 4  # give up before the response starts
    t0 = time.perf_counter()
    ttft = None
    pieces: list[str] = []

    async def go() -> tuple[str, str]:
        nonlocal ttft
        async with client.stream("POST", path, json=body) as r:
            if r.status_code == 429:
                if "retry-after" not in r.headers:
                    return "error", "429 without Retry-After"
                return "rejected", ""
            if r.status_code != 200:
                return "error", f"status {r.status_code}: {(await r.aread())[:300]!r}"
            chunks, finished, done = 0, False, False
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:]).get("choices", []):
                        pieces.append((c.get("delta") or {}).get("content") or c.get("text") or "")
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return "error", f"error event: {obj['error']}"
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if any(c.get("finish_reason") for c in obj.get("choices", [])):
                    finished = True
                if hang_up_after is not None and chunks >= hang_up_after and not finished:
                    return "disconnected", ""  # leaving the block closes the connection
            if done and finished:
                return "completed", ""
            return "error", f"stream ended without finish_reason/[DONE] (chunks={chunks})"

    try:
        if hang_up_queued:
            outcome, detail = await asyncio.wait_for(go(), timeout=rng.uniform(0.01, 0.3))
        else:
            outcome, detail = await go()
    except asyncio.TimeoutError:
        outcome, detail = "disconnected", ""
    except (httpx.HTTPError, OSError, ValueError) as e:
        outcome, detail = "error", f"{type(e).__name__}: {e}"
    greedy = None
    if outcome == "completed" and body["temperature"] == 0:
        greedy = (path, {k: v for k, v in body.items() if k != "stream"}, "".join(pieces))
    return outcome, time.perf_counter() - t0, ttft, detail, greedy


async def solo_mismatches(client: httpx.AsyncClient, seen: list[tuple[str, dict, str]]) -> tuple[int, list[str]]:
    """Ask each distinct greedy request of the run again, alone (one at a time, nothing else in
    flight), and compare its text with what the request got under load."""
    solo: dict[str, str] = {}
    bad = []
    for path, body, text in seen:
        key = json.dumps([path, body], sort_keys=True)
        if key not in solo:
            r = (await client.post(path, json=body, timeout=120)).json()
            c = r["choices"][0]
            solo[key] = c["message"]["content"] if "message" in c else c["text"]
        if solo[key] != text:
            bad.append(f"{path} {body.get('prompt') or body.get('messages')!r:.60} max_tokens={body['max_tokens']}: "
                       f"under load {text!r:.80}, alone {solo[key]!r:.80}")
    return len(solo), bad


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def run_async(url: str, model_id: str | None, clients: int, duration: float, max_requests: int | None,
                    max_tokens: int, disconnect_prob: float, settle: float, seed: int, api_key: str | None,
                    warmup: float | None = None, check_solo: bool = True) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0), limits=limits,
                                 headers=headers) as client:
        if model_id is None:
            model_id = (await client.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(seed)

        async def phase(seconds: float, limit: int | None) -> tuple[dict, list, list, list, int, list]:
            """``clients`` workers for ``seconds`` (or ``limit`` requests)."""
            outcomes: dict[str, int] = {"completed": 0, "rejected": 0, "disconnected": 0, "error": 0}
            latencies: list[float] = []
            ttfts: list[float] = []
            errors: list[str] = []
            greedy: list[tuple] = []
            issued = 0
            t_end = time.perf_counter() + seconds

            async def worker() -> None:
                nonlocal issued
                r = random.Random(rng.random())
                while time.perf_counter() < t_end and (limit is None or issued < limit):
                    issued += 1
                    outcome, lat, ttft, detail, seen = await one_request(client, model_id, r, max_tokens,
                                                                         disconnect_prob)
                    outcomes[outcome] += 1
                    if seen is not None:
                        greedy.append(seen)
                    if outcome == "completed":
                        latencies.append(lat)
                        if ttft is not None:
                            ttfts.append(ttft)
                    elif outcome == "rejected":
                        await asyncio.sleep(r.uniform(0.02, 0.2))
                    elif outcome == "error" and len(errors) < 10:
                        errors.append(detail)

            await asyncio.gather(*(worker() for _ in range(clients)))
            return outcomes, latencies, ttfts, errors, issued, greedy

        # warm-up: the same load (by default as long as the run): the allocators' high-water mark of
        # a full batch of streams is reached in the warm-up (measured: +177 MB in a first 10 s run of
        # tiny-random at batch 8, then +37, +29, +10 MB in the next ones), so that the check
        # measures growth, not the first full batch;
        # plus the largest KV cache; then a settle
        await phase(duration if warmup is None else warmup, None)
        await client.post("/v1/completions", json={"model": model_id, "prompt": "warm", "temperature": 0,
                                                   "max_tokens": max_tokens})
        await wait_idle(client)
        await asyncio.sleep(settle)
        before = await scrape(client)

        t_start = time.perf_counter()
        outcomes, latencies, ttfts, errors, issued, measured = await phase(duration, max_requests)
        elapsed = time.perf_counter() - t_start
        idle = await wait_idle(client)
        await asyncio.sleep(settle)
        try:
            health = (await client.get("/health", timeout=10)).json()
            alive = health.get("status") == "ok"
        except (httpx.HTTPError, ValueError):
            health, alive = {}, False
        after = await scrape(client) if alive else {}
        checked, mismatches = (await solo_mismatches(client, measured)) if alive and check_solo else (0, [])

    rss0 = before.get("process_resident_memory_bytes")
    rss1 = after.get("process_resident_memory_bytes")
    total = sum(outcomes.values())

    def cancelled(m: dict, reason: str) -> float:
        return m.get(f'leapdecode_requests_cancelled_total{{reason="{reason}"}}', 0.0)

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    return {
        "url": url,
        "model": model_id,
        "clients": clients,
        "elapsed_s": round(elapsed, 2),
        "requests": total,
        **outcomes,
        "requests_per_s": round(total / elapsed, 2),
        "completed_per_s": round(outcomes["completed"] / elapsed, 2),
        "latency_p50_s": r3(percentile(latencies, 0.5)),
        "latency_p95_s": r3(percentile(latencies, 0.95)),
        "ttft_p50_s": r3(percentile(ttfts, 0.5)),
        "ttft_p95_s": r3(percentile(ttfts, 0.95)),
        "generated_tokens": int(after.get("leapdecode_generated_tokens_total", 0)
                                - before.get("leapdecode_generated_tokens_total", 0)) if after else None,
        "tokens_per_s": round((after.get("leapdecode_generated_tokens_total", 0)
                               - before.get("leapdecode_generated_tokens_total", 0)) / elapsed, 2) if after else None,
        "mean_batch_size": window_mean_batch(before, after),
        "server_cancelled_disconnect": int(cancelled(after, "disconnect") - cancelled(before, "disconnect"))
        if after else None,
        "server_cancelled_timeout": int(cancelled(after, "timeout") - cancelled(before, "timeout")) if after else None,
        "server_alive": alive,
        "server_idle_after": idle,
        "rss_before_mb": round(rss0 / 2**20, 1) if rss0 else None,
        "rss_after_mb": round(rss1 / 2**20, 1) if rss1 else None,
        "rss_delta_mb": round((rss1 - rss0) / 2**20, 1) if rss0 and rss1 else None,
        "error_samples": errors,
        "greedy_completed": len(measured),
        "solo_checked": checked,
        "solo_mismatches": len(mismatches),
        "solo_mismatch_samples": mismatches[:5],
    }


def window_mean_batch(before: dict, after: dict) -> float | None:
    """Generations stepped per engine iteration during the measured window (the server's gauge is
    a mean since its start: taken apart with the iteration counts before and after)."""
    steps0, steps1 = before.get("leapdecode_engine_steps_total"), after.get("leapdecode_engine_steps_total")
    m0, m1 = before.get("leapdecode_mean_batch_size"), after.get("leapdecode_mean_batch_size")
    if None in (steps0, steps1, m0, m1) or steps1 <= steps0:
        return m1
    return round((m1 * steps1 - m0 * steps0) / (steps1 - steps0), 3)


def check(summary: dict, rss_slack_mb: float = 50.0) -> list[str]:
    """The invariants; an empty list when all hold."""
    problems = []
    if summary["error"]:
        problems.append(f"{summary['error']} request(s) neither completed, got 429 nor were hung up on purpose: "
                        f"{summary['error_samples'][:3]}")
    if not summary["completed"]:
        problems.append("no request completed")
    if summary.get("solo_mismatches"):
        problems.append(f"{summary['solo_mismatches']} greedy request(s) got another text under load than alone: "
                        f"{summary['solo_mismatch_samples'][:2]}")
    if not summary["server_alive"]:
        problems.append("the server is not alive after the run")
    if not summary["server_idle_after"]:
        problems.append("the server did not drain its queue after the run")
    if summary["server_cancelled_timeout"]:
        problems.append(f"{summary['server_cancelled_timeout']} request(s) timed out on the server")
    if summary["rss_delta_mb"] is None:
        problems.append("no RSS reading (process_resident_memory_bytes missing from /metrics)")
    elif summary["rss_delta_mb"] > rss_slack_mb:
        problems.append(f"server RSS grew by {summary['rss_delta_mb']} MB (> {rss_slack_mb} MB)")
    return problems


def run_loadtest(url: str | None = None, model: str = "tiny-random", model_id: str | None = None,
                 clients: int = 32, duration: float = 10.0, max_requests: int | None = None, max_tokens: int = 48,
                 disconnect_prob: float = 0.2, settle: float = 2.0, max_queue: int = 16, seed: int = 0,
                 api_key: str | None = None, server_args: list[str] | None = None, warmup: float | None = None,
                 check_solo: bool = True) -> dict:
    """Run the load test (starting a server unless ``url`` is given) and return its summary."""
    proc = log = None
    if url is None:
        proc, url, log = start_server(model, max_queue, server_args)
    try:
        summary = asyncio.run(run_async(url, model_id, clients, duration, max_requests, max_tokens,
                                        disconnect_prob, settle, seed, api_key, warmup, check_solo))
    finally:
        if proc is not None:
            summary_exit = proc.poll()  # None: still running, as it should be
            code = stop_server(proc)
    if proc is not None:
        summary["server_exited_during_run"] = summary_exit is not None
        summary["server_exit_status"] = code
        if summary_exit is not None:
            summary["server_alive"] = False
        summary["server_log_tail"] = Path(log).read_text(errors="replace")[-2000:]
        os.unlink(log)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start `leapdecode serve -m MODEL` on a free port)")
    p.add_argument("-m", "--model", default="tiny-random", help="model for the started server (default: %(default)s)")
    p.add_argument("--model-id", help="model id to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("LEAPDECODE_API_KEY"))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load (default: %(default)s)")
    p.add_argument("--max-requests", type=int, help="stop after this many requests")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens is drawn from [this/4, this]")
    p.add_argument("--disconnect-prob", type=float, default=0.2, help="share of requests hung up early")
    p.add_argument("--max-queue", type=int, default=16, help="--max-queue of the started server")
    p.add_argument("--settle", type=float, default=2.0, help="seconds to wait before each RSS reading")
    p.add_argument("--rss-slack-mb", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=float,
                   help="seconds of the same load before the measured run (default: --duration); the RSS "
                        "check compares the RSS after the run with the RSS after this warm-up")
    p.add_argument("--server-args", default="",
                   help="extra arguments of the started `leapdecode serve`, one string (e.g. \"--max-batch 1\")")
    p.add_argument("--no-solo-check", action="store_true",
                   help="skip asking every greedy request of the run again alone and comparing the texts")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    s = run_loadtest(url=a.url, model=a.model, model_id=a.model_id, clients=a.clients, duration=a.duration,
                     max_requests=a.max_requests, max_tokens=a.max_tokens, disconnect_prob=a.disconnect_prob,
                     settle=a.settle, max_queue=a.max_queue, seed=a.seed, api_key=a.api_key,
                     server_args=a.server_args.split(), warmup=a.warmup, check_solo=not a.no_solo_check)
    problems = check(s, a.rss_slack_mb)
    if a.json:
        print(json.dumps({**{k: v for k, v in s.items() if k != "server_log_tail"}, "problems": problems}, indent=2))
    else:
        print(f"{s['requests']} requests in {s['elapsed_s']} s from {s['clients']} clients: "
              f"{s['requests_per_s']} req/s ({s['completed_per_s']} completed/s)")
        print(f"  completed {s['completed']}, 429 {s['rejected']}, hung up {s['disconnected']}, errors {s['error']}")
        print(f"  latency p50 {s['latency_p50_s']} s, p95 {s['latency_p95_s']} s; "
              f"first chunk p50 {s['ttft_p50_s']} s, p95 {s['ttft_p95_s']} s")
        print(f"  server: {s['generated_tokens']} tokens generated ({s['tokens_per_s']} tokens/s, mean batch "
              f"{s['mean_batch_size']}), {s['server_cancelled_disconnect']} generations "
              f"cancelled by disconnects, alive={s['server_alive']}")
        print(f"  greedy requests completed {s['greedy_completed']}: {s['solo_checked']} distinct asked again alone, "
              f"{s['solo_mismatches']} with another text")
        print(f"  RSS before {s['rss_before_mb']} MB, after {s['rss_after_mb']} MB (delta {s['rss_delta_mb']} MB)")
        for prob in problems:
            print(f"FAIL: {prob}")
        if problems and s.get("server_log_tail"):
            print("server log tail:\n" + s["server_log_tail"])
        if not problems:
            print("OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
