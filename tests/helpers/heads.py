"""Trained draft heads on tiny models: the prompts and training text, a few seconds of training, and the
first-three-tokens chi-square check of a sampled head method (tests/test_heads.py, test_hydra.py,
test_eagle3.py, test_auto_head.py, test_head_storage.py and conftest's ``trained_head_dir``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import leapdecode
from leapdecode import ModelRunner
from leapdecode.core.sampling import SamplingParams, target_probs
from leapdecode.proposers.heads.common import fingerprint
from leapdecode.proposers.heads.hydra import HydraHeads
from leapdecode.proposers.heads.store import save_head
from leapdecode.training.train import Recipe, train_head

ALPHA = 0.01  # significance level of the chi-square tests
PROMPTS = ["the cat sat on the mat the cat", "def f(x): return x\ndef g(y):", "hello hello hello world",
           "abcabcab", "xyz xyz xy", "aaaa", " return xabzz", "zz return xzz return"]
TRAIN_TEXT = ("the cat sat on the mat. hello world. def f(x): return x\n" * 6
              + "abc xyz " * 20 + "\n".join(f"line {i}: the cat {i % 3}" for i in range(40)))


def vanilla(model, ids, **kw):
    return leapdecode.generate(model, prompt_ids=ids, method="vanilla", **kw)


def train_tiny_head(kind, model, out: Path, steps: int, **kw) -> dict:
    data = out.parent / "data"
    data.mkdir(exist_ok=True)
    (data / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:6]))
    (data / "text.txt").write_text(TRAIN_TEXT)
    recipe = Recipe(kind=kind, data=(str(data / "prompts.jsonl"), str(data / "text.txt")), max_prompts=6,
                    gen_tokens=48, text_chunks=8, seq_len=64, steps=steps, batch=2, lr=kw.pop("lr", 3e-3),
                    medusa_heads=3, val_prompts=0, checkpoint_minutes=kw.pop("checkpoint_minutes", 5.0),
                    eval_per_category=0, eval_humaneval=0)
    kw.setdefault("log", lambda m: None)
    return train_head(model, recipe, out, progress=False, **kw)


def next_probs(model, ids, params) -> torch.Tensor:
    cache = model.model.new_cache(batch_size=1, max_len=len(ids) + 8)
    with torch.no_grad():
        logits = model.model.forward(torch.tensor([ids]), cache, logits_for=slice(-1, None))[0, -1]
    return target_probs(logits[None].float(), params)[0].double()


def joint3(model, ids, params) -> dict:
    out = {}
    p1 = next_probs(model, ids, params)
    for x in torch.nonzero(p1).flatten().tolist():
        p2 = next_probs(model, ids + [x], params)
        for y in torch.nonzero(p2).flatten().tolist():
            p3 = next_probs(model, ids + [x, y], params)
            for z in torch.nonzero(p3).flatten().tolist():
                out[(x, y, z)] = float(p1[x] * p2[y] * p3[z])
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


def count_first_three(model, ids, make_proposer, n, params):
    """Counts of the first three tokens over runs 0..n-1, how many runs drafted and how many accepted
    a draft (each run is cancelled once three tokens are decided).  Unseeded runs (the global torch
    seed i fixed), so the verifier's recursive rejection sampling reads the heads' draft
    distributions (a seeded run's draws are the positions' own numbers whatever the drafts: the
    same-seed tests of tests/test_lossless.py cover those); each run starts from a runner memory
    with nothing learned (auto's bandit tries every arm afresh)."""
    from leapdecode.core.generate import Generation

    counts: dict = {}
    drafted = accepted = 0
    runner = ModelRunner(model)
    for i in range(n):
        runner.memory.clear()
        torch.manual_seed(i)
        prop = make_proposer()
        g = Generation(runner, ids, SamplingParams(**params), prop, method="test", max_new_tokens=12)
        seen = []
        observe = prop.observe

        def spy(tokens, tree, verdict, logits, hidden=None, observe=observe, seen=seen, g=g):
            seen.append((len(tree), len(verdict.accepted)))
            observe(tokens, tree, verdict, logits, hidden)
            if len(tokens) >= len(ids) + 3:
                g.cancel()

        prop.observe = spy
        res = g.run()
        assert len(res.tokens) >= 3, res
        drafted += any(t for t, _ in seen)
        accepted += any(a for _, a in seen)
        key = tuple(res.tokens[:3])
        counts[key] = counts.get(key, 0) + 1
    return counts, drafted, accepted


def chi2_against(chi2, counts, expected):
    keys = sorted(set(expected) | set(counts))
    return chi2([counts.get(k, 0) for k in keys], [expected.get(k, 0.0) for k in keys])


def random_hydra(model, seed: int = 0, std: float = 0.05, heads: int = 3) -> HydraHeads:
    torch.manual_seed(seed)
    head = HydraHeads.for_target(model, heads=heads)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * std)
    return head.eval()


def write_hydra(model, directory, seed: int = 0):
    save_head(directory, random_hydra(model, seed), {"target": {"name": model.name, "fingerprint": fingerprint(model)},
                                                     "steps": 0, "data": {}, "acceptance": None})
    return directory
