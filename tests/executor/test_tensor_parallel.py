"""Tensor parallelism end to end: TP=2 (gloo, two local processes) gives TP=1's greedy output on
every tiny architecture and with every engine feature that must not change results, through
LLM and through the server; a worker's death turns /health to 503 and leaves no process.

Starting a TP engine costs a few seconds (a process importing torch and loading its shards), so
one pair of engines serves every feature test."""

from __future__ import annotations

import json
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
from pagoda.engine.threads import engine_thread_count
from pagoda.structured import StructuredOutputsParams
from processes import process_alive, process_tree
from server_utils import free_port, start_serve_process

# Small blocks and pool, a small token budget and n-gram speculation: prompts are chunked,
# requests preempted, prefixes shared and drafts verified, all under tensor parallelism.
FEATURES = dict(
    block_size=4,
    num_kv_blocks=48,
    max_num_batched_tokens=32,
    max_num_seqs=8,
    speculative="ngram",
    num_speculative_tokens=3,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
WORKER_MODULE = "pagoda.executor.process_workers"


@pytest.fixture(scope="module")
def engines(llama_dir: Path):
    """(TP=1, TP=2) engines of the same configuration."""
    single = LLM(model=str(llama_dir), **FEATURES)
    split = LLM(model=str(llama_dir), tensor_parallel_size=2, **FEATURES)
    yield single, split
    split.engine.close()


def token_ids(outputs) -> list[list[int]]:
    return [list(sample.token_ids) for output in outputs for sample in output.outputs]


def test_greedy_with_chunking_preemption_prefix_cache_and_speculation(engines) -> None:
    single, split = engines
    prompts = prompts_for(300)
    for _ in range(2):  # the second round hits the prefix cache
        assert token_ids(split.generate(prompts, GREEDY)) == token_ids(single.generate(prompts, GREEDY))
    stats = split.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode.num_draft_tokens > 0
    assert_idle(split)


def test_sampling_n_logprobs_and_prompt_logprobs(engines) -> None:
    single, split = engines
    prompts = prompts_for(300, lengths=(7, 30))
    params = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=12, logprobs=3, prompt_logprobs=2)
    expected, got = single.generate(prompts, params), split.generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    for a, b in zip(expected, got):
        for sample_a, sample_b in zip(a.outputs, b.outputs):
            for position_a, position_b in zip(sample_a.logprobs, sample_b.logprobs):
                assert position_a.keys() == position_b.keys()
                for token, entry in position_a.items():
                    assert entry.logprob == pytest.approx(position_b[token].logprob, abs=1e-4)
        for position_a, position_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert {t: e.rank for t, e in position_a.items()} == {t: e.rank for t, e in position_b.items()}
    assert_idle(split)


def test_structured_output(engines) -> None:
    single, split = engines
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(**kind))
        for kind in (
            {"choice": ["yes", "no", "maybe so"]},
            {"regex": r"[0-9]{3}-[a-z]{2,4}"},
            {"json": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
        )
    ]
    prompts = ["a b c", "def f(x):", "["]
    expected = [o.outputs[0].text for o in single.generate(prompts, params)]
    got = [o.outputs[0].text for o in split.generate(prompts, params)]
    assert got == expected
    assert got[0] in ("yes", "no", "maybe so") and len(json.loads(got[2])) == 2
    assert_idle(split)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "mistral", "gqa"])
