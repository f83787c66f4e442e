"""Stochastic beams: sampling ``k`` sequences without replacement.

Papers:

* "Stochastic Beams and Where to Find Them: The Gumbel-Top-k Trick for Sampling Sequences
  Without Replacement" (Kool, van Hoof, Welling, ICML 2019): stochastic beam search
  (``strategy="stochastic-beam"``);
* "Conditional Poisson Stochastic Beams" (Meister, Amini, Vieira, Cotterell, EMNLP 2021):
  conditional Poisson stochastic beam search (``strategy="cps-beam"``).

The model's distribution over sequences is ``p(y) = prod_t softmax(logits_t / T)[y_t]`` at the
sampling temperature ``T``; a sequence ends with an end-of-sequence token or at
``max_new_tokens`` (both are leaves of the sequence tree).

**Stochastic beam search** perturbs every node of the sequence tree with a Gumbel variable so
that the perturbed log-probability of a node is the maximum of its leaves' perturbed
log-probabilities ``log p(y) + Gumbel``; the ``k`` leaves with the largest perturbations are then
an exact sample of ``k`` sequences without replacement (Gumbel-top-k), the first being an exact
sample from ``p``.  Top-down: the root's perturbation is 0; a node with perturbed value ``G``
draws for each child ``c`` an independent ``G_c ~ Gumbel(log p(c))`` and conditions them on their
maximum ``Z`` being ``G``:  ``G~_c = -log(exp(-G) - exp(-Z) + exp(-G_c))`` (computed in the
paper's stable form).  Each round keeps the ``k`` candidates with the largest ``G~`` among the
children of the unfinished beams and the finished beams, which stay in the beam with their value;
the search ends when all ``k`` are finished.  Hypotheses come out in the order of their keys:
``score`` is the key ``G``, ``logprob`` is ``log p(y)``.

**Conditional Poisson stochastic beam search** replaces beam search's top-k with a conditional
Poisson sample of size ``k``: the candidates (children of the unfinished beams, and the finished
beams) get weights ``w_n``, and a set ``S`` of ``k`` is drawn with probability proportional to
``prod_{n in S} w_n``.  As in the paper (and its code), ``w_n = p_n / (1 - p_n)``, the odds of the
candidate's probability ``p_n`` normalized over the round's candidates.  Annealing ``T -> 0``
recovers beam search.  The sample is exact: the normalizer ``e_k(w)`` (the elementary symmetric
polynomial) is the degree-``k`` coefficient of ``prod_n (1 + w_n z)``, computed in log space as a
balanced tree of polynomial products truncated at degree ``k`` (``O(N k^2)``, depth ``log N``);
the set is drawn top-down, each node splitting its ``j`` picks between its two halves with
probability ``L[a] R[j - a] / P[j]``.  Each hypothesis carries ``log_inclusion``, the sum over the
rounds of the log-probability that its prefix was in the round's sample (``pi_n = w_n
e_{k-1}(w without n) / e_k(w)``), the quantity the paper's consistent estimators divide by.
``score`` and ``logprob`` are ``log p(y)``; hypotheses come best first.

Both run every round's new beams in one forward over the shared token tree (``search.TreeKV``).
Random numbers come from a CPU generator seeded by ``seed``: the same seed gives the same samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .search import ROOT, Hypothesis, TreeSearch, log_probs


@dataclass
class Particle:
    node: int
    tokens: list[int]
    logprob: float  # log p(tokens) at the temperature
    key: float  # the perturbed log-probability (stochastic beam search)
    done: bool
    row: int = -1
    log_inclusion: float = 0.0  # conditional Poisson: sum of the rounds' log inclusion probabilities


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, stable at both ends."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def gumbel_keys(parent_key: torch.Tensor, phi: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Children's perturbed log-probabilities given their parents' (``parent_key`` ``[P]``) and
    their log-probabilities ``phi`` (``[P, V]``): independent Gumbels at ``phi``, conditioned on
    their row maximum being the parent's key (Kool et al., 2019, appendix B.3)."""
    u = torch.rand(phi.shape, generator=generator, dtype=torch.float64).clamp_(min=torch.finfo(torch.float64).tiny)
    g = phi - torch.log(-torch.log(u))
    z = g.max(dim=-1, keepdim=True).values
    t = parent_key[:, None]
    v = t - g + log1mexp(torch.clamp(g - z, max=0.0))
    return t - torch.relu(v) - torch.log1p(torch.exp(-v.abs()))


