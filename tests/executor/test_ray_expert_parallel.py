"""Expert parallelism with the ranks as Ray actors (`--distributed-executor-backend ray
--enable-expert-parallel`): each rank holds half the experts whole, greedy output equals one
rank's (and tensor parallelism's without expert parallelism), the idle engine holds no KV block,
and closing it removes its placement group; the startup errors name both numbers under Ray too,
before any actor starts, and a layer the ranks cannot load fails the start naming it, leaving no
placement group. One cluster start for the whole module (it costs seconds)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest

from engine_helpers import assert_idle, prompts_for
from model_factory import build_model
from pagoda import LLM, SamplingParams

ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'pagoda[ray]')")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Chunked prompts and a pool small enough to preempt, as in the mp launcher's test.
SETTINGS = dict(block_size=4, num_kv_blocks=48, max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def ray_cluster():
    started_here = not ray.is_initialized()  # else: the cluster of another test, joined
    yield
    if started_here and ray.is_initialized():
        ray.shutdown()


def token_ids(outputs) -> list[list[int]]:
    return [list(sample.token_ids) for output in outputs for sample in output.outputs]


def test_startup_errors_name_both_numbers_before_any_actor_starts(tmp_path: Path) -> None:
    initialized = ray.is_initialized()
    directory = build_model(tmp_path / "m", "qwen3_moe", num_experts=6)
    with pytest.raises(ValueError, match=r"experts \(6\) is not divisible by tensor_parallel_size \(4\)"):
        LLM(
            model=str(directory),
            tensor_parallel_size=4,
            enable_expert_parallel=True,
            distributed_executor_backend="ray",
        )
    config = json.loads((directory / "config.json").read_text())
    config["num_experts_per_tok"] = 7
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"num_experts_per_tok \(7\) must be between 1 and the number of experts "
        r"\(6\)",
    ):
        LLM(
            model=str(directory),
            tensor_parallel_size=2,
            enable_expert_parallel=True,
            distributed_executor_backend="ray",
        )
    assert ray.is_initialized() == initialized  # refused before Ray was even reached


# Ray tensor parallelism without EP on a MoE model is the mp launcher's test's case: one Ray start
# per layout kept here (CI time).
@pytest.mark.parametrize("architecture,expert_parallel", [("qwen2_moe", True), ("mixtral", True)])
def test_ray_expert_parallel_matches_one_rank(
    ray_cluster, tmp_path: Path, architecture: str, expert_parallel: bool
) -> None:
    directory = build_model(tmp_path / architecture, architecture)
    prompts = prompts_for(300)
    expected = token_ids(LLM(model=str(directory), **SETTINGS).generate(prompts, GREEDY))
    split = LLM(
        model=str(directory),
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        distributed_executor_backend="ray",
        **SETTINGS,
    )
    try:
        experts = split.engine.core.runner.model.model.layers[0].mlp.experts
        held = experts.num_experts // 2 if expert_parallel else experts.num_experts
        assert sorted(experts.keys(), key=int) == [str(e) for e in range(held)]
        assert token_ids(split.generate(prompts, GREEDY)) == expected
        assert split.engine.get_stats().num_preemptions > 0
        assert_idle(split)
        placement_group = split.engine.core.executor.workers.placement_group
        table = ray.util.placement_group_table(placement_group)
        assert table["strategy"] == "STRICT_PACK" and len(table["bundles"]) == 2
    finally:
        split.engine.close()
    assert ray.util.placement_group_table(placement_group)["state"] == "REMOVED"


def test_a_layer_the_ranks_cannot_load_fails_the_start_and_leaves_no_placement_group(
    ray_cluster, tmp_path: Path
) -> None:
    """qwen2_moe's shared expert stays tensor-parallel: each rank's 48 input columns of its down
    projection fit no int4 group size."""
    directory = build_model(tmp_path / "qwen2_moe", "qwen2_moe")
    with pytest.raises(
        ValueError,
        match=r"shared_expert\.down_proj: int4 group size .* input dimension 48.*"
        r"tensor_parallel_size 2",
    ):
        LLM(
            model=str(directory),
            quantization="int4",
            tensor_parallel_size=2,
            enable_expert_parallel=True,
            distributed_executor_backend="ray",
        )
    deadline = time.monotonic() + 30
    while any(group["state"] != "REMOVED" for group in ray.util.placement_group_table().values()):
        assert time.monotonic() < deadline, "the failed engine's placement group was left behind"
        gc.collect()
        time.sleep(0.1)
