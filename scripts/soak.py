#!/usr/bin/env python
"""A bounded soak of ``leapdecode serve`` shared by tenants, well-formed and hostile requests mixed
(issue 61 item 7).  Loopback only; bounded in time (``--minutes``) and count (``--max-requests``);
it stops by itself and stops its server.

Starts ``leapdecode serve -m MODEL`` with two API keys (two tenants) on a free loopback port, takes
each prompt's vanilla greedy answer as the reference, then runs ``--clients`` threads for
``--minutes``, each drawing requests from a fixed mix (seeded):

* well-formed: greedy completions with ``auto``, ``pld``, ``sam``, ``suffix``, ``lookahead``,
  ``recycling`` and ``vanilla`` (the text must equal vanilla's), a streamed chat (its pieces must add
  up to the non-streamed answer), a small JSON schema (the answer must parse and validate), from
  either key;
* hostile: the probe's suffix options (``memory_tokens`` 10**12, ``depth`` 10**7, ``remember_prompts``),
  a tree budget of 10**6, a 600 KB schema, a schema nested 2,000 deep, malformed JSON, a wrong key
  (each must get its 4xx); and requests inside the bounds that grow the shared memory most (suffix at
  its largest depth and memory over ~1,500 random tokens, a unique 100 KB schema checked in the child).

The server's resident memory is sampled every few seconds; its figure after the warm-up (the first
``--warmup`` seconds) and after the soak are compared.  Then the head-of-line check: small requests'
latency alone, and under a stream of large (admitted) schemas, p50 and p99.  At the end the model
cache is compared with its listing before the soak: no file may be left behind.

Writes ``summary.json`` and ``soak.md`` (a results-page note) into ``--out``; exit 1 when a check fails.

    python scripts/soak.py --out bench_out/soak           # 10 minutes on smollm2-135m
    python scripts/soak.py --minutes 1 --out /tmp/soak    # a quick one
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import start_server, stop_server  # noqa: E402

KEYS = ("soak-tenant-a", "soak-tenant-b")
PROMPTS = ["def fib(n):", "Write a haiku about the sea.", "The quick brown fox", "List three colours:",
           "import numpy as np\n\ndef normalize(x):", "Once upon a time", "Explain what a hash map is.",
           "SELECT name, age FROM"]
METHODS = ["auto", "pld", "sam", "suffix", "lookahead", "recycling", "vanilla"]
MAX_TOKENS = 32
SMALL_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                 "age": {"type": "integer"}}, "required": ["name", "age"]}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cache_listing(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.rglob("*")} if cache.is_dir() else set()


def temporary(path: str) -> bool:
    """A name a writer uses while it writes (dot-prefixed: ``.packed-pid...``, ``.tmp...``), not a lock."""
    return any(part.startswith(".") and part != ".locks" and not part.endswith(".lock")
               for part in Path(path).parts)


def defs_schema(n: int, tag: str) -> dict:
    """A schema slow to check (``n`` unused definitions: ~33 bytes each) and easy to follow."""
    return {"type": "object", "properties": {"a": {"type": "integer"}},
            "$defs": {f"{tag}_{i}": {"type": "integer"} for i in range(n)}}


class Soak:
    def __init__(self, url: str, model: str, seed: int) -> None:
        self.url, self.model, self.rng = url, model, random.Random(seed)
        self.reference: dict[str, str] = {}
        self.counts: Counter = Counter()  # kind -> requests
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.tags = iter(range(10**9))

    def post(self, path: str, body, key: str = KEYS[0], timeout: float = 300) -> httpx.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=data, timeout=timeout,
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})

    def completion(self, prompt: str, key: str = KEYS[0], **ext) -> httpx.Response:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        if ext:
            body["leapdecode"] = ext
        return self.post("/v1/completions", body, key)

    def references(self) -> None:
        for p in PROMPTS:
            r = self.completion(p, method="vanilla")
            r.raise_for_status()
            self.reference[p] = r.json()["choices"][0]["text"]

    def fail(self, kind: str, why: str) -> None:
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(f"{kind}: {why}")

    # ------------------------------------------------------------ the request kinds
    def good_method(self, rng: random.Random) -> str:
        method, prompt, key = rng.choice(METHODS), rng.choice(PROMPTS), rng.choice(KEYS)
        r = self.completion(prompt, key, method=method)
        if r.status_code != 200:
            self.fail(method, f"{r.status_code} {r.text[:200]}")
        elif r.json()["choices"][0]["text"] != self.reference[prompt]:
            self.fail(method, f"text differs from vanilla's on {prompt!r}")
        return f"good:{method}"

    def good_stream(self, rng: random.Random) -> str:
        prompt = rng.choice(PROMPTS)
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        text = ""
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {rng.choice(KEYS)}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += "".join(c.get("text", "") for c in json.loads(line[6:]).get("choices", []))
        if text != self.reference[prompt]:
            self.fail("stream", f"streamed text differs from vanilla's on {prompt!r}")
        return "good:stream"

    def good_schema(self, rng: random.Random) -> str:
        import jsonschema

        body = {"model": self.model, "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": "A person, as JSON."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SMALL_SCHEMA}}}
        r = self.post("/v1/chat/completions", body, rng.choice(KEYS))
        if r.status_code != 200:
            self.fail("schema", f"{r.status_code} {r.text[:200]}")
        elif r.json()["choices"][0]["finish_reason"] == "stop":
            try:
                jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SMALL_SCHEMA)
            except (ValueError, jsonschema.ValidationError) as e:
                self.fail("schema", f"invalid answer: {e}")
        return "good:schema"

    def hostile(self, rng: random.Random) -> str:
        tag = next(self.tags)
        cases = {
            "suffix-memory_tokens": (lambda: self.completion("Hi", method="suffix", options={"memory_tokens": 10**12}),
                                     400),
            "suffix-depth": (lambda: self.completion("Hi", method="suffix", options={"depth": 10**7}), 400),
            "suffix-remember_prompts": (lambda: self.completion("Hi", method="suffix",
                                                                options={"remember_prompts": True}), 400),
            "tree_budget": (lambda: self.completion("Hi", method="pld", tree_budget=10**6), 400),
            "schema-600KB": (lambda: self.post("/v1/chat/completions", schema_body(self.model, defs_schema(
                20000, f"big{tag}"))), 400),
            "schema-deep": (lambda: self.post("/v1/chat/completions", deep_body(self.model, 2000)), 400),
            "malformed": (lambda: self.post("/v1/completions", b'{"model": "x", "prompt": '), 400),
            "wrong-key": (lambda: self.completion("Hi", key="not-a-key"), 401),
        }
        name = rng.choice(sorted(cases))
        call, want = cases[name]
        r = call()
        if r.status_code != want:
            self.fail(f"hostile:{name}", f"{r.status_code} (wanted {want}) {r.text[:200]}")
        return f"hostile:{name}"

    def heavy(self, rng: random.Random) -> str:
        """Inside the bounds, what grows the shared memory most."""
        tag = next(self.tags)
        if rng.random() < 0.5:
            text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(300))
            r = self.completion(text, rng.choice(KEYS), method="suffix",
                                options={"depth": 64, "memory_tokens": 200_000})
            kind = "heavy:suffix"
        else:
            r = self.post("/v1/chat/completions", schema_body(self.model, defs_schema(3000, f"u{tag}")),
                          rng.choice(KEYS))
            kind = "heavy:schema-100KB"
        if r.status_code != 200:
            self.fail(kind, f"{r.status_code} {r.text[:200]}")
        return kind

    def one(self, rng: random.Random) -> str:
        x = rng.random()
        kind = (self.good_method if x < 0.5 else self.good_stream if x < 0.58 else self.good_schema if x < 0.66
                else self.hostile if x < 0.88 else self.heavy)
        return kind(rng)


def schema_body(model: str, schema: dict) -> dict:
    return {"model": model, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "{"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def deep_body(model: str, levels: int) -> bytes:
    """A schema request nested ``levels`` deep, written as text (json.dumps itself would recurse too deeply)."""
    schema = '{"type": "array", "items": ' * levels + '{"type": "integer"}' + "}" * levels
    body = json.dumps(schema_body(model, {"type": "integer"})).replace('{"type": "integer"}', schema)
    return body.encode()


def run_clients(soak: Soak, clients: int, seconds: float, max_requests: int) -> None:
    deadline = time.monotonic() + seconds
    left = [max_requests]

    def client(i: int) -> None:
        rng = random.Random(1000 + i)
        while time.monotonic() < deadline:
            with soak.lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            try:
                kind = soak.one(rng)
            except Exception as e:  # noqa: BLE001 (a client's own fault is a failure of the soak, not a stop)
                soak.fail("client", repr(e))
                continue
            with soak.lock:
                soak.counts[kind] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 600)


def latencies(soak: Soak, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        r = soak.post("/v1/chat/completions", {"model": soak.model, "max_tokens": 4, "temperature": 0,
                                               "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]})
        out.append(time.perf_counter() - t)
        if r.status_code != 200:
            soak.fail("small", f"{r.status_code} {r.text[:200]}")
    return out


def head_of_line(soak: Soak, n: int) -> dict:
    """Small requests' latency alone, then while large schemas (unique, admitted) stream in."""
    alone = latencies(soak, n)
    stop = threading.Event()
    big = Counter()

    def stream_schemas() -> None:
        while not stop.is_set():
            r = soak.post("/v1/chat/completions", schema_body(soak.model, defs_schema(7000, f"hol{next(soak.tags)}")),
                          KEYS[1])
            big[r.status_code] += 1

    threads = [threading.Thread(target=stream_schemas, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the first schemas are being checked
    beside = latencies(soak, n)
    stop.set()
    for t in threads:
        t.join(600)

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]

    return {"requests": n, "alone_p50_s": statistics.median(alone), "alone_p99_s": pct(alone, 0.99),
            "beside_p50_s": statistics.median(beside), "beside_p99_s": pct(beside, 0.99),
            "p99_ratio": pct(beside, 0.99) / pct(alone, 0.99), "large_schemas": dict(big),
            "large_schema_bytes": len(json.dumps(defs_schema(7000, "hol0")))}


def metric(url: str, name: str) -> float | None:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def note(s: dict) -> str:
    mib = 2**20
    hol = s["head_of_line"]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(s["counts"].items()))
    return "\n".join([
        f"## A soak of `leapdecode serve` shared by tenants ({s['date']}, {s['cpu']})",
        "",
        f"Measured with `python scripts/soak.py --minutes {s['minutes']:g}` (issue 61): `leapdecode serve -m {s['model']}` "
        f"with two API keys (two tenants, each its own cross-request memory), {s['clients']} client threads on "
        f"loopback for {s['minutes']:g} minutes, {sum(s['counts'].values())} requests: well-formed ones of seven "
        "methods (each answer compared with vanilla's greedy text), streamed, and JSON-schema ones (validated), "
        "mixed with the probe's hostile ones (suffix's unbounded sizes, a 600 KB schema, a 2,000-deep schema, "
        "malformed bodies, a wrong key: each must get its 4xx) and with requests inside the bounds that grow the "
        "shared memory most (suffix at depth 64 over 300 random words; a unique 100 KB schema).",
        "",
        f"| figure | value |",
        "|---|---|",
        f"| requests failing their check | {len(s['failures'])} |",
        f"| resident memory in the last minute of the {s['warmup_s']:g} s warm-up (median) | "
        f"{s['rss_after_warmup'] / mib:.0f} MiB |",
        f"| resident memory in the last minute of the soak (median) | {s['rss_end'] / mib:.0f} MiB "
        f"({s['rss_growth']:+.1%}) |",
        f"| highest resident memory | {s['rss_max'] / mib:.0f} MiB |",
        f"| cross-request memory at the end (budget) | {s['memory_bytes'] / mib:.1f} MiB ({s['memory_budget'] / mib:.0f} MiB), "
        f"{s['memory_evictions']:.0f} evictions |",
        f"| prompt KV in the prefix cache at the end (budget: `--prefix-cache-mib`, 512) | "
        f"{s['prefix_cache_bytes'] / mib:.0f} MiB |",
        f"| files left in the model cache | {len(s['cache_leftovers'])} |",
        f"| small request alone, p50 / p99 | {hol['alone_p50_s'] * 1000:.0f} / {hol['alone_p99_s'] * 1000:.0f} ms |",
        f"| beside a stream of {hol['large_schema_bytes'] // 1024} KB schemas, p50 / p99 | "
        f"{hol['beside_p50_s'] * 1000:.0f} / {hol['beside_p99_s'] * 1000:.0f} ms ({hol['p99_ratio']:.2f}x alone's p99) |",
        "",
        f"Requests by kind: {counts}.",
        ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="registered model to serve (default: %(default)s)")
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the soak (default: %(default)s)")
    ap.add_argument("--warmup", type=float, default=120.0, help="seconds of warm-up before the memory baseline "
                                                                "(default: %(default)s)")
    ap.add_argument("--clients", type=int, default=3, help="client threads (default: %(default)s)")
    ap.add_argument("--max-requests", type=int, default=20000, help="at most this many requests (default: %(default)s)")
    ap.add_argument("--latency-requests", type=int, default=60,
                    help="small requests timed alone and beside large schemas (default: %(default)s)")
    ap.add_argument("--memory-budget-mib", type=int, default=64,
                    help="the server's cross-request memory budget: small, so that the soak reaches it during the "
                         "warm-up and the memory that follows shows whether it holds (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="directory for summary.json and soak.md")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("LEAPDECODE_CACHE") or Path.home() / ".cache" / "leapdecode")
    before = cache_listing(cache)
    extra = [*(arg for key in KEYS for arg in ("--api-key", key)), "--memory-budget-mib", str(a.memory_budget_mib)]
    proc, url, log = start_server(a.model, max_queue=16, extra=extra)
    print(f"soak: serving {a.model} at {url} (log {log}); {a.minutes:g} min, {a.clients} clients", flush=True)
    samples: list[tuple[float, int, float]] = []  # (seconds since start, resident bytes, prefix-cache bytes)
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.wait(5.0):
            try:
                held = metric(url, "leapdecode_prefix_cache_bytes") or 0
            except httpx.HTTPError:
                held = -1
            samples.append((time.monotonic() - t0, rss_bytes(proc.pid), held))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    soak = Soak(url, a.model, a.seed)
    try:
        soak.references()
        seconds = a.minutes * 60
        started = time.monotonic() - t0
        run_clients(soak, a.clients, seconds, a.max_requests)
        ended = time.monotonic() - t0
        hol = head_of_line(soak, a.latency_requests)
        memory = {k: metric(url, f"leapdecode_proposer_memory_{k}") for k in ("bytes", "budget_bytes", "evictions_total")}
        memory["prefix_cache_bytes"] = metric(url, "leapdecode_prefix_cache_bytes")
        alive = httpx.get(url + "/health", timeout=30).status_code == 200
    finally:
        stop.set()
        sampler.join(10)
        stop_server(proc)
    time.sleep(1.0)
    after = cache_listing(cache)
    # each side is the median of a minute's samples (every 5 s), so one request's momentary cache is not read
    # as the server's memory
    warm = [r for t, r, _ in samples if started + a.warmup - 60 <= t <= started + a.warmup] or [samples[0][1]]
    soak_end = [r for t, r, _ in samples if ended - 60 <= t <= ended] or [samples[-1][1]]
    summary = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "model": a.model, "minutes": a.minutes,
        "clients": a.clients, "warmup_s": a.warmup, "counts": dict(soak.counts), "failures": soak.failures,
        "rss_after_warmup": statistics.median(warm), "rss_end": statistics.median(soak_end),
        "rss_max": max(r for _, r, _ in samples), "rss_growth": statistics.median(soak_end) / statistics.median(warm) - 1,
        "rss_samples": samples,
        "memory_bytes": memory["bytes"] or 0, "memory_budget": memory["budget_bytes"] or 0,
        "memory_evictions": memory["evictions_total"] or 0, "prefix_cache_bytes": memory["prefix_cache_bytes"] or 0,
        "head_of_line": hol, "alive": alive,
        "cache_new_files": sorted(after - before), "cache_leftovers": sorted(p for p in after - before if temporary(p)),
    }
    checks = {"every request passed its check": not soak.failures,
              "resident memory within 10% of the warm-up's": abs(summary["rss_growth"]) <= 0.10,
              "small requests' p99 within 2x beside large schemas": hol["p99_ratio"] <= 2.0,
              "no file left in the cache": not summary["cache_leftovers"], "the server answered /health": alive}
    summary["checks"] = checks
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (a.out / "soak.md").write_text(note(summary))
    print(note(summary))
    for name, held in checks.items():
        print(f"soak: {'ok  ' if held else 'FAIL'} {name}")
    for f in soak.failures[:20]:
        print("  failure:", f)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
