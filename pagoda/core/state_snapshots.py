"""StateSnapshots: prefix caching for hybrid models, by snapshots of the recurrent state at block
boundaries.

A cached prefix restores the attention layers' KV from its blocks, but the recurrent layers'
state after the prefix is not in any block: it is kept apart, a snapshot per block boundary in
slots of the state cache past the sequences' own (pagoda.worker.state_cache allocates them, the
plan counts them). When a chunk of a request's prompt reaches or crosses a block boundary, the
state there is saved into a reserved snapshot slot during the forward (the chunk's last boundary,
and where the request's cached KV ended without a snapshot: the KV cache manager picks them);
once the step is done and the block's chained hash is known, the snapshot is found under that
hash. A lookup serves the longest cached chain of KV blocks that ends at a
boundary with a snapshot; the request's slot then starts as a copy of it (a state copy before
the next forward). Snapshots are evicted least recently used first; one whose blocks have left
the KV cache is never matched again and goes with the next evictions.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, first_slot: int, count: int) -> None:
        self._free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._reserved: dict[str, list[tuple[int, int]]] = {}  # request id -> (block index, slot)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot of the snapshot after the block of this chained hash, or None."""
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def reserve(self, request_id: str, block_index: int) -> int | None:
        """A slot to save the state after block `block_index` of the request into (None: every
        slot is reserved by requests computing)."""
        if self._free:
            slot = self._free.pop()
        elif self._by_hash:
            _, slot = self._by_hash.popitem(last=False)
        else:
            return None
        self._reserved.setdefault(request_id, []).append((block_index, slot))
        return slot

    def register(self, request_id: str, block_hashes: list[bytes], num_computed_blocks: int) -> None:
        """The request's reserved snapshots of computed blocks become findable by their hashes."""
        reserved = self._reserved.get(request_id)
        if not reserved:
            return
        pending = []
        for block_index, slot in reserved:
            if block_index >= num_computed_blocks or block_index >= len(block_hashes):
                pending.append((block_index, slot))
                continue
            key = block_hashes[block_index]
            old = self._by_hash.pop(key, None)
            if old is not None:
                self._free.append(old)
            self._by_hash[key] = slot
        if pending:
            self._reserved[request_id] = pending
        else:
            del self._reserved[request_id]

    def drop(self, request_id: str) -> None:
        """A request ended or was preempted: its snapshots not yet registered are given up."""
        for _, slot in self._reserved.pop(request_id, []):
            self._free.append(slot)

    def clear(self) -> None:
        """Forget every registered snapshot (the weights changed)."""
        self._free.extend(self._by_hash.values())
        self._by_hash.clear()
