"""KV cache groups: which layers share a block table, and how many blocks a sequence holds.

Layers with a sliding window need only the last `window` tokens' KV, so their blocks wholly
before the window go back to the pool as decoding moves on, while global layers keep theirs.
Layers are grouped by window; each group has its own block table per sequence, and all groups
draw from one pool (vLLM's hybrid allocator). For one pool to serve every group, a block (a
"page") holds the KV of the same number of layers in every group: groups are cut to
`group_size` layers, and layer `i` of each group lives in the page's i-th layer tensor.
With no sliding layer, or with release off, there is one group of every layer, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagoda.config import EngineConfig
from pagoda.core.capacity import blocks_for


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table per sequence. `window`: the sliding window of every layer
    of the group, whose blocks before it are released; None: blocks are kept."""

    layers: tuple[int, ...]
    window: int | None = None


def kv_cache_groups(
    layer_windows: Sequence[int | None], release: bool, kv_layers: Sequence[int] | None = None
) -> list[KVCacheGroup]:
    """Groups of equal size (the last of a window type may be smaller) in layer order of their
    first layer. Without release (or without windows), one group of every layer, window None.
    kv_layers: the layers that keep KV (a hybrid model's linear-attention layers keep none);
    None: all of them."""
    layers_with_kv = list(range(len(layer_windows))) if kv_layers is None else list(kv_layers)
    if not release or all(layer_windows[layer] is None for layer in layers_with_kv):
        return [KVCacheGroup(tuple(layers_with_kv))]
    by_window: dict[int | None, list[int]] = {}
    for layer in layers_with_kv:
        by_window.setdefault(layer_windows[layer], []).append(layer)
    counts = [len(layers) for layers in by_window.values()]
    # vLLM's rule: the smallest type sets the page, unless padding the small ones to the largest
    # wastes little.
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    groups = []
    for window, layers in by_window.items():
        for first in range(0, len(layers), size):
            groups.append(KVCacheGroup(tuple(layers[first : first + size]), window))
    return groups


def layers_per_page(groups: Sequence[KVCacheGroup]) -> int:
    """Layers whose KV one pool block holds: the largest group."""
    return max(len(g.layers) for g in groups)


def first_needed_block(window: int | None, num_computed_tokens: int, block_size: int) -> int:
    """Index of the first block a sequence still needs once `num_computed_tokens` are computed:
    the next query, at that position, sees keys after position - window."""
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


def blocks_held(group: KVCacheGroup, num_tokens: int, block_size: int, num_new_tokens: int = 1) -> int:
    """Most blocks of `group` a sequence of `num_tokens` tokens holds while computing
    `num_new_tokens` at a time (1: decoding)."""
    total = blocks_for(num_tokens, block_size)
    if group.window is None:
        return total
    return min(total, blocks_for(group.window - 1 + num_new_tokens, block_size) + 1)


def pages_per_sequence(
    groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int, num_new_tokens: int = 1
) -> int:
    """Pool blocks one sequence of `num_tokens` tokens holds, over all groups."""
    return sum(blocks_held(g, num_tokens, block_size, num_new_tokens) for g in groups)


def longest_sequence_blocks(
    groups: Sequence[KVCacheGroup], num_pages: int, block_size: int, max_tokens: int, num_new_tokens: int
) -> int:
    """The longest sequence (in blocks of tokens, at most blocks_for(max_tokens)) whose blocks
    over all groups fit in `num_pages`, computing `num_new_tokens` at a time."""
    low, high = 0, blocks_for(max_tokens, block_size)
    while low < high:  # pages grow with the length: the largest length that fits
        mid = (low + high + 1) // 2
        if pages_per_sequence(groups, mid * block_size, block_size, num_new_tokens) <= num_pages:
            low = mid
        else:
            high = mid - 1
    return low


def release_blocker(config: EngineConfig) -> str | None:
    """Why blocks behind sliding windows must be kept with these settings (None: they can be
    released). Each of these reads every block of a sequence's single table."""
    if config.kv_offload_memory is not None:
        return "a host KV tier (--kv-offload-memory) swaps and offloads whole block tables"
    if config.role != "both":
        return f"a {config.role} engine hands off every block of a prompt"
    if config.speculative == "draft":
        return "a draft model keeps its KV in the target's blocks"
    return None
