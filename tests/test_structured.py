"""Structured output (issue 15): JSON schemas, regexes and grammars, exact with every method.

1. ``core/constraint.py`` against a hand-written toy constraint (a finite language of token
   tuples, no grammar engine): ``prune_tree`` against a brute-force reference on random trees
   (forbidden deterministic nodes go with their subtrees, forbidden *sampled* draws stay as
   leaves, q distributions follow their nodes, the constraint's state is unchanged), ``RowMasks``
   (the mask of every row in any order, ``close()`` restores the state), ``unprune`` (verdict,
   logits and hidden states back in the proposer's numbering), ``extend_forced`` (the grammar's
   forced tokens below the deepest leaf), and the verifier with a lazy mask: greedy walks the
   masked argmax, lazy and dense masks give the same verdicts, and a toy decoder (sampled draft trees over a
   toy "model", pruned, verified with ``RowMasks``) samples whole outputs exactly from the
   masked, renormalized distribution (chi-square against the exact product); a planted error
   (pruning that also drops forbidden sampled draws) is rejected by the same test.
2. ``GrammarConstraint`` (llguidance): ``mask()`` agrees with ``allows()`` token by token, the
   allowed sets JSON allows (by hand), EOS tokens exactly when the value is complete, whitespace
   runs bounded to 32, forced tokens; Lark grammars (with an embedded schema) checked against
   equivalent regexes.
3. Property tests on tiny random models: outputs of many generated JSON schemas (nested objects,
   arrays with bounds, enums, consts, patterns, maxLength, bounded integers and numbers,
   booleans, null, anyOf, $ref to $defs, required/optional properties) parse and validate with
   ``jsonschema`` whenever they finish, and most finish; outputs of generated regexes always
   finish and ``re.fullmatch``, with a speculative method giving vanilla's tokens on the same
   seed (greedy and sampling).
4. Greedy identity: every method (draft and auto with tiny draft models) gives constrained
   vanilla's tokens on JSON schemas, regexes and a Lark grammar; every method also on a fixed
   sampling seed (drafter-invariant sampling); proposers observe the trees they built (in their own numbering) though
   the grammar pruned what was verified.
5. Forced tokens: with fixed keys, the grammar drafts them itself ("grammar" trees, and chains
   below pld's trees), the verifier accepts them whole (byte-level tokenizer: one tokenization),
   and each saves a target forward; vanilla drafts nothing.
6. Distribution on a tiny model: a small language (built at run time from the model's own
   likely characters, so drafts are both accepted and rejected); the exact constrained vanilla
   distribution over whole outputs is the product of masked, renormalized next-token
   probabilities from the model's logits; ``pld`` (deterministic drafts, seeded) and ``draft``
   (sampled draft trees, unseeded: recursive rejection sampling, forbidden draws kept as leaves)
   pass the chi-square test at
   alpha = 0.01, and two planted wrong masks (one extra token allowed, one allowed token
   missing) are rejected by the same test.
7. Errors: invalid schemas, unsupported keywords, invalid regexes and grammars, several
   constraints at once, a compile that runs past its time limit: ``GrammarError`` /
   ``InvalidParameterError`` naming the problem, quickly.
8. Bugs these tests found, now fixed: a sampled EOS draw accepted where the grammar may end,
   GBNF grammars, languages with no string.
9. Integration (``-m integration``): smollm2-135m extracts JSON from a chat prompt; vanilla,
   pld and auto give the same tokens and the output validates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
import threading
import time
from collections import Counter

import jsonschema
import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leapdecode
import leapdecode.core.committer as committer_module
import leapdecode.core.step_planner as step_planner_module
from leapdecode import ModelRunner
from leapdecode.core.constraint import Constraint, RowMasks, extend_forced, prune_tree, unprune
from leapdecode.core.generate import Generation
from leapdecode.core.sampling import SamplingParams
from leapdecode.core.tree import TokenTree
from leapdecode.core.verifier import verify
from leapdecode.errors import GrammarError, InvalidParameterError
from leapdecode.proposers import METHODS, build_proposer, method_config
from leapdecode.proposers.datastore import build_datastore
from leapdecode.constraints.grammar import GrammarConstraint, compile_constraint

ALPHA = 0.01
# a fixed seed and no example database: every run (and CI) sees the same examples
HSET = dict(deadline=None, database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                   HealthCheck.filter_too_much, HealthCheck.data_too_large])


# ============================================================================ 1. a toy constraint
TOY_V = 8  # toy vocabulary: tokens 0..6, EOS = 7
TOY_EOS = 7


class ToyConstraint(Constraint):
    """The prefixes of a finite language of token tuples: a token may come next when the tokens so
    far followed by it start some word; EOS when they are a word."""

    def __init__(self, words, vocab: int = TOY_V, eos: tuple[int, ...] = (TOY_EOS,)) -> None:
        self.words = {tuple(w) for w in words}
        self.vocab = vocab
        self.eos = set(eos)
        self.stack: list[int] = []

    def _next(self, seq: tuple[int, ...]) -> set[int]:
        n = len(seq)
        return {w[n] for w in self.words if len(w) > n and w[:n] == seq}

    def mask(self) -> torch.Tensor:
        out = torch.zeros(self.vocab, dtype=torch.bool)
        seq = tuple(self.stack)
        out[sorted(self._next(seq))] = True
        if seq in self.words:
            out[sorted(self.eos)] = True
        return out

    def allows(self, token: int) -> bool:
        seq = tuple(self.stack)
        return token in self._next(seq) or (token in self.eos and seq in self.words)

    def push(self, token: int) -> None:
        assert token not in self.eos and token in self._next(tuple(self.stack)), (self.stack, token)
        self.stack.append(token)

    def pop(self, n: int = 1) -> None:
        assert 0 <= n <= len(self.stack)
        del self.stack[len(self.stack) - n:]

    def forced(self, limit: int) -> list[int]:
        seq, out = tuple(self.stack), []
        while len(out) < limit and seq not in self.words and len(self._next(seq)) == 1:
            (t,) = self._next(seq)
            out.append(t)
            seq += (t,)
        return out

    def is_eos(self, token: int) -> bool:
        return token in self.eos


def _extends(words, seq) -> bool:
    """``seq`` (no EOS in it) starts some word."""
    n = len(seq)
    return any(w[:n] == tuple(seq) for w in words)


def reference_keep(tree: TokenTree, words, prefix, keep_forbidden_draws: bool = True) -> list[int]:
    """Brute force: node i stays when every ancestor's token is allowed on its path (prefix +
    the path's tokens start a word, no EOS) and i itself is allowed or (if
    ``keep_forbidden_draws``) was drawn from a draft distribution.  Auxiliary nodes (which hang
    from the root or from auxiliary nodes) always stay."""
    kept = []
    for i in range(len(tree)):
        if tree.aux[i]:
            kept.append(i)
            continue
        path = [tree.tokens[j] for j in tree.path_to(i)]
        if TOY_EOS in path[:-1] or not _extends(words, tuple(prefix) + tuple(path[:-1])):
            continue
        ok = path[-1] != TOY_EOS and _extends(words, tuple(prefix) + tuple(path))
        if ok or (keep_forbidden_draws and tree.sampled[i]):
            kept.append(i)
    return kept


def subtree(tree: TokenTree, kept: list[int]) -> TokenTree:
    """The nodes ``kept`` (ancestor-closed, in order), renumbered, with their q."""
    out, index = TokenTree(), {}
    for i in kept:
        p = tree.parents[i]
        index[i] = out.add(tree.tokens[i], index[p] if p >= 0 else -1, tree.sampled[i], tree.sources[i], tree.aux[i])
    out.q = {(index[k] if k >= 0 else -1): v for k, v in tree.q.items() if k < 0 or k in index}
    return out


@st.composite
def toy_words(draw):
    return draw(st.lists(st.lists(st.integers(0, TOY_V - 2), min_size=1, max_size=4).map(tuple),
                         min_size=1, max_size=6))


@st.composite
def toy_trees(draw, max_nodes: int = 14):
    """Random trees over the toy vocabulary (EOS included); siblings have distinct tokens (sampled
    siblings are draws without replacement)."""
    tree = TokenTree()
    for i in range(draw(st.integers(0, max_nodes))):
        parent = draw(st.integers(-1, len(tree) - 1))
        token = draw(st.integers(0, TOY_V - 1))
        if any(tree.tokens[c] == token for c in tree.children(parent)):
            continue
        # auxiliary nodes (lookahead's Jacobi window) hang from the root or from auxiliary nodes
        aux = parent >= 0 and tree.aux[parent] or parent < 0 and draw(st.integers(0, 5)) == 0
        tree.add(token, parent, draw(st.booleans()) and not aux, source=f"n{i}", aux=aux)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    for p in sorted({tree.parents[i] for i in range(len(tree)) if tree.sampled[i]}):
        tree.q[p] = torch.rand(TOY_V, generator=g).softmax(-1)
    return tree


@st.composite
def toy_states(draw):
    """Words, a tree, and the prefix of a word the constraint is at."""
    words = draw(toy_words())
    w = draw(st.sampled_from(sorted(words)))
    prefix = w[: draw(st.integers(0, len(w) - 1))]
    return words, draw(toy_trees()), list(prefix)


@hypothesis.seed(1)
@settings(max_examples=300, **HSET)
@given(state=toy_states())
def test_prune_tree_against_brute_force(state):
    words, tree, prefix = state
    c = ToyConstraint(words)
    for t in prefix:
        c.push(t)
    out, index = prune_tree(tree, c)
    assert c.stack == prefix  # the constraint's state is unchanged
    kept = reference_keep(tree, words, prefix)
    if index is None:  # nothing pruned: the very same tree
        assert out is tree and kept == list(range(len(tree)))
    else:
        assert index == kept  # each verified node's index in the proposer's tree
    want = subtree(tree, kept)
    assert (out.tokens, out.parents, out.sampled, out.sources, out.aux) == \
           (want.tokens, want.parents, want.sampled, want.sources, want.aux)
    assert sorted(out.q) == sorted(want.q)
    for k in want.q:  # the very distributions the children were drawn from
        assert torch.equal(out.q[k], want.q[k])
    out.validate()
    # forbidden deterministic nodes are gone; forbidden sampled draws stay but have no children
    children = out.child_map()
    for i in range(len(out)):
        path = [out.tokens[j] for j in out.path_to(i)]
        allowed = out.aux[i] or path[-1] != TOY_EOS and _extends(words, tuple(prefix) + tuple(path))
        assert allowed or out.sampled[i]
        if not allowed:
            assert i not in children
    # sampled children keep their drawing order under every kept node
    for node in [-1] + kept:
        before = [tree.tokens[c] for c in tree.children(node) if tree.sampled[c] and c in kept]
        new = kept.index(node) if node >= 0 else -1
        assert [out.tokens[c] for c in out.children(new) if out.sampled[c]] == before


def test_prune_tree_by_hand():
    # language {0 1 2, 0 3, 4}; the constraint starts empty
    words = [(0, 1, 2), (0, 3), (4,)]
    tree = TokenTree()
    a = tree.add(0, -1, sampled=False, source="d")  # allowed
    b = tree.add(5, -1, sampled=False, source="d")  # forbidden, deterministic: goes with its child
    tree.add(1, b, sampled=False, source="d")
    c = tree.add(6, -1, sampled=True, source="s")  # forbidden draw: kept as a leaf
    tree.add(4, c, sampled=True, source="s")  # below a forbidden draw: cut
    d = tree.add(4, -1, sampled=True, source="s")  # allowed draw
    tree.add(TOY_EOS, d, sampled=False, source="d")  # EOS is never a draft node
    e = tree.add(1, a, sampled=False, source="d")  # 0 1: allowed
    tree.add(2, e, sampled=True, source="s")  # 0 1 2
    tree.add(3, e, sampled=False, source="d")  # 0 1 3: forbidden
    tree.q[-1] = torch.full((TOY_V,), 1.0 / TOY_V)
    tree.q[c] = torch.full((TOY_V,), 1.0 / TOY_V)
    tree.q[e] = torch.full((TOY_V,), 1.0 / TOY_V)
    c_state = ToyConstraint(words)
    out, index = prune_tree(tree, c_state)
    assert c_state.stack == []
    assert index == [0, 3, 5, 7, 8]
    assert out.tokens == [0, 6, 4, 1, 2]
    assert out.parents == [-1, -1, -1, 0, 3]
    assert out.sampled == [False, True, True, False, True]
    assert sorted(out.q) == [-1, 1, 3] and out.q[3] is tree.q[e]
    # nothing forbidden: the very same tree comes back
    clean = TokenTree.chain([0, 1, 2])
    same, index = prune_tree(clean, ToyConstraint(words))
    assert same is clean and index is None


@hypothesis.seed(4)
@settings(max_examples=200, **HSET)
@given(state=toy_states(), data=st.data())
def test_unprune_maps_back_to_the_proposers_tree(state, data):
    """The verdict, logits and hidden states of the pruned (and grammar-extended) forward, in the
    numbering of the tree the proposer built: kept nodes get their own rows, a pruned node its
    nearest kept ancestor's (or the root's); the accepted path stops where the grammar's nodes
    begin."""
    words, tree, prefix = state
    c = ToyConstraint(words)
    for t in prefix:
        c.push(t)
    pruned, kept = prune_tree(tree, c)
    if kept is None:
        kept = list(range(len(tree)))
    extra = data.draw(st.integers(0, 2))  # grammar nodes appended below the last verified node
    for _ in range(extra):
        pruned.add(0, len(pruned) - 1, source="grammar")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(1 + len(pruned), TOY_V, generator=g)
    hidden = [torch.randn(1, 1 + len(pruned), 3, generator=g) for _ in range(2)]
    # an accepted path in the verified tree: a chain from the root
    path, node = [], -1
    while True:
        kids = [k for k in pruned.children(node)]
        if not kids or not data.draw(st.booleans()):
            break
        node = data.draw(st.sampled_from(kids))
        path.append(node)
    accepted, logits2, hidden2 = unprune(tree, kept, path, logits, hidden)
    want = []
    for a in path:
        if a >= len(kept):
            break
        want.append(kept[a])
    assert accepted == want
    assert logits2.shape == (1 + len(tree), TOY_V) and len(hidden2) == 2
    new_of = {orig: new for new, orig in enumerate(kept)}
    for i in range(-1, len(tree)):
        j = i
        while j >= 0 and j not in new_of:
            j = tree.parents[j]
        row = new_of[j] + 1 if j >= 0 else 0
        assert torch.equal(logits2[i + 1], logits[row]), (i, row)
        for h, h2 in zip(hidden, hidden2):
            assert torch.equal(h2[0, i + 1], h[0, row])


FORCED_WORDS = [(0, 1, 2, 3, 4), (0, 1, 5), (2, 3, 3, 3, 6), (5,), (6, 6, 6, 6, 6, 6)]


@st.composite
def forced_states(draw):
    """Trees that mostly follow ``FORCED_WORDS`` (whose words have long forced stretches)."""
    w = draw(st.sampled_from(FORCED_WORDS))
    prefix = list(w[: draw(st.integers(0, 2))])
    tree = TokenTree()
    for i in range(draw(st.integers(0, 8))):
        parent = draw(st.integers(-1, len(tree) - 1))
        seq = tuple(prefix) + tuple(tree.tokens[j] for j in tree.path_to(parent))
        nxt = sorted({v[len(seq)] for v in FORCED_WORDS if len(v) > len(seq) and v[: len(seq)] == seq})
        token = draw(st.sampled_from(nxt)) if nxt and draw(st.integers(0, 3)) else draw(st.integers(0, TOY_V - 1))
        if any(tree.tokens[c] == token for c in tree.children(parent)):
            continue
        aux = parent >= 0 and tree.aux[parent] or parent < 0 and draw(st.integers(0, 7)) == 0
        tree.add(token, parent, draw(st.booleans()) and not aux, source=f"n{i}", aux=aux)
    for p in sorted({tree.parents[i] for i in range(len(tree)) if tree.sampled[i]}):
        tree.q[p] = torch.full((TOY_V,), 1.0 / TOY_V)
    return FORCED_WORDS, tree, prefix


EXTENDED: Counter = Counter()


@hypothesis.seed(5)
@settings(max_examples=200, **HSET)
@given(state=forced_states(), room=st.integers(0, 5))
def _check_extend_forced(state, room):
    """The grammar's forced tokens go below the deepest (then first) non-auxiliary leaf when its
    path is allowed, at most ``room`` of them, as a deterministic "grammar" chain; the state is
    unchanged."""
    words, tree, prefix = state
    c = ToyConstraint(words)
    for t in prefix:
        c.push(t)
    tree, _ = prune_tree(tree, c)
    before = tree.copy()
    added = extend_forced(tree, c, room)
    assert c.stack == prefix
    assert tree.tokens[: len(before)] == before.tokens and tree.parents[: len(before)] == before.parents
    # brute force
    depths = before.depths()
    leaves = [i for i in range(len(before)) if i not in set(before.parents) and not before.aux[i]]
    want: list[int] = []
    if leaves and room > 0:
        leaf = max(leaves, key=lambda i: (depths[i], -i))
        seq = tuple(prefix) + tuple(before.tokens[j] for j in before.path_to(leaf))
        if TOY_EOS not in seq and _extends(words, seq):
            ref = ToyConstraint(words)
            for t in seq:
                ref.push(t)
            want = ref.forced(room)
    assert added == bool(want)
    EXTENDED[added] += 1
    new = list(range(len(before), len(tree)))
    assert [tree.tokens[i] for i in new] == want
    for k, i in enumerate(new):
        assert tree.parents[i] == (leaf if k == 0 else i - 1)
        assert tree.sources[i] == "grammar" and not tree.sampled[i] and not tree.aux[i]


def test_extend_forced():
    EXTENDED.clear()
    _check_extend_forced()
    assert EXTENDED[True] >= 20 and EXTENDED[False] >= 20, EXTENDED


@hypothesis.seed(2)
@settings(max_examples=200, **HSET)
@given(state=toy_states(), data=st.data())
def test_row_masks(state, data):
    words, tree, prefix = state
    c = ToyConstraint(words)
    for t in prefix:
        c.push(t)
    tree, _ = prune_tree(tree, c)
    rows = data.draw(st.lists(st.integers(0, len(tree)), max_size=3 * len(tree) + 2))
    masks = RowMasks(c, tree)
    for row in rows:
        path = [tree.tokens[j] for j in tree.path_to(row - 1)] if row > 0 else []
        if row > 0 and tree.aux[row - 1]:
            continue  # auxiliary rows: never verified (their tokens need not follow the grammar)
        expected = torch.zeros(TOY_V, dtype=torch.bool)
        before_eos = path[: path.index(TOY_EOS)] if TOY_EOS in path else path
        if _extends(words, tuple(prefix) + tuple(before_eos)):
            if TOY_EOS in path:  # below an accepted EOS draw the sequence is over: anything goes
                expected = torch.ones(TOY_V, dtype=torch.bool)
            else:
                ref = ToyConstraint(words)
                for t in prefix + path:
                    ref.push(t)
                expected = ref.mask()
        assert torch.equal(masks(row), expected), (row, path)
    masks.close()
    assert c.stack == prefix
    masks.close()  # twice is harmless
    assert c.stack == prefix


# --------------------------------------------------------------------------- a toy decoder
TOY_WORDS = [(0,), (0, 1), (0, 2, 3), (1,), (1, 1), (1, 4, 0), (2, 5), (5,)]


def _seed_of(*key) -> int:
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:4], "little")


def _toy_logits(seq: tuple[int, ...]) -> torch.Tensor:
    """A deterministic toy "target": logits for the token after ``seq``."""
    g = torch.Generator().manual_seed(_seed_of("target", seq))
    return torch.randn(TOY_V, generator=g) * 1.5


def _toy_q(seq: tuple[int, ...]) -> torch.Tensor:
    """A toy draft distribution that puts much of its mass on forbidden tokens (3, 4, 6), so that
    trees hold forbidden sampled draws.  It never draws EOS (a sampled EOS draw that the grammar
    allows crashes the loop: ``test_bug_sampled_eos_draft_is_accepted``)."""
    g = torch.Generator().manual_seed(_seed_of("draft", seq))
    logits = torch.randn(TOY_V, generator=g)
    logits[[3, 4, 6]] += 1.5
    logits[TOY_EOS] = -torch.inf
    return logits.softmax(-1)


def _masked_probs(seq: tuple[int, ...], words) -> dict[int, float]:
    allowed = sorted({w[len(seq)] for w in words if len(w) > len(seq) and w[: len(seq)] == seq})
    if seq in words:
        allowed.append(TOY_EOS)
    p = _toy_logits(seq).double()[allowed].softmax(-1)
    return dict(zip(allowed, p.tolist()))


def _toy_exact(words) -> dict[tuple[int, ...], float]:
    out = {}
    for w in words:
        prob = 1.0
        for i in range(len(w)):
            prob *= _masked_probs(w[:i], words)[w[i]]
        out[w] = prob * _masked_probs(w, words)[TOY_EOS]
    return out


def _toy_tree(seq: tuple[int, ...], g: torch.Generator, k: int = 2) -> TokenTree:
    """Two levels of ``k`` children drawn without replacement from ``_toy_q``, plus one deterministic
    guess at the root (often forbidden)."""
    tree = TokenTree()
    q = _toy_q(seq)
    tree.q[-1] = q
    for t in torch.multinomial(q, k, replacement=False, generator=g).tolist():
        node = tree.add(t, -1, sampled=True, source="toy")
        q2 = _toy_q(seq + (t,))
        tree.q[node] = q2
        for t2 in torch.multinomial(q2, k, replacement=False, generator=g).tolist():
            tree.add(t2, node, sampled=True, source="toy")
    guess = (len(seq) * 3 + 1) % (TOY_V - 1)
    if guess not in [tree.tokens[c] for c in tree.children(-1)]:
        tree.add(guess, -1, sampled=False, source="guess")
    return tree


def _naive_prune(tree: TokenTree, constraint: ToyConstraint) -> tuple[TokenTree, list[int]]:
    """The planted error: forbidden sampled draws are dropped like deterministic nodes."""
    kept = reference_keep(tree, constraint.words, constraint.stack, keep_forbidden_draws=False)
    return subtree(tree, kept), kept


def _toy_decode(seed: int, words, prune=prune_tree, stats: Counter | None = None) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    c = ToyConstraint(words)
    params = SamplingParams(temperature=1.0)
    out: tuple[int, ...] = ()
    while True:
        tree, _ = prune(_toy_tree(out, g), c)
        if stats is not None:
            stats["forbidden_leaves"] += sum(1 for i in range(len(tree)) if not c.allows(tree.tokens[i])
                                             and tree.parents[i] < 0)
        logits = torch.stack([_toy_logits(out)] +
                             [_toy_logits(out + tuple(tree.tokens[j] for j in tree.path_to(i)))
                              for i in range(len(tree))])
        masks = RowMasks(c, tree)
        try:
            v = verify(tree, logits, params, generator=g, allowed=masks)
        finally:
            masks.close()
        assert c.stack == list(out)
        if stats is not None:
            stats["accepted"] += len(v.accepted)
        for t in v.tokens:
            if t == TOY_EOS:
                return out
            c.push(t)
            out += (t,)


def _chi2_outputs(chi2, counts: Counter, expected: dict) -> tuple[float, int, float]:
    keys = sorted(set(expected) | set(counts))
    return chi2([counts.get(k, 0) for k in keys], [expected.get(k, 0.0) for k in keys])


def test_toy_decoder_samples_the_masked_distribution(chi2):
    """Sampled draft trees full of forbidden draws, pruned, verified with lazy masks: whole outputs
    follow the exact constrained distribution; the same test rejects a pruning that drops the
    forbidden draws (recursive rejection sampling needs every draw, in order)."""
    expected = _toy_exact(TOY_WORDS)
    assert abs(sum(expected.values()) - 1) < 1e-9
    n = 2500
    stats: Counter = Counter()
    counts = Counter(_toy_decode(s, TOY_WORDS, stats=stats) for s in range(n))
    stat, df, pval = _chi2_outputs(chi2, counts, expected)
    assert pval > ALPHA, (stat, df, pval, counts)
    assert stats["forbidden_leaves"] > n and stats["accepted"] > n // 4, stats  # the case is exercised
    planted = Counter(_toy_decode(s, TOY_WORDS, prune=_naive_prune) for s in range(n))
    assert _chi2_outputs(chi2, planted, expected)[2] < ALPHA


@hypothesis.seed(3)
@settings(max_examples=150, **HSET)
@given(state=toy_states(), seed=st.integers(0, 2**31 - 1))
def test_verify_with_row_masks(state, seed):
    """Greedy: the walk follows the masked argmax (brute force); sampling: lazy masks and the
    dense mask tensor give the same verdict from the same random stream."""
    words, tree, prefix = state
    c = ToyConstraint(words)
    for t in prefix:
        c.push(t)
    tree, _ = prune_tree(tree, c)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(tree) + 1, TOY_V, generator=g) * 2
    # greedy, brute force
    node, path = -1, []
    while True:
        ref = ToyConstraint(words)
        for t in prefix + [tree.tokens[j] for j in path]:
            ref.push(t)
        best = int(logits[node + 1].masked_fill(~ref.mask(), -1e30).argmax())
        nxt = next((ch for ch in tree.children(node) if tree.tokens[ch] == best), -1)
        if nxt < 0 or best == TOY_EOS:
            break
        path.append(nxt)
        node = nxt
    masks = RowMasks(c, tree)
    v = verify(tree, logits, SamplingParams(), allowed=masks)
    masks.close()
    assert (v.accepted, v.next_token) == (path, best)
    assert c.stack == prefix
    # sampling: lazy == dense (rows the walk never reaches, below forbidden draws, allow everything)
    ref = ToyConstraint(words)
    for t in prefix:
        ref.push(t)
    rows = RowMasks(ref, tree)
    dense = torch.stack([rows(r) for r in range(len(tree) + 1)])
    rows.close()
    dense[~dense.any(-1)] = True
    params = SamplingParams(temperature=0.8)
    masks = RowMasks(c, tree)
    lazy = verify(tree, logits, params, generator=torch.Generator().manual_seed(seed), allowed=masks)
    masks.close()
    full = verify(tree, logits, params, generator=torch.Generator().manual_seed(seed), allowed=dense)
    assert (lazy.accepted, lazy.tokens) == (full.accepted, full.tokens)
    assert c.stack == prefix
    for t in lazy.tokens:  # every emitted token is allowed where it is emitted
        assert ref.allows(t), (prefix, lazy.tokens)
        if t == TOY_EOS:
            break
        ref.push(t)


# ============================================================================ 2. GrammarConstraint
PERSON = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string", "maxLength": 8},
        "last_name": {"enum": ["xy", "yz", "Smith"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-c]{1,2}$"}, "minItems": 1,
                 "maxItems": 3},
    },
    "required": ["first_name", "last_name", "age", "tags"],
    "additionalProperties": False,
}
WHITESPACE = {" ", "\n", "\r", "\t"}


def _chars(tok, mask: torch.Tensor) -> set[str]:
    return {tok.decode([t]) for t in mask.nonzero().flatten().tolist()}


def test_grammar_constraint_mask_allows_and_eos(tiny):
    """``mask()`` agrees with ``allows()`` token by token along a valid output; the allowed sets at
    a few states are those JSON allows (derived by hand); EOS tokens (256 and 258 here) only
    when the value is complete; JSON whitespace runs are bounded; pop restores."""
    model = tiny(seed=0)
    tok, vocab = model.tokenizer, model.model.vocab_size
    c = compile_constraint(ModelRunner(model), json_schema=PERSON)
    assert isinstance(c, GrammarConstraint)
    text = '{"first_name": "Al", "last_name": "Smith", "age": 42, "tags": ["ab", "c"]}'
    ids = tok.encode(text)
    start = c.mask()
    eos = sorted(model.eos_token_ids)
    for i, t in enumerate(ids + [None]):
        m = c.mask()
        assert m.dtype == torch.bool and m.shape == (vocab,)
        assert torch.equal(m, torch.tensor([c.allows(x) for x in range(vocab)])), i
        complete = i == len(ids)
        assert all(bool(m[e]) == complete for e in eos), i
        assert not m[257]  # a special token that is not an EOS
        if t is None:
            break
        assert m[t], (i, tok.decode(ids[:i]))
        c.push(t)
    assert c.done
    c.pop(len(ids))
    assert torch.equal(c.mask(), start)
    # by hand: a value starts with "{"; after it, whitespace or the first key (all keys required)
    assert _chars(tok, start) == {"{"}
    c.push(tok.encode("{")[0])
    assert _chars(tok, c.mask()) == WHITESPACE | {'"'}
    for k in range(32):  # at most 32 whitespace characters between tokens
        assert c.allows(tok.encode(" ")[0]), k
        c.push(tok.encode(" ")[0])
    assert _chars(tok, c.mask()) == {'"'}
    # inside the enum: "S" forces the rest
    c.pop(33)
    for t in tok.encode('{"first_name":"","last_name":"S'):
        c.push(t)
    assert tok.decode(c.forced(20)) == 'mith"'
    assert tok.decode(c.forced(2)) == "mi"
    assert c.forced(0) == []


# ============================================================================ 3. property tests
KEYS = ["id", "name", "tags", "ok", "n", "x", "kind", "items"]
PATTERNS = ["^[a-c]{1,3}$", "^[0-9]{2}-[a-z]$", "^(yes|no)$", "^x[yz]?$"]
SCALARS = st.one_of(st.text(alphabet="abcxyz _", max_size=4), st.integers(-9, 99), st.booleans(), st.none())


def _leaf_schemas():
    ints = st.tuples(st.integers(-50, 50), st.integers(0, 60), st.booleans()).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]} if t[2] else
        {"type": "integer", "exclusiveMinimum": t[0] - 1, "maximum": t[0] + t[1]})
    nums = st.tuples(st.integers(-20, 20), st.integers(1, 40)).map(
        lambda t: {"type": "number", "minimum": t[0] / 4, "maximum": (t[0] + t[1]) / 4})
    strs = st.tuples(st.integers(0, 2), st.integers(0, 5)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]})
    pats = st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p})
    enums = st.lists(SCALARS, min_size=1, max_size=4, unique_by=json.dumps).map(lambda vs: {"enum": vs})
    const = SCALARS.map(lambda v: {"const": v})
    return st.one_of(ints, nums, strs, pats, enums, const, st.just({"type": "boolean"}), st.just({"type": "null"}))


def _compound_schemas(children):
    obj = st.dictionaries(st.sampled_from(KEYS), children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": sorted(req),
                         "additionalProperties": False}))
    arr = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
    any_of = st.lists(children, min_size=2, max_size=3).map(lambda cs: {"anyOf": cs})
    return st.one_of(obj, arr, any_of)


@st.composite
def json_schemas(draw):
    """Bounded schemas (every string, array and object is bounded, so outputs can finish)."""
    body = draw(st.recursive(_leaf_schemas(), _compound_schemas, max_leaves=8))
    if draw(st.booleans()):  # a $ref to $defs
        part = draw(st.recursive(_leaf_schemas(), _compound_schemas, max_leaves=3))
        ref = {"$ref": "#/$defs/part"}
        if body.get("type") == "object":
            body = {**body, "properties": {**body["properties"], "part": ref}}
            if draw(st.booleans()):
                body["required"] = sorted(set(body["required"]) | {"part"})
        else:
            body = {"type": "object", "properties": {"v": body, "part": ref}, "required": ["v", "part"],
                    "additionalProperties": False}
        body = {"$defs": {"part": part}, **body}
    return body


PROMPTS = ["hello", '{"name": "ab", "n": 12, "tags": ["x"]}\n', "the cat sat on the mat", "[1, 2, 3] "]
MODEL_FREE = ["pld", "sam", "recycling", "lookahead", "jacobi", "auto"]  # auto: no draft model here


def test_json_schema_outputs_validate(tiny, fresh_runner):
    runners = [fresh_runner(tiny(seed=s), verify_cost="flat") for s in (0, 1)]
    outcomes: Counter = Counter()

    @hypothesis.seed(20240915)
    @settings(max_examples=60, **HSET)
    @given(schema=json_schemas(), which=st.integers(0, 1), prompt=st.sampled_from(PROMPTS),
           method=st.sampled_from(["vanilla"] + MODEL_FREE), temperature=st.sampled_from([0.0, 1.0, 0.7]),
           seed=st.integers(0, 2**20))
    def check(schema, which, prompt, method, temperature, seed):
        jsonschema.Draft202012Validator.check_schema(schema)
        res = leapdecode.generate(runners[which], prompt, json_schema=schema, method=method, max_new_tokens=700,
                                  temperature=temperature, seed=seed)
        outcomes[res.finish_reason] += 1
        if res.finish_reason == "stop":
            value = json.loads(res.text)
            jsonschema.Draft202012Validator(schema).validate(value)
        else:
            assert res.finish_reason == "length" and len(res.tokens) == 700

    check()
    total = sum(outcomes.values())
    assert total >= 50 and outcomes["stop"] >= 0.85 * total, outcomes


@st.composite
def regexes(draw, depth: int = 2):
    """Bounded regexes in the syntax Python's ``re`` and llguidance (Rust's regex) share."""
    atoms = st.sampled_from(["a", "b", "x", "0", "[a-c]", "[xyz]", "[0-9]", "\\.", "-", " ", "[A-Fa-f]"])
    quants = st.sampled_from(["", "", "", "?", "{2}", "{1,3}", "{0,2}"])

    def piece(d: int) -> str:
        if d == 0 or draw(st.integers(0, 2)):
            atom = draw(atoms)
        else:
            atom = "(" + "|".join(seq(d - 1) for _ in range(draw(st.integers(2, 3)))) + ")"
        return atom + draw(quants)

    def seq(d: int) -> str:
        return "".join(piece(d) for _ in range(draw(st.integers(1, 3))))

    return seq(depth)


FIXED_REGEXES = [r"(ab|ba|aa)c", r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no|maybe)",
                 r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?", r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}"]


def test_regex_outputs_match(tiny, fresh_runner):
    """Every output finishes and fully matches; a model-free method gives vanilla's tokens on the same
    seed, greedy or sampling."""
    runners = [fresh_runner(tiny(seed=s), verify_cost="flat") for s in (0, 1)]

    @hypothesis.seed(20240915)
    @settings(max_examples=60, **HSET)
    @given(regex=st.one_of(st.sampled_from(FIXED_REGEXES), regexes()), which=st.integers(0, 1),
           prompt=st.sampled_from(PROMPTS + ["ab@cd.com 555-1234 yes"]), method=st.sampled_from(MODEL_FREE),
           temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**20))
    def check(regex, which, prompt, method, temperature, seed):
        kw = dict(regex=regex, max_new_tokens=120, temperature=temperature, seed=seed)
        want = leapdecode.generate(runners[which], prompt, method="vanilla", **kw)
        got = leapdecode.generate(runners[which], prompt, method=method, **kw)
        for res in (want, got):
            assert res.finish_reason == "stop", (regex, res.text)
            assert re.fullmatch(regex, res.text), (regex, res.text)
        assert got.tokens == want.tokens, (regex, method, want.text, got.text)

    check()


def test_lark_grammar_outputs(tiny, fresh_runner):
    """Lark grammars (llguidance's dialect, with an embedded JSON schema): outputs match an
    equivalent regex, written independently."""
    runner = fresh_runner(tiny(seed=1), verify_cost="flat")
    cases = [(LARK_EXPR, r"[0-9]{1,3}([-+*][0-9]{1,3}){0,3}=[0-9]{1,3}"),
             ('start: item{1,3}\nitem: "a" | "bc"', r"(a|bc){1,3}"),
             ('start: "n=" %json {"type": "integer", "minimum": 0, "maximum": 99}', r"n=(0|[1-9][0-9]?)")]
    for grammar, equivalent in cases:
        for method, temperature, seed in (("vanilla", 0.0, None), ("pld", 1.0, 3), ("auto", 1.0, 4)):
            res = leapdecode.generate(runner, "1+2*3=7\n", grammar=grammar, method=method, temperature=temperature,
                                      seed=seed, max_new_tokens=80)
            assert res.finish_reason == "stop" and re.fullmatch(equivalent, res.text), (grammar, res.text)


# ============================================================================ 4. greedy identity
LARK_EXPR = 'start: expr "=" NUM\nexpr: NUM (("+" | "-" | "*") NUM){0,3}\nNUM: /[0-9]{1,3}/'
NESTED = {
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                        "required": ["x", "y"], "additionalProperties": False}},
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["a", "bb", 3]},
                   "at": {"$ref": "#/$defs/point"},
                   "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
                   "ok": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
    "required": ["name", "kind", "at", "path"],
    "additionalProperties": False,
}
EMAILS = r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)(, [a-z]{1,8}@[a-z]{2,5}\.(com|org)){0,3}"
# (name, constraint, prompt, tiny model seed)
IDENTITY_CASES = [
    ("person", dict(json_schema=PERSON), "hello", 0),
    ("nested", dict(json_schema=NESTED), "the cat sat on the mat", 2),
    ("emails", dict(regex=EMAILS), "contact: bob@mail.com, ann@web.org; ", 0),
    ("lark", dict(grammar=LARK_EXPR), "1+2*3=7\n12*3=36\n", 1),
]
MAX_NEW = 400


def _drafts(seed: int, tiny) -> dict:
    return {"copy": tiny(seed=seed, copy=1), "noisy": tiny(seed=seed, noise=0.01, noise_seed=1)}


@pytest.fixture(scope="module")
def rest_datastore(tiny, tmp_path_factory):
    texts = [json.dumps({"first_name": "Al", "last_name": "Smith", "age": 42, "tags": ["ab"]}),
             "bob@mail.com, ann@web.org", "1+2*3=7\n12*3=36\n"] * 3
    ds = build_datastore(texts, tiny(seed=0).tokenizer, tiny(seed=0).name)
    return str(ds.save(tmp_path_factory.mktemp("rest") / "structured.npz"))


@pytest.fixture(scope="session")
def heads_dir(tiny, tmp_path_factory):
    """Untrained medusa and eagle heads for the identity cases' tiny targets (a head's quality
    only changes speed: whatever it drafts, the output is constrained vanilla's)."""
    from leapdecode.proposers.heads import EagleHead, HydraHeads, MedusaHeads, save_head
    from leapdecode.proposers.heads.common import fingerprint

    heads = tmp_path_factory.mktemp("heads")
    for s in sorted({c[3] for c in IDENTITY_CASES}):
        target = {"target": {"name": f"tiny-random:{s}", "fingerprint": fingerprint(tiny(seed=s))}}
        save_head(heads / f"medusa-{s}", MedusaHeads.for_target(tiny(seed=s), heads=3), target)
        save_head(heads / f"eagle-{s}", EagleHead.for_target(tiny(seed=s)), target)
        save_head(heads / f"hydra-{s}", HydraHeads.for_target(tiny(seed=s), heads=3), target)
    return str(heads)


def _options(method: str, draft: str | None, datastore: str, heads: str | None = None) -> dict:
    if method in ("draft", "auto") and draft is not None:
        return {"draft": draft}
    if method == "rest":
        return {"datastore": datastore}
    if method in ("medusa", "hydra", "eagle"):
        return {"head": heads}
    return {}


_VANILLA: dict = {}


def _vanilla(tiny, case: str, **kw):
    """Constrained vanilla's result for an identity case (computed once)."""
    key = (case, repr(sorted(kw.items())))
    if key not in _VANILLA:
        name, constraint, prompt, seed = next(c for c in IDENTITY_CASES if c[0] == case)
        _VANILLA[key] = leapdecode.generate(tiny(seed=seed), prompt, method="vanilla", max_new_tokens=MAX_NEW,
                                            **constraint, **kw)
    return _VANILLA[key]


IDENTITY_METHODS = (
    [pytest.param("auto", None, id="auto"), pytest.param("auto", "noisy", id="auto+draft"),
     pytest.param("draft", "copy", id="draft-copy"), pytest.param("draft", "noisy", id="draft-noisy")]
    + [pytest.param(m, None, id=m) for m in METHODS if m not in ("auto", "draft", "vanilla")]
)


@pytest.mark.parametrize("method,draft", IDENTITY_METHODS)
def test_greedy_identity(tiny, fresh_runner, rest_datastore, heads_dir, method, draft):
    for case, constraint, prompt, seed in IDENTITY_CASES:
        want = _vanilla(tiny, case)
        runner = fresh_runner(tiny(seed=seed), verify_cost="flat", drafts=_drafts(seed, tiny))
        got = leapdecode.generate(runner, prompt, method=method,
                                  options=_options(method, draft, rest_datastore, heads_dir),
                                  max_new_tokens=MAX_NEW, **constraint)
        assert got.tokens == want.tokens, (case, method, want.text, got.text)
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
        assert got.stats["target_forwards"] <= want.stats["target_forwards"]


def _follows(constraint: dict, text: str) -> bool:
    """Whether ``text`` follows an identity case's constraint (checked without the grammar engine)."""
    if "json_schema" in constraint:
        try:
            jsonschema.Draft202012Validator(constraint["json_schema"]).validate(json.loads(text))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    return re.fullmatch(r"[0-9]{1,3}([-+*][0-9]{1,3}){0,3}=[0-9]{1,3}", text) is not None


def test_identity_cases_are_meaningful(tiny):
    """The identity cases finish and follow their constraints (checked independently), and some of
    them are long enough that drafting matters."""
    for case, constraint, prompt, seed in IDENTITY_CASES:
        res = _vanilla(tiny, case)
        assert res.finish_reason == "stop", (case, res.text)
        assert _follows(constraint, res.text), (case, res.text)
    assert max(len(_vanilla(tiny, c[0]).tokens) for c in IDENTITY_CASES) > 100


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("vanilla", "draft")])
def test_sampling_same_seed_as_vanilla(tiny, fresh_runner, rest_datastore, heads_dir, method):
    """Constrained sampling with a seed: every method (sampled drafts too: layerskip, medusa, hydra,
    eagle) gives vanilla's constrained tokens for the same seed (drafter-invariant sampling)."""
    for case, constraint, prompt, seed in IDENTITY_CASES:
        for params in (dict(temperature=1.0, seed=11), dict(temperature=0.8, top_k=20, seed=12)):
            want = _vanilla(tiny, case, **params)
            runner = fresh_runner(tiny(seed=seed), verify_cost="flat")
            got = leapdecode.generate(runner, prompt, method=method, max_new_tokens=MAX_NEW,
                                      options=_options(method, None, rest_datastore, heads_dir), **constraint,
                                      **params)
            assert got.tokens == want.tokens, (case, method, params, want.text, got.text)


