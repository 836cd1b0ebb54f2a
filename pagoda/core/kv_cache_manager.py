"""Per-request block tables on top of the block pool: prefix lookup, slot allocation,
copy-on-write fork, and freeing. With a host tier (pagoda.core.kv_tiers) behind the pool,
evicted cached blocks are offered to it, prefix lookups continue into it, and preempted
requests can be swapped out to it and back."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from pagoda.core.kv_tiers import HostTier, PreemptionPolicy, TierEntry, TransferOp, TransferPlan
from pagoda.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 host_tier: HostTier | None = None, preemption: PreemptionPolicy | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.host_tier = host_tier
        self.preemption = preemption or PreemptionPolicy("recompute")
        if self.preemption.mode != "recompute" and host_tier is None:
            raise ValueError(f"preemption_mode {self.preemption.mode} needs a host tier (kv_offload_memory)")
        self.pool = BlockPool(num_blocks, enable_caching,
                              on_evict=self._offload if host_tier is not None and enable_caching else None)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # full blocks already registered per request
        # Copy-on-write copies (src block id, dst block id) to run before the next forward.
        self._pending_copies: list[tuple[int, int]] = []
        # Tier copies recorded this step, in order, and the device blocks they or CoW write into.
        self._plan = TransferPlan()
        self._written_this_step: set[int] = set()
        self._swapped: dict[str, list[int]] = {}  # request id -> host blocks holding its KV
        self.tier_hits = {"device": 0, "host": 0, "disk": 0}  # prompt tokens found, per tier
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

    def find_cached_prefix(self, request: Request) -> list[KVBlock | TierEntry]:
        """Longest chain of cached full blocks that prefixes the request's tokens: device
        blocks first, then (with a host tier) entries the host or disk tier holds.

        The last token is always left to compute: its logits are needed to sample."""
        if not self.enable_caching:
            return []
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock | TierEntry] = []
        tier = self.host_tier
        for i in range(max_blocks):
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
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

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[KVBlock | TierEntry] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed (and cached) ones.
        Cached blocks held by a lower tier get fresh device blocks and are loaded into them
        before the step's forward.

        Returns False, changing nothing, if the pool has too few free blocks; the scheduler
        then preempts someone or leaves the request waiting.
        """
        blocks = self._blocks.setdefault(request.request_id, [])
        write_pos = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = self.num_blocks_for(write_pos + num_new_tokens) - len(blocks) - len(cached_blocks)
        num_needed = max(num_needed, 0)
        cow_index = self._shared_partial_block(blocks, write_pos) if num_new_tokens else None
        device_hits = [b for b in cached_blocks if isinstance(b, KVBlock)]
        tier_hits = [e for e in cached_blocks if isinstance(e, TierEntry)]
        # Cached blocks with no other user sit in the free queue: touching them uses it up.
        num_revived = sum(1 for b in device_hits if b.ref_cnt == 0)
        if num_needed + (cow_index is not None) + num_revived + len(tier_hits) > self.pool.num_free_blocks:
            return False

        if cached_blocks:
            self.pool.touch(device_hits)
            blocks.extend(device_hits)
            if tier_hits:
                blocks.extend(self._load_tier_hits(tier_hits))
            self._num_cached_blocks[request.request_id] = len(blocks)
            self._count_hits(device_hits, tier_hits)
        if cow_index is not None:
            self._copy_on_write(blocks, cow_index)
        if num_needed:
            blocks.extend(self.pool.allocate(num_needed))
        request.block_ids = [b.block_id for b in blocks]
        return True

    def _shared_partial_block(self, blocks: list[KVBlock], write_pos: int) -> int | None:
        """Index of the block the next write lands in, if another request shares it."""
        index = write_pos // self.block_size
        if write_pos % self.block_size and index < len(blocks) and blocks[index].ref_cnt > 1:
            return index
        return None

    def _copy_on_write(self, blocks: list[KVBlock], index: int) -> None:
        shared = blocks[index]
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
        blocks = list(self._blocks.get(parent.request_id, []))
        self.pool.touch(blocks)
        self._blocks[child.request_id] = blocks
        self._num_cached_blocks[child.request_id] = self._num_cached_blocks.get(parent.request_id, 0)
        child.block_ids = [b.block_id for b in blocks]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks within its first `num_computed_tokens` tokens in
        the prefix cache. Callers pass verified tokens only: drafts never enter the cache."""
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        blocks = self._blocks[request.request_id]
        for i in range(start, num_full):
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            self.pool.cache(blocks[i], request.block_hashes[i], tokens)
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks; its tail goes first in eviction order."""
        swapped = self._swapped.pop(request.request_id, None)
        if swapped is not None and self.host_tier is not None:
            self.host_tier.free_private(swapped)
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        request.block_ids = []

    def trim(self, request: Request, num_tokens: int) -> None:
        """Drop blocks past `num_tokens` (KV written for rejected speculative tokens)."""
        blocks = self._blocks.get(request.request_id, [])
        keep = self.num_blocks_for(num_tokens)
        if keep < len(blocks):
            self.pool.free(reversed(blocks[keep:]))
            del blocks[keep:]
            request.block_ids = request.block_ids[:keep]

    def block_hashes(self, request: Request) -> list[bytes]:
        """The request's chained full-block hashes (tenant salt and adapter included), computed
        whether or not prefix caching is on: a KV handoff carries and checks them."""
        self._update_block_hashes(request)
        return request.block_hashes

    def _update_block_hashes(self, request: Request) -> None:
        extra_keys = (request.cache_salt,) if request.cache_salt else ()
        if request.lora is not None:  # KV computed through an adapter is that adapter's alone
            extra_keys += request.lora.cache_key
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        for i in range(len(hashes), num_full):
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens, extra_keys))

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

    def _count_hits(self, device_hits: list[KVBlock], tier_hits: list[TierEntry]) -> None:
        self.tier_hits["device"] += len(device_hits) * self.block_size
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
        blocks = self._blocks.get(request.request_id, [])
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
        self._blocks[request.request_id] = blocks
        self._num_cached_blocks[request.request_id] = 0
        request.block_ids = [b.block_id for b in blocks]
        return self.allocate_slots(request, num_new_tokens)

    def num_held_blocks(self) -> int:
        """Blocks with a non-zero ref count (for the idle invariant: 0 when nothing runs)."""
        return self.pool.num_blocks - self.pool.num_free_blocks
