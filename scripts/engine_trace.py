"""Where a server's iterations go, per kind of iteration and load level (issue 14's diagnosis).

Starts one ``leapdecode serve --method M --max-batch 16`` per method (``--methods``, default
vanilla and auto), each wrapped so that its engine accounts every iteration (the ``serve``
subcommand of this script: the server process itself, with ``core/batch.py``'s ``step_batch`` and
``SpeculationScheduler.plan`` and the engine's ``_iterate`` timed around their calls; nothing in
the package changes).  Then ``--rounds`` rounds of ``scripts/loadtest.py``'s streaming clients at
``--clients``, each method in turn on the same request seed, the order reversed every other round;
after each run the server writes its accounts (on SIGUSR1) and starts afresh.  Prints per run and
kind of iteration (``none``: nothing could draft; ``plain`` / ``spec``: the load guard's arm;
``prefill``: the iteration carried a prompt chunk) and load level (``L0``: 1 decoding sequence,
``L1``: 2, ``L2``: 3-4, ``L3``: 5-8, ...): iterations, milliseconds each, committed tokens per
iteration and per second, the batched forward's and the host's milliseconds per iteration.
POSIX only (signals).

    python scripts/engine_trace.py -m qwen2.5-coder-1.5b --clients 8 --rounds 2 --duration 15
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def serve(argv: list[str]) -> int:
    """``leapdecode serve ARGS`` with per-iteration accounts, written to $ENGINE_TRACE_OUT on SIGUSR1."""
    from leapdecode.cli import main
    from leapdecode.core import batch
    from leapdecode.server import engine

    stats: dict = collections.defaultdict(lambda: [0, 0.0, 0, 0.0, 0.0])  # iterations, s, tokens, forward s, host s
    seen: dict = {}
    step, plan, iterate = engine.step_batch, batch.SpeculationScheduler.plan, engine.Engine._iterate

    def traced_step(gens, caps=None, max_prefill_chunks=1, timing=None):
        out = step(gens, caps, max_prefill_chunks, timing)
        seen["outcomes"], seen["timing"] = out, timing
        return out

    def traced_plan(self, gens):
        caps = plan(self, gens)
        prefilling = any(g.prefilling for g in gens)
        seen["kind"] = "prefill" if prefilling else (self._arm or "none")
        seen["decoding"] = sum(1 for g in gens if g.decoding)
        return caps

    def traced_iterate(self):
        seen.clear()
        t0 = time.perf_counter()
        iterate(self)
        seconds = time.perf_counter() - t0
        if "outcomes" not in seen:
            return
        kind = seen.get("kind", "none")
        level = batch.LoadGuard.level(seen.get("decoding", 0))
        timing = seen["timing"]
        for key in (kind, f"{kind}@L{level}"):
            row = stats[key]
            row[0] += 1
            row[1] += seconds
            row[2] += sum(len(o.output.tokens) for o in seen["outcomes"] if o.output is not None)
            row[3] += timing.forward_s if timing is not None else 0.0
            row[4] += sum(o.host_s for o in seen["outcomes"])

    def dump(*_):
        path = os.environ["ENGINE_TRACE_OUT"]
        with open(path + ".tmp", "w") as f:
            json.dump(stats, f)
        os.replace(path + ".tmp", path)
        stats.clear()

    engine.step_batch = traced_step
    batch.SpeculationScheduler.plan = traced_plan
    engine.Engine._iterate = traced_iterate
    signal.signal(signal.SIGUSR1, dump)
    return main(["serve", *argv])


def table(stats: dict) -> list[str]:
    lines = []
    for key in sorted(stats, key=lambda k: (k.split("@")[0], k)):
        n, s, tokens, fwd, host = stats[key]
        lines.append(f"  {key:12s} {n:5d} it {1e3 * s / n:7.1f} ms {tokens / n:5.2f} tok/it {tokens / s:7.2f} tok/s "
                     f"forward {1e3 * fwd / n:6.1f} ms host {1e3 * host / n:5.1f} ms")
    return lines


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(serve(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--methods", default="vanilla,auto")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=15.0, help="measured seconds of each run")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--levels", action="store_true", help="also print each kind of iteration per load level")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from loadtest import run_loadtest, start_server, stop_server

    servers = {}
    work = Path(tempfile.mkdtemp(prefix="engine-trace-"))
    try:
        for m in args.methods.split(","):
            out = work / f"{m}.json"
            proc, url, log = start_server(args.model, 64, ["--method", m, "--max-batch", "16"], timeout=300.0,
                                          launcher=[sys.executable, __file__, "serve"],
                                          env=dict(os.environ, ENGINE_TRACE_OUT=str(out)))
            servers[m] = (proc, url, out, log)
        methods = list(servers)
        for r in range(args.rounds):
            for m in methods if r % 2 == 0 else methods[::-1]:
                proc, url, out, _ = servers[m]
                s = run_loadtest(url=url, clients=args.clients, duration=args.duration, warmup=4.0 if r else 8.0,
                                 max_tokens=args.max_tokens, disconnect_prob=0.0, check_solo=False, seed=r)
                out.unlink(missing_ok=True)
                proc.send_signal(signal.SIGUSR1)
                for _ in range(100):
                    if out.exists():
                        break
                    time.sleep(0.05)
                stats = json.loads(out.read_text())
                print(f"round {r} {m}: {s['tokens_per_s']} tok/s in the measured window (mean batch "
                      f"{s['mean_batch_size']}, {s['completed']} completed); every iteration of the run:", flush=True)
                lines = table(stats)
                print("\n".join(x for x in lines if args.levels or "@" not in x), flush=True)
    finally:
        for proc, _, _, log in servers.values():
            stop_server(proc)
            os.unlink(log)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
