"""What the beam-search family shares: hypotheses as nodes of one token tree in one KV cache,
a search's life cycle (prefill, rounds, result), and the result types.

**One cache, one tree.**  The prompt is prefilled once (in the same position-0-aligned chunks as
``Generation``, through the runner's prefix cache), so every hypothesis shares its keys and
values.  A hypothesis is a node of the cache's *pending tree* (``models/kv_cache.py``): the node
holds its last token, its parent is the hypothesis it extends, and tree attention lets it see the
prompt and its own ancestors only.  Extending several hypotheses is one forward
(``TreeKV.expand``): each new node names its parent, whatever branch it is on, and the forward
returns one row of logits per node.  A fork costs one node, never a copy of a prefix.

``TreeKV.retain(live)`` then keeps the nodes some live hypothesis still needs (the live ones and
their ancestors) and drops the rest (``KVCache.prune_pending``: the kept nodes move down, their
parents renumbered), and commits the prefix that all live hypotheses share: the pending region
holds the branching part of the tree only.  Nodes are named by ids that survive this
renumbering.

**A search** (``TreeSearch``) is stepped like a ``Generation``: the first ``step()`` prefills the
prompt and runs its last token (the root, whose logits give the first expansion), each later
``step()`` runs one round of the strategy (at most one forward), until the strategy is done;
``result`` is then a ``SearchResult``: a ``GenerationResult`` for the best hypothesis (its text,
its tokens without a final end-of-sequence token) with ``hypotheses``, the n best, each with its
token ids, text and scores.  The runner hands out the cache and takes it back at the end; a
search keeps its state on itself, never on the model.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable

import torch

from ..core.batch import run_forwards
from ..core.config import OptionsConfig
from ..core.generate import GenerationResult
from ..core.prefill import PrefillPlanner
from ..core.runner import slot_len
from ..core.task import Forward, Status, StepOutput, Task, drive
from ..errors import InvalidParameterError, PromptTooLongError
from ..models.native import rms_norm

if TYPE_CHECKING:
    from ..core.runner import ModelRunner

MAX_TREE_NODES = 4096  # most pending nodes a search's tree may hold (the cache's ancestor table is its square)


@dataclass(frozen=True, kw_only=True)
class StrategyConfig(OptionsConfig):
    """Base of every strategy's config: ``option()`` fields (``core/config.py``), checked when built."""

    kind: ClassVar[str] = "strategy"
    strategy: ClassVar[str] = "base"
    stochastic: ClassVar[bool] = False  # draws random numbers (uses the seed and the temperature)
    # runs N sampled generations (strategies/parallel.py): takes any method, the sampling filters and
    # stop strings, as a plain generation does
    parallel: ClassVar[bool] = False

    @classmethod
    def config_name(cls) -> str:
        return cls.strategy

    @property
    def width(self) -> int:
        """Hypotheses alive at once (sizes the tree in the cache)."""
        return getattr(self, "num_beams", 1)

    @property
    def returns(self) -> int:
        """How many hypotheses the result holds (at most)."""
        n = getattr(self, "num_return_sequences", None)
        return self.width if n is None else n

    def pending_nodes(self, max_new_tokens: int) -> int:
        """Pending tree nodes a search may need at once (default: every live hypothesis's unshared tail)."""
        return self.width * (max_new_tokens + 1) + 1


@dataclass
class Hypothesis:
    """One finished hypothesis.  ``tokens``: the generated ids the scores cover, a final
    end-of-sequence token included when it ended on one (``finish_reason`` ``"stop"``; ``"length"``:
    cut at ``max_new_tokens``); ``text``: those tokens decoded, the end-of-sequence token left out;
    ``score``: what the strategy ranks by (see its module); ``logprob``: the sum of the model's
    log-probabilities of ``tokens`` (at the sampling temperature for the stochastic strategies);
    ``info``: strategy-specific values (a Gumbel key, an inclusion probability)."""

    tokens: list[int]
    text: str
    score: float
    logprob: float
    finish_reason: str
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "text": self.text, "score": self.score, "logprob": self.logprob,
                "finish_reason": self.finish_reason, **self.info}


