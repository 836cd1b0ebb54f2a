"""When a replica set grows or shrinks (`--min-replicas` / `--max-replicas`): the decision alone,
on load snapshots and a clock, so that it is tested without engines or Ray.

The replicas are under pressure while the requests waiting in their engines, per serving
replica, reach `--scale-up-queue-depth`, or while their KV usage reaches `--scale-up-kv-usage`;
pressure held for `--scale-up-window` adds a replica. They are idle while no request waits and
the KV blocks in use would fill less than `--scale-down-kv-usage` of one replica fewer (so that
removing one does not itself make pressure); idleness held for `--scale-down-window` removes
one. A window starts again after every decision and while a replica is joining or draining: the
next decision reads the set the last one made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagoda.config import DeploymentConfig

Direction = Literal["up", "down"]
# Why: queue_depth or kv_usage (up), idle (down).
Reason = Literal["queue_depth", "kv_usage", "idle"]


@dataclass(frozen=True)
class ScalingRules:
    """The thresholds and windows of DeploymentConfig's autoscaling fields."""

    min_replicas: int
    max_replicas: int
    up_queue_depth: float = 4.0  # waiting requests per serving replica
    up_kv_usage: float = 0.9
    up_window: float = 30.0  # seconds
    down_kv_usage: float = 0.3
    down_window: float = 300.0  # seconds

    @classmethod
    def of(cls, deployment: DeploymentConfig) -> ScalingRules:
        low, high = deployment.replica_range
        return cls(
            low,
            high,
            deployment.scale_up_queue_depth,
            deployment.scale_up_kv_usage,
            deployment.scale_up_window,
            deployment.scale_down_kv_usage,
            deployment.scale_down_window,
        )


@dataclass(frozen=True)
class SetLoad:
    """One look at the replica set: how many replicas serve, and their engines' stats summed."""

    serving: int  # replicas in rotation (not starting, not draining)
    changing: bool  # a replica is joining or draining
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int

    @property
    def kv_usage(self) -> float:
        used = self.num_total_blocks - self.num_free_blocks
        return used / self.num_total_blocks if self.num_total_blocks else 0.0


@dataclass(frozen=True)
class ScaleDecision:
    direction: Direction
    reason: Reason
    replicas: int  # the count before
    desired: int  # the count after
    detail: str  # what held, for the log line

    def describe(self) -> str:
        return f"scaling {self.direction} from {self.replicas} to {self.desired} replicas: {self.detail}"


class ScaleDecider:
    """Feed it a SetLoad now and then (`observe`); it answers a ScaleDecision when a window held."""

    def __init__(self, rules: ScalingRules) -> None:
        self.rules = rules
        self._pressure_since: float | None = None
        self._idle_since: float | None = None

    def observe(self, load: SetLoad, now: float) -> ScaleDecision | None:
        if load.changing or load.serving == 0:
            # The set is not what the next decision should read yet (a dead set is the
            # supervisors' to restart, not a reason to scale).
            self._pressure_since = self._idle_since = None
            return None
        pressure = self._pressure(load)
        idle = pressure is None and self._idle(load)
        if pressure is None:
            self._pressure_since = None
        elif self._pressure_since is None:
            self._pressure_since = now
        if not idle:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now
        rules = self.rules
        if (
            pressure is not None
            and self._pressure_since is not None
            and load.serving < rules.max_replicas
            and now - self._pressure_since >= rules.up_window
        ):
            reason, detail = pressure
            self._pressure_since = None
            return ScaleDecision("up", reason, load.serving, load.serving + 1, f"{detail} for {rules.up_window:g} s")
        if (
            self._idle_since is not None
            and load.serving > rules.min_replicas
            and now - self._idle_since >= rules.down_window
        ):
            self._idle_since = None
            return ScaleDecision(
                "down",
                "idle",
                load.serving,
                load.serving - 1,
                f"no request waiting and KV usage {load.kv_usage:.0%} for {rules.down_window:g} s",
            )
        return None

    def _pressure(self, load: SetLoad) -> tuple[Reason, str] | None:
        per_replica = load.num_waiting / load.serving
        if per_replica >= self.rules.up_queue_depth:
            return "queue_depth", (f"{per_replica:g} requests waiting per replica (>= {self.rules.up_queue_depth:g})")
        if load.num_total_blocks and load.kv_usage >= self.rules.up_kv_usage:
            return "kv_usage", f"KV usage {load.kv_usage:.0%} (>= {self.rules.up_kv_usage:.0%})"
        return None

    def _idle(self, load: SetLoad) -> bool:
        if load.num_waiting:
            return False
        if load.serving == 1:
            return True  # nothing to remove below one; min_replicas decides
        used = load.num_total_blocks - load.num_free_blocks
        fewer = load.num_total_blocks * (load.serving - 1) / load.serving
        return fewer > 0 and used / fewer < self.rules.down_kv_usage
