"""What an attack run found, each through a real server: the answers must stay well-formed
client errors (or the 200 a peer engine gives), never a 500, a reset, or request content in the log."""

from __future__ import annotations

import httpx
import pytest

from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("model")))
    yield live
    live.stop()


def post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    return client.post(path, json={"model": MODEL_NAME, **body})


def test_prompt_logprobs_on_a_long_prompt_is_a_200_on_a_kept_connection(server: LiveServer) -> None:
    prompt = "def f(x):\n    return x + 1\n" * 20
    with httpx.Client(base_url=server.url, timeout=120) as client:
        response = post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20})
        assert response.status_code == 200, response.text
        entries = response.json()["choices"][0]["prompt_logprobs"]
        assert entries[0] is None and len(entries) > 200
        assert all(len(entry) >= 20 for entry in entries[1:])
        assert client.get("/health").status_code == 200  # the same keep-alive connection
