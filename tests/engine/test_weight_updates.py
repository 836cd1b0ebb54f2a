"""Weight updates in place, pause and sleep on the engine (offline LLM and LLMEngine): the new
weights serve exactly as transformers computes with them, a failed update keeps the old ones
serving, no prefix cached with old weights serves a new request, and sleep releases memory."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import build_model, hf_greedy, load_hf_model
from pagoda import LLM, SamplingParams
from pagoda.engine.commands import run_command
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


class Trainer:
    """A trainer in this process: rank 0 of a gloo weight group the engine joins as rank 1,
    streaming through the engine's commands as the admin routes run them."""

    def __init__(self, engine) -> None:
        from pagoda.rl.weight_group import WeightGroupSpec, join
        from server_utils import free_port

        self.engine = engine
        spec = WeightGroupSpec("127.0.0.1", free_port(), 1, 2, timeout_s=60)
        joined: dict[str, object] = {}
        thread = threading.Thread(target=lambda: joined.update(group=join(spec, 0)))
        thread.start()
        args = {"master_address": spec.master_address, "master_port": spec.master_port, "rank_offset": 1}
        run_command(engine, "init_weight_update_group", args | {"world_size": 2, "timeout_s": 60})
        thread.join()
        self.group = joined["group"]

    def update(self, tensors: dict[str, torch.Tensor], snapshot: str | None = None) -> None:
        """start, update, finish; InvalidRequest (after an abort) when the engine refuses."""
        from pagoda.rl.weight_group import TensorMeta, broadcast

        metas = [TensorMeta.of(name, tensor) for name, tensor in tensors.items()]
        run_command(self.engine, "start_weight_update", {})
        sender = threading.Thread(target=broadcast, args=(self.group, list(tensors.values())))
        sender.start()
        args = {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas]}
        args["shapes"] = [list(m.shape) for m in metas]
        try:
            run_command(self.engine, "update_weights", args | ({"snapshot": snapshot} if snapshot else {}))
        except InvalidRequest:
            run_command(self.engine, "finish_weight_update", {"abort": True})
            raise
        finally:
            sender.join()
        run_command(self.engine, "finish_weight_update", {})


