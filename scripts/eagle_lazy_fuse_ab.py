"""EAGLE's ``observe`` fusing each verified step's states at once ("old": ``_fuse_observed`` called
from ``observe``, as before 2026-11-28) against fusing them when the head next drafts ("new", the
code): ``auto`` (with the bundled head) on one Spec-Bench dev question per category (first turns,
chat template, 96 new tokens), two runners alternating per prompt.  Prints decoding seconds (wall
minus prefill), tokens/s and drafting seconds per variant, and whether both gave the same tokens
(they must: drafting never changes greedy output).

    python scripts/eagle_lazy_fuse_ab.py 2     # rounds
"""
import sys
import time

import leapdecode
from leapdecode.bench.workloads import load_workload
from leapdecode.core.runner import ModelRunner
from leapdecode.proposers.heads import eagle as E
m = leapdecode.load("qwen2.5-coder-1.5b")
qs = load_workload(None)[0]
cats = ["writing", "roleplay", "reasoning", "humanities", "stem", "translation", "qa", "math_reasoning", "coding",
        "extraction"]
picked = [next(q for q in qs if q.category == c) for c in cats]
new_observe = E.EagleProposer.observe
def old_observe(self, *a, **k):
    new_observe(self, *a, **k); self._fuse_observed()
runners = {"old": ModelRunner(m), "new": ModelRunner(m)}
res = {k: [0.0, 0, 0.0] for k in runners}
toks = {}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):  # rounds (0: the fusing cost only)
    for i, q in enumerate(picked):
        order = ("old", "new") if (i + rnd) % 2 == 0 else ("new", "old")
        for name in order:
            E.EagleProposer.observe = old_observe if name == "old" else new_observe
            out = leapdecode.generate(runners[name], q.turns[0], method="auto", max_new_tokens=96, chat=True)
            s = out.stats
            res[name][0] += s['wall_s'] - s['prefill_s']; res[name][1] += s['new_tokens']; res[name][2] += s.get('draft_s', 0)
            toks.setdefault((rnd, i), []).append(out.tokens)
same = all(a == b for a, b in toks.values())
for k, (sec, n, d) in res.items() if toks else ():
    print(f"{k}: decoding {sec:.2f} s, {n} tokens, {n/sec:.2f} tok/s, drafting {d:.2f} s")
if toks:
    print("same tokens:", same)

# what one fusing call costs right after a target forward (the head's fuse weights then come from
# memory): what a step by another arm no longer pays
import statistics  # noqa: E402

import torch  # noqa: E402
from leapdecode.models.kv_cache import KVCache  # noqa: E402
from leapdecode.proposers.heads.common import quantized_copy  # noqa: E402
from leapdecode.proposers.heads.store import load_head  # noqa: E402
model, cfg = m.model, m.model.cfg
head = quantized_copy(load_head(("eagle3", "eagle"), m, None)[0], "int8")
cache = KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 2048, dtype=torch.bfloat16)
hidden = []
with torch.inference_mode():
    model.forward(torch.randint(0, 1000, (1, 8)), cache, hidden_states=hidden)
    for rows in ([0], [0, 1, 2]):
        ts = []
        for _ in range(30):
            model.forward(torch.tensor([[5]]), cache)
            t = time.perf_counter()
            head.features_of(head.input_states(model, hidden, rows))
            ts.append(time.perf_counter() - t)
        print(f"fusing {len(rows)} row(s) after a target forward: median {1e3 * statistics.median(ts):.2f} ms")
