"""The KV pool's bytes: --kv-cache-memory, --num-kv-blocks, or by default a share of the memory free
after the weights; what `pagoda plan` and an engine report of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.config import DEFAULT_MODEL_DIR, CacheConfig
from pagoda.core import kv_memory
from pagoda.core.kv_memory import KVMemory, free_after_weights, kv_pool_memory
from pagoda.core.kv_plan import KVPoolPlan

GIB = 2**30


def test_auto_takes_the_share_of_the_free_memory_split_between_the_engines() -> None:
    memory = kv_pool_memory(CacheConfig(), 10 * GIB)
    assert memory == KVMemory(5 * GIB, "", 0.5, 10 * GIB, 1)
    assert memory.describe() == "50% of the 10.0 GiB free after the weights"
    split = kv_pool_memory(CacheConfig(kv_cache_memory_share=0.8), 10 * GIB, parts=2)
    assert split.bytes == 4 * GIB and split.describe().endswith("split 2 ways")
    with pytest.raises(ValueError, match="no memory is free after the weights"):
        kv_pool_memory(CacheConfig(), 0)


def test_an_explicit_size_wins() -> None:
    assert kv_pool_memory(CacheConfig(kv_cache_memory="64MiB"), 10 * GIB) == KVMemory(64 * 2**20, "--kv-cache-memory")
    assert kv_pool_memory(CacheConfig(num_kv_blocks=40), 10 * GIB) == KVMemory(0, "--num-kv-blocks")


def test_the_share_is_checked() -> None:
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="kv_cache_memory_share"):
            CacheConfig(kv_cache_memory_share=share)
    with pytest.raises(ValueError, match="must be auto or a positive size"):
        CacheConfig(kv_cache_memory="lots")


def test_weights_are_counted_out_once() -> None:
    # Loaded into the process's own memory: the free memory after the load already lacks them.
    assert free_after_weights(before=10 * GIB, after=8 * GIB, weight_bytes=2 * GIB) == 8 * GIB
    # Mapped from a file: they show as reclaimable page cache, so the free memory barely moved.
    assert free_after_weights(before=10 * GIB, after=10 * GIB, weight_bytes=2 * GIB) == 8 * GIB
    assert free_after_weights(before=1 * GIB, after=1 * GIB, weight_bytes=2 * GIB) == 0


def test_a_cgroup_limit_bounds_the_free_host_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch

    (tmp_path / "memory.max").write_text("3221225472\n")  # 3 GiB
    (tmp_path / "memory.current").write_text("1073741824\n")  # 1 GiB used
    real_path = kv_memory.Path
    names = {"/sys/fs/cgroup/memory.max": "memory.max", "/sys/fs/cgroup/memory.current": "memory.current"}
    monkeypatch.setattr(kv_memory, "Path", lambda p: tmp_path / names[p] if p in names else real_path(p))
    monkeypatch.setattr(kv_memory, "_meminfo_available", lambda: 16 * GIB)
    assert kv_memory.free_memory_bytes(torch.device("cpu")) == 2 * GIB
    (tmp_path / "memory.max").write_text("max\n")
    assert kv_memory.free_memory_bytes(torch.device("cpu")) == 16 * GIB


def test_the_banner_line_says_the_bytes_and_where_they_come_from() -> None:
    def plan(num_blocks: int, memory: KVMemory) -> KVPoolPlan:
        return KVPoolPlan([], None, 2**20, num_blocks, memory)

    assert plan(1024, KVMemory(0, "--num-kv-blocks")).describe_memory() == "1.00 GiB (--num-kv-blocks)"
    share = KVMemory(GIB, "", 0.5, 2 * GIB)
    assert plan(1024, share).describe_memory() == "1.00 GiB (50% of the 2.0 GiB free after the weights)"
    assert plan(16, share).describe_memory().endswith("all that --max-num-seqs sequences can use)")


def test_plan_and_an_engine_report_the_share() -> None:
    from pagoda import LLM
    from pagoda import plan as P

    rendered = P.render_plan(
        P.plan_from_options(P.PlanOptions(model=str(DEFAULT_MODEL_DIR), kv_cache_memory_share=0.25))
    )
    (line,) = [line for line in rendered.splitlines() if line.startswith("KV pool")]
    assert "25% of the" in line and "free after the weights" in line
    assert "full-context sequences that fit at once" in rendered
    llm = LLM(model=str(DEFAULT_MODEL_DIR), num_threads=1, kv_cache_memory_share=0.25)
    assert "25% of the" in llm.engine.core.kv_pool_memory
