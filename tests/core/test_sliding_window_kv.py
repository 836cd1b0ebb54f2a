"""KV cache groups and the release of blocks behind sliding windows, on the block manager alone."""

from __future__ import annotations

from pagoda.core.kv_cache_groups import (
    KVCacheGroup,
    blocks_held,
    kv_cache_groups,
    longest_sequence_blocks,
    pages_per_sequence,
)
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

BLOCK = 4
WINDOW = 8


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(),
        eos_token_ids=frozenset(),
        max_output_tokens=1000,
    )


def test_groups_split_layers_by_window_into_equal_pages() -> None:
    assert kv_cache_groups([8, None, 8, None], release=True) == [KVCacheGroup((0, 2), 8), KVCacheGroup((1, 3))]
    gemma3 = kv_cache_groups([8] * 5 + [None], release=True)
    assert [g.layers for g in gemma3] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    assert kv_cache_groups([8, 8], release=True) == [KVCacheGroup((0, 1), 8)]
    assert kv_cache_groups([8, None], release=False) == [KVCacheGroup((0, 1))]
    assert kv_cache_groups([None, None], release=True) == [KVCacheGroup((0, 1))]


def test_a_sequence_holds_window_sized_blocks_on_its_sliding_groups() -> None:
    local, full = KVCacheGroup((0,), WINDOW), KVCacheGroup((1,))
    assert blocks_held(full, 400, BLOCK) == 100
    assert blocks_held(local, 400, BLOCK) == 3  # 7 earlier tokens and the new one: at most 3 blocks
    assert blocks_held(local, 5, BLOCK) == 2
    assert pages_per_sequence([local, full], 400, BLOCK) == 103
    # A pool of 50 pages: with one local and one global group a sequence reaches 47 blocks.
    assert longest_sequence_blocks([local, full], 50, BLOCK, 10_000, 1) == 47
    assert longest_sequence_blocks([local], 50, BLOCK, 10_000, 1) == 2500  # capped by the context only


def decode(manager: KVCacheManager, request: Request, num_tokens: int) -> list[int]:
    """Compute the prompt, then decode one token at a time; free pool blocks after each step."""
    assert manager.allocate_slots(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request, request.num_computed_tokens)
    free = []
    for step in range(num_tokens):
        request.append_output_token(1000 + step)
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        manager.cache_full_blocks(request, request.num_computed_tokens)
        free.append(manager.num_free_blocks)
    return free


def test_decoding_past_the_window_stops_taking_blocks_on_the_local_group() -> None:
    groups = [KVCacheGroup((0,), WINDOW), KVCacheGroup((1,))]
    manager = KVCacheManager(64, BLOCK, enable_caching=True, groups=groups)
    request = make_request("a", list(range(6)))
    free = decode(manager, request, 60)
    # Past the window only the global group grows: one block every BLOCK tokens.
    assert free[20] - free[20 + 4 * BLOCK] == 4
    local_table = request.block_tables[0]
    assert sum(1 for b in local_table if b != 0) <= 3
    assert len(request.block_tables[1]) == -(-request.num_tokens // BLOCK)
    manager.free(request)
    assert manager.num_held_blocks() == 0


def test_only_sliding_layers_hold_a_constant_number_of_blocks() -> None:
    manager = KVCacheManager(16, BLOCK, enable_caching=False, groups=[KVCacheGroup((0, 1), WINDOW)])
    request = make_request("a", list(range(5)))
    free = decode(manager, request, 200)  # 205 tokens would need 52 blocks kept whole
    assert min(free) >= 16 - 3
    manager.free(request)
    assert manager.num_held_blocks() == 0


def test_a_cached_prefix_counts_for_a_sliding_group_only_where_its_window_blocks_exist() -> None:
    groups = [KVCacheGroup((0,), WINDOW), KVCacheGroup((1,))]
    manager = KVCacheManager(64, BLOCK, enable_caching=True, groups=groups)
    first = make_request("a", list(range(40)))
    decode(manager, first, 0)
    manager.free(first)
    again = make_request("b", list(range(40)) + [77])
    hits = manager.find_cached_prefix(again)
    assert len(hits) == 10
    local, full = hits.tables
    assert all(b is not None for b in full)
    # The window of the first token to compute (position 40) starts at 33: blocks 8 and 9.
    assert local[:8] == [None] * 8 and all(b is not None for b in local[8:])

    # Evict the local block holding positions 32..35: the hit now ends where a window is whole.
    evicted = manager.pool.cached_blocks.pop(local[8].block_hash)
    evicted.block_hash = None
    shorter = manager.find_cached_prefix(make_request("c", list(range(40)) + [77]))
    assert len(shorter) == 8
    assert shorter.tables[0][6:] == [
        manager.pool.cached_blocks[shorter.tables[0][6].block_hash],
        manager.pool.cached_blocks[shorter.tables[0][7].block_hash],
    ]

    assert manager.allocate_slots(again, 1, hits)
    assert again.block_tables[0][:8] == [0] * 8
    manager.free(again)
    assert manager.num_held_blocks() == 0
