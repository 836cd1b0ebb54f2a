"""`pagoda bench oom-lab` on a tiny KV pool: the preemption boundary it measures agrees with
`pagoda plan`'s within 10% (short prompts, long outputs: the requests are all admitted, then
outgrow the pool), and a request longer than the pool is refused where plan says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.cli import main as pagoda_main
from pagoda.ops.oom_lab import OomLabOptions, run_oom_lab
from server_utils import build_tiny_model, start_server

NUM_BLOCKS = 24
BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x head dim 16 x fp32


def test_measured_boundary_agrees_with_plan(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "model")
    # The pool given in bytes, so plan's bytes-per-block arithmetic is what is checked.
    memory = NUM_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN
    server = start_server(model_dir, engine={"num_kv_blocks": None, "kv_cache_memory": str(memory), "max_num_seqs": 16})
    try:
        assert server.stats().num_total_blocks == NUM_BLOCKS
        report = run_oom_lab(
            OomLabOptions(
                url=server.url,
                model_dir=str(model_dir),
                prompt_lens=[16, 400],
                output_lens=[80],
                max_concurrency=6,
                kv_cache_memory=str(memory),
                block_size=BLOCK_SIZE,
                out=str(tmp_path / "lab"),
            )
        )
    finally:
        server.stop()
    assert report.num_kv_blocks == NUM_BLOCKS
    fits, too_long = report.points
    assert fits.planned_fit == 4  # 96 tokens = 6 blocks; 24 blocks hold 4
    assert fits.measured_boundary is not None and fits.agrees, fits
    assert too_long.planned_fit == 0 and too_long.refused_at == 1  # 480 tokens > 384 in the pool
    payload = json.loads((tmp_path / "lab" / "oom_lab.json").read_text())
    assert payload["points"][0]["agrees"] is True
    assert (tmp_path / "lab" / "oom_lab.png").stat().st_size > 0


def test_cli_needs_the_pool() -> None:
    with pytest.raises(SystemExit):
        pagoda_main(["bench", "oom-lab", "http://127.0.0.1:1", "--model-dir", "x"])
