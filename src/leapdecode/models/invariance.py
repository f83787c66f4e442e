"""Batch invariance, checked: a token's logits in a tree forward against feeding its path alone.

Exact speculation rests on one property of the model's forwards: the logits of a token verified
inside a tree (many rows in one forward, a tree mask) are the same bits as the logits vanilla
decoding computes for it one token at a time.  ``tree_mismatches`` measures that directly on a
model, for short and long contexts, a branching tree and a chain; the tests prove it for every
kernel path, and ``leapdecode doctor`` runs it on a tiny model in this machine's default
configuration.
"""

from __future__ import annotations

import torch

TREE = [-1, 0, 1, 1, 3, 0, 5, 6, 2, 8]  # parents: branches, and a chain of depth 5
CHAIN = list(range(-1, 7))  # a chain: no mask
CASES = [(0, 5), (1, 12), (2, 20), (3, 33), (4, 300), (5, 600), (6, 1100)]  # (seed, prompt length)
QUICK_CASES = [(0, 5), (3, 33), (4, 300)]


def tree_vs_sequential(model, prompt_len: int, parents: list[int], seed: int) -> list[tuple[int, float]]:
    """Nodes whose logits in one tree forward differ from feeding their path one token at a time
    (after the same committed prompt of random tokens): ``(node, max |difference|)``."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (1, prompt_len), generator=g)
    toks = torch.randint(0, 256, (1, len(parents)), generator=g)
    cache = model.new_cache(max_len=prompt_len + len(parents) + 8)
    for chunk in prompt.split(128, dim=1):
        model.forward(chunk, cache)
        cache.commit()
    tree = model.forward(toks, cache, parents=parents)[0]
    cache.rollback()
    bad = []
    for node in range(len(parents)):
        path, j = [], node
        while j >= 0:
            path.append(j)
            j = parents[j]
        for j in reversed(path):
            out = model.forward(toks[:, j : j + 1], cache)[0, 0]
        cache.rollback()
        if not torch.equal(out, tree[node]):
            bad.append((node, (out - tree[node]).abs().max().item()))
    return bad


def tree_mismatches(model, cases: list[tuple[int, int]] = CASES) -> dict:
    """``{(prompt length, "tree" | "chain"): [(node, max |difference|), ...]}`` for every case
    where a tree forward's logits differ from sequential decoding's; empty: batch-invariant."""
    out = {}
    for seed, prompt_len in cases:
        for shape, parents in (("tree", TREE), ("chain", CHAIN)):
            bad = tree_vs_sequential(model, prompt_len, parents, seed)
            if bad:
                out[(prompt_len, shape)] = bad
    return out


def configuration_problem(native: bool, device: torch.device, quantization: str | None,
                          attention: str) -> str | None:
    """Why a configuration does not guarantee that greedy speculation gives vanilla's tokens bit for
    bit (None: it does, by construction: quantized weights on the batch-invariant kernels with the
    invariant attention, native backend, CPU)."""
    if not native:
        return "the transformers backend's forwards are not batch-invariant"
    if device.type != "cpu":
        return (f"on {device.type} the forwards are not proven batch-invariant (identity is measured per "
                "configuration: docs/results.md)")
    if not quantization:
        return "float weights: their matrix products are not batch-invariant (the exact path is int4 on leapdecode's kernel)"
    if quantization == "int4":
        from .kernel_library import kernel_problem

        problem = kernel_problem()
        if problem is not None:
            return f"int4 on torch's kernel, not leapdecode's batch-invariant one ({problem})"
    if attention != "invariant":
        return f"attention {attention} is not batch-invariant (use attention invariant)"
    return None


def exactness_problem(model) -> str | None:
    """``configuration_problem`` of a loaded model (``LoadedModel.model``)."""
    from .native import NativeCausalLM

    native = isinstance(model, NativeCausalLM)
    return configuration_problem(native, getattr(model, "device", torch.device("cpu")),
                                 getattr(model, "quantization", None), getattr(model, "attention", "sdpa"))
