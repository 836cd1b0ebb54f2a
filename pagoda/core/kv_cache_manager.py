"""Per-request block tables on top of the block pool: prefix lookup, slot allocation,
copy-on-write fork, and freeing. With a host tier (pagoda.core.kv_tiers) behind the pool,
evicted cached blocks are offered to it, prefix lookups continue into it, and preempted
requests can be swapped out to it and back.

A request has one block table per KV cache group (pagoda.core.kv_cache_groups). In a group
with a sliding window, blocks wholly behind the window are released as the request moves on
and their entries become None (block 0 in `request.block_tables`, never read unmasked); a
cached prefix is usable for such a group only where the blocks its window still sees exist."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from pagoda.core.kv_cache_groups import KVCacheGroup, first_needed_block
from pagoda.core.kv_tiers import HostTier, PreemptionPolicy, TierEntry, TransferOp, TransferPlan
from pagoda.core.state_slots import StateSlots
from pagoda.core.state_snapshots import StateSnapshots
from pagoda.request import Request

# What a request's block table entry in the cache names: None once released behind a window.
PLACEHOLDER_BLOCK_ID = 0


class CachedPrefix(list):
    """The first group's cached blocks that prefix a request, in order; `tables` holds every
    group's (None where a sliding group needs no block)."""

    def __init__(self, tables: list[Sequence[KVBlock | TierEntry | None]]) -> None:
        super().__init__(tables[0] if tables else [])
        self.tables = tables


