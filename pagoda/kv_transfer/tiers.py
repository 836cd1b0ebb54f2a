"""Building, running and closing the KV tiers of one engine: the host tier (and disk tier)
bookkeeping of pagoda.core.kv_tiers joined to the copies of pagoda.kv_transfer."""

from __future__ import annotations

import hashlib
import logging
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.config import CacheConfig, EngineConfig, parse_bytes
from pagoda.core.kv_tiers import DiskTier, HostTier, PreemptionPolicy
from pagoda.kv_transfer.disk_store import DiskStore, file_bytes

if TYPE_CHECKING:
    import torch

    from pagoda.kv_transfer.block_transfer import BlockTransfer

logger = logging.getLogger(__name__)


@dataclass
class KVTierStats:
    """Snapshot for metrics: tier usage (0..1), prompt tokens found per tier, bytes copied per
    direction, requests swapped out now, preemptions per mode."""

    usage: dict[str, float] = field(default_factory=dict)  # "host", "disk"
    hits: dict[str, int] = field(default_factory=dict)  # "device", "host", "disk"
    transfer_bytes: dict[str, int] = field(default_factory=dict)  # "device_to_host", "host_to_device"
    num_swapped: int = 0
    preemptions: dict[str, int] = field(default_factory=dict)  # "recompute", "swap"


def model_fingerprint(config: EngineConfig, dtype_name: str) -> bytes:
    """Identity of everything a block's contents depend on besides its tokens: the model's
    config and weight files (names and sizes; a GGUF file stands for both), the draft model's,
    dtype, block size, and the weight quantization and KV cache dtype (both change the stored K/V)."""
    h = hashlib.blake2b(digest_size=16)
    for model_path in filter(None, (config.model, config.draft_model)):
        path = Path(model_path)
        if path.is_file():  # a GGUF file: config and weights in one
            h.update(f"{path.name}:{path.stat().st_size}".encode())
            continue
        if (path / "config.json").is_file():
            h.update((path / "config.json").read_bytes())
        weight_files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")) + sorted(path.glob("*.gguf"))
        for weights in weight_files:
            h.update(f"{weights.name}:{weights.stat().st_size}".encode())
    h.update(f"{dtype_name}|{config.block_size}".encode())
    h.update(
        f"|{config.quantization}:{config.quantization_group_size}:{config.quantization_zero_point}"
        f"|kv {config.kv_cache_dtype}".encode()
    )
    return h.digest()


def num_host_blocks(config: CacheConfig, bytes_per_block: int) -> int:
    """Blocks the host tier holds (0 when off); what `pagoda plan` should report for it."""
    if config.kv_offload_memory is None:
        return 0
    blocks = config.kv_offload_bytes // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"kv_offload_memory {config.kv_offload_memory} holds no KV block ({bytes_per_block} bytes each)"
        )
    return blocks


def num_disk_blocks(config: CacheConfig, bytes_per_block: int) -> int:
    if config.kv_offload_disk is None:
        return 0
    blocks = parse_bytes(config.kv_offload_disk_size) // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"kv_offload_disk_size {config.kv_offload_disk_size} holds no KV block ({bytes_per_block} bytes each)"
        )
    return blocks


