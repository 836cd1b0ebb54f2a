"""`pagoda gate`: identical servers pass; a changed chat template, changed weights or a
broken server make the right rules fire with evidence; suites are recorded from text and logs."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from pagoda.cli import main as pagoda_main
from pagoda.ops.gate import GateResult, run_gate
from pagoda.ops.latency import LoadProfile
from pagoda.ops.policy import PolicyError, load_policy, parse_policy
from pagoda.ops.report import gate_markdown, write_reports
from pagoda.ops.suite import SuiteError, load_suite, parse_suite, suite_from_request_log, suite_from_text
from pagoda.ops.target import Target
from server_utils import TOKENIZER_FILES, LiveServer, build_tiny_model, start_server

SUITE_ROWS = [
    {"id": "code", "prompt": "def fibonacci(n):\n", "tags": ["code"]},
    {"id": "emoji", "prompt": "s = '😀 e\u0301'\n", "tags": ["adversarial-tokenization"]},
    {"id": "ids", "prompt": [5, 6, 7, 8], "tags": ["token-ids"]},
    {"id": "chat", "messages": [{"role": "user", "content": "reverse a string"}], "tags": ["chat"]},
    {
        "id": "chat-2",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"}],
        "tags": ["chat"],
    },
    {
        "id": "json",
        "messages": [{"role": "user", "content": "a point"}],
        "schema": {"type": "object", "required": ["x"]},
        "tags": ["structured"],
    },
    {
        "id": "bad-temp",
        "bad_request": {"endpoint": "completions", "body": {"prompt": "x", "temperature": -1}},
        "expect_status": 400,
    },
    {
        "id": "bad-model",
        "bad_request": {"endpoint": "chat", "body": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}},
        "expect_status": 404,
    },
]
# The latency rules are left out: two servers in one test process on a shared 2-core machine
# are too noisy to gate on; test_latency_section checks the measurements themselves.
TEST_POLICY = {
    "rules": {
        "tokenization.prompt_mismatches": {"max": 0},
        "tokenization.chat_mismatches": {"max": 0},
        "outputs.exact_match_rate": {"min": 0.98},
        "outputs.logprob_drift_max": {"max": 0.05},
        "outputs.stop_reason_changes": {"max": 0},
        "structured.validity_drop": {"max": 0},
        "contract.new_failures": {"max": 0},
        "contract.status_diffs": {"max": 0},
    }
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from model_factory import build_model

    root = tmp_path_factory.mktemp("gate")
    base = build_tiny_model(root / "base")
    template = root / "template"
    shutil.copytree(base, template)
    config = json.loads((template / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("'# '", "'## '")
    assert "'## '" in config["chat_template"]
    (template / "tokenizer_config.json").write_text(json.dumps(config))
    weights = root / "weights"
    vocab_size = json.loads((base / "config.json").read_text())["vocab_size"]
    build_model(weights, "llama", seed=1, vocab_size=vocab_size)
    for name in TOKENIZER_FILES:
        shutil.copy(base / name, weights / name)
    return {"base": base, "template": template, "weights": weights}


@pytest.fixture(scope="module")
def servers(models: dict[str, Path]) -> Iterator[dict[str, LiveServer]]:
    live = {name: start_server(path) for name, path in models.items()}
    live["twin"] = start_server(models["base"])
    live["spec"] = start_server(models["base"], engine={"speculative": "ngram"})
    live["fp8kv"] = start_server(models["base"], engine={"kv_cache_dtype": "fp8_e5m2"})
    yield live
    for server in live.values():
        server.stop()


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "suite.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in SUITE_ROWS))
    return path


def gate(baseline: str, candidate: str, suite_file: Path, profile: LoadProfile | None = None) -> GateResult:
    suite = load_suite(suite_file).with_max_tokens(6)
    return run_gate(
        Target(baseline, label="baseline"),
        Target(candidate, label="candidate"),
        suite,
        parse_policy(TEST_POLICY),
        profile=profile,
        progress=False,
    )


def rule(result: GateResult, metric: str) -> Any:
    return next(r for r in result.rules if r.rule.metric == metric)


def test_identical_servers_pass(servers: dict[str, LiveServer], suite_file: Path, tmp_path: Path) -> None:
    result = gate(servers["base"].url, servers["twin"].url, suite_file)
    assert result.passed, [r.to_json() for r in result.rules if r.status == "fail"]
    metrics = {k: v for s in result.sections.values() for k, v in s.metrics.items()}
    assert metrics["outputs.exact_match_rate"] == 1.0
    assert metrics["outputs.logprob_drift_max"] == 0.0
    assert metrics["tokenization.chat_mismatches"] == 0
    assert result.sections["tokenization"].details["compared"] == 5  # token ids are not sent
    assert metrics["contract.candidate_failures"] == 0
    # pagoda serves response_format json_schema (pagoda/structured): validity is measured on
    # both sides and equal (a server that rejected it would be skipped with a note instead).
    assert rule(result, "structured.validity_drop").status == "pass"
    assert metrics["structured.validity_rate_baseline"] is not None
    assert metrics["structured.validity_rate_candidate"] == metrics["structured.validity_rate_baseline"]
    paths = write_reports(tmp_path, "report", result.to_json())
    assert json.loads(paths[0].read_text())["passed"] is True
    assert "pagoda gate: PASSED" in paths[1].read_text()
    assert paths[2].read_text().startswith("<!doctype html>")
    # Both sides' provenance (open servers: the gate reads /admin/provenance), the same artifacts.
    base, twin = result.provenance["baseline"], result.provenance["candidate"]
    assert base is not None and twin is not None and base["id"] != twin["id"]
    assert base["weights_digest"] == twin["weights_digest"] and base["route"] == twin["route"]
    assert "### Provenance" in paths[1].read_text() and "<h2>Provenance</h2>" in paths[2].read_text()


def test_chat_template_change_is_caught(servers: dict[str, LiveServer], suite_file: Path) -> None:
    result = gate(servers["base"].url, servers["template"].url, suite_file)
    assert not result.passed
    chat = rule(result, "tokenization.chat_mismatches")
    assert chat.status == "fail" and chat.value == 3
    assert "first difference at position" in chat.evidence[0]
    assert "'#'" in chat.evidence[0] or "'##'" in chat.evidence[0]  # both tokens decoded
    sides = result.provenance
    assert sides["baseline"]["chat_template_digest"] != sides["candidate"]["chat_template_digest"]
    assert sides["baseline"]["weights_digest"] == sides["candidate"]["weights_digest"]
    assert "| **chat_template_digest** |" in gate_markdown(result.to_json())
    assert rule(result, "tokenization.prompt_mismatches").status == "pass"
    outputs = result.sections["outputs"].details["cases"]
    assert all(c["exact"] for c in outputs if not c["id"].startswith(("chat", "json")))


def test_different_weights_are_caught(servers: dict[str, LiveServer], suite_file: Path) -> None:
    result = gate(servers["base"].url, servers["weights"].url, suite_file)
    assert not result.passed
    exact = rule(result, "outputs.exact_match_rate")
    assert exact.status == "fail" and exact.value < 0.5
    assert any("diverges at token" in e for e in exact.evidence)
    cases = result.sections["outputs"].details["cases"]
    assert sum(c["first_divergence"] is not None for c in cases) >= len(cases) - 1
    # Drift is measured over the shared prefix only; random weights share none, which the
    # report says instead of inventing a number.
    assert rule(result, "outputs.logprob_drift_max").status in ("fail", "skipped")
    assert rule(result, "tokenization.prompt_mismatches").status == "pass"
    assert rule(result, "contract.new_failures").status == "pass"


def test_kv_cache_dtype_change_shows_as_logprob_drift(servers: dict[str, LiveServer], suite_file: Path) -> None:
    """fp8 KV keeps tokenization and the API contract but moves the logprobs: the output
    rules carry the evidence (drift over the shared prefix, or the first divergence)."""
    result = gate(servers["base"].url, servers["fp8kv"].url, suite_file)
    drift = rule(result, "outputs.logprob_drift_max")
    exact = rule(result, "outputs.exact_match_rate")
    assert drift.value is not None and drift.value > 1e-3  # fp32 KV twins drift by 0
    assert drift.evidence or exact.evidence
    assert drift.status == "fail" or exact.status == "fail"
    assert rule(result, "tokenization.prompt_mismatches").status == "pass"
    assert rule(result, "contract.new_failures").status == "pass"


def test_speculative_decoding_keeps_greedy_outputs(servers: dict[str, LiveServer], suite_file: Path) -> None:
    """Speculation on vs off is a release that must not change greedy text: the output rules
    hold, and the logprobs over the shared prefix agree to float32 noise."""
    result = gate(servers["base"].url, servers["spec"].url, suite_file)
    assert result.passed, [r.to_json() for r in result.rules if r.status == "fail"]
    assert rule(result, "outputs.exact_match_rate").value == 1.0
    assert rule(result, "outputs.logprob_drift_max").value < 1e-3


def test_latency_section(servers: dict[str, LiveServer], suite_file: Path) -> None:
    result = gate(
        servers["base"].url,
        servers["twin"].url,
        suite_file,
        profile=LoadProfile(num_requests=4, concurrency=2, max_tokens=4, repeats=2),
    )
    details = result.sections["latency"].details
    for side in ("baseline", "candidate"):
        assert details["sides"][side]["failed_requests"] == 0
        assert len(details["sides"][side]["repeats"]) == 2
        assert details["sides"][side]["ttft_p99"] > 0
    assert 0.2 < result.sections["latency"].metrics["latency.throughput_ratio"] < 5
    assert "<svg" in write_reports_html(result)


def write_reports_html(result: GateResult) -> str:
    from pagoda.ops.report import gate_html

    return gate_html(result.to_json())


# ---- a broken OpenAI-compatible server ------------------------------------------------------


def broken_app() -> Any:
    """Answers 500 to every chat request and reports wrong usage on completions; no /tokenize."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "broken", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> Any:
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 7}
        if body.get("temperature", 1) < 0:
            return JSONResponse({"error": {"message": "bad"}}, status_code=422)
        if body.get("stream"):

            def events() -> Iterator[str]:
                yield 'data: {"id": "a", "object": "text_completion", "choices": [{"text": "hi"}]}\n\n'
                yield (
                    'data: {"id": "b", "object": "text_completion", '
                    '"choices": [{"text": "!", "finish_reason": "stop"}]}\n\n'
                )

            return StreamingResponse(events(), media_type="text/event-stream")
        return {
            "id": "x",
            "object": "text_completion",
            "model": "broken",
            "choices": [{"index": 0, "text": "hi!", "finish_reason": "stop"}],
            "usage": usage,
        }

    @app.post("/v1/chat/completions")
    async def chat() -> Any:
        return JSONResponse({"error": {"message": "internal error"}}, status_code=500)

    return app


