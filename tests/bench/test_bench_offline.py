"""`pagoda bench offline` and `pagoda bench compare` on a tiny random Llama, in-process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from model_factory import build_model
from pagoda.bench.targets import TargetSpec, parse_target
from pagoda.cli import bench as bench_cli

WORKLOAD = [
    "--mix",
    "chat=0.5,rag=0.3,summarize=0.2",
    "--length-scale",
    "0.03",
    "--num-requests",
    "12",
    "--no-progress",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("offline-model"), "llama")


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagoda")
    bench_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


@pytest.mark.parametrize("static", [False, True])
def test_offline_engine(tiny_model: Path, tmp_path: Path, static: bool, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "offline"
    extra = ["--static-batch", "4"] if static else []
    rc = bench(
        [
            "offline",
            "--model",
            str(tiny_model),
            "--num-threads",
            "1",
            "--max-model-len",
            "384",
            "--warmup",
            "1",
            "--out",
            str(out),
            *WORKLOAD,
            *extra,
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert ("pagoda static batch 4" if static else "target pagoda:") in printed
    result = json.loads((out / "results.json").read_text())
    assert len(result["requests"]) == 12
    for r in result["requests"]:
        assert r["output_tokens"] == r["output_len"] and r["reported_prompt_tokens"] == r["prompt_len"]
        assert 0 < r["ttft"] <= r["e2e"] <= result["duration"] + 0.05
    assert result["summary"]["overall"]["output_tokens"] == sum(r["output_len"] for r in result["requests"])
    assert (out / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_pagoda_static_and_transformers(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compare"
    rc = bench(
        [
            "compare",
            "--model",
            str(tiny_model),
            "--num-threads",
            "1",
            "--max-model-len",
            "384",
            "--target",
            "pagoda",
            "--target",
            "pagoda-static:batch=4,label=static",
            "--target",
            "hf:batch_size=4",
            "--warmup",
            "1",
            "--out",
            str(out),
            *WORKLOAD,
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert "vs first" in printed and "1.00x" in printed
    result = json.loads((out / "results.json").read_text())
    rows = result["comparison"]["rows"]
    assert [row[0] for row in rows] == ["pagoda", "static", "hf:batch_size=4"]
    assert all(row[1] == "12/12" for row in rows)
    runs = result["runs"]
    same = [[(r["prompt_len"], r["output_len"]) for r in run["requests"]] for run in runs]
    assert same[0] == same[1] == same[2]  # one request list for every target
    hf = runs[2]["requests"]
    assert all(r["output_tokens"] == r["output_len"] and len(r["itls"]) == r["output_len"] - 1 for r in hf)
    assert (out / "compare.png").read_bytes()[:4] == (out / "compare_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_target_specs() -> None:
    assert parse_target("pagoda:enable_prefix_caching=false,max_num_seqs=8") == TargetSpec(
        "pagoda",
        {"enable_prefix_caching": False, "max_num_seqs": 8},
        "pagoda:enable_prefix_caching=false,max_num_seqs=8",
    )
    assert parse_target("http://127.0.0.1:8000").options == {"url": "http://127.0.0.1:8000"}
    spec = parse_target("http:url=http://127.0.0.1:9/v1,model=m,label=vllm")
    assert spec.options == {"url": "http://127.0.0.1:9/v1", "model": "m"} and spec.label == "vllm"
    assert parse_target("transformers:batch_size=2").kind == "hf"
    for bad, message in (
        ("tgi", "unknown target kind"),
        ("http:model=m", "needs url"),
        ("pagoda-static", "needs batch"),
        ("pagoda:x", "KEY=VALUE"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_target(bad)


def test_offline_defaults_fit_the_bundled_model(capsys: pytest.CaptureFixture[str]) -> None:
    """No length flags on the bundled model (1,024-token context): lengths adapt and say so."""
    rc = bench(
        [
            "offline",
            "--model",
            "pagoda-coder",
            "--num-threads",
            "1",
            "--num-requests",
            "2",
            "--warmup",
            "0",
            "--no-progress",
            "--mix",
            "summarize",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    assert "lengths capped at the model's context: 1024 tokens" in captured.err
