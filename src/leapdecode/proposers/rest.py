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

Every node is deterministic (``sampled=False``), so the verifier is exact for
greedy decoding and for sampling.  The datastore is built offline
(``leapdecode datastore build``, see ``datastore.py``); ``datastore=`` takes
its path or a loaded ``Datastore``.  Without one the model's default
``<cache>/datastores/<model>-stdlib.npz`` is used if it exists.  Loaded
datastores are cached on the model object by path (and file mtime/size).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Sequence

from ..core.tree import TokenTree
from ..errors import InvalidParameterError
from .base import Proposer
from .datastore import Datastore, default_path
from .pld import check_int


def frequency_tree(cands: Sequence[tuple[Sequence[int], int]], budget: int, source: str = "rest") -> TokenTree:
    """Merge weighted candidates ``(tokens, count)`` into a trie and keep its ``budget`` most frequent
    nodes.

    A node's count is the total count of the candidates through it, so a child
    never counts more than its parent; ranking by (count desc, depth asc,
    insertion order) therefore keeps parents before their children and the
    kept nodes form a tree, best first (any prefix is the best smaller tree).
    """
    tree = TokenTree()
    if budget < 1:
        return tree
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
    order = sorted(range(len(tok)), key=lambda v: (-count[v], depth[v], v))[:budget]
    index: dict[int, int] = {}
    for v in order:
        p = par[v]
        index[v] = tree.add(tok[v], index[p] if p >= 0 else -1, sampled=False, source=source)
    return tree


def resolve_datastore(target, datastore: Any = None) -> Datastore:
    """A ``Datastore`` for ``target`` from a path, a loaded object or the default location; loaded files
    are cached on the model object, and the tokenizer is checked."""
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
        cache = target.__dict__.setdefault("_rest_datastores", {})
        ds = cache.get(key) if key is not None else None
        if ds is None:
            ds = Datastore.load(path)
            if key is not None:
                for k in [k for k in cache if k[0] == key[0]]:
                    del cache[k]  # an older version of the same file
                cache[key] = ds
    ds.check_tokenizer(target)
    return ds


class RestProposer(Proposer):
    name = "rest"

    def __init__(
        self,
        datastore: Datastore,
        tree_budget: int | None = None,
        max_suffix: int = 16,
        min_suffix: int = 2,
        draft_len: int = 10,
        max_candidates: int = 128,
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
        self.default_budget = tree_budget or 24
        self._steps = self._hits = self._nodes = 0
        self._match_total = 0

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
        tree = frequency_tree(cands, budget, self.name)
        self._nodes += len(tree)
        return tree

    def stats(self) -> dict[str, Any]:
        return {
            "rest_hit_rate": round(self._hits / self._steps, 4) if self._steps else 0.0,
            "rest_mean_match": round(self._match_total / self._hits, 3) if self._hits else 0.0,
            "rest_datastore_tokens": len(self.datastore),
            "draft_nodes": self._nodes,
        }


def make_rest_proposer(target, tree_budget: int | None, options: dict[str, Any]) -> RestProposer:
    """``make_proposer("rest", ...)``: options are ``datastore`` (path or ``Datastore``; default: the
    model's stdlib datastore in the cache) and the ``RestProposer`` parameters."""
    accepted = [n for n in inspect.signature(RestProposer.__init__).parameters if n not in ("self", "tree_budget")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InvalidParameterError(
            f"method 'rest' does not take option(s) {', '.join(unknown)}; it takes: {', '.join(accepted)}"
        )
    options = dict(options)
    if tree_budget is not None:
        check_int("tree_budget", tree_budget)
    # validate the cheap parameters before loading a datastore
    for name in ("max_suffix", "min_suffix", "draft_len", "max_candidates"):
        if name in options:
            check_int(name, options[name])
    ds = resolve_datastore(target, options.pop("datastore", None))
    return RestProposer(ds, tree_budget=tree_budget, **options)