@dataclass
class RequestBlocks:
    """A request's blocks: one table per group, None for blocks released behind a window."""

    tables: list[list[KVBlock | None]]
    num_cached: int = 0  # full blocks already registered in the prefix cache
    num_released: list[int] = field(default_factory=list)  # per group: leading entries released

    def block_ids(self) -> list[list[int]]:
        return [[PLACEHOLDER_BLOCK_ID if b is None else b.block_id for b in table] for table in self.tables]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        host_tier: HostTier | None = None,
        preemption: PreemptionPolicy | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
        state_slots: StateSlots | None = None,
        state_snapshots: StateSnapshots | None = None,
    ) -> None:
        self.block_size = block_size
        # A hybrid model's state cache: a slot per sequence, taken and returned with its blocks,
        # and (with prefix caching) snapshots of the state at block boundaries.
        self.state_slots = state_slots
        self.state_snapshots = state_snapshots if enable_caching else None
        # This step's snapshots to save: (request id, tokens into its chunk, snapshot slot).
        self._snapshots_to_save: list[tuple[str, int, int]] = []
        # Requests whose prompt's KV is cached further than a snapshot reaches: the block where
        # the cached chain ends, where they save a snapshot as they pass it (the next request
        # sharing that prefix then finds one there).
        self._snapshot_wanted: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.host_tier = host_tier
        self.preemption = preemption or PreemptionPolicy("recompute")
        if self.preemption.mode != "recompute" and host_tier is None:
            raise ValueError(f"preemption_mode {self.preemption.mode} needs a host tier (kv_offload_memory)")
        self.groups = list(groups) if groups else [KVCacheGroup(())]
        # One table of kept blocks: what host tiers, swapping and KV handoff work with.
        self.single_table = len(self.groups) == 1 and self.groups[0].window is None
        if host_tier is not None and not self.single_table:
            raise ValueError("a host KV tier cannot hold blocks of sliding-window groups yet")
        self.pool = BlockPool(
            num_blocks, enable_caching, on_evict=self._offload if host_tier is not None and enable_caching else None
        )
        self._requests: dict[str, RequestBlocks] = {}
        # Copy-on-write copies (src block id, dst block id) to run before the next forward.
        self._pending_copies: list[tuple[int, int]] = []
        # Tier copies recorded this step, in order, and the device blocks they or CoW write into.
        self._plan = TransferPlan()
        self._written_this_step: set[int] = set()
        self._swapped: dict[str, list[int]] = {}  # request id -> host blocks holding its KV
        self.tier_hits = {"device": 0, "host": 0, "disk": 0}  # prompt tokens found, per tier
        # Bumped by each weight update and hashed into every block after it: KV computed with
        # older weights, in any tier, never matches a new request's prefix.
        self.weights_version = 0
        if host_tier is not None:
            host_tier.bind(self._plan)

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Longest chain of cached full blocks that prefixes the request's tokens: device
        blocks first, then (with a host tier) entries the host or disk tier holds. A sliding
        group needs only the blocks its window sees from the end of the chain.

        The last token is always left to compute: its logits are needed to sample."""
        if not self.enable_caching:
            return CachedPrefix([])
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.single_table:
            chain = self._cached_chain(request, max_blocks)
            snapshots = self.state_snapshots
            if snapshots is not None:  # a hybrid's prefix ends where its recurrent state was saved
                cached_kv = len(chain)
                while chain and snapshots.lookup(request.block_hashes[len(chain) - 1]) is None:
                    chain.pop()
                if len(chain) < cached_kv:
                    self._snapshot_wanted[request.request_id] = cached_kv
            return CachedPrefix([chain])
        if self.state_slots is not None:  # no snapshots across several block tables yet
            return CachedPrefix([])
        length = max_blocks
        for g, group in enumerate(self.groups):
            if group.window is None:
                length = next((i for i in range(length) if self._cached_block(request, g, i) is None), length)
        sliding = {
            g: [self._cached_block(request, g, i) for i in range(length)]
            for g, group in enumerate(self.groups)
            if group.window is not None
        }
        runs = {g: _hit_runs(hits) for g, hits in sliding.items()}
        while length and not all(
            runs[g][length - 1] >= length - self._first_needed(g, length * self.block_size) for g in sliding
        ):
            length -= 1
        tables: list[Sequence[KVBlock | TierEntry | None]] = []
        for g, group in enumerate(self.groups):
            if group.window is None:
                tables.append([self._cached_block(request, g, i) for i in range(length)])
            else:
                first = self._first_needed(g, length * self.block_size)
                released: list[KVBlock | None] = [None] * first
                tables.append(released + sliding[g][first:length])
        return CachedPrefix(tables)

    def _cached_chain(self, request: Request, max_blocks: int) -> list[KVBlock | TierEntry]:
        hits: list[KVBlock | TierEntry] = []
        tier = self.host_tier
        for i in range(max_blocks):
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_hash = request.block_hashes[i]
            hit: KVBlock | TierEntry | None = self.pool.get_cached_block(block_hash, tokens)
            if hit is None and tier is not None:
                hit = tier.lookup(block_hash, tokens, self._plan)
                if hit is not None:
                    tier.pinned.add(block_hash)  # a disk fetch further down must not evict it
            if hit is None:
                break
            hits.append(hit)
        if tier is not None:
            tier.pinned.clear()
        return hits

    def _cached_block(self, request: Request, group: int, index: int) -> KVBlock | None:
        tokens = request.all_token_ids[index * self.block_size : (index + 1) * self.block_size]
        return self.pool.get_cached_block(_group_hash(request.block_hashes[index], group), tokens)

    def _first_needed(self, group: int, num_computed_tokens: int) -> int:
        return first_needed_block(self.groups[group].window, num_computed_tokens, self.block_size)

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[KVBlock | TierEntry] = ()
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed (and cached) ones.
        Cached blocks held by a lower tier get fresh device blocks and are loaded into them
        before the step's forward. Blocks a sliding window has left behind are released first.

        Returns False, changing nothing else, if the pool has too few free blocks; the
        scheduler then preempts someone or leaves the request waiting.
        """
        if self.state_slots is not None and request.state_slot is None and not self.state_slots.num_free:
            return False
        state = self._requests.get(request.request_id)
        if state is None:
            state = RequestBlocks([[] for _ in self.groups], num_released=[0] * len(self.groups))
            self._requests[request.request_id] = state
        num_cached = len(cached_blocks)
        cached_tables: list[Sequence[KVBlock | TierEntry | None]] = []
        if num_cached:
            cached_tables = cached_blocks.tables if isinstance(cached_blocks, CachedPrefix) else [list(cached_blocks)]
        else:
            self._release_behind_windows(request, state)
        write_pos = request.num_computed_tokens + num_cached * self.block_size
        total = self.num_blocks_for(write_pos + num_new_tokens)
        needed = [
            max(total - len(table) - (len(cached_tables[g]) if cached_tables else 0), 0)
            for g, table in enumerate(state.tables)
        ]
        cow = [self._shared_partial_block(table, write_pos) if num_new_tokens else None for table in state.tables]
        hits = [b for table in cached_tables for b in table if b is not None]
        device_hits = [b for b in hits if isinstance(b, KVBlock)]
        tier_hits = [e for e in hits if isinstance(e, TierEntry)]
        # Cached blocks with no other user sit in the free queue: touching them uses it up.
        num_revived = sum(1 for b in device_hits if b.ref_cnt == 0)
        num_cow = sum(1 for index in cow if index is not None)
        if sum(needed) + num_cow + num_revived + len(tier_hits) > self.pool.num_free_blocks:
            return False

        if cached_tables:
            self.pool.touch(device_hits)
            loaded = dict(zip(map(id, tier_hits), self._load_tier_hits(tier_hits))) if tier_hits else {}
            for g, table in enumerate(cached_tables):
                state.tables[g].extend(loaded[id(b)] if isinstance(b, TierEntry) else b for b in table)
                state.num_released[g] = next((i for i, b in enumerate(table) if b is not None), len(table))
            state.num_cached = len(state.tables[0])
            self._count_hits(num_cached - len(tier_hits), tier_hits)
        for g, (table, cow_index) in enumerate(zip(state.tables, cow)):
            if cow_index is not None:
                self._copy_on_write(table, cow_index)
            if needed[g]:
                table.extend(self.pool.allocate(needed[g]))
        request.block_tables = state.block_ids()
        if self.state_slots is not None and request.state_slot is None:
            request.state_slot = self.state_slots.allocate()
        if self.state_slots is not None and self.state_snapshots is not None:
            self._restore_and_snapshot(request, num_cached, write_pos, num_new_tokens)
        return True

    def _restore_and_snapshot(self, request: Request, num_cached: int, write_pos: int, num_new_tokens: int) -> None:
        """A hybrid's state: restored from the snapshot its cached prefix ends at, and saved at
        the last block boundary within the prompt that this chunk reaches."""
        snapshots, slots = self.state_snapshots, self.state_slots
        assert snapshots is not None and slots is not None and request.state_slot is not None
        if num_cached:
            source = snapshots.lookup(request.block_hashes[num_cached - 1])
            assert source is not None, "find_cached_prefix ends a hybrid's prefix at a snapshot"
            slots.copy(source, request.state_slot)
        end = min(write_pos + num_new_tokens, request.num_prompt_tokens)
        boundaries = {end // self.block_size * self.block_size}  # the chunk's last
        wanted = self._snapshot_wanted.get(request.request_id)
        if wanted is not None and wanted * self.block_size <= end:
            boundaries.add(wanted * self.block_size)  # where a cached prefix's KV ends
            del self._snapshot_wanted[request.request_id]
        for boundary in sorted(b for b in boundaries if b > write_pos):
            slot = snapshots.reserve(request.request_id, boundary // self.block_size - 1)
            if slot is not None:
                self._snapshots_to_save.append((request.request_id, boundary - write_pos, slot))

    def take_state_snapshots(self) -> list[tuple[str, int, int]]:
        """This step's snapshots to save: (request id, tokens into its chunk, snapshot slot)."""
        snapshots, self._snapshots_to_save = self._snapshots_to_save, []
        return snapshots

    def _release_behind_windows(self, request: Request, state: RequestBlocks) -> None:
        """Return the blocks no query from the next computed position on sees (oldest first, so
        they are evicted first)."""
        for g, group in enumerate(self.groups):
            if group.window is None:
                continue
            table = state.tables[g]
            first = min(self._first_needed(g, request.num_computed_tokens), len(table))
            released = [b for b in table[state.num_released[g] : first] if b is not None]
            if released:
                self.pool.free(released)
            for i in range(state.num_released[g], first):
                table[i] = None
            state.num_released[g] = max(state.num_released[g], first)

    def _shared_partial_block(self, blocks: list[KVBlock | None], write_pos: int) -> int | None:
        """Index of the block the next write lands in, if another request shares it."""
        index = write_pos // self.block_size
        if write_pos % self.block_size and index < len(blocks):
            block = blocks[index]
            if block is not None and block.ref_cnt > 1:
                return index
        return None

    def _copy_on_write(self, blocks: list[KVBlock | None], index: int) -> None:
        shared = blocks[index]
        assert shared is not None
        (private,) = self.pool.allocate(1)
        self._pending_copies.append((shared.block_id, private.block_id))
        self._written_this_step.add(private.block_id)
        self.pool.free([shared])
        blocks[index] = private

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_transfers(self) -> list[TransferOp]:
        """This step's tier copies, in the order the runner must run them (before CoW copies)."""
        self._written_this_step.clear()
        return self._plan.take()

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's blocks, shared by reference (copy-on-write on next write)."""
        source = self._requests.get(parent.request_id)
        if source is None:
            source = RequestBlocks([[] for _ in self.groups], num_released=[0] * len(self.groups))
        state = RequestBlocks([list(table) for table in source.tables], source.num_cached, list(source.num_released))
        self.pool.touch(b for table in state.tables for b in table if b is not None)
        self._requests[child.request_id] = state
        child.block_tables = state.block_ids()
        if self.state_slots is not None and parent.state_slot is not None:
            child.state_slot = self.state_slots.fork(parent.state_slot)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks within its first `num_computed_tokens` tokens in
        the prefix cache. Callers pass verified tokens only: drafts never enter the cache."""
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        state = self._requests[request.request_id]
        start = state.num_cached
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, num_full):
            tokens = request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            for g, table in enumerate(state.tables):
                block = table[i]
                if block is not None:
                    self.pool.cache(block, _group_hash(request.block_hashes[i], g), tokens)
        state.num_cached = num_full
        if self.state_snapshots is not None:
            self.state_snapshots.register(request.request_id, request.block_hashes, num_full)

    def free(self, request: Request) -> None:
        """Release the request's blocks; its tail goes first in eviction order."""
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None and self.host_tier is not None:
            self.host_tier.free_private(swapped)
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            for table in state.tables:
                self.pool.free(b for b in reversed(table) if b is not None)
        request.block_tables = []
        if self.state_slots is not None and request.state_slot is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = None
        if self.state_snapshots is not None:
            self.state_snapshots.drop(request.request_id)
            self._snapshot_wanted.pop(request.request_id, None)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Drop blocks past `num_tokens` (KV written for rejected speculative tokens)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        keep = self.num_blocks_for(num_tokens)
        for table in state.tables:
            if keep < len(table):
                self.pool.free(b for b in reversed(table[keep:]) if b is not None)
                del table[keep:]
        request.block_tables = [ids[:keep] for ids in request.block_tables]

    def block_hashes(self, request: Request) -> list[bytes]:
        """The request's chained full-block hashes (tenant salt, adapter and rope factors included), computed
        whether or not prefix caching is on: a KV handoff carries and checks them."""
        self._update_block_hashes(request)
        return request.block_hashes

    def _update_block_hashes(self, request: Request) -> None:
        extra_keys: tuple[object, ...] = (request.cache_salt,) if request.cache_salt else ()
        if request.lora is not None:  # KV computed through an adapter is that adapter's alone
            extra_keys += request.lora.cache_key
        if request.long_rope:  # KV of LongRoPE's long factors never serves a short sequence, nor the reverse
            extra_keys += (("rope factors", "long"),)
        if self.weights_version:
            extra_keys += (("weights", self.weights_version),)
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        for i in range(len(hashes), num_full):
            start, end = i * self.block_size, (i + 1) * self.block_size
            tokens = request.all_token_ids[start:end]
            keys = extra_keys
            # Placeholder tokens are the same for every image: the images' hashes tell them apart.
            images = tuple(item.content_hash for item in request.media if item.overlaps(start, end))
            if images:
                keys += (("images", images),)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens, keys))

    def invalidate_prefix_cache(self) -> None:
        """The model's weights changed: the device pool forgets its cached blocks, and the host
        and disk tiers' entries (hashed under the old version) can no longer match."""
        self.weights_version += 1
        self.pool.forget_cached()
        if self.state_snapshots is not None:
            self.state_snapshots.clear()

    # ---- host tier -----------------------------------------------------------------------------

    def _offload(self, block: KVBlock) -> None:
        """The pool is dropping a cached block: copy it to the host tier under its hash."""
        assert self.host_tier is not None and block.block_hash is not None and block.token_ids is not None
        if block.block_id in self._written_this_step:
            return  # loaded this step and not yet copied in: the host tier still holds it
        host_id = self.host_tier.offer(block.block_hash, block.token_ids, self._plan)
        if host_id is not None:
            self._plan.add("store", block.block_id, host_id)

    def _load_tier_hits(self, entries: list[TierEntry]) -> list[KVBlock]:
        """Fresh device blocks for entries a lower tier holds, registered under their hashes,
        with the loads recorded after any store their allocation caused."""
        tier = self.host_tier
        assert tier is not None
        tier.pinned.update(e.block_hash for e in entries)
        fresh = self.pool.allocate(len(entries))
        tier.pinned.clear()
        for block, entry in zip(fresh, entries):
            self._plan.add("load", entry.location, block.block_id)
            self._written_this_step.add(block.block_id)
            self.pool.cache(block, entry.block_hash, entry.token_ids)
        return fresh

    def _count_hits(self, num_device_blocks: int, tier_hits: list[TierEntry]) -> None:
        self.tier_hits["device"] += num_device_blocks * self.block_size
        for entry in tier_hits:
            self.tier_hits[entry.tier] += self.block_size

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._swapped

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    def swap_out(self, request: Request) -> bool:
        """Preempt by copying the request's computed blocks to the host tier (then freeing them
        on the device). False, changing nothing, when recompute is cheaper or cannot be avoided:
        nothing computed, host tier full, or a block is still being written this step."""
        if self.host_tier is None or self.preemption.mode == "recompute":
            return False
        state = self._requests.get(request.request_id)
        blocks = _kept_blocks(state.tables[0]) if state is not None else []
        num_blocks = min(self.num_blocks_for(request.num_computed_tokens), len(blocks))
        if num_blocks == 0 or any(b.block_id in self._written_this_step for b in blocks[:num_blocks]):
            return False
        if self.preemption.choose(request.num_computed_tokens, num_blocks) != "swap":
            return False
        host_ids = self.host_tier.allocate_private(num_blocks)
        if host_ids is None:
            return False
        for block, host_id in zip(blocks[:num_blocks], host_ids):
            self._plan.add("store", block.block_id, host_id)
        self.free(request)
        self._swapped[request.request_id] = host_ids
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request's blocks back and make room for `num_new_tokens` more;
        False, changing nothing, when the pool has too few free blocks."""
        host_ids = self._swapped[request.request_id]
        total = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        if max(total, len(host_ids)) > self.pool.num_free_blocks:
            return False
        del self._swapped[request.request_id]
        blocks = self.pool.allocate(len(host_ids))
        for host_id, block in zip(host_ids, blocks):
            self._plan.add("load", host_id, block.block_id)
            self._written_this_step.add(block.block_id)
        assert self.host_tier is not None
        self.host_tier.free_private(host_ids)  # reused only by copies recorded after the loads
        table: list[KVBlock | None] = list(blocks)
        state = RequestBlocks([table], num_released=[0])
        self._requests[request.request_id] = state
        request.block_tables = state.block_ids()
        return self.allocate_slots(request, num_new_tokens)

    def num_held_blocks(self) -> int:
        """Blocks with a non-zero ref count (for the idle invariant: 0 when nothing runs)."""
        return self.pool.num_blocks - self.pool.num_free_blocks


def _group_hash(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of `group`: each group caches its own copy of a token
    block (group 0 under the plain hash, which the host tier and KV handoff use)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def _kept_blocks(table: list[KVBlock | None]) -> list[KVBlock]:
    """A table with no entry released: a host tier works only with one table of kept blocks
    (`single_table`, no sliding window), so its tables hold no None."""
    kept = [b for b in table if b is not None]
    assert len(kept) == len(table), "a block table the host tier handles had blocks released behind a window"
    return kept


def _hit_runs(hits: list[KVBlock | None]) -> list[int]:
    """For each index, how many consecutive hits end there."""
    runs, run = [], 0
    for hit in hits:
        run = run + 1 if hit is not None else 0
        runs.append(run)
    return runs
