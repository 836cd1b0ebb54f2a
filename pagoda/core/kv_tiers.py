"""The KV tiers behind the device pool: a host tier (and optionally a disk tier under it).

This module is bookkeeping only: which host block or disk file holds which block hash, their
LRU order, and the ordered list of copies the model runner must perform before the step's
forward (`TransferOp`s, executed by pagoda.kv_transfer). A block's identity is its chained
hash, which already includes the tenant's cache salt, so a block moves between tiers with it
and a lookup under another salt can never find it.

Ordering: the runner executes the ops in the order they were recorded (consecutive ops of one
kind in one bulk copy). So a host block may be reused the moment its content has been
recorded to be copied elsewhere: the copy runs first. No host block needs a pin across steps;
only a swapped-out request's private blocks are referenced.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pagoda.config import PreemptionMode

TransferKind = Literal["store", "load", "spill", "fetch", "delete"]


@dataclass
class TransferOp:
    """One bulk copy. store: device ids -> host ids; load: host ids -> device ids;
    spill: host ids -> (file name, block hash, token ids); fetch: file names -> host ids;
    delete: file names (dst unused)."""

    kind: TransferKind
    src: list = field(default_factory=list)
    dst: list = field(default_factory=list)
    targets: set = field(default_factory=set, repr=False)  # dst, for the duplicate check


class TransferPlan:
    """The ordered copies recorded during one schedule()."""

    def __init__(self) -> None:
        self.ops: list[TransferOp] = []

    def add(self, kind: TransferKind, src, dst) -> None:
        """Append a copy, merged into the last op when it is of the same kind. A target already
        written by that op (a host block reused within one step) starts a new op: a bulk
        scatter with repeated indices would leave either value."""
        last = self.ops[-1] if self.ops else None
        if last is None or last.kind != kind or (dst is not None and dst in last.targets):
            last = TransferOp(kind)
            self.ops.append(last)
        last.src.append(src)
        last.dst.append(dst)
        if dst is not None:
            last.targets.add(dst)

    def take(self) -> list[TransferOp]:
        ops, self.ops = self.ops, []
        return ops


@dataclass
class TierEntry:
    """A cached block held by a lower tier: where it is and what it names."""

    location: int | str  # host block id, or disk file name
    block_hash: bytes
    token_ids: tuple[int, ...]
    tier: str = "host"  # where the hit came from: "host", or "disk" for a block fetched on this lookup


def disk_file_name(fingerprint: bytes, block_hash: bytes) -> str:
    """A file name from the salted block hash and the model/config fingerprint only: it reveals
    no token ids, and another model or config never derives the same name."""
    return hashlib.blake2b(fingerprint + block_hash, digest_size=20).hexdigest() + ".kv"


class DiskTier:
    """Index of blocks spilled to files, with its own LRU and a capacity in blocks."""

    def __init__(
        self,
        num_blocks: int,
        fingerprint: bytes,
        existing: Sequence[tuple[str, bytes, tuple[int, ...]]] = (),
        is_written: Callable[[str], bool] | None = None,
        can_write: Callable[[], bool] | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the disk tier needs room for at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.fingerprint = fingerprint
        # Files are written asynchronously: one still in flight (or whose write failed, e.g. a
        # full disk) is a miss, never a read of something absent.
        self.is_written = is_written
        # False while the disk is full: no block is admitted (nor an older one deleted for it).
        self.can_write = can_write
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()  # LRU first
        for name, block_hash, token_ids in existing[-num_blocks:] if existing else ():
            self.entries[block_hash] = TierEntry(name, block_hash, tuple(token_ids), "disk")

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def usage(self) -> float:
        return len(self.entries) / self.num_blocks

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> TierEntry | None:
        entry = self.entries.get(block_hash)
        if entry is None or entry.token_ids != tuple(token_ids):
            return None
        if self.is_written is not None and not self.is_written(entry.location):  # type: ignore[arg-type]
            return None
        self.entries.move_to_end(block_hash)
        return entry

    def admit(self, block_hash: bytes, token_ids: tuple[int, ...], plan: TransferPlan) -> str | None:
        """Make room for a block's file (deleting the LRU file) and index it; the file name, or
        None if the block is on disk already or the disk takes no writes now."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        if self.can_write is not None and not self.can_write():
            return None
        if len(self.entries) >= self.num_blocks:
            _, victim = self.entries.popitem(last=False)
            plan.add("delete", victim.location, None)
        name = disk_file_name(self.fingerprint, block_hash)
        self.entries[block_hash] = TierEntry(name, block_hash, token_ids, "disk")
        return name


