"""Grammar-constrained decoding of diffusion LMs: ``generate(..., json_schema= | regex= | grammar=)``.

"Constrained Decoding of Diffusion LLMs with Context-Free Grammars" (Mündler, Dekoninck and
Vechev, 2025; reference code eth-sri/constrained-diffusion).  The paper's decoder is LLaDA's
low-confidence remasking with one change: each time a (position, token) is about to be committed,
it checks that the partial output -- decided tokens at their positions, masked gaps in between --
can still be completed to a word of the grammar (non-emptiness of the intersection of the CFG with
the regular language of the partial output's completions); if not, that token's logit at that
position is set to -inf and the choice is made again (the next most confident position or token).

**What the engine allows here.**  leapdecode's structured-output engine is llguidance
(``constraints/grammar.py``): a matcher over a *left-to-right prefix*.  It can say which tokens may
follow a decided prefix, not whether a token placed after a masked gap can be completed around.
So this module checks exactly what a prefix engine can, and defers the rest:

* the *front* (the leftmost undecided answer position, everything before it decided and verified)
  is committed only with a token the grammar allows after the verified prefix: its logits are
  masked by the grammar (equivalent to the paper's reject-and-retry at that position, done in one
  mask); its confidence stays the unconstrained probability of the chosen token, as in the
  reference (``x0_p`` is read from the unmasked softmax);
* a commit *after a gap* follows stepwise decoding's order unchanged but is **provisional**: it is
  not checked when made (the paper would check it; llguidance cannot).  When the front reaches it
  (the gap before it is filled), it is checked in order; the first provisional token the grammar
  refuses is **remasked** and decoded again later at the front, where it is checked.  A remask
  costs extra denoising steps (``stats["grammar_remasked"]``, ``stats["extra_steps"]``); each
  position is remasked at most once (after a remask it is the front), so decoding always ends;
* end of sequence: an EOS token is accepted only where the grammar may end (at the front: the
  mask allows EOS only then; a provisional EOS reached by the front while the grammar cannot end
  is remasked).  The answer is cut at the first EOS, as in unconstrained decoding; positions after
  a verified EOS are outside the answer and decoded unconstrained (the canvas stays what the model
  would write, so a grammar that allows everything gives stepwise decoding's canvas exactly).  The
  mask token is never allowed anywhere.

Guarantee: every answer is a prefix the grammar allows; it is a complete word
(``stats["grammar_complete"]``) when the grammar ended it with an EOS or accepts the full span.
The span is fixed (``max_new_tokens``) and a prefix engine cannot know the shortest completion, so
a span too short for the grammar leaves an incomplete prefix, as ``max_new_tokens`` does in
causal constrained decoding.

Decoders (``SUPPORTED``): ``stepwise`` (its schedule; several commits per step are made one at a
time on the same logits) and ``fast-dllm`` (every position at or above the threshold, in
stepwise's order, one at a time, at least one per step; any of its caches).  Any other decoder is
an ``UnsupportedConstraintError`` naming it.  With a grammar that allows every token (and EOS
anywhere) each gives its unconstrained canvas, bit for bit (tested).

What it does not do: check out-of-order commits when they are made (the paper's CFG-intersection
test), or constrain the other decoders.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.constraint import Constraint
from ..errors import InvalidParameterError
from .common import Canvas, Counter, Greedy, block_steps, ranked_masked, transfer_counts
from .configs import DiffusionMethodConfig, FastDllmConfig, StepwiseConfig
from .loaded import DiffusionModel

SUPPORTED = ("stepwise", "fast-dllm")


class UnsupportedConstraintError(InvalidParameterError):
    """Structured output asked of a diffusion decoder that does not support it (CLI exit 2)."""


def check_supported(cfg: DiffusionMethodConfig) -> None:
    if cfg.method not in SUPPORTED:
        raise UnsupportedConstraintError(
            f"diffusion method {cfg.method!r} does not support structured output (json_schema / regex / grammar); "
            f"constrained diffusion decoding supports: {', '.join(SUPPORTED)}")


def structure_given(json_schema: Any = None, regex: str | None = None, grammar: str | None = None) -> bool:
    return any(v is not None for v in (json_schema, regex, grammar))


def check_structure(json_schema: Any = None, regex: str | None = None, grammar: str | None = None) -> None:
    """Exactly one of the three, its text valid as far as can be told without a tokenizer (a bad JSON
    schema, an empty regex or grammar: ``GrammarError``), before any model loads."""
    from ..constraints.grammar import grammar_text

    grammar_text(json_schema=json_schema, regex=regex, grammar=grammar)


@dataclass
class _Target:
    """The part of a causal ``LoadedModel`` that ``constraints.grammar.compile_constraint`` reads."""

    name: str
    tokenizer: Any
    model: Any  # has vocab_size
    eos_token_ids: set[int]


@dataclass
class _Vocab:
    vocab_size: int


class _Memory:
    """The llguidance tokenizer of one model, built once (~0.4 s)."""

    def __init__(self) -> None:
        self.items: dict[Any, Any] = {}

    def get(self, key, factory):
        if key not in self.items:
            self.items[key] = factory()
        return self.items[key]


@dataclass
class _Host:
    model: _Target
    memory: _Memory = field(default_factory=_Memory)


_HOSTS: "weakref.WeakKeyDictionary[DiffusionModel, _Host]" = weakref.WeakKeyDictionary()


def compile_for(model: DiffusionModel, *, json_schema: Any = None, regex: str | None = None,
                grammar: str | None = None) -> Constraint:
    """A fresh llguidance constraint over ``model``'s vocabulary (``GrammarError`` if it does not compile)."""
    from ..constraints.grammar import compile_constraint

    host = _HOSTS.get(model)
    if host is None:
        vocab = model.network.config.base.vocab_size
        host = _HOSTS[model] = _Host(_Target(model.name, model.tokenizer, _Vocab(vocab), set(model.eos_token_ids)))
    return compile_constraint(host, json_schema=json_schema, regex=regex, grammar=grammar)


