#!/usr/bin/env python
"""What an architecture's own layer costs on the kernels, against a Llama of the same size (issue 63's
"speed of a new architecture within 10% of a Llama of the same size").

Loads a model natively (default: the registered gemma3-270m, the GGUF's blocks on the kernel), times
forwards of 1, 4 and 16 tree rows at a context of ``--context`` tokens (``measure_verify_cost``: the
median of interleaved rounds), then turns the very same model into a Llama of its size (the same packed
weights; Llama's norms and activation, no q/k norms, no norms after attention and MLP, no embedding
scale, every layer attending over the whole context) and times it again in the same process, the two
alternated ``--rounds`` times (the fastest of each kept).  The Llama's output is meaningless; only its
time is used.

    python scripts/arch_cost.py                       # gemma3-270m
    python scripts/arch_cost.py --model qwen3.gguf --context 1024
"""

from __future__ import annotations

import argparse
import dataclasses
import json


def as_llama(model):
    """``model`` (a ``NativeCausalLM``) with Llama's layer, in place, its weights kept; returns what puts
    its own layer back."""
    own_cfg = model.cfg
    norms = [(b.q_norm, b.k_norm, b.post_attn_norm, b.post_mlp_norm) for b in model.layers]
    cfg = dataclasses.replace(own_cfg, norm_plus_one=False, sandwich_norms=False, embed_scale=False,
                              activation="silu", attn_scale=None, layer_windows=None, qk_norm=False,
                              attn_softcap=None, final_softcap=None)

    def use(c, kept):
        model.cfg = c
        for block, (q, k, pa, pm) in zip(model.layers, kept):
            block.cfg = c
            block.q_norm, block.k_norm, block.post_attn_norm, block.post_mlp_norm = q, k, pa, pm
        model._stack = None

    use(cfg, [(None,) * 4] * len(norms))
    return lambda: use(own_cfg, norms)


def timed(lm, context: int, sizes: tuple[int, ...]) -> dict[int, float]:
    import torch

    from leapdecode.core.cost_model import measure_verify_cost

    model = lm.model
    cache = model.new_cache(max_len=context + 64)
    ids = torch.randint(10, 1000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        for start in range(0, context, 64):
            model.forward(torch.tensor([ids[start:start + 64]]), cache)
            cache.commit()
    cost = measure_verify_cost(lm, cache, sizes=sizes, repeats=7)
    return {n: 1000 * cost.profile(n) for n in sizes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="a registered name or a GGUF path")
    ap.add_argument("--context", type=int, default=512, help="tokens in the cache before the timed forwards")
    ap.add_argument("--sizes", default="1,4,16", help="tree rows of the timed forwards")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two layers (the fastest of each kept)")
    a = ap.parse_args()
    import leapdecode

    sizes = tuple(int(n) for n in a.sizes.split(","))
    lm = leapdecode.load(a.model)
    arch = lm.model.cfg
    own, llama = {n: float("inf") for n in sizes}, {n: float("inf") for n in sizes}
    for _ in range(a.rounds):  # alternated: a drift of the machine hits both alike; the fastest of each kept
        for n, ms in timed(lm, a.context, sizes).items():
            own[n] = min(own[n], ms)
        restore = as_llama(lm.model)
        for n, ms in timed(lm, a.context, sizes).items():
            llama[n] = min(llama[n], ms)
        restore()
    out = {"model": a.model, "context": a.context, "own_ms": own, "llama_ms": llama,
           "ratio": {n: own[n] / llama[n] for n in sizes},
           "windows": list(arch.layer_windows) if arch.layer_windows else None}
    for n in sizes:
        print(f"{n:>3} rows: {own[n]:7.2f} ms ({a.model}) vs {llama[n]:7.2f} ms (a Llama of its size, same weights): "
              f"{own[n] / llama[n]:.3f}x")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
