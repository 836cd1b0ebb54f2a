"""Replicas as Ray actors on a simulated two-node cluster (Ray's own cluster_utils.Cluster on
this machine): one replica per node, both serving. Starting Ray takes seconds: one test, marked
`ray`, skipped without Ray."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.replicas.start import start_engines
from pagoda.sampling_params import SamplingParams

ray = pytest.importorskip("ray", reason="Ray is optional (pip install 'pagoda[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

from pagoda.engine.engine_request import EngineRequest  # noqa: E402

pytestmark = pytest.mark.ray
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_node_cluster(monkeypatch: pytest.MonkeyPatch):
    # Ray's workers import pagoda from this checkout, as the test process does.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    # Two nodes of one CPU each: the head and one more (each node is a raylet: seconds to start).
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster, {cluster.head_node.node_id, second.node_id}
    ray.shutdown()
    cluster.shutdown()


def test_one_replica_per_node_both_serve(two_node_cluster, llama_dir: Path) -> None:
    cluster, node_ids = two_node_cluster
    config = EngineConfig(
        model=str(llama_dir),
        num_threads=1,
        num_kv_blocks=64,
        distributed_executor_backend="ray",
        ray_address=cluster.address,
    )
    replicas = start_engines(config, DeploymentConfig(data_parallel_size=2, router="round_robin", restart=False))
    try:
        placed = {r.llm._transport.node_id for r in replicas.replicas}
        assert placed == node_ids  # one per node: each node has one CPU, each replica needs one

        async def serve() -> list[list[int]]:
            params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
            outputs = []
            for i in range(4):
                stream = await replicas.add_request(EngineRequest(f"r{i}", [7, 8, 9, 10 + i], params))
                outputs.append([t async for d in stream for s in d.outputs for t in s.token_ids])
            return outputs

        assert all(len(tokens) == 5 for tokens in asyncio.run(serve()))
        assert [r.num_routed for r in replicas.replicas] == [2, 2]
        for replica in replicas.replicas:
            stats = replica.llm.get_stats()
            assert stats.num_generation_tokens > 0 and stats.num_free_blocks == stats.num_total_blocks
        # An actor lost (its node gone) is a dead replica: out of rotation, the set degraded.
        ray.kill(replicas.replicas[0].llm._transport.actor)
        for _ in range(100):
            if not replicas.replicas[0].llm.is_alive:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert replicas.health()["status"] == "degraded"
    finally:
        replicas.shutdown()


def test_prefill_and_decode_replicas_on_two_nodes_hand_the_kv_over(two_node_cluster, llama_dir: Path) -> None:
    """--replica-roles over Ray: the decode actor listens on every interface and advertises its
    node's address; the prefill actor on the other node sends each request's KV there."""
    from pagoda.engine.llm_engine import LLMEngine

    cluster, node_ids = two_node_cluster
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[7, 8, 9, 10 + i] * 9 for i in range(3)]
    reference = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64))
    for i, prompt in enumerate(prompts):
        reference.add_request(EngineRequest(f"r{i}", prompt, params))
    expected: dict[str, list[int]] = {}
    while reference.has_unfinished_requests():
        for delta in reference.step().deltas:
            expected.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    config = EngineConfig(
        model=str(llama_dir),
        num_threads=1,
        num_kv_blocks=64,
        distributed_executor_backend="ray",
        ray_address=cluster.address,
    )
    replicas = start_engines(config, DeploymentConfig(replica_roles="prefill=1,decode=1", max_local_prefill_tokens=0))
    try:
        assert {r.llm._transport.node_id for r in replicas.replicas} == node_ids
        assert not replicas.replicas[1].llm.kv_address.startswith(("0.0.0.0", "127."))

        async def serve() -> dict[str, list[int]]:
            outputs = {}
            for i, prompt in enumerate(prompts):
                stream = await replicas.add_request(EngineRequest(f"r{i}", prompt, params))
                outputs[f"r{i}"] = [t async for d in stream for s in d.outputs for t in s.token_ids]
            return outputs

        assert asyncio.run(serve()) == expected
        decode = replicas.replicas[1].llm.get_stats().disaggregation
        assert decode.handoffs_imported == 3 and decode.fallback_prefills == 0
    finally:
        replicas.shutdown()
