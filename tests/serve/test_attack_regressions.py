"""What an attack run found, each through a real server: the answers must stay well-formed
client errors (or the 200 a peer engine gives), never a 500, a reset, or request content in the log."""

from __future__ import annotations

import logging

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


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize(
    "constraint, field",
    [
        ({"regex": "x{1000000}"}, "structured_outputs.regex"),
        ({"choice": [f"option-{i}" for i in range(50000)]}, "structured_outputs.choice"),
    ],
)
def test_a_grammar_that_cannot_be_honoured_is_a_400_naming_its_field_and_stays_out_of_the_log(
    server: LiveServer, constraint: dict, field: str
) -> None:
    records = Records()
    logging.getLogger().addHandler(records)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            response = post(
                client, "/v1/completions", {"prompt": "hello", "max_tokens": 8, "structured_outputs": constraint}
            )
    finally:
        logging.getLogger().removeHandler(records)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    logged = "\n".join(records.lines)
    assert "x{1000000}" not in logged and "option-1" not in logged


@pytest.mark.parametrize("name", ["temperature", "repetition_penalty"])
def test_an_infinite_sampling_value_is_refused(server: LiveServer, name: str) -> None:
    # Raw text: json.dumps cannot write 1e400 (Python reads it as infinity).
    body = f'{{"model": "{MODEL_NAME}", "prompt": "hello", "max_tokens": 1, "{name}": 1e400}}'.encode()
    response = httpx.post(
        server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == name


def test_json_nested_too_deeply_says_so(server: LiveServer) -> None:
    depth = 300
    nested = "[" * depth + "]" * depth
    body = f'{{"model": "{MODEL_NAME}", "prompt": "hi", "max_tokens": 1, "user": {nested}}}'
    response = httpx.post(
        server.url + "/v1/completions", content=body.encode(), headers={"content-type": "application/json"}, timeout=60
    )
    assert response.status_code == 400
    assert "nested too deeply" in response.json()["error"]["message"]


def test_stop_strings_are_bounded_in_total(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        heavy = post(
            client,
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 1, "stop": [f"{i:04d}" + "x" * 1020 for i in range(64)]},
        )
        assert heavy.status_code == 400 and heavy.json()["error"]["param"] == "stop"
        assert "together" in heavy.json()["error"]["message"]
        light = post(
            client,
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 1, "stop": [f"{i:02d}" + "y" * 60 for i in range(64)]},
        )
        assert light.status_code == 200, light.text


def test_a_server_fault_is_logged_as_a_500_and_closes_the_connection(server: LiveServer, monkeypatch) -> None:
    from pagoda.serve.api import handler

    def broken(self) -> None:
        raise TypeError("a bug while writing the answer")

    records = []
    server.app.state.ctx.request_log.add_listener(records.append)
    monkeypatch.setattr(handler.WholeAnswer, "response", broken)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        response = post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert response.status_code == 500
    assert response.headers.get("connection") == "close"
    assert [r.status for r in records if r.endpoint != "rejected"][-1] == 500