class HostTier:
    """Host blocks: cached ones indexed by hash in LRU order, and private ones held by
    swapped-out requests. Evicting a cached block spills it to the disk tier, if any."""

    def __init__(self, num_blocks: int, disk: DiskTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.disk = disk
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self.cached: OrderedDict[bytes, TierEntry] = OrderedDict()  # LRU first
        self.pinned: set[bytes] = set()  # hits being brought back right now (within one call)
        self.num_private = 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def lookup(self, block_hash: bytes, token_ids: Sequence[int], plan: TransferPlan) -> TierEntry | None:
        """The host block holding this hash; a disk hit is first fetched into a host block."""
        entry = self.cached.get(block_hash)
        if entry is not None:
            if entry.token_ids != tuple(token_ids):
                return None
            self.cached.move_to_end(block_hash)
            entry.tier = "host"
            return entry
        if self.disk is None:
            return None
        on_disk = self.disk.lookup(block_hash, token_ids)
        if on_disk is None:
            return None
        host_id = self._take_free_id()
        if host_id is None:
            return None
        plan.add("fetch", on_disk.location, host_id)
        entry = TierEntry(host_id, block_hash, on_disk.token_ids, "disk")
        self.cached[block_hash] = entry
        return entry

    def offer(self, block_hash: bytes, token_ids: tuple[int, ...], plan: TransferPlan) -> int | None:
        """A host block to copy an evicted device block into, or None when the block is here
        already or no host block can be freed."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
            return None
        host_id = self._take_free_id()
        if host_id is None:
            return None
        self.cached[block_hash] = TierEntry(host_id, block_hash, token_ids)
        return host_id

    def allocate_private(self, num_blocks: int) -> list[int] | None:
        """Host blocks for a swapped-out request, evicting cached ones; None (changing
        nothing) when even evicting every cached block would not make room."""
        evictable = len(self.cached) - len(self.pinned)
        if num_blocks > len(self.free_ids) + evictable:
            return None
        ids = [self._take_free_id() for _ in range(num_blocks)]
        self.num_private += num_blocks
        return ids  # type: ignore[return-value]

    def free_private(self, host_ids: Sequence[int]) -> None:
        self.num_private -= len(host_ids)
        self.free_ids.extend(host_ids)

    def _take_free_id(self) -> int | None:
        if not self.free_ids and not self._evict_lru():
            return None
        return self.free_ids.pop()

    def _evict_lru(self) -> bool:
        victim = next((e for h, e in self.cached.items() if h not in self.pinned), None)
        if victim is None:
            return False
        del self.cached[victim.block_hash]
        self._spill(victim)
        self.free_ids.append(victim.location)  # type: ignore[arg-type]
        return True

    def _spill(self, entry: TierEntry) -> None:
        if self.disk is None:
            return
        name = self.disk.admit(entry.block_hash, entry.token_ids, self._plan)
        if name is not None:
            self._plan.add("spill", entry.location, (name, entry.block_hash, entry.token_ids))

    def bind(self, plan: TransferPlan) -> None:
        """The plan that spills and deletes are recorded into (the manager's)."""
        self._plan = plan


class PreemptionPolicy:
    """Chooses recompute or swap for a preempted request.

    `auto` compares the estimated cost of copying its blocks out and back with the cost of
    recomputing its tokens; both rates are exponential moving averages of what this engine
    measured (priors until then). A fixed per-swap overhead makes short contexts recompute.
    """

    SWAP_OVERHEAD_S = 2e-3  # resuming a swapped request costs at least one extra bookkeeping pass

    def __init__(
        self, mode: PreemptionMode, *, prior_forward_s_per_token: float = 2e-4, prior_copy_s_per_block: float = 5e-5
    ) -> None:
        if mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {mode!r}")
        self.mode = mode
        self.forward_s_per_token = prior_forward_s_per_token
        self.copy_s_per_block = prior_copy_s_per_block

    def choose(self, num_tokens: int, num_blocks: int) -> str:
        if self.mode != "auto":
            return self.mode
        copy = self.SWAP_OVERHEAD_S + 2 * num_blocks * self.copy_s_per_block
        recompute = num_tokens * self.forward_s_per_token
        return "swap" if copy < recompute else "recompute"

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        """A prefill-sized forward (decode-only steps price tokens far above a recompute's)."""
        if num_tokens >= 64 and seconds > 0:
            self.forward_s_per_token = 0.8 * self.forward_s_per_token + 0.2 * seconds / num_tokens

    def observe_copy(self, num_blocks: int, seconds: float) -> None:
        """Copies of `num_blocks` blocks that took `seconds`; like the forward rate, an
        exponential moving average, so the estimate follows what copies cost lately."""
        if num_blocks > 0 and seconds > 0:
            self.copy_s_per_block = 0.8 * self.copy_s_per_block + 0.2 * seconds / num_blocks
