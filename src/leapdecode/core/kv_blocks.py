"""The runner's KV block manager (issue 48 item 1): under which keys a sequence's keys and values
are kept in the prefix cache and found again.

The prefix cache (``core/prefix_cache.py``) is a store: blocks of keys and values under 16-byte
keys, least recently used out.  What a key means is decided here, once for every generation and
search on a runner (vLLM v1 likewise splits its KV-cache manager, which hashes blocks, from the
block pool that holds them).  A key hashes the key before it and the block's tokens, so it stands
for every token up to the block's end, and two schemes keep that exact:

* **whole chunks**: a prompt prefilled in chunks aligned to position 0 (``core/prefill.py``) keys
  each whole chunk; a chunk's keys and values are then a function of the tokens up to its end;
* **16-token blocks** (``BLOCK``) on a key chain of their own (``BLOCKS_KEY``), where the decoder
  computes a token's keys and values with the same bits however its prompt is cut
  (``keyed_in_blocks``): a short prompt on a cut-invariant model, or any prompt on a model that
  prefills cut-invariantly; there a generation keeps its output's blocks too when it ends
  (``BlockTable.keep_output``), so a chat's next turn restores the earlier turns and answers.

A ``BlockTable`` is one sequence's place on its chain: the key of what it covers so far and how
many tokens that is.  The prefill planner and the generation ask it to restore or keep blocks;
neither computes a key itself.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING, Any

from .prefix_cache import PrefixCache

if TYPE_CHECKING:
    from ..models.kv_cache import KVCache
    from .kv_policy import KVPolicy

BLOCK = 16  # tokens per block of a sequence keyed in blocks
BLOCKS_KEY = b"blocks of 16"  # what the chain of such blocks starts from (whole chunks' starts from b"")


def chain_key(previous: bytes, tokens: list[int]) -> bytes:
    """The key of ``tokens`` following the block keyed ``previous`` (``b""``: the first chunk)."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


def keyed_in_blocks(decoder: Any, store: PrefixCache, prompt_len: int, chunk: int) -> bool:
    """Whether a prompt of ``prompt_len`` tokens (all but the last prefilled, in forwards of
    ``chunk``) is keyed in ``BLOCK``-token blocks: where every prompt forward is at most
    ``cut_invariant_tokens`` long (a short prompt, or any prompt on a model that prefills
    cut-invariantly), a token's keys and values have the same bits however the prompt is cut."""
    cut = getattr(decoder, "cut_invariant_tokens", 0)
    end = prompt_len - 1
    return store.enabled and end > 0 and (end <= min(cut, chunk) or chunk <= cut)


class BlockTable:
    """One sequence's keys in the prefix cache (see the module docstring): ``key`` is the key of
    the blocks it covers, ``covered`` how many tokens they hold (restored or kept)."""

    def __init__(self, store: PrefixCache, in_blocks: bool, keep_output: bool, salt: bytes = b"") -> None:
        self.store = store
        self.in_blocks = in_blocks  # 16-token blocks; else whole prompt chunks
        self.keep_output = keep_output  # the output's blocks are kept at the end too
        # the first key's seed: a scope's salt (a server's tenant), so that no other scope restores its
        # blocks, nor learns from a restore's speed that they exist (vLLM's ``cache_salt``, likewise)
        self.salt = salt
        self.key = b""
        self.covered = 0

    # ------------------------------------------------------------ 16-token blocks
    def restore_blocks(self, cache: "KVCache", ids: list[int], end: int) -> int:
        """Append to ``cache`` the longest run of stored blocks of ``ids`` from ``covered`` to at
        most ``end``; the new ``covered``."""
        while self.covered + BLOCK <= end:
            key = chain_key(self.key or BLOCKS_KEY + self.salt, ids[self.covered : self.covered + BLOCK])
            if not self.store.restore(key, cache):
                break
            self.key, self.covered = key, self.covered + BLOCK
        return self.covered

    def keep_blocks(self, cache: "KVCache", ids: list[int], upto: int) -> None:
        """Keep every whole block of ``ids`` from ``covered`` whose keys and values are committed in
        ``cache`` below slot ``upto``."""
        while self.covered + BLOCK <= upto:
            self.key = chain_key(self.key or BLOCKS_KEY + self.salt, ids[self.covered : self.covered + BLOCK])
            self.store.store(self.key, cache, self.covered + BLOCK, BLOCK)
            self.covered += BLOCK

    # ----------------------------------------------------------------- whole chunks
    def chunk_key(self, chunk: list[int]) -> bytes:
        """The key of a whole chunk that follows what this table covers."""
        return chain_key(self.key or self.salt, chunk)

    def restore_chunk(self, key: bytes, cache: "KVCache", length: int) -> bool:
        """Append the chunk ``key`` (``length`` tokens) to ``cache`` if the store holds it."""
        if not self.store.restore(key, cache):
            return False
        self.key, self.covered = key, self.covered + length
        return True

    def keep_chunk(self, key: bytes, cache: "KVCache", end: int, length: int) -> None:
        """Keep committed slots ``[end - length, end)`` of ``cache`` as the chunk ``key``."""
        self.store.store(key, cache, end, length)
        self.key, self.covered = key, end


class KVBlockManager:
    """The runner's block keys over its prefix cache (``store``; replaceable, e.g. resized)."""

    def __init__(self, store: PrefixCache) -> None:
        self.store = store

    def table(self, decoder: Any, prompt_len: int, chunk: int, policy: "KVPolicy | None" = None,
              scope: str | None = None) -> BlockTable | None:
        """A new sequence's table for a prompt of ``prompt_len`` tokens prefilled in forwards of
        ``chunk`` on ``decoder``, its keys salted by ``scope`` (a server's tenant; None: unsalted);
        None where nothing is kept (the store is off, or a KV-cache policy changes what the cache
        holds)."""
        if policy is not None or not self.store.enabled:
            return None
        in_blocks = keyed_in_blocks(decoder, self.store, prompt_len, chunk)
        salt = b"" if scope is None else hashlib.blake2b(scope.encode(), digest_size=16).digest()
        return BlockTable(self.store, in_blocks, in_blocks and chunk <= getattr(decoder, "cut_invariant_tokens", 0),
                          salt)