@pytest.fixture(scope="module")
def broken_url() -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(broken_app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_broken_candidate_lists_contract_failures(
    servers: dict[str, LiveServer], suite_file: Path, broken_url: str
) -> None:
    result = gate(servers["base"].url, broken_url, suite_file)
    assert not result.passed
    failures = rule(result, "contract.new_failures")
    assert failures.status == "fail"
    text = "\n".join(result.sections["contract"].details["candidate_failures"])
    all_failures = result.to_json()["sections"]["contract"]["metrics"]
    assert all_failures["contract.candidate_failures"] >= 8
    assert "chat: HTTP 500: internal error" in text
    assert "code: usage total_tokens 7 != prompt_tokens 3 + completion_tokens 2" in text
    assert rule(result, "contract.status_diffs").value == 2  # 422 and 404 -> 400, 404 expected
    assert any("no /tokenize" in n for n in result.sections["tokenization"].notes)
    assert rule(result, "tokenization.chat_mismatches").status == "skipped"


def test_stream_shape_failures(servers: dict[str, LiveServer], suite_file: Path, broken_url: str) -> None:
    result = gate(servers["base"].url, broken_url, suite_file)
    failures = result.sections["contract"].details["candidate_failures"]
    stream = [f for f in failures if "(stream)" in f]
    assert any("[DONE]" in f for f in stream)
    assert any("different ids" in f for f in stream)
    assert any("usage chunk" in f for f in stream)


# ---- suites, policies, the command line -----------------------------------------------------


def test_default_suite_covers_the_categories() -> None:
    suite = load_suite("default")
    tags = {t for c in suite.cases for t in c.tags}
    assert {"code", "chat", "multilingual", "long-context", "structured", "adversarial-tokenization"} <= tags
    assert suite.bad_requests and all(b.expect_status >= 400 for b in suite.bad_requests)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "a"}', "exactly one of prompt or messages"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ('{"bad_request": {"endpoint": "chat", "body": {}}, "expect_status": 99}', "expect_status"),
        ("not json", "not JSON"),
    ],
)
def test_suite_errors_name_the_line(line: str, message: str) -> None:
    with pytest.raises(SuiteError, match=message):
        parse_suite(['{"prompt": "ok"}', line], "s.jsonl")


