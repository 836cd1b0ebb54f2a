"""`pagoda run-batch`: vLLM's batch format offline, through pagoda.LLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.cli import main
from pagoda.sampling_params import SamplingParams
from server_utils import build_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


def write_lines(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_run_batch_writes_one_response_line_per_request(model: Path, tmp_path: Path) -> None:
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0}
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {
            "custom_id": "text",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": ["one", "two"], "max_tokens": 3, "temperature": 0},
        },
        {"custom_id": "vector", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hello"}},
        {
            "custom_id": "unsupported",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "response_format": {"type": "json_object"}},
        },
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "x", "max_tokens": 10**6},
        },
        "not json",
    ]
    source, target = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    status = main(
        [
            "run-batch",
            "-i",
            str(source),
            "-o",
            str(target),
            "--model",
            str(model),
            "--num-threads",
            "1",
            "--num-kv-blocks",
            "64",
        ]
    )
    assert status == 1  # some lines failed
    records = [json.loads(text) for text in target.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["chat", "text", "vector", "unsupported", "too-long", "line-6"]
    assert all(r["id"].startswith("batch_req_") and r["error"] is None for r in records)
    assert [r["response"]["status_code"] for r in records] == [200, 200, 200, 400, 400, 400]
    answer = records[0]["response"]["body"]
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] <= 5
    assert records[0]["response"]["request_id"] == answer["id"]
    text = records[1]["response"]["body"]
    assert text["model"] == "m" and [c["index"] for c in text["choices"]] == [0, 1]
    assert records[2]["response"]["body"]["data"][0]["object"] == "embedding"
    assert records[3]["response"]["body"]["error"]["param"] == "response_format"
    assert records[4]["response"]["body"]["error"]["param"] == "max_tokens"

    # The same greedy answer as the engine's own for the same prompt.
    from pagoda.engine.llm import LLM

    llm = LLM(str(model), num_threads=1, num_kv_blocks=64)
    [expected] = llm.generate(["one"], SamplingParams(temperature=0, max_tokens=3))
    assert text["choices"][0]["text"] == expected.outputs[0].text
