"""Medusa heads (``method="medusa"``): extra decoding heads on the target's last hidden state.

Paper: "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads" (Cai et
al., 2024).  Head ``i`` (``i = 0 .. k-1``) is a residual block ``f + SiLU(W_i f + b_i)`` on the
feature ``f`` of the last decided token at position ``t`` (``common.target_features``: what the
target's output projection reads), followed by the target's own output projection (shared, not
trained; or FR-Spec's frequency-ranked subset of it): it predicts the token at ``t + i + 2``, one
further than the target's own head.  ``W_i`` starts at zero, so an untrained head predicts what
the target predicts for ``t + 1`` (Medusa's initialisation).

Tree (Medusa-1 style, greedy): the children of a node at depth ``d`` are head ``d``'s top-``top_k``
tokens (the same set under every node of that depth: Medusa's heads do not see the drafted path);
a node's score is the sum of its path's head log-probabilities, and the ``budget`` best nodes
form the tree (best-first, so the sparse tree follows the heads' confidence at this step rather
than a fixed template).  Under sampling each expanded node draws its ``top_k`` children without
replacement from head ``d``'s processed distribution and records it as the node's ``q`` (the
verifier's recursive rejection sampling then keeps the target's distribution exactly); sampled
children are never dropped: a node is expanded only when all its children fit the budget.

Cost-aware (greedy, ``cost_aware=True``, the default): the heads' probabilities are mapped
through an acceptance calibration learned from the verifier's verdicts (``tree_cost.TreeSizer``,
Sequoia's hardware-aware sizing with EAGLE-2's confidence ranking, as ``eagle`` does), a node's score is
its path's calibrated log acceptance, and only as many of the best candidates are verified as
raise the expected tokens per second of the step under the target's measured verification cost
(on a CPU whose tree rows cost a quarter of a one-row forward each, 24 nodes would cost more than
they bring).  Any greedy tree gives vanilla's tokens, so timings may steer it.

The head holds weights only (``MedusaHeads``); the feature of the last decided token, which comes
from the verification forward (``wants_hidden``), lives on the proposer.  The first step of a
generation drafts from the last prompt token's feature, which the prefill's forward hands over
(``prompt_features``/``observe_prompt``; a chunk the prefix cache restored has none, and then the
first step drafts nothing).
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Any

import torch
from torch import nn

from ...core.proposer import DecodeContext, Identity, MemoryKey, Proposer
from ...core.tree import TokenTree
from ...errors import InvalidParameterError
from ..common import check_int, draw_children
from ..configs import MedusaConfig
from ..tree_cost import TreeSizer
from .common import (HeadVocab, best_first, candidate_tree, check_head_weights, head_stats, int8_linears, node_dist,
                     require_native, running_head, target_features)


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` (Medusa's head block); ``W``, ``b`` start at zero."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``heads`` Medusa heads of ``layers`` residual blocks each over a ``hidden``-wide feature.
    ``forward(features [..., H]) -> [heads, ..., H]``: what the target's output head reads to
    predict the tokens 2, 3, ... ahead.  Weights only; no decoding state."""

    kind = "medusa"

    def __init__(self, hidden: int, heads: int = 4, layers: int = 1) -> None:
        super().__init__()
        self.config = {"hidden": int(hidden), "heads": int(heads), "layers": int(layers)}
        self.heads = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(layers))) for _ in range(heads))

    @classmethod
    def from_config(cls, config: dict) -> "MedusaHeads":
        return cls(config["hidden"], config["heads"], config.get("layers", 1))

    @classmethod
    def for_target(cls, target, heads: int = 4, layers: int = 1) -> "MedusaHeads":
        return cls(target.model.cfg.hidden_size, heads, layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.stack([h(features) for h in self.heads])


class MedusaProposer(Proposer):
    name = "medusa"

    def __init__(self, target, heads: MedusaHeads, tree_budget: int | None = None, top_k: int = MedusaConfig.top_k,
                 draft_vocab: int = MedusaConfig.draft_vocab, head_weights: str = MedusaConfig.head_weights, cost_aware: bool = MedusaConfig.cost_aware) -> None:
        require_native(target, "medusa")
        if not isinstance(heads, MedusaHeads):
            raise InvalidParameterError(f"medusa needs MedusaHeads, got {type(heads).__name__}")
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.top_k = check_int("top_k", top_k)
        self.draft_vocab = check_int("draft_vocab", draft_vocab, low=0)
        self.head_weights = check_head_weights(head_weights)
        self.cost_aware = bool(cost_aware)
        self.target = target
        self.heads = heads
        self.dtype = next(heads.parameters()).dtype
        self.net: nn.Module = heads  # what runs: the heads, or their int8 copy (``begin``)
        self.default_budget = tree_budget or MedusaConfig.default_tree_budget
        self._steps = self._drafted = self._accepted = 0
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
        self.out = HeadVocab(ctx, self.draft_vocab, tokens)
        self.net = running_head(ctx, self.heads, self.head_weights)
        # greedy trees sized by expected tokens per second: the calibration is learned across
        # generations, per head and target (proposers/tree_cost.py)
        self.sizer = ctx.remember(MemoryKey("medusa", "tree_sizer", of=Identity(self.heads)), TreeSizer)
        self._node_p: list[tuple[int, float]] = []  # the greedy tree's nodes: (token, head probability)
        self.feature: torch.Tensor | None = None  # of the last decided token before the root
        self.feature_pos = -1
        pos, feature = getattr(self, "_prompt_feature", (-1, None))
        self._prompt_feature = (-1, None)
        if pos == len(tokens) - 2:  # from the prefill (absent when the prefix cache had the chunk)
            self.feature, self.feature_pos = feature, pos

    def wants_hidden(self) -> bool:
        return True

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        t0 = self._t_step = time.perf_counter()
        tree = TokenTree()
        if self.feature is None or self.feature_pos != len(tokens) - 2 or budget < 1:
            return tree  # no feature for the last decided token (the first step, or a step not observed)
        params = self.ctx.params
        with torch.inference_mode():
            states = self.net(self.feature.to(self.dtype))
            logp = node_dist(self.out.logits(states), params)  # [heads, n]
        n_heads = logp.shape[0]
        greedy = params.greedy
        k = min(self.top_k, budget)
        gen = self.ctx.generator
        self._node_p = []
        if greedy:
            # candidates: every depth's top-k under every kept node, best-first by path log-probability
            # (cost-aware: by the path's calibrated log acceptance)
            verify = self.sizing_cost()
            sizer = self.sizer if verify is not None else None
            per_depth = [draw_children(logp[d], k, params, gen) for d in range(n_heads)]
            per_depth = [(self.out.ids(idx), vals, [sizer.log_accept(math.exp(v)) for v in vals] if sizer else vals)
                         for idx, vals in per_depth]
            toks: list[int] = []
            pars: list[int] = []
            scores: list[float] = []
            probs: list[float] = []
            heap = [(-s, 0, -1, t, v) for t, v, s in zip(*per_depth[0])]
            heapq.heapify(heap)
            while heap and len(toks) < budget:
                neg, depth, parent, t, v = heapq.heappop(heap)
                node = len(toks)
                toks.append(t)
                pars.append(parent)
                scores.append(-neg)
                probs.append(math.exp(v))
                if depth + 1 < n_heads:
                    for ct, cv, cs in zip(*per_depth[depth + 1]):
                        heapq.heappush(heap, (neg - cs, depth + 1, node, ct, cv))
            if sizer is not None and toks:
                budget = sizer.size(scores, budget, verify, time.perf_counter() - t0)
            order = best_first(scores, pars, budget)
            tree = candidate_tree(toks, pars, scores, {}, budget, True, "medusa", order=order)
            self._node_p = [(toks[c], probs[c]) for c in order]
        else:
            # sampled: a node's children are drawn (without replacement) from its depth's head and kept
            # whole; nodes are expanded best-first while their children fit the budget
            q_of = [self.out.full(logp[d].exp()) for d in range(n_heads)]
            heap: list[tuple[float, int, int]] = [(0.0, -1, -1)]  # (-score, node, depth of node)
            while heap:
                neg, node, depth = heapq.heappop(heap)
                d = depth + 1
                if d >= n_heads:
                    continue
                # drafter-invariant sampling: head d drafts the token d positions past the root's next
                first = self.out.coupled(logp[d], self.ctx.uniform(len(tokens) + d))
                idx, vals = draw_children(logp[d], k, params, gen, first)
                if not idx or len(tree) + len(idx) > budget:
                    continue
                tree.q[node] = q_of[d]
                for t, v in zip(self.out.ids(idx), vals):
                    child = tree.add(t, node, sampled=True, source="medusa")
                    heapq.heappush(heap, (neg - v, child, d))
        self._drafted += len(tree)
        self._time += time.perf_counter() - t0
        return tree

    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        self._steps += 1
        self._accepted += len(verdict.accepted)
        if self.sizing_cost() is not None and self._node_p:
            self.sizer.learn(self._node_p, tree, verdict.accepted)  # calibrate
            self.sizer.note_step(len(verdict.tokens), time.perf_counter() - self._t_step)
        self._node_p = []  # used once: in ``auto`` another arm may draft the next step
        self.feature = None
        if hidden:
            row = verdict.accepted[-1] + 1 if verdict.accepted else 0
            with torch.inference_mode():
                self.feature = target_features(self.model, hidden[-1][0, row])
            self.feature_pos = len(tokens) - 2

    def stats(self) -> dict[str, Any]:
        out = head_stats("medusa", self._steps, self._drafted, self._accepted, self._time)
        out["head_int8_linears"] = int8_linears(self.net)
        return out