def test_policy_errors() -> None:
    with pytest.raises(PolicyError, match="needs min and/or max"):
        parse_policy({"rules": {"outputs.exact_match_rate": {"minimum": 1}}})
    assert any(r.metric == "latency.itl_p99_ratio" for r in load_policy(None))


def test_record_from_text_and_log(tmp_path: Path) -> None:
    suite = suite_from_text("def a():\n    pass\n\n\nclass B:\n", "t")
    assert [c.prompt for c in suite.cases] == ["def a():\n    pass", "class B:"]
    log = [
        '2026-01-01 INFO pagoda.serve.requests: {"request_id":"1","endpoint":"/v1/completions",'
        '"status":200,"output_tokens":5,"prompt":["hello","world"]}',
        '2026-01-01 INFO pagoda.serve.requests: {"request_id":"2","endpoint":"/v1/chat/completions",'
        '"status":200,"prompt":["[1, 2, 3]"]}',
        '2026-01-01 INFO pagoda.serve.requests: {"request_id":"3","endpoint":"/v1/completions","status":200}',
        "2026-01-01 INFO pagoda.serve.requests: "
        + json.dumps(
            {
                "request_id": "5",
                "endpoint": "/v1/chat/completions",
                "status": 200,
                "prompt": [json.dumps([{"role": "user", "content": "hi"}])],
            }
        ),
        '2026-01-01 INFO pagoda.serve.requests: {"request_id":"4","endpoint":"/v1/completions",'
        '"status":400,"prompt":["bad"]}',
        "INFO: uvicorn noise",
    ]
    suite, without = suite_from_request_log(log, "log")
    assert [c.prompt for c in suite.cases] == ["hello", "world", [1, 2, 3], None]
    assert suite.cases[3].messages == [{"role": "user", "content": "hi"}]
    assert suite.cases[0].max_tokens == 5 and without == 1
    with pytest.raises(SuiteError, match="--log-prompts"):
        suite_from_request_log(log[2:3], "log")
    path = tmp_path / "s.jsonl"
    suite.write(path)
    assert [c.prompt for c in load_suite(path).cases] == ["hello", "world", [1, 2, 3], None]


