"""The engine's thread count: every core the process may use (affinity, cgroup quota), split between
the replicas and ranks, or --num-threads."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.config import EngineConfig
from pagoda.engine import threads


@pytest.fixture
def six_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(6)))
    monkeypatch.setattr(threads, "_cgroup_cpu_quota", lambda: None)


def config(tmp_path: Path, **fields) -> EngineConfig:
    return EngineConfig(model=str(tmp_path), **fields)


def test_a_serving_engine_computes_on_every_core(tmp_path: Path, six_cores: None) -> None:
    assert threads.engine_thread_count(config(tmp_path), serving=True) == 6
    assert threads.engine_thread_count(config(tmp_path, num_replicas=2), serving=True) == 3
    assert threads.engine_thread_count(config(tmp_path, tensor_parallel_size=2), serving=True) == 3
    assert threads.engine_thread_count(config(tmp_path, num_threads=4), serving=True) == 4  # explicit wins
    assert threads.engine_thread_count(config(tmp_path), serving=False) is None  # offline: torch's own


def test_the_cgroup_quota_bounds_the_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(threads, "_cgroup_cpu_quota", lambda: 3)  # --cpus 2.5 rounds up
    assert threads.available_cores() == 3
    assert threads.engine_thread_count(config(tmp_path), serving=True) == 3
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})  # taskset narrower than the quota
    assert threads.available_cores() == 2


def test_cgroup_cpu_max_is_read_in_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    real_path = threads.Path
    monkeypatch.setattr(threads, "Path", lambda p: cpu_max if p == "/sys/fs/cgroup/cpu.max" else real_path(p))
    cpu_max.write_text("250000 100000\n")
    assert threads._cgroup_cpu_quota() == 3
    cpu_max.write_text("max 100000\n")
    assert threads._cgroup_cpu_quota() is None
