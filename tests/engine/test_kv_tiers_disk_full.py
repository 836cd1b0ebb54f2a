"""A full disk tier: one warning per condition with a count, no writes until space returns,
real usage in the metrics, clamped to the free space at startup, outputs unchanged."""

from __future__ import annotations

import errno
import logging
import subprocess

import pytest

from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
from pagoda.kv_transfer import disk_store
from pagoda.kv_transfer.disk_store import DiskStore, file_bytes
from test_kv_tiers_disk import engine, run
from test_kv_tiers_engine import assert_tiers_idle, block_bytes, distinct_prompts

LOGGERS = ("pagoda.kv_transfer.disk_store", "pagoda.kv_transfer.tiers")


def logged(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name in LOGGERS and r.levelno == level]


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def write(store: DiskStore, i: int) -> None:
    import torch

    store.write(f"{i:040x}.kv", bytes([i % 256]) * 16, [1, 2, 3], [torch.zeros(64)])


def test_a_burst_of_enospc_warns_once_stops_writing_and_resumes_when_space_returns(tmp_path, monkeypatch, caplog):
    store = DiskStore(tmp_path / "kv", b"fp")
    attempts = []
    monkeypatch.setattr(disk_store, "SPACE_RECHECK_S", 0.0)  # check free space at every write
    monkeypatch.setattr(store, "_write_file", lambda *a: (attempts.append(a), no_space()))
    monkeypatch.setattr(store, "free_bytes", lambda: 0)
    with caplog.at_level(logging.INFO, logger="pagoda.kv_transfer.disk_store"):
        for i in range(50):
            write(store, i)
        assert len(logged(caplog, logging.WARNING)) == 1 and "no space left" in logged(caplog, logging.WARNING)[0]
        assert len(attempts) == 1 and store.full and not store.can_write()  # stopped writing
        assert store.failures == {"ENOSPC": 50} and not store.written
        assert not list((tmp_path / "kv").iterdir())  # no temporary file left
        monkeypatch.undo()  # space returns
        write(store, 99)
    assert store.is_written(f"{99:040x}.kv") and not store.full
    [resumed] = logged(caplog, logging.INFO)
    assert "again" in resumed and "50 (ENOSPC)" in resumed
    assert len(logged(caplog, logging.WARNING)) == 1


def test_engine_on_a_full_disk_serves_the_same_outputs_and_reports_real_usage(llama_dir, tmp_path, monkeypatch, caplog):
    prompts = distinct_prompts(5, 40, seed=5)
    expected, _ = run(EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=8, max_num_seqs=1)), prompts)
    monkeypatch.setattr(DiskStore, "_write_file", lambda self, *a: no_space())
    monkeypatch.setattr(DiskStore, "free_bytes", lambda self: 10**12)  # room at startup, then a full disk
    with caplog.at_level(logging.INFO, logger="pagoda.kv_transfer"):
        core = engine(llama_dir, tmp_path / "kv", persist=False)
        monkeypatch.setattr(DiskStore, "free_bytes", lambda self: 0)
        for _ in range(3):
            assert run(core, prompts)[0] == expected
        core.kv_tiers.transfer.flush()
    assert len(logged(caplog, logging.WARNING)) == 1
    store = core.kv_tiers.disk_store
    assert store.full and sum(store.failures.values()) >= 1
    assert len(core.kv_tiers.disk) <= 1  # nothing admitted while the disk is full
    assert core.stats().kv_tiers.usage["disk"] == 0.0  # nothing is on disk
    assert_tiers_idle(core)
    core.close()


def test_startup_clamps_the_disk_tier_to_the_free_space(llama_dir, tmp_path, monkeypatch, caplog):
    per_file = file_bytes(block_bytes(llama_dir), 16)
    monkeypatch.setattr(DiskStore, "free_bytes", lambda self: 3 * per_file + 10)
    with caplog.at_level(logging.WARNING, logger="pagoda.kv_transfer.tiers"):
        core = engine(llama_dir, tmp_path / "kv", persist=False)  # configured: 64 blocks
    assert core.kv_tiers.disk.num_blocks == 3
    [warning] = logged(caplog, logging.WARNING)
    assert "room for 3 blocks" in warning and "--kv-offload-disk-size" in warning
    core.close()
    monkeypatch.setattr(DiskStore, "free_bytes", lambda self: per_file // 2)
    with pytest.raises(ValueError, match="not one KV block file"):
        engine(llama_dir, tmp_path / "kv2", persist=False)


def test_a_small_real_tmpfs(llama_dir, tmp_path, caplog):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    per_file = file_bytes(block_bytes(llama_dir), 16)
    size_kib = max(64, 6 * -(-per_file // 4096) * 4)  # room for a handful of blocks, far below the configured 64
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here")
    try:
        prompts = distinct_prompts(5, 40, seed=5)
        expected, _ = run(EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=8, max_num_seqs=1)), prompts)
        with caplog.at_level(logging.INFO, logger="pagoda.kv_transfer"):
            core = engine(llama_dir, mount / "kv", persist=False)
            assert core.kv_tiers.disk.num_blocks < 64
            for _ in range(2):
                assert run(core, prompts)[0] == expected
            core.kv_tiers.transfer.flush()
        usage = core.stats().kv_tiers.usage["disk"]
        assert usage == len(list((mount / "kv").glob("*.kv"))) / core.kv_tiers.disk.num_blocks
        assert len(logged(caplog, logging.WARNING)) <= 2  # the clamp, and at most one full-disk warning
        core.close()
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_the_files_of_a_killed_engine_are_removed_older_ones_kept(tmp_path):
    import os
    import time

    from pagoda.kv_transfer.disk_store import remove_files_written_since

    directory = tmp_path / "kv"
    directory.mkdir()
    persisted = directory / f"{1:040x}.kv"
    persisted.write_bytes(b"an earlier run's block")
    os.utime(persisted, (1000.0, 1000.0))
    started = time.time() - 0.5  # the killed engine's start
    for name in (f"{2:040x}.kv", f"{3:040x}.kv.tmp"):
        (directory / name).write_bytes(b"written by the killed engine")
    (directory / "notes.txt").write_text("not a block file")
    assert remove_files_written_since(directory, started) == 2
    assert sorted(p.name for p in directory.iterdir()) == [persisted.name, "notes.txt"]
    assert remove_files_written_since(tmp_path / "missing", started) == 0
