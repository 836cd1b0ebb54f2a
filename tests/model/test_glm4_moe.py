"""GLM-4.5 MoE against transformers running the same weights (float32): greedy ids equal and
logprobs within LOGPROB_TOLERANCE, batched, with n > 1, chunked prefill with prefix caching, and
preemption; and how its config reads (partial rotary, q/k norms, DeepSeek's router).

The tiny checkpoint (tests/model_factory.py "glm4_moe"): half of each 32-dim head rotated, q/k
norms, q/k/v biases, a dense first layer, then top-2 of 8 experts in the best 2 of 4 groups under
the sigmoid router with its correction bias, routed scaling and a shared expert."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_helpers import assert_idle
from engine_helpers import prompts_for as engine_prompts
from model_factory import assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams
from pagoda.model.model_config import ModelConfig

NEW_TOKENS = 16
LOGPROB_TOLERANCE = 1e-3  # float32; they agree to about 1e-6
# transformers' reference runs with min_new_tokens (EOS masked, logprobs raw): the same here.
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
SETTINGS = {
    "batched": dict(),
    "chunked-prefix-cache": dict(enable_prefix_caching=True, max_num_batched_tokens=16, block_size=4),
    "preemption": dict(block_size=4, num_kv_blocks=24, enable_prefix_caching=False),
}


def prompts_for(vocab_size: int) -> list[list[int]]:
    return engine_prompts(vocab_size, (3, 11, 40, 57), shared_length=12, seed=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("glm4_moe") / "model", "glm4_moe", seed=1)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> tuple[list[list[int]], list[tuple[list[int], list[float]]]]:
    return hf_references(model_dir, prompts_for, NEW_TOKENS)


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_and_logprobs_match_transformers(model_dir, expected, setting: str) -> None:
    prompts, references = expected
    settings = SETTINGS[setting]
    llm = LLM(model=str(model_dir), **settings)
    rounds = 2 if settings.get("enable_prefix_caching") else 1
    for _ in range(rounds):
        assert_matches_reference(llm.generate(prompts, GREEDY), references, LOGPROB_TOLERANCE)
    stats = llm.engine.get_stats()
    if setting == "batched":
        parallel = SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, n=2
        )
        assert_matches_reference(llm.generate(prompts, parallel), references, LOGPROB_TOLERANCE)
    elif setting == "preemption":
        assert stats.num_preemptions > 0
    else:
        assert stats.prefix_cache_hits > 0
    assert_idle(llm)


def test_config_reads_partial_rotary_qk_norms_and_the_router(model_dir) -> None:
    config = ModelConfig.from_dir(model_dir)
    assert (config.head_dim, config.rotary_dim) == (32, 16)
    assert config.qk_norm and config.qkv_bias and not config.o_bias
    moe = config.moe
    assert moe is not None and moe.sigmoid_routing and not moe.shared_expert_gated
    assert (moe.num_groups, moe.top_k_groups, moe.routed_scaling_factor) == (4, 2, 1.8)
    assert moe.sparse_layers == (False, True, True)
    assert moe.shared_expert_intermediate_size == 32


def test_partial_rotary_is_refused_where_the_family_has_none() -> None:
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 64,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            }
        )


def test_tensor_parallel_keeps_transformers_outputs(model_dir, expected) -> None:
    prompts, references = expected
    llm = LLM(model=str(model_dir), tensor_parallel_size=2)
    assert_matches_reference(llm.generate(prompts, GREEDY), references, LOGPROB_TOLERANCE)