# ============================================================================ 5. forced tokens
FIXED_KEYS = {
    "type": "object",
    "properties": {"first_name": {"type": "string", "maxLength": 4}, "last_name": {"type": "string", "maxLength": 4},
                   "nickname": {"enum": ["alpha_centauri", "beta_pictoris"]}},
    "required": ["first_name", "last_name", "nickname"],
    "additionalProperties": False,
}


def _record_steps(monkeypatch, gen: Generation) -> list:
    """(position in the output, tree, verdict) of every verification of ``gen``."""
    steps = []

    def spy(tree, logits, params, history=None, generator=None, allowed=None, uniform=None):
        v = verify(tree, logits, params, history, generator, allowed, uniform)
        steps.append((len(gen.generated), tree, v))
        return v

    monkeypatch.setattr(committer_module, "verify", spy)
    return steps


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tokens_are_drafted_by_the_grammar(tiny, fresh_runner, monkeypatch, temperature):
    model = tiny(seed=0)
    tok = model.tokenizer
    runner = fresh_runner(model, verify_cost="flat")
    kw = dict(json_schema=FIXED_KEYS, max_new_tokens=MAX_NEW, temperature=temperature, seed=5)
    want = leapdecode.generate(runner, "hello", method="vanilla", **kw)
    assert want.finish_reason == "stop"
    gen = leapdecode.start_generation(runner, "hello", method="pld", **kw)
    steps = _record_steps(monkeypatch, gen)
    got = gen.run()
    assert got.tokens == want.tokens  # pld's drafts and the grammar's are deterministic nodes
    pieces, n_forced = [], 0
    for pos, tree, v in steps:
        on_path = {-1, *v.accepted}
        grammar = [i for i in range(len(tree)) if tree.sources[i] == "grammar"]
        for i in grammar:
            # a byte-level tokenizer has one tokenization of the forced text: once the verifier
            # reaches a forced node's parent, it takes the forced node
            if tree.parents[i] in on_path:
                assert i in on_path, (tok.decode(tree.tokens), v)
        accepted = [i for i in v.accepted if tree.sources[i] == "grammar"]
        if accepted:
            at = pos + v.accepted.index(accepted[0])
            assert got.tokens[at: at + len(accepted)] == [tree.tokens[i] for i in accepted]
            pieces.append(tok.decode([tree.tokens[i] for i in accepted]))
            n_forced += len(accepted)
    assert any(len(t) and set(t.sources) == {"grammar"} for _, t, _ in steps)  # trees of forced tokens alone
    text = "|".join(pieces)
    for key in ("first_name", "last_name", "nickname"):
        # the keys: all but their first letter (which picks the key when several are left)
        assert key[1:] in text.replace('"', ""), text
    assert "_centauri" in text or "_pictoris" in text, text  # the rest of the enum value
    # every accepted draft saved a forward; the forced ones alone saved n_forced
    total = sum(len(v.accepted) for _, _, v in steps)
    assert got.stats["target_forwards"] == want.stats["target_forwards"] - total
    assert total >= n_forced >= len("irst_name" "ast_name" "ickname" "_pictoris")


