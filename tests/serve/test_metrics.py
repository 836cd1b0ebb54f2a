"""Prometheus series a vLLM dashboard expects, under pagoda: and (with compat) vllm: names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.outputs import RequestMetrics
from pagoda.serve.metrics.server import ServerMetrics


def scrape(metrics: ServerMetrics) -> dict[str, float]:
    body, _ = metrics.render()
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    key = name + str(sorted({"model_name": "m", **labels}.items()))
    return samples[key]


def finished_request() -> RequestMetrics:
    return RequestMetrics(
        arrival_time=100.0,
        first_scheduled_time=100.5,
        first_token_time=101.0,
        last_token_time=103.0,
        finished_time=103.0,
    )


def test_request_phases_and_token_histograms() -> None:
    metrics = ServerMetrics("m", lambda: None)
    metrics.record_finished("stop", finished_request(), num_prompt_tokens=40, num_generation_tokens=7)
    samples = scrape(metrics)
    assert value(samples, "pagoda:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert value(samples, "pagoda:request_decode_time_seconds_sum") == pytest.approx(2.0)
    assert value(samples, "pagoda:request_inference_time_seconds_sum") == pytest.approx(2.5)
    assert value(samples, "pagoda:request_prompt_tokens_sum") == 40
    assert value(samples, "pagoda:request_prompt_tokens_bucket", le="48.0") == 1
    assert value(samples, "pagoda:request_prompt_tokens_bucket", le="32.0") == 0
    assert value(samples, "pagoda:request_generation_tokens_count") == 1
    assert value(samples, "pagoda:iteration_tokens_total_count") == 0
    assert not any(name.startswith("vllm:") for name in samples)


def test_iteration_tokens_from_engine_stats() -> None:
    histogram = SimpleNamespace(counts=[0, 3, 0, 0, 2] + [0] * 24, sum=3 * 2 + 2 * 8)
    stats = SimpleNamespace(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.25,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_generation_tokens=0,
        spec_decode=None,
        iteration_tokens=histogram,
    )
    samples = scrape(ServerMetrics("m", lambda: stats))
    assert value(samples, "pagoda:iteration_tokens_total_count") == 5
    assert value(samples, "pagoda:iteration_tokens_total_bucket", le="2.0") == 3
    assert value(samples, "pagoda:iteration_tokens_total_sum") == 22


def test_vllm_compat_exports_every_series_twice_with_aliases() -> None:
    stats = SimpleNamespace(
        num_running=2,
        num_waiting=1,
        kv_cache_usage=0.5,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
        num_preemptions=0,
        num_prompt_tokens=10,
        num_generation_tokens=3,
        spec_decode=None,
    )
    metrics = ServerMetrics("m", lambda: stats, compat="vllm")
    metrics.record_finished("length", finished_request(), num_prompt_tokens=10, num_generation_tokens=3)
    metrics.record_inter_token(0.02, 2)
    samples = scrape(metrics)
    for pagoda_name, vllm_name in [
        ("pagoda:num_requests_running", "vllm:num_requests_running"),
        ("pagoda:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        ("pagoda:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ("pagoda:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        ("pagoda:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_sum"),
        ("pagoda:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"),
        ("pagoda:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
    ]:
        assert value(samples, vllm_name) == value(samples, pagoda_name)
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1


def test_unknown_compat_is_refused() -> None:
    with pytest.raises(ValueError, match="metrics_compat"):
        ServerMetrics("m", lambda: None, compat="sglang")  # type: ignore[arg-type]


def test_iteration_tokens_come_from_a_real_engine(llama_dir) -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(llama_dir), num_kv_blocks=64, max_num_batched_tokens=8)
    llm.generate(["hello world, this prompt is chunked"], SamplingParams(temperature=0, max_tokens=3))
    stats = llm.engine.get_stats()
    samples = scrape(ServerMetrics("m", lambda: stats))
    steps = value(samples, "pagoda:iteration_tokens_total_count")
    assert steps >= 3 and value(samples, "pagoda:iteration_tokens_total_sum") == stats.iteration_tokens.sum
    assert value(samples, "pagoda:iteration_tokens_total_bucket", le="8.0") == steps  # budget 8
