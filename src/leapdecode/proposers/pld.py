"""Prompt lookup / n-gram drafting (``method="pld"``): copy what followed earlier.

Text an LLM writes often repeats spans of its input (code edits, summaries,
retrieval-augmented answers, quoting) or of its own output.  The drafter
matches the last ``n`` tokens against the prompt and everything generated so
far and proposes the tokens that followed the match.  No model runs; every
node is *deterministic* (``sampled=False``), so the verifier is exact for both
greedy decoding and sampling.

Papers:

* the copy idea is "Lossless Acceleration for Seq2seq Generation with
  Aggressive Decoding" (Ge et al., 2022): the input is used as the draft and
  the model verifies it in parallel;
* matching at several n-gram orders, longest first and falling back to
  shorter ones, is the multi-level n-gram module of "Lossless Acceleration of
  Large Language Model via Adaptive N-gram Parallel Decoding" (ANPD, Ou et
  al., 2024) -- in the prompt-lookup form popularised by "Prompt Lookup
  Decoding" (Saxena, 2023): n from ``max_ngram`` down to ``min_ngram``;
* ranking several candidate continuations by how often they were seen, and
  keeping more than one (a tree rather than a chain), follows "Adaptive
  Draft-Verification for Efficient Large Language Model Decoding" (ADED, Liu
  et al., 2024), whose drafts come from n-gram statistics of the text itself.

How a step works.  An incremental index maps every n-gram (``1 <= n <=
max_ngram``) to the positions of the token that *followed* each of its
occurrences, in text order; it is updated with the tokens decided since the
last step only (``max_ngram`` dict updates per token, never a rescan).  At
propose time, for ``n = max_ngram .. min_ngram`` the last ``n`` tokens are
looked up; the ``max_matches`` most recent continuation positions of each
level (positions already found at a longer level are skipped: an occurrence
of a 3-gram is also one of its 2-gram suffix) each give a continuation of up
to ``draft_len`` tokens.  A continuation that runs into the end of the text
keeps copying from its own start (the overlapping copy of LZ77), so a run
"a b a b" drafts "a b a b ..." and "x x x" drafts "x x x ...".  The
continuations are merged into a trie and the ``budget`` best nodes kept,
ranked by (longest matching n, number of supporting occurrences, most recent
occurrence): the longest match's most frequent continuation first, other
branches as the budget allows.  The cost per step is bounded by
``max_ngram * max_matches * draft_len``, independent of the text length.

Cost-aware chains (greedy, ``cost_aware=True``, the default).  Where verifying
another tree row costs a good part of a token (a CPU without AMX: the default
int4 format's verification profile), a 24-node tree of weak matches costs more
than it brings.  As ``sam`` does, the drafter then keeps the longest match's
continuation only, cut to the length that maximises expected tokens per second
of the verification forward (Sequoia's hardware-aware tree size;
``core/sizing.py``): P(the token at depth d is accepted | the ones before
were) is learned from the verdicts per matched n-gram length
(``ChainAcceptance``, remembered by the runner across generations), the
verification cost per tree size is the runner's measured profile.  Sampling
never follows the clock: it keeps the fixed budget (the verifier is exact
either way).  ``cost_aware=False`` keeps the tree above.
"""

from __future__ import annotations

from typing import Any, Iterable

from ..core.sizing import Chain, ChainAcceptance
from ..core.tree import TokenTree
from ..errors import InvalidParameterError
from ..core.proposer import DecodeContext, MemoryKey, Proposer
from .common import check_int, copy_continuation, merge_candidates
from .configs import PldConfig


class NGramIndex:
    """n-gram (``1 <= n <= max_ngram``) -> positions of the token that followed each occurrence.

    Fed one token at a time.  The n-grams ending at the newest token are
    registered only when the next token arrives, so every stored position
    ``p`` satisfies ``p < len(text)``: a continuation always exists.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.text: list[int] = []
        self.positions: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.text)

    def append(self, token: int) -> None:
        text = self.text
        i = len(text)  # the new token's position: continuation of the n-grams ending at i - 1
        text.append(int(token))
        positions = self.positions
        for n in range(1, min(self.max_ngram, i) + 1):
            key = tuple(text[i - n : i])
            lst = positions.get(key)
            if lst is None:
                positions[key] = [i]
            else:
                lst.append(i)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def lookup(self, n: int) -> list[int]:
        """Continuation positions (oldest first) of the last ``n`` tokens' earlier occurrences."""
        if n > len(self.text) or n > self.max_ngram:
            return []
        return self.positions.get(tuple(self.text[len(self.text) - n :]), [])


