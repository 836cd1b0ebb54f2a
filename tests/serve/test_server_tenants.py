"""API keys, per-tenant limits, and prefix-cache isolation between tenants."""

from __future__ import annotations

import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagoda.serve.admission.tenants import TenantRegistry
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

KEYS_FILE = """
tenants:
  alice: {api_keys: [key-alice]}
  bob: {api_keys: [key-bob]}
  limited: {api_keys: [key-limited], requests_per_minute: 3}
  quota: {api_keys: [key-quota], tokens_per_minute: 30}
  single: {api_keys: [key-single], max_concurrent_requests: 1}
  narrow:
    api_keys: [key-narrow]
    max_prompt_tokens: 40
    max_output_tokens: 4
    priority: -1
"""
# Long enough for several full KV blocks (16 tokens each) of shared prefix.
SHARED_PROMPT = (
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
) * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    root = tmp_path_factory.mktemp("tenants")
    keys = root / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS_FILE))
    live = start_server(build_tiny_model(root / "model"), tenants=TenantRegistry.from_file(keys))
    yield live
    live.stop()


def post(server: LiveServer, key: str | None, path: str = "/v1/completions", **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    payload = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **body}
    return httpx.post(server.url + path, json=payload, headers=headers, timeout=30)


def test_api_key_required(server: LiveServer) -> None:
    for key in (None, "key-nobody"):
        response = post(server, key)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(server.base_url + "/models", headers=headers).status_code == 401
        assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=headers).status_code == 401
    # Broken JSON from an unknown client is still a 401: authentication comes first.
    response = httpx.post(server.base_url + "/chat/completions", content=b"{", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert post(server, "key-alice").status_code == 200


def test_prefix_cache_is_scoped_per_tenant(server: LiveServer) -> None:
    def cached(key: str) -> int:
        client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
        result = client.completions.create(model=MODEL_NAME, prompt=SHARED_PROMPT, max_tokens=1, temperature=0)
        assert result.usage.prompt_tokens > 48
        return result.usage.prompt_tokens_details.cached_tokens

    assert cached("key-alice") == 0
    assert cached("key-alice") >= 48
    assert cached("key-bob") == 0  # same prompt, other tenant: no hit on alice's blocks
    assert cached("key-bob") >= 48


def test_requests_per_minute(server: LiveServer) -> None:
    for _ in range(3):
        assert post(server, "key-limited").status_code == 200
    response = post(server, "key-limited")
    assert response.status_code == 429
    assert int(response.headers["Retry-After"]) >= 1
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert post(server, "key-alice").status_code == 200  # other tenants are unaffected
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pagoda:request_rejected_total{model_name="tiny-llama",reason="rate_limited"}' in metrics


def test_token_quota(server: LiveServer) -> None:
    # The quota (30 tokens) is reserved at admission: prompt + max_tokens must fit in it.
    first = post(server, "key-quota", max_tokens=24, ignore_eos=True)
    assert first.status_code == 200
    response = post(server, "key-quota", max_tokens=10)
    assert response.status_code == 429
    assert int(response.headers["Retry-After"]) >= 1


def test_max_concurrent_requests(server: LiveServer) -> None:
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, server, "key-single", max_tokens=480, ignore_eos=True)
        deadline = time.monotonic() + 10
        while server.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        second = post(server, "key-single")
        assert second.status_code == 429 and "Retry-After" in second.headers
        assert first.result().status_code == 200
    assert post(server, "key-single").status_code == 200


def test_prompt_and_output_caps(server: LiveServer) -> None:
    too_long = post(server, "key-narrow", prompt=SHARED_PROMPT)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
    too_many = post(server, "key-narrow", max_tokens=10)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    capped = post(
        server,
        "key-narrow",
        path="/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=None,
        ignore_eos=True,
    )
    assert capped.status_code == 200, capped.text
    assert capped.json()["usage"]["completion_tokens"] == 4


def test_keys_file_errors(tmp_path: Path) -> None:
    cases = {
        "tenants: {a: {api_keys: [k], requests_per_mnute: 3}}": "unknown settings",
        "tenants: {a: {api_keys: [k]}, b: {api_keys: [k]}}": "listed twice",
        "tenants: {a: {requests_per_minute: 3}}": "no api_keys",
        "tenants: {a: {api_keys: [k], max_concurrent_requests: 0}}": "positive integer",
        "keys: []": "tenants",
    }
    for text, message in cases.items():
        path = tmp_path / "keys.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            TenantRegistry.from_file(path)
    json_path = tmp_path / "keys.json"
    json_path.write_text('{"tenants": [{"name": "a", "api_key": "k", "priority": 2}]}')
    tenant = TenantRegistry.from_file(json_path).authenticate("k")
    assert tenant is not None and tenant.name == "a" and tenant.limits.priority == 2
