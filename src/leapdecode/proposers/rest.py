"""Retrieval-based drafting (``method="rest"``).

"REST: Retrieval-Based Speculative Decoding" (He, Zhong, Cai, Lee & He,
NAACL 2024, arXiv:2311.08252).  Instead of a draft model, a datastore of
text (code, or earlier answers of the model) supplies the draft:

1. exact-match retrieval: the longest suffix of the current context (at most
   ``max_suffix`` tokens, at least ``min_suffix``) that occurs in the
   datastore -- the paper starts from a long suffix and shortens it until
   something matches -- is located with the datastore's suffix array;
2. the ``draft_len`` tokens that followed each of its occurrences (at most
   ``max_candidates`` occurrences, sampled evenly over the suffix-array range
   when there are more, see ``Datastore.continuations``) are the candidates;
3. draft construction: the candidates are merged into a trie whose nodes count
   the candidates through them, and the ``budget`` most frequent nodes (the
   paper's top nodes of the trie by count; ties go to the shallower node, so
   the kept nodes form a tree) are verified as one token tree.

Under greedy decoding the tree is sized by expected tokens per second, as for
``sam`` and ``draft`` (Sequoia's hardware-aware tree size, ``core/sizing.py``):
a node's chance of acceptance is its continuation frequency given its parent,
calibrated online against the verdicts per match-length bucket (a 2-token
suffix that matches thousands of places in a code corpus predicts chat text
badly; a 12-token one predicts well), and only the prefix of the ranked nodes
that maximises accepted tokens per second of verification is verified.  Where
verifying a wider tree costs more (a CPU without AMX), retrieval that keeps
missing stops costing anything.  ``cost_aware=False`` keeps the paper's fixed
budget.

Every node is deterministic (``sampled=False``), so the verifier is exact for
greedy decoding and for sampling.  The datastore is built offline
(``leapdecode datastore build``, see ``datastore.py``); ``datastore=`` takes
its path or a loaded ``Datastore``.  Without one the model's default
``<cache>/datastores/<model>-stdlib.npz`` is used if it exists.  Loaded
datastores are cached on the model object by path (and file mtime/size).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from ..core.sizing import AcceptanceCalibration, TryAgain
from ..core.tree import TokenTree
from ..errors import InvalidParameterError
from ..core.proposer import DecodeContext, Identity, MemoryKey, Proposer
from .datastore import Datastore, default_path, vocab_sha256
from .common import check_int
from .configs import RestConfig
from .tree_cost import Cut, Trie, TrieSizer

# suffix-match lengths whose continuations are calibrated apart (how far they can be trusted)
MATCH_BUCKETS = (0, 4, 8)


def _trie(cands: Sequence[tuple[Sequence[int], int]]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Weighted candidates ``(tokens, count)`` merged into a trie: per node its token, parent,
    depth and the total count of the candidates through it (a child never counts more than
    its parent)."""
    child: dict[tuple[int, int], int] = {}
    tok: list[int] = []
    par: list[int] = []
    depth: list[int] = []
    count: list[int] = []
    for toks, w in cands:
        parent = -1
        for d, t in enumerate(toks):
            t = int(t)
            node = child.get((parent, t))
            if node is None:
                node = child[(parent, t)] = len(tok)
                tok.append(t)
                par.append(parent)
                depth.append(d)
                count.append(0)
            count[node] += w
            parent = node
    return tok, par, depth, count


def _tree_of(order: list[int], tok: list[int], par: list[int], source: str) -> TokenTree:
    """The trie nodes ``order`` (parents before children) as a token tree."""
    tree = TokenTree()
    index: dict[int, int] = {}
    for v in order:
        p = par[v]
        index[v] = tree.add(tok[v], index[p] if p >= 0 else -1, sampled=False, source=source)
    return tree


def frequency_tree(cands: Sequence[tuple[Sequence[int], int]], budget: int, source: str = "rest") -> TokenTree:
    """Merge weighted candidates ``(tokens, count)`` into a trie and keep its ``budget`` most frequent
    nodes.

    A node's count is the total count of the candidates through it, so a child
    never counts more than its parent; ranking by (count desc, depth asc,
    insertion order) therefore keeps parents before their children and the
    kept nodes form a tree, best first (any prefix is the best smaller tree).
    """
    if budget < 1:
        return TokenTree()
    tok, par, depth, count = _trie(cands)
    order = sorted(range(len(tok)), key=lambda v: (-count[v], depth[v], v))[:budget]
    return _tree_of(order, tok, par, source)


