"""Constrained decoding in the loop: what a grammar state must offer, and how a token tree meets it.

A ``Constraint`` is the state of a grammar over the tokens generated so far (the grammar engine
itself lives a layer up, ``leapdecode.constraints.grammar``).  It works like a stack: ``push``
consumes a token, ``pop`` takes tokens back, ``mask`` is the set of tokens allowed next.  The
loop uses it three ways, all exact:

* **the distribution**: at every verified row the target's logits are restricted to the allowed
  tokens (``verify(..., allowed=...)``), which is exactly what vanilla constrained decoding
  samples from: the target's next-token distribution restricted and renormalized;
* **pruning** (``prune_tree``): draft nodes the grammar forbids are removed with their subtrees
  before the verification forward, so no tree slot is spent on them.  A forbidden node that was
  *drawn* from a draft distribution (``sampled``) keeps its slot as a leaf: recursive rejection
  sampling needs every draw, in order, to stay exact; only what hangs below it is cut.
  Auxiliary nodes (lookahead's Jacobi branch) are never pruned.  The proposer still learns in its
  own numbering: ``unprune`` maps the verdict, logits and hidden states back to the tree it built;
* **forced tokens** (``forced``): where the grammar allows a single continuation (a fixed key
  name, punctuation), it proposes that chain itself, at no drafting cost: at the root instead of
  the proposer, and below the deepest leaf of the proposer's tree (``extend_forced``: a drafted
  `",` then the next key name); the verifier still decides (several tokenizations of the forced
  text may be allowed).

``RowMasks`` hands the verifier the mask of each tree row lazily (the verifier only looks at rows
along the path it walks), moving the grammar state along the tree with push/pop and restoring it
when closed.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from .tree import TokenTree


class Constraint(ABC):
    """A grammar's state over the generated tokens; masks are bool tensors over the target's
    vocabulary (True = allowed), end-of-sequence tokens included when the grammar may end."""

    @abstractmethod
    def mask(self) -> torch.Tensor:
        """Tokens allowed next (``[vocab]`` bool, on the CPU)."""

    @abstractmethod
    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (cheaper than a mask)."""

    @abstractmethod
    def push(self, token: int) -> None:
        """Consume ``token`` (which must be allowed)."""

    @abstractmethod
    def pop(self, n: int = 1) -> None:
        """Take back the last ``n`` pushed tokens."""

    @abstractmethod
    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here (empty when the next token is free)."""

    @abstractmethod
    def is_eos(self, token: int) -> bool:
        """Whether ``token`` ends the sequence (it is never pushed)."""

    def bias(self) -> torch.Tensor | None:
        """Log-weights added to the target's logits at the current state (``[vocab]`` float, before
        the temperature; None: none).  Plain grammars have none; grammar-aligned sampling
        (``constraints/asap.py``) reweights tokens by the estimated grammaticality of what follows."""
        return None


def rewind(constraint: Constraint, path: list[int], target: list[int]) -> int:
    """Pop ``constraint`` (and ``path``, the tree nodes whose tokens are pushed) back to the longest
    common prefix of ``path`` and ``target``; returns its length (``target[common:]`` is to push)."""
    common = 0
    while common < min(len(path), len(target)) and path[common] == target[common]:
        common += 1
    if len(path) > common:
        constraint.pop(len(path) - common)
        del path[common:]
    return common


def prune_tree(tree: TokenTree, constraint: Constraint) -> tuple[TokenTree, list[int] | None]:
    """``tree`` without the nodes the grammar forbids (see the module docstring), and for each kept
    node its index in ``tree`` (None when nothing was pruned: the same tree comes back); the
    constraint's state is unchanged on return."""
    if not len(tree):
        return tree, None
    aux = tree.aux or [False] * len(tree)
    keep: list[bool] = [False] * len(tree)
    leaf_only: list[bool] = [False] * len(tree)  # a forbidden sampled draw: kept, its subtree cut
    path: list[int] = []  # nodes whose tokens are pushed, root's child first
    try:
        for i, p in enumerate(tree.parents):  # parents precede children: a depth-first-ish order
            if p >= 0 and (not keep[p] or leaf_only[p]):
                continue
            if aux[i]:  # never accepted, and its logits are the proposer's business
                keep[i] = True
                continue
            # move the grammar state to the end of the path to p
            target = tree.path_to(p) if p >= 0 else []
            common = rewind(constraint, path, target)
            for node in target[common:]:
                constraint.push(tree.tokens[node])
                path.append(node)
            if constraint.allows(tree.tokens[i]) and not constraint.is_eos(tree.tokens[i]):
                keep[i] = True
            elif tree.sampled[i]:
                keep[i] = leaf_only[i] = True
    finally:
        if path:
            constraint.pop(len(path))
    if all(keep) and not any(leaf_only):
        return tree, None
    new_index: dict[int, int] = {}
    out = TokenTree()
    for i in range(len(tree)):
        if not keep[i]:
            continue
        parent = tree.parents[i]
        new_index[i] = out.add(tree.tokens[i], new_index[parent] if parent >= 0 else -1, tree.sampled[i],
                               tree.sources[i] if tree.sources else "", tree.aux[i] if tree.aux else False)
        if i in tree.q:
            out.q[new_index[i]] = tree.q[i]
    if -1 in tree.q:
        out.q[-1] = tree.q[-1]
    return out, sorted(new_index)


