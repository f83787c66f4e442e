"""What a beam search gains from sharing the server's batched forward with other requests.

One process, one engine: a beam search (``--beams``) and ``--others`` plain greedy requests arrive
together; measured twice per repetition, alternating the order: with the search's rounds in the
batch (the task protocol, ``core/task.py``), and with each round run alone beside the batch (the
engine's behaviour before the protocol, reproduced by driving the search's coroutine itself).
Prints the wall time until everything finished and until the search finished, and checks that
the search's hypotheses are the same both ways.

    python scripts/beam_sharing.py -m qwen2.5-coder-0.5b --beams 4 --others 3 --tokens 64 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from leapdecode.core.sampling import SamplingParams
from leapdecode.core.task import StepOutput
from leapdecode.models.loader import load
from leapdecode.proposers import method_config
from leapdecode.request import GenerationRequest
from leapdecode.server.engine import Ended, Engine, Finished, GenSpec, Job, build_runner
from leapdecode.strategies.registry import strategy_config
from leapdecode.strategies.search import TreeSearch

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a hash table is in two sentences.",
           "List three uses of the command line tool grep.",
           "Translate to French: the cat sleeps on the warm windowsill.",
           "def quicksort(xs):"]


def searches_alone(original):
    """``TreeSearch.next_forwards`` that runs the round's forwards itself (none goes to the batch)."""
    def alone(self, cap=None):
        out = original(self, cap)
        while not isinstance(out, StepOutput):
            out = self.finish_forwards(out, [f.run() for f in out])
        return out

    return alone


async def one_run(engine: Engine, model, beams: int, others: int, tokens: int) -> tuple[float, float, list]:
    tok = model.tokenizer
    beam = strategy_config("beam", {"num_beams": beams, "num_return_sequences": 1})
    search = [GenSpec(tok.encode(PROMPTS[0]), GenerationRequest(method_config("vanilla"), SamplingParams(), tokens,
                                                                strategy=beam))]
    plain = [[GenSpec(tok.encode(PROMPTS[1 + i % (len(PROMPTS) - 1)]),
                      GenerationRequest(method_config("vanilla"), SamplingParams(), tokens))] for i in range(others)]
    t0 = time.perf_counter()
    done: dict[int, float] = {}

    async def collect(k: int, specs) -> list:
        job = Job(specs)
        engine.submit(job)
        events = []
        while not events or not isinstance(events[-1], Ended):
            events.append(await asyncio.wait_for(job.events.get(), 600))
        done[k] = time.perf_counter() - t0
        return events

    results = await asyncio.gather(collect(0, search), *(collect(1 + i, s) for i, s in enumerate(plain)))
    hyp = [e.result.tokens for e in results[0] if isinstance(e, Finished)]
    return max(done.values()), done[0], hyp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--others", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model = load(a.model)
    runner = build_runner(model, {})
    engine = Engine(runner, max_batch=a.others + 1)
    rows: dict[str, list[tuple[float, float]]] = {"shared": [], "alone": []}
    hyps: dict[str, list] = {}
    original = TreeSearch.next_forwards
    try:
        asyncio.run(one_run(engine, model, a.beams, a.others, 8))  # warm-up
        for rep in range(a.reps):
            for mode in (("shared", "alone") if rep % 2 == 0 else ("alone", "shared")):
                TreeSearch.next_forwards = searches_alone(original) if mode == "alone" else original
                total, search_s, hyp = asyncio.run(one_run(engine, model, a.beams, a.others, a.tokens))
                rows[mode].append((total, search_s))
                hyps.setdefault(mode, hyp)
                print(f"rep {rep} {mode:6s}: all done {total:6.2f} s, beam search done {search_s:6.2f} s", flush=True)
    finally:
        TreeSearch.next_forwards = original
        engine.stop()
    for mode, vals in rows.items():
        print(f"{mode:6s}: all done median {statistics.median(v[0] for v in vals):.2f} s, "
              f"beam search median {statistics.median(v[1] for v in vals):.2f} s")
    print("same hypotheses both ways:", hyps["shared"] == hyps["alone"])


if __name__ == "__main__":
    main()