@dataclass
class SearchResult(GenerationResult):
    """A ``GenerationResult`` for the best hypothesis, with all the returned ones, best first."""

    hypotheses: list[Hypothesis] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "hypotheses": [h.to_dict() for h in self.hypotheses]}

    def as_results(self, n: int) -> list[GenerationResult]:
        """``n`` plain results, one per hypothesis, best first (a server's ``n`` choices): each its
        text, its tokens without a final end-of-sequence token, and its finish reason; the first
        carries the search's statistics, every one its ``score`` and ``logprob``.  A search that
        returned fewer than ``n`` (cancelled, or fewer hypotheses exist) pads with empty results
        of its own finish reason."""
        out = []
        for j in range(n):
            if j < len(self.hypotheses):
                h = self.hypotheses[j]
                # a stop string (test-time scaling's samples) ends a hypothesis with no end-of-sequence token
                eos_end = h.finish_reason == "stop" and not h.info.get("stop_string")
                tokens = h.tokens[:-1] if eos_end else list(h.tokens)
                stats = dict(self.stats) if j == 0 else {"strategy": self.stats.get("strategy")}
                stats.update(new_tokens=len(tokens), score=h.score, logprob=h.logprob)
                out.append(GenerationResult(h.text, tokens, self.prompt_tokens, h.finish_reason, stats))
            else:
                out.append(GenerationResult("", [], self.prompt_tokens, self.finish_reason,
                                            dict(self.stats) if j == 0 else {}))
        return out


ROOT = 0  # the id of the prompt's last token: the hypothesis with nothing generated


def search_cache_tokens(model: Any, cfg: StrategyConfig, prompt_len: int, max_new_tokens: int) -> int:
    """The most cache slots a search of ``cfg`` holds (the prompt, the longest hypothesis, and the
    tree of pending hypotheses), capped at the model's context: what ``TreeKV`` asks the runner for."""
    max_new_tokens = min(max_new_tokens, max(model.max_seq_len - prompt_len, 1))
    nodes = max(1, min(tree_nodes_for(cfg, max_new_tokens), MAX_TREE_NODES))
    return min(prompt_len + max_new_tokens + nodes, model.max_seq_len)


def tree_nodes_for(cfg: StrategyConfig, max_new_tokens: int) -> int:
    """Pending nodes a search may need at once (``cfg.pending_nodes``)."""
    return cfg.pending_nodes(max_new_tokens)


