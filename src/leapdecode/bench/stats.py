"""Benchmark statistics, computed from the per-run records of ``results.jsonl``.

Definitions (Spec-Bench's):

* a *prompt* is one (question, turn); each runner decodes every prompt ``repeats`` times
  and the per-prompt figures are the medians over the repeats;
* tokens/s of a runner = mean over prompts of (new tokens / wall time);
* speedup = that mean divided by the same mean for vanilla decoding (the ``vanilla``
  row: leapdecode, same model, dtype and device), over the same prompts; per task group
  and per category the means are taken over that group's prompts only;
* mean accepted = total new tokens / total target forward passes (1.00 for vanilla);
* identical = the runner's tokens equal vanilla's for the same prompt (greedy only);
  first divergence = the index of the first differing token when they are not.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from .workloads import group_of, group_order

REFERENCE = "vanilla"

UNSTEADY = 1.5  # a prompt whose repeats differ by more than this factor in tokens/s is flagged


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """None when identical, else the index of the first token that differs (a shorter
    sequence that is a prefix of the other diverges at its length)."""
    if list(tokens) == list(reference):
        return None
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return min(len(tokens), len(reference))


def _median(values: list) -> Any:
    values = [v for v in values if v is not None]
    if not values:
        return None
    m = statistics.median(values)
    return m


def _mean(values: Iterable) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def prompt_key(r: dict) -> tuple:
    return (str(r["question_id"]), int(r.get("turn", 1)))


def per_prompt(records: list[dict]) -> dict[str, dict[tuple, dict]]:
    """{runner name: {(question_id, turn): record of medians over the repeats}}."""
    groups: dict[str, dict[tuple, list[dict]]] = {}
    for r in records:
        groups.setdefault(r["method"], {}).setdefault(prompt_key(r), []).append(r)
    out: dict[str, dict[tuple, dict]] = {}
    for name, prompts in groups.items():
        out[name] = {}
        for key, rs in prompts.items():
            first = rs[0]
            agg = {k: first.get(k) for k in ("method", "system", "question_id", "category", "turn")}
            agg["group"] = first.get("group") or group_of(first["category"])
            agg["repeats"] = len(rs)
            for k in ("new_tokens", "decided_tokens", "wall_s", "tokens_per_s", "target_forwards", "peak_rss_mb",
                      "peak_gpu_mb"):
                agg[k] = _median([r.get(k) for r in rs])
            rates = [r["tokens_per_s"] for r in rs if r.get("tokens_per_s")]
            agg["spread"] = max(rates) / min(rates) if len(rates) > 1 else None  # the repeats' fastest / slowest
            idents = [r.get("identical") for r in rs if r.get("identical") is not None]
            agg["identical"] = all(idents) if idents else None
            divs = [r.get("first_divergence") for r in rs if r.get("first_divergence") is not None]
            agg["first_divergence"] = min(divs) if divs else None
            out[name][key] = agg
    return out


def _speedup(rows: dict[tuple, dict], ref: dict[tuple, dict], keys: list[tuple]) -> float | None:
    keys = [k for k in keys if k in rows and k in ref]
    ours = _mean(rows[k]["tokens_per_s"] for k in keys)
    base = _mean(ref[k]["tokens_per_s"] for k in keys)
    if ours is None or not base:
        return None
    return ours / base


def summarize(records: list[dict], reference: str = REFERENCE, order: list[str] | None = None) -> dict:
    """Per-runner summary rows (see the module docstring for the definitions)."""
    pp = per_prompt(records)
    ref = pp.get(reference, {})
    names = list(order or []) + [n for n in pp if n not in (order or [])]
    names = [n for n in names if n in pp]
    categories = sorted({r["category"] for r in records})
    groups = group_order({r.get("group") or group_of(r["category"]) for r in records})
    rows = []
    for name in names:
        prompts = pp[name]
        keys = list(prompts)
        by_group = {}
        for g in groups:
            gk = [k for k in keys if prompts[k]["group"] == g]
            if gk:
                by_group[g] = _speedup(prompts, ref, gk)
        by_cat = {}
        for c in categories:
            ck = [k for k in keys if prompts[k]["category"] == c]
            if ck:
                by_cat[c] = _speedup(prompts, ref, ck)
        new = sum(p["new_tokens"] or 0 for p in prompts.values())
        decided = sum(p.get("decided_tokens") or p["new_tokens"] or 0 for p in prompts.values())
        fw = [p["target_forwards"] for p in prompts.values()]
        forwards = sum(fw) if all(f is not None for f in fw) else None
        idents = [p["identical"] for p in prompts.values() if p["identical"] is not None]
        divs = [p["first_divergence"] for p in prompts.values() if p["first_divergence"] is not None]
        rss = [p["peak_rss_mb"] for p in prompts.values() if p.get("peak_rss_mb") is not None]
        gpu = [p["peak_gpu_mb"] for p in prompts.values() if p.get("peak_gpu_mb") is not None]
        rows.append({
            "name": name,
            "system": next(iter(prompts.values()))["system"],
            "prompts": len(prompts),
            "speedup": _speedup(prompts, ref, keys),
            "speedup_by_group": by_group,
            "speedup_by_category": by_cat,
            "tokens_per_s": _mean(p["tokens_per_s"] for p in prompts.values()),
            "mean_accepted": (decided / forwards) if forwards else None,  # tokens decided per forward
            "new_tokens": new,
            "wall_s": sum(p["wall_s"] or 0.0 for p in prompts.values()),
            "identical_pct": (100.0 * sum(idents) / len(idents)) if idents else None,
            # prompts whose repeats differ by more than UNSTEADY: a busy machine or a one-off cost was timed
            "unsteady": [f"{k[0]}/{k[1]}" for k, p in prompts.items() if (p.get("spread") or 0) > UNSTEADY],
            "identical": sum(idents) if idents else None,
            "compared": len(idents),
            "first_divergences": sorted(divs),
            "peak_rss_mb": max(rss) if rss else None,
            "peak_gpu_mb": max(gpu) if gpu else None,
        })
    return {"reference": reference, "groups": groups, "categories": categories, "rows": rows}
