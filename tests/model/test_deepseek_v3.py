"""DeepSeek-V3 (multi-head latent attention, DeepSeek's router) against transformers running the
same weights (float32): greedy ids equal and logprobs within LOGPROB_TOLERANCE, batched, with
n > 1, chunked prefill over cached latents, prefix caching (blocks of latents) and preemption;
the latent KV cache's size; absorbed decode against the expanded form on the same cache; the
router against a naive per-token reference and transformers' own.

The tiny checkpoints (tests/model_factory.py "deepseek_v3"): a dense first layer, then top-2 of
8 experts within the best 2 of 4 groups, a correction bias that steers the choice, routed scaling
and a shared expert; q through q_lora_rank, YaRN rope with its mscale; and a variant with a
plain q_proj, un-interleaved default rope, one group and no renormalization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import assert_idle
from engine_helpers import prompts_for as engine_prompts
from model_factory import assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams
from pagoda.kernels.attention.latent import LatentProjection, absorbed_attention, expanded_decode
from pagoda.kernels.moe import SigmoidRouting, sigmoid_top_k
from pagoda.model.model_config import ModelConfig
from pagoda.plan import ModelShape, count_params_from_architecture
from pagoda.plan import kv_bytes_per_token as plan_kv_bytes_per_token
from pagoda.plan import load_model as load_plan_model

NEW_TOKENS = 16
LOGPROB_TOLERANCE = 1e-3  # float32; they agree to about 1e-6
# transformers' reference runs with min_new_tokens (the EOS logit masked, logprobs raw); these
# random models' flat distributions often put EOS first, so pagoda masks it the same way.
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
VARIANTS = {
    "q-lora": {},
    "plain-q": dict(
        q_lora_rank=None,
        rope_interleave=False,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
SETTINGS = {
    "chunked-prefix-cache": dict(enable_prefix_caching=True, max_num_batched_tokens=16, block_size=4),
    "preemption": dict(block_size=4, num_kv_blocks=24, enable_prefix_caching=False),
    # verification chunks attend expanded over cached latents
    "ngram-speculation": dict(speculative="ngram"),
    # latent blocks offloaded to the host tier and read back
    "host-tier": dict(kv_offload_memory="4MiB", block_size=4, num_kv_blocks=30, enable_prefix_caching=True),
}


def prompts_for(vocab_size: int) -> list[list[int]]:
    return engine_prompts(vocab_size, (3, 11, 40, 57), shared_length=12, seed=1)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    return {name: build_model(root / name, "deepseek_v3", seed=1, **overrides) for name, overrides in VARIANTS.items()}


@pytest.fixture(scope="module")
def expected(model_dirs: dict[str, Path]) -> dict[str, tuple[list[list[int]], list[tuple[list[int], list[float]]]]]:
    return {name: hf_references(directory, prompts_for, NEW_TOKENS) for name, directory in model_dirs.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_and_logprobs_match_transformers(model_dirs, expected, variant: str) -> None:
    prompts, references = expected[variant]
    llm = LLM(model=str(model_dirs[variant]))
    assert_matches_reference(llm.generate(prompts, GREEDY), references, LOGPROB_TOLERANCE)
    parallel = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, n=2
    )
    assert_matches_reference(llm.generate(prompts, parallel), references, LOGPROB_TOLERANCE)
    assert_idle(llm)


@pytest.mark.parametrize("setting", SETTINGS)
def test_engine_features_keep_transformers_outputs(model_dirs, expected, setting: str) -> None:
    prompts, references = expected["q-lora"]
    settings = SETTINGS[setting]
    llm = LLM(model=str(model_dirs["q-lora"]), **settings)
    rounds = 2 if settings.get("enable_prefix_caching") else 1
    for _ in range(rounds):
        assert_matches_reference(llm.generate(prompts, GREEDY), references, LOGPROB_TOLERANCE)
    stats = llm.engine.get_stats()
    if setting == "preemption":
        assert stats.num_preemptions > 0
    elif setting == "ngram-speculation":
        assert stats.spec_decode is not None and stats.spec_decode.num_accepted_tokens > 0
    elif setting == "host-tier":
        assert stats.kv_tiers is not None and stats.kv_tiers.hits["host"] > 0
    else:  # the second round reads its prompts' latents from cached blocks
        assert stats.prefix_cache_hits > 0
    assert_idle(llm)


def test_kv_cache_holds_one_latent_and_rope_key_per_token_and_layer(model_dirs) -> None:
    config = ModelConfig.from_dir(model_dirs["q-lora"])
    assert config.mla is not None and config.mla.cache_dims == (32, 8)
    assert config.head_dim == 8  # the rotary tables span the rope dims
    latent_bytes = config.num_layers * (32 + 8) * 4
    assert config.kv_bytes_per_token(4) == latent_bytes
    # int8: each vector (latent, rope key) one byte per value plus its float32 scale
    assert config.kv_bytes_per_token(4, kv_cache_dtype="int8") == config.num_layers * (32 + 4 + 8 + 4)
    shape = ModelShape.from_model_config(config)  # `pagoda plan`'s worksheet, the same formula
    assert shape.kv_latent_dims == (32, 8) and plan_kv_bytes_per_token(shape, "fp32") == latent_bytes
    # A config alone counts the latent attention's weights as the checkpoint holds them.
    from_config = count_params_from_architecture(shape)
    from_weights = load_plan_model(str(model_dirs["q-lora"]))[1]
    assert from_config.linear + from_config.other == pytest.approx(from_weights.linear + from_weights.other, rel=0.02)
    llm = LLM(model=str(model_dirs["q-lora"]), block_size=4)
    caches = llm.engine.core.runner.distinct_kv_caches
    assert len(caches) == config.num_layers
    blocks = llm.engine.core.num_blocks
    allocated = sum(t.numel() * t.element_size() for pair in caches for t in pair)
    assert allocated == blocks * 4 * latent_bytes
    assert caches[0][0].shape == (blocks, 4, 1, 32) and caches[0][1].shape == (blocks, 4, 1, 8)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_latents_stay_close(model_dirs, expected, kv_cache_dtype: str) -> None:
    prompts, references = expected["q-lora"]
    llm = LLM(model=str(model_dirs["q-lora"]), kv_cache_dtype=kv_cache_dtype, block_size=4)
    outputs = llm.generate(prompts, GREEDY)
    first = [output.outputs[0].token_ids[0] for output in outputs]
    assert first == [tokens[0] for tokens, _ in references]
    for output, (tokens, logprobs) in zip(outputs, references):
        completion = output.outputs[0]
        assert abs(completion.logprobs[0][tokens[0]].logprob - logprobs[0]) < 0.05


def test_int8_weights_quantize_the_latent_attention_and_agree(model_dirs, expected) -> None:
    prompts, references = expected["q-lora"]
    llm = LLM(model=str(model_dirs["q-lora"]), quantization="int8")
    attention = llm.engine.core.runner.model.model.layers[1].self_attn
    assert attention.q_b_proj.weight_format.name == "int8"
    assert attention.kv_b_proj.weight.dtype == torch.float32  # the absorbed projections stay whole
    outputs = llm.generate(prompts, GREEDY)
    agree = sum(
        a == b for output, (tokens, _) in zip(outputs, references) for a, b in zip(output.outputs[0].token_ids, tokens)
    )
    assert agree >= 0.5 * NEW_TOKENS * len(prompts)


def test_absorbed_decode_agrees_with_expanded_on_the_same_cache(model_dirs, expected) -> None:
    prompts, references = expected["plain-q"]
    llm = LLM(model=str(model_dirs["plain-q"]))
    absorbed = llm.generate(prompts, GREEDY)
    llm.engine.core.runner.backend.absorb_latent_decode = False
    expanded = llm.generate(prompts, GREEDY)
    for a, b in zip(absorbed, expanded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step, token in enumerate(a.outputs[0].token_ids):
            assert abs(a.outputs[0].logprobs[step][token].logprob - b.outputs[0].logprobs[step][token].logprob) < 1e-4
    assert_matches_reference(expanded, references, LOGPROB_TOLERANCE)


def test_absorbed_attention_equals_expanded_attention() -> None:
    generator = torch.Generator().manual_seed(0)
    heads, nope, rope, v, latent, batch, length = 4, 16, 8, 12, 32, 3, 20
    projection = LatentProjection(torch.randn(heads * (nope + v), latent, generator=generator), heads, nope, v)
    q_nope = torch.randn(batch, heads, nope, generator=generator)
    q_rope = torch.randn(batch, heads, rope, generator=generator)
    latents = torch.randn(batch, length, latent, generator=generator)
    rope_keys = torch.randn(batch, length, rope, generator=generator)
    mask = torch.arange(length)[None, :] < torch.tensor([[20], [7], [13]])  # padded contexts
    args = (q_nope, q_rope, latents, rope_keys, projection, 0.2, mask)
    torch.testing.assert_close(absorbed_attention(*args), expanded_decode(*args), rtol=1e-4, atol=1e-5)


def naive_sigmoid_routing(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, groups: int, top_groups: int, renormalize: bool, scale: float
) -> list[dict[int, float]]:
    """Token by token, in plain Python: each token's {expert: weight}."""
    chosen = []
    per_group = logits.shape[1] // groups
    for row in logits.tolist():
        scores = [1 / (1 + torch.exp(torch.tensor(-x)).item()) for x in row]
        biased = [s + b for s, b in zip(scores, bias.tolist())]
        group_score = [sum(sorted(biased[g * per_group : (g + 1) * per_group])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: group_score[g])[-top_groups:]
        candidates = [e for e in range(len(row)) if e // per_group in kept]
        experts = sorted(candidates, key=lambda e: biased[e])[-top_k:]
        total = sum(scores[e] for e in experts) if renormalize else 1.0
        chosen.append({e: scores[e] / total * scale for e in experts})
    return chosen


@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_router_matches_a_naive_reference(renormalize: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 12, generator=generator)
    bias = torch.randn(12, generator=generator) * 0.5
    weights, experts = sigmoid_top_k(logits, 3, renormalize, SigmoidRouting(bias, 4, 2, 2.5))
    reference = naive_sigmoid_routing(logits, bias, 3, 4, 2, renormalize, 2.5)
    for token, expected_weights in enumerate(reference):
        got = dict(zip(experts[token].tolist(), weights[token].tolist()))
        assert got.keys() == expected_weights.keys()
        for expert, weight in expected_weights.items():
            assert got[expert] == pytest.approx(weight, rel=1e-5)


def test_sigmoid_router_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=1.5
    )
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=generator) * 0.3)
    hidden = torch.randn(24, 32, generator=generator)
    logits, expected_weights, expected_experts = router(hidden)
    routing = SigmoidRouting(router.e_score_correction_bias, 4, 2, 1.5)
    weights, experts = sigmoid_top_k(logits, 4, True, routing)
    order, expected_order = experts.argsort(dim=-1), expected_experts.argsort(dim=-1)
    assert torch.equal(experts.gather(1, order), expected_experts.gather(1, expected_order))
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))


