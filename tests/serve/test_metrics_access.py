"""What /metrics shows and to whom: --metrics-token guards it (open without, as in vLLM), tenant
ids and adapter names stay out of label values unless --metrics-tenant-labels, and a key in a
dashboard URL never reaches the access log."""

from __future__ import annotations

import logging
import textwrap

import httpx
import pytest
from prometheus_client.registry import Collector

from pagoda.engine.engine_core import LoRAStats
from pagoda.guard import GuardMetrics
from pagoda.guard.decision import RuleHit
from pagoda.serve.admission.tenants import TenantRegistry
from pagoda.serve.metrics.lora import lora_families
from pagoda.serve.metrics.server import PREFIX, ServerMetrics
from pagoda.serve.observability.access_log import ACCESS_LOGGER_NAME, redact_url
from pagoda.serve.settings import ServerSettings
from server_utils import build_tiny_model, start_server

KEYS = """
tenants:
  ops: {api_keys: [key-ops], admin: true}
  acme: {api_keys: [key-acme], adapters: [sql]}
  beta: {api_keys: [key-beta], adapters: [beta-secret]}
"""


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Adapters(Collector):
    def collect(self):
        yield from lora_families(
            LoRAStats(
                max_loras=2,
                running_adapters=["beta-secret"],
                waiting_adapters=["sql"],
                loaded_adapters=["beta-secret", "sql"],
                num_slot_loads=3,
            ),
            PREFIX,
            ["model_name"],
            ["m"],
        )


def metrics_with_tenant_names(tenant_labels: bool) -> ServerMetrics:
    metrics = ServerMetrics("m", lambda: None, tenant_labels=tenant_labels, compat="vllm")
    metrics.registry.register(Adapters())
    guard = GuardMetrics(metrics.registry, "m")
    guard.record_hit("beta", RuleHit(rule="pii", kind="pii", action="flag", stage="input", count=2))
    guard.record_hit("acme", RuleHit(rule="pii", kind="pii", action="flag", stage="input", count=5))
    return metrics


def test_label_values_name_no_tenant_or_adapter_unless_asked() -> None:
    quiet = metrics_with_tenant_names(tenant_labels=False).render()[0].decode()
    for name in ("beta-secret", "sql", 'tenant="beta"', 'tenant="acme"'):
        assert name not in quiet
    assert 'running_lora_adapters=""' in quiet and 'max_lora="2"' in quiet
    # one series for every tenant, the sum of theirs
    assert (
        'pagoda:guardrail_decisions_total{action="flag",model_name="m",rule="pii",stage="input",tenant=""} 7.0' in quiet
    )
    assert "vllm:guardrail_decisions_total{" in quiet and "beta-secret" not in quiet
    loud = metrics_with_tenant_names(tenant_labels=True).render()[0].decode()
    assert 'running_lora_adapters="beta-secret"' in loud and 'tenant="acme"' in loud


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


def test_metrics_token_guards_the_scrape_and_keys_stay_out_of_the_access_log(model_dir, tmp_path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS))
    live = start_server(model_dir, tenants=TenantRegistry.from_file(keys), metrics_token="scrape-me")
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            missing = http.get("/metrics")
            assert missing.status_code == 401 and "--metrics-token" in missing.json()["error"]["message"]
            assert http.get("/metrics", headers={"Authorization": "Bearer key-ops"}).status_code == 401
            scraped = http.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
            assert scraped.status_code == 200 and "pagoda:num_requests_running" in scraped.text
            access = logging.getLogger(ACCESS_LOGGER_NAME)  # uvicorn's: it does not propagate
            records = Records()
            access.addHandler(records)
            level = access.level
            access.setLevel(logging.INFO)
            try:
                assert http.get("/dashboard?key=key-acme").status_code == 200
                assert http.get("/dashboard/snapshot", headers={"Authorization": "Bearer key-acme"}).status_code == 200
            finally:
                access.removeHandler(records)
                access.setLevel(level)
        lines = [r.getMessage() for r in records.records]
        assert any("/dashboard?key=<redacted>" in line for line in lines), lines
        assert not any("key-acme" in line for line in lines)
    finally:
        live.stop()
    open_server = start_server(model_dir)
    try:
        assert httpx.get(open_server.url + "/metrics", timeout=30).status_code == 200  # open by default
    finally:
        open_server.stop()


def test_redact_url_and_an_empty_token_is_refused() -> None:
    assert redact_url("/dashboard?key=abc&x=1") == "/dashboard?key=<redacted>&x=1"
    assert redact_url("/p?a=1&API_KEY=s3&token=t") == "/p?a=1&API_KEY=<redacted>&token=<redacted>"
    assert redact_url("/keys/monkey=1") == "/keys/monkey=1"
    with pytest.raises(ValueError, match="--metrics-token"):
        ServerSettings(metrics_token=" ")
