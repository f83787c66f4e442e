"""The runner's KV block manager (``core/kv_blocks.py``): which keys a sequence's keys and values
are kept under in the prefix cache, whole chunks or 16-token blocks, and a sequence's
``BlockTable`` restoring what another kept."""

from __future__ import annotations

import types

import torch

from leapdecode import ModelRunner
from leapdecode.core.kv_blocks import BLOCK, BLOCKS_KEY, BlockTable, KVBlockManager, chain_key, keyed_in_blocks
from leapdecode.core.kv_policy import parse_kv_policy
from leapdecode.core.prefix_cache import PrefixCache
from leapdecode.models.kv_cache import KVCache


def _cache(n: int = 0, seed: int = 0) -> KVCache:
    cache = KVCache(n_layers=2, n_kv_heads=2, head_dim=4, max_len=128)
    if n:
        g = torch.Generator().manual_seed(seed)
        cache.append_committed(torch.randn(2, 1, 2, n, 4, generator=g), torch.randn(2, 1, 2, n, 4, generator=g))
    return cache


CUT = types.SimpleNamespace(cut_invariant_tokens=64)  # a decoder that computes keys the same however cut
PLAIN = types.SimpleNamespace()  # one that does not


def test_a_key_stands_for_every_token_before_it():
    a, b = chain_key(b"", [1, 2, 3]), chain_key(b"", [1, 2, 4])
    assert a != b and chain_key(a, [5]) != chain_key(b, [5]) and chain_key(a, [5]) == chain_key(a, [5])
    assert chain_key(BLOCKS_KEY, [1, 2, 3]) != a  # blocks and whole chunks are separate chains


def test_which_prompts_are_keyed_in_blocks():
    store = PrefixCache()
    assert keyed_in_blocks(CUT, store, 40, 256)  # a short prompt on a cut-invariant decoder
    assert not keyed_in_blocks(CUT, store, 300, 256)  # a longer one prefilled in 256-token chunks
    assert keyed_in_blocks(CUT, store, 300, 64)  # ... unless every forward is within the invariant cut
    assert not keyed_in_blocks(PLAIN, store, 40, 256)
    assert not keyed_in_blocks(CUT, PrefixCache(0), 40, 256)  # the store is off
    assert not keyed_in_blocks(CUT, store, 1, 256)  # nothing to prefill


def test_the_manager_hands_out_tables_only_where_blocks_are_kept():
    manager = KVBlockManager(PrefixCache())
    table = manager.table(CUT, 40, 64)
    assert table.in_blocks and table.keep_output  # every forward within the cut: the output too
    assert not manager.table(CUT, 40, 256).keep_output  # short prompt only: its output is not keyed
    assert not manager.table(PLAIN, 40, 256).in_blocks  # whole chunks
    assert manager.table(CUT, 40, 64, parse_kv_policy("streaming:sink=4,window=64")) is None
    assert KVBlockManager(PrefixCache(0)).table(CUT, 40, 64) is None


def test_a_second_sequence_restores_the_blocks_the_first_kept():
    store = PrefixCache()
    ids = list(range(100, 150))  # 50 tokens: three whole blocks
    first, src = BlockTable(store, True, True), _cache(50)
    first.keep_blocks(src, ids, 40)  # slots below 40 are committed: two whole blocks
    assert first.covered == 2 * BLOCK and len(store) == 2
    first.keep_blocks(src, ids, 50)
    assert first.covered == 3 * BLOCK and len(store) == 3
    second, dst = BlockTable(store, True, True), _cache()
    assert second.restore_blocks(dst, ids, 49) == 3 * BLOCK
    assert torch.equal(dst.k[:, :, :, : 3 * BLOCK], src.k[:, :, :, : 3 * BLOCK])
    other, dst2 = BlockTable(store, True, True), _cache()
    assert other.restore_blocks(dst2, ids[:20] + [7] + ids[21:], 49) == BLOCK  # diverges in the 2nd block
    assert other.key == chain_key(BLOCKS_KEY, ids[:BLOCK])


def test_whole_chunks_follow_their_own_chain():
    store = PrefixCache()
    ids, src = list(range(64)), _cache(64)
    first = BlockTable(store, False, False)
    k1 = first.chunk_key(ids[:32])
    first.keep_chunk(k1, src, 32, 32)
    k2 = first.chunk_key(ids[32:])
    assert k2 == chain_key(k1, ids[32:]) and first.covered == 32
    first.keep_chunk(k2, src, 64, 32)
    second, dst = BlockTable(store, False, False), _cache()
    assert second.restore_chunk(second.chunk_key(ids[:32]), dst, 32)
    assert second.restore_chunk(second.chunk_key(ids[32:]), dst, 32)
    assert second.covered == 64 and torch.equal(dst.v[:, :, :, :64], src.v[:, :, :, :64])
    assert not BlockTable(store, False, False).restore_chunk(chain_key(b"", ids[32:]), _cache(), 32)


def test_a_runner_resized_by_the_server_keys_into_its_new_store(tiny):
    runner = ModelRunner(tiny(seed=0))
    bigger = PrefixCache(2**20)
    runner.prefix_cache = bigger  # server/app.py's --prefix-cache-mib
    assert runner.blocks.store is bigger and runner.prefix_cache is bigger
