"""A model directory whose config.json and tokenizer_config.json carry an `auto_map` naming
Python files in the directory is served without running them (vLLM CVE-2026-22807): pagoda
builds its model from config.json's fields and never asks transformers to import the code."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from server_utils import build_tiny_model, start_server

CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig, PreTrainedTokenizerFast
class EvilConfig(PretrainedConfig):
    model_type = "evil"
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def plant(model_dir: Path, marker: Path) -> None:
    (model_dir / "evil.py").write_text(CODE.format(marker=str(marker)))
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "evil.EvilConfig",
        "AutoModelForCausalLM": "evil.EvilModel",
        "AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"],
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def test_auto_map_code_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    model_dir = build_tiny_model(tmp_path / "model")
    plant(model_dir, marker)
    server = start_server(model_dir)
    try:
        response = httpx.post(
            server.url + "/v1/completions", timeout=60, json={"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}
        )
        assert response.status_code == 200, response.text
    finally:
        server.stop()
    assert not marker.exists()
