"""Sampling parameters and the logits -> distribution transform.

One function, ``target_probs``, turns raw logits into the distribution a token
is drawn from; the verifier applies it to the target and stochastic drafters
apply the same to their own logits, so target and draft see identical
temperature / top-k / top-p / min-p / typical-p processing.  The order follows
transformers' ``generate``: repetition penalty, temperature, top-k, top-p,
min-p, typical-p.
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass

import torch

from ..errors import InvalidParameterError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidParameterError(msg)

        for name in ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
                bad(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            bad(f"min_p must be in [0, 1), got {self.min_p}")
        if not 0 < self.typical_p <= 1:
            bad(f"typical_p must be in (0, 1], got {self.typical_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            bad(f"seed must be an integer in [0, 2**63) or None, got {seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict:
        return asdict(self)


def apply_repetition_penalty(
    logits: torch.Tensor, penalty: float, history: torch.Tensor, extra: list[list[int]] | None = None
) -> torch.Tensor:
    """CTRL-style penalty (as transformers): divide positive, multiply negative logits.

    ``history`` (1-D ids) applies to every row; ``extra[i]`` adds tokens for row i only
    (a tree node's ancestors).
    """
    if penalty == 1.0:
        return logits
    seen = torch.zeros_like(logits, dtype=torch.bool)
    if history.numel():
        seen[:, history.to(logits.device)] = True
    if extra:
        for i, toks in enumerate(extra):
            if toks:
                seen[i, toks] = True
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature and truncation filters; returns logits with -inf outside the kept set."""
    logits = logits / p.temperature
    neg_inf = torch.finfo(logits.dtype).min
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, neg_inf)
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - p.top_p)
        remove_sorted[..., -1] = False  # keep at least one token
        remove = remove_sorted.scatter(-1, idx, remove_sorted)
        logits = logits.masked_fill(remove, neg_inf)
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        threshold = p.min_p * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, neg_inf)
    if p.typical_p < 1.0:
        logp = logits.log_softmax(-1)
        probs = logp.exp()
        ent = -(torch.nan_to_num(logp * probs)).sum(-1, keepdim=True)
        shifted = (-logp - ent).abs()
        sorted_shift, idx = torch.sort(shifted, dim=-1)
        cum = logits.gather(-1, idx).softmax(-1).cumsum(-1)
        last = (cum < p.typical_p).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
        remove_sorted = sorted_shift > sorted_shift.gather(-1, last)
        remove = remove_sorted.scatter(-1, idx, remove_sorted)
        logits = logits.masked_fill(remove, neg_inf)
    return logits


def target_probs(
    logits: torch.Tensor,
    p: SamplingParams,
    history: torch.Tensor | None = None,
    extra: list[list[int]] | None = None,
) -> torch.Tensor:
    """Distribution (rows sum to 1) that sampling draws from; for greedy, a one-hot of the argmax."""
    logits = logits.float()
    if history is not None and p.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, p.repetition_penalty, history, extra)
    if p.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    return filter_logits(logits, p).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, num_samples: int = 1) -> torch.Tensor:
    """Indices drawn from the distribution ``probs`` (1-D, or one distribution per row of a 2-D
    tensor; non-negative weights with a positive total), ``num_samples`` per distribution with
    replacement: ``[num_samples]``, or ``[rows, num_samples]``.

    Inverse transform sampling: the first index whose cumulative weight (fp64) exceeds ``u`` times
    the total, ``u`` uniform in [0, 1) from ``generator``.  That is the distribution
    ``torch.multinomial`` draws from (up to the rounding of the cumulative sum), and an index of
    zero weight is never drawn; on a CPU it is ~7x faster for a 50k-token vocabulary (about
    0.15 ms against 1 ms per draw, which was 13% of a batched smollm2-135m step with sampled
    requests: docs/lab-notes/benchmarks.md section 23)."""
    single = probs.dim() == 1
    p = probs.reshape(1, -1) if single else probs
    if p.dim() != 2 or p.shape[-1] == 0:
        raise ValueError(f"sample needs a 1-D or 2-D tensor of weights, got shape {tuple(probs.shape)}")
    u = torch.rand(p.shape[0], num_samples, generator=generator, dtype=torch.float64, device=p.device)
    idx = _inverse_cdf(p, u)
    return idx[0] if single else idx


def sample_at(probs: torch.Tensor, u: float) -> int:
    """The index of the 1-D distribution ``probs`` that inverse transform sampling gives for the
    uniform number ``u`` in [0, 1): ``sample``'s rule with a given ``u`` (a ``position_uniform``)."""
    if probs.dim() != 1 or probs.shape[0] == 0:
        raise ValueError(f"sample_at needs a 1-D tensor of weights, got shape {tuple(probs.shape)}")
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u!r}")
    uu = torch.full((1, 1), u, dtype=torch.float64, device=probs.device)
    return int(_inverse_cdf(probs.reshape(1, -1), uu)[0, 0])


def _inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of the weights ``p`` ``[rows, V]``, the first index whose fp64 cumulative weight
    exceeds ``u * total`` (``u`` ``[rows, n]`` in [0, 1)); never an index of zero weight."""
    p = p.double()
    cdf = p.cumsum(-1)
    total = cdf[:, -1:]
    if not bool(((total > 0) & torch.isfinite(total)).all()) or bool((p < 0).any()):
        raise ValueError("sample needs non-negative, finite weights with a positive total")
    idx = torch.searchsorted(cdf, u * total, right=True).clamp_(max=p.shape[-1] - 1)
    # u * total can round up to the total: step back to the last index of positive weight
    zero = p.gather(-1, idx) <= 0
    if bool(zero.any()):
        last = (torch.arange(p.shape[-1], device=p.device) * (p > 0)).argmax(-1, keepdim=True)
        idx = torch.where(zero, last.expand_as(idx), idx)
    return idx


_MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that a seeded sampled generation draws its token at sequence
    ``position`` with: a counter-based random stream (SplitMix64's finaliser over the seed and the
    position), so the number belongs to the position and not to how many draws came before it.

    This is what makes seeded sampling *drafter-invariant* (``core/verifier.py``): whatever tree a
    step verifies, the token at each position is ``sample_at(p, position_uniform(seed, pos))`` of
    the target's distribution ``p`` there, exactly the token vanilla decoding draws."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


def greedy_tokens(
    logits: torch.Tensor, p: SamplingParams, history: torch.Tensor | None = None,
    extra: list[list[int]] | None = None,
) -> torch.Tensor:
    if history is not None and p.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits.float(), p.repetition_penalty, history, extra)
    return logits.argmax(-1)
