"""Pipeline parallelism end to end: PP=2 (two local processes, gloo), alone and with TP=2 inside
each stage, gives PP=1's greedy tokens and logprobs on the tiny Llama, Qwen2 (tied embeddings:
the last stage's head is the embedding) and Mistral (sliding window) models, through chunking,
preemption, prefix caching and n-gram speculation, with two micro-batches of disjoint requests in
flight; each stage holds only its layers and their KV; bad partitions and unsupported combinations
are one-line startup errors; a stage's death ends the engine (/health 503, the request failed, no
process left).

Starting a PP engine costs a few seconds (a process importing torch and loading its layers),
so one pair of engines serves the feature tests."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from engine_helpers import assert_idle, prompts_for
from model_factory import build_model
from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.threads import engine_thread_count
from pagoda.errors import InvalidRequest
from processes import process_alive, process_tree
from server_utils import free_port, start_serve_process

FEATURES = dict(
    block_size=4,
    num_kv_blocks=48,
    max_num_batched_tokens=32,
    max_num_seqs=8,
    speculative="ngram",
    num_speculative_tokens=3,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
WORKER_MODULE = "pagoda.executor.process_workers"


@pytest.fixture(scope="module")
def engines(llama_dir: Path):
    """(PP=1, PP=2) engines of the same configuration."""
    single = LLM(model=str(llama_dir), **FEATURES)
    staged = LLM(model=str(llama_dir), pipeline_parallel_size=2, **FEATURES)
    yield single, staged
    staged.engine.close()


def token_ids(outputs) -> list[list[int]]:
    return [list(sample.token_ids) for output in outputs for sample in output.outputs]


def assert_same_logprobs(expected, got) -> None:
    for a, b in zip(expected, got):
        for sample_a, sample_b in zip(a.outputs, b.outputs):
            for position_a, position_b in zip(sample_a.logprobs, sample_b.logprobs):
                assert position_a.keys() == position_b.keys()
                for token, entry in position_a.items():
                    assert entry.logprob == pytest.approx(position_b[token].logprob, abs=1e-5)


def test_greedy_with_chunking_preemption_prefix_cache_and_speculation(engines) -> None:
    single, staged = engines
    prompts = prompts_for(300)
    for _ in range(2):  # the second round hits the prefix cache
        expected, got = single.generate(prompts, GREEDY), staged.generate(prompts, GREEDY)
        assert token_ids(got) == token_ids(expected)
        assert_same_logprobs(expected, got)
    stats = staged.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode.num_draft_tokens > 0
    assert_idle(staged)  # the block pool is the scheduler's: no stage holds a block the engine does not see


def test_sampling_n_and_prompt_logprobs(engines) -> None:
    single, staged = engines
    prompts = prompts_for(300, lengths=(7, 30))
    params = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=12, logprobs=3, prompt_logprobs=2)
    expected, got = single.generate(prompts, params), staged.generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    assert_same_logprobs(expected, got)
    for a, b in zip(expected, got):
        for position_a, position_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert {t: e.rank for t, e in position_a.items()} == {t: e.rank for t, e in position_b.items()}
    assert_idle(staged)


def test_two_micro_batches_of_disjoint_requests_are_in_flight(engines) -> None:
    _, staged = engines
    core = staged.engine.core
    submit = core.runner.submit
    depths: list[int] = []
    shared: list[set[int]] = []

    def recording(scheduler_output):
        new = {id(entry.request) for entry in scheduler_output.scheduled}
        out = {id(entry.request) for step in core.in_flight for entry in step.submitted.scheduler_output.scheduled}
        depths.append(len(core.in_flight) + 1)
        shared.append(new & out)
        return submit(scheduler_output)

    core.runner.submit = recording
    try:
        staged.generate(prompts_for(300, lengths=(9, 20)), SamplingParams(temperature=0.0, max_tokens=8))
    finally:
        del core.runner.submit
    assert max(depths) == 2 and not any(shared)
    with_in_flight = [depth for depth in depths if depth == 2]
    assert len(with_in_flight) > len(depths) // 2  # the stages mostly work at the same time
    assert_idle(staged)


def test_each_stage_holds_its_layers_only(engines) -> None:
    _, staged = engines
    core = staged.engine.core
    model = core.runner.model
    assert [stage.layers for stage in core.stages] == [range(0, 1), range(1, 2)]
    assert model.model.embed_tokens is not None and model.model.norm is None and model.lm_head is None
    assert not any(name.startswith("model.layers.1.") for name, _ in model.named_parameters())
    assert core.runner.kv_caches[0] is not None and core.runner.kv_caches[1] is None
    busy = core.executor.stage_busy_seconds()
    assert len(busy) == 2 and all(seconds > 0 for seconds in busy)


def test_embeddings_are_refused_naming_pipeline_parallelism(engines) -> None:
    _, staged = engines
    with pytest.raises(InvalidRequest, match="pipeline parallelism"):
        staged.generate([[5, 6, 7]], SamplingParams(pooling="last", max_tokens=1))
    assert_idle(staged)


@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
def test_architectures_match_one_stage(architecture: str, model_dirs: dict[str, Path]) -> None:
    """qwen2: tied embeddings (the last stage's head is the embedding matrix); mistral: sliding window."""
    model_dir = model_dirs[architecture]
    prompts = prompts_for(300, lengths=(5, 40, 70))
    settings = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
    expected = LLM(model=str(model_dir), **settings).generate(prompts, GREEDY)
    staged = LLM(model=str(model_dir), pipeline_parallel_size=2, **settings)
    try:
        got = staged.generate(prompts, GREEDY)
        assert token_ids(got) == token_ids(expected)
        assert_same_logprobs(expected, got)
        assert_idle(staged)
    finally:
        staged.engine.close()


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral"])
def test_tensor_parallel_stages_match_one_rank(architecture: str, model_dirs: dict[str, Path], monkeypatch) -> None:
    """PP=2 x TP=2: four ranks, each stage a tensor-parallel group, micro-batches in flight."""
    import pagoda.engine.assembly as assembly

    monkeypatch.setattr(assembly, "available_cores", lambda: 4)  # a 2-core CI machine: slower, not wrong
    model_dir = model_dirs[architecture]
    prompts = prompts_for(300, lengths=(5, 40, 70))
    settings = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32, max_num_seqs=4)
    expected = LLM(model=str(model_dir), **settings).generate(prompts, GREEDY)
    staged = LLM(model=str(model_dir), pipeline_parallel_size=2, tensor_parallel_size=2, **settings)
    try:
        core = staged.engine.core
        assert core.runner.model.tp.world_size == 2 and core.runner.kv_caches[1] is None
        got = staged.generate(prompts, GREEDY)
        assert token_ids(got) == token_ids(expected)
        assert_same_logprobs(expected, got)
        assert_idle(staged)
        assert all(seconds > 0 for seconds in core.executor.stage_busy_seconds())
    finally:
        staged.engine.close()


