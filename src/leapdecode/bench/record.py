"""One line of ``results.jsonl``: what one runner did on one prompt in one repeat (``BenchRecord``).

``to_dict`` gives the line's keys in the order the file has always had them; the engine's own
statistics (``RECORDED_STATS``) appear only where the generation reported them (leapdecode's rows),
the structured-output outcome only for a prompt constrained to a schema.  ``from_dict`` reads a
line back, so ``BenchRecord.from_dict(d).to_dict() == d`` for every line written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from .runners import RunOutput
from .stats import first_divergence
from .workloads import Question

# a leapdecode generation's stats kept per record (where the time went, what was drafted)
RECORDED_STATS = ("tree_rows", "prefill_s", "draft_s", "verify_s", "auto_arms")


@dataclass
class StructuredOutcome:
    """A constrained output: valid against its schema (None: Python cannot check the schema; only for
    outputs that ``ended``, i.e. reached their end-of-sequence token), and the grammar engine's time."""

    valid: bool | None
    ended: bool
    constraint_s: float | None

    @classmethod
    def of(cls, res: RunOutput, schema: dict) -> "StructuredOutcome":
        ended = res.finish_reason == "stop"
        return cls(valid=output_valid(res.text, schema) if ended else None, ended=ended,
                   constraint_s=res.constraint_s)


@dataclass
class BenchRecord:
    method: str  # the row's name (``vanilla``, ``pld:cost_aware=false``, ``llama-server``)
    model: str
    system: str  # leapdecode, hf, llama.cpp
    question_id: str | int
    category: str
    group: str
    turn: int
    repeat: int
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    target_forwards: int | None
    decided_tokens: int  # tokens decided by the target's forwards (end-of-sequence included)
    mean_accepted: float | None
    identical: bool | None  # the tokens are vanilla's (greedy only)
    first_divergence: int | None
    finish_reason: str
    peak_rss_mb: float | None
    peak_gpu_mb: float | None
    stats: dict[str, Any] = field(default_factory=dict)  # the ``RECORDED_STATS`` the generation reported
    structured: StructuredOutcome | None = None

    @classmethod
    def of_run(cls, res: RunOutput, *, method: str, system: str, model: str, q: Question, turn: int, repeat: int,
               prompt_tokens: int, reference: list[int] | None) -> "BenchRecord":
        """The record of one run; ``reference``: vanilla's tokens for the prompt (greedy runs), else None."""
        div = first_divergence(res.tokens, reference) if reference is not None else None
        n = res.new_tokens
        gs = res.extra.get("stats") or {}  # a leapdecode generation's own stats
        # tokens decided per forward: a leapdecode generation's own count (its end-of-sequence token
        # included: vanilla is 1.00), else the new tokens
        decided = gs.get("decided_tokens", n)
        schema = q.meta.get("json_schema")
        return cls(method=method, model=model, system=system, question_id=q.question_id, category=q.category,
                   group=q.group, turn=turn, repeat=repeat, prompt_tokens=prompt_tokens, new_tokens=n,
                   wall_s=round(res.wall_s, 5), tokens_per_s=round(n / res.wall_s, 4) if res.wall_s > 0 else 0.0,
                   target_forwards=res.target_forwards, decided_tokens=decided,
                   mean_accepted=round(decided / res.target_forwards, 4) if res.target_forwards else None,
                   identical=(div is None) if reference is not None else None, first_divergence=div,
                   finish_reason=res.finish_reason, peak_rss_mb=res.peak_rss_mb, peak_gpu_mb=res.peak_gpu_mb,
                   stats={k: gs[k] for k in RECORDED_STATS if k in gs},
                   structured=StructuredOutcome.of(res, schema) if "json_schema" in q.meta else None)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("stats", "structured")}
        out.update(self.stats)
        if self.structured is not None:
            out.update(valid=self.structured.valid, ended=self.structured.ended,
                       constraint_s=self.structured.constraint_s)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "BenchRecord":
        own = {f.name for f in fields(cls)} - {"stats", "structured"}
        structured = StructuredOutcome(valid=d["valid"], ended=d.get("ended", d["valid"] is not None),
                                       constraint_s=d.get("constraint_s")) if "valid" in d else None
        return cls(**{k: d[k] for k in own}, stats={k: d[k] for k in RECORDED_STATS if k in d},
                   structured=structured)


def output_valid(text: str, schema: dict) -> bool | None:
    """The output parses as JSON and validates against the schema (``jsonschema``); None when
    Python cannot check it (a pattern in an ECMA-262 regex dialect that ``re`` does not read, a
    ``$ref`` to a remote schema)."""
    import jsonschema

    try:
        instance = json.loads(text)
    except ValueError:
        return False
    try:
        jsonschema.validators.validator_for(schema)(schema).validate(instance)
    except jsonschema.ValidationError:
        return False
    except Exception:  # noqa: BLE001  a pattern re cannot read (re.error), a remote $ref (referencing)
        return None
    return True
