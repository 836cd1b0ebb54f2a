"""Weight updates in place, pause and sleep on the engine (offline LLM and LLMEngine): the new
weights serve exactly as transformers computes with them, a failed update keeps the old ones
serving, no prefix cached with old weights serves a new request, and sleep releases memory."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import build_model, hf_greedy, load_hf_model
from pagoda import LLM, SamplingParams
from pagoda.engine.engine_request import EngineRequest
from pagoda.errors import InvalidRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = list(range(5, 45))  # 40 tokens: two full blocks of 16 land in the prefix cache


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    return {"old": build_model(root / "old", "llama", seed=0), "new": build_model(root / "new", "llama", seed=1)}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[int]]:
    return {name: hf_greedy(load_hf_model(path), PROMPT, GREEDY.max_tokens)[0] for name, path in checkpoints.items()}


def greedy(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids)


def test_update_from_disk_serves_the_new_weights_and_no_old_prefix(checkpoints, references) -> None:
    assert references["old"] != references["new"]
    llm = LLM(model=str(checkpoints["old"]), num_kv_blocks=64)
    assert greedy(llm) == references["old"]
    kv_cache = llm.engine.core.kv_cache
    assert kv_cache.pool.cached_blocks  # the prompt's blocks, computed with the old weights
    llm.update_weights_from_disk(str(checkpoints["new"]))
    assert not kv_cache.pool.cached_blocks
    assert greedy(llm) == references["new"]
    assert llm.engine.weight_updates.version == 1 and llm.engine.weight_updates.source == str(checkpoints["new"])


def _corrupt(source: Path, target: Path, how: str) -> Path:
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    if how == "missing tensor":
        del tensors["model.layers.1.mlp.down_proj.weight"]
    elif how == "wrong shape":
        tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)
    elif how == "wrong dtype":
        tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    if how == "unreadable file":
        weights.write_bytes(weights.read_bytes()[:5000])  # truncated mid-tensor
    else:
        save_file(tensors, weights, metadata={"format": "pt"})
    return target


@pytest.mark.parametrize(
    "how, reason",
    [
        ("missing tensor", "missing tensor"),
        ("wrong shape", "has shape"),
        ("wrong dtype", "has dtype torch.int32"),
        ("unreadable file", "model.safetensors"),
        ("no directory", "is not a directory"),
        ("no checkpoint", "no \\*.safetensors weights"),
    ],
)
def test_a_failed_update_keeps_the_old_weights_serving(
    checkpoints, references, tmp_path: Path, how: str, reason: str
) -> None:
    llm = LLM(model=str(checkpoints["old"]), num_kv_blocks=64)
    path = (
        tmp_path / "absent"
        if how == "no directory"
        else tmp_path
        if how == "no checkpoint"
        else _corrupt(checkpoints["new"], tmp_path / "bad", how)
    )
    with pytest.raises(InvalidRequest, match=reason):
        llm.update_weights_from_disk(str(path))
    assert greedy(llm) == references["old"]
    assert llm.engine.weight_updates.version == 0 and not llm.engine.weight_updates.staged


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="RSS is read from /proc")
def test_sleep_releases_the_kv_pool_and_the_weights(tmp_path: Path, capsys) -> None:
    # A pool of 32 MiB and 32 MiB of weights, so their release stands out of the process's noise.
    wide = build_model(
        tmp_path / "wide",
        "llama",
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    weights_bytes = (wide / "model.safetensors").stat().st_size
    llm = LLM(model=str(wide), num_kv_blocks=512)
    before = greedy(llm)
    caches = [t for pair in llm.engine.core.runner.distinct_kv_caches for t in pair]
    pool_bytes = sum(t.untyped_storage().nbytes() for t in caches)
    for cache in caches:
        cache.fill_(0)  # resident, as under load
    awake = _rss()
    llm.sleep(1)
    level_1 = _rss()
    assert llm.is_sleeping and all(t.untyped_storage().nbytes() == 0 for t in caches)
    with pytest.raises(InvalidRequest, match="asleep"):
        llm.generate([PROMPT], GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping and greedy(llm) == before
    awake_again = _rss()
    llm.sleep(2)
    level_2 = _rss()
    llm.wake_up()
    assert greedy(llm) == before
    with capsys.disabled():
        mib = 2**20
        print(
            f"\nsleep RSS: awake {awake / mib:.1f} MiB -> level 1 {level_1 / mib:.1f} MiB (KV pool "
            f"{pool_bytes / mib:.1f} MiB); awake {awake_again / mib:.1f} MiB -> level 2 {level_2 / mib:.1f} MiB "
            f"(pool + weights {(pool_bytes + weights_bytes) / mib:.1f} MiB)"
        )
    assert awake - level_1 > 0.8 * pool_bytes
    assert awake_again - level_2 > 0.8 * pool_bytes + 0.5 * weights_bytes


def test_a_wake_recaptures_the_decode_graphs(checkpoints, references) -> None:
    """Waking reallocates the KV pool's storage: CUDA graphs captured before the sleep would
    replay into freed memory, so the wake captures them again (a stand-in records it on the CPU)."""

    class CaptureLog:
        captures = 0

        def capture(self) -> None:
            self.captures += 1

    llm = LLM(model=str(checkpoints["old"]), num_kv_blocks=64)
    runner = llm.engine.core.runner
    llm.sleep(1)
    runner.decode_graphs = log = CaptureLog()
    llm.wake_up()
    runner.decode_graphs = None
    assert log.captures == 1 and greedy(llm) == references["old"]


def test_sleep_refuses_while_requests_are_in_flight(checkpoints) -> None:
    llm = LLM(model=str(checkpoints["old"]), num_kv_blocks=64)
    llm.engine.add_request(EngineRequest("r", PROMPT, GREEDY))
    with pytest.raises(InvalidRequest, match="in flight"):
        llm.sleep(1)


def _run(engine, steps: int = 50) -> dict[str, object]:
    finished = {}
    for _ in range(steps):
        output = engine.step()
        finished.update({d.request_id: d for d in output.deltas if d.finished})
        finished.update({c: "accepted" for c in output.accepted})
    return finished


def test_pause_keeps_waits_or_aborts_what_is_in_flight(checkpoints, references) -> None:
    engine = LLM(model=str(checkpoints["old"]), num_kv_blocks=64).engine
    engine.add_request(EngineRequest("kept", PROMPT, GREEDY))
    engine.step()
    engine.run_command("pause-keep", "pause", {"mode": "keep"})
    assert not engine.has_unfinished_requests()  # nothing steps while paused in place
    assert "kept" not in _run(engine, 5)
    engine.run_command("resume", "resume", {})
    assert "kept" in _run(engine)

    engine.add_request(EngineRequest("drained", PROMPT, GREEDY))
    engine.step()
    engine.run_command("pause-wait", "pause", {"mode": "wait"})
    first = engine.step()
    assert "pause-wait" not in first.accepted  # answered once the request finished
    done = _run(engine)
    assert done["pause-wait"] == "accepted" and done["drained"].outputs[0].finish_reason == "length"
    engine.run_command("resume", "resume", {})

    engine.add_request(EngineRequest("aborted", PROMPT, GREEDY))
    engine.step()
    engine.run_command("pause-abort", "pause", {"mode": "abort"})
    done = _run(engine, 2)
    assert done["pause-abort"] == "accepted" and done["aborted"].outputs[0].finish_reason == "abort"


def test_every_replica_updates_or_none_does(checkpoints, references, tmp_path: Path) -> None:
    from pagoda.config import DeploymentConfig, EngineConfig
    from pagoda.replicas.start import start_engines

    config = EngineConfig(model=str(checkpoints["old"]), num_threads=1, num_kv_blocks=64, max_num_seqs=4)
    replicas = start_engines(config, DeploymentConfig(data_parallel_size=2), transport="thread")
    bad = _corrupt(checkpoints["new"], tmp_path / "bad", "wrong shape")

    def served() -> list[list[int]]:  # each replica's own greedy answer
        async def each() -> list[list[int]]:
            answers = []
            for i, replica in enumerate(replicas.replicas):
                outputs = [
                    output
                    async for output in replica.llm.generate(EngineRequest(f"r{i}-{len(answers)}", PROMPT, GREEDY))
                ]
                answers.append(list(outputs[-1].outputs[0].token_ids))
            return answers

        return asyncio.run(each())

    try:
        with pytest.raises(InvalidRequest, match="has shape"):
            asyncio.run(replicas.engine_command("update_weights_from_disk", {"model_path": str(bad)}))
        assert served() == [references["old"]] * 2
        # One replica refuses a checkpoint the other staged: neither commits it.
        second = replicas.replicas[1].llm
        command = second.engine_command

        async def refuse_staging(name: str, args: dict | None = None) -> None:
            if name == "stage_weights_from_disk":
                raise InvalidRequest("weights not updated: this replica ran out of memory")
            await command(name, args)

        second.engine_command = refuse_staging  # type: ignore[method-assign]
        with pytest.raises(InvalidRequest, match="out of memory"):
            asyncio.run(replicas.engine_command("update_weights_from_disk", {"model_path": str(checkpoints["new"])}))
        second.engine_command = command  # type: ignore[method-assign]
        assert served() == [references["old"]] * 2
        asyncio.run(replicas.engine_command("update_weights_from_disk", {"model_path": str(checkpoints["new"])}))
        assert served() == [references["new"]] * 2
        asyncio.run(replicas.engine_command("sleep", {"level": 1}))
        assert replicas.sleep_level == 1 and replicas.health()["status"] == "asleep"
        asyncio.run(replicas.engine_command("wake_up"))
        assert replicas.health()["status"] == "ok"
    finally:
        replicas.shutdown()


def test_a_wake_that_cannot_reload_the_weights_stays_asleep(checkpoints, references, tmp_path: Path) -> None:
    served = shutil.copytree(checkpoints["old"], tmp_path / "served")
    llm = LLM(model=str(served), num_kv_blocks=64)
    llm.sleep(2)
    (served / "model.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(InvalidRequest, match="could not be loaded again"):
        llm.wake_up()
    assert llm.is_sleeping
    (tmp_path / "moved.safetensors").rename(served / "model.safetensors")
    llm.wake_up()
    assert greedy(llm) == references["old"]


def test_tensor_parallel_ranks_each_stage_their_shard(checkpoints, references, tmp_path: Path) -> None:
    llm = LLM(model=str(checkpoints["old"]), tensor_parallel_size=2, num_kv_blocks=64)
    try:
        with pytest.raises(InvalidRequest, match="has shape"):
            llm.update_weights_from_disk(str(_corrupt(checkpoints["new"], tmp_path / "bad", "wrong shape")))
        with pytest.raises(InvalidRequest, match="no \\*.safetensors weights"):
            llm.update_weights_from_disk(str(tmp_path))  # a directory without a checkpoint
        assert greedy(llm) == references["old"]
        llm.update_weights_from_disk(str(checkpoints["new"]))
        assert greedy(llm) == references["new"]
        with pytest.raises(InvalidRequest, match="not supported with tensor"):
            llm.sleep(1)
    finally:
        llm.engine.close()
