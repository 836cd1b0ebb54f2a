"""The device slots: which loaded adapters sit in the layers' stacked weights, LRU over
`--max-loras`. The rest of the loaded adapters wait in host memory (the registry)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SlotTable:
    """load id -> slot, least recently used first. `assign` finds slots for one step's
    adapters, reusing resident ones and evicting the least recently used adapters the step
    does not need; it reports which adapters must be copied into which slots."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._resident: OrderedDict[int, int] = OrderedDict()  # load id -> slot, LRU first
        self.num_loads = 0  # adapters copied into a slot since start (evictions + first loads)

    def __contains__(self, load_id: int) -> bool:
        return load_id in self._resident

    def slot_of(self, load_id: int) -> int:
        return self._resident[load_id]

    def assign(self, load_ids: Iterable[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for the step's adapters, and the (load id, slot) copies needed first."""
        wanted = list(dict.fromkeys(load_ids))
        if len(wanted) > self.num_slots:
            raise ValueError(f"a step holds {len(wanted)} adapters but there are {self.num_slots} slots")
        for load_id in wanted:
            if load_id in self._resident:
                self._resident.move_to_end(load_id)
        free = sorted(set(range(self.num_slots)) - set(self._resident.values()))
        copies = []
        for load_id in wanted:
            if load_id in self._resident:
                continue
            if free:
                slot = free.pop(0)
            else:
                victim = next(v for v in self._resident if v not in wanted)
                slot = self._resident.pop(victim)
            self._resident[load_id] = slot
            copies.append((load_id, slot))
        self.num_loads += len(copies)
        return {load_id: self._resident[load_id] for load_id in wanted}, copies

    def evict(self, load_id: int) -> None:
        """Forget an adapter that is gone (unloaded and no request uses it any more)."""
        self._resident.pop(load_id, None)
