"""`pagoda bench route-sim`: the simulator replays traces through the real router policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.bench.route_sim import ReplicaModel, RouteSimOptions, render_table, route_sim, simulate
from pagoda.bench.route_traces import TraceRequest, generate_trace, load_trace, save_trace
from pagoda.bench.step_cost import StepCost, fit
from pagoda.cli import main
from pagoda.replicas.policies import CacheAware, LeastLoad, RoundRobin


def by_policy(report: dict, n: int) -> dict[str, dict]:
    return {r["policy"]: r for r in report["results"] if r["num_replicas"] == n}


def test_cache_aware_beats_round_robin_on_multi_tenant_chat(tmp_path: Path) -> None:
    report = route_sim(RouteSimOptions(trace="chat", replicas=[8], requests_per_replica=60, out=str(tmp_path)))
    results = by_policy(report, 8)
    assert set(results) == {"round_robin", "least_load", "cache_aware"}
    assert results["cache_aware"]["hit_rate"] > 1.4 * results["round_robin"]["hit_rate"]
    assert results["cache_aware"]["imbalance"] < 1.5
    assert results["least_load"]["imbalance"] <= results["round_robin"]["imbalance"] + 0.05
    assert json.loads((tmp_path / "results.json").read_text())["results"] == report["results"]
    assert "cache_aware" in render_table(report)


def test_simulated_replica_serves_every_request_and_caches_repeats() -> None:
    system = list(range(1000, 1064))  # four blocks
    trace = [TraceRequest(i * 0.5, "a", system + [i], 3) for i in range(6)]
    result = simulate(trace, CacheAware(16, 64), 2, ReplicaModel(cost=StepCost(0.001, 1e-5, 1e-4)))
    # Spaced out, each request finds the one before cached (except the first).
    assert result.hit_rate == pytest.approx(5 * 64 / (6 * 65))
    assert result.routed_by_prefix == pytest.approx(5 / 6)
    assert result.ttft_p99_s < 0.01
    # The same prompt for another tenant: never a hit across tenants.
    other = [TraceRequest(i * 0.5, f"t{i}", system + [i], 3) for i in range(6)]
    assert simulate(other, LeastLoad(), 2).hit_rate == 0.0
    assert simulate(other, RoundRobin(), 2).throughput_rps > 0


def test_traces_scale_with_the_fleet_and_round_trip(tmp_path: Path) -> None:
    small = generate_trace("chat", 2, requests_per_replica=20, rate_per_replica=5)
    large = generate_trace("rag", 4, requests_per_replica=20, rate_per_replica=5)
    assert len(small) == 40 and len(large) == 80
    path = tmp_path / "trace.jsonl"
    save_trace(path, small)
    assert load_trace(path, rate=1.0) == small
    # The server's request log (--log-prompts): a prefix, then the JSON record.
    log = tmp_path / "requests.log"
    log.write_text(
        '2026-01-01 INFO pagoda.serve.requests: {"request_id":"x","tenant":"a","status":200,'
        '"prompt":"hello","output_tokens":5}\nnoise\n'
        '2026-01-01 INFO pagoda.serve.requests: {"request_id":"y","status":429,"output_tokens":0}\n'
        '2026-01-01 INFO pagoda.serve.requests: {"request_id":"z","tenant":"b","status":200,'
        '"prompt":["[1, 2, 3]"],"output_tokens":2}\n'
    )
    request, ids = load_trace(log, rate=2.0, tokenize=lambda text: [ord(c) for c in text])
    assert (request.tenant, request.prompt_token_ids, request.output_tokens) == ("a", [104, 101, 108, 108, 111], 5)
    assert (ids.tenant, ids.prompt_token_ids, ids.output_tokens) == ("b", [1, 2, 3], 2)
    with pytest.raises(ValueError, match="tokenizer"):
        load_trace(log, rate=2.0)


def test_fit_recovers_a_linear_cost() -> None:
    truth = StepCost(0.002, 5e-5, 3e-4, 1e-7)
    samples = [(p, d, c, truth.seconds(p, d, c)) for p in (0, 64, 512) for d in (0, 4, 32) for c in (0, d * 100)]
    got = fit(samples, source="test")
    for name in ("base_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12)


def test_cli_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "bench",
                "route-sim",
                "--replicas",
                "2",
                "--requests-per-replica",
                "10",
                "--policies",
                "round_robin,cache_aware",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "prefix hit" in out and "cache_aware" in out and "least_load" not in out
    assert main(["bench", "route-sim", "--policies", "random"]) == 2
