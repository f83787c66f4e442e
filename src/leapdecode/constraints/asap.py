"""Grammar-aligned sampling: ASAp ("Grammar-Aligned Decoding", Park, Wang, Berg-Kirkpatrick,
Polikarpova, D'Antoni, 2024).

Grammar-constrained decoding (GCD: mask the forbidden tokens, renormalize, sample) does not sample
from the model's distribution *conditioned on the grammar*, ``P(w | w in L(G)) ~ P(w) [w in L(G)]``:
at every step it renormalizes over the allowed tokens without regard to how much of the model's
probability mass *after* each token stays grammatical, so it over-samples prefixes that the model
rarely continues grammatically.  The exact conditional picks token ``t`` after prefix ``u`` with

    P(t | u, G)  ~  P(t | u) * EFG(u t),      EFG(u) = sum over grammatical completions w of P(w | u)

(the expected future grammaticality).  ASAp (Adaptive Sampling with Approximate expected
futures) keeps an estimate of EFG on a trie of the prefixes it has sampled: an unexplored prefix
counts as 1 (so the first sample is plain GCD), and after each sample, every prefix on its path
gets the model-probability mass of its grammatical continuations under the current estimates,

    EFG(u) = sum over allowed t of P(t | u) * EFG(u t)
           = sum over explored children t of P(t | u) * EFG(u t) + the unexplored allowed mass,

with ``P(EOS | u)`` counting fully when the grammar may end at ``u``.  The estimates only shrink
toward the truth, and the distribution of successive samples converges to the model's
distribution conditioned on the grammar (the paper's Theorem 1).  Each single sample is still
from an approximation; use it where the *distribution* over many samples matters (evaluation,
best-of-n, RL rollouts), not for one greedy answer.

Here the reweighting is a logit bias: the ASAp constraint wraps a grammar constraint and returns
``T * log EFG(u t)`` for the explored children (``Constraint.bias``), which the verifier adds to
the target's logits before the temperature ``T`` (and the mask), so any decoding method samples
exactly from the reweighted distribution.  The probabilities ``P(t | u)`` for the trie update
come from one teacher-forced forward over the sampled sequence (at the sampling temperature).
Sampling filters other than the temperature (top-k, top-p, min-p, typical-p, repetition penalty)
are refused: they change ``P`` in ways the estimate does not follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.constraint import Constraint
from ..core.generate import Generation, GenerationResult
from ..core.prompt import check_max_new_tokens, encode_prompt
from ..core.prefill import prefill_chunk
from ..core.runner import ModelRunner, runner_for
from ..core.sampling import SamplingParams
from ..errors import InvalidParameterError
from ..proposers.registry import build_proposer, method_config
from .grammar import GrammarConstraint, compile_constraint


@dataclass
class Node:
    """A sampled prefix: the grammatical share of its next-token mass, and its explored children."""

    unexplored: float = 1.0  # P(an allowed next token not yet sampled here | prefix), EOS included
    children: dict[int, tuple[float, "Node"]] = field(default_factory=dict)  # token -> (P(t | u), node)
    efg: float = 1.0  # the estimate of EFG(prefix); 1 until a sample's update reaches it

    def refresh(self) -> None:
        """EFG from the children's current estimates plus the unexplored allowed mass at the
        optimistic 1.  All terms are positive and the unexplored mass is summed directly over its
        tokens, never as a difference: grammatical masses of 1e-20 stay exact."""
        self.efg = sum(p * c.efg for p, c in self.children.values()) + self.unexplored


class ASApConstraint(Constraint):
    """A grammar constraint that also biases each explored child by ``T * log EFG``."""

    def __init__(self, base: GrammarConstraint, root: Node, temperature: float) -> None:
        self.base = base
        self.temperature = temperature
        self.nodes: list[Node | None] = [root]  # the trie node of each pushed prefix (None: unexplored)

    def mask(self) -> torch.Tensor:
        return self.base.mask()

    def allows(self, token: int) -> bool:
        return self.base.allows(token)

    def push(self, token: int) -> None:
        self.base.push(token)
        node = self.nodes[-1]
        child = node.children.get(token) if node is not None else None
        self.nodes.append(child[1] if child is not None else None)

    def pop(self, n: int = 1) -> None:
        self.base.pop(n)
        del self.nodes[len(self.nodes) - n:]

    def forced(self, limit: int) -> list[int]:
        return self.base.forced(limit)

    def is_eos(self, token: int) -> bool:
        return self.base.is_eos(token)

    def bias(self) -> torch.Tensor | None:
        node = self.nodes[-1]
        if node is None or not node.children:
            return None
        out = torch.zeros(self.base.vocab_size)
        for token, (_, child) in node.children.items():
            out[token] = self.temperature * math.log(max(child.efg, 1e-300))
        return out


class ASApSampler:
    """Draws samples of one prompt under one grammar; the samples' distribution approaches the
    model's distribution conditioned on the grammar as the trie learns (see the module docstring).

        sampler = ASApSampler(model, "Give a JSON person:", json_schema=schema, temperature=1.0)
        results = [sampler.sample(seed=i) for i in range(20)]
    """

    def __init__(self, model, prompt: Any, *, json_schema: Any = None, regex: str | None = None,
                 grammar: str | None = None, temperature: float = 1.0, max_new_tokens: int = 256,
                 method: str = "vanilla", chat: bool | None = None) -> None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise InvalidParameterError(f"grammar-aligned sampling needs a temperature > 0, got {temperature!r}")
        self.runner: ModelRunner = runner_for(model)
        self.structure = {"json_schema": json_schema, "regex": regex, "grammar": grammar}
        self.base = compile_constraint(self.runner, **self.structure)  # validates now; forked per sample
        self.prompt_ids = encode_prompt(self.runner.model, prompt, chat)
        self.temperature = float(temperature)
        self.method = method_config(method)  # validated now
        # never more than the context can hold (as the API caps it)
        self.max_new_tokens = min(check_max_new_tokens(max_new_tokens),
                                  max(self.runner.model.max_seq_len - len(self.prompt_ids), 1))
        self.root = Node()
        self.samples = 0

    @property
    def efg(self) -> float:
        """The current estimate of P(the model's output is grammatical) for this prompt."""
        return self.root.efg

    def sample(self, seed: int | None = None) -> GenerationResult:
        """One sample (under the current estimates), then the trie update along its path."""
        constraint = ASApConstraint(self.base.fork(), self.root, self.temperature)
        params = SamplingParams(temperature=self.temperature, seed=seed)
        gen = Generation(self.runner, self.prompt_ids, params, build_proposer(self.method, self.runner),
                         method=self.method.method, max_new_tokens=self.max_new_tokens,
                         tree_budget=self.method.tree_budget, constraint=constraint)
        res = gen.run()
        self._update(res.tokens, ended=res.finish_reason == "stop")
        self.samples += 1
        res.stats["asap_efg"] = round(self.root.efg, 6)
        return res

    @torch.inference_mode()
    def _probs(self, tokens: list[int]) -> torch.Tensor:
        """P_T(. | prompt + tokens[:i]) for i = 0..len(tokens): ``[len(tokens) + 1, V]`` (one
        teacher-forced pass, in prefill-sized chunks)."""
        ids = self.prompt_ids + tokens
        model = self.runner.model
        cache = self.runner.acquire_cache(model, len(ids) + 1)
        try:
            rows = []
            first = len(self.prompt_ids) - 1  # the logits after the prompt's last token come first
            step = prefill_chunk(model.model)  # cut as a Generation cuts it: the same bits
            for s in range(0, len(ids), step):
                chunk = torch.tensor(ids[s : s + step], device=model.device)
                logits = model.model.forward(chunk[None], cache)
                cache.commit()
                lo = max(first - s, 0)
                if lo < chunk.numel():
                    rows.append(logits[0, lo:].float())
            return torch.cat(rows).double().div(self.temperature).softmax(-1).cpu()
        finally:
            self.runner.release_cache(cache)

    def _update(self, tokens: list[int], ended: bool) -> None:
        probs = self._probs(tokens)
        grammar = self.base.fork()
        masks = []
        for t in tokens:
            masks.append(grammar.mask())
            grammar.push(t)
        masks.append(grammar.mask())
        # the trie path, created where new
        path = [self.root]
        for t, p in zip(tokens, probs):
            node = path[-1]
            if t not in node.children:
                node.children[t] = (float(p[t]), Node())
            path.append(node.children[t][1])
        # each prefix's grammatical mass under the model, bottom-up (children already updated)
        for i in range(len(path) - 1, -1, -1):
            if i == len(path) - 1 and not ended:
                continue  # cut by the token limit: what follows is unknown, keep the optimistic 1
            node = path[i]
            unexplored = masks[i].clone()
            if node.children:
                unexplored[list(node.children)] = False
            node.unexplored = float(probs[i][unexplored].sum())
            node.refresh()