def test_forced_tokens_need_a_proposer(tiny, monkeypatch):
    """Vanilla drafts nothing, not even forced tokens: one forward per token."""
    model = tiny(seed=0)
    gen = leapdecode.start_generation(model, "hello", method="vanilla", json_schema=FIXED_KEYS, max_new_tokens=MAX_NEW)
    steps = _record_steps(monkeypatch, gen)
    res = gen.run()
    assert all(len(tree) == 0 for _, tree, _ in steps)
    assert res.stats["target_forwards"] == len(res.tokens) + (res.finish_reason == "stop")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_proposers_observe_their_own_trees(tiny, fresh_runner, monkeypatch, temperature):
    """Pruning renumbers the verified tree; a proposer still observes the tree it built, with the
    accepted path in its own numbering (a chain whose tokens are the emitted ones)."""
    runner = fresh_runner(tiny(seed=0), verify_cost="flat", drafts=_drafts(0, tiny))
    pruned = [0]

    def prune_spy(tree, constraint):
        out, kept = prune_tree(tree, constraint)
        pruned[0] += kept is not None
        return out, kept

    monkeypatch.setattr(step_planner_module, "prune_tree", prune_spy)
    for method, options in (("draft", {"draft": "copy"}), ("draft", {"draft": "noisy"}), ("auto", {"draft": "noisy"}),
                            ("lookahead", {}), ("recycling", {})):
        gen = leapdecode.start_generation(runner, "hello", method=method, options=options, json_schema=PERSON,
                                          temperature=temperature, seed=1, max_new_tokens=MAX_NEW)
        proposer, last, observed = gen.proposer, {}, [0]
        propose, observe = proposer.propose, proposer.observe

        def propose_spy(tokens, budget, propose=propose, last=last):
            last["tree"] = propose(tokens, budget)
            return last["tree"]

        def observe_spy(tokens, tree, verdict, logits, hidden=None, observe=observe, last=last, observed=observed):
            mine = last.pop("tree")
            assert tree is mine or (tree.tokens, tree.parents) == (mine.tokens[: len(tree)], mine.parents[: len(tree)])
            assert logits.shape[0] == 1 + len(tree)
            parent = -1
            for k, node in enumerate(verdict.accepted):
                assert tree.parents[node] == parent and tree.tokens[node] == verdict.tokens[k]
                parent = node
            observed[0] += 1
            observe(tokens, tree, verdict, logits, hidden)

        proposer.propose, proposer.observe = propose_spy, observe_spy
        res = gen.run()
        assert observed[0] > 0, method
        if temperature == 0:
            assert res.tokens == _vanilla_person(tiny)
    assert pruned[0] > 10


