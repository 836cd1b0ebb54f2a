"""Gemma 2, Gemma 3 (text) and Phi-3 against transformers running the same weights (float32):
greedy ids equal and logprobs within LOGPROB_TOLERANCE, with and without prefix caching, with
chunked prefill, under preemption, with tensor parallelism and through the server.

The tiny checkpoints (tests/model_factory.py) exercise each architecture's differences: Gemma 2's
soft-capped scores and logits, alternating 24-token windows (prompts run past them), (1 + w)
norms around attention and MLP, scaled embeddings, GELU-tanh and query_pre_attn_scalar; Gemma 3's
q/k norms and separate rope bases with linear scaling on its global layers; Phi-3's fused
qkv_proj / gate_up_proj tensors and LongRoPE's short factors (both sides of its boundary:
tests/model/test_phi3_longrope.py)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine_helpers import assert_idle
from engine_helpers import prompts_for as engine_prompts
from model_factory import MORE_ARCHITECTURES, assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams
from pagoda.model.model_config import ModelConfig
from server_utils import start_server

NEW_TOKENS = 24
# float32 rounding only: tighter than the 1e-3 parity bound, so that exact instead of tanh GELU
# (which keeps the greedy ids here) fails too.
LOGPROB_TOLERANCE = 2e-5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
# Engine settings that must not change results: no prefix cache; chunked prefill over a shared
# prefix (run twice: the second round hits the prefix cache); a pool too small for the batch.
SETTINGS = {
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefix-cache": dict(enable_prefix_caching=True, max_num_batched_tokens=16, block_size=4),
    "preemption": dict(block_size=4, num_kv_blocks=24, enable_prefix_caching=False),
}


def prompts_for(vocab_size: int) -> list[list[int]]:
    return engine_prompts(
        vocab_size, (3, 11, 40, 57), shared_length=12, seed=1
    )  # 40 and 57 run past the 24-token windows of the Gemma models


@pytest.fixture(scope="module")
def more_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("more_models")
    return {arch: build_model(root / arch, arch) for arch in MORE_ARCHITECTURES}


@pytest.fixture(scope="module")
def expected(
    more_model_dirs: dict[str, Path],
) -> dict[str, tuple[list[list[int]], list[tuple[list[int], list[float]]]]]:
    """Per architecture: the prompts and transformers' greedy (ids, logprobs) for each."""
    return {arch: hf_references(directory, prompts_for, NEW_TOKENS) for arch, directory in more_model_dirs.items()}


def assert_matches(outputs, references) -> None:
    assert_matches_reference(outputs, references, LOGPROB_TOLERANCE)


# Both ways: "off" is the transformers-exact mode, "auto" the default (the native kernels where they
# build: Gemma's (1 + w) norms, soft-caps and sliding windows in the native attention).
@pytest.mark.parametrize("native_kernels", ["off", "auto"])
@pytest.mark.parametrize("architecture", MORE_ARCHITECTURES)
def test_greedy_and_logprobs_match_transformers(
    more_model_dirs, expected, architecture: str, native_kernels: str
) -> None:
    prompts, references = expected[architecture]
    llm = LLM(model=str(more_model_dirs[architecture]), native_kernels=native_kernels)
    assert_matches(llm.generate(prompts, GREEDY), references)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("architecture", MORE_ARCHITECTURES)
def test_engine_features_keep_transformers_outputs(more_model_dirs, expected, architecture: str, setting: str) -> None:
    prompts, references = expected[architecture]
    llm = LLM(model=str(more_model_dirs[architecture]), **SETTINGS[setting])
    rounds = 2 if SETTINGS[setting].get("enable_prefix_caching") else 1
    for _ in range(rounds):
        assert_matches(llm.generate(prompts, GREEDY), references)
    stats = llm.engine.get_stats()
    if setting == "preemption":
        assert stats.num_preemptions > 0
    if rounds == 2:
        assert stats.prefix_cache_hits > 0
    assert_idle(llm)


def test_gemma2_local_layers_slide_past_their_window(more_model_dirs, expected) -> None:
    config = ModelConfig.from_dir(more_model_dirs["gemma2"])
    assert config.layer_sliding_windows == [24, None, 24]
    prompts, references = expected["gemma2"]
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert len(prompts[longest]) + NEW_TOKENS > 2 * 24
    llm = LLM(model=str(more_model_dirs["gemma2"]), block_size=4)
    assert_matches(llm.generate([prompts[longest]], GREEDY), [references[longest]])


@pytest.mark.parametrize("architecture", ["gemma2", "phi3"])
def test_tensor_parallel_matches_transformers(more_model_dirs, expected, architecture: str) -> None:
    """Gemma 2: vocabulary-parallel tied head under a soft-cap; Phi-3: fused checkpoint tensors
    split across ranks."""
    prompts, references = expected[architecture]
    llm = LLM(model=str(more_model_dirs[architecture]), tensor_parallel_size=2, num_kv_blocks=64)
    try:
        assert_matches(llm.generate(prompts, GREEDY), references)
        assert_idle(llm)
    finally:
        llm.engine.close()


def test_server_answers_with_the_offline_completion(more_model_dirs) -> None:
    directory = more_model_dirs["gemma3"]
    prompt = "def fibonacci(n):"
    offline = LLM(model=str(directory)).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    live = start_server(directory)
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
    finally:
        live.stop()


def test_checkpoint_configs_in_the_wild_parse() -> None:
    """Gemma 2 / 3 config.json as published: no layer_types, Gemma 3's local rope base and
    rope_scaling at top level; Phi-3's `su` rope type."""
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=32,
    )
    gemma2 = ModelConfig.from_dict(
        {
            **common,
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "num_hidden_layers": 4,
            "query_pre_attn_scalar": 256,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "hidden_activation": "gelu_pytorch_tanh",
        }
    )
    assert gemma2.layer_sliding_windows == [32, None, 32, None]
    assert gemma2.tie_word_embeddings and gemma2.gemma_norms and gemma2.embedding_scale == 8.0
    assert (gemma2.attention_scale, gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (1 / 16, 50.0, 30.0)
    gemma3 = ModelConfig.from_dict(
        {
            **common,
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "sliding_window_pattern": 6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    assert gemma3.layer_sliding_windows == [32] * 5 + [None]
    assert gemma3.qk_norm
    assert gemma3.layer_rope(0) == (10000.0, None)
    assert gemma3.layer_rope(5) == (1000000.0, {"rope_type": "linear", "factor": 8.0})
    phi3 = ModelConfig.from_dict(
        {
            **common,
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            "num_hidden_layers": 2,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
        }
    )
    assert phi3.max_position_embeddings == 131072 and phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.long_rope_boundary == 4096
    assert phi3.layer_sliding_windows == [32, 32]