class StochasticBeamSearch(TreeSearch):
    """Gumbel-top-k stochastic beam search (Kool et al., 2019)."""

    def begin(self, logits: torch.Tensor) -> None:
        self.beams = [Particle(ROOT, [], 0.0, 0.0, False, 0)]
        self.logp = log_probs(logits[None], self.temperature).double().cpu()
        self.length = 0

    def extension_logprobs(self, open_: list) -> torch.Tensor:
        """``[beams, vocab]`` fp64: each open beam's log-probability plus each next token's."""
        rows = self.logp.index_select(0, torch.tensor([b.row for b in open_]))
        return torch.tensor([b.logprob for b in open_], dtype=torch.float64)[:, None] + rows

    def condition(self, parent_key: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
        """The round's perturbed keys of the children (``gumbel_keys``)."""
        return gumbel_keys(parent_key, phi, self.generator)

    def advance(self) -> bool:
        open_ = [b for b in self.beams if not b.done]
        if not open_:
            return True
        k = self.cfg.num_beams
        phi = self.extension_logprobs(open_)
        keys = self.condition(torch.tensor([b.key for b in open_], dtype=torch.float64), phi)
        closed = [b for b in self.beams if b.done]
        vocab = phi.shape[-1]
        pool = torch.cat([keys.reshape(-1), torch.tensor([b.key for b in closed], dtype=torch.float64)])
        top = torch.topk(pool, min(k, int(torch.isfinite(pool).sum())))
        last = self.length + 1 >= self.max_new_tokens
        beams = []
        for key, flat in zip(top.values.tolist(), top.indices.tolist()):
            if flat >= keys.numel():
                beams.append(closed[flat - keys.numel()])
                continue
            parent, tok = open_[flat // vocab], flat % vocab
            beams.append(Particle(parent.node, parent.tokens + [tok], float(phi[flat // vocab, tok]), key,
                                  last or tok in self.eos))
        self.length += 1
        return (yield from self.run_round(beams))

    def run_round(self, beams: list[Particle]) -> bool:
        """Make ``beams`` the beam; run its unfinished new members (one forward); True when all are finished."""
        self.beams = beams
        fresh = [b for b in beams if not b.done]  # an unfinished member is always a new child
        if not fresh:
            return all(b.done for b in beams)
        tree = self.tree
        tree.retain(b.node for b in fresh)
        ids, logits = yield from tree.expand_co([b.node for b in fresh], [b.tokens[-1] for b in fresh])
        for b in beams:
            b.row = -2  # rows of the previous forward are gone
        for i, (b, nid) in enumerate(zip(fresh, ids)):
            b.node, b.row = nid, i
        self.logp = log_probs(logits, self.temperature).double().cpu()
        return False

    def hypotheses(self) -> list[Hypothesis]:
        order = sorted(self.beams, key=lambda b: -b.key)
        return [self.hypothesis(b.tokens, b.key, b.logprob) for b in order]


# ---------------------------------------------------------------------- conditional Poisson
def _poly_mul(a: torch.Tensor, b: torch.Tensor, degree: int) -> torch.Tensor:
    """Products of polynomials in log space (rows of coefficients, ``[..., degree + 1]``), truncated.
    Each coefficient is a log-sum-exp of at most ``degree + 1`` terms, written out as elementwise
    operations over the rows (``torch.logsumexp`` over a last dimension of 2..5 costs ~40x more on
    the ~10^5 rows of a large vocabulary's first level)."""
    out = []
    for d in range(degree + 1):
        terms = [a[..., i] + b[..., d - i] for i in range(d + 1)]
        m = terms[0]
        for t in terms[1:]:
            m = torch.maximum(m, t)
        shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all terms -inf: the sum is -inf
        total = torch.exp(terms[0] - shift)
        for t in terms[1:]:
            total = total + torch.exp(t - shift)
        out.append(torch.log(total) + shift)
    return torch.stack(out, dim=-1)


def conditional_poisson_sample(log_w: torch.Tensor, k: int, generator: torch.Generator
                               ) -> tuple[list[int], list[float]]:
    """A conditional Poisson sample: ``k`` distinct indices of ``log_w`` (log weights, ``[N]``;
    ``-inf``: weight 0), the set ``S`` drawn with probability ``prod_{n in S} w_n / e_k(w)``; with
    fewer than ``k`` positive weights, all of them.  Returns the indices (ascending) and each one's
    log inclusion probability.  See the module docstring for the algorithm."""
    log_w = log_w.double().cpu()
    n = log_w.numel()
    k = min(k, int(torch.isfinite(log_w).sum()))
    if k <= 0:
        return [], []
    size = 1 << max(0, (n - 1).bit_length())
    neg = -math.inf
    leaves = torch.full((size, k + 1), neg, dtype=torch.float64)
    leaves[:, 0] = 0.0
    leaves[:n, 1] = log_w
    if size > n:
        leaves[n:, 0] = 0.0  # padding: the polynomial 1
    levels = [leaves]
    while levels[-1].shape[0] > 1:
        p = levels[-1]
        levels.append(_poly_mul(p[0::2], p[1::2], k))
    root = levels[-1][0]
    # top-down: split each node's picks between its halves
    current = [(0, k)]
    for depth in range(len(levels) - 1, 0, -1):
        below = levels[depth - 1]
        nxt = []
        for idx, j in current:
            left, right = below[2 * idx], below[2 * idx + 1]
            split = torch.tensor([left[a] + right[j - a] for a in range(j + 1)], dtype=torch.float64)
            probs = torch.softmax(split, dim=0)
            a = int(torch.multinomial(probs, 1, generator=generator))
            if a:
                nxt.append((2 * idx, a))
            if j - a:
                nxt.append((2 * idx + 1, j - a))
        current = nxt
    chosen = sorted(idx for idx, _ in current)
    # inclusion: w_n * [z^(k-1)] prod_{m != n} (1 + w_m z) / e_k(w), the product along n's path
    incl = []
    for leaf in chosen:
        rest = torch.full((k,), neg, dtype=torch.float64)
        rest[0] = 0.0
        idx = leaf
        for depth in range(len(levels) - 1):
            sibling = levels[depth][idx ^ 1][:k]
            rest = _poly_mul(rest, sibling, k - 1)
            idx //= 2
        incl.append(float(log_w[leaf] + rest[k - 1] - root[k]))
    return chosen, incl


def odds_weights(logp: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of the candidates' probabilities ``p`` normalized over the candidates
    (``logp``: unnormalized log-probabilities); a candidate holding all the mass is kept finite."""
    lp = logp.double() - torch.logsumexp(logp.double(), dim=0)
    lp = torch.clamp(lp, max=math.log1p(-1e-12))
    return lp - log1mexp(lp)


class ConditionalPoissonBeamSearch(StochasticBeamSearch):
    """Conditional Poisson stochastic beam search (Meister et al., 2021)."""

    def sample(self, log_w: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        """The round's sample of ``k`` candidates (``conditional_poisson_sample``)."""
        return conditional_poisson_sample(log_w, k, self.generator)

    def advance(self) -> bool:
        open_ = [b for b in self.beams if not b.done]
        if not open_:
            return True
        k = self.cfg.num_beams
        phi = self.extension_logprobs(open_)
        closed = [b for b in self.beams if b.done]
        vocab = phi.shape[-1]
        cands = torch.cat([phi.reshape(-1), torch.tensor([b.logprob for b in closed], dtype=torch.float64)])
        picked, incl = self.sample(odds_weights(cands), k)
        last = self.length + 1 >= self.max_new_tokens
        beams = []
        for flat, li in zip(picked, incl):
            if flat >= phi.numel():
                b = closed[flat - phi.numel()]
                b.log_inclusion += li
                beams.append(b)
                continue
            parent, tok = open_[flat // vocab], flat % vocab
            beams.append(Particle(parent.node, parent.tokens + [tok], float(phi[flat // vocab, tok]), 0.0,
                                  last or tok in self.eos, log_inclusion=parent.log_inclusion + li))
        beams.sort(key=lambda b: -b.logprob)
        self.length += 1
        return (yield from self.run_round(beams))

    def hypotheses(self) -> list[Hypothesis]:
        order = sorted(self.beams, key=lambda b: -b.logprob)
        return [self.hypothesis(b.tokens, b.logprob, b.logprob, log_inclusion=b.log_inclusion) for b in order]