def test_every_architecture_matches_tp1(
    architecture: str, model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """qwen2: q/k/v bias and tied embeddings; qwen3: per-head q/k norm; mistral: sliding window;
    gqa: one KV head for two ranks (replicated)."""
    if architecture == "gqa":
        model_dir = build_model(tmp_path_factory.mktemp("gqa") / "llama", "llama", num_key_value_heads=1)
    else:
        model_dir = model_dirs[architecture]
    prompts = prompts_for(300, lengths=(5, 40, 70))
    expected = token_ids(LLM(model=str(model_dir), num_kv_blocks=64).generate(prompts, GREEDY))
    split = LLM(model=str(model_dir), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert token_ids(split.generate(prompts, GREEDY)) == expected
        assert_idle(split)
    finally:
        split.engine.close()


def test_features_not_split_yet_are_startup_errors(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="speculative draft is not supported with tensor_parallel_size > 1"):
        EngineConfig(model=str(llama_dir), tensor_parallel_size=2, speculative="draft", draft_model=str(llama_dir))
    with pytest.raises(ValueError, match="kv_offload_memory .* not supported with tensor_parallel_size > 1"):
        EngineConfig(model=str(llama_dir), tensor_parallel_size=2, kv_offload_memory="64MiB")
    with pytest.raises(ValueError, match="distributed_executor_backend must be mp or ray"):
        EngineConfig(model=str(llama_dir), distributed_executor_backend="slurm")


def test_a_worker_that_dies_at_startup_is_a_prompt_startup_error(llama_dir: Path, monkeypatch) -> None:
    import pagoda.executor.process_workers as process_workers

    monkeypatch.setattr(process_workers, "worker_command", lambda: ["/bin/false"])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="could not start: tensor-parallel worker rank 1 .* exited with code 1"):
        LLM(model=str(llama_dir), tensor_parallel_size=2)
    assert time.monotonic() - started < 30  # not the rendezvous timeout


def test_each_rank_gets_its_share_of_the_threads(llama_dir: Path) -> None:
    def threads(**config) -> int | None:
        return engine_thread_count(EngineConfig(model=str(llama_dir), **config), serving=True)

    assert threads(num_threads=2, tensor_parallel_size=2) == 1
    assert threads(num_threads=8, tensor_parallel_size=2) == 4
    assert threads(num_threads=1, tensor_parallel_size=2) == 1  # never zero
    assert threads(tensor_parallel_size=1, num_threads=None) >= 1


def test_idle_worker_death_ends_an_engine_on_the_thread_transport(llama_dir: Path) -> None:
    def our_workers() -> set[int]:
        return {pid for pid, command in process_tree(os.getpid()).items() if WORKER_MODULE in command}

    before = our_workers()  # the module's shared engine has its own
    llm = AsyncLLM(EngineConfig(model=str(llama_dir), num_kv_blocks=32, tensor_parallel_size=2), transport="thread")
    try:
        workers = sorted(our_workers() - before)
        assert len(workers) == 1 and llm.is_alive
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.is_alive:
            assert time.monotonic() < deadline, "the idle engine did not notice its worker's death"
            time.sleep(0.05)
        assert "tensor-parallel worker rank 1" in str(llm.error) and "exited with code -9" in str(llm.error)
    finally:
        llm.shutdown()
    assert not any(process_alive(pid) for pid in workers)


def test_server_greedy_then_worker_death_is_503_and_leaves_no_process(engines, llama_dir: Path) -> None:
    single, _ = engines
    prompt = prompts_for(300, lengths=(30,))[0]
    expected = single.generate([prompt], GREEDY)[0].outputs[0].text
    port = free_port()
    server = start_serve_process(llama_dir, port, "--tensor-parallel-size", "2", "--num-kv-blocks", "128")
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
        # A worker dies while a long request streams: the request fails, /health turns 503.
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
        assert any("error" in line for line in rest), rest[-3:]  # the stream ends with an error event
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{base}/health", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.1)
        assert "worker" in health.text or "tensor-parallel" in health.text or "Connection closed" in health.text
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


@pytest.mark.parametrize(
    "architecture,expert_parallel",
    [("qwen2_moe", False), ("qwen2_moe", True), ("mixtral", True), ("gpt_oss", False), ("gpt_oss", True)],
)
def test_moe_tensor_and_expert_parallel_match_one_rank(
    tmp_path: Path, architecture: str, expert_parallel: bool
) -> None:
    """Without expert parallelism every expert is split over the ranks; with it each rank holds
    half the experts whole (the shared expert, attention and dense layers stay tensor-parallel).
    Either way greedy output equals one rank's, with chunking and preemption."""
    directory = build_model(tmp_path / architecture, architecture)
    prompts = prompts_for(300)
    settings = dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=32, max_num_seqs=8)
    expected = token_ids(LLM(model=str(directory), **settings).generate(prompts, GREEDY))
    split = LLM(model=str(directory), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **settings)
    try:
        experts = split.engine.core.runner.model.model.layers[0].mlp.experts
        held = experts.num_experts // 2 if expert_parallel else experts.num_experts
        assert sorted(experts.keys(), key=int) == [str(e) for e in range(held)]
        assert token_ids(split.generate(prompts, GREEDY)) == expected
        assert_idle(split)
    finally:
        split.engine.close()


def test_expert_parallel_needs_experts_divisible_by_ranks(tmp_path: Path) -> None:
    directory = build_model(tmp_path / "m", "qwen3_moe", num_experts=6)
    with pytest.raises(ValueError, match=r"experts \(6\) is not divisible by tensor_parallel_size \(4\)"):
        LLM(model=str(directory), tensor_parallel_size=4, enable_expert_parallel=True)