class TreeKV:
    """Hypotheses as nodes of the pending tree of one KV cache from ``runner``; see the module
    docstring.  ``max_nodes``: the most pending nodes the tree may hold at once."""

    def __init__(self, runner: "ModelRunner", prompt_ids: list[int], max_new_tokens: int, max_nodes: int,
                 model: Any = None) -> None:
        # ``model``: another LoadedModel than the runner's target (contrastive decoding's amateur):
        # its cache comes from the same runner, and it never touches the target's prefix cache
        model = runner.model if model is None else model
        self.runner, self.decoder = runner, model.model
        self.use_prefix = model is runner.model  # the runner's prefix cache holds the target's blocks only
        self.prompt_ids = list(prompt_ids)
        self.max_nodes = max(1, min(max_nodes, MAX_TREE_NODES))
        want = len(prompt_ids) + max_new_tokens + self.max_nodes
        self.cache = runner.acquire_cache(model, min(want, model.max_seq_len))
        self.cache.reserve_pending(self.max_nodes)
        self.end = ROOT  # the id of the last committed node
        self._parent: dict[int, int] = {}  # pending id -> parent id
        self._slot: dict[int, int] = {}  # pending id -> its pending index
        self._next = ROOT + 1
        self.forwards = 0
        self.nodes = 0  # nodes appended by expansions
        self.moved = 0  # nodes whose keys and values moved (retain)
        self.reused = 0  # prompt tokens restored from the prefix cache

    # ---------------------------------------------------------------- prompt
    def prefill(self, on_hidden: Callable[[list], None] | None = None, whole_prompt: bool = True) -> torch.Tensor:
        """Prefill the prompt (all but its last token, in chunks through the prefix cache) and run its
        last token; returns that token's logits (``[vocab]``, fp32).  ``on_hidden`` is called with
        each forward's ``hidden_states`` list (see ``Decoder.forward``), in order: every prompt
        forward's (``whole_prompt``; the prefix cache is then not read, a restored chunk has no hidden
        states), or the last token's only."""
        ids, cache = self.prompt_ids, self.cache
        every = on_hidden is not None and whole_prompt
        # the prompt cut and keyed as a Generation cuts and keys it (core/prefill.py); with ``every``
        # each chunk is computed (a restored one has no hidden states), and still kept
        planner = PrefillPlanner(self.runner, cache, ids, decoder=self.decoder, use_prefix=self.use_prefix,
                                 restore=not every)
        while (chunk := planner.next_forward(0)) is not None:
            states: list | None = [] if every else None
            self.decoder.forward(chunk.tokens[None], cache, logits_for=slice(0, 0), hidden_states=states)
            if every:
                on_hidden(states)
            cache.commit()
            planner.computed(chunk)
        self.reused += planner.reused
        states = [] if on_hidden is not None else None
        logits = self.decoder.forward(torch.tensor([[ids[-1]]], device=self.decoder.device), cache,
                                      hidden_states=states)
        if on_hidden is not None:
            on_hidden(states)
        cache.commit()
        self.forwards += 1
        return logits[0, -1]

    # ---------------------------------------------------------------- tree
    def expand_co(self, parents: list[int], tokens: list[int], hidden: list | None = None):
        """``expand`` as a coroutine: ``ids, logits = yield from tree.expand_co(...)`` yields the
        forward (a ``Forward`` on this tree's cache) to whoever drives the search, which sends its
        logits (``[1, n, vocab]``) back: so a scheduler can run it in a batch with other tasks'."""
        cache = self.cache
        if len(parents) != len(tokens) or not tokens:
            raise ValueError(f"{len(parents)} parents for {len(tokens)} tokens")
        if cache.n_pending + len(tokens) > cache.max_pending or cache.room() < len(tokens):
            raise InvalidParameterError(
                f"the search tree outgrew its KV cache ({cache.n_pending} pending nodes + {len(tokens)} new; "
                f"{cache.room()} slots free): use fewer beams or fewer new tokens")
        slots = [-1 if p == self.end else self._slot[p] for p in parents]
        start = cache.n_pending
        forward = Forward(torch.tensor(tokens, device=self.decoder.device), slots, hidden=hidden, cache=cache,
                          all_logits=True, keep_pending=start, decoder=self.decoder)
        logits = yield forward
        ids = list(range(self._next, self._next + len(tokens)))
        self._next += len(tokens)
        for i, (nid, p) in enumerate(zip(ids, parents)):
            self._parent[nid] = p
            self._slot[nid] = start + i
        self.forwards += 1
        self.nodes += len(tokens)
        return ids, logits[0]

    def expand(self, parents: list[int], tokens: list[int],
               hidden: list | None = None) -> tuple[list[int], torch.Tensor]:
        """Append ``tokens[i]`` as a child of node ``parents[i]`` (an id: the committed end or a
        pending node), all in one forward; returns the new ids and their logits (``[n, vocab]``).
        ``hidden`` (a list) receives the forward's hidden states (``Decoder.forward``)."""
        return drive(self.expand_co(parents, tokens, hidden))

    @property
    def pending(self) -> int:
        return self.cache.n_pending

    @property
    def held(self) -> int:
        """Pending nodes the search knows (``pending`` counts every one in the cache: the same, unless
        a forward's nodes were left behind)."""
        return len(self._slot)

    def retain(self, live: Iterable[int]) -> None:
        """Keep the nodes ``live`` (ids; the committed end may be among them) and their ancestors,
        drop every other pending node, and commit the chain of nodes all of them descend from."""
        chains = []
        keep: set[int] = set()
        for nid in set(live):
            chain = []
            while nid != self.end:
                if nid not in self._slot:
                    raise ValueError(f"node {nid} is neither pending nor the committed end")
                chain.append(nid)
                nid = self._parent[nid]
            chain.reverse()
            chains.append(chain)
            keep.update(chain)
        common = 0
        if chains:
            first = chains[0]
            while common < len(first) and all(len(c) > common and c[common] == first[common] for c in chains):
                common += 1
        if len(keep) == len(self._slot) and common == 0:
            return
        order = sorted(keep, key=self._slot.__getitem__)
        committed = chains[0][:common] if common else []
        # the committed chain comes first in slot order: each is an ancestor of every other kept node
        slots = [self._slot[i] for i in order]
        before = {i: self._slot[i] for i in order}
        mapping = self.cache.prune_pending(slots, commit=common)
        self.moved += sum(1 for j, i in enumerate(order) if before[i] != j)
        self._slot = {i: mapping[before[i]] for i in order if mapping[before[i]] >= 0}
        self._parent = {i: self._parent[i] for i in self._slot}
        if committed:
            self.end = committed[-1]

    def release(self) -> None:
        if self.cache is not None:
            self.runner.release_cache(self.cache)
            self.cache = None


