"""The model runner: one per loaded target, owner of every piece of decoding state.

In the spirit of gpt-fast's ``setup_caches`` and vLLM's model runner, the runner owns

* the KV caches: one per generation in flight (so two interleaved streams on one model never
  share a cache), reused across generations, for the target and for any draft model;
* the measured verification cost of the target (per tree size), probed once per process
  (or read from the profile store, ``core/cost_model.py``);
* the draft models a method may use: loaded by the caller that builds the proposer (the API
  or the server at start-up), never by a proposer; a runner can refuse to load more
  (``allow_draft_loading=False``: the server loads its drafts at start-up only);
* the prefix cache and its block manager: the KV of prompt chunks and blocks, reused by later
  prompts that start alike (``core/prefix_cache.py``, ``core/kv_blocks.py``; exact);
* a bounded proposer memory: what methods learn across generations on this target (bandit
  statistics, acceptance calibration, n-gram pools, datastores), least recently used first out,
  within a count and (a server's) byte budget; a generation reads and feeds the part of it its
  request's ``memory_scope`` names (a server's tenant), so one tenant's text never steers another's
  drafts.

Models hold weights only.  ``runner_for(model)`` gives the runner of a ``LoadedModel``
(created on first use); a caller that wants isolated state builds a ``ModelRunner`` itself.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..errors import InvalidParameterError
from .kv_blocks import KVBlockManager
from .prefix_cache import DEFAULT_BYTES as DEFAULT_PREFIX_BYTES
from .prefix_cache import PrefixCache

if TYPE_CHECKING:
    from ..models.kv_cache import KVCache
    from ..models.loader import LoadedModel
    from .batch_cost import BatchCost
    from .cost_model import VerifyCost

T = TypeVar("T")

CACHE_ROUND = 256  # cache lengths are rounded up to this, so a slightly longer request reuses a cache
IDLE_CACHES = 2  # idle caches kept per model for reuse


UNSIZED_BYTES = 1024  # what an entry of unknown size is counted as (a statistic, a small table)


def entry_bytes(value: Any, _depth: int = 0) -> int:
    """About how many bytes a memory entry holds: its ``nbytes`` (a method or attribute: a suffix
    memory, an adjacency matrix, a tensor or array), a module's parameters and buffers, the sum over
    a tuple, list or dict's items, else ``UNSIZED_BYTES``.  Weights shared with the target (a view
    of its head) are counted as if they were copies: the budget errs on the safe side."""
    nbytes = getattr(value, "nbytes", None)
    if nbytes is not None and not isinstance(value, type):
        return int(nbytes() if callable(nbytes) else nbytes)
    if hasattr(value, "parameters") and hasattr(value, "buffers"):  # a torch module
        return sum(t.nelement() * t.element_size() for t in (*value.parameters(), *value.buffers()))
    if _depth < 3 and isinstance(value, (tuple, list)):
        return sum(entry_bytes(v, _depth + 1) for v in value[:4096]) + 8 * len(value)
    if _depth < 3 and isinstance(value, dict):
        return sum(entry_bytes(v, _depth + 1) for v in list(value.values())[:4096]) + 16 * len(value)
    return UNSIZED_BYTES


class ProposerMemory:
    """A bounded mapping from a key (a proposer's: ``core/proposer.py``'s ``MemoryKey``) to what a method keeps
    across generations, least recently used first out: past ``max_entries`` entries, and past
    ``max_bytes`` bytes (``entry_bytes``; None: no byte bound) once an entry is added or a
    generation that may have grown one ends (``settle``).  An entry that can shed its oldest content
    (``shrink(nbytes)``: a suffix memory forgets its oldest documents) sheds it before it is
    dropped whole.  A generation keeps using an entry dropped under it; the runner forgets it."""

    def __init__(self, max_entries: int = 64, max_bytes: int | None = None) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.evictions = 0  # entries dropped or shrunk to stay within the bounds
        self._entries: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any, factory: Callable[[], T]) -> T:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        value = factory()  # outside the lock: a factory may be slow (loading a datastore)
        with self._lock:
            value = self._entries.setdefault(key, value)
            self._entries.move_to_end(key)
            self._settle()
            return value

    def settle(self) -> None:
        """Drop (or shrink) the least recently used entries until the bounds hold again: after a
        generation ends, since entries grow as generations feed them."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.evictions += 1
        if self.max_bytes is None:
            return
        sizes = {k: entry_bytes(v) for k, v in self._entries.items()}
        excess = sum(sizes.values()) - self.max_bytes
        for key in list(self._entries):
            if excess <= 0:
                break
            value = self._entries[key]
            if hasattr(value, "shrink"):
                excess -= value.shrink(excess)
                sizes[key] = entry_bytes(value)
                if excess <= 0:
                    self.evictions += 1
                    break
            del self._entries[key]
            excess -= sizes[key]
            self.evictions += 1

    @property
    def nbytes(self) -> int:
        """The bytes the entries hold now (``entry_bytes``)."""
        with self._lock:
            return sum(entry_bytes(v) for v in self._entries.values())

    def __contains__(self, key: Any) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def snapshot(self) -> dict[Any, Any]:
        """The state of every entry that remembers content (it has ``snapshot``/``restore``: a
        suffix memory, an adjacency matrix); statistics (bandits, acceptance rates) are not kept."""
        with self._lock:
            return {k: v.snapshot() for k, v in self._entries.items() if hasattr(v, "restore")}

    def restore(self, snap: dict[Any, Any]) -> None:
        """Put the content memories back as ``snap`` found them; one created since is emptied
        by dropping it."""
        with self._lock:
            for k in [k for k, v in self._entries.items() if hasattr(v, "restore") and k not in snap]:
                del self._entries[k]
            for k, state in snap.items():
                if k in self._entries:
                    self._entries[k].restore(state)


