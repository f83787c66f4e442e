"""A*-decoding: best-first search over partial solutions, steps sampled from the model and ranked
by a process reward.

Paper: "A*-Decoding: Token-Efficient Inference Scaling" (Chatziveroglou, 2025; arXiv 2505.13672).
Decoding is a search in the state space of partial solutions: a state ``s`` is the prompt and the
tokens generated so far, a goal is a state that ended (an end-of-sequence token, or
``max_new_tokens``).  The transition model has a stochastic part, ``k`` candidate continuations
(the next reasoning *step* each) sampled from the model at ``s``, and a deterministic part, A*'s
choice of the state with the lowest ``f(s) = g(s) + h(s)``, where the heuristic ``h`` comes from
a process supervision signal ``r(s)`` (the paper's process reward model; ``h = 1 - r``).  The
open states sit in one priority queue: the best one is popped, and if it is a goal it is
returned, else it is expanded (``k`` sampled steps, each scored, each pushed).

Here:

* **the process reward** ``r`` is a registered scorer (``strategies/scorers.py``) applied to the
  partial solution as a ``Sample`` (``finished`` False while it is open): the model's own mean or
  summed log-likelihood (temperature 1) of the tokens so far, or a user's Python callable on the
  partial text (a PRM, a verifier, a rule).  ``h(s) = -r(s)``, which orders states as the paper's
  ``1 - r`` does for a reward in ``[0, 1]`` but takes any real score.  The sandboxed unit-test
  scorer cannot score a partial program and is refused.
* **the path cost** ``g(s) = step_cost * steps(s)``: a choice made here (the paper's ``g`` adds a
  cost per transition; a positive ``step_cost`` makes longer partial solutions pay, as A* does with
  a unit cost per edge; the default 0 orders states by the process reward alone).
* **a step** ends with the token whose text completes ``step_delimiter`` (default a newline, the
  paper's reasoning steps), after ``max_step_tokens`` tokens, or with the solution.
* **the budget** is in sampled tokens (``token_budget``: the paper's "token-efficient" compute
  budget) and optionally in expansions (``max_expansions``, the paper's PRM calls are ``k`` per
  expansion).  A round whose sampled tokens would exceed the budget is not run: the steps it would
  have finished are dropped, so ``stats["sampled_tokens"] <= token_budget`` always.  When the
  budget ends before ``num_return_sequences`` goals were popped, the goals still queued follow in
  queue order, then (only if none ended at all) the best open state, with finish reason
  ``"length"``.

Ties in ``f`` pop the state pushed first.  Hypotheses: the goals in the order popped, ``score`` the
process reward, ``logprob`` the model's log-probability (temperature 1) of the tokens.

**The KV cache.**  Every state is a node of the search's token tree in one cache
(``search.TreeKV``): the prompt is prefilled once, a sampled step is a chain of nodes hanging off
the state it extends, and the ``k`` samples of one expansion advance together, one forward per
token position (``k`` rows), and each ``step()`` of the search runs one such forward (a server
interleaves it with the other requests).  A step's last token is forwarded only when its state
is expanded (``Rollouts.start``), so states that are never expanded cost no forward for it.
Nodes are never copied.  Sampling draws from ``softmax(logits / temperature)`` with the search's seeded generator
(same seed, same search); a speculative ``method`` does not combine with this search (the API
refuses it, as for every tree search), since a proposer's drafts would need verifying against
every branch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator

import torch

from ..core.config import option
from ..core.sampling import sample
from ..errors import InvalidParameterError, ScorerError
from .scorers import Sample, Scorer, check_scorer_spec, make_scorer
from .search import MAX_TREE_NODES, ROOT, Hypothesis, StrategyConfig, TreeKV, TreeSearch

if TYPE_CHECKING:
    from ..core.runner import ModelRunner


# ---------------------------------------------------------------------- partial solutions on a tree
@dataclass
class Partial:
    """A partial (or ended) solution.  ``anchor``: the tree node of its last forwarded token (the
    search's root before any); ``pending``: its last token when that has not been forwarded yet
    (a step's last token, forwarded when the state is extended); ``finish``: "stop" (an
    end-of-sequence token), "length" (``max_new_tokens``), None while open."""

    id: int
    tokens: list[int]
    logprobs: list[float]  # the model's log-probability (temperature 1) of each token
    anchor: int
    pending: int | None
    steps: int
    finish: str | None = None
    step_start: int = 0  # where its last step begins in ``tokens``
    logits: torch.Tensor | None = None  # the next-token logits once its last token was forwarded

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))

    def last_step(self) -> list[int]:
        return self.tokens[self.step_start:]


@dataclass
class Tip:
    """One continuation being sampled from ``origin``: its tokens so far, the node of its last
    forwarded token, and the last sampled token (not yet forwarded)."""

    origin: Partial
    tokens: list[int]
    logprobs: list[float]
    node: int
    pending: int | None
    done: str | None = None  # "step", "stop" (end of sequence), "length" (max_new_tokens), "limit", "cut"


class Rollouts:
    """Samples continuations of partial solutions on a ``TreeKV``, all tips of a call advancing
    together (one forward per token position).  ``until``: "step" (a step ends at the delimiter
    or after ``max_step_tokens``) or "end" (to the end of the solution, or ``limit`` tokens).
    ``sampled`` counts every token drawn; ``budget`` (None: none) bounds it: a round that would
    pass it is not run, and the tips still going are marked "cut"."""

    def __init__(self, search: TreeSearch, tree: TreeKV, delimiter: str, max_step_tokens: int | None) -> None:
        self.search, self.tree = search, tree
        self.delimiter, self.max_step_tokens = delimiter, max_step_tokens
        self.sampled = 0
        self.forwards = 0
        self.tokenizer = search.model.tokenizer

    def _draw(self, logits: torch.Tensor, n: int | None = None) -> tuple[list[int], list[float]]:
        """Tokens drawn at the search's temperature from ``logits`` (``[rows, vocab]``: one per
        row; or ``n`` from a single row), and their temperature-1 log-probabilities (on the CPU,
        where the search's generator is)."""
        logits = logits.float().cpu()
        probs = torch.softmax(logits / self.search.temperature, dim=-1)
        lp1 = torch.log_softmax(logits, dim=-1)
        if n is not None:
            toks = sample(probs[0], self.search.generator, n)
            return toks.tolist(), lp1[0, toks].tolist()
        toks = sample(probs, self.search.generator)[:, 0]
        return toks.tolist(), lp1[torch.arange(len(toks)), toks].tolist()

    def _check(self, tip: Tip, until: str, limit: int | None) -> None:
        tok = tip.tokens[-1]
        total = len(tip.origin.tokens) + len(tip.tokens)
        if tok in self.search.eos:
            tip.done = "stop"
        elif total >= self.search.max_new_tokens:
            tip.done = "length"
        elif until == "step":
            if self.max_step_tokens is not None and len(tip.tokens) >= self.max_step_tokens:
                tip.done = "step"
            elif self.delimiter and self.delimiter in self.tokenizer.decode(tip.tokens):
                tip.done = "step"
        elif limit is not None and len(tip.tokens) >= limit:
            tip.done = "limit"

    def start(self, origins: list[Partial]) -> Iterator[None]:
        """Give each origin its next-token logits (``Partial.logits``): forwards the pending last
        tokens of the origins that have one, all in one forward, each once (such an origin then has
        that node as its anchor).  A generator: it yields after its forward."""
        need = list({o.id: o for o in origins if o.pending is not None}.values())
        if need:
            ids, logits = self.tree.expand([o.anchor for o in need], [o.pending for o in need])
            self.forwards += 1
            for o, nid, row in zip(need, ids, logits):
                o.anchor, o.pending, o.logits = nid, None, row
            yield
        for o in origins:
            if o.logits is None:
                raise RuntimeError(f"state {o.id} has no logits to continue from")

    def sample(self, origins: list[Partial], counts: list[int], until: str, budget: int | None = None,
               limit: int | None = None) -> Generator[None, None, list[Tip]]:
        """``counts[i]`` continuations of ``origins[i]`` (open states), sampled independently.  A
        generator that yields after each forward (a search's round) and returns the tips."""
        if not origins:
            return []
        if budget is not None and self.sampled + sum(counts) > budget:
            return [Tip(o, [], [], o.anchor, o.pending, "cut") for o, c in zip(origins, counts) for _ in range(c)]
        yield from self.start(origins)
        tips: list[Tip] = []
        for o, c in zip(origins, counts):
            toks, lps = self._draw(o.logits[None], n=c)
            for t, lp in zip(toks, lps):
                tip = Tip(o, [t], [lp], o.anchor, t)
                self._check(tip, until, limit)
                tips.append(tip)
        self.sampled += sum(counts)
        while True:
            active = [t for t in tips if t.done is None]
            if not active:
                return tips
            if budget is not None and self.sampled + len(active) > budget:
                for t in active:
                    t.done = "cut"
                return tips
            ids, logits = self.tree.expand([t.node for t in active], [t.pending for t in active])
            self.forwards += 1
            toks, lps = self._draw(logits)
            self.sampled += len(active)
            for t, nid, tok, lp in zip(active, ids, toks, lps):
                t.node, t.pending = nid, tok
                t.tokens.append(tok)
                t.logprobs.append(lp)
                self._check(t, until, limit)
            yield

    @staticmethod
    def extend(tip: Tip, new_id: int) -> Partial:
        """The state a finished tip reaches (a step: open, its last token pending; an end: ended)."""
        o = tip.origin
        finish = tip.done if tip.done in ("stop", "length") else None
        return Partial(new_id, o.tokens + tip.tokens, o.logprobs + tip.logprobs, tip.node,
                       tip.pending if finish is None else None, o.steps + 1, finish, len(o.tokens))


def as_sample(search: TreeSearch, state: Partial, prompt_text: str) -> Sample:
    """A state as a scorer sees it (its text without an end-of-sequence token)."""
    shown = [t for t in state.tokens if t not in search.eos]
    return Sample(state.id, prompt_text, search.model.tokenizer.decode(shown), list(state.tokens), state.logprob,
                  state.finish is not None, state.finish)


def check_partial_scorer(spec: Any, strategy: str, what: str = "scorer") -> None:
    """Refuse a scorer that cannot score partial solutions (before any model work)."""
    check_scorer_spec(spec, what)
    if spec == "tests":
        raise ScorerError(f"strategy {strategy!r}: {what} 'tests' cannot score a partial solution; give "
                          "'mean-logprob', 'sum-logprob' or a callable (best-of-n runs unit tests on finished samples)")


# ---------------------------------------------------------------------- the config
@dataclass(frozen=True, kw_only=True)
class AStarConfig(StrategyConfig):
    strategy = "a-star"
    stochastic = True
    num_samples: int = option(4, "k: next steps sampled from the model for each expanded state", low=1, high=64)
    scorer: str | Callable = option("mean-logprob", "the process reward r(s) of a partial solution (higher is "
                                                    "better; h = -r): 'mean-logprob', 'sum-logprob' (the model's "
                                                    "own log-likelihood, temperature 1) or a Python callable "
                                                    "sample -> float (API only; sample.finished is False while open)")
    step_cost: float = option(0.0, "g(s) = step_cost * steps(s): the path cost A* adds to h (0: rank by the "
                                   "process reward alone)", low=0)
    step_delimiter: str = option("\n", "a step ends with the token whose text completes this string "
                                       "('': steps end at max_step_tokens only; a shell passes a newline as "
                                       "$'step_delimiter=\\n')")
    max_step_tokens: int | None = option(None, "most tokens in one step (None: up to the delimiter or the end)",
                                         low=1)
    token_budget: int = option(1024, "most tokens sampled by the whole search (each a node of its KV tree)",
                               low=1, high=MAX_TREE_NODES - 64)
    max_expansions: int | None = option(None, "most states expanded (None: the token budget alone)", low=1)
    num_return_sequences: int | None = option(None, "ended solutions returned, in the order popped (None: 1)",
                                              low=1, high=64)

    @property
    def width(self) -> int:
        return self.num_samples

    @property
    def returns(self) -> int:
        return 1 if self.num_return_sequences is None else self.num_return_sequences

    def pending_nodes(self, max_new_tokens: int) -> int:
        return self.token_budget + 1

    def make_scorer(self) -> Scorer:
        return make_scorer(self.scorer)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_partial_scorer(self.scorer, self.strategy)
        if not self.step_delimiter and self.max_step_tokens is None:
            raise InvalidParameterError("strategy 'a-star': with an empty step_delimiter give max_step_tokens "
                                        "(else a step is the whole solution)")


# ---------------------------------------------------------------------- the search
class AStarDecoding(TreeSearch):
    """A*-decoding; see the module docstring."""

    def __init__(self, runner: "ModelRunner", prompt_ids: list[int], cfg: AStarConfig, max_new_tokens: int,
                 temperature: float, seed: int | None) -> None:
        super().__init__(runner, prompt_ids, cfg, max_new_tokens, temperature=temperature, seed=seed)
        if temperature <= 0:
            raise InvalidParameterError("strategy 'a-star' samples its steps: give a temperature > 0")
        self.scorer = cfg.make_scorer()
        self.prompt_text = runner.model.tokenizer.decode(prompt_ids)

    def begin(self, logits: torch.Tensor) -> None:
        cfg = self.cfg
        self.rollouts = Rollouts(self, self.tree, cfg.step_delimiter, cfg.max_step_tokens)
        self.queue: list[tuple[float, int]] = []
        self.states: dict[int, Partial] = {}
        self.scores: dict[int, float] = {}
        self.goals: list[Partial] = []
        self.expansions = 0
        self.expanded: list[tuple[int, list[int]]] = []  # (state, its children's ids), in the order popped
        self.exhausted = False
        self.next_id = 1
        root = Partial(0, [], [], ROOT, None, 0, logits=logits)
        self.states[0] = root
        self._push(root)
        self._rounds = self._search()

    def _push(self, s: Partial) -> None:
        # the prompt alone (the only state at first, popped first whatever its score) is not scored
        r = self.scorer(as_sample(self, s, self.prompt_text)) if s.id else 0.0
        self.scores[s.id] = r
        heapq.heappush(self.queue, (self.cfg.step_cost * s.steps - r, s.id))

    def advance(self) -> bool:
        """One round: the search (``_search``) runs up to its next forward."""
        try:
            next(self._rounds)
            return False
        except StopIteration:
            return True

    def _search(self) -> Iterator[None]:
        cfg = self.cfg
        while self.queue:
            _, sid = heapq.heappop(self.queue)
            s = self.states[sid]
            if s.finish is not None:  # a goal: done when enough were popped
                self.goals.append(s)
                if len(self.goals) >= cfg.returns:
                    return
                continue
            if cfg.max_expansions is not None and self.expansions >= cfg.max_expansions:
                heapq.heappush(self.queue, (cfg.step_cost * s.steps - self.scores[sid], sid))
                self.exhausted = True
                return
            tips = yield from self.rollouts.sample([s], [cfg.num_samples], "step", budget=cfg.token_budget)
            s.logits = None  # expanded once: its row is not needed again
            self.expansions += 1
            done = [t for t in tips if t.done != "cut"]
            self.expanded.append((sid, list(range(self.next_id, self.next_id + len(done)))))
            for t in done:
                child = Rollouts.extend(t, self.next_id)
                self.next_id += 1
                self.states[child.id] = child
                self._push(child)
            if len(done) < len(tips):  # the token budget ran out in this expansion
                heapq.heappush(self.queue, (cfg.step_cost * s.steps - self.scores[sid], sid))
                self.exhausted = True
                return

    def hypotheses(self) -> list[Hypothesis]:
        out = list(self.goals)
        rest = sorted(self.queue)
        want = self.cfg.returns
        if len(out) < want:
            out += [self.states[i] for _, i in rest if self.states[i].finish is not None][: want - len(out)]
        if not out and rest:
            out = [self.states[rest[0][1]]]
        return [self._hyp(s) for s in out[:want]]

    def _hyp(self, s: Partial) -> Hypothesis:
        h = self.hypothesis(s.tokens, self.scores[s.id], s.logprob, state=s.id, steps=s.steps,
                            f=self.cfg.step_cost * s.steps - self.scores[s.id])
        if s.finish is None:
            h.finish_reason = "length"
        return h

    def stats(self) -> dict[str, Any]:
        ro = getattr(self, "rollouts", None)
        return {"expansions": getattr(self, "expansions", 0), "expanded": getattr(self, "expanded", []),
                "sampled_tokens": ro.sampled if ro else 0, "token_budget": self.cfg.token_budget, "states": len(getattr(self, "states", {})),
                "budget_exhausted": getattr(self, "exhausted", False),
                "goals_popped": len(getattr(self, "goals", []))}
