"""Planning one engine's KV pool before it is allocated: the KV cache groups its layers fall in,
the bytes one pool block takes on a rank, and how many blocks the pool holds.

The same formula as `pagoda plan` (ModelConfig.kv_bytes_per_token, pagoda.quant.storage_bytes);
its bytes come from pagoda.core.kv_memory (--kv-cache-memory, or a share of the free memory); the
pool itself is allocated by the model runner (pagoda.worker.paged_model), the host and disk
tiers below it by pagoda.kv_transfer.tiers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.kv_cache_groups import KVCacheGroup, kv_cache_groups, layers_per_page, pages_per_sequence
from pagoda.core.kv_memory import KVMemory
from pagoda.core.state_slots import plan_state_slots

if TYPE_CHECKING:
    from pagoda.model.model_config import ModelConfig
    from pagoda.model.pipeline import PipelineStage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVPoolPlan:
    """What plan_kv_pool decided."""

    groups: list[KVCacheGroup]  # a pool block holds one layer of each group member
    release_blocker: str | None  # why sliding-window blocks are kept whole (None: released or no windows)
    bytes_per_block: int  # on one rank (or the largest pipeline stage), the draft model's included
    num_blocks: int
    memory: KVMemory  # the bytes the pool may take on one rank, and why (the pool may use fewer)
    # A hybrid model's state cache (pagoda.core.state_slots): a slot per sequence, and its
    # snapshots with prefix caching, in the same budget.
    num_state_slots: int = 0
    num_state_snapshots: int = 0
    bytes_per_state_slot: int = 0

    @property
    def state_bytes(self) -> int:
        """The state cache's bytes: its slots and snapshots."""
        return (self.num_state_slots + self.num_state_snapshots) * self.bytes_per_state_slot

    def describe_memory(self) -> str:
        """The pool's bytes on one rank and where they come from, for the banner."""
        used = self.num_blocks * self.bytes_per_block + self.state_bytes
        capped = used + self.bytes_per_block <= self.memory.bytes  # every running sequence at full context fits
        return (
            f"{_gib(used)} ({self.memory.describe()}{', all that --max-num-seqs sequences can use' if capped else ''})"
            + (f"; {self.describe_state()}" if self.num_state_slots else "")
        )

    def describe_state(self) -> str:
        """A hybrid model's state cache (pagoda.core.state_slots): how many sequences fit."""
        return f"state cache: {self.num_state_slots} sequences fit ({self.bytes_per_state_slot:,} bytes each)" + (
            f", {self.num_state_snapshots} prefix-cache snapshots at block boundaries"
            if self.num_state_snapshots
            else ""
        )


def plan_kv_pool(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    model_config: ModelConfig,
    memory: KVMemory,
    *,
    num_kv_heads: int,
    element_bytes: int,
    max_model_len: int,
    release_blocker: str | None,
    stages: list[PipelineStage] | None = None,
    draft_config: ModelConfig | None = None,
) -> KVPoolPlan:
    """The pool of a model whose ranks each hold `num_kv_heads` KV heads, stored at
    `element_bytes` per element (before --kv-cache-dtype), in `memory`'s bytes. `release_blocker`: why these settings
    keep sliding-window blocks whole (pagoda.core.kv_cache_groups.release_blocker), if they do."""
    # Sliding-window layers release the blocks behind their windows, in KV cache groups of
    # their own (pagoda.core.kv_cache_groups); a pool block holds one layer of each group member.
    windows = model_config.layer_sliding_windows
    blocker = release_blocker if any(w is not None for w in windows) else None
    groups = kv_cache_groups(windows, release=blocker is None, kv_layers=model_config.kv_layers)
    if blocker is not None:
        logger.info("sliding-window KV blocks are kept whole: %s", blocker)
    # Per rank: each holds its KV heads' slice of every block.
    bytes_per_block = (
        model_config.kv_bytes_per_token(element_bytes, num_kv_heads, kv_cache_dtype=cache.kv_cache_dtype)
        * cache.block_size
    )
    num_kv_layers = len(model_config.kv_layers)
    bytes_per_block = bytes_per_block * layers_per_page(groups) // num_kv_layers
    if stages is not None:  # each stage holds its layers' share of a block: the largest bounds the pool
        bytes_per_block = (
            bytes_per_block * max(stage_layers_per_page(groups, stage) for stage in stages) // layers_per_page(groups)
        )
    if draft_config is not None:
        bytes_per_block += (
            draft_config.kv_bytes_per_token(element_bytes, kv_cache_dtype=cache.kv_cache_dtype) * cache.block_size
        )
    state = plan_state_slots(cache, scheduler, model_config, element_bytes, memory.bytes)
    if state.num_slots:
        logger.info(
            "state cache: %d sequences fit, %d bytes of recurrent-layer state each, %d prefix-cache snapshots",
            state.num_slots,
            state.bytes_per_slot,
            state.num_snapshots,
        )
    num_blocks = num_kv_blocks(
        cache, scheduler, groups, num_kv_layers, bytes_per_block, max_model_len, memory.bytes - state.total_bytes
    )
    return KVPoolPlan(
        groups,
        blocker,
        bytes_per_block,
        num_blocks,
        memory,
        state.num_slots,
        state.num_snapshots,
        state.bytes_per_slot,
    )


def num_kv_blocks(
    cache: CacheConfig,
    scheduler: SchedulerConfig,
    groups: list[KVCacheGroup],
    num_layers: int,
    bytes_per_block: int,
    max_model_len: int,
    pool_bytes: int,
) -> int:
    """--num-kv-blocks, else what `pool_bytes` (pagoda.core.kv_memory, less a hybrid model's state
    cache) hold, at most what the running sequences could ever use."""
    if cache.num_kv_blocks is not None:  # blocks of every layer: the same memory in pages
        return cache.num_kv_blocks * num_layers // layers_per_page(groups)
    num_blocks = pool_bytes // bytes_per_block
    # More than every running sequence at full length could ever use is wasted memory.
    useful = scheduler.max_num_seqs_bound * pages_per_sequence(
        groups, max_model_len, cache.block_size, scheduler.max_num_batched_tokens
    )
    num_blocks = min(num_blocks, useful)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory {cache.kv_cache_memory} ({pool_bytes} bytes) holds no KV block "
            f"({bytes_per_block} bytes each)"
        )
    return num_blocks


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def stage_layers_per_page(groups: list[KVCacheGroup], stage: PipelineStage) -> int:
    """Layers of a pool block a pipeline stage holds: the places its layers take in the groups
    (pagoda.worker.paged_model allocates only those)."""
    return len({place for group in groups for place, layer in enumerate(group.layers) if stage.holds_layer(layer)})
