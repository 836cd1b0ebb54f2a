"""Latency-aware admission: refuse while the window's p90 misses a target, reopen as it drains."""

from __future__ import annotations

import pytest

from pagoda.serve.admission.latency_targets import LatencyGuard, LatencyTargets, LatencyWindow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_window_percentile_is_weighted_and_expires() -> None:
    clock = Clock()
    window = LatencyWindow(5.0, clock)
    window.observe(0.010, weight=9)
    window.observe(0.500, weight=1)
    assert window.count() == 10
    assert window.percentile(0.9) == 0.010
    assert window.percentile(1.0) == 0.500
    clock.now += 6
    assert window.count() == 0 and window.percentile(0.5) is None


def test_refuses_while_itl_p90_is_over_target_then_reopens() -> None:
    clock = Clock()
    guard = LatencyGuard(LatencyTargets(itl_s=0.05, window_s=5.0), clock)
    guard.observe_itl(0.02, num_tokens=50)
    assert guard.check() is None
    clock.now += 1
    guard.observe_itl(0.2, num_tokens=20)  # the batch grew: 20 of 70 gaps are slow
    refusal = guard.check()
    assert refusal is not None and "inter-token latency" in refusal.message
    assert "200 ms" in refusal.message and "50 ms" in refusal.message
    assert 1 <= refusal.retry_after_s <= 5
    clock.now += 5.5  # no new observations while refusing: the window drains
    assert guard.check() is None


def test_ttft_target_and_too_few_samples() -> None:
    clock = Clock()
    guard = LatencyGuard(LatencyTargets(ttft_s=0.5), clock)
    for _ in range(3):
        guard.observe_ttft(2.0)
    assert guard.check() is None  # three samples are not evidence yet
    guard.observe_ttft(2.0)
    refusal = guard.check()
    assert refusal is not None and "time to first token" in refusal.message
    guard.observe_itl(10.0, 100)  # no ITL target: ignored
    assert guard.itl.count() == 0


@pytest.mark.parametrize("kwargs", [{"ttft_s": 0}, {"itl_s": -1.0}, {"ttft_s": float("nan")}, {"window_s": 0}])
def test_bad_targets_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LatencyTargets(**kwargs)


def test_disabled_targets() -> None:
    assert not LatencyTargets().enabled
    assert LatencyTargets(itl_s=0.1).enabled


def test_admission_controller_refuses_with_503_while_targets_are_missed() -> None:
    from pagoda.serve.admission.queue import AdmissionController
    from pagoda.serve.admission.work import RequestWork
    from pagoda.serve.errors import APIError

    controller = AdmissionController(None, None, LatencyTargets(itl_s=0.05))
    controller.reserve(RequestWork(1))[0].leave()
    controller.observe_inter_token(1.0, num_tokens=10)  # 100 ms per token
    with pytest.raises(APIError) as refused:
        controller.reserve(RequestWork(1))
    assert refused.value.status == 503 and "Retry-After" in refused.value.headers
    assert controller.queued_sequences == 0
    plain = AdmissionController(None, None)
    plain.observe_inter_token(1.0, num_tokens=10)
    assert len(plain.reserve(RequestWork(1))) == 1