def final_hidden(decoder: Any, states: list) -> torch.Tensor:
    """The last layer's output as the output head reads it (after the final norm), fp32
    ``[T, hidden]``, from one forward's ``hidden_states`` list (its batch row 0).  The native decoder
    lists the residual stream before the norm; the transformers backend lists transformers' hidden
    states, whose last one is already normed."""
    x = states[-1][0]
    if getattr(decoder, "backend", None) == "native":
        with torch.no_grad():
            x = rms_norm(x, decoder.norm, decoder.cfg.rms_norm_eps)
    return x.float()


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-softmax of ``logits`` (rows) at ``temperature``."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


class TreeSearch(Task):
    """A search on a runner (see the module docstring).  Subclasses implement ``begin(logits)``
    (the root's logits: set up the first hypotheses), ``advance() -> bool`` (one round, True when
    the search is over; a round that expands the tree with ``yield from self.tree.expand_co(...)``
    makes ``advance`` a generator, whose forward a scheduler batches with other tasks' (at most one
    on the target per round); one that calls ``self.tree.expand`` runs its forward itself) and
    ``hypotheses() -> list[Hypothesis]`` (best first).  ``self.eos`` holds the model's end-of-sequence ids, ``self.generator`` a seeded CPU
    random generator."""

    # whose part of the runner's memory the generations of a search that runs a method's proposer use
    # (``parallel.py``; ``GenerationRequest.memory_scope``, set by ``api.start_request``)
    memory_scope: str | None = None
    # "all": ``prompt_states(states)`` is called with every prefill forward's ``hidden_states`` list, in
    # order, before ``begin`` (the prefix cache is then not read); "last": with the prompt's last
    # token's only; None: not called
    prompt_hidden: ClassVar[str | None] = None

    @classmethod
    def kv_tokens(cls, model: Any, prompt_len: int, max_new_tokens: int, *, strategy: Any = None,
                  kv_policy: Any = None) -> tuple[int, str]:
        """Its one cache (``Task.kv_tokens``): the prompt, the longest hypothesis and the pending tree."""
        return slot_len(model, search_cache_tokens(model, strategy, prompt_len, max_new_tokens)), "plain"

    def __init__(self, runner: "ModelRunner", prompt_ids: list[int], cfg: StrategyConfig, max_new_tokens: int,
                 temperature: float = 1.0, seed: int | None = None) -> None:
        model = runner.model
        if not prompt_ids:
            raise InvalidParameterError("the prompt is empty")
        if len(prompt_ids) + 1 > model.max_seq_len:
            raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; the context of {model.name} holds "
                                     f"{model.max_seq_len} (prompt + at least 1 new token)")
        self.runner, self.model, self.cfg = runner, model, cfg
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.eos = frozenset(model.eos_token_ids)
        self.tree: TreeKV | None = None
        self.result: SearchResult | None = None
        self.rounds = 0
        self._t0 = 0.0
        self._suspended: Generator | None = None  # a round waiting for its forward's logits

    # ------------------------------------------------------------ subclass API
    def tree_nodes(self) -> int:
        """Pending nodes the tree may need at once (default: every live hypothesis's unshared tail)."""
        return tree_nodes_for(self.cfg, self.max_new_tokens)

    def prompt_states(self, states: list) -> None:
        """One prefill forward's hidden states (see ``prompt_hidden``)."""

    def begin(self, logits: torch.Tensor) -> None:
        raise NotImplementedError

    def advance(self) -> bool:
        raise NotImplementedError

    def hypotheses(self) -> list[Hypothesis]:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def hypothesis(self, tokens: list[int], score: float, logprob: float, **info: Any) -> Hypothesis:
        """A finished hypothesis over ``tokens`` (decoded without a final end-of-sequence token)."""
        stop = bool(tokens) and tokens[-1] in self.eos
        shown = tokens[:-1] if stop else tokens
        return Hypothesis(list(tokens), self.model.tokenizer.decode(shown), float(score), float(logprob),
                          "stop" if stop else "length", info)

    # ------------------------------------------------------------ life cycle
    def step(self) -> StepOutput:
        """One round alone (the first one prefills the prompt); ``finished`` once the search is over."""
        out = self.next_forwards()
        if not isinstance(out, StepOutput):
            out = self.finish_forwards(out, run_forwards(self.model, out))
        return out

    # ------------------------------------------------------------ the task protocol (core/task.py)
    @property
    def cache(self) -> Any:
        return self.tree.cache if self.tree is not None else None

    @property
    def status(self) -> Status:
        if self.result is not None:
            return Status.FINISHED
        return Status.WAITING if not self._t0 else Status.DECODING  # (its prompt prefills inside its first step)

    def next_forwards(self, cap: int | None = None) -> "list[Forward] | StepOutput":
        """A round's first forward on the target (``advance`` suspended at its ``expand_co``), or a
        ``StepOutput`` when the round needed none: the first round prefills the prompt here, alone."""
        if self.result is not None:
            return self._output()
        try:
            if self._cancelled:
                self._finish("cancelled")
                return self._output()
            if not self._t0:  # the first step
                self._t0 = time.perf_counter()
                self._start()
                return self._output()
            self.rounds += 1
            return self._round_forwards()
        except BaseException:
            self.abort()
            raise

    def _start(self) -> None:
        """The first step: the random generator, the tree, the prompt's prefill and ``begin``."""
        self.generator = torch.Generator()
        self.generator.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        self.tree = TreeKV(self.runner, self.prompt_ids, self.max_new_tokens, self.tree_nodes())
        hook = self.prompt_states if self.prompt_hidden else None
        self.begin(self.tree.prefill(hook, whole_prompt=self.prompt_hidden == "all"))

    def _round_forwards(self) -> "list[Forward] | StepOutput":
        """A round's forwards: ``advance`` run up to its first ``expand_co`` (or to its end)."""
        rnd = self.advance()
        if not isinstance(rnd, Generator):  # a round that ran its forwards itself
            return self._round_over(rnd)
        self._suspended = rnd
        return self._resume(None)

    def finish_forwards(self, forwards: "list[Forward]", logits: "list[torch.Tensor]") -> StepOutput:
        try:
            out = self._resume(logits[0])
            while not isinstance(out, StepOutput):  # another forward in this round (another model's): alone
                out = self._resume(out[0].run())
            return out
        except BaseException:
            self.abort()
            raise

    def _resume(self, logits: torch.Tensor | None) -> "list[Forward] | StepOutput":
        try:
            forward = self._suspended.send(logits)
        except StopIteration as stop:
            self._suspended = None
            return self._round_over(stop.value)
        return [forward]

    def _round_over(self, over: bool) -> StepOutput:
        if over:
            self._finish("done")
        return self._output()

    def _output(self) -> StepOutput:
        if self.result is None:
            return StepOutput("", [], False)
        return StepOutput("", [], True, self.result.finish_reason)

    def choice_results(self, n: int) -> list[GenerationResult]:
        return self.result.as_results(n)

    def _drop_round(self) -> None:
        if self._suspended is not None:  # a round abandoned while it waited for its forward
            self._suspended.close()
            self._suspended = None

    def _finish(self, how: str) -> None:
        self._drop_round()
        hyps = self.hypotheses() if how == "done" else []
        hyps = hyps[: self.cfg.returns]
        tree = self.tree
        wall = time.perf_counter() - self._t0 if self._t0 else 0.0
        stats: dict[str, Any] = {"strategy": self.cfg.strategy, "method": "vanilla",
                                 "prompt_tokens": len(self.prompt_ids), "rounds": self.rounds,
                                 "target_forwards": tree.forwards if tree else 0,
                                 "tree_nodes": tree.nodes if tree else 0, "kv_moved": tree.moved if tree else 0,
                                 "prefix_reused": tree.reused if tree else 0, "wall_s": round(wall, 4)}
        stats.update(self.stats())
        if tree is not None:
            tree.release()
        self.release_more()
        if hyps:
            best = hyps[0]
            tokens = best.tokens[:-1] if best.finish_reason == "stop" else list(best.tokens)
            stats["new_tokens"] = len(tokens)
            stats["tokens_per_s"] = round(sum(len(h.tokens) for h in hyps) / wall, 3) if wall > 0 else 0.0
            self.result = SearchResult(best.text, tokens, len(self.prompt_ids), best.finish_reason, stats, hyps)
        else:
            stats["new_tokens"] = 0
            self.result = SearchResult("", [], len(self.prompt_ids), "cancelled" if how != "done" else "stop",
                                       stats, [])

    def abort(self) -> None:
        """Give the cache back after a failure (finish reason "error")."""
        self._drop_round()
        if self.tree is not None:
            self.tree.release()
        self.release_more()
        if self.result is None:
            self.result = SearchResult("", [], len(self.prompt_ids), "error", {"strategy": self.cfg.strategy}, [])

    def close(self) -> None:
        """Give the cache back now (a search abandoned before its end)."""
        if self.result is None:
            self._finish("cancelled")

    def release_more(self) -> None:
        """Give back any other cache the search holds (contrastive decoding's amateur tree)."""

    def __del__(self) -> None:
        try:
            if self.tree is not None and self.tree.cache is not None:
                self.tree.release()
            self.release_more()
        except Exception:
            pass
