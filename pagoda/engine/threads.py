"""How many CPU threads the engine computes with: the one owner of that decision.

Two facts drive it (MEASURED.md, "the thread trap"):
- OpenMP workers that spin while idle steal the cores other threads need; a decode step then
  slows 25-100x. `prefer_passive_omp_wait` makes them sleep instead; it only works before
  torch is first imported, so `pagoda/__init__.py` calls it, and a spawned engine process
  inherits the setting through its environment.
- A server's engine shares the machine with its HTTP event loop (requests, tokenization, SSE):
  spread over every core it stalls whenever that loop wants one. So a serving engine leaves
  one core free (the rest split between `--data-parallel-size` replicas); the offline engine
  (`LLM`), with no loop beside it, keeps the process's torch setting (torch's default: every
  core; a caller may have lowered it, as the tests do).
`--num-threads` overrides both defaults.

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
    """Intra-op threads: as configured, else every core but one when serving (the spare one
    for the event loop), split between the data-parallel replicas; None offline: keep the
    process's torch setting."""
    if config.num_threads is not None:
        return config.num_threads
    if not serving:
        return None
    return max(1, (available_cores() - 1) // config.data_parallel_size)


def set_engine_threads(config: EngineConfig, *, serving: bool) -> int:
    """Apply `engine_thread_count` to torch on the calling thread; returns the count in use."""
    import torch

    count = engine_thread_count(config, serving=serving)
    if count is not None:
        torch.set_num_threads(count)
    return torch.get_num_threads()
