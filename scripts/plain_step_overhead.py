"""Host and forward time of plain batched steps, per method, in process: 16 generations of
``--model`` stepped together by ``core/batch.step_batch`` with every draft cap at 0 (what the
batched engine runs when it does not speculate), alternating methods, per-iteration means.  A
method whose plain steps cost more than vanilla's carries overhead that a server comparison would
charge to speculation.

    python scripts/plain_step_overhead.py -m smollm2-135m --methods vanilla,auto --rounds 4
"""

from __future__ import annotations

import argparse
import time

import leapdecode
from leapdecode.core.batch import BatchTiming, step_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--methods", default="vanilla,auto")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    runner = leapdecode.load(a.model)

    def run(method: str) -> tuple[int, float, float, float]:
        gens = [leapdecode.api.start_generation(runner, f"Once upon a time, in a village number {i}, there lived",
                                                method=method, max_new_tokens=a.new) for i in range(a.sequences)]
        n, host, fwd = 0, 0.0, 0.0
        t = time.perf_counter()
        while not all(g.finished for g in gens):
            live = [g for g in gens if not g.finished]
            timing = BatchTiming()
            outs = step_batch(live, [0] * len(live), max_prefill_chunks=len(live), timing=timing)
            host += sum(o.host_s for o in outs)
            fwd += timing.forward_s
            n += 1
        return n, time.perf_counter() - t, host, fwd

    for _ in range(a.rounds):
        for m in a.methods.split(","):
            n, s, h, f = run(m)
            print(f"{m}: {n} iterations, {1e3 * s / n:.1f} ms each (host {1e3 * h / n:.1f}, forward {1e3 * f / n:.1f})",
                  flush=True)


if __name__ == "__main__":
    main()
