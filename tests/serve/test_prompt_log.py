"""The prompt log (--log-prompts): a separate owner-only file, PII redacted before writing,
sampling, retention (rotation and deletion while running), and the audited admin endpoint."""

from __future__ import annotations

import json
import logging
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagoda.guard import load_guardrails
from pagoda.serve.admission.tenants import TenantRegistry
from pagoda.serve.observability.prompt_log import AUDIT_FILE, PromptLog, parse_duration, redaction_rules
from pagoda.serve.observability.request_log import LOGGER_NAME, RequestLogRecord
from pagoda.serve.settings import ServerSettings
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

EMAIL = "jane.doe@example.com"
CARD = "4111 1111 1111 1111"
ADMIN_KEY, USER_KEY = "sk-admin-key", "sk-user-key"


def record(tenant: str = "acme", prompt: str = "hi", output: str = "ok") -> RequestLogRecord:
    return RequestLogRecord(
        request_id=f"r-{random.random()}",
        endpoint="completions",
        tenant=tenant,
        model=MODEL_NAME,
        prompt=[prompt],
        output=[output],
        output_tokens=1,
    )


def lines(directory: Path) -> list[dict]:
    return [
        json.loads(line) for path in sorted(directory.glob("prompts-*.jsonl")) for line in path.read_text().splitlines()
    ]


def test_pii_is_redacted_before_writing_and_files_are_owner_only(tmp_path: Path) -> None:
    log = PromptLog(tmp_path / "log")
    log.record(record(prompt=f"mail {EMAIL} or pay with {CARD}", output=f"sure, {EMAIL}"))
    log.close()
    [entry] = lines(tmp_path / "log")
    assert entry["prompt"] == ["mail [REDACTED_EMAIL] or pay with [REDACTED_CREDIT_CARD]"]
    assert entry["output"] == ["sure, [REDACTED_EMAIL]"]
    raw = "".join(p.read_text() for p in (tmp_path / "log").iterdir())
    assert EMAIL not in raw and CARD not in raw
    for path in (tmp_path / "log").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((tmp_path / "log").stat().st_mode) == 0o700


def test_the_guardrails_rules_redact_too(tmp_path: Path) -> None:
    """The --guardrails file's redacting rules apply to their tenants' records."""
    rules_file = tmp_path / "guardrails.yaml"
    rules_file.write_text(
        json.dumps(
            {
                "rules": [
                    {
                        "name": "codename",
                        "kind": "regex",
                        "pattern": "project-[a-z]+",
                        "action": "redact",
                        "replacement": "[CODENAME]",
                        "tenants": ["acme"],
                    }
                ]
            }
        )
    )
    log = PromptLog(tmp_path / "log", rules=redaction_rules(load_guardrails(rules_file)))
    log.record(record("acme", prompt="about project-falcon"))
    log.record(record("other", prompt="about project-falcon"))
    log.close()
    assert [e["prompt"] for e in lines(tmp_path / "log")] == [["about [CODENAME]"], ["about project-falcon"]]


def test_sampling_keeps_about_the_rate(tmp_path: Path) -> None:
    log = PromptLog(tmp_path / "a", sample_rate=0.25, rng=random.Random(7))
    for _ in range(400):
        log.record(record())
    log.close()
    assert 60 <= len(lines(tmp_path / "a")) <= 140
    nothing = PromptLog(tmp_path / "b", sample_rate=0.0)
    nothing.record(record())
    nothing.close()
    assert lines(tmp_path / "b") == []


def test_retention_rotates_and_deletes(tmp_path: Path) -> None:
    """With a clock under the test's control: a file per tenth of the retention, each deleted
    once its first record is past the retention."""
    now = [1_000_000.0]
    log = PromptLog(tmp_path, retention_s=100.0, clock=lambda: now[0])
    log.record(record(prompt="first"))
    now[0] += 10  # one rotation later
    log.record(record(prompt="second"))
    assert len(log.files()) == 2
    now[0] += 91  # the first file's record is 101 s old, the second's 91 s
    log.enforce_retention()
    assert [e["prompt"] for e in lines(tmp_path)] == [["second"]]
    now[0] += 10
    log.enforce_retention()
    assert log.files() == [] and lines(tmp_path) == []
    log.record(record(prompt="third"))  # a new file after the current one was deleted
    assert [e["prompt"] for e in lines(tmp_path)] == [["third"]]
    log.close()


