"""The router's approximate picture of what each replica holds in its prefix cache.

Like SGLang's router or llm-d's KV-aware routing, the router never asks the replicas: it
remembers which prompts it sent where. A prompt is cut into blocks of `block_size` tokens and
each full block gets a chained hash (the hash of its tokens and of every block before it), so
one hash names a whole prefix and the set of hashes is a prefix tree flattened into a dict.
The chain starts from the tenant's cache salt: one tenant's prompts can never match another
tenant's entries (the engines keep tenants' caches apart the same way), so one tenant's cache
state never steers another tenant's request.

Each replica remembers at most `capacity_blocks` blocks, least recently used first out, about
what its KV pool keeps; the picture is approximate (the engine may have evicted earlier, or
kept more), which only costs a worse choice, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

BlockHash = int


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, tenant_key: Hashable) -> list[BlockHash]:
    """Chained hashes of the prompt's full blocks, seeded by the tenant's key."""
    hashes: list[BlockHash] = []
    parent: Hashable = ("tenant", tenant_key)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixTree:
    """Which replica has seen which prefix blocks, per tenant, with LRU forgetting."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        # Per replica, its remembered block hashes, least recently used first.
        self._held: dict[int, OrderedDict[BlockHash, None]] = {}
        # Block hash -> replicas holding it, so a match costs one lookup per block.
        self._holders: dict[BlockHash, set[int]] = {}

    def match(self, hashes: Sequence[BlockHash], replicas: Sequence[int]) -> dict[int, int]:
        """Per replica in `replicas`, how many leading blocks of `hashes` it holds."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for depth, block_hash in enumerate(hashes):
            alive &= self._holders.get(block_hash, set())
            if not alive:
                break
            for replica in alive:
                matched[replica] = depth + 1
        return matched

    def insert(self, replica: int, hashes: Sequence[BlockHash]) -> None:
        """`replica` now holds these blocks (most recently used)."""
        held = self._held.setdefault(replica, OrderedDict())
        # Leading blocks last, so they are forgotten last: a prefix is only usable from its
        # start, and the engines' own LRU frees a request's tail blocks first too.
        for block_hash in reversed(hashes):
            if block_hash in held:
                held.move_to_end(block_hash)
            else:
                held[block_hash] = None
                self._holders.setdefault(block_hash, set()).add(replica)
        while len(held) > self.capacity_blocks:
            evicted, _ = held.popitem(last=False)
            self._forget(evicted, replica)

    def remove_replica(self, replica: int) -> None:
        """A replica that died takes its cache with it."""
        for block_hash in self._held.pop(replica, OrderedDict()):
            self._forget(block_hash, replica)

    def num_blocks(self, replica: int) -> int:
        return len(self._held.get(replica, ()))

    def _forget(self, block_hash: BlockHash, replica: int) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block_hash]
