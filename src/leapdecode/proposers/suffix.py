"""Cross-request suffix memory (``method="suffix"``).

"SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications" (Oliaro et al., 2024): a
suffix tree over the outputs of earlier requests, kept by the serving process, and one over the
current request's prompt and output; at each step the longest suffix of the text that occurs in a
tree (in the request's own: that occurred before its newest occurrence) selects a node, and a
speculation tree is grown from it greedily by the empirical probability of each continuation (the
counts of the tree's children over their parent's), at most ``spec_factor`` x the matched length
nodes (a long match is trusted with a larger tree), no node below ``min_prob``; of the two trees
(global, request) the one with the larger expected number of accepted tokens (the sum of its nodes'
path probabilities) is verified. A server answering similar requests (extraction to one schema,
agent loops, repeated code edits) drafts from what earlier requests produced instead of relearning
it every time.

Here the trees are depth-limited suffix tries with counts (``SuffixTrie``): every suffix of a
document, cut at ``depth`` tokens, is a path from the root, and a node's count is the number of
suffixes through it. A document is extended one token at a time (the request's own trie grows with
its output) and can be removed again, so the global memory is bounded: the runner keeps the outputs
of the last requests up to ``memory_tokens`` tokens, and the oldest go first (LRU). The memory lives
in the runner (``ctx.remember``), one per target, shared by every generation on it; the global trie
learns a request's output when the request ends.

Under greedy decoding (``cost_aware``, the default) the size of the tree is measured rather than the
paper's ``spec_factor`` x match length, which stands in for the cost of verification on a GPU, where
extra rows are nearly free: each trie grows its tree up to the budget (``min_prob`` still applies),
a node's chance of acceptance is its empirical probability given its parent, calibrated online
against the verdicts per match-length bucket and per trie (request or memory), and the prefix of the
nodes ranked by calibrated path probability that maximises expected tokens per second of
verification (``core/sizing.py``'s ``best_tree_size`` on the target's measured profile) is
verified; of the two tries the one whose sized tree is worth more, and every few cuts of a trie and
match bucket one node beyond the cut is verified too (``TryAgain``: a calibration learns only from
what is verified, and without the tries a few early misses shut a trie out for good). On a CPU,
where a verified row costs a tenth to a quarter of a forward, a one-token match no longer buys a
one-node tree by rule, nor does a long match buy a wide one. ``cost_aware=False`` (and sampling,
where no clock may steer) keeps the paper's rule.

Every node is deterministic (``sampled=False``), so the verifier keeps the output exactly vanilla's,
greedy and sampled.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Any, Sequence

from ..core.sizing import AcceptanceCalibration, TryAgain
from ..core.proposer import DecodeContext, MemoryKey, Proposer
from ..core.tree import TokenTree
from ..errors import InvalidParameterError
from .common import check_int
from .configs import SuffixConfig
from .sam import MATCH_BUCKETS, match_bucket
from .tree_cost import Cut, Trie, TrieSizer

SOURCES = ("suffix-local", "suffix-global")  # the request's own trie, the runner's memory
# bytes a trie holds per live node (its children dict and list slots), per freed node kept for reuse,
# and per stored token: measured with tracemalloc on 20,000 random tokens at depth 48 (282, 134)
NODE_BYTES, FREE_NODE_BYTES, TOKEN_BYTES = 282, 134, 36


class SuffixTrie:
    """Suffixes of documents, each cut at ``depth`` tokens, in a trie with counts.

    Node 0 is the root; ``children[v]`` maps a token to a node and ``count[v]`` is the number of
    stored suffixes that pass through ``v``.  Documents are added token by token (``extend``) and
    removed whole (``remove``); nodes whose count drops to zero are freed and reused."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.children: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self.token: list[int] = [-1]
        self.level: list[int] = [0]  # a node's depth
        self._free: list[int] = []
        self.docs: dict[Any, list[int]] = {}  # document -> its tokens
        self._active: dict[Any, list[int]] = {}  # document -> nodes where its last suffixes end
        self._tokens = 0  # tokens stored: kept, not summed, since the memory budget reads it after every generation

    def __len__(self) -> int:
        """Tokens stored."""
        return self._tokens

    @property
    def nodes(self) -> int:
        return len(self.count) - len(self._free)

    def nbytes(self) -> int:
        """About the bytes the trie holds (``NODE_BYTES``...): what a server's memory budget counts."""
        return self.nodes * NODE_BYTES + len(self._free) * FREE_NODE_BYTES + len(self) * TOKEN_BYTES

    def _child(self, v: int, t: int) -> int:
        c = self.children[v].get(t)
        if c is None:
            if self._free:
                c = self._free.pop()
                self.children[c], self.count[c], self.token[c] = {}, 0, t
                self.level[c] = self.level[v] + 1
            else:
                c = len(self.count)
                self.children.append({})
                self.count.append(0)
                self.token.append(t)
                self.level.append(self.level[v] + 1)
            self.children[v][t] = c
        return c

    def extend(self, doc: Any, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to document ``doc`` (created if new): each new token extends the
        suffixes that end at the document's end and are shorter than ``depth``, and starts one."""
        text = self.docs.setdefault(doc, [])
        active = self._active.setdefault(doc, [])
        for t in tokens:
            t = int(t)
            text.append(t)
            self._tokens += 1
            nxt = []
            for v in [*active, 0]:
                c = self._child(v, t)
                self.count[c] += 1
                if self.level[c] < self.depth:
                    nxt.append(c)
            active[:] = nxt

    def remove(self, doc: Any) -> None:
        """Forget document ``doc``: every one of its suffixes' counts is taken back."""
        text = self.docs.pop(doc, None)
        self._active.pop(doc, None)
        if not text:
            return
        self._tokens -= len(text)
        for start in range(len(text)):
            v = 0
            for t in text[start:start + self.depth]:
                c = self.children[v][t]
                self.count[c] -= 1
                if self.count[c] <= 0:  # counts fall with depth: the whole subtree is unused now
                    del self.children[v][t]
                    self._release(c)
                    break
                v = c

    def _release(self, v: int) -> None:
        stack = [v]
        while stack:
            u = stack.pop()
            stack.extend(self.children[u].values())
            self.children[u] = {}
            self.count[u] = 0
            self._free.append(u)

    def match(self, context: Sequence[int], longest: int, exclude: int = 0) -> tuple[int, int]:
        """The node of the longest suffix of ``context`` (at most ``longest`` tokens) that is a path
        from the root with more than ``exclude`` occurrences, and its length; (0, 0) when not even
        the last token does.  ``exclude=1`` for a trie that holds ``context`` itself (the request's
        own): the suffix's newest occurrence is the one being matched, and without an earlier one
        there is nothing to continue from."""
        n = len(context)
        for length in range(min(longest, n), 0, -1):
            v = 0
            for t in context[n - length:]:
                v = self.children[v].get(int(t), -1)
                if v < 0:
                    break
            if v > 0 and self.count[v] > exclude:
                return v, length
        return 0, 0

    def speculate(self, node: int, max_nodes: int, min_prob: float,
                  exclude: int = 0) -> tuple[list[tuple[int, int, float]], float]:
        """Grow a speculation tree from ``node``: the most probable continuations first, each
        child's probability its count over its parent's times the parent's path probability, at
        most ``max_nodes`` nodes, none below ``min_prob``; ``exclude`` occurrences of ``node``
        without a continuation are left out of its count (the request's own text: the suffix being
        matched ends there).  Returns ``[(token, parent index or -1, path probability)]`` in the
        order added (parents first) and the tree's score, the sum of the path probabilities (the
        expected number of accepted tokens)."""
        out: list[tuple[int, int, float]] = []
        order = itertools.count()  # ties: the earlier-pushed first (deterministic)
        heap: list[tuple[float, int, int, int]] = []

        def push(v: int, p: float, parent_index: int, exclude: int = 0) -> None:
            total = self.count[v] - exclude
            if total <= 0:
                return
            for t, c in self.children[v].items():
                q = p * self.count[c] / total
                if q >= min_prob:
                    heapq.heappush(heap, (-q, next(order), c, parent_index))

        push(node, 1.0, -1, exclude)
        score = 0.0
        while heap and len(out) < max_nodes:
            neg_q, _, c, parent_index = heapq.heappop(heap)
            out.append((self.token[c], parent_index, -neg_q))
            score += -neg_q
            if self.count[c] > 0 and self.children[c]:
                push(c, -neg_q, len(out) - 1)
        return out, score


class SuffixMemory:
    """The runner's global trie over earlier requests' outputs, bounded by tokens (LRU: the oldest
    requests are forgotten first)."""

    def __init__(self, depth: int, max_tokens: int) -> None:
        self.trie = SuffixTrie(depth)
        self.max_tokens = max_tokens
        self.order: OrderedDict[int, int] = OrderedDict()  # document -> its length, oldest first
        self.tokens = 0
        self.version = 0  # changes whenever the content does (a match found before is stale then)
        self._ids = itertools.count()

    def snapshot(self) -> list[tuple[int, list[int]]]:
        """What the memory holds now, to be put back by ``restore`` (cheap: references to the
        documents' token lists, which never change once added)."""
        return [(doc, self.trie.docs[doc]) for doc in self.order]

    def restore(self, snap: list[tuple[int, list[int]]]) -> None:
        """Forget what was added since ``snap`` was taken and take back what it evicted (the bench
        repeats a request from the same memory, so no repeat drafts from its own earlier run)."""
        keep = dict(snap)
        for doc in [d for d in self.order if d not in keep]:
            self.trie.remove(doc)
        for doc, tokens in snap:
            if doc not in self.trie.docs:
                self.trie.extend(doc, tokens)
        self.order = OrderedDict((doc, len(tokens)) for doc, tokens in snap)
        self.tokens = sum(self.order.values())
        self.version += 1

    def nbytes(self) -> int:
        return self.trie.nbytes()

    def shrink(self, nbytes: int) -> int:
        """Forget the oldest documents until about ``nbytes`` bytes are freed, or none is left (the
        runner's memory budget, ``ProposerMemory``); returns the bytes freed."""
        before = self.nbytes()
        while self.order and before - self.nbytes() < nbytes:
            old, n = self.order.popitem(last=False)
            self.trie.remove(old)
            self.tokens -= n
            self.version += 1
        return before - self.nbytes()

    def add(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[-self.max_tokens:]  # a document longer than the memory: its end
        if not tokens:
            return
        doc = next(self._ids)
        self.version += 1
        self.trie.extend(doc, tokens)
        self.order[doc] = len(tokens)
        self.tokens += len(tokens)
        while self.tokens > self.max_tokens and self.order:
            old, n = self.order.popitem(last=False)
            self.trie.remove(old)
            self.tokens -= n


class SuffixDecodingProposer(Proposer):
    name = "suffix"

    def __init__(self, tree_budget: int | None = None, depth: int = SuffixConfig.depth, max_match: int = SuffixConfig.max_match,
                 spec_factor: float = SuffixConfig.spec_factor, min_prob: float = SuffixConfig.min_prob, memory_tokens: int = SuffixConfig.memory_tokens,
                 remember_prompts: bool = SuffixConfig.remember_prompts, cost_aware: bool = SuffixConfig.cost_aware,
                 local: bool = True, memory: bool = True) -> None:
        """``local=False``: draft from the memory alone, never from the request's own text (``auto``'s
        memory arm: its automaton covers the request; no per-request trie is built).  ``memory=False``:
        the request's own trie alone, neither reading nor adding to the runner's memory (``auto``'s
        copying arm with ``copier="suffix"``)."""
        if not (local or memory):
            raise InvalidParameterError("suffix needs the request's own trie, the memory, or both")
        super().__init__(check_int("tree_budget", tree_budget) if tree_budget is not None
                         else SuffixConfig.default_tree_budget)
        self.depth = check_int("depth", depth)
        self.max_match = min(check_int("max_match", max_match), self.depth - 1)  # room for a continuation
        self.spec_factor, self.min_prob = float(spec_factor), float(min_prob)
        self.memory_tokens = check_int("memory_tokens", memory_tokens)
        self.remember_prompts = remember_prompts
        self.cost_aware = cost_aware
        self.use_local = local
        self.use_memory = memory
        self.calibration: dict[str, list[AcceptanceCalibration]] = {}
        self.sizer = TrieSizer(TryAgain())  # its tries: the runner's, per trie and match bucket (begin)
        self._last: Cut | None = None  # the sized tree, whose verdict teaches
        self.memory: SuffixMemory | None = None
        self.local: SuffixTrie | None = None
        self._fed = self._prompt_len = 0
        self._tokens: list[int] = []
        self._memory_hit: tuple | None = None  # (text length, memory version, node, match length)
        self._steps = self._global_drafts = self._local_drafts = self._nodes = 0

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        super().begin(ctx, tokens)
        self.memory = ctx.remember(MemoryKey("suffix", "memory", (self.depth, self.memory_tokens)),
                                   lambda: SuffixMemory(self.depth, self.memory_tokens)) if self.use_memory else None
        self.local = SuffixTrie(self.depth)
        if self.use_local:
            self.local.extend("request", tokens)
        self._fed = self._prompt_len = len(tokens)
        self._tokens = list(tokens)
        self._memory_hit = None
        self._last = None
        # (sampling: no clock may steer)
        if self.sizing_cost() is not None:  # what each trie's frequencies are worth to this model, learned across generations
            self.calibration = ctx.remember(MemoryKey("suffix", "calibration"), lambda: {
                source: [AcceptanceCalibration() for _ in MATCH_BUCKETS] for source in SOURCES})
            self.sizer = TrieSizer(ctx.remember(MemoryKey("suffix", "tries"), TryAgain))

    def memory_match(self, tokens: list[int]) -> int:
        """The length of the longest suffix of ``tokens`` (at most ``max_match``) that occurs in the
        memory; 0 before ``begin`` or with an empty memory.  The match is kept for a ``propose`` at
        the same text (``auto``'s memory arm asks first, then drafts)."""
        if self.memory is None or not self.memory.tokens:
            return 0
        node, length = self.memory.trie.match(tokens, self.max_match)
        self._memory_hit = (len(tokens), self.memory.version, node, length)
        return length

    def _sync(self, tokens: list[int]) -> None:
        if len(tokens) > self._fed and self.use_local:
            self.local.extend("request", tokens[self._fed:])
            self._fed = len(tokens)
        self._tokens = tokens

    def _candidate(self, trie: SuffixTrie, tokens: list[int], budget: int, source: str,
                   found: tuple | None = None):
        """The speculation tree of ``trie`` at the text's longest matched suffix: its nodes
        ``(token, parent index, calibrated path probability)``, its score (expected tokens per second
        of the step when sized by cost, else the paper's expected accepted tokens) and, when sized by
        cost, the sized tree, whose verdict teaches (``Cut``)."""
        # the request's own trie holds the text up to the root, the matched suffix's own occurrence
        # included: it has no continuation yet, so it is left out of the match and of its count
        exclude = 1 if source == "suffix-local" else 0
        node, length = found or trie.match(tokens, self.max_match, exclude)
        if length == 0:
            return [], 0.0, None
        verify = self.sizing_cost()
        if verify is None:
            cap = min(budget, max(1, int(self.spec_factor * length)))
            return *trie.speculate(node, cap, self.min_prob, exclude=exclude), None
        nodes, _ = trie.speculate(node, budget, self.min_prob, exclude=exclude)
        cond = [q / (nodes[parent][2] if parent >= 0 else 1.0) for _, parent, q in nodes]
        trie_nodes = Trie(cond, [parent for _, parent, _ in nodes], self.calibration[source][match_bucket(length)],
                          (source, match_bucket(length)))
        cut = self.sizer.size(trie_nodes, None, verify)
        return [(nodes[i][0], parent, q) for i, parent, q in zip(cut.nodes, cut.parents, cut.probs)], cut.rate, cut

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        self._sync(tokens)
        self._steps += 1
        tree = TokenTree()
        self._last = None
        if budget < 1:
            return tree
        none: tuple[list, float, None] = ([], 0.0, None)
        local = self._candidate(self.local, tokens, budget, "suffix-local") if self.use_local else none
        glob = none
        if self.memory is not None and self.memory.tokens:
            hit = self._memory_hit  # (memory_match's at this text and this memory: not matched twice)
            found = hit[2:] if hit is not None and hit[:2] == (len(tokens), self.memory.version) else None
            glob = self._candidate(self.memory.trie, tokens, budget, "suffix-global", found=found)
        (nodes, _, learn), source = (glob, "suffix-global") if glob[1] > local[1] else (local, "suffix-local")
        if not nodes and (glob[0] or local[0]):  # two cuts worth nothing: the one with a try beyond it
            (nodes, _, learn), source = (glob, "suffix-global") if glob[0] else (local, "suffix-local")
        if not nodes:
            return tree
        self._last = learn
        if source == "suffix-global":
            self._global_drafts += 1
        else:
            self._local_drafts += 1
        for token, parent, _ in nodes:
            tree.add(token, parent, sampled=False, source=source)
        self._nodes += len(tree)
        return tree

    def observe(self, tokens, tree, verdict, logits, hidden=None) -> None:
        self._tokens = tokens
        if self._last is None:
            return
        cut, self._last = self._last, None  # tree node i is the sized tree's node i
        self.sizer.learn(cut, tree, verdict.accepted)

    def end(self) -> None:
        if self.memory is None:
            return
        start = 0 if self.remember_prompts else self._prompt_len
        self.memory.add(self._tokens[start:])

    def stats(self) -> dict[str, Any]:
        return {"suffix_global_drafts": self._global_drafts, "suffix_local_drafts": self._local_drafts,
                "suffix_memory_tokens": self.memory.tokens if self.memory is not None else 0,
                "draft_nodes": self._nodes}