def test_streamed_tensors_are_received_in_place_and_checked(checkpoints, references, tmp_path: Path) -> None:
    from pagoda.model.loader import build_empty_model, receive_targets

    llm = LLM(model=str(checkpoints["old"]), num_kv_blocks=64)
    core = llm.engine.core
    new = load_file(checkpoints["new"] / "model.safetensors")
    fresh = build_empty_model(core.model_config, core.dtype, core.device, core.weight_format)
    targets = receive_targets(fresh, core.model_config, [(n, t.dtype, tuple(t.shape)) for n, t in new.items()])
    assert all(target is not None for target in targets)  # q/k/v and gate/up land in their fused rows
    trainer = Trainer(llm.engine)
    with pytest.raises(InvalidRequest, match="has shape"):
        trainer.update(new | {"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)})
    assert greedy(llm) == references["old"]
    # Another dtype than the model's arrives in a buffer of its own and is cast as it is filled.
    trainer.update({name: t.to(torch.bfloat16) if "mlp" in name else t for name, t in new.items()}, None)
    assert llm.engine.weight_updates.version == 1
    snapshot = tmp_path / "snapshot"
    trainer.update(new, str(snapshot))
    assert greedy(llm) == references["new"]  # served at once: the snapshot is written meanwhile
    llm.engine.weight_updates.wait_snapshot()
    saved = load_file(snapshot / "model.safetensors")
    assert saved.keys() == new.keys() and all(torch.equal(saved[n], new[n]) for n in new)
    assert llm.engine.weight_updates.source == str(snapshot)
    with pytest.raises(InvalidRequest, match="already exists"):
        trainer.update(new, str(snapshot))


def test_tensor_parallel_ranks_each_stage_their_shard(checkpoints, references, tmp_path: Path, monkeypatch) -> None:
    llm = LLM(model=str(checkpoints["old"]), tensor_parallel_size=2, num_kv_blocks=64)
    try:
        with pytest.raises(InvalidRequest, match="has shape"):
            llm.update_weights_from_disk(str(_corrupt(checkpoints["new"], tmp_path / "bad", "wrong shape")))
        with pytest.raises(InvalidRequest, match="no \\*.safetensors weights"):
            llm.update_weights_from_disk(str(tmp_path))  # a directory without a checkpoint
        assert greedy(llm) == references["old"]
        llm.update_weights_from_disk(str(checkpoints["new"]))
        assert greedy(llm) == references["new"]

        # Streamed from a trainer: rank 0 relays each tensor and every rank stages its shard.
        trainer = Trainer(llm.engine)
        old = load_file(checkpoints["old"] / "model.safetensors")
        partial = {name: t for name, t in old.items() if not name.endswith("down_proj.weight")}
        with pytest.raises(InvalidRequest, match="missing tensor"):
            trainer.update(partial)
        assert greedy(llm) == references["new"]
        # Rank 0 refuses what the worker staged: the worker drops it too.
        import pagoda.engine.weight_updates as weight_updates

        def refuse(*args, **kwargs):
            raise ValueError("rank 0 ran out of memory")

        with monkeypatch.context() as patch:
            patch.setattr(weight_updates, "stage_weights", refuse)
            with pytest.raises(InvalidRequest, match="out of memory"):
                trainer.update(old)
        assert greedy(llm) == references["new"]
        trainer.update(old)
        assert greedy(llm) == references["old"]

        # Sleep on every rank; level 2 drops the weights everywhere and reloads each rank's shard.
        llm.update_weights_from_disk(str(checkpoints["new"]))
        for level in (1, 2):
            llm.sleep(level)
            assert llm.is_sleeping
            llm.wake_up()
            assert greedy(llm) == references["new"]
    finally:
        llm.engine.close()


def test_a_restarted_replica_loads_the_current_weights(checkpoints, references, tmp_path: Path) -> None:
    """A replica killed after an update comes back with the updated weights: from the directory
    of an update from disk, and from the snapshot the first replica saved of a streamed one."""
    from pagoda.config import DeploymentConfig, EngineConfig
    from pagoda.replicas.start import start_engines
    from pagoda.rl.weight_group import TensorMeta, WeightGroupSpec, broadcast, join
    from server_utils import free_port

    third = build_model(tmp_path / "third", "llama", seed=2)
    expected_third = hf_greedy(load_hf_model(third), PROMPT, GREEDY.max_tokens)[0]
    assert expected_third not in (references["old"], references["new"])
    config = EngineConfig(model=str(checkpoints["old"]), num_threads=1, num_kv_blocks=64, max_num_seqs=4)
    deployment = DeploymentConfig(data_parallel_size=2, replica_restart_backoff=0.1, max_replica_restarts=4)
    replicas = start_engines(config, deployment, transport="process")

    async def answer(llm, request_id: str) -> list[int]:
        outputs = [output async for output in llm.generate(EngineRequest(request_id, PROMPT, GREEDY))]
        return list(outputs[-1].outputs[0].token_ids)

    def kill_and_ask(replica, request_id: str) -> list[int]:
        old = replica.llm
        os.kill(old.engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while replica.llm is old or not replica.llm.is_alive:
            assert time.monotonic() < deadline, "the replica was not restarted"
            time.sleep(0.05)
        return asyncio.run(answer(replica.llm, request_id))

    try:
        asyncio.run(replicas.engine_command("update_weights_from_disk", {"model_path": str(checkpoints["new"])}))
        assert kill_and_ask(replicas.replicas[1], "after-disk") == references["new"]

        # Streamed to both replicas (ranks 1 and 2 of the trainer's group), then a kill.
        spec = WeightGroupSpec("127.0.0.1", free_port(), 1, 3, timeout_s=60)
        trainer: dict[str, object] = {}
        joined = threading.Thread(target=lambda: trainer.update(group=join(spec, 0)))
        joined.start()
        group_args = {"master_address": "127.0.0.1", "master_port": spec.master_port, "rank_offset": 1}
        asyncio.run(replicas.engine_command("init_weight_update_group", group_args | {"world_size": 3}))
        joined.join()
        tensors = load_file(third / "model.safetensors")
        metas = [TensorMeta.of(name, tensor) for name, tensor in tensors.items()]
        sender = threading.Thread(target=broadcast, args=(trainer["group"], list(tensors.values())))
        asyncio.run(replicas.engine_command("start_weight_update"))
        sender.start()
        args = {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas]}
        asyncio.run(replicas.engine_command("update_weights", args | {"shapes": [list(m.shape) for m in metas]}))
        sender.join()
        asyncio.run(replicas.engine_command("finish_weight_update"))
        snapshot = replicas.weights.current
        assert snapshot is not None
        # Killed at once: the restart waits for the first replica to finish writing the snapshot.
        assert kill_and_ask(replicas.replicas[1], "after-stream") == expected_third
        assert (Path(snapshot) / "model.safetensors").is_file()
        assert asyncio.run(answer(replicas.replicas[0].llm, "streamed")) == expected_third
    finally:
        replicas.shutdown()
    assert not Path(snapshot).exists()  # the front's snapshots go with it


def test_a_snapshot_is_whole_or_absent(tmp_path: Path) -> None:
    """Written beside and renamed into place: readable by safetensors when there; an abandoned
    write (a newer update committed) leaves nothing behind."""
    from pagoda.engine.weight_updates import _save_snapshot

    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.tensor(2.5), "c": torch.randn(4, 6)[:, :3]}
    _save_snapshot(tensors, tmp_path / "kept", threading.Event())
    saved = load_file(tmp_path / "kept" / "model.safetensors")
    assert all(torch.equal(saved[name], tensor) for name, tensor in tensors.items())
    abandoned = threading.Event()
    abandoned.set()
    _save_snapshot(tensors, tmp_path / "abandoned", abandoned)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_a_single_supervised_engine_keeps_a_loadable_snapshot_of_a_streamed_update(checkpoints, references) -> None:
    """`pagoda serve`'s one engine (restarted when it dies): the streamed update's snapshot is the
    source a restart loads, and it loads (here into the running engine)."""
    from pagoda.config import DeploymentConfig, EngineConfig
    from pagoda.replicas.start import start_engines
    from pagoda.replicas.supervised_engine import SupervisedEngine
    from pagoda.rl.weight_group import TensorMeta, WeightGroupSpec, broadcast, join
    from server_utils import free_port

    config = EngineConfig(model=str(checkpoints["old"]), num_threads=1, num_kv_blocks=64, max_num_seqs=4)
    front = start_engines(config, DeploymentConfig(), transport="thread")
    assert isinstance(front, SupervisedEngine)
    try:
        spec = WeightGroupSpec("127.0.0.1", free_port(), 1, 2, timeout_s=60)
        trainer: dict[str, object] = {}
        joined = threading.Thread(target=lambda: trainer.update(group=join(spec, 0)))
        joined.start()
        group_args = {"master_address": "127.0.0.1", "master_port": spec.master_port, "rank_offset": 1}
        asyncio.run(front.engine_command("init_weight_update_group", group_args | {"world_size": 2}))
        joined.join()
        tensors = load_file(checkpoints["new"] / "model.safetensors")
        metas = [TensorMeta.of(name, tensor) for name, tensor in tensors.items()]
        sender = threading.Thread(target=broadcast, args=(trainer["group"], list(tensors.values())))
        asyncio.run(front.engine_command("start_weight_update"))
        sender.start()
        args = {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas]}
        asyncio.run(front.engine_command("update_weights", args | {"shapes": [list(m.shape) for m in metas]}))
        sender.join()
        asyncio.run(front.engine_command("finish_weight_update"))
        snapshot = front.weights.written(60)
        assert snapshot is not None and load_file(Path(snapshot) / "model.safetensors").keys() == tensors.keys()
        front.supervisor.load_weights()  # what a restarted engine runs before it serves
        outputs = asyncio.run(_collect(front.generate(EngineRequest("after", PROMPT, GREEDY))))
        assert list(outputs[-1].outputs[0].token_ids) == references["new"]
    finally:
        front.shutdown()
    assert not Path(snapshot).exists()


async def _collect(stream) -> list:
    return [output async for output in stream]
