"""Nothing from a request body reaches a request-log line except field names and sizes (the
whole message goes to the separate prompt log with --log-prompts); the client still reads the
whole message in its 4xx body."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from pagoda.serve.observability.prompt_log import PromptLog, PromptLogQuery
from pagoda.serve.observability.request_log import LOGGER_NAME, RequestLogger, RequestLogRecord, redact_message
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

SECRET = "zq-SECRET-7731"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("model")))
    yield live
    live.stop()


BAD_BODIES = {
    "json_schema": {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {"type": "object", "properties": {SECRET: {"type": f"no-such-type-{SECRET}"}}},
            },
        },
    },
    "regex": {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "structured_outputs": {"regex": f"({SECRET}[a-"},
    },
    "role": {"model": MODEL_NAME, "messages": [{"role": SECRET, "content": "hi"}]},
    "model": {"model": SECRET, "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_a_refused_body_is_not_echoed_into_the_log(
    server: LiveServer, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    with caplog.at_level(logging.DEBUG):
        response = httpx.post(server.url + "/v1/chat/completions", json=BAD_BODIES[case], timeout=60)
    assert 400 <= response.status_code < 500
    assert caplog.records, "the refusal is logged"
    assert all(SECRET not in record.getMessage() for record in caplog.records), caplog.text
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    assert lines and lines[-1]["status"] == response.status_code and lines[-1]["error"]


def test_the_client_still_reads_the_whole_message(server: LiveServer) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", json=BAD_BODIES["role"], timeout=60)
    assert response.status_code == 400 and SECRET in response.json()["error"]["message"]


def test_log_prompts_keeps_the_message_and_quotes_are_redacted_otherwise(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    message = f"messages[0].role '{SECRET}' is not supported; the server's limit is 5"
    record = RequestLogRecord(request_id="r", endpoint="chat", status=400, error=message, error_param="messages")
    prompt_log = PromptLog(tmp_path)
    logger = RequestLogger()
    logger.add_listener(prompt_log.record)  # as --log-prompts does
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        logger.log(record)
    prompt_log.close()
    [quiet] = (json.loads(r.getMessage()) for r in caplog.records)
    assert SECRET not in quiet["error"] and "server's limit is 5" in quiet["error"]
    [loud] = prompt_log.read(PromptLogQuery())
    assert loud["error"] == message
    assert redact_message("The model `abc` does not exist.") == "The model `<3 chars>` does not exist."
