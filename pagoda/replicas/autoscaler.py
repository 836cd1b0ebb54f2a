"""Autoscaler: keeps a replica set between `--min-replicas` and `--max-replicas` (Ray backend).

A thread looks at the set every `interval` seconds: it stops the replicas that finished
draining, hands the set's load to the ScaleDecider (scale_decider.py) and carries out what it
decides. Up: a replica is started on a thread of its own (Ray places it on the cluster's free
resources, waiting for them if there are none) and joins the router once ready
(ReplicaSet.add_replica); a start that fails is logged and the target falls back. Down: the
newest replica is drained (ReplicaSet.drain_replica), then stopped once its requests are done.
Every decision is logged and counted by direction and reason; the set's /health body carries
the count, the target and the counts (`autoscale`), which the metrics read.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagoda.replicas.scale_decider import ScaleDecider, ScaleDecision, ScalingRules, SetLoad

if TYPE_CHECKING:
    from pagoda.replicas.replica import Replica
    from pagoda.replicas.replica_set import ReplicaSet

logger = logging.getLogger(__name__)

# How often the set's load is looked at (the engines report stats every step).
EVALUATE_INTERVAL_S = 0.5


class Autoscaler:
    """Grows and shrinks one ReplicaSet by its ScaleDecider's decisions."""

    def __init__(
        self,
        replicas: ReplicaSet,
        rules: ScalingRules,
        *,
        interval: float = EVALUATE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rules = rules
        self._set = replicas
        self._decider = ScaleDecider(rules)
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self.desired = len(replicas.replicas)  # the target: what the last decision asked for
        self._starting = 0
        self._draining: list[Replica] = []
        self.events: collections.Counter[tuple[str, str]] = collections.Counter()  # (direction, reason)
        self.failed_starts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagoda-autoscaler", daemon=True)
        self._thread.start()

    def state(self) -> dict[str, Any]:
        """The `autoscale` part of the set's /health body."""
        with self._lock:
            serving = sum(1 for r in self._set.replicas if not r.draining and r.is_alive)
            return {
                "replicas": serving,
                "desired": self.desired,
                "min": self.rules.min_replicas,
                "max": self.rules.max_replicas,
                "starting": self._starting,
                "draining": len(self._draining),
                "failed_starts": self.failed_starts,
                "scale_events": [
                    {"direction": direction, "reason": reason, "count": count}
                    for (direction, reason), count in sorted(self.events.items())
                ],
            }

    def load(self) -> SetLoad:
        serving = [r for r in self._set.replicas if not r.draining and r.is_alive]
        stats = [s for s in (r.llm.get_stats() for r in serving) if s is not None]
        restarting = any(not r.is_alive and r.supervisor.state().status == "restarting" for r in self._set.replicas)
        with self._lock:
            changing = bool(self._starting or self._draining) or restarting
        return SetLoad(
            serving=len(serving),
            changing=changing,
            num_waiting=sum(s.num_waiting for s in stats),
            num_total_blocks=sum(s.num_total_blocks for s in stats),
            num_free_blocks=sum(s.num_free_blocks for s in stats),
        )

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._retire_drained()
                decision = self._decider.observe(self.load(), self._clock())
                if decision is not None:
                    self._act(decision)
            except Exception:
                logger.exception("autoscaler: looking at the replicas failed")

    def _act(self, decision: ScaleDecision) -> None:
        replica = self._set.drain_replica() if decision.direction == "down" else None
        if decision.direction == "down" and replica is None:
            return  # one replica left in rotation (the others draining or gone): nothing to remove
        logger.info("replicas of %s: %s", self._set.config.model, decision.describe())
        with self._lock:
            self.events[(decision.direction, decision.reason)] += 1
            self.desired = decision.desired
            if replica is None:
                self._starting += 1
            else:
                self._draining.append(replica)
        if replica is None:
            threading.Thread(target=self._grow, name="pagoda-autoscaler-start", daemon=True).start()
        else:
            logger.info(
                "replicas of %s: draining replica %s (%d requests in flight)",
                self._set.config.model,
                replica.label,
                replica.num_requests,
            )

    def _grow(self) -> None:
        try:
            replica = self._set.add_replica()
        except BaseException as exc:
            if self._stop.is_set():
                return
            logger.error(
                "replicas of %s: the added replica did not start (%s); %d replicas serve",
                self._set.config.model,
                exc.__cause__ or exc,
                len(self._set.replicas),
            )
            with self._lock:
                self.failed_starts += 1
                self.desired -= 1
        else:
            logger.info(
                "replicas of %s: replica %s joined (pid %s); %d replicas serve",
                self._set.config.model,
                replica.label,
                replica.llm.engine_pid,
                len(self._set.replicas),
            )
        finally:
            with self._lock:
                self._starting -= 1

    def _retire_drained(self) -> None:
        with self._lock:
            draining = list(self._draining)
        for replica in draining:
            if self._set.retire_drained(replica):
                logger.info(
                    "replicas of %s: replica %s drained and stopped; %d replicas serve",
                    self._set.config.model,
                    replica.label,
                    len(self._set.replicas),
                )
                with self._lock:
                    self._draining.remove(replica)
