"""The disk KV tier: owner-only files named by salted hashes, matching the index, deleted at
clean shutdown unless persisted, and reused only by an engine with the same fingerprint."""

from __future__ import annotations

import re
import stat

import torch

from pagoda import SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.engine_request import EngineRequest
from test_kv_tiers_engine import assert_tiers_idle, block_bytes, distinct_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def run(core: EngineCore, prompts) -> tuple[list[list[int]], list[int]]:
    samples = [core.add_request(EngineRequest(f"p{i}-{id(prompts)}", p, GREEDY))[0] for i, p in enumerate(prompts)]
    while core.has_unfinished_requests():
        core.step()
    for sample in samples:
        core.release(sample.parent_id)
    return [s.output_token_ids for s in samples], [s.num_cached_tokens for s in samples]


def engine(model_dir, disk_dir, persist: bool) -> EngineCore:
    per_block = block_bytes(model_dir)
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            num_kv_blocks=8,
            max_num_seqs=1,
            kv_offload_memory=str(4 * per_block),
            kv_offload_disk=str(disk_dir),
            kv_offload_disk_size=str(64 * per_block),
            kv_offload_disk_persist=persist,
        )
    )


def disk_files(directory) -> set[str]:
    return {p.name for p in directory.iterdir()}


def assert_disk_matches_index(core: EngineCore, directory) -> None:
    core.kv_tiers.transfer.flush()
    indexed = {e.location for e in core.kv_tiers.disk.entries.values()}
    assert disk_files(directory) == indexed


def test_disk_tier_spills_persists_and_respects_the_fingerprint(model_dirs, tmp_path):
    llama = model_dirs["llama"]
    disk_dir = tmp_path / "kv"
    prompts = distinct_prompts(5, 40, seed=5)
    baseline = EngineCore(EngineConfig(model=str(llama), num_kv_blocks=8, max_num_seqs=1))
    expected, _ = run(baseline, prompts)

    first = engine(llama, disk_dir, persist=True)
    outputs, _ = run(first, prompts)
    assert outputs == expected
    assert len(first.kv_tiers.disk) > 0  # the 4-block host tier spilled to disk
    assert_disk_matches_index(first, disk_dir)
    assert stat.S_IMODE(disk_dir.stat().st_mode) == 0o700
    for path in disk_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert re.fullmatch(r"[0-9a-f]{40}\.kv", path.name)  # a hash, no token ids
    again, cached = run(first, prompts[:1])  # the oldest prompt's blocks come back from disk
    assert again == expected[:1] and cached[0] == 32
    assert first.kv_cache.tier_hits["disk"] > 0
    assert_tiers_idle(first)
    assert_disk_matches_index(first, disk_dir)
    first.close()
    persisted = disk_files(disk_dir)
    assert persisted

    # Same model and config, persist: the files are adopted and hit from a fresh engine.
    second = engine(llama, disk_dir, persist=False)
    assert len(second.kv_tiers.disk) == 0  # without persist, earlier files are never reused
    second.close()
    assert disk_files(disk_dir) == persisted  # and not deleted either: they were not its own

    third = engine(llama, disk_dir, persist=True)
    assert {e.location for e in third.kv_tiers.disk.entries.values()} == persisted
    outputs, cached = run(third, prompts)
    assert outputs == expected and sum(cached) > 0 and third.kv_cache.tier_hits["disk"] > 0
    third.close()

    # Another model: a different fingerprint never reuses the files.
    other = engine(model_dirs["qwen2"], disk_dir, persist=True)
    assert len(other.kv_tiers.disk) == 0
    other.close()

    # A clean shutdown without persist deletes what the engine wrote.
    fresh_dir = tmp_path / "fresh"
    fourth = engine(llama, fresh_dir, persist=False)
    run(fourth, prompts)
    fourth.kv_tiers.transfer.flush()
    assert disk_files(fresh_dir)
    fourth.close()
    assert disk_files(fresh_dir) == set()


def test_failed_disk_writes_are_misses_not_errors(llama_dir, tmp_path, monkeypatch):
    import errno
    import os

    disk_dir = tmp_path / "full"
    real_replace = os.replace

    def disk_full(src, dst, *args, **kwargs):
        if str(disk_dir) in str(dst):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", disk_full)
    prompts = distinct_prompts(5, 40, seed=5)
    expected, _ = run(EngineCore(EngineConfig(model=str(llama_dir), num_kv_blocks=8, max_num_seqs=1)), prompts)
    core = engine(llama_dir, disk_dir, persist=False)
    assert run(core, prompts)[0] == expected
    assert run(core, prompts)[0] == expected  # the index names blocks whose files never landed
    core.kv_tiers.transfer.flush()
    assert len(core.kv_tiers.disk) > 0 and core.kv_cache.tier_hits["disk"] == 0
    assert disk_files(disk_dir) == set()  # no temporary files left behind
    core.close()


def test_all_tiers_under_pressure_match_the_plain_engine(llama_dir, tmp_path):
    """Shared prefixes, a tiny host tier over a disk tier, swap preemption and waves of
    requests: every copy path at once (host blocks reused within a step, spills and fetches
    of the same blocks, swaps), and the greedy outputs must not move."""
    generator = torch.Generator().manual_seed(21)
    shared = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in (35, 50)]
    prompts = [shared[i % 2] + torch.randint(5, 300, (5 + 9 * i,), generator=generator).tolist() for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def waves(core: EngineCore) -> list[list[int]]:
        outputs = {}
        for wave in (prompts[:4], prompts[4:], prompts[::3]):
            samples = [
                core.add_request(EngineRequest(f"w{len(outputs) + i}", p, params))[0] for i, p in enumerate(wave)
            ]
            while core.has_unfinished_requests():
                core.step()
            for sample in samples:
                outputs[sample.request_id] = sample.output_token_ids
                core.release(sample.parent_id)
        return list(outputs.values())

    expected = waves(EngineCore(EngineConfig(model=str(llama_dir))))
    per_block = block_bytes(llama_dir)
    core = EngineCore(
        EngineConfig(
            model=str(llama_dir),
            num_kv_blocks=12,
            max_num_seqs=12,
            max_num_batched_tokens=48,
            kv_offload_memory=str(12 * per_block),
            preemption_mode="swap",
            kv_offload_disk=str(tmp_path / "kv"),
            kv_offload_disk_size=str(40 * per_block),
        )
    )
    assert waves(core) == expected
    stats = core.stats().kv_tiers
    assert stats.hits["host"] > 0 and stats.hits["disk"] > 0 and stats.preemptions["swap"] > 0
    assert_tiers_idle(core)
    assert_disk_matches_index(core, tmp_path / "kv")
    core.close()
