"""Teacher-forced top-1 accuracy of the store's (or bundled) EAGLE-3 head on the target's own greedy
text, per unrolled step (the first, second and third drafted token of a chain), on HumanEval's
held-apart prompts and on Spec-Bench dev prompts (docs/lab-notes/benchmarks.md section 27).

    python scripts/head_accuracy.py [--he 3] [--sb 5] [--tokens 96]
    python scripts/head_accuracy.py --head A --head B --per-category 2   # two heads, per Spec-Bench category

Each prompt is continued greedily (vanilla), the whole sequence runs once through the target with
hidden states (`heads_train.sequence_features`, the proposers' path), and the head's unrolled
outputs (`heads_train.chain_hits` over `ttt_outputs`, what decoding computes for a chain) are scored against the
target's greedy tokens over the generated part only. This separates what the head predicts from
what a tree and the cost model make of it.
"""

import argparse

import torch

import leapdecode
from leapdecode.bench.workloads import load_workload
from leapdecode.core.generate import encode_prompt
from leapdecode.heads_train import chain_hits, sequence_features
from leapdecode.proposers.heads.store import load_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--he", type=int, default=3)
    ap.add_argument("--sb", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--head", action="append", default=[],
                    help="a head directory to score (repeat to compare heads on the same text; default: the store's)")
    ap.add_argument("--per-category", type=int, default=0,
                    help="instead of --sb: this many Spec-Bench dev prompts of every category, reported per category")
    a = ap.parse_args()
    t = leapdecode.load("qwen2.5-coder-1.5b")
    heads = {str(p): load_head(("eagle3",), t, p)[0].float().eval() for p in (a.head or [None])}
    weight = t.model.head_weight[:32768].float()
    he, _ = load_workload("humaneval-heldout")
    sb, _ = load_workload(None)
    sets = {"humaneval-heldout": he[: a.he]}
    if a.per_category:
        for q in sb:
            picked = sets.setdefault(f"spec-bench/{q.category}", [])
            if len(picked) < a.per_category:
                picked.append(q)
    else:
        sets["spec-bench"] = sb[:: max(1, len(sb) // a.sb)][: a.sb]
    layers = {tuple(h.config["layers"]) for h in heads.values()}
    if len(layers) != 1:
        raise SystemExit(f"heads fuse different layers {sorted(layers)}: score them in separate runs")
    for name, qs in sets.items():
        hits = {k: [0] * a.steps for k in heads}
        cnt = {k: [0] * a.steps for k in heads}
        for q in qs:
            ids = encode_prompt(t, q.turns[0], chat=q.chat)
            seq = ids + leapdecode.generate(t, prompt_ids=ids, method="vanilla", max_new_tokens=a.tokens).tokens
            states: list = []
            _, labels = sequence_features(t, seq, layers=list(next(iter(layers))),
                                          states=states)
            m = len(seq) - 1
            with torch.no_grad():
                emb = t.model.embed(torch.tensor(seq)).float()
                emb = torch.cat([emb, emb.new_zeros(a.steps, emb.shape[-1])])
                for k, head in heads.items():
                    inp = head.fuse_states(states[0].float()[:m])
                    for j, (h, c) in enumerate(chain_hits(head, inp, emb, labels, weight, a.steps, skip=len(ids) - 1)):
                        hits[k][j] += h
                        cnt[k][j] += c
        for k in heads:
            print(f"{name} [{k}]: {len(qs)} prompts, top-1 per step "
                  f"{[round(h / c, 3) if c else None for h, c in zip(hits[k], cnt[k])]}, scored tokens {cnt[k]}", flush=True)


if __name__ == "__main__":
    main()