class PromptLookupProposer(Proposer):
    name = "pld"

    def __init__(
        self,
        tree_budget: int | None = None,
        max_ngram: int = PldConfig.max_ngram,
        min_ngram: int = PldConfig.min_ngram,
        draft_len: int = PldConfig.draft_len,
        max_matches: int = PldConfig.max_matches,
        cost_aware: bool = PldConfig.cost_aware,
    ) -> None:
        if tree_budget is not None:
            check_int("tree_budget", tree_budget)
        self.max_ngram = check_int("max_ngram", max_ngram)
        self.min_ngram = check_int("min_ngram", min_ngram)
        if self.min_ngram > self.max_ngram:
            raise InvalidParameterError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.draft_len = check_int("draft_len", draft_len)
        self.max_matches = check_int("max_matches", max_matches)
        self.default_budget = tree_budget or PldConfig.default_tree_budget
        self.cost_aware = cost_aware
        self.acceptance = ChainAcceptance(self.max_ngram + 1, self.draft_len)  # bucket: the matched n
        self._chain: Chain | None = None  # the last cost-aware chain (its bucket: the matched n)
        self.index = NGramIndex(self.max_ngram)
        self._steps = self._hits = self._nodes = 0
        self._match_total = 0

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        self.index = NGramIndex(self.max_ngram)
        self.index.extend(tokens)
        # (sampling: no clock may steer)
        self._chain = None
        if self.sizing_cost() is not None:  # what this model accepts is learned across its generations
            self.acceptance = ctx.remember(MemoryKey("pld", "chain_acceptance", (self.max_ngram, self.draft_len)),
                                           lambda: self.acceptance)

    def sync(self, tokens: list[int]) -> None:
        """Index the tokens decided since the last call (the text only grows within a generation)."""
        idx = self.index
        n = len(idx)
        if n > len(tokens) or (n and tokens[n - 1] != idx.text[n - 1]):
            idx = self.index = NGramIndex(self.max_ngram)  # a different text: start over
            n = 0
        if n < len(tokens):
            idx.extend(tokens[n:])

    def candidates(self, budget: int) -> list[tuple[list[int], int, int]]:
        """Continuations as ``(tokens, n, position)``, longest n first, most recent first within a level."""
        text = self.index.text
        length = min(self.draft_len, budget)
        seen: set[int] = set()
        out: list[tuple[list[int], int, int]] = []
        for n in range(min(self.max_ngram, len(text)), self.min_ngram - 1, -1):
            found = 0
            positions = self.index.lookup(n)
            for p in reversed(positions):
                if found >= self.max_matches:
                    break
                if p in seen:
                    continue
                seen.add(p)
                found += 1
                out.append((copy_continuation(text, p, length), n, p))
        return out

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        self.sync(tokens)
        self._steps += 1
        cands = self.candidates(budget)
        if not cands:
            return TokenTree()
        self._hits += 1
        self._match_total += cands[0][1]
        self._chain = None
        verify = self.sizing_cost()
        if verify is not None:  # the longest match's continuation, cut where it stops paying
            toks, n, p = cands[0]
            chain = self.acceptance.size(Chain(n, len(toks)), budget, verify)
            keep = chain.length
            if keep < 1:
                return TokenTree()
            self._chain = chain
            cands = [(toks[:keep], n, p)]
            budget = keep
        tree = merge_candidates(cands, budget, self.name)
        self._nodes += len(tree)
        return tree

    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        if self._chain is not None:  # learn how deep chains of this match length get accepted
            self.acceptance.learn(self._chain, tree, verdict.accepted)
            self._chain = None

    def stats(self) -> dict[str, Any]:
        return {
            "pld_hit_rate": round(self._hits / self._steps, 4) if self._steps else 0.0,
            "pld_mean_ngram": round(self._match_total / self._hits, 3) if self._hits else 0.0,
            "draft_nodes": self._nodes,
        }