def resolve_datastore(runner, datastore: Any = None) -> Datastore:
    """A ``Datastore`` for the runner's target from a path, a loaded object or the default location;
    loaded files are kept in the runner's memory (keyed by path, mtime and size), and the tokenizer
    is checked."""
    target = runner.model
    if isinstance(datastore, Datastore):
        ds = datastore
    else:
        if datastore is None:
            path = default_path(target.name)
            if not path.is_file():
                raise InvalidParameterError(
                    f"method 'rest' needs a datastore: pass datastore=PATH (--datastore PATH), or build the "
                    f"default one for {target.name} with `leapdecode datastore build --preset stdlib "
                    f"--model {target.name}` (it is written to {path})"
                )
        elif isinstance(datastore, (str, os.PathLike)):
            path = Path(datastore).expanduser()
        else:
            raise InvalidParameterError(
                f"datastore must be a path or a Datastore, got {type(datastore).__name__}"
            )
        try:
            st = path.stat()
            key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
        except OSError:
            key = None  # Datastore.load reports it
        ds = runner.memory.get(MemoryKey("rest", "datastore", key), lambda: Datastore.load(path)) if key \
            else Datastore.load(path)
    ds.check_tokenizer(target, runner.memory.get(MemoryKey("target", "vocab_sha256"),
                                                 lambda: vocab_sha256(target.tokenizer)))
    return ds


class RestProposer(Proposer):
    name = "rest"

    def __init__(
        self,
        datastore: Datastore,
        tree_budget: int | None = None,
        max_suffix: int = RestConfig.max_suffix,
        min_suffix: int = RestConfig.min_suffix,
        draft_len: int = RestConfig.draft_len,
        max_candidates: int = RestConfig.max_candidates,
        cost_aware: bool = RestConfig.cost_aware,
    ) -> None:
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.max_suffix = check_int("max_suffix", max_suffix)
        self.min_suffix = check_int("min_suffix", min_suffix)
        if self.min_suffix > self.max_suffix:
            raise InvalidParameterError(f"min_suffix ({min_suffix}) must be <= max_suffix ({max_suffix})")
        self.draft_len = check_int("draft_len", draft_len)
        self.max_candidates = check_int("max_candidates", max_candidates)
        if not isinstance(datastore, Datastore):
            raise InvalidParameterError(f"datastore must be a Datastore, got {type(datastore).__name__}")
        self.datastore = datastore
        self.default_budget = tree_budget or RestConfig.default_tree_budget
        self.cost_aware = cost_aware
        self.sizer = TrieSizer(TryAgain())  # its tries: the runner's, per datastore and match bucket (begin)
        self._last: Cut | None = None  # the sized tree, whose verdict teaches
        self._steps = self._hits = self._nodes = 0
        self._match_total = 0

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        # (sampling: no clock may steer)
        self._last = None
        if self.sizing_cost() is not None:
            # what this datastore's continuations are worth to this model, learned across generations
            # (the entry holds the datastore too, as it did when the key was its id())
            self.calibration, tries, _ = ctx.remember(
                MemoryKey("rest", "calibration", of=Identity(self.datastore)),
                lambda: ([AcceptanceCalibration() for _ in MATCH_BUCKETS], TryAgain(), self.datastore))
            self.sizer = TrieSizer(tries)

    def candidates(self, tokens: Sequence[int], budget: int) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
        """``(match length, [(continuation, count), ...])`` for the context ``tokens``."""
        ds = self.datastore
        length, lo, hi = ds.longest_suffix_match(tokens, self.max_suffix, self.min_suffix)
        if length == 0:
            return 0, []
        return length, ds.continuations(lo, hi, length, min(self.draft_len, budget), self.max_candidates)

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        self._steps += 1
        if budget < 1:
            return TokenTree()
        length, cands = self.candidates(tokens, budget)
        if not cands:
            return TokenTree()
        self._hits += 1
        self._match_total += length
        tree = self._sized_tree(cands, budget, length) if self.sizing_cost() is not None \
            else frequency_tree(cands, budget, self.name)
        self._nodes += len(tree)
        return tree

    def _sized_tree(self, cands, budget: int, match_len: int) -> TokenTree:
        """The trie's nodes ranked by calibrated acceptance probability, cut to the number that
        maximises expected tokens per second of the verification forward, now and then one beyond
        the cut (``TrieSizer``: without the tries a few early misses shut a match bucket out)."""
        tok, par, _, count = _trie(cands)
        total = sum(w for _, w in cands)
        bucket = max(i for i, lo in enumerate(MATCH_BUCKETS) if match_len >= lo)
        cond = [count[v] / (count[par[v]] if par[v] >= 0 else total) for v in range(len(tok))]
        cut = self.sizer.size(Trie(cond, par, self.calibration[bucket], bucket), budget,
                                         self.sizing_cost())
        self._last = cut
        return _tree_of(cut.nodes, tok, par, self.name)

    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        if self._last is None:
            return
        cut, self._last = self._last, None  # tree node i is the i-th ranked trie node
        self.sizer.learn(cut, tree, verdict.accepted)

    def stats(self) -> dict[str, Any]:
        return {
            "rest_hit_rate": round(self._hits / self._steps, 4) if self._steps else 0.0,
            "rest_mean_match": round(self._match_total / self._hits, 3) if self._hits else 0.0,
            "rest_datastore_tokens": len(self.datastore),
            "draft_nodes": self._nodes,
        }

