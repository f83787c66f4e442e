"""Teacher-forced accuracy of an EAGLE or EAGLE-3 head, per Spec-Bench category and on HumanEval's
held-apart prompts (``leapdecode heads accuracy``; also after every ``train-head`` run).

Each prompt is continued greedily by the target (vanilla), the whole sequence runs once through the
target with hidden states (``training.data.sequence_features``, the proposers' path), and the head's
unrolled outputs (``training.train.chain_hits`` over EAGLE-3's training-time test, what decoding
computes for a chain) are scored against the target's greedy tokens over the generated part only:
the top-1 of the first, second and third drafted token.  This separates what the head predicts
from what a tree and the cost model make of it.  The sequences depend on the target alone, so they
are kept in the model cache (``train/eval/``) and a later run scores a new head in seconds.

The prompts are the bench's: Spec-Bench dev (``shared/data/spec_bench/questions_dev.jsonl``, the
first ``per_category`` of each category; left out with a note where the file is absent) and
HumanEval's held-apart problems, never trained on (``training.data``).
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import Callable

import torch

from ..results.page import DEV_SET, HUMANEVAL_SET
from ..bench.workloads import WorkloadError, find_default_workload, load_workload
from ..models import store
from ..proposers.heads.common import fingerprint
from ..proposers.heads.eagle import Eagle3Head, EagleHead, ttt_outputs
from ..proposers.heads.store import atomic_write

STEPS = 3  # drafted tokens scored per chain


def eval_questions(per_category: int, humaneval: int) -> tuple[dict[str, list], list[str]]:
    """(set name -> questions, notes): Spec-Bench dev's first ``per_category`` prompts of each category
    (``spec-bench/<category>``) and HumanEval's first ``humaneval`` held-apart problems."""
    sets: dict[str, list] = {}
    notes = []
    if per_category:
        try:
            dev, _ = load_workload(find_default_workload())
        except WorkloadError as e:  # no shared data here: scored on HumanEval alone, said
            notes.append(f"Spec-Bench dev not scored: {e}")
            dev = []
        for q in dev:
            picked = sets.setdefault(f"spec-bench/{q.category}", [])
            if len(picked) < per_category:
                picked.append(q)
    if humaneval:
        he, _ = load_workload("humaneval-heldout")
        sets[HUMANEVAL_SET] = he[:humaneval]
    return sets, notes


