"""The `ray` backend: tensor-parallel ranks 1..N-1 (or pipeline stages' ranks) as Ray actors in
one placement group.

The group has one bundle per rank (1 CPU, or 1 GPU on CUDA) with STRICT_PACK, so a replica's
ranks share a node (tensor parallelism all-reduces twice per layer: it wants the fastest link);
pipeline stages only pass hidden states from one to the next, so their group is PACK: one node
when it fits, else the ranks spread over nodes (a stage's own tensor-parallel ranks too: Ray's
groups cannot pack subsets);
bundle 0 reserves rank 0's share for the engine core's process, which stays the driver. An
engine core that runs inside a Ray actor already placed in a group of at least N bundles (a
data-parallel replica placed by its launcher in bundle 0) uses that group's bundles 1..N-1. The
cluster is `--ray-address` (e.g. `auto` for one started with `ray start --head`), or a local
one started on demand. Ray is optional (`pip install pagoda[ray]`).

Each actor runs `run_worker` in one long call; the watcher learns of an actor's death when
that call's result resolves (RayActorError) before the stop.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from pagoda.executor.channel import encode
from pagoda.executor.process_workers import OnWorkerExit
from pagoda.executor.worker import WorkerSpec

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend=ray needs Ray: pip install 'pagoda[ray]'") from None
    return ray


def ensure_ray(address: str | None) -> None:
    """Connect to the cluster at `address`, or start a local one, unless already connected
    (inside a Ray actor, or a caller that initialized Ray itself)."""
    ray = _import_ray()
    if ray.is_initialized():
        return
    # Actors on this machine import the same pagoda as the driver.
    root = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={
            "env_vars": {"PYTHONPATH": pythonpath, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        },
    )


def node_address(address: str | None) -> str:
    """This node's IP as Ray sees it: where rank 0's store listens for the actors."""
    ensure_ray(address)
    ray = _import_ray()
    return ray.util.get_node_ip_address()


class _RankActor:
    """One worker rank (wrapped with ray.remote on first use)."""

    def run(self, encoded_spec: bytes) -> None:
        from pagoda.executor.channel import decode
        from pagoda.executor.worker import run_worker

        spec = decode(encoded_spec, WorkerSpec)  # typed, as on the mp backend's stdin

        # Like the engine process and the mp workers: a terminal's Ctrl-C or a SIGTERM to the
        # server's process group must not end a rank while the server drains (Ray's own
        # handler would raise SystemExit here); rank 0 stops or kills the actor.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        run_worker(spec)


class RayWorkers:
    def __init__(self, specs: list[WorkerSpec], address: str | None) -> None:
        ensure_ray(address)
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = len(specs) + 1
        on_gpu = specs[0].device.startswith("cuda")
        strategy = "PACK" if specs[0].stage is not None else "STRICT_PACK"
        bundle = {"GPU": 1} if on_gpu else {"CPU": 1}
        # An engine that is itself a Ray actor placed in bundle 0 of a group of >= N bundles
        # (a data-parallel replica) puts its ranks in that group's other bundles.
        current = ray.util.get_current_placement_group()
        self.owns_group = current is None or len(current.bundle_specs) < world_size
        if self.owns_group:
            self.placement_group = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
        else:
            self.placement_group = current
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            self._remove_group()
            where = "on one node" if strategy == "STRICT_PACK" else "in the cluster"
            raise RuntimeError(
                f"Ray could not place {world_size} ranks ({bundle} each) {where} "
                f"within {PLACEMENT_TIMEOUT_S:.0f} s: {ray.cluster_resources()} in the cluster"
            )
        actor_class = ray.remote(_RankActor)
        self.ranks = [spec.rank for spec in specs]
        self.titles = [spec.title for spec in specs]
        self.actors = [
            actor_class.options(
                num_cpus=0 if on_gpu else 1,
                num_gpus=1 if on_gpu else 0,
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=spec.rank
                ),
            ).remote()
            for spec in specs
        ]
        self.runs = [actor.run.remote(encode(spec)) for actor, spec in zip(self.actors, specs)]
        self._stopping = threading.Event()

    def watch(self, on_exit: OnWorkerExit) -> None:
        ray = _import_ray()

        def wait() -> None:
            pending = list(self.runs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                if self._stopping.is_set():
                    return
                index = self.runs.index(done[0])
                try:
                    ray.get(done[0])
                    why = "returned before the engine stopped"
                except Exception as error:  # RayActorError, or the worker's own exception
                    why = f"died ({type(error).__name__}: {str(error).strip().splitlines()[0]})"
                on_exit(self.ranks[index], f"{self.titles[index]} (Ray actor) {why}")
                return

        threading.Thread(target=wait, name="pagoda-tp-ray-watch", daemon=True).start()

    def stop(self, timeout: float) -> None:
        ray = _import_ray()
        self._stopping.set()
        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        self.kill()

    def kill(self) -> None:
        self._stopping.set()
        ray = _import_ray()
        if not ray.is_initialized():
            return
        for actor in self.actors:
            ray.kill(actor)
        self._remove_group()

    def _remove_group(self) -> None:
        if self.owns_group:
            _import_ray().util.remove_placement_group(self.placement_group)
