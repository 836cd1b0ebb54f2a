"""What is particular to gpt-oss (GptOssForCausalLM): a Hub config parses; YaRN rope and MXFP4
dequantization compute what transformers computes; a checkpoint with MXFP4 experts (the Hub's
layout, made here from the tiny model) loads and matches transformers on the dequantized
weights; the server answers as the offline engine.
Parity with transformers through the engine features runs with the other MoE models
(tests/model/test_moe_models.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_helpers import prompts_for as engine_prompts
from model_factory import assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams
from pagoda.model.loader import load_model_config
from pagoda.model.model_config import ModelConfig
from pagoda.model.rope import rope_attention_factor, rope_inv_freq
from pagoda.quant.mxfp4 import FP4_VALUES, dequantize_mxfp4
from server_utils import start_server

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)

# openai/gpt-oss-20b's config.json as the Hub serves it (its MXFP4 quantization_config included).
HUB_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}


def prompts_for(vocab_size: int) -> list[list[int]]:
    return engine_prompts(vocab_size, (5, 40), shared_length=12, seed=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("gpt_oss") / "m", "gpt_oss")


def test_hub_config_parses(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIG))
    config = load_model_config(tmp_path)  # the MXFP4 quantization_config is accepted
    assert config.architecture == "GptOssForCausalLM" and config.attention_sinks
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (32, 4, 2880)
    assert config.moe.router_bias and config.moe.expert_bias and config.moe.softmax_over_top_k
    assert (config.moe.swiglu_limit, config.moe.swiglu_alpha) == (7.0, 1.702)
    assert config.moe.sparse_layers == (True,) * 24
    assert config.layer_sliding_windows == [128, None] * 12
    assert config.qkv_bias and config.o_bias and (config.num_heads, config.num_kv_heads, config.head_dim) == (64, 8, 64)
    assert config.rope_theta == 150000.0 and config.rope_scaling["rope_type"] == "yarn"
    assert config.max_position_embeddings == 131072


@pytest.mark.parametrize(
    "parameters",
    [
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
        dict(factor=8.0, original_max_position_embeddings=64),  # truncated correction range, default betas
        dict(factor=4.0, mscale=1.0, mscale_all_dim=0.5, original_max_position_embeddings=512),
    ],
)
def test_yarn_matches_transformers(parameters: dict) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **parameters}
    hf_config = transformers.GptOssConfig(head_dim=64, max_position_embeddings=4096 * 32, rope_parameters=dict(rope))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    config = ModelConfig.from_dict({**HUB_CONFIG, "rope_scaling": None, "rope_parameters": rope})
    assert torch.equal(rope_inv_freq(64, config.rope_theta, config.rope_scaling), inv_freq)
    assert rope_attention_factor(config.rope_scaling) == attention_factor


def test_mxfp4_dequantizes_as_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 136, (3, 8, 4), dtype=torch.uint8, generator=generator)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 8, 128)
    # transformers returns its own input-major layout [E, K, rows]
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"MXFP4 blocks \(3, 8, 4, 16\) do not fit scales \(3, 8, 3\)"):
        dequantize_mxfp4(blocks, scales[..., :3])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] -> (blocks [..., K / 32, 16], scales [..., K / 32]): each group of 32 scaled
    by a power of two that puts its largest magnitude within FP4's 6, codes rounded to nearest."""
    groups = weight.reshape(*weight.shape[:-1], -1, 32).float()
    amax = groups.abs().amax(-1).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    table = torch.tensor(FP4_VALUES)
    codes = (groups / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1).sub(table).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def _mxfp4_checkpoints(source: Path, quantized: Path, reference: Path) -> None:
    """`quantized`: the experts as the Hub ships them (output-major MXFP4 blocks and scales,
    quantization_config mxfp4); `reference`: the same dequantized weights in transformers' layout."""
    shutil.copytree(source, quantized)
    shutil.copytree(source, reference)
    tensors = load_file(str(source / "model.safetensors"))
    hub, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # [E, out, in], quantized along `in`
            hub[name + "_blocks"], hub[name + "_scales"] = blocks, scales
            dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        else:
            hub[name] = dequantized[name] = tensor
    assert not torch.equal(
        dequantized["model.layers.0.mlp.experts.down_proj"], tensors["model.layers.0.mlp.experts.down_proj"]
    )  # quantization changed them
    save_file(hub, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = HUB_CONFIG["quantization_config"]
    (quantized / "config.json").write_text(json.dumps(config))


def test_mxfp4_experts_load_dequantized(model_dir: Path, tmp_path: Path) -> None:
    quantized, reference = tmp_path / "mxfp4", tmp_path / "dequantized"
    _mxfp4_checkpoints(model_dir, quantized, reference)
    prompts, references = hf_references(reference, prompts_for, NEW_TOKENS)
    assert_matches_reference(LLM(model=str(quantized)).generate(prompts, GREEDY), references, 1e-3)


def test_mxfp4_tensor_without_its_scales_is_named(model_dir: Path, tmp_path: Path) -> None:
    quantized, reference = tmp_path / "mxfp4", tmp_path / "dequantized"
    _mxfp4_checkpoints(model_dir, quantized, reference)
    tensors = load_file(str(quantized / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales is missing"):
        LLM(model=str(quantized))


def test_missing_expert_bias_is_named_as_the_checkpoint_names_it(model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "m"
    shutil.copytree(model_dir, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.gate_up_proj_bias"], tensors["model.layers.0.mlp.router.bias"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"missing tensor\(s\) model\.layers\.0\.mlp\.router\.bias, "
        r"model\.layers\.1\.mlp\.experts\.gate_up_proj_bias$",
    ):
        LLM(model=str(directory))


def test_ngram_speculation_keeps_transformers_outputs(model_dir: Path) -> None:
    prompts, references = hf_references(model_dir, prompts_for, NEW_TOKENS)
    llm = LLM(model=str(model_dir), speculative="ngram", num_speculative_tokens=3)
    assert_matches_reference(llm.generate(prompts, GREEDY), references, 1e-3)


def test_int8_quantizes_the_biased_experts_and_agrees(model_dir: Path) -> None:
    prompts, references = hf_references(model_dir, prompts_for, NEW_TOKENS)
    llm = LLM(model=str(model_dir), quantization="int8")
    experts = llm.engine.core.runner.model.model.layers[0].mlp.experts
    assert experts["1"].down_proj.qweight.dtype == torch.int8 and experts["1"].down_proj.bias is not None
    outputs = llm.generate(prompts, GREEDY)
    agree = sum(
        a == b for output, (tokens, _) in zip(outputs, references) for a, b in zip(output.outputs[0].token_ids, tokens)
    )
    assert agree >= 0.6 * NEW_TOKENS * len(prompts)


def test_server_answers_with_the_offline_completion(model_dir: Path) -> None:
    prompt = "def fibonacci(n):"
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = LLM(model=str(model_dir)).generate([prompt], params)[0].outputs[0].text
    live = start_server(model_dir)
    try:
        response = httpx.post(
            live.base_url + "/completions",
            timeout=30,
            json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == offline
    finally:
        live.stop()
