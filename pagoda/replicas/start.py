"""Start what serves a deployment: one engine (supervised unless --no-restart), or a ReplicaSet
of `num_replicas` of them (--data-parallel-size, or prefill and decode replicas with
--replica-roles)."""

from __future__ import annotations

import functools
import logging

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.client import EngineClient
from pagoda.engine.transport import TransportKind
from pagoda.replicas.autoscaler import Autoscaler
from pagoda.replicas.replica_set import ReplicaSet
from pagoda.replicas.scale_decider import ScalingRules
from pagoda.replicas.supervised_engine import SupervisedEngine
from pagoda.replicas.supervisor import EngineKeeper, EngineSupervisor, RestartPolicy

logger = logging.getLogger(__name__)


def start_engines(
    config: EngineConfig,
    deployment: DeploymentConfig | None = None,
    *,
    transport: TransportKind = "process",
    startup_timeout: float | None = None,
) -> EngineClient:
    """One engine when there is one replica (no `deployment`: one engine), no pool and no Ray:
    a SupervisedEngine that restarts it when it dies, or with `deployment.restart` off the
    plain AsyncLLM; else a replica set, its replicas on `transport` (each its own engine
    process by default) or, with `distributed_executor_backend="ray"`, Ray actors
    (ray_actors.py), autoscaled between min and max replicas when they differ. Without Ray the
    replica count stays fixed (a warning says so when min and max differ).

    Raises RuntimeError when an engine cannot start, ValueError (or OSError) for bad pool
    settings or an unreadable route rules file."""
    deployment = deployment or DeploymentConfig()
    deployment.validate_with(config)
    if config.role != "both":
        raise ValueError(
            f"role {config.role} runs only as a replica beside its partner: serve with "
            f"--replica-roles prefill=P,decode=D"
        )
    ray = config.distributed_executor_backend == "ray"
    if deployment.autoscaling and not ray:
        low, high = deployment.replica_range
        logger.warning(
            "--min-replicas %d / --max-replicas %d: autoscaling needs "
            "--distributed-executor-backend ray; serving a fixed %d replicas",
            low,
            high,
            deployment.num_replicas,
        )

    def start_engine(engine: EngineConfig) -> AsyncLLM:
        return AsyncLLM(engine, transport=transport, startup_timeout=startup_timeout)

    if deployment.num_replicas == 1 and deployment.replica_pools is None and not ray:
        if not deployment.restart:
            return start_engine(config)
        keeper = EngineKeeper(functools.partial(start_engine, config), "pagoda-engine-0")
        return SupervisedEngine(EngineSupervisor(keeper, start_engine, "0", RestartPolicy.of(deployment)))
    if ray:
        from pagoda.replicas.ray_actors import connect_ray, start_ray_replica

        connect_ray(config.ray_address)  # once, before the replicas start side by side
        replicas = ReplicaSet.start(config, deployment, start_ray_replica)
        if deployment.autoscaling:
            replicas.autoscaler = Autoscaler(replicas, ScalingRules.of(deployment))
        return replicas

    def start_replica(index: int, replica: EngineConfig) -> AsyncLLM:
        return start_engine(replica)

    return ReplicaSet.start(config, deployment, start_replica)
