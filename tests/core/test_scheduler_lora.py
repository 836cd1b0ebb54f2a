"""--max-loras in the scheduler: adapter limit per step and no starvation."""

from __future__ import annotations

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.lora_request import AdapterIdentity
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams


def _request(request_id: str, adapter: str | None, max_tokens: int = 4) -> Request:
    lora = AdapterIdentity(adapter, adapter, hash(adapter) & 0xFFFF) if adapter else None
    return Request(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        eos_token_ids=frozenset(),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_output_tokens=max_tokens,
        lora=lora,
    )


def _finish_step(scheduler: Scheduler, output) -> None:
    scheduler.update_from_output(output, {e.request.request_id: [7] for e in output.scheduled if e.samples})


def test_steady_stream_of_one_adapter_does_not_starve_another() -> None:
    scheduler = Scheduler(
        KVCacheManager(256, 4, True), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, max_loras=1
    )
    scheduler.add_request(_request("a0", "A", max_tokens=50))
    scheduler.add_request(_request("b0", "B"))
    admitted_b_at = None
    for step in range(200):
        # A keeps arriving behind b0, each able to join the running A requests.
        scheduler.add_request(_request(f"a{step + 1}", "A", max_tokens=3))
        output = scheduler.schedule()
        adapters = {e.request.lora.name for e in output.scheduled if e.request.lora}
        assert len(adapters) <= 1
        if "B" in adapters and admitted_b_at is None:
            admitted_b_at = step
        _finish_step(scheduler, output)
    assert admitted_b_at is not None and admitted_b_at < 80


def test_base_requests_are_never_held_back_by_the_adapter_limit() -> None:
    scheduler = Scheduler(
        KVCacheManager(256, 4, True), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, max_loras=1
    )
    for request in (_request("a", "A"), _request("b", "B"), _request("base", None)):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert {e.request.request_id for e in output.scheduled} == {"a", "base"}
    assert [r.request_id for r in scheduler.waiting] == ["b"]
