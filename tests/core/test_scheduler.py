"""The scheduler on its own, no model: token budget, chunked prefill, admission limits and
preemption victims under FCFS and priority. Each step is driven by hand: schedule(), then
update_from_output() with made-up sampled tokens."""

from __future__ import annotations

import itertools

import pytest

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams

BLOCK_SIZE = 4
_arrivals = itertools.count(1)


def make_request(request_id: str, num_prompt: int, *, max_tokens: int = 8, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, num_prompt + 1)),
        sampling_params=params,
        eos_token_ids=frozenset(),
        max_output_tokens=max_tokens,
        arrival_time=float(next(_arrivals)),
        priority=priority,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 8,
    chunked: bool = True,
    policy: str = "fcfs",
    caching: bool = False,
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BLOCK_SIZE, caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=1024,
        enable_chunked_prefill=chunked,
        policy=policy,
    )


def step(scheduler: Scheduler, token_id: int = 7) -> SchedulerOutput:
    """One engine step: every request whose chunk reaches its end samples `token_id`."""
    output = scheduler.schedule()
    sampled = {e.request.request_id: [token_id] for e in output.scheduled if e.samples}
    scheduler.update_from_output(output, sampled)
    return output


def scheduled_tokens(output: SchedulerOutput) -> dict[str, int]:
    return {e.request.request_id: e.num_new_tokens for e in output.scheduled}


# ---- budget and chunked prefill -------------------------------------------------------------


def test_long_prompt_is_cut_into_budget_sized_chunks() -> None:
    scheduler = make_scheduler(budget=32)
    request = make_request("a", 100)
    scheduler.add_request(request)
    chunks = []
    while not request.num_output_tokens:
        output = scheduler.schedule()
        (entry,) = output.scheduled
        chunks.append((entry.num_computed_before, entry.num_new_tokens, entry.samples))
        scheduler.update_from_output(output, {"a": [7]} if entry.samples else {})
    # Only the last chunk reaches the end of the prompt and samples a token.
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert request.num_computed_tokens == 100 and request.output_token_ids == [7]
    assert scheduled_tokens(step(scheduler)) == {"a": 1}  # then one token per decode step


def test_budget_is_shared_running_first_then_waiting() -> None:
    scheduler = make_scheduler(budget=16)
    first, second = make_request("a", 10), make_request("b", 10)
    scheduler.add_request(first)
    scheduler.add_request(second)
    assert scheduled_tokens(step(scheduler)) == {"a": 10, "b": 6}  # b gets what is left
    # a decodes (1 token) before b's prompt continues (4 tokens).
    assert scheduled_tokens(step(scheduler)) == {"a": 1, "b": 4}
    assert second.num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    scheduler = make_scheduler(budget=16, chunked=False)
    scheduler.add_request(make_request("a", 10))
    scheduler.add_request(make_request("b", 10))
    assert scheduled_tokens(step(scheduler)) == {"a": 10}  # b does not fit in the 6 left
    assert scheduled_tokens(step(scheduler)) == {"a": 1, "b": 10}


def test_budget_of_one_token_still_makes_progress() -> None:
    scheduler = make_scheduler(budget=1)
    request = make_request("a", 3, max_tokens=2)
    scheduler.add_request(request)
    for _ in range(4):
        assert scheduled_tokens(step(scheduler)) == {"a": 1}
    assert request.status == RequestStatus.FINISHED_LENGTH and request.output_token_ids == [7, 7]
    assert not scheduler.has_unfinished_requests()


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(name, 4) for name in "abc"]
    for request in requests:
        scheduler.add_request(request)
    assert scheduled_tokens(step(scheduler)) == {"a": 4, "b": 4}
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    scheduler.finish_requests([requests[0]], RequestStatus.FINISHED_ABORTED)
    assert scheduled_tokens(step(scheduler)) == {"b": 1, "c": 4}  # a freed seat admits c


def with_samples(lead: Request, n: int) -> Request:
    """`lead` with n - 1 samples to fork off it, as the engine builds an `n > 1` request."""
    lead.pending_forks = [lead.new_sample(i) for i in range(1, n)]
    return lead


def run_to_completion(scheduler: Scheduler) -> int:
    """Step until nothing is left; the most sequences that were ever running at once."""
    peak = 0
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            return peak
        step(scheduler)
        peak = max(peak, len(scheduler.running), scheduler.num_running_seqs)
    raise AssertionError("the scheduler made no progress")


def test_samples_of_n_count_against_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=4)
    leads = [with_samples(make_request(name, 6, max_tokens=3), 4) for name in "abc"]
    for lead in leads:
        scheduler.add_request(lead)
    step(scheduler)
    # The first prompt's 4 samples take every seat: the other prompts wait, not fork beside it.
    assert [r.request_id for r in scheduler.running] == ["a", "a#1", "a#2", "a#3"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert run_to_completion(scheduler) == 4


def test_more_samples_than_max_num_seqs_run_a_few_at_a_time() -> None:
    scheduler = make_scheduler(max_num_seqs=3)
    lead = with_samples(make_request("a", 6, max_tokens=3), 7)
    samples = [lead, *lead.pending_forks]
    scheduler.add_request(lead)
    assert lead.num_sequences == 3 and len(scheduler.waiting) == 5
    assert run_to_completion(scheduler) == 3
    assert all(s.output_token_ids == [7, 7, 7] for s in samples)


def test_a_batch_of_prompts_never_exceeds_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=4, num_blocks=256)
    for i in range(6):
        scheduler.add_request(with_samples(make_request(f"p{i}", 5 + i, max_tokens=4), 1 + i % 3))
    assert run_to_completion(scheduler) == 4