def _vanilla_person(tiny) -> list[int]:
    return leapdecode.generate(tiny(seed=0), "hello", method="vanilla", json_schema=PERSON,
                               max_new_tokens=MAX_NEW).tokens


# ============================================================================ 6. distribution on a tiny model
ALNUM = string.ascii_letters + string.digits
DIST_PROMPT = "the " + "ab" * 4  # pld drafts "a b ..."; the model puts its mass on letters here
N_SAMPLES = 1000


def _logits_after(model, ids: list[int]) -> torch.Tensor:
    """The model's next-token logits after ``ids`` (one plain forward on a fresh cache), float64."""
    cache = model.model.new_cache(batch_size=1, max_len=len(ids) + 8)
    with torch.no_grad():
        return model.model.forward(torch.tensor([ids]), cache, logits_for=slice(-1, None))[0, -1].double()


def _alnum_ids(tok) -> list[int]:
    ids = [tok.encode(ch) for ch in ALNUM]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def _closest(p: torch.Tensor, candidates: list[int], like: int, k: int) -> list[int]:
    """The ``k`` candidates whose probability is closest (in log) to that of ``like``."""
    target = float(p[like].clamp_min(1e-30).log())
    return sorted((c for c in candidates if c != like), key=lambda c: abs(float(p[c].clamp_min(1e-30).log()) - target))[:k]