def test_retention_is_enforced_while_running_without_traffic(tmp_path: Path) -> None:
    log = PromptLog(tmp_path, retention_s=0.5)
    try:
        log.record(record())
        assert len(log.files()) == 1
        deadline = time.monotonic() + 30
        while log.files() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log.files() == [], "the retention thread deletes expired files by itself"
    finally:
        log.close()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--log-prompts", "--prompt-log-sample", "-0.5"], "--prompt-log-sample must be between 0 and 1"),
        (["--log-prompts", "--prompt-log-sample", "1.5"], "--prompt-log-sample must be between 0 and 1"),
        (["--log-prompts", "--prompt-log-retention", "soon"], "--prompt-log-retention: 'soon' is not a duration"),
        (["--log-prompts", "--prompt-log-retention", "0h"], "--prompt-log-retention must be > 0"),
        (["--prompt-log-retention", "1d"], "--prompt-log-retention needs --log-prompts"),
    ],
)
def test_bad_values_exit_with_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"pagoda serve: {message}"), result.stderr


def test_durations() -> None:
    assert [parse_duration(t) for t in ("30d", "12h", "90m", "45s", "500ms", "2", "1w")] == [
        30 * 86400,
        12 * 3600,
        5400,
        45,
        0.5,
        2,
        604800,
    ]
    settings = ServerSettings(log_prompts=True, prompt_log_retention="2h", prompt_log_dir="x")
    assert settings.prompt_log_retention_s == 7200 and settings.prompt_log_directory == Path("x")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> tuple[LiveServer, Path]:
    root = tmp_path_factory.mktemp("prompt-log")
    keys = root / "keys.json"
    keys.write_text(
        json.dumps({"tenants": {"ops": {"api_keys": [ADMIN_KEY], "admin": True}, "acme": {"api_keys": [USER_KEY]}}})
    )
    live = start_server(
        build_tiny_model(root / "model"),
        tenants=TenantRegistry.from_file(keys),
        log_prompts=True,
        prompt_log_dir=str(root / "log"),
    )
    yield live, root / "log"
    live.stop()


def test_a_served_request_reaches_the_prompt_log_not_the_request_log(
    server: tuple[LiveServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    live, directory = server
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        httpx.post(
            live.url + "/v1/completions",
            headers={"Authorization": f"Bearer {USER_KEY}"},
            json={"model": MODEL_NAME, "prompt": f"write to {EMAIL}", "max_tokens": 2},
            timeout=60,
        ).raise_for_status()
    assert all(EMAIL not in r.getMessage() and "write to" not in r.getMessage() for r in caplog.records)
    [entry] = [e for e in lines(directory) if e["prompt"] == ["write to [REDACTED_EMAIL]"]]
    assert entry["tenant"] == "acme" and entry["status"] == 200 and len(entry["output"]) == 1


def test_the_admin_endpoint_reads_and_every_access_is_audited(server: tuple[LiveServer, Path]) -> None:
    live, directory = server
    for tenant_key, prompt in ((USER_KEY, "from acme"), (ADMIN_KEY, "from ops")):
        httpx.post(
            live.url + "/v1/completions",
            headers={"Authorization": f"Bearer {tenant_key}"},
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
            timeout=60,
        ).raise_for_status()
    url = live.url + "/admin/prompt-log"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    answer = httpx.get(url, params={"tenant": "acme"}, headers=admin, timeout=30)
    assert answer.status_code == 200
    body = answer.json()
    assert body["filter"] == {"tenant": "acme", "limit": 100}
    assert body["data"] and all(e["tenant"] == "acme" for e in body["data"])
    assert ["from acme"] in [e["prompt"] for e in body["data"]]
    everyone = httpx.get(url, params={"limit": "1"}, headers=admin, timeout=30).json()["data"]
    assert [e["prompt"] for e in everyone] == [["from ops"]]  # the newest record
    refused = httpx.get(url, params={"tenant": "ops"}, headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=30)
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert httpx.get(url, timeout=30).status_code == 401
    bad = httpx.get(url, params={"limit": "-3"}, headers=admin, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    audit = [json.loads(line) for line in (directory / AUDIT_FILE).read_text().splitlines()]
    assert [(a["who"], a["status"], a["filter"]) for a in audit[-5:]] == [
        ("ops", 200, {"tenant": "acme", "limit": 100}),
        ("ops", 200, {"tenant": None, "limit": 1}),
        ("acme", 403, {"tenant": "ops"}),
        (None, 401, {}),
        ("ops", 400, {"limit": "-3"}),
    ]
    assert audit[-5]["returned"] == len(body["data"]) and audit[-5]["time"]
    assert stat.S_IMODE((directory / AUDIT_FILE).stat().st_mode) == 0o600


def test_prompt_log_endpoint_without_log_prompts_is_404(tmp_path: Path) -> None:
    live = start_server(build_tiny_model(tmp_path / "model"))
    try:
        response = httpx.get(live.url + "/admin/prompt-log", timeout=30)
        assert response.status_code == 404 and "--log-prompts" in response.json()["error"]["message"]
    finally:
        live.stop()
