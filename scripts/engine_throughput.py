"""Throughput of the batched engine loop in-process, on a fixed list of requests (no HTTP).

The load test's request mix (``scripts/loadtest.py``'s prompts, chat or plain completion,
``max_tokens`` drawn from [``--max-tokens`` / 4, ``--max-tokens``] (default 96), temperature 0 or 0.8 with a seed), ``--requests`` of them,
kept ``--clients`` at a time in one batch stepped by ``core/batch.py`` (``step_batch`` with the
``SpeculationScheduler``, as the server's engine does); a finished request is replaced by the next.
Every run does the same work, so runs compare without the load test's mix noise.  ``--no-fused``
runs the batched forward's attention per sequence (``FusedSegments`` off) for an A/B in one
checkout, ``--layer-by-layer`` the decoder layers one by one instead of in one kernel call
(``LayerStack``); ``--profile FILE`` writes a cProfile of the measured part.

    python scripts/engine_throughput.py -m smollm2-135m --method vanilla --clients 16 --requests 64
"""

from __future__ import annotations

import argparse
import cProfile
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import leapdecode
from leapdecode.api import start_generation
from leapdecode.core.batch import BatchTiming, SpeculationScheduler, step_batch
from leapdecode.core.runner import ModelRunner
from leapdecode.models import native

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadtest import PROMPTS  # noqa: E402  (the load test's prompts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--method", default="vanilla")
    ap.add_argument("--clients", type=int, default=16, help="requests in the batch at once")
    ap.add_argument("--requests", type=int, default=64, help="requests measured (after a warm-up of --clients)")
    ap.add_argument("--max-tokens", type=int, default=96,
                    help="a request's max_tokens is drawn from [max/4, max], as the load test draws it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fused", action="store_true", help="attention per sequence (FusedSegments off; "
                    "implies --layer-by-layer)")
    ap.add_argument("--layer-by-layer", action="store_true",
                    help="the decoder layers one by one (NativeCausalLM.layers_kernel off), not in one kernel call")
    ap.add_argument("--profile", default="", help="write a cProfile of the measured part here")
    a = ap.parse_args()
    if a.no_fused:
        native.FusedSegments.of = classmethod(lambda cls, *args: None)
    model = leapdecode.load(a.model)
    if a.layer_by_layer or a.no_fused:
        model.model.layers_kernel = False
    runner = ModelRunner(model, allow_draft_loading=False)
    tok = model.tokenizer
    rng = random.Random(a.seed)

    def request():
        text = rng.choice(PROMPTS)
        if rng.random() < 0.5:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        return start_generation(runner, prompt_ids=list(ids), max_new_tokens=rng.randint(max(1, a.max_tokens // 4), a.max_tokens), method=a.method,
                                temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 1000))

    sched = SpeculationScheduler(runner)

    def run(n: int) -> tuple[int, int, float]:
        todo = [request() for _ in range(n)]
        live, tokens, steps, t0 = todo[:a.clients], 0, 0, time.perf_counter()
        todo = todo[a.clients:]
        while live:
            caps, timing = sched.plan(live), BatchTiming()
            outs = step_batch(live, caps, timing=timing)
            sched.record(live, outs, timing)
            steps += 1
            for o in outs:
                if o.error is not None:
                    raise o.error
                if o.output is not None:
                    tokens += len(o.output.tokens)
            live = [g for g in live if not g.finished]
            while todo and len(live) < a.clients:
                live.append(todo.pop(0))
        return tokens, steps, time.perf_counter() - t0

    run(a.clients)  # warm-up: kernels, packed weights, the cost model
    before = dict(sched.counters)
    prof = cProfile.Profile() if a.profile else None
    if prof:
        prof.enable()
    tokens, steps, seconds = run(a.requests)
    if prof:
        prof.disable()
        prof.dump_stats(a.profile)
    spec = {k: sched.counters[k] - before[k] for k in ("speculative_steps", "draft_rows", "probes")}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent).stdout.strip() or "?"
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, commit {rev}, {os.cpu_count()} CPUs; "
          f"{a.model} {a.method}{' (attention per sequence)' if a.no_fused else ''}"
          f"{' (layer by layer)' if a.layer_by_layer else ''}, {a.clients} at once: "
          f"{tokens / seconds:.1f} tokens/s ({tokens} tokens, {a.requests} requests, {steps} steps, "
          f"{seconds:.1f} s), {spec}", flush=True)


if __name__ == "__main__":
    main()
