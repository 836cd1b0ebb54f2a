"""The mixed load of benchmarks/disaggregation.py (pagoda.bench.mixed_load): seeded request lists,
per-request SLO goodput, the KV handoff deltas from /metrics, and one short run against the
streaming stub of test_bench_serve (no pagoda server)."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

from model_factory import build_tokenizer
from pagoda.bench.handoff_metrics import handoff_delta
from pagoda.bench.lengths import uniform
from pagoda.bench.loadgen import LoadConfig
from pagoda.bench.mixed_load import (
    ARRIVAL_INDEX_BASE,
    MixedLoadSpec,
    MixedWorkload,
    RequestSlo,
    meets_request_slo,
    parse_request_slo,
    request_itl_p99,
    run_mixed,
    summarize_mixed,
    summary_row,
)
from pagoda.bench.prompts import PromptBuilder
from pagoda.bench.records import RequestRecord
from pagoda.bench.server_metrics import parse_labeled
from pagoda.bench.workloads import load_tokenizer
from test_bench_serve import StubServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    return PromptBuilder.from_tokenizer(load_tokenizer(str(directory)))


SPEC = MixedLoadSpec(
    streams=3,
    stream_prompt=uniform(20, 30),
    stream_output=8,
    arrival_rate=2.0,
    arrival_prompt=uniform(100, 120),
    arrival_output=4,
    duration=5.0,
    seed=7,
)


def take(workload: MixedWorkload, client: int, n: int) -> list:
    stream = workload.stream_requests(client)
    return [next(stream) for _ in range(n)]


def test_same_seed_same_requests_and_exact_lengths(builder: PromptBuilder) -> None:
    a, b = MixedWorkload(SPEC, builder), MixedWorkload(SPEC, builder)
    for client in range(SPEC.streams):
        first, second = take(a, client, 4), take(b, client, 4)
        assert [r.prompt for r in first] == [r.prompt for r in second]
        for k, request in enumerate(first):
            assert request.index == k * SPEC.streams + client and request.class_name == "chat"
            assert 20 <= request.prompt_len <= 30 and request.prompt_len == builder.count(request.prompt)
            assert request.output_len == 8
    arrivals = a.arrivals()
    assert [(t, r.prompt) for t, r in arrivals] == [(t, r.prompt) for t, r in b.arrivals()]
    assert all(0 < t < SPEC.duration for t, _ in arrivals)
    assert [t for t, _ in arrivals] == sorted(t for t, _ in arrivals)
    assert [r.index for _, r in arrivals] == list(range(ARRIVAL_INDEX_BASE, ARRIVAL_INDEX_BASE + len(arrivals)))
    assert all(r.class_name == "rag" and 100 <= r.prompt_len <= 120 and r.output_len == 4 for _, r in arrivals)
    # Clients differ from each other, and another seed gives other prompts.
    assert take(a, 0, 1)[0].prompt != take(a, 1, 1)[0].prompt
    other = MixedWorkload(MixedLoadSpec(**{**SPEC.__dict__, "seed": 8}), builder)
    assert take(other, 0, 1)[0].prompt != take(a, 0, 1)[0].prompt
    assert [w.index for w in a.warmup_requests()] == [-2, -1]


def test_arrivals_are_poisson_at_the_rate(builder: PromptBuilder) -> None:
    times = MixedWorkload(MixedLoadSpec(arrival_rate=4.0, duration=1000.0, seed=1), builder).arrival_times()
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert len(times) == pytest.approx(4000, rel=0.05)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd = mean
    assert MixedWorkload(MixedLoadSpec(arrival_rate=0.0), builder).arrival_times() == []


def test_spec_rejects_empty_or_ambiguous_loads() -> None:
    with pytest.raises(ValueError):
        MixedLoadSpec(streams=0, arrival_rate=0.0)
    with pytest.raises(ValueError):
        MixedLoadSpec(duration=0)
    with pytest.raises(ValueError):
        MixedLoadSpec(stream_class="rag")


def record(index: int, name: str, ttft: float, itls: list[float], status: int = 200) -> RequestRecord:
    r = RequestRecord(
        index,
        name,
        64,
        len(itls) + 1,
        ttft=ttft,
        itls=itls,
        status=status,
        e2e=ttft + sum(itls),
        output_tokens=len(itls) + 1,
    )
    if status != 200:
        r.error = "boom"
    return r


def test_goodput_uses_each_requests_own_itl_p99() -> None:
    slo = RequestSlo(ttft=0.5, itl_p99=0.1)
    smooth = record(0, "chat", 0.2, [0.01] * 99 + [0.5])  # one stretched gap of 100: p99 = 0.0149
    stretched = record(1, "chat", 0.2, [0.01] * 97 + [0.5] * 3)  # three: p99 = 0.5
    late = record(2, "chat", 0.6, [0.01] * 10)
    failed = record(3, "chat", 0.1, [0.01] * 10, status=500)
    assert request_itl_p99(smooth) == pytest.approx(0.01 + 0.49 * 0.01)
    assert request_itl_p99(record(4, "rag", 0.1, [])) == 0.0
    assert [meets_request_slo(r, slo) for r in (smooth, stretched, late, failed)] == [True, False, False, False]

    rag = [record(10, "rag", 2.0, [0.02] * 3), record(11, "rag", 4.0, [0.02] * 3)]
    summary = summarize_mixed(
        [smooth, stretched, late, failed, *rag],
        duration=10.0,
        slo={"chat": slo, "rag": RequestSlo(ttft=3.0, itl_p99=0.1)},
    )
    chat = summary.per_class["chat"]
    assert (chat.num_requests, chat.num_ok, chat.num_good) == (4, 3, 1)
    assert chat.goodput == pytest.approx(0.1)
    assert summary.per_class["rag"].num_good == 1
    assert summary.goodput == pytest.approx(0.2)
    assert summary.output_throughput == pytest.approx((101 + 101 + 11 + 4 + 4) / 10)
    assert summary.errors == {"500: boom": 1}
    assert chat.itl.count == 100 + 100 + 10  # the failed request's gaps are not counted
    row = summary_row(summary)
    assert row["chat_good_fraction"] == pytest.approx(0.25) and row["rag_ttft_p50_s"] == pytest.approx(3.0)
    assert summarize_mixed([smooth], 1.0).goodput is None  # no SLO, no goodput


def test_parse_request_slo() -> None:
    assert parse_request_slo("ttft=1.5,itl_p99=80ms") == RequestSlo(1.5, 0.08)
    assert parse_request_slo(" itl_p99=0.1s , ttft=500ms ") == RequestSlo(0.5, 0.1)
    for bad in ("ttft=1", "ttft=1,itl=0.1", "ttft=-1,itl_p99=0.1", "ttft=x,itl_p99=0.1"):
        with pytest.raises(ValueError):
            parse_request_slo(bad)


def handoff_metrics(exported: int, bytes_sent: int, transfer_sum: float, transfer_count: int) -> str:
    lines = [
        f'pagoda:kv_handoffs_exported_total{{model_name="m",replica="0",role="prefill"}} {exported}',
        f'pagoda:kv_handoffs_imported_total{{model_name="m",replica="1",role="decode"}} {exported}',
        f'pagoda:kv_handoff_bytes_sent_total{{model_name="m",replica="0",role="prefill"}} {bytes_sent}',
        f'pagoda:kv_handoff_blocks_sent_total{{model_name="m",replica="0",role="prefill"}} {exported * 4}',
        'pagoda:kv_handoff_failures_total{kind="send",model_name="m",replica="0",role="prefill"} 1',
        f'pagoda:kv_handoff_phase_seconds_bucket{{le="0.01",model_name="m",phase="transfer",replica="1",'
        f'role="decode"}} {transfer_count}',
        f'pagoda:kv_handoff_phase_seconds_sum{{model_name="m",phase="transfer",replica="1",role="decode"}} '
        f"{transfer_sum}",
        f'pagoda:kv_handoff_phase_seconds_count{{model_name="m",phase="transfer",replica="1",role="decode"}} '
        f"{transfer_count}",
        'pagoda:kv_handoff_phase_seconds_sum{model_name="m",phase="prefill",replica="0",role="prefill"} 9',
        'pagoda:kv_handoff_phase_seconds_count{model_name="m",phase="prefill",replica="0",role="prefill"} 3',
    ]
    return "# HELP pagoda:kv_handoffs_exported_total x\n" + "\n".join(lines) + "\n"


def test_handoff_delta_per_phase_and_per_handoff() -> None:
    before = parse_labeled(handoff_metrics(2, 2000, 0.02, 2))
    after = parse_labeled(handoff_metrics(6, 10000, 0.10, 6))
    delta = handoff_delta(before, after)
    assert delta is not None
    assert (delta.handoffs_exported, delta.handoffs_imported, delta.bytes_sent) == (4, 4, 8000)
    assert delta.bytes_per_handoff == 2000 and delta.blocks_per_handoff == 4
    assert delta.phase_mean_s["transfer"] == pytest.approx(0.02)
    assert delta.phase_mean_s["prefill"] is None and delta.phase_count["prefill"] == 0  # no new observation
    assert delta.failures == 0
    assert handoff_delta({}, parse_labeled('pagoda:num_requests_running{model_name="m"} 0\n')) is None


def test_run_against_a_streaming_stub(builder: PromptBuilder) -> None:
    spec = MixedLoadSpec(
        streams=2,
        stream_prompt=uniform(10, 12),
        stream_output=5,
        arrival_rate=8.0,
        arrival_prompt=uniform(40, 50),
        arrival_output=3,
        duration=0.5,
        seed=3,
    )
    workload = MixedWorkload(spec, builder)
    with StubServer(token_delay=0.005) as stub:
        result = run_mixed(
            LoadConfig(base_url=stub.url, model="stub", ignore_eos=True, duration=spec.duration), workload
        )
    chat = [r for r in result.records if r.class_name == "chat"]
    rag = [r for r in result.records if r.class_name == "rag"]
    assert all(r.ok for r in result.records)
    assert len(rag) == len(workload.arrivals())
    assert {r.index % 2 for r in chat} == {0, 1} and all(r.start < spec.duration for r in chat)
    assert all(len(r.itls) == 4 for r in chat) and all(r.output_tokens == 3 for r in rag)
    assert result.duration >= max(r.finish for r in result.records) - 1e-3


def test_benchmark_aggregates_rounds_and_compares_medians() -> None:
    spec = importlib.util.spec_from_file_location("disaggregation_bench", REPO / "benchmarks" / "disaggregation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    rounds = [
        {
            "a": {"chat_itl_p99_s": x, "output_tok_per_s": 100.0, "note": "text"},
            "b": {"chat_itl_p99_s": x / 4, "output_tok_per_s": 90.0},
        }
        for x in (0.3, 0.1, 0.2)
    ]
    medians = module.aggregate(rounds, ["a", "b"])
    assert medians["a"]["chat_itl_p99_s"] == {"median": 0.2, "min": 0.1, "max": 0.3}
    assert "note" not in medians["a"]
    ratios = module.comparison(medians, "a", "b")
    assert ratios["chat_itl_p99_s"] == pytest.approx(0.25) and ratios["output_tok_per_s"] == pytest.approx(0.9)