def test_uneven_partition_matches_one_stage(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "llama4", "llama", num_hidden_layers=4)
    prompts = prompts_for(300, lengths=(9, 33))
    expected = LLM(model=str(model_dir), num_kv_blocks=64, max_num_seqs=4).generate(prompts, GREEDY)
    staged = LLM(
        model=str(model_dir), num_kv_blocks=64, max_num_seqs=4, pipeline_parallel_size=2, pp_layer_partition="1,3"
    )
    try:
        assert [stage.layers for stage in staged.engine.core.stages] == [range(0, 1), range(1, 4)]
        assert token_ids(staged.generate(prompts, GREEDY)) == token_ids(expected)
    finally:
        staged.engine.close()


def test_bad_partitions_name_the_numbers(llama_dir: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 3 is larger than the model's 2 layers"):
        LLM(model=str(llama_dir), pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"pp_layer_partition 1,2 sums to 3 layers, the model has 2"):
        LLM(model=str(llama_dir), pipeline_parallel_size=2, pp_layer_partition="1,2")
    with pytest.raises(ValueError, match=r"pp_layer_partition 1,1,1 has 3 stage\(s\), pipeline_parallel_size is 2"):
        EngineConfig(model=str(llama_dir), pipeline_parallel_size=2, pp_layer_partition="1,1,1")
    with pytest.raises(
        ValueError, match=r"pp_layer_partition must be comma-separated layer counts like 3,5, got 'a,b'"
    ):
        EngineConfig(model=str(llama_dir), pipeline_parallel_size=2, pp_layer_partition="a,b")
    with pytest.raises(ValueError, match=r"pp_layer_partition 0,2: every stage needs at least one layer"):
        EngineConfig(model=str(llama_dir), pipeline_parallel_size=2, pp_layer_partition="0,2")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be >= 1, got 0"):
        EngineConfig(model=str(llama_dir), pipeline_parallel_size=0)
    import pagoda.engine.assembly as assembly

    monkeypatch.setattr(assembly, "available_cores", lambda: 1)
    with pytest.raises(
        ValueError,
        match=r"pipeline_parallel_size 2 x tensor_parallel_size 1 = 2 ranks, "
        r"but only 1 CPU cores are available",
    ):
        LLM(model=str(llama_dir), pipeline_parallel_size=2)


def test_unsupported_combinations_are_startup_errors(llama_dir: Path) -> None:
    def config(**settings) -> EngineConfig:
        return EngineConfig(model=str(llama_dir), pipeline_parallel_size=2, **settings)

    with pytest.raises(ValueError, match="speculative draft is not supported with pipeline_parallel_size > 1"):
        config(speculative="draft", draft_model=str(llama_dir))
    with pytest.raises(ValueError, match="enable_lora LoRA adapters are not supported with pipeline_parallel_size > 1"):
        config(enable_lora=True)
    with pytest.raises(ValueError, match="role prefill/decode roles are not supported with pipeline_parallel_size > 1"):
        config(role="prefill")
    with pytest.raises(ValueError, match="kv_offload_memory .* not supported with pipeline_parallel_size > 1"):
        config(kv_offload_memory="64MiB")


def test_stages_share_the_threads(llama_dir: Path) -> None:
    config = EngineConfig(model=str(llama_dir), pipeline_parallel_size=2, num_threads=4)
    assert engine_thread_count(config, serving=True) == 2


def test_idle_stage_death_ends_the_engine(llama_dir: Path) -> None:
    def our_workers() -> set[int]:
        return {pid for pid, command in process_tree(os.getpid()).items() if WORKER_MODULE in command}

    before = our_workers()  # the module's shared engine has its own
    llm = AsyncLLM(
        EngineConfig(model=str(llama_dir), num_kv_blocks=32, max_num_seqs=4, pipeline_parallel_size=2),
        transport="thread",
    )
    try:
        workers = sorted(our_workers() - before)
        assert len(workers) == 1 and llm.is_alive
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.is_alive:
            assert time.monotonic() < deadline, "the idle engine did not notice its stage's death"
            time.sleep(0.05)
        assert "pipeline stage 1" in str(llm.error) and "exited with code -9" in str(llm.error)
    finally:
        llm.shutdown()
    assert not any(process_alive(pid) for pid in workers)


def test_server_greedy_then_stage_death_is_503_and_leaves_no_process(engines, llama_dir: Path) -> None:
    single, _ = engines
    prompt = prompts_for(300, lengths=(30,))[0]
    expected = single.generate([prompt], GREEDY)[0].outputs[0].text
    port = free_port()
    server = start_serve_process(llama_dir, port, "--pipeline-parallel-size", "2", "--num-kv-blocks", "128")
    base = f"http://127.0.0.1:{port}"
    try:
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        answer = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
        ).json()
        assert answer["choices"][0]["text"] == expected
        tree = process_tree(server.pid)
        workers = [pid for pid, command in tree.items() if WORKER_MODULE in command]
        assert len(workers) == 1
        # The last stage dies while a long request streams: the request fails, /health turns 503.
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            timeout=60,
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(workers[0], signal.SIGKILL)
            rest = list(lines)
        assert any("error" in line for line in rest), rest[-3:]
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{base}/health", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.1)
        assert "pipeline stage" in health.text or "Connection closed" in health.text or "failed" in health.text
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except Exception:
            os.killpg(server.pid, signal.SIGKILL)
            raise
    deadline = time.monotonic() + 10
    while left := [pid for pid in tree if process_alive(pid)]:
        assert time.monotonic() < deadline, f"processes left: {[tree[pid] for pid in left]}"
        time.sleep(0.1)


