"""What a target forward of n tree tokens costs on this machine, relative to one token: the
profile leapdecode's greedy tree sizing measures on first use (core/cost_model.py).

    python scripts/verify_cost.py -m qwen2.5-coder-1.5b --context 200
    python scripts/verify_cost.py -m qwen2.5-coder-1.5b --context 300 --weights int4 --attention invariant
"""

from __future__ import annotations

import argparse
import json

import torch

import leapdecode
from leapdecode.core.cost_model import measure_verify_cost
from leapdecode.core.proposer import feed_committed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="auto", help="auto, bf16, fp32, int8, int4")
    ap.add_argument("--attention", default="auto", help="auto, sdpa or invariant")
    ap.add_argument("--context", type=int, default=200, help="committed tokens before the tree")
    ap.add_argument("--sizes", default="1,2,4,8,12,16,24,32")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    model = leapdecode.load(a.model, dtype=a.dtype, weights=a.weights, attention=a.attention)
    cache = model.model.new_cache(max_len=a.context + 64)
    ids = torch.randint(0, 1000, (a.context,), generator=torch.Generator().manual_seed(0)).tolist()
    feed_committed(model, cache, ids, want_logits=False)  # in chunks that fit the pending area
    sizes = tuple(int(s) for s in a.sizes.split(","))
    cost = measure_verify_cost(model, cache, sizes=sizes, repeats=a.repeats)
    print(json.dumps({"model": a.model, "dtype": str(model.dtype), "weights": model.weights,
                      "attention": a.attention, "threads": torch.get_num_threads(),
                      "context": a.context, "ms": {n: round(t * 1e3, 1) for n, t in zip(cost.sizes, cost.seconds)},
                      "relative": cost.relative()}, indent=1))


if __name__ == "__main__":
    main()