def slot_len(model: "LoadedModel", max_len: int) -> int:
    """The length of the cache ``acquire_cache`` hands out for ``max_len`` tokens."""
    return min(-(-max_len // CACHE_ROUND) * CACHE_ROUND, model.max_seq_len)


class ModelRunner:
    """Decoding state for one loaded target; see the module docstring."""

    def __init__(self, model: "LoadedModel", memory_entries: int = 64, allow_draft_loading: bool = True,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_BYTES, weak_model: bool = False,
                 memory_bytes: int | None = None) -> None:
        # ``weak_model`` (``runner_for``'s runners): the runner does not keep its model alive, so a
        # model the user drops is collected with its runner and caches (a strong reference here, as
        # the value of ``_RUNNERS``' weak key, kept every model ever used resident)
        self._model = None if weak_model else model
        self._model_ref = weakref.ref(model) if weak_model else None
        self.blocks = KVBlockManager(PrefixCache(prefix_cache_bytes))  # block keys over the prefix cache
        self.memory = ProposerMemory(memory_entries, memory_bytes)  # memory_bytes: a server's budget
        self.allow_draft_loading = allow_draft_loading
        self._drafts: dict[str, "LoadedModel"] = {}
        self._idle: dict[tuple[int, str], list["KVCache"]] = {}  # (id(decoder), kind) -> free caches
        self._busy: dict[int, tuple[int, str]] = {}  # id(cache) -> (id(decoder), kind)
        self._verify_cost: "VerifyCost | None" = None
        self._verify_cost_at = 0.0  # time.monotonic() when _verify_cost was obtained
        self._batch_cost: "BatchCost | None" = None
        self._lock = threading.Lock()

    @property
    def model(self) -> "LoadedModel":
        if self._model is not None:
            return self._model
        model = self._model_ref()
        if model is None:
            raise ReferenceError("this runner's model was garbage-collected")
        return model

    @property
    def prefix_cache(self) -> PrefixCache:
        """The store of the block manager's KV blocks."""
        return self.blocks.store

    @prefix_cache.setter
    def prefix_cache(self, store: PrefixCache) -> None:
        self.blocks.store = store

    def __repr__(self) -> str:
        return f"ModelRunner({self.model.name!r}, drafts={sorted(self._drafts)}, busy_caches={len(self._busy)})"

    # ----------------------------------------------------------------- caches
    def acquire_cache(self, model: "LoadedModel", max_len: int, kind: str = "plain") -> "KVCache":
        """An empty cache for ``model`` (the target or a draft) with room for ``max_len`` tokens
        (capped at the model's context), for the caller's use until ``release_cache``.  ``kind``:
        ``"plain"``, or ``"int8"`` (an int8 KV-cache policy; native backend): idle caches are
        reused only by a request for the same kind."""
        decoder = model.model
        want = slot_len(model, max_len)
        pool = (id(decoder), kind)
        with self._lock:
            idle = self._idle.setdefault(pool, [])
            cache = next((c for c in idle if c.max_len >= want), None)
            if cache is not None:
                idle.remove(cache)
            elif idle and len(idle) >= IDLE_CACHES:
                idle.pop(0)  # too small for this request: free one before allocating
        if cache is None:
            if kind == "plain":
                cache = decoder.new_cache(batch_size=1, max_len=want)
            else:
                cache = decoder.new_cache(batch_size=1, max_len=want, kind=kind)
        cache.reset()
        with self._lock:
            self._busy[id(cache)] = pool
        return cache

    def release_cache(self, cache: "KVCache") -> None:
        with self._lock:
            owner = self._busy.pop(id(cache), None)
            if owner is None:
                return
            cache.reset()
            idle = self._idle.setdefault(owner, [])
            idle.append(cache)
            while len(idle) > IDLE_CACHES:
                idle.pop(0)

    @property
    def caches_in_use(self) -> int:
        return len(self._busy)

    # ---------------------------------------------------------- verify cost
    def verify_cost(self, cache: "KVCache") -> "VerifyCost":
        """The target's verification cost per tree size, measured once (on ``cache``, which must
        have nothing pending; the probe's nodes are rolled back) or read from the profile store.
        A profile measured while other processes held the cores is kept for
        ``CONTENDED_MAX_AGE_S`` only, in the process as in the store: a long-lived server then
        measures again instead of sizing trees from it for its whole life."""
        from .cost_model import CONTENDED_MAX_AGE_S, verify_cost_for

        cost = self._verify_cost
        if cost is None or (cost.contended and time.monotonic() - self._verify_cost_at > CONTENDED_MAX_AGE_S):
            self._verify_cost = verify_cost_for(self.model, cache)
            self._verify_cost_at = time.monotonic()
        return self._verify_cost

    def batch_cost(self, cache: "KVCache") -> "BatchCost":
        """The target's batched-forward cost (``batch_cost.BatchCost``), measured online by the
        batched scheduler; created on first use with the verification profile as its prior
        (``cache``: as for ``verify_cost``)."""
        from .batch_cost import BatchCost

        if self._batch_cost is None:
            self._batch_cost = BatchCost(self.verify_cost(cache))
        return self._batch_cost

    # ----------------------------------------------------------------- drafts
    def add_draft(self, name: str, draft: "LoadedModel") -> None:
        self._drafts[name] = draft

    @property
    def drafts(self) -> dict[str, "LoadedModel"]:
        return dict(self._drafts)

    def draft(self, name: str | None = None) -> "LoadedModel":
        """The draft model ``name`` (default: the target's registered pair), loaded on first use
        in the target's weight format (or dtype) and on its device (``loader.load_draft``), unless
        this runner only serves drafts loaded up front."""
        from ..models.loader import load_draft

        if name is None:
            name = self.model.draft_name
            if name is None:
                raise InvalidParameterError(
                    f"method needs a draft model: {self.model.name} has no registered draft; pass one "
                    "(--draft NAME, or the option draft=NAME)")
        if not isinstance(name, str):
            raise InvalidParameterError(f"draft must be a model name or path (a string), got {name!r}")
        if name not in self._drafts:
            if not self.allow_draft_loading:
                loaded = ", ".join(sorted(self._drafts)) or "none"
                raise InvalidParameterError(f"draft model {name!r} is not loaded here (loaded: {loaded})")
            self._drafts[name] = load_draft(name, self.model)
        return self._drafts[name]


_RUNNERS: "weakref.WeakKeyDictionary[LoadedModel, ModelRunner]" = weakref.WeakKeyDictionary()
_RUNNERS_LOCK = threading.Lock()


def runner_for(model: "LoadedModel | ModelRunner") -> ModelRunner:
    """The runner of a loaded model (one per model object, created on first use); a runner is
    returned as it is."""
    if isinstance(model, ModelRunner):
        return model
    with _RUNNERS_LOCK:
        runner = _RUNNERS.get(model)
        if runner is None:
            runner = _RUNNERS[model] = ModelRunner(model, weak_model=True)
        return runner