def extend_forced(tree: TokenTree, constraint: Constraint, room: int) -> bool:
    """Append, below the deepest allowed leaf of ``tree`` (in place), the tokens the grammar forces
    after that leaf's path, at most ``room``; returns whether any were added."""
    if room <= 0 or not len(tree):
        return False
    aux = tree.aux or [False] * len(tree)
    has_child = set(tree.parents)
    depths = tree.depths()
    leaves = [i for i in range(len(tree)) if i not in has_child and not aux[i]]
    if not leaves:
        return False
    leaf = max(leaves, key=lambda i: (depths[i], -i))
    path = tree.path_to(leaf)
    pushed = 0
    try:
        for node in path:
            token = tree.tokens[node]
            if constraint.is_eos(token) or not constraint.allows(token):
                return False  # a forbidden sampled draw kept as a leaf: nothing follows it
            constraint.push(token)
            pushed += 1
        forced = [t for t in constraint.forced(room)]
    finally:
        if pushed:
            constraint.pop(pushed)
    parent = leaf
    for t in forced:
        if constraint.is_eos(t):
            break
        parent = tree.add(t, parent, source="grammar")
    return parent != leaf


def unprune(tree: TokenTree, kept: list[int], accepted: list[int], logits: torch.Tensor,
            hidden: list | None) -> tuple[list[int], torch.Tensor, list | None]:
    """The verdict's accepted path, the logits ``[1 + len(verified), V]`` and the hidden states
    of a pruned (or grammar-extended) tree's forward, renumbered for ``tree``, the tree its
    proposer built.  ``kept[i]``: the index in ``tree`` of verified node ``i``; verified nodes past
    ``len(kept)`` are the grammar's (``extend_forced``): the accepted path is cut where it enters
    them.  A pruned node never went through the forward: its rows repeat those of its nearest
    kept ancestor (or the root's), a stand-in no verdict depends on."""
    row_of = [0] * (1 + len(tree))  # original flattened row -> row of the pruned forward
    new_of = {orig: new for new, orig in enumerate(kept)}
    for i, p in enumerate(tree.parents):
        row_of[i + 1] = new_of[i] + 1 if i in new_of else row_of[p + 1]
    index = torch.tensor(row_of, device=logits.device)
    logits = logits.index_select(0, index)
    if hidden:
        hidden = [h.index_select(1, index.to(h.device)) for h in hidden]
    path = []
    for a in accepted:
        if a >= len(kept):
            break
        path.append(kept[a])
    return path, logits, hidden


class RowMasks:
    """The allowed-token mask of each row of a flattened tree (row 0 = the root), computed when the
    verifier asks for it; ``close()`` puts the constraint back where it was."""

    def __init__(self, constraint: Constraint, tree: TokenTree) -> None:
        self.constraint = constraint
        self.tree = tree
        self.path: list[int] = []
        self.seconds = 0.0  # time spent in the grammar engine (masks and moves)

    def __call__(self, row: int) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self._mask(row)
        finally:
            self.seconds += time.perf_counter() - t0

    def bias(self, row: int) -> torch.Tensor | None:
        """The constraint's logit bias at ``row`` (None for plain grammars)."""
        t0 = time.perf_counter()
        try:
            self._mask(row, mask=False)
            return self.constraint.bias()
        finally:
            self.seconds += time.perf_counter() - t0

    def _mask(self, row: int, mask: bool = True) -> torch.Tensor | None:
        target = self.tree.path_to(row - 1) if row > 0 else []
        c, path = self.constraint, self.path
        common = rewind(c, path, target)
        for node in target[common:]:
            token = self.tree.tokens[node]
            if c.is_eos(token):
                # an accepted EOS draw (sampling): the sequence ends there and the loop discards what
                # the verifier draws below it, so any token will do
                return torch.ones_like(c.mask()) if mask else None
            if not c.allows(token):  # unreachable: the verifier never accepts a forbidden token
                return torch.zeros_like(c.mask()) if mask else None
            c.push(token)
            path.append(node)
        return c.mask() if mask else None

    def close(self) -> None:
        if self.path:
            t0 = time.perf_counter()
            self.constraint.pop(len(self.path))
            self.path = []
            self.seconds += time.perf_counter() - t0
