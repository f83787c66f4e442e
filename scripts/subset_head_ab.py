"""Drafting on the target's quantized head (now) against the code before it (docs/benchmarks.md
section 31), in one process: two runners of qwen2.5-coder-1.5b decode the same held-apart
HumanEval prompts alternately, one with the earlier ``subset_head`` (a bf16 copy of the
dequantized head's first rows) and the earlier int8 conversion of a head's layers (torch's
``Int8Linear``) patched in.  Prints decoding tokens/s, tokens per target forward and drafting
seconds per round, and whether both gave the same tokens (they must).

    python scripts/subset_head_ab.py eagle      # or draft, medusa, ...
"""
import argparse

import torch

import leapdecode
from leapdecode import ModelRunner
from leapdecode.bench.workloads import load_workload
from leapdecode.models.linear import make_linear
from leapdecode.models.quant import Int8Linear
from leapdecode.proposers import common as pc
from leapdecode.proposers import draft_model as dm
from leapdecode.proposers.heads import common as hc

NEW = {"subset": pc.subset_head, "int8": hc.int8_linear}


def old_subset_head(ctx, draft, size, extra, vocab=None):
    """``subset_head`` before: the first ``size`` rows of the dequantized head as a bf16 layer."""
    model = draft.model
    weight = model.head_weight
    vocab = min(vocab or model.vocab_size, model.vocab_size)
    if weight is None or size <= 0 or vocab <= 2 * size:
        return None
    base = ctx.remember(("subset_head_before", id(model), size), lambda: make_linear(weight[:size]))
    extra_ids = torch.tensor(sorted({t for t in extra if size <= t < vocab}), dtype=torch.long)
    rows = make_linear(weight[extra_ids]) if len(extra_ids) else None
    return pc.SubsetHead(base, torch.arange(size), extra_ids, rows, dtype=weight.dtype)


def old_int8_linear(linear):
    """``int8_linear`` before: torch's per-row int8 kernel."""
    if Int8Linear.unsupported(linear.out_features, linear.in_features, linear.weight.device) is not None:
        return None
    return Int8Linear.from_float(linear.weight, linear.bias)


def use(before: bool) -> None:
    subset = old_subset_head if before else NEW["subset"]
    hc.subset_head = dm.subset_head = subset  # the modules that call it
    hc.int8_linear = old_int8_linear if before else NEW["int8"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("method", nargs="?", default="eagle")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    he, _ = load_workload("humaneval-heldout")
    prompts = [(q.turns[0], q.chat) for q in he[: args.prompts]]
    target = leapdecode.load("qwen2.5-coder-1.5b")
    runners = {"before": ModelRunner(target, prefix_cache_bytes=0), "now": ModelRunner(target, prefix_cache_bytes=0)}
    for name, runner in runners.items():  # warm-up: conversions and cost probes outside the timing
        use(name == "before")
        leapdecode.generate(runner, prompts[0][0], method=args.method, max_new_tokens=16, chat=prompts[0][1])
    tot = {k: [0, 0, 0.0, 0.0] for k in runners}
    tokens: dict[tuple[int, str], list[int]] = {}
    for rnd in range(args.rounds):
        order = list(runners) if rnd % 2 == 0 else list(runners)[::-1]
        for i, (text, chat) in enumerate(prompts):
            for name in order:
                use(name == "before")
                r = leapdecode.generate(runners[name], text, method=args.method, max_new_tokens=args.new, chat=chat)
                st, d = r.stats, tot[name]
                d[0] += len(r.tokens)
                d[1] += st.get("target_forwards", 0)
                d[2] += st["wall_s"] - st["prefill_s"]
                d[3] += st.get("draft_s", 0.0)
                tokens.setdefault((i, name), r.tokens)
        print(f"round {rnd}: " + " | ".join(f"{k}: {n / w:.2f} tok/s decoding, {n / f:.2f} tokens/forward, "
                                            f"drafting {ds:.1f} s" for k, (n, f, w, ds) in tot.items()), flush=True)
    same = all(tokens[(i, "before")] == tokens[(i, "now")] for i in range(len(prompts)))
    print("same tokens:", same)


if __name__ == "__main__":
    main()
