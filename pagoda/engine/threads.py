"""How many CPU threads the engine computes with, and how idle OpenMP workers wait: the one owner
of those decisions.

- Every core the process may use: a decode or prefill step is a few large products that torch
  splits between its intra-op threads, and the HTTP side (event loop, tokenization, SSE) is idle
  most of the time a step runs. So a serving engine, like the offline one, computes on every core
  available to the process (`available_cores`: its CPU affinity, at most its cgroup's CPU quota),
  split between the `--data-parallel-size` replicas of the host. `--num-threads` overrides it.
  benchmarks/threads.py compares one thread with every core side by side: every core decoded and
  prefilled faster and served more tokens under load, while /health under load stayed within the
  rounds' noise of one thread's (the HTTP side gets a core whenever the sleeping workers leave one;
  results/threads/).
  The offline engine (`LLM`) keeps the process's torch setting (torch's default: every core; a
  caller may have lowered it, as the tests do).
- Idle OpenMP workers sleep (OMP_WAIT_POLICY=PASSIVE) unless the user chose a policy. Spinning
  workers (ACTIVE) answer the next parallel region a little sooner on an otherwise idle machine,
  but they hold their cores between steps, which the HTTP side and every other process need:
  benchmarks/threads.py measures both policies side by side (c=1 inter-token latency, prefill,
  /health latency and throughput under load; results/threads/summary.json): on a machine shared
  with other work, ACTIVE lost on every measure, at one thread and at every core. The policy is read when torch is first
  imported, so `pagoda/__init__.py` sets it before that, and a spawned engine process inherits it
  through its environment.
- Tensor parallelism: the count above is the engine's total; each of the
  `tensor_parallel_size` ranks computes with its share (total // N, at least 1), rank 0 on the
  engine's thread and each worker process the same. Ranks run their matmuls at the same time, so
  more threads each than cores in all would contend. Pipeline stages share the total the same
  way (tensor_parallel_size x pipeline_parallel_size ranks).

Torch's intra-op thread count is per calling thread, so whoever drives the engine calls
`set_engine_threads` on the thread that will step it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pagoda.config import EngineConfig


def prefer_passive_omp_wait() -> None:
    """Ask OpenMP to sleep, not spin, while idle (unless the user chose a policy): the policy
    benchmarks/threads.py measured best beside an HTTP side and other work (see the module's doc)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def available_cores() -> int:
    """Cores this process may compute on: its CPU affinity (taskset, cpusets), at most its cgroup's
    CPU quota rounded up (a container's --cpus)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, quota)) if quota is not None else cores


def _cgroup_cpu_quota() -> int | None:
    """The cgroup's CPU quota in cores, rounded up (v2 cpu.max, v1 cfs_quota_us / cfs_period_us);
    None without one."""
    try:
        quota, _, period = Path("/sys/fs/cgroup/cpu.max").read_text().strip().partition(" ")
        if quota == "max":
            return None
        return -(-int(quota) // int(period))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return -(-quota_us // period_us) if quota_us > 0 and period_us > 0 else None


def engine_thread_count(config: EngineConfig, *, serving: bool = True) -> int | None:
    """Intra-op threads of one rank: as configured, else every available core, split between the
    data-parallel replicas when serving; None offline on one rank: keep the process's torch
    setting. With tensor or pipeline parallelism, a replica's total is shared out between its ranks."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    if config.num_threads is not None:
        total = config.num_threads
    elif not serving and ranks == 1:
        return None
    else:
        total = max(1, available_cores() // config.num_replicas) if serving else available_cores()
    return max(1, total // ranks)


def set_engine_threads(config: EngineConfig, *, serving: bool) -> int:
    """Apply `engine_thread_count` to torch on the calling thread; returns the count in use."""
    import torch

    count = engine_thread_count(config, serving=serving)
    if count is not None:
        torch.set_num_threads(count)
    return torch.get_num_threads()
