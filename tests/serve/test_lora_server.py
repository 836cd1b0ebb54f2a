"""LoRA adapters through the server: adapters as model names, runtime load -> use -> unload ->
404 (the engine in its own process, so the messages cross a pipe), tenants' adapter lists,
the request log and metrics, and a bad adapter at start."""

from __future__ import annotations

import textwrap
from typing import Any

import httpx
import pytest

pytest.importorskip("peft", reason="peft (the test extra) builds the PEFT adapters")

from lora_factory import ATTENTION_MODULES, build_adapter  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.config import EngineConfig  # noqa: E402
from pagoda.lora_request import LoRARequest  # noqa: E402
from pagoda.serve.admission.tenants import TenantRegistry  # noqa: E402
from pagoda.serve.launch import launch_server  # noqa: E402
from pagoda.serve.settings import ServerSettings  # noqa: E402
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server  # noqa: E402

KEYS_FILE = """
tenants:
  ops: {api_keys: [key-ops], admin: true}
  acme: {api_keys: [key-acme], adapters: [sql]}
  globex: {api_keys: [key-globex], adapters: []}
  initech: {api_keys: [key-initech]}
"""
PROMPT = [5, 17, 42, 99, 100, 7, 8, 200, 31, 64, 12, 250]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora_server")
    model = build_tiny_model(root / "model")
    adapters = {
        "sql": build_adapter(model, root / "sql", rank=8, seed=1),
        "chat": build_adapter(model, root / "chat", target_modules=ATTENTION_MODULES, rank=4, seed=2),
    }
    keys = root / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS_FILE))
    live = start_server(
        model,
        engine={"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "lora_modules": [f"sql={adapters['sql']}"]},
        transport="process",
        tenants=TenantRegistry.from_file(keys),
        allow_runtime_lora=True,
    )
    yield live, model, adapters
    live.stop()


def post(server: LiveServer, key: str, path: str = "/v1/completions", **body: Any) -> httpx.Response:
    payload = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(server.url + path, json=payload, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def models(server: LiveServer, key: str) -> dict[str, dict]:
    response = httpx.get(server.base_url + "/models", headers={"Authorization": f"Bearer {key}"})
    return {card["id"]: card for card in response.json()["data"]}


def test_runtime_load_use_unload_then_404(setup) -> None:
    server, model, adapters = setup
    records = []
    server.app.state.ctx.request_log.add_listener(records.append)
    listed = models(server, "key-ops")
    assert listed["sql"]["parent"] == MODEL_NAME and listed[MODEL_NAME]["parent"] is None
    # A request's model picks the adapter; the answer names it.
    offline = LLM(model=str(model), enable_lora=True, max_lora_rank=8, num_kv_blocks=32)
    expected = {
        name: offline.generate(
            [PROMPT],
            SamplingParams(temperature=0, max_tokens=8),
            lora_request=LoRARequest(name, 1, str(adapters[name])),
        )[0]
        .outputs[0]
        .text
        for name in adapters
    }
    response = post(server, "key-ops", model="sql")
    assert response.status_code == 200 and response.json()["model"] == "sql"
    assert response.json()["choices"][0]["text"] == expected["sql"]
    assert records[-1].model == "sql" and records[-1].extra["lora_adapter"] == "sql"

    load = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
    assert post(server, "key-ops", model="chat").status_code == 404  # not loaded yet
    denied = post(server, "key-initech", "/v1/load_lora_adapter", **load)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "admin_required"
    loaded = post(server, "key-ops", "/v1/load_lora_adapter", **load)
    assert loaded.status_code == 200, loaded.text
    again = post(server, "key-ops", "/v1/load_lora_adapter", **load)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert "chat" in models(server, "key-ops")
    used = post(server, "key-ops", model="chat", stream=True)
    assert used.status_code == 200 and '"model":"chat"' in used.text.replace(" ", "")
    assert post(server, "key-ops", model="chat").json()["choices"][0]["text"] == expected["chat"]
    tokenized = post(server, "key-ops", "/tokenize", model="chat", prompt="def f():")
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
    metrics = httpx.get(server.url + "/metrics").text
    assert "pagoda:lora_requests_info{" in metrics and 'max_lora="2"' in metrics

    unloaded = post(server, "key-ops", "/v1/unload_lora_adapter", lora_name="chat")
    assert unloaded.status_code == 200, unloaded.text
    after = post(server, "key-ops", model="chat")
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"
    assert "chat" not in models(server, "key-ops")
    missing = post(server, "key-ops", "/v1/unload_lora_adapter", lora_name="chat")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_bad_adapters_are_refused_and_the_server_keeps_serving(setup, tmp_path) -> None:
    server, model, adapters = setup
    (tmp_path / "empty").mkdir()
    bad = post(server, "key-ops", "/v1/load_lora_adapter", lora_name="broken", lora_path=str(tmp_path / "empty"))
    assert bad.status_code == 400
    assert "'broken'" in bad.json()["error"]["message"] and "adapter_config.json" in bad.json()["error"]["message"]
    big = build_adapter(model, tmp_path / "big", rank=16, seed=5)
    too_big = post(server, "key-ops", "/v1/load_lora_adapter", lora_name="big", lora_path=str(big))
    assert too_big.status_code == 400 and "max-lora-rank 8" in too_big.json()["error"]["message"]
    assert post(server, "key-ops", model="sql").status_code == 200


def test_tenants_see_and_use_only_their_adapters(setup) -> None:
    server, _, adapters = setup
    assert (
        post(server, "key-ops", "/v1/load_lora_adapter", lora_name="open", lora_path=str(adapters["chat"])).status_code
        == 200
    )
    try:
        assert set(models(server, "key-acme")) == {MODEL_NAME, "sql"}  # its own; "open" is not on its list
        assert set(models(server, "key-globex")) == {MODEL_NAME}
        assert set(models(server, "key-initech")) == {MODEL_NAME, "open"}  # sql belongs to acme
        assert post(server, "key-acme", model="sql").status_code == 200
        for key in ("key-globex", "key-initech"):
            refused = post(server, key, model="sql")
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
            # Exactly what a model that does not exist gets: nothing tells the adapter is there.
            absent = post(server, key, model="nope").json()["error"]
            assert refused.json()["error"] == {**absent, "message": absent["message"].replace("nope", "sql")}
        assert post(server, "key-initech", model="open").status_code == 200
        assert post(server, "key-globex", model="open").status_code == 404
    finally:
        post(server, "key-ops", "/v1/unload_lora_adapter", lora_name="open")


def test_runtime_loading_is_off_without_the_flag(tmp_path) -> None:
    server = start_server(build_tiny_model(tmp_path / "model"), engine={"enable_lora": True})
    try:
        response = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "runtime_lora_disabled"
    finally:
        server.stop()


def test_serve_refuses_to_start_with_a_bad_adapter(setup, tmp_path) -> None:
    _, model, _ = setup
    engine = EngineConfig(
        model=str(model), enable_lora=True, num_kv_blocks=16, lora_modules=[f"sql={tmp_path / 'absent'}"]
    )
    with pytest.raises(SystemExit) as stopped:
        launch_server(engine, ServerSettings(engine_transport="thread", log_level="warning"))
    message = str(stopped.value)
    assert message.startswith("pagoda serve:") and "'sql'" in message and "no such directory" in message
    assert "\n" not in message
    engine = EngineConfig(model=str(model), enable_lora=True, lora_modules=[f"{MODEL_NAME}={tmp_path}"])
    with pytest.raises(SystemExit, match="has the served model's name"):
        launch_server(engine, ServerSettings(served_model_name=MODEL_NAME, log_level="warning"))
