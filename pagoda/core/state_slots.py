"""StateSlots: the slots of a hybrid model's state cache, one per running sequence.

A linear-attention layer's state does not grow with the sequence: each sequence holds one slot
(its convolution windows and recurrent states in every linear layer, allocated by
pagoda.worker.state_cache) from admission to its end. The KV cache manager takes a slot when it
first gives a request blocks and returns it with them (finish, abort, preemption: a preempted
sequence recomputes from its first token, its state from zeros). A forked sample gets a slot of
its own holding a copy of its lead's state, copied before the next forward like copy-on-write
blocks. The engine runs at most as many sequences as there are slots (pagoda.core.kv_plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.config import CacheConfig, SchedulerConfig

if TYPE_CHECKING:
    from pagoda.model.model_config import ModelConfig


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a hybrid model's state cache needs at least one slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot: the engine admits no more sequences than slots")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def fork(self, slot: int) -> int:
        """A new slot for a forked sample, to hold a copy of `slot`'s state."""
        child = self.allocate()
        self._pending_copies.append((slot, child))
        return child

    def copy(self, source: int, destination: int) -> None:
        """Copy a slot's state (a snapshot restored into a sequence's slot) before the next forward."""
        self._pending_copies.append((source, destination))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source slot, destination slot) copies to run before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies


@dataclass(frozen=True)
class StatePlan:
    """A hybrid model's state cache: a slot per sequence, and as many snapshot slots with prefix
    caching (pagoda.core.state_snapshots), each of `bytes_per_slot`."""

    num_slots: int = 0
    num_snapshots: int = 0
    bytes_per_slot: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.num_slots + self.num_snapshots) * self.bytes_per_slot


def plan_state_slots(
    cache: CacheConfig, scheduler: SchedulerConfig, model_config: ModelConfig, element_bytes: int, pool_bytes: int
) -> StatePlan:
    """A hybrid model's state cache inside the KV budget (`pool_bytes`, pagoda.core.kv_memory): one slot per
    sequence --max-num-seqs allows (and one snapshot slot each with prefix caching), in at most
    half the budget (the rest holds the attention layers' KV blocks); unset, as many sequences as
    that half holds, up to its ceiling. Empty for a model without recurrent layers."""
    linear = model_config.linear_attention
    if linear is None:
        return StatePlan()
    per_slot = linear.state_bytes(element_bytes)
    copies = 2 if cache.enable_prefix_caching else 1
    if cache.num_kv_blocks is not None:  # a pool given in blocks: the state is counted apart
        slots = scheduler.max_num_seqs_bound
        return StatePlan(slots, slots * (copies - 1), per_slot)
    fit = pool_bytes // 2 // (per_slot * copies)
    what = " and its prefix-cache snapshot" if copies == 2 else ""
    if scheduler.max_num_seqs is not None and scheduler.max_num_seqs > fit:
        raise ValueError(
            f"the recurrent state{what} of {scheduler.max_num_seqs} sequences (--max-num-seqs) takes "
            f"{scheduler.max_num_seqs * per_slot * copies:,} bytes ({per_slot:,} each), more than half of "
            f"the KV memory ({pool_bytes:,} bytes): lower --max-num-seqs or raise --kv-cache-memory"
        )
    if fit < 1:
        raise ValueError(
            f"the KV memory ({pool_bytes:,} bytes) cannot hold one sequence's recurrent state{what} "
            f"({per_slot * copies:,} bytes) in half of it"
        )
    slots = min(scheduler.max_num_seqs_bound, fit)
    return StatePlan(slots, slots * (copies - 1), per_slot)