class VerifiedPrefix:
    """The verified prefix: answer positions ``[0, checked)`` are decided and pushed into the
    constraint; ``ended`` once a verified EOS closed the answer."""

    def __init__(self, canvas: Canvas, constraint: Constraint, eos_ids: set[int], stats: dict) -> None:
        self.canvas, self.c, self.eos = canvas, constraint, eos_ids
        self.checked = 0
        self.ended = False
        self.stats = stats
        self.mask_cache: torch.Tensor | None = None

    @property
    def position(self) -> int | None:
        """Canvas index of the front, or None once the answer is closed or fully verified."""
        if self.ended or self.checked >= self.canvas.gen_len:
            return None
        return self.canvas.prompt_len + self.checked

    def allowed(self, vocab: int) -> torch.Tensor:
        """Tokens the grammar allows at the front ([vocab] bool), the mask token never."""
        if self.mask_cache is None:
            t0 = time.perf_counter()
            m = self.c.mask()
            self.stats["grammar_s"] += time.perf_counter() - t0
            out = torch.zeros(vocab, dtype=torch.bool)
            n = min(vocab, m.shape[0])
            out[:n] = m[:n]
            if self.canvas.mask_id < vocab:
                out[self.canvas.mask_id] = False
            self.mask_cache = out
        return self.mask_cache

    def advance(self) -> None:
        """Check the decided tokens at the front, in order: push the allowed ones, close the answer
        at an EOS the grammar accepts, remask the first refused one (a provisional commit)."""
        x, mask_id = self.canvas.x, self.canvas.mask_id
        t0 = time.perf_counter()
        while (p := self.position) is not None and int(x[p]) != mask_id:
            tok = int(x[p])
            ok = self.c.allows(tok)
            if ok and (tok in self.eos or self.c.is_eos(tok)):
                self.ended = True
            elif ok:
                self.c.push(tok)
                self.checked += 1
                self.mask_cache = None
                continue
            else:
                x[p] = mask_id
                self.stats["grammar_remasked"] += 1
            break
        self.stats["grammar_s"] += time.perf_counter() - t0

    def complete(self) -> bool:
        if self.ended:
            return True
        eos = sorted(self.eos)
        return self.checked >= self.canvas.gen_len and bool(eos) and self.c.allows(eos[0])


def front_choice(logits: torch.Tensor, allowed: torch.Tensor, pos: int) -> int | None:
    """The greedy token at the front among the allowed ones (None: the grammar allows nothing)."""
    row = logits[pos].double().masked_fill(~allowed.to(logits.device), float("-inf"))
    tok = int(row.argmax())
    return tok if bool(allowed[tok]) else None