def _regex_of(tok, words) -> str:
    return "(" + "|".join(tok.decode(list(w)) for w in sorted(words)) + ")"


def _exact_constrained(model, ids: list[int], words) -> dict[tuple[int, ...], float]:
    """P(output = w) under constrained vanilla sampling at temperature 1: the product, along w and its
    end, of the model's next-token distributions restricted to what the language allows next
    (EOS tokens where w is complete) and renormalized."""
    eos = sorted(model.eos_token_ids)
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        nxt = sorted({w[len(prefix)] for w in words if len(w) > len(prefix) and w[: len(prefix)] == prefix})
        allowed = nxt + (eos if prefix in words else [])
        if not nxt:  # only EOS tokens: the output ends here
            out[prefix] = prob
            return
        p = _logits_after(model, ids + list(prefix))[allowed].softmax(-1).tolist()
        for t, pt in zip(allowed, p):
            if t in eos:
                out[prefix] = out.get(prefix, 0.0) + prob * pt
            else:
                walk(prefix + (t,), prob * pt)

    walk((), 1.0)
    assert abs(sum(out.values()) - 1) < 1e-9
    return out


class Tracking(Constraint):
    """A constraint passed through unchanged, that remembers the tokens pushed (the state)."""

    def __init__(self, inner: Constraint) -> None:
        self.inner = inner
        self.stack: list[int] = []

    def mask(self):
        return self.inner.mask()

    def allows(self, token):
        return self.inner.allows(token)

    def push(self, token):
        self.inner.push(token)
        self.stack.append(token)

    def pop(self, n=1):
        self.inner.pop(n)
        del self.stack[len(self.stack) - n:]

    def forced(self, limit):
        return self.inner.forced(limit)

    def is_eos(self, token):
        return self.inner.is_eos(token)


