#!/usr/bin/env python
"""Time of one batched decoding forward (``NativeCausalLM.forward_batch``, one token per
sequence) against the batch size: how much batching gives before the engine's per-sequence work.
Each size with the decoder layers in one kernel call (the default, ``LayerStack``) and layer by
layer (``layers_kernel`` off), alternating ``--rounds`` times; min ms per step.

    python scripts/batch_forward_speed.py -m smollm2-135m --batch 1 2 4 8
"""

from __future__ import annotations

import argparse
import time

import torch

import leapdecode
from leapdecode.models.native import BatchItem


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = leapdecode.load(a.model)
    m, tok = lm.model, lm.tokenizer
    caches = []
    for b in range(max(a.batch)):
        c = m.new_cache(max_len=1024)
        m.forward(torch.tensor(tok.encode(f"Write a story about a cat number {b}, please, with details."))[None], c)
        c.commit()
        caches.append(c)
    print(f"{a.model} ({lm.weights}, attention {m.attention}), {a.threads} threads")
    for batch in a.batch:
        def step():
            if batch == 1:
                m.forward(torch.tensor([[5]]), caches[0])
            else:
                m.forward_batch([BatchItem(torch.tensor([5]), c) for c in caches[:batch]])
            for c in caches[:batch]:
                c.rollback()
        best = {True: float("inf"), False: float("inf")}
        for _ in range(a.rounds):
            for stack in (True, False):
                m.layers_kernel = stack
                step()
                t0 = time.perf_counter()
                for _ in range(a.repeats):
                    step()
                best[stack] = min(best[stack], (time.perf_counter() - t0) / a.repeats * 1000)
        m.layers_kernel = True
        print(f"batch {batch:3d}: {best[True]:7.1f} ms per step with the layers in one call, "
              f"{best[False]:7.1f} layer by layer")


if __name__ == "__main__":
    main()
