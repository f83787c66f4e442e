"""Automatic prefix caching, exact: prompts that share a prefix reuse its keys and values.

Requests that start alike (a system prompt, the earlier turns of a chat, a few-shot preamble)
need not recompute the KV of what they share.  vLLM's automatic prefix caching ("Efficient
Memory Management for Large Language Model Serving with PagedAttention", Kwon et al., 2023)
keys KV blocks by a hash of all tokens up to the block's end; SGLang's RadixAttention ("SGLang:
Efficient Execution of Structured Language Model Programs", Zheng et al., 2024) keeps them in
a radix tree.  leapdecode keys its blocks the vLLM way, with one twist that keeps it exact.

A reused block must hold the same bits that the request would have computed itself, or the
output could change.  A token's keys and values depend on how its prefill was cut into
forwards (a 300-token prefill computes them in other kernels' blocks than a 100-token one), so
``Generation`` always prefills in chunks aligned to position 0 (``PREFILL_CHUNK`` tokens; the
last one shorter), whatever the scheduler runs beside it.  A whole chunk's KV is then a
function of the tokens up to its end only, and that is exactly what the key hashes: a request
that finds its first j chunks here copies them into its cache and computes the rest as it
would have anyway.  Greedy output with a hit is bitwise the output without (tested).

Short prompts get finer blocks where that stays exact: 16-token blocks on a cut-invariant model,
and a generation's output blocks too where the model prefills cut-invariantly (SGLang's multi-turn
reuse, exactly).  Which keys a sequence uses is the runner's block manager's business
(``core/kv_blocks.py``); this module is the store the keys point into.  Least recently used out past
``max_bytes``.  One store per runner (one target model).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..models.kv_cache import KVCache

DEFAULT_BYTES = 512 * 2**20


class PrefixCache:
    """Blocks of keys and values under the block manager's keys (``core/kv_blocks.py``: a hash of
    every token up to the block's end), least recently used out past ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prefix cache size must be an integer >= 0 bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0  # chunk lookups answered from here
        self.misses = 0  # chunk lookups computed by the request
        self.reused_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def restore(self, key: bytes, cache: "KVCache") -> bool:
        """Append the block ``key`` to ``cache``'s committed tokens if it is here."""
        if not self.enabled:
            return False
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                self.misses += 1
                return False
            self._blocks.move_to_end(key)
            self.hits += 1
            self.reused_tokens += block[0].shape[3]
        cache.append_committed(*block)
        return True

    def store(self, key: bytes, cache: "KVCache", end: int, length: int) -> None:
        """Keep committed slots ``[end - length, end)`` of ``cache`` as the block ``key``."""
        if not self.enabled or key in self._blocks:
            return
        k, v = cache.committed_slice(end - length, end)
        size = k.numel() * k.element_size() * 2
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._blocks:  # stored meanwhile by another thread
                return
            self._blocks[key] = (k, v)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (k0, v0) = self._blocks.popitem(last=False)
                self._bytes -= k0.numel() * k0.element_size() * 2

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    def stats(self) -> dict[str, float]:
        lookups = self.hits + self.misses
        return {"blocks": len(self._blocks), "bytes": self._bytes, "hits": self.hits, "misses": self.misses,
                "hit_rate": round(self.hits / lookups, 4) if lookups else 0.0, "reused_tokens": self.reused_tokens}
