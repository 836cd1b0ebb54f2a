"""Structured output on a GGUF checkpoint: the grammar's tokenizer comes from the GGUF
metadata as the engine's does (no tokenizer files beside the .gguf)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="GGUF support needs the `gguf` package")

from gguf_factory import write_gguf  # noqa: E402
from pagoda.engine.llm import LLM  # noqa: E402
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

# Bounded on purpose: a random model may write digits or text until max_tokens otherwise.
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


def test_json_schema_on_a_gguf_model(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = write_gguf(model_dirs["qwen2"], tmp_path / "qwen2.gguf", "F32")
    llm = LLM(model=str(path), kv_cache_memory="32MiB")
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    output = llm.generate(["Answer in JSON:"], params)[0].outputs[0]
    value = json.loads(output.text)
    assert value["color"] in ("red", "green") and isinstance(value["ok"], bool) and len(value) == 2
    assert output.finish_reason == "stop"