def test_request_that_can_never_fit_waits_without_taking_blocks() -> None:
    # 4 blocks of 4 tokens; a 40-token prompt needs 10. (The engine rejects such a request
    # before it reaches the scheduler; the scheduler itself must not loop or leak blocks.)
    scheduler = make_scheduler(num_blocks=4, budget=64)
    scheduler.add_request(make_request("huge", 40))
    scheduler.add_request(make_request("small", 4))
    output = scheduler.schedule()
    assert output.is_empty and not output.preempted
    assert [r.request_id for r in scheduler.waiting] == ["huge", "small"]  # FCFS: no overtaking
    assert scheduler.kv_cache.num_free_blocks == 4


# ---- preemption ---------------------------------------------------------------------------------


def fill_pool(scheduler: Scheduler, requests: list[Request]) -> None:
    for request in requests:
        scheduler.add_request(request)
    step(scheduler)
    assert all(r.status == RequestStatus.RUNNING for r in requests)


def test_fcfs_preempts_the_newest_running_request() -> None:
    # 3 requests x 4 prompt tokens fill 3 of 3 blocks; the next decode step needs a new block each.
    scheduler = make_scheduler(num_blocks=3)
    a, b, c = make_request("a", 4), make_request("b", 4), make_request("c", 4)
    fill_pool(scheduler, [a, b, c])
    output = step(scheduler)
    assert output.preempted == [c, b]  # newest first, until a fits
    assert scheduled_tokens(output) == {"a": 1}
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]  # back at the front, in order
    for victim in (b, c):
        assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
        assert victim.block_ids == [] and victim.metrics.num_preemptions == 1
    assert scheduler.num_preemptions == 2


def test_preempted_request_resumes_with_its_tokens_recomputed() -> None:
    scheduler = make_scheduler(num_blocks=3)
    a, b = make_request("a", 4, max_tokens=2), make_request("b", 6, max_tokens=2)
    fill_pool(scheduler, [a, b])
    assert step(scheduler).preempted == [b]
    while scheduler.has_unfinished_requests():
        step(scheduler)
    # b's prompt and its first output token were recomputed; it still got exactly two tokens.
    assert a.output_token_ids == [7, 7] and b.output_token_ids == [7, 7]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.kv_cache.num_free_blocks == 3


def test_priority_preempts_the_lowest_priority_running_request() -> None:
    scheduler = make_scheduler(num_blocks=3, policy="priority")
    low, high, mid = (
        make_request("low", 4, priority=5),
        make_request("high", 4, priority=0),
        make_request("mid", 4, priority=1),
    )
    fill_pool(scheduler, [low, high, mid])
    output = step(scheduler)
    assert output.preempted[0] is low  # not the newest (mid): the largest priority value
    assert low.status == RequestStatus.PREEMPTED and high.status == RequestStatus.RUNNING


def test_priority_arrival_preempts_a_lower_priority_request() -> None:
    # low's next decode token takes the pool's last block: urgent can only get in by preempting it.
    scheduler = make_scheduler(num_blocks=3, policy="priority")
    low = make_request("low", 8, priority=3)
    fill_pool(scheduler, [low])
    urgent = make_request("urgent", 4, priority=0)
    scheduler.add_request(urgent)
    output = scheduler.schedule()
    assert output.preempted == [low]
    assert scheduled_tokens(output) == {"urgent": 4}


def test_fcfs_arrival_never_preempts() -> None:
    scheduler = make_scheduler(num_blocks=3)
    first = make_request("first", 8)
    fill_pool(scheduler, [first])
    scheduler.add_request(make_request("later", 4))
    output = scheduler.schedule()
    assert not output.preempted and "later" not in scheduled_tokens(output)


def test_equal_priority_falls_back_to_arrival_order() -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    for request in (
        make_request("x", 4, priority=2),
        make_request("y", 4, priority=1),
        make_request("z", 4, priority=1),
    ):
        scheduler.add_request(request)
    assert [r.request_id for r in scheduler.waiting] == ["y", "z", "x"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_speculative_tokens_fit_in_what_is_left(policy: str) -> None:
    scheduler = make_scheduler(budget=3, policy=policy)
    request = make_request("a", 2, max_tokens=8)
    scheduler.add_request(request)
    step(scheduler)  # prompt, then one sampled token: now decoding
    request.spec.num_wanted, request.spec.token_ids = 4, [1, 2, 3, 4]
    output = scheduler.schedule()
    (entry,) = output.scheduled
    # 1 real token + 2 drafts fill the budget of 3.
    assert (entry.num_new_tokens, entry.num_spec_tokens) == (3, 2)
    scheduler.update_from_output(output, {"a": [1, 9]})  # one draft accepted, then the target's token
    assert request.output_token_ids == [7, 1, 9] and request.num_computed_tokens == 4
    assert request.spec.token_ids == [] and request.spec.num_wanted == 0
