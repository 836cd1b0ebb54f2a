"""How many bytes the KV pool takes: --kv-cache-memory as given, or by default (auto) a share of
the memory free once the weights are loaded (--kv-cache-memory-share, as vLLM's
--gpu-memory-utilization).

Free memory: on a GPU what the device reports free; on the CPU the host's available RAM
(/proc/meminfo's MemAvailable: free pages plus what the kernel can reclaim), at most what the
process's cgroup still allows (a container's limit). It is read once, at engine start, after the
weights are loaded, and never again: the pool does not change with the load of the moment. The
weights are counted out twice over nothing: the engine takes the smaller of the memory free after
the load and the memory free before it less the bytes the weights hold (a weight file mapped from
disk shows as reclaimable page cache, hence as available, though the model reads it every step).

Several engines on one host share it: the data-parallel replicas and the CPU ranks of a
tensor- or pipeline-parallel engine each take their part of the share. The pool's pages take no
RAM until a block is first written (pagoda.worker.paged_model allocates it lazily on the CPU), so
a large pool costs what the traffic uses of it. `pagoda plan` and the banner print the decision.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagoda.config import CacheConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVMemory:
    """The KV pool's bytes on one rank, and where they come from."""

    bytes: int  # 0 with --num-kv-blocks (the blocks are counted, not the bytes)
    given: str = ""  # the flag that set the size ("--kv-cache-memory", "--num-kv-blocks"); "": the share
    share: float | None = None
    free_bytes: int | None = None  # the free memory the share is of (after the weights)
    parts: int = 1  # engines and ranks on this host the share is split between

    def describe(self) -> str:
        """How the banner and `pagoda plan` explain the pool's size."""
        if self.share is None or self.free_bytes is None:
            return self.given
        split = f", split {self.parts} ways" if self.parts > 1 else ""
        return f"{self.share:.0%} of the {_gib(self.free_bytes)} free after the weights{split}"


def kv_pool_memory(cache: CacheConfig, free_bytes: int | None, *, parts: int = 1) -> KVMemory:
    """The pool's bytes per rank: --num-kv-blocks' (counted in blocks: 0 here), --kv-cache-memory,
    else the share of `free_bytes` (the memory free after the weights) split `parts` ways.
    ValueError when auto has no free memory to share."""
    if cache.num_kv_blocks is not None:
        return KVMemory(0, "--num-kv-blocks")
    given = cache.kv_cache_bytes
    if given is not None:
        return KVMemory(given, "--kv-cache-memory")
    if free_bytes is None or free_bytes <= 0:
        raise ValueError(
            f"--kv-cache-memory auto: no memory is free after the weights ({_gib(free_bytes or 0)}): "
            "give --kv-cache-memory or --num-kv-blocks"
        )
    share = cache.kv_cache_memory_share
    return KVMemory(int(share * free_bytes) // max(1, parts), "", share, free_bytes, max(1, parts))


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on `device` now: the GPU's free bytes, or the host's available RAM within the
    process's cgroup limit."""
    if device.type == "cuda":
        import torch  # only here: `pagoda plan` on a CPU never loads it for this

        return int(torch.cuda.mem_get_info(device)[0])
    available = _meminfo_available()
    room = _cgroup_room()
    return min(available, room) if room is not None else available


def free_after_weights(before: int, after: int, weight_bytes: int) -> int:
    """The memory free once the weights are loaded: what is free after the load, at most what was
    free before it less the weights' bytes (mapped weights count as reclaimable, not as used)."""
    return max(0, min(after, before - weight_bytes))


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_room() -> int | None:
    """What the process's cgroup still allows (v2 memory.max - memory.current, or v1's limit -
    usage); None without a limit."""
    pairs = (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    )
    for limit_path, usage_path in pairs:
        try:
            limit_text = Path(limit_path).read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 2**60:  # cgroup v1's "no limit"
            return None
        return max(0, limit - usage)
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
