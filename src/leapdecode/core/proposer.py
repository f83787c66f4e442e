"""What a proposer is: a leaf that proposes a token tree and learns from the verdict.

Proposers never decide what is emitted; the verifier does.  Any proposer is therefore
lossless through the verifier, and a buggy proposer can only make decoding slower.

A proposer gets everything it may use through its ``DecodeContext``: the target, the
target's KV cache for this generation (self-speculative methods use its pending area as
scratch and roll it back: the loop checks that nothing is left pending after ``propose``),
caches for its own models (``ctx.acquire_cache``), the measured verification cost, and the
runner's bounded memory for what it learns across generations (``ctx.memory``).  It never
loads a model, patches the target or times the target inside ``propose``.

This is the interface the generation loop (``core/generate.py``) calls; the drafting
methods themselves live in ``leapdecode.proposers``, one file each.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from .sampling import SamplingParams, position_uniform
from .tree import TokenTree

if TYPE_CHECKING:
    from ..models.kv_cache import KVCache
    from ..models.loader import LoadedModel
    from .cost_model import VerifyCost
    from .runner import ModelRunner
    from .verifier import Verdict

T = TypeVar("T")


class Identity:
    """The object a learned entry is about (a model, heads, a datastore), compared and hashed by
    identity and held weakly: while it lives nothing else is equal to it, and once it is freed an
    object that takes its address is another key (a bare ``id()`` in a key could name either)."""

    __slots__ = ("_ref", "_id")

    def __init__(self, obj: Any) -> None:
        self._ref, self._id = weakref.ref(obj), id(obj)

    def __hash__(self) -> int:
        return self._id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Identity) or other._id != self._id:
            return False
        obj = self._ref()
        return obj is not None and obj is other._ref()

    def __repr__(self) -> str:
        return f"Identity({type(self._ref()).__name__} at {self._id:#x})"


@dataclass(frozen=True)
class MemoryKey:
    """The key of what a method learns across generations in the runner's memory
    (``DecodeContext.remember``): the ``method``, ``what`` it learns, the ``options`` the entry
    depends on, the object it was learned about (``of``, by identity) and the memory scope it
    belongs to (set by ``remember``; None: the process's one part, or a shared entry)."""

    method: str
    what: str
    options: tuple = ()
    of: Identity | None = None
    scope: str | None = None


@dataclass
class DecodeContext:
    """What a proposer may look at during one generation."""

    runner: "ModelRunner"
    cache: "KVCache"  # the target's cache for this generation (self-speculation shares it)
    params: SamplingParams
    generator: torch.Generator
    prompt_len: int
    max_new_tokens: int
    verify_cost: "VerifyCost | None" = None  # set before ``begin`` by the step planner's gate (cost-aware, greedy)
    # whose part of the runner's memory this generation reads and feeds (a server's tenant; None:
    # the process's one part): what one scope learns never steers another's drafts
    memory_scope: str | None = None
    _acquired: list = field(default_factory=list, repr=False)

    @property
    def target(self) -> "LoadedModel":
        return self.runner.model

    @property
    def drafter_invariant(self) -> bool:
        """Seeded sampling: the verifier draws each position's token with that position's own
        uniform number (``core/verifier.py``), so the text does not depend on the trees."""
        return self.params.seed is not None and not self.params.greedy

    def uniform(self, position: int) -> float | None:
        """For a drafter-invariant generation, the uniform number the target's token at sequence
        ``position`` (0 = the prompt's first token) is drawn with; a drafter that samples draws its
        own token there with the same number (``sampling.sample_at``) to be accepted more often.
        None otherwise."""
        return position_uniform(self.params.seed, position) if self.drafter_invariant else None

    def remember(self, key: MemoryKey, factory: Callable[[], T], shared: bool = False) -> T:
        """The runner's memory entry ``key`` (created by ``factory`` on first use): what a method
        learns across generations on this target (bandit statistics, calibration, n-gram pools), in
        this generation's ``memory_scope``.  ``shared``: a copy derived from weights alone (a head's
        quantized copy), the same for every scope and so kept once."""
        if not shared and self.memory_scope is not None:
            key = dataclasses.replace(key, scope=self.memory_scope)
        return self.runner.memory.get(key, factory)

    def acquire_cache(self, model: "LoadedModel", max_len: int) -> "KVCache":
        """A KV cache for one of the proposer's own models (a draft), empty, with room for at least
        ``max_len`` tokens; the runner takes it back when the generation ends."""
        cache = self.runner.acquire_cache(model, max_len)
        self._acquired.append(cache)
        return cache

    def release_all(self) -> None:
        for cache in self._acquired:
            self.runner.release_cache(cache)
        self._acquired.clear()


class Proposer:
    """Base class; subclasses implement ``propose`` and may override the hooks.

    ``default_budget``: the tree size the method drafts when the user sets no ``tree_budget``.
    """

    name = "base"
    # may size its greedy trees by the measured verification cost (a method sets it from its config's
    # ``cost_aware``, ``draft`` from ``adaptive``); the step planner decides whether it does
    cost_aware = False

    def __init__(self, default_budget: int) -> None:
        if not isinstance(default_budget, int) or default_budget < 1:
            raise ValueError(f"{type(self).__name__}: default_budget must be an integer >= 1")
        self.default_budget = default_budget

    def sizing_cost(self) -> "VerifyCost | None":
        """The verification cost this generation's trees are sized by: the one the step planner
        measured for this generation (``StepPlanner.begin``: the gate, cost-aware sizing under greedy
        decoding) where this proposer is ``cost_aware``; None (draft without costs) otherwise, and
        before any ``begin``."""
        ctx = getattr(self, "ctx", None)
        return ctx.verify_cost if ctx is not None and self.cost_aware else None

    def begin(self, ctx: DecodeContext, tokens: list[int]) -> None:
        """A generation starts; ``tokens`` is the prompt (its last token is the root)."""
        self.ctx = ctx

    def propose(self, tokens: list[int], budget: int) -> TokenTree:
        """Draft continuations of ``tokens`` (whose last token is the root), at most ``budget`` nodes."""
        raise NotImplementedError

    def catchup_seconds(self) -> float:
        """Of the last ``propose``, the seconds spent catching up on text it did not draft: the prompt,
        and steps another drafter made (``auto``'s arms).  ``auto`` charges them to no arm: they are
        paid once whichever arm runs next, not per step of this one."""
        return 0.0

    def prompt_features(self) -> int:
        """How many of the prompt's last tokens (before the root) the proposer wants the per-layer
        hidden states of, from the prefill's own forwards (``observe_prompt``); 0: none.  Chunks the
        prefix cache restores (or a prompt copied from another generation) are not recomputed, so a
        proposer must cope with fewer, or none."""
        return 0

    def observe_prompt(self, start: int, hidden: list[torch.Tensor]) -> None:
        """During the prefill, before ``begin``: the residual stream after the embedding and after
        each layer (``[1, T, hidden]`` each) of prompt positions ``start .. start + T - 1``."""

    def wants_hidden(self) -> bool:
        """Asked after ``propose``: should the verification forward hand its per-layer hidden
        states to ``observe`` (``hidden``)?"""
        return False

    def observe(self, tokens: list[int], tree: TokenTree, verdict: "Verdict", logits: torch.Tensor,
                hidden: list[torch.Tensor] | None = None) -> None:
        """After verification: ``tokens`` now includes the emitted tokens; ``logits`` are the target's
        (row 0 = root, row i + 1 = node i); ``hidden``: the residual stream after the embedding and
        after each layer (``[1, T, hidden]`` each) when ``wants_hidden()`` said so."""

    def end(self) -> None:
        """The generation finished (or was cancelled)."""

    def stats(self) -> dict[str, Any]:
        return {}


def feed_committed(model: "LoadedModel", cache: "KVCache", new: list[int], want_logits: bool = True,
                   chunk: int = 512, head=None) -> tuple[torch.Tensor | None, int]:
    """Run ``new`` tokens through ``model`` and commit them to ``cache``, in chunks that fit the
    cache's pending area (a prefill).  Returns (logits of the last token or None, number of
    forwards).  ``head``: see ``NativeCausalLM.forward``."""
    step = min(chunk, cache.max_pending)  # a chunk is pending until committed
    logits, forwards = None, 0
    for s in range(0, len(new), step):
        last = s + step >= len(new)
        ids = torch.tensor(new[s : s + step], device=model.device)[None]
        kwargs = {"head": head} if head is not None else {}
        out = model.model.forward(ids, cache, logits_for=slice(-1, None) if (last and want_logits) else slice(0, 0),
                                  **kwargs)
        cache.commit()
        forwards += 1
        if last and want_logits:
            logits = out[0, -1]
    return logits, forwards