def eval_sequences(target, layers: list[int], sets: dict[str, list], tokens: int,
                   progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict[str, list[dict]]:
    """Per set, each prompt's sequence (prompt and the target's greedy continuation), labels, final
    features and the ``layers``' states, from the model cache when an earlier run made them."""
    from ..api import generate
    from ..core.prompt import encode_prompt
    from .data import sequence_features

    ident = json.dumps([fingerprint(target), list(layers), tokens,
                        {k: [str(q.question_id) for q in qs] for k, qs in sets.items()}], sort_keys=True)
    path = store.cache_dir() / "train" / "eval" / f"{hashlib.sha1(ident.encode()).hexdigest()[:20]}.pt"
    if path.is_file():
        try:
            saved = torch.load(path, weights_only=True, map_location="cpu")
            if saved.get("ident") == ident:
                return saved["sets"]
        except Exception:  # noqa: BLE001 (a torn cache file: made again)
            pass
    out: dict[str, list[dict]] = {}
    advance = progress("accuracy: the target's text", sum(len(qs) for qs in sets.values())) if progress else None
    for name, qs in sets.items():
        for q in qs:
            ids = encode_prompt(target, q.turns[0], chat=q.chat)
            if len(ids) + tokens + 1 > target.max_seq_len:  # (a small model's context; a set may end up empty)
                continue
            seq = ids + generate(target, prompt_ids=ids, method="vanilla", max_new_tokens=tokens).tokens
            states: list = []
            feats, labels = sequence_features(target, seq, layers=list(layers), states=states)
            out.setdefault(name, []).append({
                "ids": torch.tensor(seq, dtype=torch.int32), "prompt_len": len(ids), "labels": labels.to(torch.int32),
                "feats": feats.to(torch.bfloat16), "states": states[0].to(torch.bfloat16) if states else None})
            if advance:
                advance()
    store.make_dir(path.parent)
    buf = io.BytesIO()
    torch.save({"ident": ident, "sets": out}, buf)
    atomic_write(path, buf.getvalue())
    return out


def chain_hits(head: EagleHead, inp: torch.Tensor, emb: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
               steps: int, skip: int = 0) -> list[tuple[int, int]]:
    """Teacher-forced top-1 of each unrolled step of ``ttt_outputs(head, inp, emb, steps)`` (the
    first, second, ... drafted token of a chain): per step ``j``, (hits, rows) over rows ``>= skip``
    whose prediction through ``weight`` equals ``labels[1 + j + row]``."""
    m = inp.shape[0]
    res = []
    for j, out in enumerate(ttt_outputs(head, inp, emb, steps)):
        pred = (head.readout(out[: m - j]).float() @ weight.T).argmax(-1)
        ok = (pred == labels[1 + j : 1 + m])[skip:]
        res.append((int(ok.sum()), ok.numel()))
    return res


def score(head: EagleHead, target, seqs: dict[str, list[dict]], steps: int = STEPS, train_vocab: int = 0) -> dict:
    """{set: {"top1": [step 1, 2, ...], "tokens": scored tokens, "prompts": n}}, plus ``DEV_SET``: the
    Spec-Bench sets together, token-weighted.  ``train_vocab``: predictions among the lowest ids only
    (0: the whole vocabulary, what decoding uses)."""
    head = head.float().eval()
    dev = next(head.parameters()).device  # (the cached sequences are on the CPU; the head may be on a GPU)
    weight = target.model.head_weight.detach()
    weight = (weight[:train_vocab] if train_vocab else weight).float().to(dev)
    embed = target.model.embed
    res: dict[str, dict] = {}
    dev_hits, dev_count = [0] * steps, [0] * steps
    for name, items in seqs.items():
        hits, count = [0] * steps, [0] * steps
        for s in items:
            ids, labels = s["ids"].long(), s["labels"].long().to(dev)
            m = len(ids) - 1
            with torch.no_grad():
                emb = embed(ids.to(embed.weight.device)).float().to(dev)
                emb = torch.cat([emb, emb.new_zeros(steps, emb.shape[-1])])
                inp = head.fuse_states(s["states"].float()[:m].to(dev)) if isinstance(head, Eagle3Head) else \
                    s["feats"].float()[:m].to(dev)
                for j, (h, c) in enumerate(chain_hits(head, inp, emb, labels, weight, steps, skip=s["prompt_len"] - 1)):
                    hits[j] += h
                    count[j] += c
        res[name] = {"top1": [round(h / c, 4) if c else None for h, c in zip(hits, count)], "tokens": count[0],
                     "prompts": len(items)}
        if name.startswith("spec-bench/"):
            dev_hits = [a + b for a, b in zip(dev_hits, hits)]
            dev_count = [a + b for a, b in zip(dev_count, count)]
    if any(dev_count):
        res[DEV_SET] = {"top1": [round(h / c, 4) if c else None for h, c in zip(dev_hits, dev_count)],
                    "tokens": dev_count[0], "prompts": sum(v["prompts"] for k, v in res.items()
                                                           if k.startswith("spec-bench/"))}
    return res


def accuracy(target, head: EagleHead, *, per_category: int = 2, humaneval: int = 8, tokens: int = 96,
             progress: Callable[[str, int], Callable[[], None]] | None = None) -> dict:
    """The head's teacher-forced top-1 per drafted step on every set (``score``), with the notes."""
    sets, notes = eval_questions(per_category, humaneval)
    layers = list(head.config.get("layers") or []) if isinstance(head, Eagle3Head) else []
    seqs = eval_sequences(target, layers, sets, tokens, progress)
    return {"sets": score(head, target, seqs), "notes": notes, "tokens_per_prompt": tokens,
            "per_category": per_category, "humaneval": humaneval}
