"""Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss against transformers running the same weights (float32):
greedy ids equal and logprobs within LOGPROB_TOLERANCE, with and without prefix caching, with
chunked prefill, under preemption, with n > 1, from transformers 5's fused expert layout, with
int8 experts, and through the server; and the checkpoint errors a MoE model can have.

The tiny checkpoints (tests/model_factory.py): Mixtral top-2 of 4 experts with a 24-token
sliding window (prompts run past it); Qwen2-MoE top-2 of 8 without renormalization, a shared
expert behind its sigmoid gate, and a dense layer (`mlp_only_layers`); Qwen3-MoE top-3 of 8,
renormalized, with q/k norms; gpt-oss top-2 of 4 biased experts with the clamped SwiGLU, a
biased router, attention sinks, a sliding layer and a global one, YaRN rope (what is particular
to it: tests/model/test_gpt_oss.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from engine_helpers import assert_idle
from engine_helpers import prompts_for as engine_prompts
from model_factory import MOE_ARCHITECTURES, assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe import SparseMoE
from server_utils import start_server

NEW_TOKENS = 24
# float32 rounding only (the outputs agree to about 1e-6 here).
LOGPROB_TOLERANCE = 2e-5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
SETTINGS = {
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefix-cache": dict(enable_prefix_caching=True, max_num_batched_tokens=64, block_size=4),
    "preemption": dict(block_size=4, num_kv_blocks=24, enable_prefix_caching=False),
}


def prompts_for(vocab_size: int) -> list[list[int]]:
    return engine_prompts(vocab_size, (3, 11, 40, 57), shared_length=12, seed=1)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_models")
    return {arch: build_model(root / arch, arch) for arch in MOE_ARCHITECTURES}


@pytest.fixture(scope="module")
def expected(moe_dirs: dict[str, Path]) -> dict[str, tuple[list[list[int]], list[tuple[list[int], list[float]]]]]:
    return {arch: hf_references(directory, prompts_for, NEW_TOKENS) for arch, directory in moe_dirs.items()}


def assert_matches(outputs, references, tolerance: float = LOGPROB_TOLERANCE) -> None:
    assert_matches_reference(outputs, references, tolerance)


# Both ways: "off" is the transformers-exact mode, "auto" the default (the native fused MoE and
# routing kernels where they build): greedy ids equal and logprobs within LOGPROB_TOLERANCE either way.
@pytest.mark.parametrize("native_kernels", ["off", "auto"])
@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_greedy_and_logprobs_match_transformers(moe_dirs, expected, architecture: str, native_kernels: str) -> None:
    prompts, references = expected[architecture]
    llm = LLM(model=str(moe_dirs[architecture]), native_kernels=native_kernels)
    assert_matches(llm.generate(prompts, GREEDY), references)
    parallel = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, n=2)
    assert_matches(llm.generate(prompts, parallel), references)
    assert_idle(llm)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_engine_features_keep_transformers_outputs(moe_dirs, expected, architecture: str, setting: str) -> None:
    prompts, references = expected[architecture]
    settings = dict(SETTINGS[setting])
    if architecture == "mixtral" and setting == "preemption":
        # Its sliding window releases blocks as decoding moves on: only a smaller pool (and
        # chunks that fit it) still runs out and preempts.
        settings.update(num_kv_blocks=12, max_num_batched_tokens=16)
    llm = LLM(model=str(moe_dirs[architecture]), **settings)
    rounds = 2 if settings.get("enable_prefix_caching") else 1
    for _ in range(rounds):
        assert_matches(llm.generate(prompts, GREEDY), references)
    stats = llm.engine.get_stats()
    if setting == "preemption":
        assert stats.num_preemptions > 0
    if rounds == 2:
        assert stats.prefix_cache_hits > 0
    assert_idle(llm)


def test_configs_place_experts_as_transformers_does(moe_dirs) -> None:
    mixtral = ModelConfig.from_dir(moe_dirs["mixtral"])
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.renormalize) == (4, 2, True)
    assert mixtral.layer_sliding_windows == [24, 24]
    qwen2 = ModelConfig.from_dir(moe_dirs["qwen2_moe"])
    assert qwen2.moe.sparse_layers == (True, False, True)
    assert qwen2.moe.shared_expert_intermediate_size == 96 and not qwen2.moe.renormalize
    assert qwen2.qkv_bias and qwen2.layer_sliding_windows == [None] * 3  # sliding_window: 0, not used
    qwen3 = ModelConfig.from_dir(moe_dirs["qwen3_moe"])
    assert (qwen3.moe.num_experts, qwen3.moe.top_k, qwen3.moe.renormalize, qwen3.qk_norm) == (8, 3, True, True)
    stepped = ModelConfig.from_dict(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "decoder_sparse_step": 2,
        }
    )
    assert stepped.moe.sparse_layers == (False, True, False, True)
    gpt_oss = ModelConfig.from_dir(moe_dirs["gpt_oss"])
    assert (gpt_oss.moe.num_experts, gpt_oss.moe.top_k, gpt_oss.moe.swiglu_limit) == (4, 2, 0.6)
    assert gpt_oss.layer_sliding_windows == [24, None] and gpt_oss.attention_sinks


def _fuse_experts(source: Path, destination: Path) -> Path:
    """The checkpoint in transformers 5's in-memory layout: one [E, 2I, H] gate_up_proj and one
    [E, H, I] down_proj per layer."""
    shutil.copytree(source, destination)
    tensors = load_file(str(destination / "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    layers = sorted({name.split(".experts.")[0] for name in tensors if ".experts." in name})
    for prefix in layers:
        count = len({name for name in tensors if name.startswith(prefix + ".experts.") and "gate_proj" in name})
        take = lambda e, p, prefix=prefix: tensors.pop(f"{prefix}.experts.{e}.{p}.weight")  # noqa: E731
        fused[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([take(e, "gate_proj"), take(e, "up_proj")]) for e in range(count)]
        )
        fused[f"{prefix}.experts.down_proj"] = torch.stack([take(e, "down_proj") for e in range(count)])
    save_file({**tensors, **fused}, str(destination / "model.safetensors"), metadata={"format": "pt"})
    return destination


def test_fused_expert_layout_loads(moe_dirs, expected, tmp_path) -> None:
    directory = _fuse_experts(moe_dirs["qwen3_moe"], tmp_path / "fused")
    prompts, references = expected["qwen3_moe"]
    assert_matches(LLM(model=str(directory)).generate(prompts, GREEDY), references)


def test_int8_quantizes_the_experts_and_agrees(moe_dirs, expected) -> None:
    prompts, references = expected["qwen2_moe"]
    llm = LLM(model=str(moe_dirs["qwen2_moe"]), quantization="int8")
    block = llm.engine.core.runner.model.model.layers[0].mlp
    assert isinstance(block, SparseMoE)
    assert block.experts["3"].gate_up_proj.qweight.dtype == torch.int8
    assert block.gate.weight_format.name == "full"  # the router stays in full precision
    outputs = llm.generate(prompts, GREEDY)
    agree = sum(
        a == b for output, (tokens, _) in zip(outputs, references) for a, b in zip(output.outputs[0].token_ids, tokens)
    )
    assert agree >= 0.6 * NEW_TOKENS * len(prompts)


def test_missing_expert_tensor_is_named(moe_dirs, tmp_path) -> None:
    directory = tmp_path / "m"
    shutil.copytree(moe_dirs["mixtral"], directory)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.2\.w1\.weight"):
        LLM(model=str(directory))


def test_top_k_beyond_the_experts_is_refused(moe_dirs, tmp_path) -> None:
    directory = tmp_path / "m"
    shutil.copytree(moe_dirs["qwen3_moe"], directory)
    config = json.loads((directory / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\).*\(8\)"):
        LLM(model=str(directory))


def test_server_answers_with_the_offline_completion_and_counts_experts(moe_dirs) -> None:
    directory = moe_dirs["qwen2_moe"]
    prompt = "def fibonacci(n):"
    offline = LLM(model=str(directory)).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    live = start_server(directory, engine={"moe_metrics": True})
    try:
        response = httpx.post(
            live.base_url + "/completions",
            timeout=30,
            json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == 8
        assert body["choices"][0]["text"] == offline[0].outputs[0].text
        live.wait_idle()
        families = {
            family.name: family.samples
            for family in text_string_to_metric_families(httpx.get(live.url + "/metrics", timeout=30).text)
        }
        routed = {
            (s.labels["layer"], s.labels["expert"]): s.value
            for s in families["pagoda:moe_expert_tokens"]
            if s.name.endswith("_total")
        }
        assert {layer for layer, _ in routed} == {"0", "2"}  # layer 1 is dense
        # Every computed token (the prompt, and each generated one but the last) picked 2 experts.
        tokens = body["usage"]["prompt_tokens"] + 7
        assert sum(v for (layer, _), v in routed.items() if layer == "2") == 2 * tokens
        imbalance = {s.labels["layer"]: s.value for s in families["pagoda:moe_expert_imbalance"]}
        assert set(imbalance) == {"0", "2"} and all(1.0 <= v <= 8.0 for v in imbalance.values())
    finally:
        live.stop()


def test_expert_metrics_are_off_by_default(moe_dirs) -> None:
    llm = LLM(model=str(moe_dirs["mixtral"]))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert llm.engine.get_stats().moe is None


def test_lora_on_a_moe_model_is_refused_at_start(moe_dirs) -> None:
    with pytest.raises(ValueError, match="LoRA adapters are not supported on mixture-of-experts models"):
        LLM(model=str(moe_dirs["qwen3_moe"]), enable_lora=True)