class ExtraToken(Tracking):
    """A planted error: at the start, one more token than the language allows (the grammar
    consumes ``alias`` for it)."""

    def __init__(self, inner, extra: int, alias: int) -> None:
        super().__init__(inner)
        self.extra, self.alias = extra, alias

    def mask(self):
        m = self.inner.mask().clone()
        if not self.stack:
            m[self.extra] = True
        return m

    def allows(self, token):
        return (not self.stack and token == self.extra) or self.inner.allows(token)

    def push(self, token):
        self.inner.push(self.alias if not self.stack and token == self.extra else token)
        self.stack.append(token)

    def forced(self, limit):
        return [] if not self.stack else self.inner.forced(limit)


class MissingToken(Tracking):
    """A planted error: after ``prefix``, one allowed token is forbidden."""

    def __init__(self, inner, prefix: tuple[int, ...], token: int) -> None:
        super().__init__(inner)
        self.prefix, self.token = prefix, token

    def mask(self):
        m = self.inner.mask().clone()
        if tuple(self.stack) == self.prefix:
            m[self.token] = False
        return m

    def allows(self, token):
        return not (tuple(self.stack) == self.prefix and token == self.token) and self.inner.allows(token)


def _sample_outputs(runner, ids, n: int, method: str, options: dict, regex: str, wrap=None,
                    seeded: bool = True) -> Counter:
    """Outputs of ``n`` runs: run i with ``seed=i`` (drafter-invariant sampling), or, ``seeded=False``,
    with no seed and the global torch seed i (recursive rejection sampling over sampled drafts)."""
    counts: Counter = Counter()
    for i in range(n):
        kw = dict(regex=regex) if wrap is None else dict(constraint=wrap(compile_constraint(runner, regex=regex)))
        if not seeded:
            torch.manual_seed(i)
        res = leapdecode.generate(runner, prompt_ids=ids, method=method, options=options, temperature=1.0,
                                  seed=i if seeded else None, max_new_tokens=6, **kw)
        assert res.finish_reason == "stop", res
        counts[tuple(res.tokens)] += 1
    return counts


