"""phi-Decoding: step-level search by adaptive foresight sampling.

Paper: "phi-Decoding: Adaptive Foresight Sampling for Balanced Inference-Time Exploration and
Exploitation" (Xu, Yan, Ma, Zhao, Liu, Lin, Wu, 2025; ACL 2025; arXiv 2503.13288), and its authors'
code (``phi_decoding.py`` of github.com/xufangzhi/phi-Decoding), which fixes what the paper leaves
open.  The solution is built step by step with a *step beam* of ``M`` partial solutions
(``step_beam_size``); at each step:

1. **candidates**: every beam samples ``N`` next steps (``num_rollout``): ``M * N`` candidates (at
   the first step the ``M`` beams are all the prompt).
2. **in-width pruning**: a candidate whose step likelihood (the mean log-probability of its
   tokens) is not above ``mean - sigma_rate * std`` over the candidates is dropped; if fewer than
   the beams to fill are left, dropped ones are drawn back without replacement with weights
   ``softmax(likelihood / tau)``.
3. **foresight**: each kept candidate is rolled out to the end of the solution (one sampled
   continuation); its *foresight score* ``F`` is the mean log-probability of the rollout's tokens
   (the paper's foresight probability, length-normalized as in the code), and its *advantage*
   ``A = F - F(parent)``, the parent beam's own foresight score (0 at the first step).
4. **selection** from the joint distribution of exploitation and exploration: the candidates
   with ``A > 0`` and a non-empty rollout are clustered by their rollouts' text (TF-IDF vectors,
   k-means with ``cluster_num`` clusters); candidate ``i`` gets weight
   ``1/2 softmax(A / tau)_i + 1/2 |C(i)| / sum_j |C(j)|`` (the advantage distribution and the size
   of its cluster), and the beams are drawn from it without replacement.  Too few such candidates,
   or texts that cannot be clustered: ``softmax(A / tau)`` over all candidates (the code's fallback).
5. **in-depth pruning** (early stop): after at least ``min_steps`` steps, stop stepping when the
   largest cluster holds more than ``threshold`` of the clustered candidates (the rollouts agree),
   or when every selected step is the same text.

After ``max_steps`` steps (or the early stop) every beam rolls out to the end once more, and one
completion is chosen: among those with ``A > 0`` and a non-empty final segment, the larger of two
k-means clusters, then a draw by ``softmax(A / tau)`` inside it (too few, or no clusters: that
draw over all completions).

**Choices made here** (where the paper and the code leave room or disagree):

* Steps end with the token whose text completes ``step_delimiter`` (the code stops at a newline),
  after ``max_step_tokens``, or with the solution.  Steps and rollouts are drawn at the request's
  temperature (the code: 0.6 for steps, vLLM's default 1.0 for rollouts); likelihoods are the
  model's temperature-1 log-probabilities (what the scorers read).
* The exploration weight is the cluster's share normalized over the candidates, as the paper
  describes; the code takes a softmax of the shares.  When no completion qualifies for the final
  clustering the code draws by ``softmax(-A / tau)`` (marked TODO there); here ``softmax(A / tau)``.
* A beam that ends (end-of-sequence token or ``max_new_tokens``) leaves the step beam as a finished
  solution, keeping the advantage it was selected with, and later steps fill ``M`` minus the
  finished ones; its foresight is empty, so its ``F`` is the mean log-probability of its last step.
  The code keeps generating after an end.
* ``scorer``: the default ``"mean-logprob"`` is the paper's foresight score above (``"sum-logprob"``:
  summed instead).  A Python callable scores the whole completed trajectory (the partial solution,
  the candidate step and its rollout, as a ``Sample``), in place of the foresight likelihood: a
  verifier or reward in the paper's place for ``F``.
* Both early-stop rules apply once ``min_steps`` steps are done (the code lets the same-steps
  rule wait one step longer than the cluster rule).
* ``foresight_tokens`` may cap a rollout's length (None: to the end, as the paper) to bound the
  KV tree.
* TF-IDF follows scikit-learn's defaults (words of 2+ characters, lower-cased, smoothed idf, rows
  L2-normalized); k-means is Lloyd's algorithm from a k-means++ start drawn from the search's
  generator (one start).

**The KV cache**: one token tree (``search.TreeKV``): the prompt once, each beam a branch, its
``N`` candidates and their rollouts chains hanging off it; all candidates advance together (one
forward per token position; each ``step()`` of the search runs one forward, so a server
interleaves it with its other requests), and after each pruning and selection the tree keeps
only the nodes the surviving beams need (``TreeKV.retain``: the rest are dropped, the shared
prefix committed).
Random numbers come from the search's seeded generator: the same seed gives the same search.  A
speculative ``method`` does not combine with it (refused, as for every tree search).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator

import torch

from ..core.config import option
from ..errors import InvalidParameterError
from .a_star import Partial, Rollouts, Tip, as_sample, check_partial_scorer
from .scorers import LogLikelihood, Sample, Scorer, make_scorer
from .search import MAX_TREE_NODES, ROOT, Hypothesis, StrategyConfig, TreeSearch

if TYPE_CHECKING:
    from ..core.runner import ModelRunner

_WORD = re.compile(r"(?u)\b\w\w+\b")


# ---------------------------------------------------------------------- clustering and draws
def tfidf(texts: list[str]) -> torch.Tensor:
    """TF-IDF rows (``[len(texts), words]``, fp64, L2-normalized) as scikit-learn's
    ``TfidfVectorizer()`` computes them; ``ValueError`` when no text has a word."""
    docs = [_WORD.findall(t.lower()) for t in texts]
    vocab = sorted({w for d in docs for w in d})
    if not vocab:
        raise ValueError("no words to cluster")
    index = {w: i for i, w in enumerate(vocab)}
    x = torch.zeros(len(texts), len(vocab), dtype=torch.float64)
    for r, d in enumerate(docs):
        for w, c in Counter(d).items():
            x[r, index[w]] = c
    df = (x > 0).sum(0).double()
    idf = torch.log((1 + len(texts)) / (1 + df)) + 1
    x = x * idf
    norm = x.norm(dim=1, keepdim=True)
    return x / torch.where(norm > 0, norm, torch.ones_like(norm))


def kmeans(x: torch.Tensor, k: int, generator: torch.Generator, iterations: int = 100) -> list[int]:
    """Cluster labels of the rows of ``x``: Lloyd's algorithm from a k-means++ start;
    ``ValueError`` when there are fewer rows than clusters."""
    n = x.shape[0]
    if k < 1 or n < k:
        raise ValueError(f"{n} samples cannot make {k} clusters")
    first = int(torch.randint(0, n, (1,), generator=generator))
    centers = [x[first]]
    for _ in range(1, k):
        d2 = torch.stack([((x - c) ** 2).sum(1) for c in centers]).min(0).values
        p = d2 / d2.sum() if float(d2.sum()) > 0 else torch.full((n,), 1.0 / n, dtype=x.dtype)
        centers.append(x[int(torch.multinomial(p, 1, generator=generator))])
    c = torch.stack(centers)
    labels: list[int] | None = None
    for _ in range(iterations):
        new = torch.cdist(x, c).argmin(1).tolist()
        if new == labels:
            break
        labels = new
        for j in range(k):
            members = [i for i, lab in enumerate(labels) if lab == j]
            if members:
                c[j] = x[members].mean(0)
    assert labels is not None
    return labels


def softmax(values: list[float], tau: float = 1.0) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64) / tau
    return torch.softmax(t, 0).tolist()


def draw_without_replacement(weights: list[float], n: int, generator: torch.Generator) -> list[int]:
    """``n`` indices drawn one after another, each with probability proportional to its weight
    among those not drawn yet (numpy's ``choice(replace=False, p=weights)``); zero weights are
    drawn last, uniformly."""
    left = list(range(len(weights)))
    out = []
    for _ in range(min(n, len(weights))):
        w = torch.tensor([weights[i] for i in left], dtype=torch.float64)
        if float(w.sum()) <= 0:
            w = torch.ones(len(left), dtype=torch.float64)
        j = int(torch.multinomial(w / w.sum(), 1, generator=generator))
        out.append(left.pop(j))
    return out


def width_keep(likelihoods: list[float], sigma_rate: float) -> list[int]:
    """In-width pruning: the candidates whose step likelihood is above ``mean - sigma_rate * std``
    (population std, as numpy's)."""
    t = torch.tensor(likelihoods, dtype=torch.float64)
    bar = float(t.mean() - sigma_rate * t.std(unbiased=False)) if len(likelihoods) > 1 else -math.inf
    return [i for i, v in enumerate(likelihoods) if v > bar]


def selection_weights(advantages: list[float], labels: list[int], tau: float) -> list[float]:
    """The joint distribution of step 4: ``1/2 softmax(A / tau) + 1/2 |C(i)| / sum_j |C(j)|``."""
    sizes = Counter(labels)
    share = [sizes[lab] for lab in labels]
    total = float(sum(share))
    adv = softmax(advantages, tau)
    return [0.5 * a + 0.5 * s / total for a, s in zip(adv, share)]


# ---------------------------------------------------------------------- the config
@dataclass(frozen=True, kw_only=True)
class PhiDecodingConfig(StrategyConfig):
    strategy = "phi-decoding"
    stochastic = True
    step_beam_size: int = option(4, "M: partial solutions kept after each step", low=1, high=32)
    num_rollout: int = option(4, "N: candidate next steps sampled per beam", low=1, high=32)
    max_steps: int = option(8, "most steps decided by foresight (the code's num_foresight); then every beam "
                               "completes in one rollout", low=1, high=256)
    scorer: str | Callable = option("mean-logprob", "the foresight score F of a candidate: 'mean-logprob' (the "
                                                    "paper: mean log-probability of its rollout's tokens), "
                                                    "'sum-logprob', or a Python callable on the completed "
                                                    "trajectory, sample -> float (API only)")
    tau: float = option(0.1, "temperature of the advantage distribution softmax(A / tau)", low=0, low_open=True,
                        high=100)
    width_pruning: bool = option(True, "in-width pruning: drop candidates whose step likelihood is not above "
                                       "mean - sigma_rate * std before their foresight")
    sigma_rate: float = option(1.0, "sigma rate of the in-width pruning", low=0, high=100)
    positive_advantage: bool = option(True, "cluster and select among the candidates with A > 0 only (the "
                                            "code's adv_above0)")
    cluster_num: int = option(3, "k-means clusters of the foresight rollouts' TF-IDF vectors", low=1, high=64)
    depth_pruning: bool = option(True, "in-depth pruning: stop stepping early when the rollouts agree")
    threshold: float = option(0.7, "early stop when the largest cluster holds more than this share", low=0,
                              high=1)
    min_steps: int = option(4, "steps taken before an early stop may happen (the code's least_foresight_num)",
                            low=1)
    step_delimiter: str = option("\n", "a step ends with the token whose text completes this string "
                                       "('': steps end at max_step_tokens only; a shell passes a newline as "
                                       "$'step_delimiter=\\n')")
    max_step_tokens: int | None = option(None, "most tokens in one step (None: up to the delimiter or the end)",
                                         low=1)
    foresight_tokens: int | None = option(None, "most tokens in a foresight rollout (None: to the end of the "
                                                "solution, as the paper)", low=1)
    num_return_sequences: int | None = option(None, "hypotheses returned: the one output (None: 1)", low=1, high=1)

    @property
    def width(self) -> int:
        return self.step_beam_size * self.num_rollout

    @property
    def returns(self) -> int:
        return 1

    def pending_nodes(self, max_new_tokens: int) -> int:
        # At most every candidate's chain at once (during the foresight): a chain holds a node per
        # token of its trajectory but the last (sampled, never forwarded), so at most
        # max_new_tokens - 1; with caps, a beam's branch is shared by its N candidates, each adding
        # at most its step and its rollout.
        m, n = self.step_beam_size, self.num_rollout
        chain = max(1, max_new_tokens - 1)
        ahead = chain if self.foresight_tokens is None else min(chain, self.foresight_tokens)
        step = chain if self.max_step_tokens is None else min(chain, self.max_step_tokens)
        return min(m * n * chain, m * chain + m * n * (step + ahead)) + 1

    def make_scorer(self) -> Scorer:
        return make_scorer(self.scorer)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_partial_scorer(self.scorer, self.strategy)
        if not self.step_delimiter and self.max_step_tokens is None:
            raise InvalidParameterError("strategy 'phi-decoding': with an empty step_delimiter give max_step_tokens "
                                        "(else a step is the whole solution)")


def check_tree_size(cfg: PhiDecodingConfig, max_new_tokens: int) -> None:
    need = cfg.pending_nodes(max_new_tokens)
    if need > MAX_TREE_NODES:
        raise InvalidParameterError(
            f"strategy 'phi-decoding' may hold up to {need} tree nodes at once (step_beam_size * num_rollout "
            f"candidates of up to max_new_tokens each); at most {MAX_TREE_NODES}: lower "
            "max_new_tokens, step_beam_size or num_rollout, or set foresight_tokens / max_step_tokens")


# ---------------------------------------------------------------------- the search
@dataclass
class Candidate:
    state: Partial  # the partial solution with the candidate step
    parent_q: float  # the foresight score of the beam it extends
    step_logp: float  # the mean log-probability of the step's tokens
    foresight: list[int] = field(default_factory=list)
    foresight_logprobs: list[float] = field(default_factory=list)
    text: str = ""  # the rollout's text (what clustering reads)
    score: float = 0.0  # F
    advantage: float = 0.0  # A = F - parent_q


class PhiDecoding(TreeSearch):
    """phi-Decoding; see the module docstring."""

    def __init__(self, runner: "ModelRunner", prompt_ids: list[int], cfg: PhiDecodingConfig, max_new_tokens: int,
                 temperature: float, seed: int | None) -> None:
        super().__init__(runner, prompt_ids, cfg, max_new_tokens, temperature=temperature, seed=seed)
        if temperature <= 0:
            raise InvalidParameterError("strategy 'phi-decoding' samples its steps: give a temperature > 0")
        check_tree_size(cfg, max_new_tokens)
        self.scorer = cfg.make_scorer()
        self.prompt_text = runner.model.tokenizer.decode(prompt_ids)
        self.next_id = 1
        self.trace: list[dict[str, Any]] = []

    # ------------------------------------------------------------ helpers
    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _text(self, tokens: list[int]) -> str:
        return self.model.tokenizer.decode([t for t in tokens if t not in self.eos]).strip()

    def _score(self, c: Candidate, foresight_tip: Tip | None) -> None:
        """F and A of a candidate (its rollout ``foresight_tip``; None for a candidate that ended)."""
        if foresight_tip is not None:
            c.foresight, c.foresight_logprobs = list(foresight_tip.tokens), list(foresight_tip.logprobs)
        c.text = self._text(c.foresight)
        if isinstance(self.scorer, LogLikelihood):
            toks, lps = (c.foresight, c.foresight_logprobs) if c.foresight else (c.state.last_step(),
                                                                                 c.state.logprobs[c.state.step_start:])
            c.score = self.scorer(Sample(c.state.id, self.prompt_text, self._text(toks), list(toks),
                                         float(sum(lps)), True, None))
        else:
            s = c.state
            ended = foresight_tip.done if foresight_tip is not None else s.finish
            whole = Partial(s.id, s.tokens + c.foresight, s.logprobs + c.foresight_logprobs, ROOT, None, s.steps,
                            ended if ended in ("stop", "length") else None)
            c.score = self.scorer(as_sample(self, whole, self.prompt_text))
        c.advantage = c.score - c.parent_q

    def _retain(self, states: list[Partial]) -> None:
        live = [s.anchor for s in states if s.finish is None]
        if live:
            self.tree.retain(live)

    # ------------------------------------------------------------ the search
    def begin(self, logits: torch.Tensor) -> None:
        cfg = self.cfg
        self.rollouts = Rollouts(self, self.tree, cfg.step_delimiter, cfg.max_step_tokens)
        root = Partial(0, [], [], ROOT, None, 0, logits=logits)
        self.beams: list[tuple[Partial, float]] = [(root, 0.0)] * cfg.step_beam_size
        self.finished_pool: list[Candidate] = []
        self.steps_done = 0
        self.early_stop: str | None = None
        self.width_pruned = 0
        self.choice: Candidate | None = None
        self.final: list[Candidate] = []
        self._rounds = self._search()

    def advance(self) -> bool:
        """One round: the search (``_search``) runs up to its next forward."""
        try:
            next(self._rounds)
            return False
        except StopIteration:
            return True

    def _search(self) -> Iterator[None]:
        while (yield from self._step()):
            pass
        yield from self._final()

    def _step(self) -> Generator[None, None, bool]:
        """One step of the step beam; False when stepping is over."""
        cfg = self.cfg
        if not self.beams or self.steps_done >= cfg.max_steps or self.early_stop:
            return False
        need = cfg.step_beam_size - len(self.finished_pool)
        record: dict[str, Any] = {"step": self.steps_done}
        # 1. candidates: N steps per beam
        origins = [b for b, _ in self.beams]
        tips = yield from self.rollouts.sample(origins, [cfg.num_rollout] * len(origins), "step")
        for o in origins:
            o.logits = None  # the beams are replaced by their candidates
        cands = []
        for j, tip in enumerate(tips):
            q = self.beams[j // cfg.num_rollout][1]
            state = Rollouts.extend(tip, self._new_id())
            cands.append(Candidate(state, q, float(sum(tip.logprobs)) / len(tip.logprobs)))
        record["candidates"] = len(cands)
        # 2. in-width pruning
        if cfg.width_pruning:
            keep = width_keep([c.step_logp for c in cands], cfg.sigma_rate)
            if len(keep) < need:
                out = [i for i in range(len(cands)) if i not in keep]
                back = draw_without_replacement(softmax([cands[i].step_logp for i in out], cfg.tau), need - len(keep),
                                                self.generator)
                keep = sorted(keep + [out[i] for i in back])
            self.width_pruned += len(cands) - len(keep)
            cands = [cands[i] for i in keep]
        record["kept"] = len(cands)
        self._retain([c.state for c in cands])
        # 3. foresight: one rollout per open candidate, to the end
        open_ = [c for c in cands if c.state.finish is None]
        rolls = yield from self.rollouts.sample([c.state for c in open_], [1] * len(open_), "end",
                                                limit=cfg.foresight_tokens)
        for c, tip in zip(open_, rolls):
            self._score(c, tip)
        for c in cands:
            if c.state.finish is not None:
                self._score(c, None)
        self._retain([c.state for c in cands])  # the rollouts' nodes go
        # 4. selection
        chosen, labels = self._select(cands, need)
        record.update(selected=[cands[i].state.id for i in chosen], clusters=labels,
                      advantages=[round(c.advantage, 6) for c in cands])
        picked = [cands[i] for i in chosen]
        beams = []
        for c in picked:
            if c.state.finish is not None:
                self.finished_pool.append(c)
            else:
                beams.append((c.state, c.score))
        self.beams = beams
        self.steps_done += 1
        # 5. in-depth pruning
        if cfg.depth_pruning and self.steps_done >= cfg.min_steps:
            steps = [self._text(c.state.last_step()) for c in picked]
            if all(s == steps[0] for s in steps):
                self.early_stop = "same steps"
            elif labels is not None and max(Counter(labels).values()) / len(labels) > cfg.threshold:
                self.early_stop = "cluster"
        record["early_stop"] = self.early_stop
        self.trace.append(record)
        self._retain([b for b, _ in self.beams])
        return True

    def _select(self, cands: list[Candidate], need: int) -> tuple[list[int], list[int] | None]:
        """Step 4: the indices of the selected candidates, and the cluster labels of the clustered
        ones (None: the advantage-only fallback)."""
        cfg = self.cfg
        pool = [i for i, c in enumerate(cands) if c.text and (c.advantage > 0 or not cfg.positive_advantage)]
        if len(pool) >= need:
            try:
                labels = kmeans(tfidf([cands[i].text for i in pool]), cfg.cluster_num, self.generator)
            except ValueError:
                labels = None
            if labels is not None:
                weights = selection_weights([cands[i].advantage for i in pool], labels, cfg.tau)
                return [pool[j] for j in draw_without_replacement(weights, need, self.generator)], labels
        weights = softmax([c.advantage for c in cands], cfg.tau)
        return draw_without_replacement(weights, need, self.generator), None

    def _final(self) -> Iterator[None]:
        """Every open beam completes in one rollout; one completion is chosen (see the docstring)."""
        open_ = [(b, q) for b, q in self.beams]
        rolls = yield from self.rollouts.sample([b for b, _ in open_], [1] * len(open_), "end")
        finals = []
        for (b, q), tip in zip(open_, rolls):
            c = Candidate(b, q, 0.0)
            self._score(c, tip)
            done = tip.done if tip.done in ("stop", "length") else "length"
            c.state = Partial(b.id, b.tokens + tip.tokens, b.logprobs + tip.logprobs, ROOT, None, b.steps, done,
                              len(b.tokens))
            finals.append(c)
        for c in self.finished_pool:
            c.text = self._text(c.state.last_step())  # its final segment: its last step
            finals.append(c)
        self.final = finals
        if not finals:
            return
        tau = self.cfg.tau
        pool = [i for i, c in enumerate(finals) if c.text and c.advantage > 0]
        pick: int | None = None
        if pool:
            try:
                labels = kmeans(tfidf([finals[i].text for i in pool]), 2, self.generator)
            except ValueError:
                labels = None
            if labels is not None:
                groups = [[pool[j] for j, lab in enumerate(labels) if lab == g] for g in (0, 1)]
                big = groups[0] if len(groups[0]) > len(groups[1]) else groups[1]
                w = softmax([finals[i].advantage for i in big], tau)
                pick = big[draw_without_replacement(w, 1, self.generator)[0]]
        if pick is None:
            pick = draw_without_replacement(softmax([c.advantage for c in finals], tau), 1, self.generator)[0]
        self.choice = finals[pick]

    def hypotheses(self) -> list[Hypothesis]:
        c = self.choice
        if c is None:
            return []
        s = c.state
        return [self.hypothesis(s.tokens, c.advantage, s.logprob, foresight_score=c.score, steps=s.steps)]

    def stats(self) -> dict[str, Any]:
        ro = getattr(self, "rollouts", None)
        return {"steps": getattr(self, "steps_done", 0), "early_stop": getattr(self, "early_stop", None),
                "sampled_tokens": ro.sampled if ro else 0, "width_pruned": getattr(self, "width_pruned", 0),
                "finals": len(getattr(self, "final", [])), "trace": self.trace}
