"""Teacher-forced top-1 accuracy of the store's (or bundled) EAGLE-3 head on the target's own greedy
text, per unrolled step (the first, second and third drafted token of a chain), on HumanEval's
held-apart prompts and on Spec-Bench dev prompts (docs/benchmarks.md section 27).

    python scripts/head_accuracy.py [--he 3] [--sb 5] [--tokens 96]

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
    a = ap.parse_args()
    t = leapdecode.load("qwen2.5-coder-1.5b")
    head = load_head(("eagle3",), t, None)[0].float().eval()
    weight = t.model.head_weight[:32768].float()
    he, _ = load_workload("humaneval-heldout")
    sb, _ = load_workload(None)
    sets = {"humaneval-heldout": he[: a.he], "spec-bench": sb[:: max(1, len(sb) // a.sb)][: a.sb]}
    for name, qs in sets.items():
        hits, cnt = [0] * a.steps, [0] * a.steps
        for q in qs:
            ids = encode_prompt(t, q.turns[0], chat=q.chat)
            seq = ids + leapdecode.generate(t, prompt_ids=ids, method="vanilla", max_new_tokens=a.tokens).tokens
            states: list = []
            _, labels = sequence_features(t, seq, layers=head.config["layers"], states=states)
            m = len(seq) - 1
            with torch.no_grad():
                emb = t.model.embed(torch.tensor(seq)).float()
                emb = torch.cat([emb, emb.new_zeros(a.steps, emb.shape[-1])])
                inp = head.fuse_states(states[0].float()[:m])
                for j, (h, c) in enumerate(chain_hits(head, inp, emb, labels, weight, a.steps, skip=len(ids) - 1)):
                    hits[j] += h
                    cnt[j] += c
        print(f"{name}: {len(qs)} prompts, top-1 per step {[round(h / c, 3) for h, c in zip(hits, cnt)]}, "
              f"scored tokens {cnt}", flush=True)


if __name__ == "__main__":
    main()
