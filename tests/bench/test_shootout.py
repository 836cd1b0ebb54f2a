"""`pagoda bench shootout` against two local servers on a tiny model: every class measured for
both, greedy outputs of identical weights agree, and the JSON, Markdown and plots are written."""

from __future__ import annotations

import json
from pathlib import Path

from pagoda.bench.shootout import ShootoutOptions, agreement, run_shootout
from pagoda.cli import main as pagoda_main
from server_utils import build_tiny_model, start_server


def test_agreement_counts_exact_matches_and_common_prefixes() -> None:
    figures = agreement(["abcd", "xy", None], ["abXX", "xy", "z"])
    assert figures == {"exact_match_rate": 0.5, "common_prefix_share": 0.75, "compared": 2}


def test_two_local_servers_side_by_side(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "model")
    servers = [start_server(model_dir), start_server(model_dir, engine={"max_num_seqs": 2})]
    try:
        report = run_shootout(
            ShootoutOptions(
                targets=[f"default={servers[0].url}", f"seqs2={servers[1].url}"],
                rounds=2,
                requests_per_class=2,
                concurrency=2,
                length_scale=0.02,
                greedy_prompts=3,
                slo={"ttft": 30.0},
                out=str(tmp_path / "out"),
            )
        )
        assert pagoda_main(["bench", "shootout", servers[0].url, "--classes", "nope"]) == 2
    finally:
        for server in servers:
            server.stop()
    assert set(report["results"]) == {"default", "seqs2"}
    for by_class in report["results"].values():
        assert set(by_class) == {"chat", "rag", "summarize", "agent"}
        for summary in by_class.values():
            assert summary["requests"] == 4 and summary["errors"] == 0
            assert summary["ttft"]["p50"] is not None and summary["goodput_requests_per_s"] > 0
    assert report["greedy_agreement"]["seqs2"]["exact_match_rate"] == 1.0
    assert len(report["machine"]["load_average_1m"]) == 3  # each of the 2 rounds' start, and the end
    out = tmp_path / "out"
    assert json.loads((out / "shootout.json").read_text())["targets"][1]["label"] == "seqs2"
    markdown = (out / "shootout.md").read_text()
    assert "| chat | default |" in markdown and "1-minute load average" in markdown
    assert (out / "throughput.png").exists() and (out / "cdf_agent.png").exists()
