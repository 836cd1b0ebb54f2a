"""Block pool and KV cache manager bookkeeping."""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool, hash_block_tokens
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=8), frozenset(), 8, cache_salt=salt)


def test_free_queue_is_lru_and_hits_are_removed_from_the_middle():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache(b, b"hash-b", [1, 2])
    pool.free([c, b, a])  # tail first: c is evicted first, then b, then a
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(b"hash-b", [1, 2]) is b
    assert pool.get_cached_block(b"hash-b", [9, 9]) is None  # token check rules out collisions
    pool.touch([b])  # a hit revives b out of the middle of the queue
    assert b.ref_cnt == 1 and pool.num_free_blocks == 3
    first, second, third = pool.allocate(3)
    assert [first.block_id, second.block_id, third.block_id] == [3, c.block_id, a.block_id]
    pool.free([b])
    (reused,) = pool.allocate(1)
    assert reused is b and pool.get_cached_block(b"hash-b", [1, 2]) is None  # evicted on reuse


def test_block_hash_chains_and_salt():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(h1, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 3], ("a",)) != hash_block_tokens(None, [1, 2, 3], ("b",))


def test_allocate_cache_lookup_and_free():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    first = make_request("a", list(range(10)))
    assert manager.allocate_slots(first, 10)
    assert len(first.block_ids) == 3
    first.num_computed_tokens = 10
    manager.cache_full_blocks(first, first.num_computed_tokens)
    manager.free(first)
    assert manager.num_held_blocks() == 0

    again = make_request("b", list(range(9)) + [99])
    hits = manager.find_cached_prefix(again)
    assert len(hits) == 2  # two full blocks of 4; the last token is always computed
    assert manager.allocate_slots(again, 2, hits)
    assert again.block_ids[:2] == [b.block_id for b in hits]
    other_tenant = make_request("c", list(range(10)), salt="tenant-b")
    assert manager.find_cached_prefix(other_tenant) == []


def test_allocation_fails_cleanly_when_the_pool_is_short():
    manager = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    request = make_request("a", list(range(20)))
    assert not manager.allocate_slots(request, 20)
    assert manager.num_free_blocks == 3 and request.block_ids == []


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    lead = make_request("lead", list(range(6)))
    assert manager.allocate_slots(lead, 5)
    lead.num_computed_tokens = 5
    child = make_request("child", list(range(6)))
    manager.fork(lead, child)
    assert child.block_ids == lead.block_ids
    assert all(manager.pool.blocks[b].ref_cnt == 2 for b in lead.block_ids)
    # Writing token 5 lands in the shared partial block 1: the child gets a private copy.
    assert manager.allocate_slots(child, 1)
    assert child.block_ids[0] == lead.block_ids[0] and child.block_ids[1] != lead.block_ids[1]
    assert manager.take_pending_copies() == [(lead.block_ids[1], child.block_ids[1])]
    assert manager.allocate_slots(lead, 1)  # now the sole owner: writes in place
    assert manager.take_pending_copies() == []
    manager.free(child)
    manager.free(lead)
    assert manager.num_held_blocks() == 0
