"""Per-request block tables on top of the block pool: prefix lookup, slot allocation,
copy-on-write fork, and freeing."""

from __future__ import annotations

from pagoda.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from pagoda.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # full blocks already registered per request
        # Copy-on-write copies (src block id, dst block id) to run before the next forward.
        self._pending_copies: list[tuple[int, int]] = []

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """Longest chain of cached full blocks that prefixes the request's tokens.

        The last token is always left to compute: its logits are needed to sample."""
        if not self.enable_caching:
            return []
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            block = self.pool.get_cached_block(request.block_hashes[i], tokens)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[KVBlock] | tuple = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed (and cached) ones.

        Returns False, changing nothing, if the pool has too few free blocks; the scheduler
        then preempts someone or leaves the request waiting.
        """
        blocks = self._blocks.setdefault(request.request_id, [])
        write_pos = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = self.num_blocks_for(write_pos + num_new_tokens) - len(blocks) - len(cached_blocks)
        num_needed = max(num_needed, 0)
        cow_index = self._shared_partial_block(blocks, write_pos) if num_new_tokens else None
        # Cached blocks with no other user sit in the free queue: touching them uses it up.
        num_revived = sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if num_needed + (cow_index is not None) + num_revived > self.pool.num_free_blocks:
            return False

        if cached_blocks:
            self.pool.touch(cached_blocks)
            blocks.extend(cached_blocks)
            self._num_cached_blocks[request.request_id] = len(blocks)
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
        self.pool.free([shared])
        blocks[index] = private

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

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

    def _update_block_hashes(self, request: Request) -> None:
        extra_keys = (request.cache_salt,) if request.cache_salt else ()
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        for i in range(len(hashes), num_full):
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens, extra_keys))

    def num_held_blocks(self) -> int:
        """Blocks with a non-zero ref count (for the idle invariant: 0 when nothing runs)."""
        return self.pool.num_blocks - self.pool.num_free_blocks
