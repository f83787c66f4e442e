"""EAGLE's ``observe`` fusing each verified step's states at once ("old": ``_fuse_observed`` called
from ``observe``, as before 2026-11-28) against fusing them when the head next drafts ("new", the
code): ``auto`` (with the bundled head) on one Spec-Bench dev question per category (first turns,
chat template, 96 new tokens), two runners alternating per prompt.  Prints decoding seconds (wall
minus prefill), tokens/s and drafting seconds per variant, and whether both gave the same tokens
(they must: drafting never changes greedy output); then what one fusing call costs right after a
target forward (the fuse weights then come from memory): what a step by another arm no longer pays
(docs/benchmarks.md section 37).

    python scripts/eagle_lazy_fuse_ab.py --rounds 2     # --rounds 0: the fusing cost only
"""

import argparse
import statistics
import time

import torch

import leapdecode
from leapdecode.bench.workloads import load_workload
from leapdecode.core.runner import ModelRunner
from leapdecode.models.kv_cache import KVCache
from leapdecode.proposers.heads import eagle
from leapdecode.proposers.heads.common import quantized_copy
from leapdecode.proposers.heads.store import load_head

CATEGORIES = ("writing", "roleplay", "reasoning", "humanities", "stem", "translation", "qa", "math_reasoning",
              "coding", "extraction")
NEW_OBSERVE = eagle.EagleProposer.observe


def old_observe(self, *args, **kwargs) -> None:
    """``observe`` as before: the states fused at once."""
    NEW_OBSERVE(self, *args, **kwargs)
    self._fuse_observed()


def alternate(loaded, rounds: int) -> None:
    questions = load_workload(None)[0]
    picked = [next(q for q in questions if q.category == c) for c in CATEGORIES]
    runners = {"old": ModelRunner(loaded), "new": ModelRunner(loaded)}
    totals = {k: [0.0, 0, 0.0] for k in runners}  # decoding s, tokens, drafting s
    tokens: dict = {}
    for rnd in range(rounds):
        for i, q in enumerate(picked):
            for name in ("old", "new") if (i + rnd) % 2 == 0 else ("new", "old"):
                eagle.EagleProposer.observe = old_observe if name == "old" else NEW_OBSERVE
                out = leapdecode.generate(runners[name], q.turns[0], method="auto", max_new_tokens=96, chat=True)
                s, t = out.stats, totals[name]
                t[0] += s["wall_s"] - s["prefill_s"]
                t[1] += s["new_tokens"]
                t[2] += s.get("draft_s", 0)
                tokens.setdefault((rnd, i), []).append(out.tokens)
    eagle.EagleProposer.observe = NEW_OBSERVE
    for name, (sec, n, draft) in totals.items():
        print(f"{name}: decoding {sec:.2f} s, {n} tokens, {n / sec:.2f} tok/s, drafting {draft:.2f} s")
    print("same tokens:", all(a == b for a, b in tokens.values()))


def fusing_cost(loaded) -> None:
    model, cfg = loaded.model, loaded.model.cfg
    head = quantized_copy(load_head(("eagle3", "eagle"), loaded, None)[0], "int8")
    cache = KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 2048, dtype=torch.bfloat16)
    hidden: list = []
    with torch.inference_mode():
        model.forward(torch.randint(0, 1000, (1, 8)), cache, hidden_states=hidden)
        for rows in ([0], [0, 1, 2]):
            ts = []
            for _ in range(30):
                model.forward(torch.tensor([[5]]), cache)  # evicts the head's weights from the caches
                t = time.perf_counter()
                head.features_of(head.input_states(model, hidden, rows))
                ts.append(time.perf_counter() - t)
            print(f"fusing {len(rows)} row(s) after a target forward: median {1e3 * statistics.median(ts):.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the prompts (0: the fusing cost only)")
    a = ap.parse_args()
    loaded = leapdecode.load("qwen2.5-coder-1.5b")
    if a.rounds > 0:
        alternate(loaded, a.rounds)
    fusing_cost(loaded)


if __name__ == "__main__":
    main()
