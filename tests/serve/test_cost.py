"""--price-table: the cost arithmetic (cached prompt tokens priced apart), the tables refused at
startup with one line naming the field, and through a server: each request's cost in its log
record, pagoda:cost_usd_total{model,tenant} (tenant emptied unless --metrics-tenant-labels) and
the dashboard's cost per tenant; without a table, token counts only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda.config import EngineConfig
from pagoda.serve.admission.tenants import TenantRegistry
from pagoda.serve.launch import built_settings
from pagoda.serve.observability.cost import ModelPrice, PriceTableError, load_price_table, parse_price_table
from pagoda.serve.observability.request_log import RequestLogRecord
from pagoda.serve.settings import ServerSettings
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

KEYS_FILE = """
tenants:
  ops: {api_keys: [key-ops], admin: true}
  acme: {api_keys: [key-acme]}
"""
PRICES = {"models": {MODEL_NAME: {"prompt": 0.5, "cached_prompt": 0.05, "completion": 2.0}}}


def test_cost_arithmetic_prices_cached_tokens_apart() -> None:
    price = ModelPrice(prompt=0.5, completion=2.0, cached_prompt=0.05)
    # 1000 prompt tokens of which 400 cached, 250 generated.
    assert price.cost(1000, 250, 400) == pytest.approx((600 * 0.5 + 400 * 0.05 + 250 * 2.0) / 1000)
    assert price.cost(0, 0) == 0.0
    # Without a cached price the cache changes nothing; more cached than prompt is capped.
    uncached = ModelPrice(prompt=0.5, completion=2.0)
    assert uncached.cost(1000, 250, 400) == pytest.approx(uncached.cost(1000, 250)) == pytest.approx(1.0)
    assert price.cost(10, 0, 50) == pytest.approx(10 * 0.05 / 1000)
    table = parse_price_table(PRICES, [MODEL_NAME])
    assert table.cost(MODEL_NAME, 2000, 1000) == pytest.approx(1.0 + 2.0)
    assert table.cost("other", 2000, 1000) is None


@pytest.mark.parametrize(
    "table, named",
    [
        ({"models": {MODEL_NAME: {"prompt": -0.1, "completion": 1}}}, f"models.{MODEL_NAME}.prompt"),
        (
            {"models": {MODEL_NAME: {"prompt": 0.1, "completion": 1, "cached_prompt": -1}}},
            f"models.{MODEL_NAME}.cached_prompt",
        ),
        ({"models": {MODEL_NAME: {"prompt": 0.1, "completion": 1, "image": 3}}}, f"models.{MODEL_NAME}.image"),
        ({"models": {"gpt-9": {"prompt": 0.1, "completion": 1}}}, "models.gpt-9"),
        ({"models": {MODEL_NAME: {"prompt": "cheap", "completion": 1}}}, f"models.{MODEL_NAME}.prompt"),
        ({"models": {MODEL_NAME: {"prompt": True, "completion": 1}}}, f"models.{MODEL_NAME}.prompt"),
        ({"models": {MODEL_NAME: {"prompt": 0.1}}}, f"models.{MODEL_NAME}.completion"),
        ({"models": {MODEL_NAME: {"prompt": 0.1, "completion": 1}}, "currency": "EUR"}, "currency"),
        ({"models": {}}, "models"),
        ([1, 2], "mapping"),
    ],
)
def test_bad_tables_name_the_field(table: Any, named: str) -> None:
    with pytest.raises(PriceTableError, match=named.replace(".", r"\.")):
        parse_price_table(table, [MODEL_NAME])


def test_bad_table_file_exits_at_startup_with_one_line(tmp_path: Path) -> None:
    config = EngineConfig(model=str(tmp_path / MODEL_NAME))
    bad = tmp_path / "prices.yaml"
    bad.write_text(f"models:\n  {MODEL_NAME}: {{prompt: -1, completion: 1}}\n")
    with pytest.raises(SystemExit) as exit_info:
        built_settings(ServerSettings(price_table=str(bad)), config)
    message = str(exit_info.value.code)
    assert "\n" not in message and str(bad) in message and f"models.{MODEL_NAME}.prompt" in message
    with pytest.raises(SystemExit, match="cannot read"):
        built_settings(ServerSettings(price_table=str(tmp_path / "missing.yaml")), config)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(SystemExit, match="not valid YAML/JSON"):
        built_settings(ServerSettings(price_table=str(broken)), config)
    good = tmp_path / "prices.json"
    good.write_text(json.dumps(PRICES))
    prices = built_settings(ServerSettings(price_table=str(good)), config)["prices"]
    assert prices == load_price_table(good, [MODEL_NAME])


def test_serve_refuses_a_bad_table_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "prices.yaml"
    bad.write_text("models:\n  some-model: {prompt: 0.1, completion: 1, per_image: 2}\n")
    model = tmp_path / "some-model"
    model.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(model), "--port", "1", "--price-table", str(bad)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "models.some-model.per_image: unknown field" in lines[0], done.stderr


def wait_for_record(records: list[RequestLogRecord], request_id: str) -> RequestLogRecord:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for record in records:
            if record.request_id == request_id:
                return record
        time.sleep(0.01)
    raise AssertionError(f"no log record of {request_id}")


def cost_samples(server: LiveServer) -> dict[tuple[str, str], float]:
    body = httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text
    samples = {}
    for line in body.splitlines():
        if line.startswith("pagoda:cost_usd_total{"):
            labels, value = line[len("pagoda:cost_usd_total{") :].rsplit("} ", 1)
            parsed = dict(part.split("=", 1) for part in labels.split(","))
            samples[(parsed["model"].strip('"'), parsed["tenant"].strip('"'))] = float(value)
    return samples


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("cost") / "model")


@pytest.fixture(scope="module")
def priced(model: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("cost_keys") / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS_FILE))
    live = start_server(model, tenants=TenantRegistry.from_file(keys), prices=parse_price_table(PRICES, [MODEL_NAME]))
    records: list[RequestLogRecord] = []
    live.app.state.ctx.request_log.add_listener(records.append)
    yield live, records
    live.stop()


def complete(server: LiveServer, key: str, **body: Any) -> httpx.Response:
    return httpx.post(
        server.base_url + "/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL_NAME, "prompt": "the cost of a request " * 4, "max_tokens": 5, "temperature": 0, **body},
    )


def test_cost_in_the_log_the_metric_and_the_dashboard(priced) -> None:
    server, records = priced
    price = ModelPrice(prompt=0.5, completion=2.0, cached_prompt=0.05)
    expected = 0.0
    for _ in range(2):  # the second finds the prompt in the prefix cache
        response = complete(server, "key-acme")
        assert response.status_code == 200
        usage = response.json()["usage"]
        record = wait_for_record(records, response.json()["id"])
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert record.cost_usd == pytest.approx(price.cost(usage["prompt_tokens"], usage["completion_tokens"], cached))
        expected += record.cost_usd
    assert cached > 0  # the second request's cached tokens were priced at the cached price
    # /metrics: the tenant's name is not published (label_policy.py); the sum is.
    assert cost_samples(server) == {(MODEL_NAME, ""): pytest.approx(expected)}
    # The dashboard shows the tenant its cost over the window.
    snapshot = httpx.get(
        server.base_url.removesuffix("/v1") + "/dashboard/snapshot", headers={"Authorization": "Bearer key-acme"}
    ).json()
    assert snapshot["tenants"]["acme"]["cost_usd"] == pytest.approx(expected)
    admin = httpx.get(
        server.base_url.removesuffix("/v1") + "/dashboard/snapshot", headers={"Authorization": "Bearer key-ops"}
    ).json()
    assert admin["tenants"]["acme"]["cost_usd"] == pytest.approx(expected)


def test_cost_metric_names_tenants_when_allowed(model: Path) -> None:
    live = start_server(model, metrics_tenant_labels=True, prices=parse_price_table(PRICES, [MODEL_NAME]))
    try:
        response = complete(live, "any")
        assert response.status_code == 200
        usage = response.json()["usage"]
        cost = ModelPrice(prompt=0.5, completion=2.0).cost(usage["prompt_tokens"], usage["completion_tokens"])
        tenant = live.app.state.ctx.settings.tenants.authenticate(None).name
        assert cost_samples(live) == {(MODEL_NAME, tenant): pytest.approx(cost)}
    finally:
        live.stop()


def test_without_a_table_token_counts_only(model: Path) -> None:
    live = start_server(model)
    try:
        records: list[RequestLogRecord] = []
        live.app.state.ctx.request_log.add_listener(records.append)
        response = complete(live, "any")
        record = wait_for_record(records, response.json()["id"])
        assert record.cost_usd is None and record.prompt_tokens > 0 and record.output_tokens > 0
        assert cost_samples(live) == {}
        assert "pagoda:cost_usd" not in httpx.get(live.base_url.removesuffix("/v1") + "/metrics").text
        snapshot = httpx.get(live.base_url.removesuffix("/v1") + "/dashboard/snapshot").json()
        assert all(t["cost_usd"] is None for t in snapshot["tenants"].values())
    finally:
        live.stop()