def test_a_supervised_engine_whose_stage_dies_is_restarted(llama_dir: Path) -> None:
    import asyncio

    from pagoda.replicas.supervised_engine import SupervisedEngine
    from pagoda.replicas.supervisor import EngineKeeper, EngineSupervisor, RestartPolicy

    def our_workers() -> set[int]:
        return {pid for pid, command in process_tree(os.getpid()).items() if WORKER_MODULE in command}

    def start(config: EngineConfig) -> AsyncLLM:
        return AsyncLLM(config, transport="thread")

    async def generate(request_id: str) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        stream = await engine.add_request(EngineRequest(request_id, [5] * 8, params))
        return [t async for delta in stream for s in delta.outputs for t in s.token_ids]

    config = EngineConfig(model=str(llama_dir), num_kv_blocks=32, max_num_seqs=4, pipeline_parallel_size=2)
    before = our_workers()
    engine = SupervisedEngine(
        EngineSupervisor(EngineKeeper(lambda: start(config), "pp-engine"), start, "0", RestartPolicy(backoff=0.05))
    )
    try:
        first = engine.supervisor.llm
        stage = sorted(our_workers() - before)
        assert len(stage) == 1
        os.kill(stage[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while engine.supervisor.llm is first or not engine.is_alive:
            assert time.monotonic() < deadline, "the engine was not restarted after its stage died"
            time.sleep(0.05)
        assert engine.supervisor.restarts == 1
        assert len(asyncio.run(generate("after-restart"))) == 6
        restarted = sorted(our_workers() - before)
        assert len(restarted) == 1 and restarted != stage
    finally:
        engine.shutdown()
    assert not any(process_alive(pid) for pid in stage)
