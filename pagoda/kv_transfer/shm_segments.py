"""Shared-memory segments of the shm KV transport, reused across handoffs.

A fresh segment per handoff (create, fault its pages in, copy, unlink) cost the shm transport
more than the copy itself: it ran at half TCP's speed (benchmarks/kv_transfer.py). So a sender
keeps its segments in a pool, one going back once the receiver has acknowledged the handoff
(it has copied every block out), and a receiver keeps its mappings of recently used segments.
A segment whose handoff failed is unlinked, never reused: the receiver may still be reading it.

Segments are created through multiprocessing.shared_memory, whose resource tracker unlinks any
a killed engine process leaves behind when the server exits.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from collections import OrderedDict
from multiprocessing import shared_memory

_GRANULE = 1 << 20  # segment sizes are rounded up to this, so different sizes reuse segments
DEFAULT_POOL_BYTES = 256 << 20  # free segments a sender keeps at most


class ShmSegments:
    """A sender's pool of shared-memory segments (thread-safe: sends run on several threads)."""

    def __init__(self, max_free_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: list[shared_memory.SharedMemory] = []
        self._lock = threading.Lock()
        self._closed = False
        self.num_created = 0  # segments created since start (the pool's misses)

    def acquire(self, size: int) -> shared_memory.SharedMemory:
        """A segment of at least `size` bytes: the smallest free one that fits, else a new one."""
        with self._lock:
            fitting = [s for s in self._free if s.size >= size]
            if fitting:
                segment = min(fitting, key=lambda s: s.size)
                self._free.remove(segment)
                return segment
            self.num_created += 1
        size = -(-max(size, 1) // _GRANULE) * _GRANULE
        return shared_memory.SharedMemory(
            create=True, size=size, name=f"pagoda-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        )

    def release(self, segment: shared_memory.SharedMemory) -> None:
        """The receiver acknowledged the handoff: the segment may serve the next one."""
        with self._lock:
            if self._closed:  # a send that outlived close()
                _unlink(segment)
                return
            self._free.append(segment)
            while sum(s.size for s in self._free) > self.max_free_bytes and self._free:
                _unlink(self._free.pop(0))

    def discard(self, segment: shared_memory.SharedMemory) -> None:
        """The handoff failed: the receiver may still read the segment, so it is not reused."""
        _unlink(segment)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for segment in free:
            _unlink(segment)


def _unlink(segment: shared_memory.SharedMemory) -> None:
    segment.close()
    try:
        segment.unlink()
    except FileNotFoundError:
        pass


class MappedSegment:
    """A sender's segment mapped by the receiver without taking ownership (the sender unlinks
    it; multiprocessing's SharedMemory would register it with this process's resource tracker,
    which would unlink it, or complain, at exit — Python < 3.13 cannot turn that off)."""

    def __init__(self, name: str) -> None:
        import _posixshmem  # type: ignore[import-not-found]  # CPython's own, without a stub; shared_memory uses it

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)
        self.users = 0

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


class SegmentMaps:
    """A receiver's mappings of the segments it read lately, so a reused segment is not mapped
    (and its pages faulted in) again. Mappings of segments their sender has unlinked since are
    dropped; at most `capacity` idle ones are kept."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._maps: OrderedDict[str, MappedSegment] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, name: str) -> MappedSegment:
        """The segment's mapping, held until `done` (FileNotFoundError if it is gone)."""
        with self._lock:
            segment = self._maps.pop(name, None)
            if segment is None:
                segment = MappedSegment(name)
            self._maps[name] = segment
            segment.users += 1
            self._trim()
            return segment

    def done(self, segment: MappedSegment) -> None:
        with self._lock:
            segment.users -= 1
            self._trim()

    def close(self) -> None:
        with self._lock:
            for segment in self._maps.values():
                if segment.users == 0:
                    segment.close()
            self._maps.clear()

    def _trim(self) -> None:
        for name, segment in list(self._maps.items()):
            if segment.users == 0 and not os.path.exists(f"/dev/shm/{name}"):
                del self._maps[name]  # unlinked by its sender: never reused again
                segment.close()
        idle = [name for name, segment in self._maps.items() if segment.users == 0]
        while len(self._maps) > self.capacity and idle:
            self._maps.pop(idle.pop(0)).close()