def _pld_language(model, ids):
    """A language around pld's own drafts: its first drafted token d1 and two letters about as
    likely as d1 at the start; after d1, its second drafted token d2 and a letter about as likely;
    after the others, their two likeliest letters.  So pld's drafts are allowed, and the verifier
    accepts and rejects them in comparable proportions."""
    tok = model.tokenizer
    alnum = _alnum_ids(tok)
    d1, d2 = build_proposer(method_config("pld"), ModelRunner(model)).propose(ids, 4).tokens[:2]
    assert d1 in alnum and d2 in alnum, tok.decode([d1, d2])
    p1 = _logits_after(model, ids).softmax(-1)
    firsts = [d1] + _closest(p1, alnum, d1, 2)
    words = set()
    for a in firsts:
        words.add((a,))
        p2 = _logits_after(model, ids + [a]).softmax(-1)
        seconds = [d2] + _closest(p2, alnum, d2, 1) if a == d1 else sorted(alnum, key=lambda t: -p2[t])[:2]
        words.update((a, b) for b in seconds)
    return words, d1, d2


def _draft_outcomes(monkeypatch) -> Counter:
    """Counts, over verifications, of steps whose tree the proposer drafted ("drafted"), and of
    those where the verifier accepted at least one drafted node ("accepted")."""
    stats: Counter = Counter()

    def spy(tree, logits, params, history=None, generator=None, allowed=None, uniform=None):
        v = verify(tree, logits, params, history, generator, allowed, uniform)
        if any(s != "grammar" for s in tree.sources):
            stats["drafted"] += 1
            stats["accepted"] += any(tree.sources[i] != "grammar" for i in v.accepted)
        return v

    monkeypatch.setattr(committer_module, "verify", spy)
    return stats


def test_distribution_pld_and_planted_masks(tiny, fresh_runner, chi2, monkeypatch):
    """Deterministic drafts under a constraint: whole outputs follow the exact constrained
    distribution; the same test rejects a mask with one extra token and one with a missing one."""
    model = tiny(seed=0)
    tok = model.tokenizer
    ids = tok.encode(DIST_PROMPT)
    words, d1, d2 = _pld_language(model, ids)
    regex = _regex_of(tok, words)
    expected = _exact_constrained(model, ids, words)
    assert min(expected[(d1,)] + expected.get((d1, d2), 0), 1 - expected[(d1,)]) > 0.05  # not a sure thing
    runner = fresh_runner(model, verify_cost="flat")
    drafts = _draft_outcomes(monkeypatch)
    counts = _sample_outputs(runner, ids, N_SAMPLES, "pld", {}, regex)
    stat, df, pval = chi2(*zip(*[(counts.get(w, 0), expected.get(w, 0.0)) for w in sorted(set(counts) | set(expected))]))
    assert pval > ALPHA, (stat, df, pval, counts, expected)
    # pld drafted, and its drafts were both accepted and rejected
    assert 0.1 * drafts["drafted"] < drafts["accepted"] < 0.9 * drafts["drafted"], drafts
    assert drafts["drafted"] > N_SAMPLES // 2, drafts
    # planted errors, the same test
    n = N_SAMPLES // 2
    alnum = _alnum_ids(tok)
    p1 = _logits_after(model, ids).softmax(-1)
    extra = max((t for t in alnum if (t,) not in words), key=lambda t: p1[t])
    wrong = _sample_outputs(runner, ids, n, "pld", {}, regex, wrap=lambda c: ExtraToken(c, extra, d1))
    assert _chi2_outputs(chi2, wrong, expected)[2] < ALPHA
    second = max((w for w in expected if len(w) == 2 and w[0] == d1), key=lambda w: expected[w])
    assert expected[second] > 0.03
    wrong = _sample_outputs(runner, ids, n, "pld", {}, regex, wrap=lambda c: MissingToken(c, second[:1], second[1]))
    assert set(wrong) <= set(expected)  # every output is in the language: only the frequencies are off
    assert _chi2_outputs(chi2, wrong, expected)[2] < ALPHA


DRAFT_CANDIDATES = [(1, "q7kq7kq7k"), (2, "abcabcab"), (2, "xyz xyz xy"), (0, " return xabzz")]


def _likeliest_letters(model, ids):
    """The model's three likeliest letters/digits, each followed by nothing or by one of its two
    likeliest; and the unconstrained probability of the first three."""
    alnum = _alnum_ids(model.tokenizer)
    p1 = _logits_after(model, ids).softmax(-1)
    firsts = sorted(alnum, key=lambda t: -p1[t])[:3]
    words = set()
    for a in firsts:
        words.add((a,))
        p2 = _logits_after(model, ids + [a]).softmax(-1)
        words.update((a, b) for b in sorted(alnum, key=lambda t: -p2[t])[:2])
    return words, float(p1[firsts].sum())


def test_distribution_sampled_draft_tree(tiny, fresh_runner, chi2, monkeypatch):
    """Sampled draft trees (recursive rejection sampling over children drawn without replacement)
    under a constraint: forbidden draws stay in the verified tree as leaves (their subtrees cut),
    and whole outputs follow the exact constrained distribution."""
    chosen = None
    for seed, prompt in DRAFT_CANDIDATES:  # drafts must hit (letters likely) and outputs must vary
        model = tiny(seed=seed)
        ids = model.tokenizer.encode(prompt)
        words, mass = _likeliest_letters(model, ids)
        expected = _exact_constrained(model, ids, words)
        if mass > 0.5 and max(expected.values()) < 0.6:
            chosen = seed
            break
    assert chosen is not None, "no candidate gives a usable case; extend DRAFT_CANDIDATES"
    regex = _regex_of(model.tokenizer, words)
    draft = tiny(seed=chosen, noise=0.01, noise_seed=1)
    runner = fresh_runner(model, verify_cost="flat", drafts={"noisy": draft})
    leaves: Counter = Counter()

    def prune_spy(tree, constraint):
        out, kept = prune_tree(tree, constraint)
        prefix = tuple(constraint.stack)
        children = out.child_map()
        for i in range(len(out)):
            seq = prefix + tuple(out.tokens[j] for j in out.path_to(i))
            if not any(w[: len(seq)] == seq for w in words):  # forbidden here (EOS included)
                assert out.sampled[i] and i not in children, (seq, out)
                leaves["forbidden"] += 1
            leaves["nodes"] += 1
        return out, kept

    monkeypatch.setattr(step_planner_module, "prune_tree", prune_spy)
    drafts = _draft_outcomes(monkeypatch)
    # draft_vocab=64: the draft samples from the 64 lowest ids and the prompt's tokens, so it never
    # draws an EOS (see test_bug_sampled_eos_draft_is_accepted)
    options = dict(draft="noisy", tree_budget=8, beam=1, draft_vocab=64)
    # unseeded: recursive rejection sampling, where forbidden sampled draws must stay as leaves
    counts = _sample_outputs(runner, ids, N_SAMPLES, "draft", options, regex, wrap=Tracking, seeded=False)
    stat, df, pval = _chi2_outputs(chi2, counts, expected)
    assert pval > ALPHA, (stat, df, pval, counts, expected)
    assert leaves["forbidden"] > N_SAMPLES // 10, leaves  # forbidden draws were verified as leaves
    assert 0.05 * drafts["drafted"] < drafts["accepted"] < 0.95 * drafts["drafted"], drafts
    # power: the law the draft itself would sample under the constraint is rejected
    assert _chi2_outputs(chi2, counts, _exact_constrained(draft, ids, words))[2] < ALPHA


