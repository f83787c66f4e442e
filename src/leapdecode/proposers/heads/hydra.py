"""Hydra heads (``method="hydra"``): draft heads that see the tokens drafted before them.

Paper: "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding" (Ankner et al., 2024).

Medusa's heads all read the same feature and so cannot tell which path of the tree they extend.
Hydra's head ``i`` (``i = 0 .. k-1``) reads the feature ``f_t`` of the last decided token at
position ``t`` (``common.target_features``) *and* the input embeddings of the ``i + 1`` tokens after
it: the root ``x_{t+1}`` (decided: the verifier's bonus token) and the ``i`` tokens drafted before
it on the path, and predicts ``x_{t+i+2}`` through the target's own output projection (shared, not
trained; or FR-Spec's subset of it).  Each head is Hydra's MLP: a first residual block over the
concatenation ``[f ; e_1 ; ... ; e_{i+1}]`` whose skip connection is a linear map back to the
hidden width (``res``), then ``layers - 1`` residual blocks ``x + SiLU(W x + b)`` (Medusa's).  The
first block starts as ``res = [I, 0, ...]``, ``W = 0``: an untrained head predicts what the target
predicts from ``f_t`` (Medusa's initialisation).  The paper's "prefix attention" variant (an extra
decoder layer over the context) is not built.

Tree.  Because a head's output depends on the path, a node's children come from the head of its
depth run on that node's path (not one set per depth as in Medusa).  The tree grows as EAGLE-2's
dynamic tree: every candidate carries its path's cumulative log-probability, each round expands
the ``beam`` best frontier candidates (one batched call per head involved, ``top_k`` children
each) until the heads run out (depth ``k``), and the ``budget`` best candidates form the tree
(greedy).  Under sampling a node's children are drawn without replacement from its head's
processed distribution (Gumbel-top-k), all kept, the distribution recorded as the node's ``q`` for
the verifier's recursive rejection sampling, and expansion stops before the budget would be
exceeded.  The heads hold weights only; the feature of the last decided token lives on the
proposer (from the verification forward's hidden states, or for the first step the prefill's).

Cost-aware (greedy, ``cost_aware=True``, the default), as ``eagle``: the heads' probabilities are
mapped through an acceptance calibration learned from the verifier's verdicts
(``tree_cost.TreeSizer``), another round is drafted only while it is expected to raise the tokens
per second of the step (the heads' measured call time against the target's measured verification
cost), and only as many of the best candidates are verified as pay for their rows.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from ...core.proposer import DecodeContext, Identity, MemoryKey, Proposer
from ...core.tree import TokenTree
from ...errors import InvalidParameterError
from ..common import check_int, draw_children
from ..tree_cost import TreeSizer
from .common import (HeadVocab, best_first, candidate_tree, check_head_weights, head_stats, int8_linears, node_dist,
                     require_native, running_head, target_features)
from .medusa import ResBlock  # Hydra's later blocks are Medusa's residual block
from ..configs import HydraConfig


class GroundedBlock(nn.Module):
    """Hydra's first block of head ``i``: ``res(x) + SiLU(W x + b)`` over ``x = [f ; e_1 .. e_c]``
    (``(c + 1) * hidden`` wide) back to ``hidden``; starts as ``f`` (``res = [I, 0 ..]``, ``W = 0``)."""

    def __init__(self, hidden: int, conditions: int) -> None:
        super().__init__()
        width = hidden * (conditions + 1)
        self.linear = nn.Linear(width, hidden)
        self.res = nn.Linear(width, hidden, bias=False)
        with torch.no_grad():
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)
            self.res.weight.zero_()
            self.res.weight[:, :hidden] = torch.eye(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res(x) + nn.functional.silu(self.linear(x))


class HydraHeads(nn.Module):
    """``heads`` Hydra heads of ``layers`` blocks each.  ``forward(i, features [N, H], embeds [N, i + 1, H])
    -> [N, H]``: what the target's output head reads to predict the token ``i + 2`` after the
    feature's position, given the embeddings of the ``i + 1`` tokens between.  Weights only."""

    kind = "hydra"

    def __init__(self, hidden: int, heads: int = 4, layers: int = 1) -> None:
        super().__init__()
        if heads < 1 or layers < 1:
            raise InvalidParameterError(f"hydra heads: heads ({heads}) and layers ({layers}) must be >= 1")
        self.config = {"hidden": int(hidden), "heads": int(heads), "layers": int(layers)}
        self.heads = nn.ModuleList(
            nn.Sequential(GroundedBlock(hidden, i + 1), *(ResBlock(hidden) for _ in range(layers - 1)))
            for i in range(heads))

    @classmethod
    def from_config(cls, config: dict) -> "HydraHeads":
        return cls(config["hidden"], config["heads"], config.get("layers", 1))

    @classmethod
    def for_target(cls, target, heads: int = 4, layers: int = 1) -> "HydraHeads":
        return cls(target.model.cfg.hidden_size, heads, layers)

    @property
    def n_heads(self) -> int:
        return len(self.heads)

    def forward(self, i: int, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        if embeds.shape[-2] != i + 1:
            raise InvalidParameterError(f"hydra head {i} reads {i + 1} token embeddings, got {embeds.shape[-2]}")
        x = torch.cat([features[..., None, :], embeds], -2).flatten(-2)
        return self.heads[i](x)


class HydraProposer(Proposer):
    name = "hydra"

    def __init__(self, target, heads: HydraHeads, tree_budget: int | None = None, top_k: int = HydraConfig.top_k, beam: int = HydraConfig.beam,
                 draft_vocab: int = HydraConfig.draft_vocab, head_weights: str = HydraConfig.head_weights, cost_aware: bool = HydraConfig.cost_aware) -> None:
        require_native(target, "hydra")
        if not isinstance(heads, HydraHeads):
            raise InvalidParameterError(f"hydra needs HydraHeads, got {type(heads).__name__}")
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.top_k, self.beam = check_int("top_k", top_k), check_int("beam", beam)
        self.draft_vocab = check_int("draft_vocab", draft_vocab, low=0)
        self.head_weights = check_head_weights(head_weights)
        self.cost_aware = bool(cost_aware)
        self.target = target
        self.heads = heads
        self.net: nn.Module = heads  # what runs: the heads, or their int8 copy (``begin``)
        self.default_budget = tree_budget or HydraConfig.default_tree_budget
        self._steps = self._drafted = self._accepted = self._head_calls = 0
        self._time = 0.0

    def prompt_features(self) -> int:
        return 1  # the last prompt token before the root: the first step drafts from it

    def observe_prompt(self, start: int, hidden: list[torch.Tensor]) -> None:
        with torch.inference_mode():
            self._prompt_feature = (start + hidden[-1].shape[1] - 1,
                                    target_features(self.target.model, hidden[-1][0, -1]))

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        self.model = ctx.target.model
        self.dtype = next(self.heads.parameters()).dtype
        self.out = HeadVocab(ctx, self.draft_vocab, tokens)
        self.net = running_head(ctx, self.heads, self.head_weights)
        # greedy trees sized by expected tokens per second: calibration and the heads' call time are
        # learned across generations, per head and target (proposers/tree_cost.py)
        self.sizer = ctx.remember(MemoryKey("hydra", "tree_sizer", of=Identity(self.heads)), TreeSizer)
        self._node_p: list[tuple[int, float]] = []  # the greedy tree's nodes: (token, head probability)
        self.feature: torch.Tensor | None = None  # of the last decided token before the root
        self.feature_pos = -1
        pos, feature = getattr(self, "_prompt_feature", (-1, None))
        self._prompt_feature = (-1, None)
        if pos == len(tokens) - 2:  # from the prefill (absent when the prefix cache had the chunk)
            self.feature, self.feature_pos = feature, pos

    def wants_hidden(self) -> bool:
        return True

    def _embed(self, toks: list[list[int]]) -> torch.Tensor:
        return self.model.embed(torch.tensor(toks, device=self.model.device)).to(self.dtype)

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        t0 = self._t_step = time.perf_counter()
        if self.feature is None or self.feature_pos != len(tokens) - 2 or budget < 1:
            return TokenTree()  # no feature for the last decided token (the first step, or a step not observed)
        with torch.inference_mode():
            tree = self._grow(tokens[-1], self.feature.to(self.dtype), budget, t0)
        self._drafted += len(tree)
        self._time += time.perf_counter() - t0
        return tree

    def _grow(self, root: int, feature: torch.Tensor, budget: int, t0: float) -> TokenTree:
        params, gen = self.ctx.params, self.ctx.generator
        greedy = params.greedy
        verify = self.sizing_cost()
        sizer = self.sizer if greedy and verify is not None else None
        prob: list[float] = []  # each candidate's head probability given its parent
        k = min(self.top_k, budget)
        n_heads = self.heads.n_heads
        tok: list[int] = []
        par: list[int] = []
        score: list[float] = []
        path: list[list[int]] = []  # the tokens after the feature's position up to each candidate (root first)
        qdist: dict[int, torch.Tensor] = {}

        def expand(nodes: list[int]) -> None:
            """Children of ``nodes`` (all at one depth ``d``: head ``d + 1``; -1: the root, head 0)."""
            t1 = time.perf_counter()
            first_new = len(tok)
            paths = [path[c] if c >= 0 else [root] for c in nodes]
            i = len(paths[0]) - 1
            states = self.net(i, feature.expand(len(nodes), -1), self._embed(paths))
            self._head_calls += 1
            logp = node_dist(self.out.logits(states), params)
            for j, c in enumerate(nodes):
                if not greedy:
                    qdist[c] = self.out.full(logp[j].exp())
                # drafter-invariant sampling: the feature is at the position before the root's
                first = self.out.coupled(logp[j], self.ctx.uniform(self.feature_pos + 2 + i))
                idx, vals = draw_children(logp[j], k, params, gen, first)
                base = score[c] if c >= 0 else 0.0
                for t, v in zip(self.out.ids(idx), vals):
                    tok.append(t)
                    par.append(c)
                    score.append(base + (sizer.log_accept(math.exp(v)) if sizer is not None else v))
                    prob.append(math.exp(v))
                    path.append(paths[j] + [t])
            if sizer is not None:
                sizer.note_forward(time.perf_counter() - t1, prob[first_new:])

        expand([-1])
        frontier = list(range(len(tok)))
        while frontier:
            frontier = [c for c in frontier if len(path[c]) - 1 < n_heads]  # a head left for its children
            if not frontier:
                break
            frontier.sort(key=lambda c: -score[c])
            chosen = frontier[: self.beam]
            if not greedy and len(tok) + len(chosen) * k > budget:
                break  # sampled children are never pruned: stop before the budget is exceeded
            if greedy and len(tok) >= budget and score[chosen[0]] <= sorted(score)[-budget]:
                break  # nothing deeper can enter the best ``budget``
            if sizer is not None and not sizer.worth_expanding(score, [score[c] for c in chosen], budget,
                                                               time.perf_counter() - t0, verify):
                break  # another round costs more than it is expected to bring
            before = len(tok)
            by_depth: dict[int, list[int]] = {}
            for c in chosen:
                by_depth.setdefault(len(path[c]), []).append(c)
            for nodes in by_depth.values():
                expand(nodes)
            frontier = [c for c in frontier if c not in chosen] + list(range(before, len(tok)))
        if not greedy:
            return candidate_tree(tok, par, score, qdist, budget, greedy, "hydra")
        if sizer is not None and tok:
            budget = sizer.size(score, budget, verify, time.perf_counter() - t0)
        order = best_first(score, par, budget)
        self._node_p = [(tok[c], prob[c]) for c in order]
        return candidate_tree(tok, par, score, qdist, budget, greedy, "hydra", order=order)

    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        self._steps += 1
        self._accepted += len(verdict.accepted)
        if self.sizing_cost() is not None and self._node_p:
            self.sizer.learn(self._node_p, tree, verdict.accepted)  # calibrate
            self.sizer.note_step(len(verdict.tokens), time.perf_counter() - self._t_step)
        self._node_p = []
        self.feature = None
        if hidden:
            row = verdict.accepted[-1] + 1 if verdict.accepted else 0
            with torch.inference_mode():
                self.feature = target_features(self.model, hidden[-1][0, row])
            self.feature_pos = len(tokens) - 2

    def stats(self) -> dict[str, Any]:
        out = head_stats("hydra", self._steps, self._drafted, self._accepted, self._time)
        out["hydra_head_calls"] = self._head_calls
        out["head_int8_linears"] = int8_linears(self.net)
        return out
