"""Per-request provenance: the x-pagoda-provenance header and the log record on a completion, a
streamed chat, the Messages API, a LoRA request (static and loaded at run time) and a
data-parallel request; the digests checked against hashlib; GET /admin/provenance/{id}."""

from __future__ import annotations

import hashlib
import json
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda.engine.client import StreamRoute
from pagoda.serve.admission.tenants import TenantRegistry
from pagoda.serve.observability.provenance import (
    HEADER,
    ProvenanceBook,
    RouteTaken,
    engine_config_fingerprint,
    unverified_weights_digest,
)
from pagoda.serve.observability.request_log import RequestLogRecord
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

KEYS_FILE = """
tenants:
  ops: {api_keys: [key-ops], admin: true}
  acme: {api_keys: [key-acme]}
"""
PROMPT = [5, 17, 42, 99, 100, 7, 8, 200]


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def files_digest(root: Path, names: list[str]) -> str:
    lines = "".join(f"{name}\0{hashlib.sha256((root / name).read_bytes()).hexdigest()}\n" for name in sorted(names))
    return sha256(lines.encode())


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("provenance")
    model = build_tiny_model(root / "model")
    adapter = None
    engine: dict[str, Any] = {}
    try:
        from lora_factory import build_adapter

        adapter = build_adapter(model, root / "sql", rank=4, seed=1)
        engine = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "lora_modules": [f"sql={adapter}"]}
    except ImportError:  # peft (the test extra) builds adapters
        pass
    keys = root / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS_FILE))
    live = start_server(
        model, engine=engine, tenants=TenantRegistry.from_file(keys), allow_runtime_lora=adapter is not None
    )
    records: list[RequestLogRecord] = []
    live.app.state.ctx.request_log.add_listener(records.append)
    yield live, model, adapter, records, root
    live.stop()


def post(server: LiveServer, path: str, key: str = "key-acme", **body: Any) -> httpx.Response:
    return httpx.post(
        server.base_url.removesuffix("/v1") + path, json=body, timeout=60, headers={"Authorization": f"Bearer {key}"}
    )


def admin_record(server: LiveServer, provenance_id: str, key: str | None = "key-ops") -> httpx.Response:
    """`key` None: an open server's (no keys configured: every caller is the operator)."""
    return httpx.get(
        server.base_url.removesuffix("/v1") + f"/admin/provenance/{provenance_id}",
        headers={"Authorization": f"Bearer {key}"} if key else {},
        timeout=30,
    )