class Choices:
    """One forward's greedy choices under the grammar: every position's token and confidence as
    ``Greedy.of`` gives them, except the front's, chosen among the tokens the grammar allows (its
    confidence: that token's unconstrained probability, as the reference reads ``x0_p``)."""

    def __init__(self, logits: torch.Tensor, mask_id: int) -> None:
        self.logits, self.mask_id = logits, mask_id
        self.pred = Greedy.of(logits, mask_id)
        self.probs: torch.Tensor | None = None

    def next(self, canvas: Canvas, front: VerifiedPrefix, masked: torch.Tensor) -> tuple[int, int, float]:
        """(position, token, confidence) of the next commit among ``masked``: stepwise's order."""
        tokens, conf = self.pred.tokens, self.pred.confidence
        fp = front.position
        if fp is not None and bool(masked[fp]):
            tok = front_choice(self.logits, front.allowed(self.logits.shape[-1]), fp)
            if tok is None:
                raise InvalidParameterError("the grammar allows no token after the decided prefix "
                                            f"{canvas.x[canvas.prompt_len:fp].tolist()}")
            if tok != int(tokens[fp]):
                if self.probs is None:  # the unconstrained probabilities, as Greedy.of computes them
                    row = self.logits.double().clone()
                    if self.mask_id < row.shape[-1]:
                        row[..., self.mask_id] = float("-inf")
                    self.probs = torch.softmax(row, dim=-1)
                tokens, conf = tokens.clone(), conf.clone()
                tokens[fp], conf[fp] = tok, self.probs[fp, tok]
        pos = int(ranked_masked(conf, masked)[0])
        return pos, int(tokens[pos]), float(conf[pos])


def commit(canvas: Canvas, front: VerifiedPrefix, pos: int, token: int) -> None:
    canvas.x[pos] = token
    front.advance()


def check_converges(stats: dict, limit: int) -> None:
    if stats["extra_steps"] > limit:  # each position is remasked at most once
        raise RuntimeError("constrained diffusion decoding did not converge: more remasks than answer positions "
                           "(a grammar state that refuses what its mask allowed?)")


def decode_stepwise(canvas: Canvas, fwd: Counter, cfg: StepwiseConfig, constraint: Constraint,
                    eos_ids: set[int], stats: dict) -> None:
    """``stepwise.decode`` with the grammar applied as the module docstring says: the same
    schedule, the same confidence order, one commit at a time; extra steps for remasked positions."""
    stats.update(grammar_remasked=0, extra_steps=0, grammar_s=0.0)
    front = VerifiedPrefix(canvas, constraint, eos_ids, stats)
    front.advance()
    for (start, end), steps in zip(canvas.blocks(), block_steps(canvas, cfg.steps)):
        counts = transfer_counts(end - start, steps)
        step = 0
        while bool(canvas.masked(start, end).any()):
            n = counts[step] if step < len(counts) else 1
            if step >= len(counts):
                stats["extra_steps"] += 1
                check_converges(stats, canvas.gen_len)
            step += 1
            choices = Choices(fwd.predict(canvas.x)[0], canvas.mask_id)
            for _ in range(n):
                masked = canvas.masked(start, end)
                if not bool(masked.any()):
                    break
                pos, tok, _conf = choices.next(canvas, front, masked)
                commit(canvas, front, pos, tok)
    stats["grammar_complete"] = front.complete()


def decode_fast_dllm(canvas: Canvas, fwd: Counter, cfg: FastDllmConfig, constraint: Constraint,
                     eos_ids: set[int], stats: dict) -> None:
    """``fast_dllm.decode`` with the grammar: each step commits, in stepwise's order and one at a
    time, every masked position of the block whose confidence (the front's under the grammar)
    reaches the threshold, at least one; remasked positions are decoded again by later steps
    (``extra_steps`` counts the steps beyond the block's masked count)."""
    from .fast_dllm import BlockCache

    stats.update(grammar_remasked=0, extra_steps=0, grammar_s=0.0)
    front = VerifiedPrefix(canvas, constraint, eos_ids, stats)
    front.advance()
    length = canvas.x.shape[0]
    for start, end in canvas.blocks():
        cache = None if cfg.cache == "none" else BlockCache(fwd, start, end, length, cfg.cache)
        first, step = True, 0
        while bool(canvas.masked(start, end).any()):
            if step >= end - start:
                stats["extra_steps"] += 1
                check_converges(stats, canvas.gen_len)
            step += 1
            if cache is None:
                logits = fwd.predict(canvas.x)[0]
            else:
                logits = cache.begin(canvas.x) if first else cache.step(canvas.x)
            first = False
            choices = Choices(logits, canvas.mask_id)
            committed = 0
            while bool((masked := canvas.masked(start, end)).any()):
                pos, tok, conf = choices.next(canvas, front, masked)
                if committed and conf < cfg.threshold:
                    break
                commit(canvas, front, pos, tok)
                committed += 1
    stats["grammar_complete"] = front.complete()


DECODERS = {"stepwise": decode_stepwise, "fast-dllm": decode_fast_dllm}
