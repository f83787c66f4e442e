"""Where a target forward's time goes, in the default format, after a ``--context``-token prompt:
forwards of 1, 8 and 16 tree tokens with the layers in one kernel call (default, ``LayerStack``),
layer by layer (``layers_kernel`` off), and layer by layer with one SDPA call per token
(``attention_kernel`` off too); then, layer by layer, the same forwards with the linear layers'
kernel calls replaced by their cached outputs (what is left: attention, norms, rope, Python and
torch glue), then with the attention kernel's calls replaced too (glue alone).  Min (and median)
over ``--repeats`` runs of ``--calls`` forwards, ms.

    python scripts/forward_split.py -m qwen2.5-coder-1.5b --context 300

The replaced calls return tensors computed once, so the timings after a replacement measure
everything but that kernel; the model's outputs are not used.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import leapdecode
from leapdecode.models import native, qkernel


def timed(fn, calls: int, repeats: int) -> tuple[float, float]:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e3)
    return min(runs), statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    model = leapdecode.load(a.model).model
    cache = model.new_cache(max_len=a.context + 64)
    prompt = torch.randint(0, 1000, (1, a.context), generator=torch.Generator().manual_seed(0))
    for chunk in prompt.split(128, dim=1):
        model.forward(chunk, cache, logits_for=slice(-1, None))
        cache.commit()

    def tree(t: int):
        toks = torch.randint(0, 1000, (1, t))
        parents = [-1] + [(i - 1) // 2 for i in range(1, t)] if t > 1 else None
        model.forward(toks, cache, parents=parents)
        cache.rollback()

    print(f"{a.model}: weights {model.quantization}, attention {model.attention}, {torch.get_num_threads()} threads, "
          f"context {a.context}")
    print("| forward | min ms | median ms |\n|---|---:|---:|")
    routes = {"layers in one call": (True, True), "layer by layer": (False, True),
              "layer by layer, attention SDPA per token": (False, False)}
    for t in (1, 8, 16):
        for route, (stack, kernel) in routes.items():
            model.layers_kernel, model.attention_kernel = stack, kernel
            lo, med = timed(lambda: tree(t), a.calls, a.repeats)
            print(f"| {t} token{'s' if t > 1 else ''}, {route} | {lo:.1f} | {med:.1f} |")
    # the replacements below act on the layer-by-layer route's calls
    model.layers_kernel, model.attention_kernel = False, True

    def stub(real, key_of):
        memo = {}

        def call(*args, **kwargs):
            key = key_of(*args, **kwargs)
            if key not in memo:
                memo[key] = real(*args, **kwargs)
            return memo[key]
        return call

    real_linear = qkernel.QLinear._forward
    qkernel.QLinear._forward = stub(real_linear, lambda self, x, rowwise: (id(self), tuple(x.shape), rowwise))
    real_attention = native.attend_rows
    try:
        for t in (1, 8, 16):
            lo, med = timed(lambda: tree(t), a.calls, a.repeats)
            print(f"| {t} token{'s' if t > 1 else ''}, linear kernels replaced | {lo:.1f} | {med:.1f} |")
        native.attend_rows = stub(real_attention, lambda q, k, v, f, o: (tuple(q.shape), k.shape[1]))
        for t in (1, 8, 16):
            lo, med = timed(lambda: tree(t), a.calls, a.repeats)
            print(f"| {t} token{'s' if t > 1 else ''}, linear and attention kernels replaced | {lo:.1f} | {med:.1f} |")
    finally:
        qkernel.QLinear._forward = real_linear
        native.attend_rows = real_attention


if __name__ == "__main__":
    main()
