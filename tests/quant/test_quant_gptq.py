"""GPTQ 4-bit checkpoints (quantization_config.quant_method == "gptq") load without
re-quantizing: the int4 layer's effective weight is the checkpoint's (q - z) * s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gptq_factory import write_gptq
from pagoda.engine.llm import LLM
from pagoda.sampling_params import SamplingParams


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_codes_load_exactly(llama_dir: Path, tmp_path: Path, checkpoint_format: str) -> None:
    from pagoda.model.loader import load_model, load_model_config

    target = tmp_path / "gptq"
    dequantized = write_gptq(llama_dir, target, checkpoint_format)
    model = load_model(target, load_model_config(target), torch.float32, torch.device("cpu"))
    attention = model.model.layers[1].self_attn
    assert attention.qkv_proj.weight_format.name == "int4"
    effective = attention.qkv_proj(torch.eye(attention.qkv_proj.in_features)).t()
    expected = torch.cat([dequantized[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(effective, expected, rtol=2e-2, atol=2e-3)
    down = model.model.layers[0].mlp.down_proj
    torch.testing.assert_close(
        down(torch.eye(down.in_features)).t(), dequantized["model.layers.0.mlp.down_proj.weight"], rtol=2e-2, atol=2e-3
    )


def test_gptq_generates_like_its_dequantized_weights(llama_dir: Path, tmp_path: Path) -> None:
    gptq_dir = tmp_path / "gptq"
    dequantized = write_gptq(llama_dir, gptq_dir)
    reference_dir = tmp_path / "dequantized"
    shutil.copytree(llama_dir, reference_dir)
    tensors = load_file(str(reference_dir / "model.safetensors"))
    tensors.update(dequantized)
    save_file(tensors, str(reference_dir / "model.safetensors"))

    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys"]
    reference = LLM(model=str(reference_dir), kv_cache_memory="16MiB").generate(prompts, params)
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in reference]
    scored = LLM(model=str(gptq_dir), kv_cache_memory="16MiB").generate(
        sequences, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    )
    hits = total = 0
    for output, sequence, ref in zip(scored, sequences, reference):
        for position in range(len(ref.prompt_token_ids), len(sequence)):
            hits += output.prompt_logprobs[position][sequence[position]].rank == 1
            total += 1
    # Same weights; only bf16 activations in the int4 kernel differ (observed: all agree).
    assert hits >= 0.9 * total


def test_unsupported_gptq_variants(llama_dir: Path, tmp_path: Path) -> None:
    from pagoda.model.loader import load_model_config

    target = tmp_path / "gptq8"
    shutil.copytree(llama_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": 128}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPTQ with bits=8 is not supported; pagoda loads 4-bit GPTQ"):
        load_model_config(target)
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'compressed-tensors' is not supported .*GPTQ 4-bit"):
        load_model_config(target)
