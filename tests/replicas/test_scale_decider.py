"""The autoscaler's decision on load snapshots and a fake clock: pressure (queue depth, KV usage)
held for the up window adds a replica, idleness held for the down window removes one, within
min and max; windows start again after a decision and while the set is changing. Plus the
settings' checks."""

from __future__ import annotations

import pytest

from pagoda.config import DeploymentConfig
from pagoda.replicas.scale_decider import ScaleDecider, ScalingRules, SetLoad

RULES = ScalingRules(
    min_replicas=1, max_replicas=3, up_queue_depth=2, up_kv_usage=0.9, up_window=10, down_kv_usage=0.3, down_window=60
)


def load(
    serving: int, waiting: int = 0, used_blocks: int = 0, *, changing: bool = False, blocks_per_replica: int = 100
) -> SetLoad:
    total = blocks_per_replica * serving
    return SetLoad(serving, changing, waiting, total, total - used_blocks)


def run(decider: ScaleDecider, snapshot: SetLoad, start: float, end: float, step: float = 1.0):
    """Observe the same load from `start` to `end`; the decisions made, with their times."""
    decisions = []
    now = start
    while now <= end:
        decision = decider.observe(snapshot, now)
        if decision is not None:
            decisions.append((now, decision))
        now += step
    return decisions


def test_a_queue_held_for_the_window_adds_one_replica_and_the_window_starts_again() -> None:
    decider = ScaleDecider(RULES)
    decisions = run(decider, load(1, waiting=2), 0, 25)
    assert [(t, d.direction, d.reason, d.replicas, d.desired) for t, d in decisions] == [
        (10, "up", "queue_depth", 1, 2),
        (21, "up", "queue_depth", 1, 2),
    ]
    assert "2 requests waiting per replica" in decisions[0][1].describe()


def test_a_queue_that_does_not_hold_adds_nothing() -> None:
    decider = ScaleDecider(RULES)
    for t in range(30):
        assert decider.observe(load(1, waiting=2 if t % 5 else 0), float(t)) is None
    # Below the threshold per replica: 3 waiting over 2 replicas is 1.5 each.
    assert run(ScaleDecider(RULES), load(2, waiting=3), 0, 30) == []


def test_kv_usage_is_pressure_too_and_max_replicas_caps() -> None:
    decisions = run(ScaleDecider(RULES), load(2, used_blocks=190), 0, 10)
    assert [(d.reason, d.desired) for _, d in decisions] == [("kv_usage", 3)]
    assert run(ScaleDecider(RULES), load(3, waiting=30, used_blocks=300), 0, 100) == []


def test_idle_for_the_down_window_removes_one_down_to_min() -> None:
    decider = ScaleDecider(RULES)
    decisions = run(decider, load(3), 0, 60)
    assert [(t, d.direction, d.reason, d.desired) for t, d in decisions] == [(60, "down", "idle", 2)]
    assert run(ScaleDecider(RULES), load(1), 0, 1000) == []  # at min


def test_running_requests_that_would_crowd_one_replica_fewer_are_not_idle() -> None:
    # 2 replicas of 100 blocks, 40 used: 40% of the 100 left after removing one (>= 30%).
    assert run(ScaleDecider(RULES), load(2, used_blocks=40), 0, 200) == []
    # 20 used: 20% of one replica, idle though requests run.
    assert len(run(ScaleDecider(RULES), load(2, used_blocks=20), 0, 60)) == 1
    # Anything waiting is not idle.
    assert run(ScaleDecider(RULES), load(2, waiting=1), 0, 200) == []


def test_windows_start_again_while_the_set_changes() -> None:
    decider = ScaleDecider(RULES)
    assert run(decider, load(1, waiting=5), 0, 9) == []
    assert decider.observe(load(1, waiting=5, changing=True), 9.5) is None  # a replica is joining
    decisions = run(decider, load(1, waiting=5), 10, 30)
    assert [t for t, _ in decisions] == [20]  # a whole window after the change


def test_the_autoscaling_settings_are_checked() -> None:
    assert DeploymentConfig(min_replicas=1, max_replicas=4).autoscaling
    assert DeploymentConfig(min_replicas=1, max_replicas=4, data_parallel_size=2).num_replicas == 2
    assert DeploymentConfig(min_replicas=3, max_replicas=4).num_replicas == 3
    assert DeploymentConfig(min_replicas=2).replica_range == (2, 2)
    assert not DeploymentConfig(data_parallel_size=3).autoscaling
    assert ScalingRules.of(DeploymentConfig(max_replicas=5, scale_up_window=1)).up_window == 1
    with pytest.raises(ValueError, match="min_replicas .3. is more than max_replicas .2."):
        DeploymentConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="min_replicas must be >= 1"):
        DeploymentConfig(min_replicas=0)
    with pytest.raises(ValueError, match="cannot be combined with min_replicas"):
        DeploymentConfig(max_replicas=3, replica_roles="prefill=1,decode=1")
    with pytest.raises(ValueError, match="scale_down_kv_usage"):
        DeploymentConfig(max_replicas=3, scale_down_kv_usage=0.95)