def test_cli(
    servers: dict[str, LiveServer], suite_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(json.dumps(TEST_POLICY))
    common = ["--suite", str(suite_file), "--policy", str(policy), "--no-latency", "--max-tokens", "4", "--no-progress"]
    assert (
        pagoda_main(["gate", servers["base"].url, servers["twin"].url, *common, "--out", str(tmp_path / "same")]) == 0
    )
    assert (tmp_path / "same" / "report.html").exists()
    assert (
        pagoda_main(
            ["gate", servers["base"].url, servers["template"].url + "/v1", *common, "--out", str(tmp_path / "diff")]
        )
        == 1
    )
    assert "tokenization.chat_mismatches" in (tmp_path / "diff" / "report.md").read_text()
    assert pagoda_main(["gate", servers["base"].url, *common]) == 2
    assert pagoda_main(["gate", "ftp://x", servers["base"].url, *common]) == 2
    assert "neither an http(s) URL nor pagoda:ARGS" in capsys.readouterr().err
    text = tmp_path / "prompts.txt"
    text.write_text("one\n\ntwo\n")
    assert pagoda_main(["gate", "record", "--from-text", str(text), "-o", str(tmp_path / "rec.jsonl")]) == 0
    assert len(load_suite(tmp_path / "rec.jsonl").cases) == 2


def test_structured_validity_is_compared() -> None:
    """json_schema cases: the validity rate of each side and the drop, from the replies."""
    from pagoda.ops.calls import Completion
    from pagoda.ops.gate import SideResult, compare_structured
    from pagoda.ops.schema_check import validate_text

    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    assert validate_text('{"x": 3}', schema) is None
    assert "missing required 'x'" in validate_text("{}", schema)
    assert "expected integer" in validate_text('{"x": 1.5}', schema)
    assert "unexpected property" in validate_text('{"x": 1, "y": 2}', schema)
    assert "not JSON" in validate_text("x = 3", schema)
    suite = parse_suite([json.dumps({"id": f"s{i}", "prompt": "p", "schema": schema}) for i in range(2)], "s")
    base = SideResult(
        Target("http://b", label="baseline"),
        structured={"s0": Completion(200, text='{"x": 1}'), "s1": Completion(200, text='{"x": 2}')},
    )
    cand = SideResult(
        Target("http://c", label="candidate"),
        structured={"s0": Completion(200, text='{"x": 1}'), "s1": Completion(200, text='{"x": "two"}')},
    )
    result = compare_structured(suite, base, cand)
    assert result.metrics["structured.validity_rate_baseline"] == 1.0
    assert result.metrics["structured.validity_drop"] == 0.5
    assert "candidate s1: $.x: expected integer" in result.evidence["structured.validity_drop"][0]
    rejecting = SideResult(
        Target("http://c", label="candidate"),
        structured={name: Completion(400, error="response_format is not supported") for name in ("s0", "s1")},
    )
    result = compare_structured(suite, base, rejecting)
    assert result.metrics["structured.validity_rate_candidate"] is None
    assert result.metrics["structured.validity_drop"] == 1.0


def test_record_from_a_live_server_log(models: dict[str, Path], tmp_path: Path) -> None:
    """What `pagoda serve --log-prompts` really logs (its prompt log's files) becomes a suite
    that replays the same prompts and conversations."""
    import httpx

    live = start_server(models["base"], log_prompts=True, prompt_log_dir=str(tmp_path))
    conversation = [{"role": "user", "content": "reverse a string"}]
    try:
        httpx.post(
            live.url + "/v1/completions", json={"prompt": "def f():", "max_tokens": 3}, timeout=30
        ).raise_for_status()
        httpx.post(
            live.url + "/v1/chat/completions", timeout=30, json={"messages": conversation, "max_tokens": 2}
        ).raise_for_status()
    finally:
        live.stop()
    lines = [line for path in sorted(tmp_path.glob("prompts-*.jsonl")) for line in path.read_text().splitlines()]
    suite, without = suite_from_request_log(lines, "live")
    assert without == 0
    assert [(c.prompt, c.messages) for c in suite.cases] == [("def f():", None), (None, conversation)]
    assert [c.max_tokens for c in suite.cases] == [3, 2]


def test_cli_launches_a_pagoda_side(
    servers: dict[str, LiveServer], models: dict[str, Path], suite_file: Path, tmp_path: Path
) -> None:
    """`pagoda:ARGS` runs `pagoda serve ARGS` on a free loopback port for the gate, then stops it."""
    launched = f"pagoda:--model {models['base']} --engine-transport thread --num-threads 1 --num-kv-blocks 256"
    out = tmp_path / "launched"
    assert (
        pagoda_main(
            [
                "gate",
                servers["base"].url,
                launched,
                "--suite",
                str(suite_file),
                "--no-latency",
                "--max-tokens",
                "4",
                "--no-progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )  # default policy; skipped rules do not fail
    report = json.loads((out / "report.json").read_text())
    assert report["candidate"]["launched"].startswith("pagoda serve --model")
    assert report["sections"]["outputs"]["metrics"]["outputs.exact_match_rate"] == 1.0
