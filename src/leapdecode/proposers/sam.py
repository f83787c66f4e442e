"""Suffix-automaton drafting (``method="sam"``).

"SAM Decoding: Speculative Decoding via Suffix Automaton" (Hu et al., 2024):
a suffix automaton over the prompt and the generated text (and optionally a
second, static one over a corpus) finds the *longest* suffix of the current
text that occurred before, and the tokens that followed that occurrence are
the draft.  Unlike fixed-order n-gram lookup the match length is unbounded,
and both building and matching cost amortized O(1) per token.

The automaton is the classic online construction (Blumer et al., 1985): state
``v`` has ``next[v]`` (token -> state), a suffix ``link[v]`` and ``length[v]``
(its longest string); per state we also keep two end positions of its
strings: ``first[v]``, the end of the first occurrence (set at creation,
inherited by clones), and ``recent[v]``, the end of a recent occurrence
(refreshed for every state the construction touches -- those are suffixes of
the text, so the newest position is one of their occurrences; refreshing
*every* suffix state would cost O(depth) per token, so states not touched keep
an older but still valid occurrence).  ``occurrence="recent"`` (default)
drafts from recent occurrences (the copy source is followed while it keeps
matching), ``"first"`` always from the first occurrence (the classic
``firstpos``).

Matching is incremental (one update per appended token, as the paper keeps its match state):

* dynamic automaton (prompt + output): after appending token ``i`` the state
  of the longest suffix of ``text[:i+1]`` that also ends before ``i`` is just
  ``link[last]`` and the match length is its ``length``.  The draft source
  position follows the occurrence we copied from while it keeps matching
  (``text[pos + 1] == token`` -> ``pos + 1``), else takes the new state's
  stored position *before* the construction refreshes it to ``i``.
* static automaton (corpus): the usual matching walk -- follow ``next`` on the
  new token, else shorten the match along suffix links -- one step per token.

The draft is the continuation of the longer of the two matches (at most
``draft_len`` tokens; a dynamic continuation that runs into the end of the
text continues as an overlapping copy); if the other automaton matched too
and budget is left, its continuation becomes a second branch.  Matches
shorter than ``min_match`` draft nothing.  All nodes are deterministic
(``sampled=False``), so the verifier is exact under greedy and sampling.

Under greedy decoding the chain is cut to the length that maximises expected
tokens per second: the acceptance of each depth, per match-length bucket, is
learned from the verdicts, and the verification cost per tree size is measured
(``core/cost_model.py``).  On hardware where a 17-token forward costs well
above a 1-token one, a long draft from a short, unreliable match costs more
than it brings.  ``cost_aware=False`` always drafts ``draft_len`` tokens.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..core.sizing import Chain, ChainAcceptance
from ..core.tree import TokenTree
from ..errors import InvalidParameterError
from ..core.proposer import DecodeContext, MemoryKey, Proposer
from .common import check_int, copy_continuation, merge_candidates
from .configs import SamConfig

# suffix-match length buckets: how far a match's draft can be trusted (also auto's bandit context)
MATCH_BUCKETS = (0, 1, 4, 12)


def match_bucket(match_len: int) -> int:
    return max(i for i, lo in enumerate(MATCH_BUCKETS) if match_len >= lo)

SEPARATOR = -1  # between corpus documents: never a token, so no match crosses it


class SuffixAutomaton:
    """Online suffix automaton over an integer sequence (``text`` is kept alongside)."""

    def __init__(self, recent: bool = True) -> None:
        self.use_recent = recent  # which stored end position ``append`` and ``step`` report
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first: list[int] = [-1]
        self.recent: list[int] = [-1]
        self.last = 0
        self.text: list[int] = []

    def __len__(self) -> int:
        return len(self.text)

    @property
    def n_states(self) -> int:
        return len(self.length)

    def _new_state(self, length: int, link: int, nxt: dict[int, int], first: int, recent: int) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.first.append(first)
        self.recent.append(recent)
        return len(self.length) - 1

    def append(self, c: int) -> int:
        """Extend by token ``c`` (position ``i``); returns the end of an earlier occurrence (``< i``) of the
        longest suffix that occurred before -- its state is ``link[last]`` afterwards -- or -1."""
        nxt, link, length, recent = self.next, self.link, self.length, self.recent
        i = len(self.text)
        self.text.append(c)
        cur = self._new_state(length[self.last] + 1, 0, {}, i, i)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            recent[p] = i - 1  # p is a suffix of text[:i]
            p = link[p]
        earlier = -1
        if p != -1:
            q = nxt[p][c]
            # q holds the longest earlier-occurring suffix (or its longer strings); read its
            # stored occurrence before it is refreshed to i
            earlier = recent[q] if self.use_recent else self.first[q]
            if length[p] + 1 == length[q]:
                link[cur] = q
                recent[q] = i
            else:
                clone = self._new_state(length[p] + 1, link[q], dict(nxt[q]), self.first[q], i)
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    recent[p] = i - 1
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur
        return earlier

    # --------------------------------------------------------------- matching
    def step(self, state: int, length: int, pos: int, c: int) -> tuple[int, int, int]:
        """Matching walk: the match ``(state, length, pos)`` of a text extended by ``c``.

        ``pos`` is the end of an occurrence of the matched string in this
        automaton's text (-1 if none is known).  The result is the longest
        suffix of the extended text that is a substring of this automaton's text.
        """
        nxt, link, lens, text = self.next, self.link, self.length, self.text
        while state != 0 and c not in nxt[state]:
            state = link[state]
            length = lens[state]
        target = nxt[state].get(c)
        if target is None:
            return 0, 0, -1
        if self.use_recent and 0 <= pos < len(text) - 1 and text[pos + 1] == c:
            pos += 1  # the occurrence we were following goes on
        else:
            pos = self.recent[target] if self.use_recent else self.first[target]
        return target, length + 1, pos


def build_static(corpus_tokens: Sequence[Sequence[int]], recent: bool = True) -> SuffixAutomaton:
    sa = SuffixAutomaton(recent)
    for d, doc in enumerate(corpus_tokens):
        if d:
            sa.append(SEPARATOR)
        for t in doc:
            t = int(t)
            if t < 0:
                raise InvalidParameterError(f"corpus_tokens must be token ids >= 0, got {t}")
            sa.append(t)
    return sa


class SuffixAutomatonProposer(Proposer):
    name = "sam"

    def __init__(
        self,
        tree_budget: int | None = None,
        draft_len: int = SamConfig.draft_len,
        min_match: int = SamConfig.min_match,
        corpus_tokens: list[list[int]] | None = SamConfig.corpus_tokens,
        occurrence: str = SamConfig.occurrence,
        cost_aware: bool = SamConfig.cost_aware,
    ) -> None:
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.draft_len = check_int("draft_len", draft_len)
        self.min_match = check_int("min_match", min_match)
        if occurrence not in ("recent", "first"):
            raise InvalidParameterError(f"occurrence must be 'recent' or 'first', got {occurrence!r}")
        self._recent = occurrence == "recent"
        if corpus_tokens is not None and (
            isinstance(corpus_tokens, (str, bytes)) or not all(isinstance(d, (list, tuple)) for d in corpus_tokens)
        ):
            raise InvalidParameterError("corpus_tokens must be a list of token-id lists")
        self.static = build_static(corpus_tokens, self._recent) if corpus_tokens else None
        self.default_budget = tree_budget or SamConfig.default_tree_budget
        self.cost_aware = cost_aware
        self.acceptance = ChainAcceptance(len(MATCH_BUCKETS), self.draft_len)
        self._chain: Chain | None = None  # the last cost-aware chain
        self._reset()
        self._steps = self._hits = self._nodes = 0
        self._match_total = 0
        self._static_used = 0

    def _reset(self) -> None:
        self.dyn = SuffixAutomaton(self._recent)
        self.dyn_len = 0  # length of the longest suffix that occurred before (state: dyn.link[dyn.last])
        self.dyn_pos = -1  # end of that earlier occurrence
        self.st_state = self.st_len = 0
        self.st_pos = -1

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        self._reset()
        self._feed(tokens)
        # (sampling: no clock may steer)
        if self.sizing_cost() is not None:  # what this model accepts is learned across its generations
            self.acceptance = ctx.remember(MemoryKey("sam", "chain_acceptance", (self.draft_len,)), lambda: self.acceptance)

    def _feed(self, new: Sequence[int]) -> None:
        dyn, st = self.dyn, self.static
        for c in new:
            c = int(c)
            # dynamic: ("recent") follow the copied occurrence while it matches, else the automaton's stored one
            # (if it does, the new match is exactly one token longer and ends at dyn_pos + 1)
            n = len(dyn.text)
            follow = self._recent and 0 <= self.dyn_pos < n - 1 and dyn.text[self.dyn_pos + 1] == c
            earlier = dyn.append(c)
            self.dyn_len = dyn.length[dyn.link[dyn.last]]
            if self.dyn_len == 0:
                self.dyn_pos = -1
            elif follow:
                self.dyn_pos += 1
            else:
                self.dyn_pos = earlier
            if st is not None:
                self.st_state, self.st_len, self.st_pos = st.step(self.st_state, self.st_len, self.st_pos, c)

    def sync(self, tokens: list[int]) -> None:
        n = len(self.dyn)
        if n > len(tokens) or (n and tokens[n - 1] != self.dyn.text[n - 1]):
            self._reset()  # a different text: start over
            n = 0
        if n < len(tokens):
            self._feed(tokens[n:])

    def matches(self) -> list[tuple[int, str, list[int]]]:
        """``(match length, "dynamic"/"static", continuation)`` per automaton that matched at least
        ``min_match`` tokens, longer match first (dynamic first on ties)."""
        out = []
        if self.dyn_len >= self.min_match and self.dyn_pos >= 0:
            out.append((self.dyn_len, "dynamic", copy_continuation(self.dyn.text, self.dyn_pos + 1, self.draft_len)))
        if self.static is not None and self.st_len >= self.min_match and self.st_pos >= 0:
            cont = []
            text = self.static.text
            for j in range(self.st_pos + 1, min(self.st_pos + 1 + self.draft_len, len(text))):
                if text[j] == SEPARATOR:
                    break
                cont.append(text[j])
            if cont:
                out.append((self.st_len, "static", cont))
        out.sort(key=lambda m: -m[0])  # stable: dynamic first on ties
        return out

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        self.sync(tokens)
        self._steps += 1
        found = self.matches()
        if not found or budget < 1:
            return TokenTree()
        self._hits += 1
        self._match_total += found[0][0]
        self._static_used += found[0][1] == "static"
        self._chain = None
        if self.sizes_by_cost:
            budget = self.worth_drafting(found[0][0], min(len(found[0][2]), budget))
            if budget < 1:
                return TokenTree()
            self._chain = Chain(match_bucket(found[0][0]), budget)
        # the longer match's chain first, the other as a branch with what budget is left
        cands = [(cont[:budget], len(found) - r, 0) for r, (_, _, cont) in enumerate(found)]
        tree = merge_candidates(cands, budget, self.name)
        self._nodes += len(tree)
        return tree

    @property
    def sizes_by_cost(self) -> bool:
        """This generation's chains are cut by learned acceptance and measured cost (greedy with a
        profile): a chain not worth its rows is not drafted at all."""
        return self.sizing_cost() is not None

    def worth_drafting(self, match_len: int, length: int, fixed_s: float = 0.0) -> int:
        """Greedy: how many tokens of a ``length``-token continuation of a ``match_len``-token
        match are worth verifying (expected tokens per second, see ``core/sizing.py``);
        ``length`` itself when costs are not used."""
        verify = self.sizing_cost()
        if verify is None:
            return length
        return self.acceptance.size(Chain(match_bucket(match_len), length), None, verify, fixed_s).length

    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        if self._chain is not None:  # learn how deep this match length's chains get accepted
            # (merge_candidates puts the main chain first: nodes 0, 1, ...)
            self.acceptance.learn(self._chain, tree, verdict.accepted)
            self._chain = None

    def stats(self) -> dict[str, Any]:
        out = {
            "sam_hit_rate": round(self._hits / self._steps, 4) if self._steps else 0.0,
            "sam_mean_match": round(self._match_total / self._hits, 3) if self._hits else 0.0,
            "draft_nodes": self._nodes,
        }
        if self.static is not None:
            out["sam_static_states"] = self.static.n_states
            out["sam_static_drafts"] = self._static_used
        return out
