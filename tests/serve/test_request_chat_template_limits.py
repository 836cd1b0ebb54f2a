"""A chat template a request brings (--trust-request-chat-template) that fails, includes, or loops
too long is a 400 naming messages, on a connection the server keeps; the server keeps serving."""

from __future__ import annotations

import time

import httpx
import pytest

from pagoda.tokenizer import CHAT_TEMPLATE_TIME_LIMIT_S
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("model")), trust_request_chat_template=True)
    yield live
    live.stop()


@pytest.mark.parametrize(
    "template",
    [
        "{% include 'x' %}",
        "{{ 1/0 }}",
        "{{ range(100001)|list }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ raise_exception('no') }}",
        "{{ messages[5].content }}",
    ],
)
def test_a_failing_or_endless_request_template_is_a_400(server: LiveServer, template: str) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        started = time.monotonic()
        response = client.post(
            "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": HI, "max_tokens": 2, "chat_template": template},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] in ("messages", "chat_template")
        assert time.monotonic() - started < CHAT_TEMPLATE_TIME_LIMIT_S + 5
        assert client.get("/health").status_code == 200  # the same connection, kept
