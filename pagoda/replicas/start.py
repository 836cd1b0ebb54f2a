"""Start what serves a deployment: one AsyncLLM, or a ReplicaSet of `num_replicas` of them
(--data-parallel-size, or prefill and decode replicas with --replica-roles)."""

from __future__ import annotations

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.client import EngineClient
from pagoda.engine.transport import TransportKind
from pagoda.replicas.replica_set import ReplicaSet


def start_engines(config: EngineConfig, deployment: DeploymentConfig | None = None, *,
                  transport: TransportKind = "process",
                  startup_timeout: float | None = None) -> EngineClient:
    """One engine as before when there is one replica (no `deployment`: one engine), no pool
    and no Ray; else a replica set, its replicas on `transport` (each its own engine process by
    default) or, with `distributed_executor_backend="ray"`, Ray actors (ray_actors.py).

    Raises RuntimeError when an engine cannot start, ValueError (or OSError) for bad pool
    settings or an unreadable route rules file."""
    deployment = deployment or DeploymentConfig()
    deployment.validate_with(config)
    if config.role != "both":
        raise ValueError(f"role {config.role} runs only as a replica beside its partner: serve with "
                         f"--replica-roles prefill=P,decode=D")
    ray = config.distributed_executor_backend == "ray"
    if deployment.num_replicas == 1 and deployment.replica_pools is None and not ray:
        return AsyncLLM(config, transport=transport, startup_timeout=startup_timeout)
    if ray:
        from pagoda.replicas.ray_actors import connect_ray, start_ray_replica

        connect_ray(config.ray_address)  # once, before the replicas start side by side
        return ReplicaSet.start(config, deployment, start_ray_replica)

    def start_replica(index: int, replica: EngineConfig) -> AsyncLLM:
        return AsyncLLM(replica, transport=transport, startup_timeout=startup_timeout)

    return ReplicaSet.start(config, deployment, start_replica)
