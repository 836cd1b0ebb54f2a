"""/v1/load_lora_adapter as an attacker holding an admin key would try it: names that are path
pieces are refused, every unusable path gets the same answer (no filesystem probe), a 5,000
character path is a 400, and --lora-root keeps adapters under one directory."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lora"))
from lora_factory import build_adapter  # noqa: E402
from pagoda.serve.admission.tenants import TenantRegistry  # noqa: E402
from server_utils import LiveServer, build_tiny_model, start_server  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora-paths")
    model = build_tiny_model(root / "model")
    allowed = root / "adapters"
    adapter = build_adapter(model, allowed / "good", rank=4, seed=1)
    outside = build_adapter(model, root / "outside", rank=4, seed=2)
    (allowed / "link").symlink_to(outside)
    keys = root / "keys.yaml"
    keys.write_text(
        textwrap.dedent("""
        tenants:
          ops: {api_keys: [key-ops], admin: true}
    """)
    )
    live = start_server(
        model,
        engine={"enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
        tenants=TenantRegistry.from_file(keys),
        allow_runtime_lora=True,
        lora_root=str(allowed),
    )
    yield live, root, adapter
    live.stop()


def load(server: LiveServer, name: str, path: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": path},
        headers={"Authorization": "Bearer key-ops"},
        timeout=60,
    )


def test_names_that_are_path_pieces_are_refused(setup) -> None:
    server, _, adapter = setup
    for name in ("../../x", "a/b", "x" * 200, ".hidden", "a\0b"):
        response = load(server, name, str(adapter))
        assert response.status_code == 400 and response.json()["error"]["param"] == "lora_name", (name, response.text)


def test_every_unusable_path_gets_one_answer(setup) -> None:
    server, root, adapter = setup
    (root / "adapters" / "empty").mkdir()
    answers = set()
    for path in (
        str(root / "adapters" / "missing"),
        str(root / "adapters" / "empty"),
        "/" + "a" * 5000,
        str(root / "outside"),
        str(root / "adapters" / "link"),
        "/etc",
        str(root / "adapters" / ".." / "outside"),
    ):
        response = load(server, "probe", path)
        assert response.status_code == 400, (path[:80], response.text)
        answers.add(response.json()["error"]["message"])
    assert len(answers) == 1
    assert load(server, "good", str(adapter)).status_code == 200


def test_count_tokens_answers_another_tenants_adapter_like_an_unknown_model(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    adapter = build_adapter(model, tmp_path / "secret", rank=4, seed=3)
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        textwrap.dedent("""
        tenants:
          acme: {api_keys: [key-acme], adapters: [secret]}
          beta: {api_keys: [key-beta]}
    """)
    )
    live = start_server(
        model,
        engine={"enable_lora": True, "max_loras": 1, "max_lora_rank": 8, "lora_modules": [f"secret={adapter}"]},
        tenants=TenantRegistry.from_file(keys),
    )
    try:

        def count(key: str, name: str) -> httpx.Response:
            return httpx.post(
                live.url + "/v1/messages/count_tokens",
                headers={"x-api-key": key},
                timeout=60,
                json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
            )

        assert count("key-acme", "secret").status_code == 200
        hidden, unknown = count("key-beta", "secret"), count("key-beta", "nope")
        assert hidden.status_code == unknown.status_code == 404
        assert hidden.json()["error"]["type"] == unknown.json()["error"]["type"]
        assert hidden.json()["error"]["message"] == unknown.json()["error"]["message"].replace("nope", "secret")
    finally:
        live.stop()
