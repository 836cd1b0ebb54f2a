"""How many CPU threads the engine computes with: the one owner of that decision.

Two facts drive it (MEASURED.md, "the thread trap"):
- OpenMP workers that spin while idle steal the cores other threads need; a decode step then
  slows by an order of magnitude or more. `prefer_passive_omp_wait` makes them sleep instead; it only works before
  torch is first imported, so `pagoda/__init__.py` calls it, and a spawned engine process
  inherits the setting through its environment.
- A server's engine shares the machine with its HTTP event loop (requests, tokenization, SSE):
  spread over every core it stalls whenever that loop wants one. So a serving engine leaves
  one core free (the rest split between `--data-parallel-size` replicas); the offline engine
  (`LLM`), with no loop beside it, keeps the process's torch setting (torch's default: every
  core; a caller may have lowered it, as the tests do).
`--num-threads` overrides both defaults.
- Tensor parallelism: the count above is the engine's total; each of the
  `tensor_parallel_size` ranks computes with its share (total // N, at least 1), rank 0 on the
  engine's thread and each worker process the same (offline, the total is every core). Ranks
  run their matmuls at the same time, so more threads each than cores in all would contend.
  Pipeline stages share the total the same way (tensor_parallel_size x pipeline_parallel_size
  ranks).

Torch's intra-op thread count is per calling thread, so whoever drives the engine calls
`set_engine_threads` on the thread that will step it.
"""

from __future__ import annotations

import os
import sys

from pagoda.config import EngineConfig


def prefer_passive_omp_wait() -> None:
    """Ask OpenMP to sleep, not spin, while idle (unless the user chose a policy)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def engine_thread_count(config: EngineConfig, *, serving: bool = True) -> int | None:
    """Intra-op threads of one rank: as configured, else every core but one when serving (the
    spare one for the event loop), split between the data-parallel replicas; None offline:
    keep the process's torch setting. With tensor parallelism, a replica's total is shared
    out between its ranks."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    if config.num_threads is not None:
        total = config.num_threads
    elif not serving and ranks == 1:
        return None
    else:
        total = max(1, (available_cores() - 1) // config.num_replicas) if serving else available_cores()
    return max(1, total // ranks)


def set_engine_threads(config: EngineConfig, *, serving: bool) -> int:
    """Apply `engine_thread_count` to torch on the calling thread; returns the count in use."""
    import torch

    count = engine_thread_count(config, serving=serving)
    if count is not None:
        torch.set_num_threads(count)
    return torch.get_num_threads()
