"""The token tree: what every proposer builds and the one verifier consumes.

Nodes are draft tokens; ``parents[i] == -1`` means node ``i`` follows the *root*,
the last decided token (already chosen, not yet in the target's KV cache).  For
verification the tree is flattened with the root first, so the target forward
sees ``[root, node 0, node 1, ...]`` and each node attends to the cache plus its
ancestors (positions = sequence length + depth).

Stochastic drafters record how children were drawn: ``q[v]`` is the draft
distribution at node ``v`` (``-1`` for the root) from which the children of
``v`` marked ``sampled`` were drawn *without replacement, in order*.  The
verifier runs recursive rejection sampling over those and falls back to the
deterministic-draft rule for the other children, which keeps the target
distribution exact.  A proposer must not drop sampled children after looking
at later draws (that would bias the test); deterministic children can be pruned
freely.

*Auxiliary* nodes (``aux[i]``) ride along in the verification forward but are
never accepted: lookahead decoding uses them for its Jacobi branch, whose
logits the proposer reads back in ``observe``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    aux: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int = -1, sampled: bool = False, source: str = "",
            aux: bool = False) -> int:
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not an existing node")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.sampled.append(sampled)
        self.sources.append(source)
        self.aux.append(aux)
        return len(self.tokens) - 1

    @classmethod
    def chain(cls, tokens: list[int], source: str = "", q: list[torch.Tensor] | None = None) -> "TokenTree":
        """A linear draft; with ``q`` (one distribution per token) it is a sampled chain."""
        tree = cls()
        for i, t in enumerate(tokens):
            tree.add(t, i - 1, sampled=q is not None, source=source)
            if q is not None:
                tree.q[i - 1] = q[i]
        return tree

    def children(self, node: int) -> list[int]:
        return self.child_map().get(node, [])

    def child_map(self) -> dict[int, list[int]]:
        """Candidate children of each node (auxiliary nodes excluded)."""
        out: dict[int, list[int]] = {}
        aux = self.aux or [False] * len(self.parents)
        for i, p in enumerate(self.parents):
            if not aux[i]:
                out.setdefault(p, []).append(i)
        return out

    def depths(self) -> list[int]:
        d: list[int] = []
        for p in self.parents:
            d.append(0 if p < 0 else d[p] + 1)
        return d

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def find_child(self, parent: int, token: int) -> int:
        return next((c for c in self.children(parent) if self.tokens[c] == token), -1)

    def flattened_parents(self) -> list[int]:
        """Parents in the verification forward, where index 0 is the root."""
        return [-1] + [p + 1 for p in self.parents]

    def copy(self) -> "TokenTree":
        """A tree that can grow without changing this one (the draft distributions are shared:
        nodes are only ever added)."""
        return TokenTree(list(self.tokens), list(self.parents), list(self.sampled), dict(self.q),
                         list(self.sources), list(self.aux))

    def truncated(self, n: int) -> "TokenTree":
        """The first ``n`` nodes (parents always precede children, so this is a tree).

        Children drawn from a draft distribution stay valid: dropping a suffix of
        the node list only drops whole later draws.
        """
        if n >= len(self):
            return self
        return TokenTree(self.tokens[:n], self.parents[:n], self.sampled[:n],
                         {k: v for k, v in self.q.items() if k < n}, self.sources[:n], self.aux[:n])

    def validate(self) -> None:
        if not (len(self.tokens) == len(self.parents) == len(self.sampled)) or (
            self.aux and len(self.aux) != len(self.tokens)
        ):
            raise ValueError("token tree fields differ in length")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede children")
            if self.sampled[i] and p not in self.q:
                raise ValueError(f"node {i} is marked sampled but its parent {p} has no draft distribution")
