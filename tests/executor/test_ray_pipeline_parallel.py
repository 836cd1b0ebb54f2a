"""Pipeline stages as Ray actors (`--distributed-executor-backend ray`): one local Ray cluster,
stage 1 an actor in a PACK placement group; greedy tokens equal PP=1's, and the actor's death
ends the engine with the stage named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine_helpers import assert_idle, prompts_for
from pagoda import LLM, SamplingParams
from pagoda.executor.tensor_parallel import TensorParallelError

ray = pytest.importorskip("ray", reason="Ray is an optional extra (pip install 'pagoda[ray]')")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_ray_stages_match_one_stage_and_their_death_ends_the_engine(llama_dir: Path) -> None:
    prompts = prompts_for(300, lengths=(9, 40, 20))
    expected = [o.outputs[0].token_ids for o in LLM(model=str(llama_dir), num_kv_blocks=64).generate(prompts, GREEDY)]
    started_here = not ray.is_initialized()  # else: the cluster of another test, joined
    staged = LLM(model=str(llama_dir), num_kv_blocks=64, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert [o.outputs[0].token_ids for o in staged.generate(prompts, GREEDY)] == expected
        assert_idle(staged)
        executor = staged.engine.core.executor
        table = ray.util.placement_group_table(executor.workers.placement_group)
        assert table["strategy"] == "PACK" and len(table["bundles"]) == 2
        reasons: list[str] = []
        staged.engine.on_worker_failure(reasons.append)
        ray.kill(executor.workers.actors[0])
        deadline = time.monotonic() + 30
        while not reasons:
            assert time.monotonic() < deadline, "the actor's death was not noticed"
            time.sleep(0.05)
        assert "pipeline stage 1 (Ray actor) died" in reasons[0]
        with pytest.raises(TensorParallelError, match="pipeline stage 1"):
            staged.generate(prompts[:1], GREEDY)
    finally:
        staged.engine.close()
        if started_here:
            ray.shutdown()