def test_a_backend_without_latent_attention_refuses_the_model() -> None:
    from pagoda.kernels.attention import AttentionLayerSpec
    from pagoda.kernels.attention.torch_backend import TorchAttentionBackend

    class NoLatent(TorchAttentionBackend):
        name = "no-latent"
        supports_latent = False

    spec = AttentionLayerSpec(num_heads=4, num_kv_heads=1, head_dim=24, scale=0.2, sliding_window=None, latent=True)
    with pytest.raises(ValueError, match="latent attention runs on the torch attention backend"):
        NoLatent().check_layers([spec], "DeepseekV3ForCausalLM")
    backend = TorchAttentionBackend(native=object())  # type: ignore[arg-type]
    backend.check_layers([spec], "DeepseekV3ForCausalLM")
    assert backend.native is None  # the native paged kernel reads K/V heads, not latents


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_splits_the_heads_and_keeps_transformers_outputs(
    model_dirs, expected, expert_parallel: bool
) -> None:
    """Two ranks: each holds half the heads (q, kv_b_proj's rows, o_proj's inputs) and the whole
    latent; experts split, or placed whole per rank."""
    prompts, references = expected["q-lora"]
    llm = LLM(model=str(model_dirs["q-lora"]), tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    attention = llm.engine.core.runner.model.model.layers[0].self_attn
    assert attention.num_heads == 2 and attention.kv_b_proj.weight.shape == (2 * (16 + 16), 32)
    assert_matches_reference(llm.generate(prompts, GREEDY), references, LOGPROB_TOLERANCE)
