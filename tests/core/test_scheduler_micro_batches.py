"""Micro-batches in flight (pipeline parallelism): while a step is in flight its requests are
never scheduled again, preempted or handed to the speculator; each micro-batch takes an even
share of the requests; a request aborted in flight is skipped when its step comes back."""

from __future__ import annotations

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.request import RequestStatus
from test_scheduler import BLOCK_SIZE, make_request


def make_pipelined(
    *, num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8, num_micro_batches: int = 2
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BLOCK_SIZE, False),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=1024,
        num_micro_batches=num_micro_batches,
    )


def collect(scheduler: Scheduler, output: SchedulerOutput, token_id: int = 7) -> None:
    scheduler.update_from_output(output, {e.request.request_id: [token_id] for e in output.scheduled if e.samples})


def ids(output: SchedulerOutput) -> list[str]:
    return [entry.request.request_id for entry in output.scheduled]


def test_micro_batches_in_flight_hold_disjoint_even_shares() -> None:
    scheduler = make_pipelined()
    for name in "abcdef":
        scheduler.add_request(make_request(name, 4))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert ids(first) == ["a", "b", "c"] and ids(second) == ["d", "e", "f"]
    assert scheduler.schedule().is_empty  # everything is in flight
    assert scheduler.not_in_flight() == []
    collect(scheduler, first)
    third = scheduler.schedule()  # the first batch's requests decode while the second is out
    assert ids(third) == ["a", "b", "c"] and all(e.num_new_tokens == 1 for e in third.scheduled)
    collect(scheduler, second)
    collect(scheduler, third)
    assert ids(scheduler.schedule()) == ["a", "b", "c"]


def test_a_request_in_flight_is_never_preempted() -> None:
    # a and b fill the 2 blocks; b's next step needs a block while a is in flight: b gives way.
    scheduler = make_pipelined(num_blocks=2)
    a, b = make_request("a", 4), make_request("b", 4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert ids(first) == ["a"] and ids(second) == ["b"]
    collect(scheduler, second)
    third = scheduler.schedule()
    assert third.preempted == [b] and third.is_empty
    assert a.status == RequestStatus.RUNNING and a.block_ids
    collect(scheduler, first)
    assert ids(scheduler.schedule()) == ["a"]


def test_a_request_aborted_in_flight_is_skipped_when_its_step_returns() -> None:
    scheduler = make_pipelined()
    a, b = make_request("a", 4), make_request("b", 4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first, second = scheduler.schedule(), scheduler.schedule()
    scheduler.finish_requests([a], RequestStatus.FINISHED_ABORTED)
    assert a.block_ids == [] and scheduler.kv_cache.num_free_blocks == 63  # a's block is back at once
    collect(scheduler, first)
    collect(scheduler, second)
    assert a.output_token_ids == [] and b.output_token_ids == [7]
    assert ids(scheduler.schedule()) == ["b"]


def test_one_micro_batch_tracks_nothing() -> None:
    scheduler = make_pipelined(num_micro_batches=1)
    for name in "abc":
        scheduler.add_request(make_request(name, 4))
    assert ids(scheduler.schedule()) == ["a", "b", "c"]
    assert ids(scheduler.schedule()) == ["a", "b", "c"]  # not updated: the same work again, as always
