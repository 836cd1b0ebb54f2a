"""The live dashboard's data: the sliding window's math, its agreement with /metrics, and who
may see which tenant's figures."""

from __future__ import annotations

import json
import textwrap
import time
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pagoda.guard import GuardMetrics
from pagoda.http_client.sse import iter_sse_events
from pagoda.serve.admission.tenants import TenantRegistry
from pagoda.serve.dashboard import DashboardWindow, Histogram
from pagoda.serve.metrics.server import ServerMetrics
from pagoda.serve.observability.request_log import RequestLogRecord
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

KEYS_FILE = """
tenants:
  alice: {api_keys: [key-alice]}
  bob: {api_keys: [key-bob]}
  ops: {api_keys: [key-ops], admin: true}
"""


def metric_totals(server_url: str) -> dict[str, float]:
    """/metrics summed over labels: family name -> value (counters and gauges)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(server_url + "/metrics").text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_count", "_sum", "_created")):
                continue
            totals[family.name] = totals.get(family.name, 0.0) + sample.value
    return totals


def test_histogram_quantile_interpolates_like_promql() -> None:
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 in (0.2, +Inf).
    h = Histogram([0.1, 0.2, float("inf")], [4, 8, 10], 1.5)
    assert h.quantile(0.2) == pytest.approx(0.05)
    assert h.quantile(0.5) == pytest.approx(0.125)
    assert h.quantile(0.99) == pytest.approx(0.2)  # +Inf bucket -> highest finite bound
    assert Histogram([0.1, float("inf")], [0, 0]).quantile(0.5) is None
    older = Histogram([0.1, 0.2, float("inf")], [4, 4, 4], 0.2)
    assert h.minus(older).quantile(0.5) == pytest.approx(0.175)  # only the 6 newer ones


def test_window_rates_and_percentiles_over_the_window() -> None:
    now = [1000.0]
    metrics = ServerMetrics("m", lambda: None)
    window = DashboardWindow(metrics.registry, window_s=10.0, clock=lambda: now[0])
    first = window.snapshot()
    assert first["now"]["output_tok_s"] == 0.0 and first["now"]["ttft_p50"] is None
    for _ in range(4):
        metrics.record_inter_token(0.02)
    metrics.record_rejected("rate_limited")
    now[0] += 2.0
    window.observe_request(
        RequestLogRecord(
            "r1", "completions", tenant="a", prompt_tokens=6, output_tokens=4, queue_time_s=0.1, ttft_s=0.3, e2e_s=0.5
        )
    )
    snap = window.snapshot()
    assert snap["now"]["itl_p50"] == pytest.approx(0.0175)  # inside the (0.015, 0.02] bucket
    assert snap["now"]["rejected_s"] == pytest.approx(0.5)
    assert snap["totals"]["requests_rejected"] == 1
    assert len(snap["history"]) == 2
    [timeline] = snap["requests"]
    assert (timeline["queue_s"], timeline["prefill_s"], timeline["decode_s"]) == pytest.approx((0.1, 0.2, 0.2))
    assert snap["tenants"]["a"]["requests"] == 1
    assert snap["tenants"]["a"]["tokens_per_s"] == pytest.approx(10 / 2.0)
    # Samples are taken at most once per interval, however many viewers ask.
    assert len(window.snapshot()["history"]) == 2
    # Eleven seconds on, the gaps have left the window.
    now[0] += 11.0
    window.snapshot()
    now[0] += 1.0
    assert window.snapshot()["now"]["itl_p50"] is None


def test_admin_is_a_tenant_setting() -> None:
    from pagoda.serve.admission.tenants import parse_tenants

    keys = parse_tenants({"tenants": {"ops": {"api_keys": ["k1"], "admin": True}, "app": {"api_keys": ["k2"]}}})
    assert keys["k1"].admin and not keys["k2"].admin
    with pytest.raises(ValueError, match="tenant 'ops': admin must be true or false"):
        parse_tenants({"tenants": {"ops": {"api_keys": ["k"], "admin": "yes"}}})
    assert TenantRegistry.single_key("k").authenticate("k").admin


def test_window_shows_guardrail_decisions_only_when_configured() -> None:
    from pagoda.guard import RuleHit

    metrics = ServerMetrics("m", lambda: None)
    window = DashboardWindow(metrics.registry)
    assert window.snapshot()["totals"]["guard_blocks"] is None
    guarded = ServerMetrics("m", lambda: None)
    guard = GuardMetrics(guarded.registry, "m")
    guard.record_hit("a", RuleHit("pii", "pii", "redact", "output", count=3, label="email"))
    guard.record_hit("b", RuleHit("words", "blocklist", "block", "input"))
    totals = DashboardWindow(guarded.registry).snapshot()["totals"]
    assert (totals["guard_blocks"], totals["guard_redactions"], totals["guard_flags"]) == (1, 3, 0)


def test_replicas_kv_usage_is_averaged_and_counts_summed() -> None:
    from prometheus_client import Gauge

    from pagoda.serve.dashboard.window import read_registry

    registry = CollectorRegistry()
    usage = Gauge("pagoda:kv_cache_usage_perc", "", ["model_name", "replica"], registry=registry)
    running = Gauge("pagoda:num_requests_running", "", ["model_name", "replica"], registry=registry)
    for replica, (fraction, count) in enumerate([(0.6, 3), (0.8, 5)]):
        usage.labels("m", str(replica)).set(fraction)
        running.labels("m", str(replica)).set(count)
    sample = read_registry(registry, now=0.0)
    assert sample.scalars["kv_usage"] == pytest.approx(0.7)  # never above 1 with many replicas
    assert sample.scalars["running"] == 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    root = tmp_path_factory.mktemp("dashboard")
    keys = root / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS_FILE))
    live = start_server(build_tiny_model(root / "model"), tenants=TenantRegistry.from_file(keys))
    yield live
    live.stop()


def complete(server: LiveServer, key: str, max_tokens: int = 5) -> None:
    response = httpx.post(
        server.url + "/v1/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": MODEL_NAME,
            "prompt": "def f(x):",
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text


def snapshot(server: LiveServer, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.url + "/dashboard/snapshot", headers=headers, timeout=10)


def test_page_and_assets_are_served_without_data(server: LiveServer) -> None:
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/static/dashboard.js" in page.text
    for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        asset = httpx.get(server.url + "/dashboard/static/" + name)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
    missing = httpx.get(server.url + "/dashboard/static/..%2F..%2Fapp.py")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_data_needs_a_key(server: LiveServer) -> None:
    for key in (None, "key-nobody"):
        response = snapshot(server, key)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/dashboard/events").status_code == 401


def test_tenants_see_only_their_own_figures_admin_sees_all(server: LiveServer) -> None:
    complete(server, "key-alice")
    complete(server, "key-bob")
    complete(server, "key-bob")
    server.wait_idle()
    alice = snapshot(server, "key-alice").json()
    assert alice["scope"] == ["alice"]
    assert set(alice["tenants"]) == {"alice"}
    assert alice["requests"] and {r["tenant"] for r in alice["requests"]} == {"alice"}
    admin = snapshot(server, "key-ops").json()
    assert admin["scope"] == "all"
    assert admin["tenants"]["bob"]["requests"] == 2
    assert {"alice", "bob"} <= {r["tenant"] for r in admin["requests"]}
    assert all("prompt" not in r for r in admin["requests"])  # never the clients' text
    # Server-wide figures are the same for both (they are public on /metrics too).
    assert alice["totals"]["requests_finished"] == admin["totals"]["requests_finished"]


def test_totals_match_metrics_and_events_stream(server: LiveServer) -> None:
    complete(server, "key-alice", max_tokens=7)
    server.wait_idle()
    time.sleep(1.0)  # the window samples at most once a second
    totals = metric_totals(server.url)
    snap = snapshot(server, "key-ops").json()
    assert snap["totals"]["requests_finished"] == totals["pagoda:request_success"]
    assert snap["totals"]["generation_tokens"] == totals["pagoda:generation_tokens"]
    assert snap["totals"]["prompt_tokens"] == totals["pagoda:prompt_tokens"]
    assert snap["now"]["kv_usage"] == totals["pagoda:kv_cache_usage_perc"]
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "GET", server.url + "/dashboard/events", timeout=10, headers={"Authorization": "Bearer key-bob"}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for event in iter_sse_events(response.iter_lines()):
            events.append(event.json())
            if len(events) == 2:
                break
    assert events[1]["time"] > events[0]["time"]
    assert set(events[1]["tenants"]) <= {"bob"}


def test_grafana_board_uses_only_metrics_the_server_exports(server: LiveServer) -> None:
    import re
    from pathlib import Path

    import yaml

    examples = Path(__file__).resolve().parents[2] / "examples"
    board = json.loads((examples / "grafana" / "pagoda.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = {re.sub(r"_(bucket|total)$", "", name) for expr in exprs for name in re.findall(r"pagoda:[a-z0-9_]+", expr)}
    exported = {family.name for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    guard_registry = CollectorRegistry()  # registered only when --guardrails is given
    GuardMetrics(guard_registry, MODEL_NAME)
    exported |= {family.name for family in guard_registry.collect()}
    assert used and used <= exported, used - exported
    scrape = yaml.safe_load((examples / "prometheus.yaml").read_text())
    assert scrape["scrape_configs"][0]["metrics_path"] == "/metrics"


def test_window_shows_expert_load_only_with_moe_metrics() -> None:
    from pagoda.model.moe_load import MoEStats
    from pagoda.serve.metrics.moe import moe_families

    assert DashboardWindow(ServerMetrics("m", lambda: None).registry).snapshot()["moe"] is None
    stats = MoEStats(
        layers=[0, 2],
        expert_tokens=[[4, 0, 4, 0], [2, 2, 2, 2]],
        expert_imbalance=[2.0, 1.0],
        rank_imbalance=[1.0, 1.0],
    )

    class Collector:
        def collect(self):
            return moe_families(stats, "pagoda:", ["model_name"], ["m"])

    registry = CollectorRegistry()
    registry.register(Collector())
    now = [1000.0]
    window = DashboardWindow(registry, window_s=10.0, clock=lambda: now[0])
    first = window.snapshot()["moe"]
    assert [layer["layer"] for layer in first] == [0, 2]
    assert first[0]["expert_tokens"] == [4, 0, 4, 0]
    assert first[0]["window_tokens"] is None and first[0]["window_imbalance"] is None  # one sample so far
    assert (first[0]["expert_imbalance"], first[0]["rank_imbalance"]) == (2.0, 1.0)
    stats.expert_tokens = [[4, 6, 4, 0], [3, 2, 2, 2]]  # this window: 6 tokens to expert 1 of layer 0
    stats.expert_imbalance = [4.0, 4.0]
    now[0] += 1.0
    later = window.snapshot()["moe"]
    assert later[0]["expert_tokens"] == [4, 6, 4, 0]
    assert later[0]["window_tokens"] == [0, 6, 0, 0] and later[0]["window_imbalance"] == 4.0
    assert later[1]["window_tokens"] == [1, 0, 0, 0] and later[1]["expert_imbalance"] == 4.0
    now[0] += 1.0  # nothing routed since: the window keeps the tokens of its span
    assert window.snapshot()["moe"][0]["window_tokens"] == [0, 6, 0, 0]
