"""Messages that say what is wrong: a pickle-only checkpoint is refused on purpose (and how to
convert it), a corrupt GGUF is called corrupt, an unknown architecture is one line with no
transformers warning before it, and int4 picks a group size each layer of the bundled model
takes (pagoda plan counts the same one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.config import DEFAULT_MODEL_DIR
from pagoda.model.loader import checkpoint_files
from pagoda.plan import PlanOptions, plan_from_options

REPO_ROOT = Path(__file__).resolve().parents[2]


def serve(model: Path | str, *flags: str) -> subprocess.CompletedProcess:
    """`pagoda serve` expected to refuse at startup (so it never listens)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            "1",
            "--num-threads",
            "1",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


def copy_of_bundled(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(DEFAULT_MODEL_DIR, target, ignore=shutil.ignore_patterns("*.png", "*.txt"))
    return target


def test_a_pickle_only_checkpoint_is_refused_on_purpose(tmp_path) -> None:
    model = copy_of_bundled(tmp_path, "pickled")
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError) as refused:
        checkpoint_files(model)
    message = str(refused.value)
    assert "pytorch_model.bin" in message and "refuses pickle checkpoints on purpose" in message
    assert "safe_serialization=True" in message and "no *.safetensors" not in message


def test_unknown_architecture_and_corrupt_gguf_are_one_line_each(tmp_path) -> None:
    model = copy_of_bundled(tmp_path, "unknown")
    config = (model / "config.json").read_text()
    (model / "config.json").write_text(
        config.replace("LlamaForCausalLM", "FooForCausalLM").replace('"model_type": "llama"', '"model_type": "foo"')
    )
    unknown = serve(model)
    assert unknown.returncode != 0
    assert unknown.stderr.strip().splitlines() == [unknown.stderr.strip()]  # one line, no warning first
    assert "unsupported architecture ['FooForCausalLM']" in unknown.stderr and "transformers" not in unknown.stderr

    corrupt = tmp_path / "model.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00" + os.urandom(64))
    broken = serve(corrupt)
    assert broken.returncode != 0 and len(broken.stderr.strip().splitlines()) == 1
    assert "corrupt or truncated" in broken.stderr and "--tokenizer" not in broken.stderr


def test_int4_serves_the_bundled_model_with_a_group_size_each_layer_takes() -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM(str(DEFAULT_MODEL_DIR), quantization="int4", num_kv_blocks=16, num_threads=1)
    [output] = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(output.outputs[0].token_ids) == 4
    layer = llm.engine.core.runner.model.model.layers[0]
    assert layer.mlp.down_proj.weight_format.group_size == 64  # its input, 704, is no multiple of 128
    assert layer.self_attn.o_proj.weight_format.group_size == 128
    with pytest.raises(ValueError, match="pass --quantization-group-size 64"):
        LLM(str(DEFAULT_MODEL_DIR), quantization="int4", quantization_group_size=128, num_kv_blocks=16)

    plan = plan_from_options(PlanOptions(model=str(DEFAULT_MODEL_DIR), memory="1GiB", dtype="int4"))
    assert plan.quantization_group_size == 64 and not any("group size" in w for w in plan.warnings)
    explicit = plan_from_options(
        PlanOptions(model=str(DEFAULT_MODEL_DIR), memory="1GiB", dtype="int4", quantization_group_size=128)
    )
    assert any("does not divide" in w and "704" in w for w in explicit.warnings)