class KVTiers:
    """The engine's tiers: bookkeeping for the scheduler, copies for the runner."""

    def __init__(self, config: CacheConfig, bytes_per_block: int, fingerprint: bytes) -> None:
        """`fingerprint`: model_fingerprint of the engine, the identity of a disk tier's blocks."""
        self.config = config
        self.disk_store: DiskStore | None = None
        disk = None
        if config.kv_offload_disk is not None:
            self.disk_store = DiskStore(config.kv_offload_disk, fingerprint)
            existing = self.disk_store.scan() if config.kv_offload_disk_persist else []
            if not config.kv_offload_disk_persist:  # an engine dropped without close() cleans up too
                self._remove_files = weakref.finalize(self, self.disk_store.remove_all)
            disk = DiskTier(
                self._disk_blocks_that_fit(num_disk_blocks(config, bytes_per_block), bytes_per_block, len(existing)),
                fingerprint,
                existing,
                is_written=self.disk_store.is_written,
                can_write=self.disk_store.can_write,
            )
            for name, _, _ in existing[: max(0, len(existing) - disk.num_blocks)]:
                self.disk_store.delete(name)  # the oldest beyond this run's capacity
            if existing:
                logger.info("disk KV tier: reusing %d persisted blocks", len(disk))
        self.host = HostTier(num_host_blocks(config, bytes_per_block), disk)
        self.disk = disk
        self.policy = PreemptionPolicy(config.preemption_mode)
        self.transfer: BlockTransfer | None = None
        # The transfer's cumulative load totals the policy has already seen.
        self._observed_load_blocks = 0
        self._observed_load_seconds = 0.0

    def _disk_blocks_that_fit(self, configured: int, bytes_per_block: int, num_existing: int) -> int:
        """`configured` (--kv-offload-disk-size in blocks), or fewer with a warning when the file
        system has no room for that many (the files this run adopts count as room)."""
        assert self.disk_store is not None
        per_file = file_bytes(bytes_per_block, self.config.block_size)
        try:
            free = self.disk_store.free_bytes()
        except OSError as exc:
            raise ValueError(
                f"kv_offload_disk {self.config.kv_offload_disk}: cannot read its free space ({exc})"
            ) from None
        fits = (free + num_existing * per_file) // per_file
        if fits >= configured:
            return configured
        if fits < 1:
            raise ValueError(
                f"kv_offload_disk {self.config.kv_offload_disk} has {free} bytes free: not one KV "
                f"block file ({per_file} bytes) fits; free some space or leave out --kv-offload-disk"
            )
        logger.warning(
            "disk KV tier: %s has room for %d blocks (%d bytes free), fewer than "
            "--kv-offload-disk-size %s (%d blocks): using %d",
            self.config.kv_offload_disk,
            fits,
            free,
            self.config.kv_offload_disk_size,
            configured,
            fits,
        )
        return fits

    def attach(self, device_caches: list[torch.Tensor]) -> BlockTransfer:
        """Allocate the host tensors mirroring the device caches (every layer's keys and values,
        the draft model's included)."""
        from pagoda.kv_transfer.block_transfer import BlockTransfer

        self.transfer = BlockTransfer(device_caches, self.host.num_blocks, self.disk_store)
        return self.transfer

    def observe_step(self, num_batched_tokens: int, forward_seconds: float) -> None:
        """Feed the auto preemption policy with this engine's own forward and copy rates: the
        step's forward, and the host-to-device loads issued since the last step."""
        self.policy.observe_forward(num_batched_tokens, forward_seconds)
        if self.transfer is not None:
            stats = self.transfer.stats
            self.policy.observe_copy(
                stats.blocks_to_device - self._observed_load_blocks,
                stats.seconds_to_device - self._observed_load_seconds,
            )
            self._observed_load_blocks = stats.blocks_to_device
            self._observed_load_seconds = stats.seconds_to_device

    def stats(self, hits: dict[str, int], num_swapped: int, preemptions: dict[str, int]) -> KVTierStats:
        usage = {"host": self.host.usage}
        if self.disk is not None and self.disk_store is not None:
            # Files actually on disk: an indexed block whose write failed or is still queued holds no space.
            usage["disk"] = min(1.0, len(self.disk_store.written) / self.disk.num_blocks)
        moved = self.transfer.stats if self.transfer is not None else None
        return KVTierStats(
            usage=usage,
            hits=dict(hits),
            num_swapped=num_swapped,
            preemptions=dict(preemptions),
            transfer_bytes={
                "device_to_host": moved.bytes_to_host if moved else 0,
                "host_to_device": moved.bytes_to_device if moved else 0,
            },
        )

    def close(self) -> None:
        """Finish queued copies; delete the disk tier's files unless they persist."""
        if self.transfer is not None:
            self.transfer.close()
        if self.disk_store is not None and not self.config.kv_offload_disk_persist:
            self._remove_files()
