"""Bulk copies of KV blocks between the device pool and the host tier's tensors.

Every copy moves a list of blocks with one gather and one scatter per cache tensor (a layer's
keys or values), never one copy per block. Ordering against the model's forward:

- store (device -> host): the gather out of the device pool runs at once, before the step's
  forward can overwrite the evicted blocks; the scatter into the host tensors runs on a worker
  thread (after the device-to-host copy, which on CUDA is issued on a side stream), so the step
  does not wait for it.
- load (host -> device): needed by this step's forward. It first waits only for pending stores
  into the host blocks it reads, then copies; on CUDA on the side stream, and the compute
  stream waits on its event (the host does not block).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda.core.kv_tiers import TransferOp
    from pagoda.kv_transfer.disk_store import DiskStore


def gather_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """The given blocks of every cache tensor, one index_select each (a copy, on the caches'
    device): the blocks may be reused as soon as this returns."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=caches[0].device)
    return [c.index_select(0, index) for c in caches]


def scatter_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int], data: Sequence[torch.Tensor]) -> None:
    """Write `data` (one tensor per cache, blocks first, as gather_blocks returns) into the
    given blocks, one index_copy_ per cache tensor."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=caches[0].device)
    with torch.inference_mode():
        for cache, block_data in zip(caches, data):
            cache.index_copy_(0, index, block_data.to(cache.device))


@dataclass
class TransferStats:
    """Cumulative bytes and seconds of issued copies, per direction."""

    bytes_to_host: int = 0
    bytes_to_device: int = 0
    seconds_to_host: float = 0.0  # the part of the store the step itself paid (the gather)
    seconds_to_device: float = 0.0
    blocks_to_host: int = 0
    blocks_to_device: int = 0


class BlockTransfer:
    """Host-side tensors mirroring the device caches, and the copies between them."""

    def __init__(
        self, device_caches: Sequence[torch.Tensor], num_host_blocks: int, disk: DiskStore | None = None
    ) -> None:
        if num_host_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_host_blocks}")
        self.device_caches = list(device_caches)
        self.device = self.device_caches[0].device
        self.num_host_blocks = num_host_blocks
        on_cuda = self.device.type == "cuda"
        # Pinned host memory lets CUDA copy asynchronously; on CPU it is plain memory.
        self.host_caches = [
            torch.zeros((num_host_blocks, *c.shape[1:]), dtype=c.dtype, device="cpu", pin_memory=on_cuda)
            for c in self.device_caches
        ]
        self.bytes_per_block = sum(c[0].numel() * c.element_size() for c in self.device_caches)
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-kv-transfer")
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}  # host block id -> its last unfinished store
        self.stats = TransferStats()
        self.disk = disk

    def run(self, ops: Sequence[TransferOp]) -> None:
        """Execute a step's tier copies in their recorded order."""
        for op in ops:
            if op.kind == "store":
                self.store(op.src, op.dst)
            elif op.kind == "load":
                self.load(op.src, op.dst)
            elif op.kind == "spill":
                self._spill(op.src, op.dst)
            elif op.kind == "fetch":
                self._fetch(op.src, op.dst)
            elif op.kind == "delete":
                self._delete(op.src)
            else:
                raise ValueError(f"unknown transfer kind {op.kind!r}")

    def _require_disk(self) -> DiskStore:
        if self.disk is None:
            raise RuntimeError("a disk-tier copy was planned but no disk tier is configured")
        return self.disk

    def _spill(self, host_ids: Sequence[int], files: Sequence[tuple[str, bytes, tuple[int, ...]]]) -> None:
        """Write host blocks to files on the transfer thread, after the stores queued before."""
        disk = self._require_disk()

        def write() -> None:
            for host_id, (name, block_hash, token_ids) in zip(host_ids, files):
                disk.write(name, block_hash, token_ids, [host[host_id] for host in self.host_caches])

        self._worker.submit(write)

    def _delete(self, names: Sequence[str]) -> None:
        """Delete files on the transfer thread, after the writes queued before."""
        disk = self._require_disk()
        names = list(names)

        def delete() -> None:
            for name in names:
                disk.delete(name)

        self._worker.submit(delete)

    def _fetch(self, names: Sequence[str], host_ids: Sequence[int]) -> None:
        """Read files into host blocks on the transfer thread; loads of them wait for it."""
        disk = self._require_disk()

        def read() -> None:
            for name, host_id in zip(names, host_ids):
                disk.read_into(name, [host[host_id] for host in self.host_caches])

        future = self._worker.submit(read)
        with self._lock:
            for host_id in host_ids:
                self._pending[host_id] = future
        future.add_done_callback(partial(self._forget, list(host_ids)))

    # ---- device -> host ------------------------------------------------------------------------

    def store(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> None:
        """Copy device blocks into host blocks. Returns once the device blocks may be reused."""
        if not device_ids:
            return
        started = time.perf_counter()
        src = torch.tensor(list(device_ids), dtype=torch.long, device=self.device)
        dst = torch.tensor(list(host_ids), dtype=torch.long)
        done_event = None
        if self.stream is None:
            staged = gather_blocks(self.device_caches, device_ids)
        else:
            compute = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(compute)  # the blocks' last writes come first
            with torch.cuda.stream(self.stream):
                gathered = [c.index_select(0, src) for c in self.device_caches]
                gather_done = torch.cuda.Event()
                gather_done.record(self.stream)
                staged = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in gathered]
                for host, g in zip(staged, gathered):
                    host.copy_(g, non_blocking=True)
                done_event = torch.cuda.Event()
                done_event.record(self.stream)
                for g in gathered:
                    g.record_stream(self.stream)
            compute.wait_event(gather_done)  # the forward may overwrite the blocks after the gather
        future = self._worker.submit(self._scatter_to_host, staged, dst, done_event)
        with self._lock:
            for host_id in host_ids:
                self._pending[host_id] = future
        future.add_done_callback(partial(self._forget, list(host_ids)))
        self.stats.bytes_to_host += len(device_ids) * self.bytes_per_block
        self.stats.blocks_to_host += len(device_ids)
        self.stats.seconds_to_host += time.perf_counter() - started

    def _scatter_to_host(
        self, staged: list[torch.Tensor], dst: torch.Tensor, done_event: torch.cuda.Event | None
    ) -> None:
        if done_event is not None:
            done_event.synchronize()
        with torch.inference_mode():
            for host, block_data in zip(self.host_caches, staged):
                host.index_copy_(0, dst, block_data)

    def _forget(self, host_ids: list[int], future: Future) -> None:
        with self._lock:
            for host_id in host_ids:
                if self._pending.get(host_id) is future:
                    del self._pending[host_id]

    # ---- host -> device ------------------------------------------------------------------------

    def load(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> None:
        """Copy host blocks into device blocks, ordered before the compute stream's next work."""
        if not host_ids:
            return
        started = time.perf_counter()
        self.wait(host_ids)
        src = torch.tensor(list(host_ids), dtype=torch.long)
        dst = torch.tensor(list(device_ids), dtype=torch.long, device=self.device)
        if self.stream is None:
            scatter_blocks(self.device_caches, device_ids, [host.index_select(0, src) for host in self.host_caches])
        else:
            staged = []
            for host in self.host_caches:
                buffer = torch.empty((len(host_ids), *host.shape[1:]), dtype=host.dtype, pin_memory=True)
                torch.index_select(host, 0, src, out=buffer)
                staged.append(buffer)
            compute = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(compute)  # earlier readers of the target blocks are done
            with torch.cuda.stream(self.stream):
                for device_cache, buffer in zip(self.device_caches, staged):
                    device_cache.index_copy_(0, dst, buffer.to(self.device, non_blocking=True))
                loaded = torch.cuda.Event()
                loaded.record(self.stream)
            compute.wait_event(loaded)
        self.stats.bytes_to_device += len(host_ids) * self.bytes_per_block
        self.stats.blocks_to_device += len(host_ids)
        self.stats.seconds_to_device += time.perf_counter() - started

    # ---- waiting -------------------------------------------------------------------------------

    def wait(self, host_ids: Sequence[int]) -> None:
        with self._lock:
            futures = {id(f): f for h in host_ids if (f := self._pending.get(h)) is not None}
        for future in futures.values():
            future.result()

    def wait_all(self) -> None:
        with self._lock:
            futures = list(self._pending.values())
        for future in futures:
            future.result()

    def flush(self) -> None:
        """Wait for every copy and file operation queued so far."""
        self._worker.submit(lambda: None).result()

    def close(self) -> None:
        self.wait_all()
        self._worker.shutdown(wait=True)
