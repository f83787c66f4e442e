"""A generation's output processor: what it shows and what it reports (issue 48 item 1, vLLM v1's
output processor).  ``OutputProcessor`` turns the tokens each step keeps into text pieces (an
incremental detokenizer; stop strings, with the text that could still start one held back until
it cannot) and counts the statistics of the steps (forwards, accepted drafts, seconds per part),
which it hands over as the result's ``stats``.  It never touches a cache, a proposer or a model."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from .detokenizer import IncrementalDetokenizer, StopChecker


@dataclass
class Emitted:
    """What one step shows: ``piece`` (new text), ``text`` (all of it so far, cut at a stop
    string), ``finish`` (a stop string turns it into "stop"), ``covering`` (after a stop string:
    the tokens whose text covers the output up to it; None otherwise)."""

    piece: str
    text: str
    finish: str | None
    covering: list[int] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopChecker(stop)
        self.shown = 0  # characters of text shown so far
        self.hist: Counter[int] = Counter()  # accepted draft tokens per decoding step
        self.forwards = 0  # decoding forwards
        self.drafted_steps = self.drafted_accepted = 0  # steps that verified a tree, and their accepted tokens
        self.decided = 0  # tokens the decoding forwards decided (an end-of-sequence token too)
        self.tree_rows = 0  # draft nodes put through the target (after grammar pruning)
        self.draft_s = self.verify_s = self.constraint_s = 0.0

    # ------------------------------------------------------------ statistics
    def count_step(self, drafted: int, accepted: int) -> None:
        """One decoding step that verified ``drafted`` nodes and accepted ``accepted`` of them."""
        self.forwards += 1
        self.hist[accepted] += 1
        if drafted:
            self.drafted_steps += 1
            self.drafted_accepted += accepted
            self.tree_rows += drafted

    def draft_acceptance(self) -> float:
        """Draft tokens accepted per step that verified a tree, with a weak prior (one token per
        step, worth two steps), so that a generation that has not drafted yet gets tried."""
        return (self.drafted_accepted + 2.0) / (self.drafted_steps + 2.0)

    # ------------------------------------------------------------ text
    def emit(self, kept: list[int], finish: str | None) -> Emitted:
        """Add the tokens a step kept (``finish``: the step ended the generation, e.g. at its
        end-of-sequence token or its token limit): the text it can show now."""
        detok = self.detok
        before = len(detok.text)
        detok.add(kept)
        if finish is not None:
            detok.flush()
        text = detok.text
        covering = None
        cut = self.stops.find(text, before)
        if cut is not None:
            text = text[:cut]
            covering = detok.tokens_covering(cut)
            finish = "stop"
        safe = len(text) if finish else self.stops.safe_length(text)
        piece = ""
        if safe > self.shown:
            piece = text[self.shown : safe]
            self.shown = safe
        return Emitted(piece, text, finish, covering)

    @property
    def text(self) -> str:
        return self.detok.text

    # ------------------------------------------------------------ the result's statistics
    def stats(self, *, method: str, new_tokens: int, prompt_tokens: int, wall: float, prefill_s: float,
              prefix_reused: int, constrained: bool) -> dict[str, Any]:
        forwards = self.forwards
        stats: dict[str, Any] = {
            "method": method,
            "new_tokens": new_tokens,
            "prompt_tokens": prompt_tokens,
            "target_forwards": forwards,
            # tokens decided per decoding forward (vanilla: 1.00, its end-of-sequence token counted too)
            "mean_accepted": round(self.decided / forwards, 4) if forwards else 0.0,
            "decided_tokens": self.decided,
            "accept_hist": {str(k): self.hist[k] for k in sorted(self.hist)},
            "tree_rows": self.tree_rows,
            "wall_s": round(wall, 4),
            "prefill_s": round(prefill_s, 4),
            "prefix_reused": prefix_reused,
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "tokens_per_s": round(new_tokens / wall, 3) if wall > 0 else 0.0,
        }
        if constrained:
            stats["constraint_s"] = round(self.constraint_s, 5)  # masks, pruning, forced drafts, pushes
        return stats