# ============================================================================ 7. errors
@pytest.mark.parametrize("kw,error,words", [
    (dict(json_schema={"type": "nonsense"}), GrammarError, ["invalid JSON schema", "nonsense"]),
    (dict(json_schema='{"type": "object"'), GrammarError, ["not valid JSON"]),
    (dict(json_schema=["not", "a", "schema"]), GrammarError, ["must be an object"]),
    (dict(json_schema=False), GrammarError, ["`false`", "no document"]),  # probe SO013
    (dict(json_schema="false"), GrammarError, ["`false`", "no document"]),
    (dict(json_schema={"type": "array", "uniqueItems": True}), GrammarError, ["uniqueItems"]),
    (dict(json_schema={"type": "string", "format": "no-such-format"}), GrammarError, ["no-such-format"]),
    (dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}),
     GrammarError, ["/$defs/missing"]),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), GrammarError, ["minimum", "maximum"]),
    (dict(regex="(ab"), GrammarError, ["regex", "unclosed group"]),
    (dict(regex="a{2,1}"), GrammarError, ["repetition"]),
    (dict(regex=""), GrammarError, ["regex"]),
    (dict(grammar="start: foo"), GrammarError, ["foo"]),
    (dict(grammar="start: /(?!a)b/"), GrammarError, ["look-around"]),
    (dict(grammar="   "), GrammarError, ["grammar"]),
    (dict(json_schema={"type": "object"}, regex="a"), InvalidParameterError, ["json_schema", "regex"]),
    (dict(regex="a", grammar='start: "a"'), InvalidParameterError, ["regex", "grammar"]),
])
def test_errors(tiny, kw, error, words):
    model = tiny(seed=0)
    runner = ModelRunner(model)
    t0 = time.perf_counter()
    with pytest.raises(error) as info:
        leapdecode.generate(runner, "hello", max_new_tokens=8, **kw)
    assert time.perf_counter() - t0 < 5  # refused at once, before any model work
    assert isinstance(info.value, InvalidParameterError)
    message = str(info.value)
    for w in words:
        assert w.lower() in message.lower(), (w, message)
    assert runner.caches_in_use == 0  # no cache slot taken


def test_grammar_compile_time_limit(tiny, monkeypatch):
    """A grammar that takes longer than the limit to compile is refused with a GrammarError at the
    limit (the compile runs in a thread; the caller does not wait for it)."""
    import llguidance

    release = threading.Event()
    real = llguidance.LLMatcher

    class Slow:
        def __new__(cls, *args, **kwargs):
            release.wait(30)
            return real(*args, **kwargs)

    for name in ("grammar_from_regex", "grammar_from_json_schema", "grammar_from_lark"):
        setattr(Slow, name, staticmethod(getattr(real, name)))
    monkeypatch.setattr(llguidance, "LLMatcher", Slow)
    try:
        t0 = time.perf_counter()
        with pytest.raises(GrammarError, match="took more than"):
            compile_constraint(ModelRunner(tiny(seed=0)), regex="abc", timeout_s=0.3)
        assert time.perf_counter() - t0 < 3
    finally:
        release.set()


def test_compiled_constraint_and_strings_not_both(tiny):
    runner = ModelRunner(tiny(seed=0))
    c = compile_constraint(runner, regex="ab")
    with pytest.raises(InvalidParameterError):
        leapdecode.generate(runner, "x", constraint=c, regex="ab")
    res = leapdecode.generate(runner, "x", constraint=c, max_new_tokens=5)
    assert (res.text, res.finish_reason) == ("ab", "stop")


# ============================================================================ 8. once bugs (found by these tests, fixed)
def test_sampled_eos_draft_is_accepted_where_the_grammar_may_end():
    words = [(0,), (0, 1)]
    c = ToyConstraint(words)
    c.push(0)  # "0" is a word: EOS may come next (or 1)
    tree = TokenTree()
    tree.q[-1] = torch.zeros(TOY_V)
    tree.q[-1][[TOY_EOS, 1]] = 0.5
    tree.add(TOY_EOS, -1, sampled=True, source="draft")
    tree, _ = prune_tree(tree, c)
    assert tree.tokens == [TOY_EOS]  # kept: a draw
    logits = torch.zeros(2, TOY_V)
    logits[0, 1] = -30.0  # the target ends here almost surely: the EOS draw is accepted
    masks = RowMasks(c, tree)
    try:
        v = verify(tree, logits, SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(0),
                   allowed=masks)
    finally:
        masks.close()
    assert v.tokens[0] == TOY_EOS


def test_draft_sampling_when_the_draft_samples_eos(tiny, fresh_runner):
    base = tiny(seed=0)
    ids = base.tokenizer.encode("hello")
    favourite = int(_logits_after(base, ids).argmax())
    model = dataclasses.replace(base, eos_token_ids=set(base.eos_token_ids) | {favourite})
    runner = fresh_runner(model, verify_cost="flat", drafts={"copy": tiny(seed=0, copy=1)})
    for seed in range(10):
        res = leapdecode.generate(runner, "hello", regex="[a-c]{0,2}", method="draft", options={"draft": "copy"},
                                  temperature=1.0, seed=seed, max_new_tokens=10)
        assert re.fullmatch("[a-c]{0,2}", res.text)


def test_gbnf_grammar(tiny):
    res = leapdecode.generate(tiny(seed=0), "hello", grammar='root ::= "yes" | "no"', max_new_tokens=5)
    assert res.text in ("yes", "no") and res.finish_reason == "stop"


@pytest.mark.parametrize("regex", [r"a[^\x00-\x{10FFFF}]", r"[a&&b]"])
def test_empty_language_is_refused(tiny, regex):
    """A language with no string in it is refused when compiled: otherwise the matcher starts
    stopped, its mask allows only EOS, and an empty output would claim to be complete."""
    runner = ModelRunner(tiny(seed=0))
    with pytest.raises(GrammarError, match="matches nothing"):
        compile_constraint(runner, regex=regex)
    with pytest.raises(GrammarError):
        leapdecode.generate(runner, "hello", regex=regex, max_new_tokens=5)


# ============================================================================ 9. integration
SMOL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol():
    from leapdecode.models import kernel_library

    # the default (batch-invariant) format where the block kernel runs; fp32 otherwise.  An
    # integration test needs its model: a load error is a failure, not a skip.
    if kernel_library.kernel_problem() is None:
        return leapdecode.load("smollm2-135m")
    return leapdecode.load("smollm2-135m", dtype="fp32", device="cpu")


@pytest.mark.integration
def test_smollm2_json_extraction(smol, fresh_runner):
    prompt = ("Extract the person's name, age and city as JSON.\n"
              "Text: Alice Martin is 31 years old and lives in Paris.")
    runner = fresh_runner(smol, verify_cost="flat")
    results = {m: leapdecode.generate(runner, prompt, chat=True, json_schema=SMOL_SCHEMA, method=m, max_new_tokens=80)
               for m in ("vanilla", "pld", "auto")}
    want = results["vanilla"]
    assert want.finish_reason == "stop"
    value = json.loads(want.text)
    jsonschema.Draft202012Validator(SMOL_SCHEMA).validate(value)
    assert value["age"] == 31 and "Alice" in value["name"]
    for m, res in results.items():
        assert res.tokens == want.tokens, (m, res.text, want.text)
    # the keys are forced: the speculative methods need fewer forwards than tokens
    assert results["pld"].stats["target_forwards"] < len(want.tokens)