def record_of(records: list[RequestLogRecord], request_id: str) -> RequestLogRecord:
    """The request's log record (a stream's is written once the server closed it, which may
    be just after the client read the last event)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for record in records:
            if record.request_id == request_id:
                return record
        time.sleep(0.01)
    raise AssertionError(f"no log record of {request_id}")


def expected_model_fields(server: LiveServer, model: Path) -> dict[str, Any]:
    template = server.llm.tokenizer.hf.chat_template
    generation_config = model / "generation_config.json"
    return {
        "model": MODEL_NAME,
        "weights_digest": unverified_weights_digest(model),
        "tokenizer_digest": files_digest(model, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]),
        "chat_template_digest": sha256(template.encode()) if template else None,
        "generation_config_digest": sha256(generation_config.read_bytes()) if generation_config.is_file() else None,
        "guardrail_policy": None,
        "engine_config_fingerprint": engine_config_fingerprint(server.llm.config),
    }


def test_completion_header_and_log_record(setup) -> None:
    server, model, _, records, _ = setup
    response = post(server, "/v1/completions", model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert response.status_code == 200
    provenance_id = response.headers[HEADER]
    assert provenance_id == response.json()["id"]
    record = record_of(records, provenance_id)
    assert record.provenance is not None
    assert record.provenance == {
        "id": provenance_id,
        **expected_model_fields(server, model),
        "adapter": None,
        "adapter_hash": None,
        "route": {"model": MODEL_NAME, "pool": None, "replica": None, "route": None, "fallback": False, "canary": None},
    }
    assert record.cost_usd is None  # no --price-table
    # An admin key finds the record by the header's id; another tenant's key may not.
    found = admin_record(server, provenance_id)
    assert found.status_code == 200 and found.json() == record.provenance
    denied = admin_record(server, provenance_id, key="key-acme")
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_required"
    missing = admin_record(server, "cmpl-nothing")
    assert missing.status_code == 404 and "cmpl-nothing" in missing.json()["error"]["message"]
    assert admin_record(server, provenance_id, key="wrong").status_code == 401


def test_weights_digest_follows_the_weight_files(setup, tmp_path: Path) -> None:
    _, model, _, _, _ = setup
    copy = tmp_path / "m"
    copy.mkdir()
    for path in model.iterdir():
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    digest = unverified_weights_digest(copy)
    assert digest == unverified_weights_digest(model) and digest.startswith("unverified:sha256:")
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"\0")  # another size
    assert unverified_weights_digest(copy) != digest
    config = copy / "config.json"
    config.write_text(config.read_text().replace("}", ', "x": 1}', 1))
    assert unverified_weights_digest(copy) != digest


def test_streamed_chat_carries_the_header(setup) -> None:
    server, model, _, records, _ = setup
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        server.base_url + "/chat/completions",
        json=body,
        timeout=60,
        headers={"Authorization": "Bearer key-acme"},
    ) as response:
        assert response.status_code == 200
        provenance_id = response.headers[HEADER]
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert json.loads(lines[0].removeprefix("data: "))["id"] == provenance_id
    record = record_of(records, provenance_id)
    assert record.stream and record.endpoint == "chat"
    assert record.provenance is not None and record.provenance["id"] == provenance_id
    expected = expected_model_fields(server, model)
    assert record.provenance["chat_template_digest"] == expected["chat_template_digest"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_carry_the_header(setup, stream: bool) -> None:
    server, _, _, records, _ = setup
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    with httpx.stream(
        "POST", server.base_url + "/messages", json=body, timeout=60, headers={"x-api-key": "key-acme"}
    ) as response:
        assert response.status_code == 200
        provenance_id = response.headers[HEADER]
        response.read()
    assert record_of(records, provenance_id).provenance is not None


def test_lora_request_names_the_adapter_and_its_hash(setup) -> None:
    server, _, adapter, records, root = setup
    if adapter is None:
        pytest.skip("peft (the test extra) builds the adapters")
    names = [p.name for p in adapter.iterdir() if p.is_file()]
    response = post(server, "/v1/completions", model="sql", prompt=PROMPT, max_tokens=4, temperature=0)
    assert response.status_code == 200
    record = record_of(records, response.headers[HEADER])
    assert record.provenance is not None
    assert record.provenance["adapter"] == "sql"
    assert record.provenance["adapter_hash"] == files_digest(adapter, names)
    assert record.provenance["model"] == MODEL_NAME  # the served (base) model; the route says so too
    assert record.provenance["route"]["model"] == MODEL_NAME

    # Loaded at run time: hashed when loaded, forgotten when unloaded.
    from lora_factory import build_adapter

    other = build_adapter(Path(server.app.state.ctx.settings.model_path), root / "other", rank=4, seed=2)
    loaded = post(server, "/v1/load_lora_adapter", key="key-ops", lora_name="other", lora_path=str(other))
    assert loaded.status_code == 200, loaded.text
    response = post(server, "/v1/completions", key="key-ops", model="other", prompt=PROMPT, max_tokens=4)
    provenance = admin_record(server, response.headers[HEADER]).json()
    assert provenance["adapter"] == "other"
    assert provenance["adapter_hash"] == files_digest(other, [p.name for p in other.iterdir() if p.is_file()])
    assert provenance["adapter_hash"] != files_digest(adapter, names)
    assert post(server, "/v1/unload_lora_adapter", key="key-ops", lora_name="other").status_code == 200
    assert server.app.state.ctx.provenance.adapter_hash("other") is None


def test_refused_request_has_no_header(setup) -> None:
    server, _, _, _, _ = setup
    response = post(server, "/v1/completions", model=MODEL_NAME, prompt=PROMPT, max_tokens=-1)
    assert response.status_code == 400 and HEADER not in response.headers


def test_route_of_a_batch_and_the_bounded_book() -> None:
    assert RouteTaken.of("m", [None]) == RouteTaken("m")
    route = RouteTaken.of("m", [StreamRoute("10", "b"), StreamRoute("2", "a"), StreamRoute("2", "a")])
    assert (route.pool, route.replica, route.fallback, route.canary) == ("a,b", "2,10", False, None)
    assert RouteTaken.of("m", [None], "route:auto:m").route == "auto"
    assert RouteTaken.of("m", [None], "fallback:m").fallback
    from pagoda.serve.observability.provenance import ModelProvenance

    book = ProvenanceBook(ModelProvenance("m", "w", None, None, None, None, "f"), max_records=2)
    for i in range(3):
        book.record(f"r{i}", None, [None])
    assert book.find("r0") is None and book.find("r2") is not None


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    root = tmp_path_factory.mktemp("provenance_dp")
    rules = root / "rules.yaml"
    rules.write_text("default: chat\nrules:\n  - {pool: long, min_prompt_tokens: 40}\n")
    live = start_server(
        build_tiny_model(root / "model"),
        transport="thread",
        deployment={
            "data_parallel_size": 2,
            "restart": False,
            "replica_pools": "chat=1,long=1",
            "route_rules": str(rules),
        },
    )
    yield live
    live.stop()


def test_replica_request_names_its_pool_and_replica(replicas: LiveServer) -> None:
    records: list[RequestLogRecord] = []
    replicas.app.state.ctx.request_log.add_listener(records.append)
    for prompt, pool, replica in (([7] * 8, "chat", "0"), ([7] * 60, "long", "1"), ([9] * 4, "chat", "0")):
        response = httpx.post(
            replicas.base_url + "/completions",
            timeout=60,
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        )
        assert response.status_code == 200
        provenance = admin_record(replicas, response.headers[HEADER], key=None).json()
        assert provenance["route"] == {
            "model": MODEL_NAME,
            "pool": pool,
            "replica": replica,
            "route": None,
            "fallback": False,
            "canary": None,
        }
        assert record_of(records, response.headers[HEADER]).provenance == provenance


def test_a_verified_model_reports_its_manifest_digest(tmp_path: Path) -> None:
    """Under --verify-manifest the weights digest is the manifest's, carried from the engine
    process through the transport to the provenance record."""
    from pagoda.artifacts.digests import ArtifactFiles
    from pagoda.artifacts.manifest import build_manifest, write_manifest

    model = build_tiny_model(tmp_path / "model")
    files = ArtifactFiles.of(model)
    manifest = build_manifest(files)
    write_manifest(files, manifest)
    live = start_server(model, engine={"verify_manifest": True}, transport="process")
    try:
        response = post(live, "/v1/completions", model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
        assert response.status_code == 200
        found = live.app.state.ctx.provenance.find(response.headers[HEADER])
        assert found is not None and found.model.weights_digest == manifest.digest
    finally:
        live.stop()
