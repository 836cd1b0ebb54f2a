"""Physical KV blocks: ref counts, an O(1) LRU free queue, and the hash -> block prefix cache."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Sequence


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """Chained hash of one full block: H(parent, tokens, extra keys).

    The chain makes a block's hash name its whole prefix. Extra keys carry everything that
    makes reuse unsafe across requests (the tenant's cache salt, an adapter id); they are
    hashed into every block so no block is shared across salts.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class KVBlock:
    """One physical block. Linked into the free queue while its ref count is zero."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head (least recently freed), append at
    the tail, and remove from the middle in O(1) when a cached free block is hit again."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(first)
        return first


class BlockPool:
    """All physical blocks of the KV cache and the map from block hash to cached block."""

    def __init__(
        self, num_blocks: int, enable_caching: bool, on_evict: Callable[[KVBlock], None] | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVBlock] = {}
        self.on_evict = on_evict  # sees a cached block just before its contents are dropped

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes, token_ids: Sequence[int]) -> KVBlock | None:
        block = self.cached_blocks.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take blocks from the head of the free queue, evicting their cached contents."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (maybe sitting in the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each. Pass blocks in eviction order: blocks freed first are
        evicted first, so callers pass a sequence's tail before its head."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache(self, block: KVBlock, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Register a full block under its hash. The first block with a given hash wins."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached_blocks[block_hash] = block

    def forget_cached(self) -> None:
        """Drop every block's hash (new weights: no block computed before serves a new request);
        blocks in use stay with their requests."""
        for block in self.cached_blocks.values():
            block.block_hash = None
            block.token_ids = None
        self.cached_blocks.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block)
            block.block_hash = None
            block.token_ids = None
