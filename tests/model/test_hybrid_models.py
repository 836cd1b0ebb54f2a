"""Hybrid models, recurrent layers beside attention: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text),
with Gated DeltaNet, and Granite 4.0-H, Nemotron-H and Falcon-H1, with Mamba2, against transformers running the same
weights (float32): greedy ids equal and logprobs within LOGPROB_TOLERANCE, batched at different
lengths, through chunked prefill, under preemption (the recomputed sequence's state starts from
zeros) and with n > 1 (each sample a copy of its lead's state), the state cache empty when the
engine is idle, and with prefix caching (the recurrent state restored from snapshots at block
boundaries); and the settings refused for them.

The tiny checkpoints (tests/model_factory.py): Gated DeltaNet in layers 0-2, two key heads
serving four value heads; gated attention with q/k norms and a half-head rotary in layer 3;
Qwen3-Next with top-2 of 4 experts and a shared expert (layer 1 dense), Qwen3.5-MoE with them
in every layer; Granite with Mamba2 in layers 0, 1 and 3 (two groups, chunks of 16 tokens),
attention without rotary in layer 2, its multipliers, and experts beside its shared MLP;
Nemotron-H's single-mixer blocks: Mamba2, a squared-ReLU MLP, attention, an MLP; Falcon-H1's
Mamba2 and attention side by side in both layers, every muP multiplier away from 1."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
import torch

from engine_helpers import assert_idle
from engine_helpers import prompts_for as engine_prompts
from model_factory import HYBRID_ARCHITECTURES, assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams
from pagoda.model.linear_attention_config import LinearAttentionConfig, Mamba2Config
from pagoda.model.model_config import ModelConfig
from server_utils import start_server

NEW_TOKENS = 12
# float32 rounding only (the outputs agree to about 5e-6 here).
LOGPROB_TOLERANCE = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
SETTINGS = {
    "no-prefix-cache": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
    "chunked-prefix-cache": dict(enable_prefix_caching=True, max_num_batched_tokens=16, block_size=4),
    "preemption": dict(block_size=4, num_kv_blocks=30, max_num_batched_tokens=32),
}


def prompts_for(vocab_size: int) -> list[list[int]]:
    # 70 tokens: past one 64-token chunk of the delta rule
    return engine_prompts(vocab_size, (3, 11, 40, 70), shared_length=12, seed=1)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid_models")
    return {arch: build_model(root / arch, arch) for arch in HYBRID_ARCHITECTURES}


@pytest.fixture(scope="module")
def expected(hybrid_dirs: dict[str, Path]) -> dict[str, tuple[list[list[int]], list[tuple[list[int], list[float]]]]]:
    return {arch: hf_references(directory, prompts_for, NEW_TOKENS) for arch, directory in hybrid_dirs.items()}


@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_greedy_and_logprobs_match_transformers(hybrid_dirs, expected, architecture: str) -> None:
    prompts, references = expected[architecture]
    llm = LLM(model=str(hybrid_dirs[architecture]))
    assert_matches_reference(llm.generate(prompts, GREEDY), references, LOGPROB_TOLERANCE)
    parallel = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, n=3)
    assert_matches_reference(llm.generate(prompts, parallel), references, LOGPROB_TOLERANCE)
    assert_idle(llm)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_engine_features_keep_transformers_outputs(hybrid_dirs, expected, architecture: str, setting: str) -> None:
    prompts, references = expected[architecture]
    settings = SETTINGS[setting]
    llm = LLM(model=str(hybrid_dirs[architecture]), **settings)
    rounds = 2 if settings.get("enable_prefix_caching", True) else 1
    for _ in range(rounds):  # the second round restores cached prefixes: KV and recurrent state
        assert_matches_reference(llm.generate(prompts, GREEDY), references, LOGPROB_TOLERANCE)
    if rounds == 2:  # samples forked from a lead whose whole prompt but the last token was cached
        parallel = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, n=2)
        assert_matches_reference(llm.generate(prompts, parallel), references, LOGPROB_TOLERANCE)
    stats = llm.engine.get_stats()
    if setting == "preemption":
        assert stats.num_preemptions > 0
    assert (stats.prefix_cache_hits > 0) == (rounds == 2)
    assert_idle(llm)


def test_configs_place_linear_and_attention_layers(hybrid_dirs) -> None:
    config = ModelConfig.from_dir(hybrid_dirs["qwen3_next"])
    linear = config.linear_attention
    assert linear is not None and linear.layers == (True, True, True, False)
    assert (linear.num_key_heads, linear.num_value_heads, linear.conv_dim) == (2, 4, 2 * 32 + 32)
    assert config.kv_layers == (3,) and config.rotary_dim == 8
    assert config.attention_output_gate and config.zero_centered_norms and not config.gemma_norms
    assert config.moe is not None and config.moe.sparse_layers == (True, False, True, True)
    moe = ModelConfig.from_dir(hybrid_dirs["qwen3_5_moe"])
    assert moe.moe is not None and moe.moe.renormalize and all(moe.moe.sparse_layers)
    assert isinstance(moe.linear_attention, LinearAttentionConfig) and moe.linear_attention.projection == "separate"
    granite = ModelConfig.from_dir(hybrid_dirs["granitemoehybrid"])
    mamba = granite.linear_attention
    assert isinstance(mamba, Mamba2Config) and mamba.layers == (True, True, False, True)
    assert (mamba.intermediate_size, mamba.conv_dim, mamba.time_step_limit) == (128, 128 + 2 * 2 * 16, (0.0, math.inf))
    assert granite.kv_layers == (2,) and granite.no_rope
    assert (granite.embedding_scale, granite.residual_multiplier, granite.attention_scale) == (2.0, 0.5, 0.2)
    assert granite.logits_divisor == 2.0
    assert granite.moe is not None and granite.moe.softmax_over_top_k and not granite.moe.shared_expert_gated
    nemotron = ModelConfig.from_dir(hybrid_dirs["nemotron_h"])
    assert isinstance(nemotron.linear_attention, Mamba2Config)
    assert nemotron.linear_attention.layers == (True, False, False, False)
    assert nemotron.mlp_only_layers == (1, 3) and nemotron.kv_layers == (2,) and nemotron.no_rope
    falcon = ModelConfig.from_dir(hybrid_dirs["falcon_h1"])
    assert isinstance(falcon.linear_attention, Mamba2Config) and falcon.linear_attention.layers == (True, True)
    assert falcon.kv_layers == (0, 1) and falcon.linear_attention.gated_norm == "before_gate"
    assert falcon.linear_attention.projection_multipliers == (1.1, 0.9, 1.2, 0.8, 1.3)
    assert falcon.logits_divisor == 2.0 and falcon.layer_multipliers["mlp"] == (0.8, 1.2)


def test_nemotron_h_moe_blocks_are_refused(hybrid_dirs, tmp_path) -> None:
    config = json.loads((hybrid_dirs["nemotron_h"] / "config.json").read_text())
    config["layers_block_type"] = ["linear_attention", "moe", "full_attention", "mlp"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Nemotron-H blocks of type moe are not supported yet"):
        ModelConfig.from_dir(tmp_path)


def test_a_cached_prefix_ends_at_a_state_snapshot(hybrid_dirs, expected) -> None:
    prompts, _ = expected["qwen3_5"]
    llm = LLM(model=str(hybrid_dirs["qwen3_5"]), block_size=4, max_num_batched_tokens=16)
    llm.generate(prompts[-1:], GREEDY)
    core = llm.engine.core
    # 82 prompt tokens in chunks of 16: a snapshot after each chunk's last full block (16 ... 80)
    assert core.kv_cache.state_snapshots is not None and core.kv_cache.state_snapshots.num_cached == 5
    longer = [prompts[-1] + [7, 8, 9, 10, 11, 12]]
    hits = core.scheduler.prefix_cache_hits
    cached = llm.generate(longer, GREEDY)[0].outputs[0]
    assert core.scheduler.prefix_cache_hits - hits == 80  # the KV and the state after 80 tokens
    plain = LLM(model=str(hybrid_dirs["qwen3_5"]), enable_prefix_caching=False).generate(longer, GREEDY)[0].outputs[0]
    assert cached.token_ids == plain.token_ids
    for position, token in enumerate(cached.token_ids):
        assert abs(cached.logprobs[position][token].logprob - plain.logprobs[position][token].logprob) < 1e-4
    assert_idle(llm)


def test_a_shared_prefix_is_snapshotted_where_its_cached_kv_ends(hybrid_dirs) -> None:
    # A document and different questions (the rag workload's shape): the first prompt saves its
    # state only at its last block boundary (inside its question); the second finds the
    # document's KV cached but no state there, so it saves one as it passes the document's end;
    # the third restores the document from it.
    generator = torch.Generator().manual_seed(3)
    document = torch.randint(5, 300, (40,), generator=generator).tolist()
    questions = [torch.randint(5, 300, (6,), generator=generator).tolist() for _ in range(3)]
    llm = LLM(model=str(hybrid_dirs["granitemoehybrid"]), block_size=4)
    scheduler = llm.engine.core.scheduler
    hits = []
    outputs = []
    for question in questions:
        before = scheduler.prefix_cache_hits
        outputs.append(llm.generate([document + question], GREEDY)[0].outputs[0])
        hits.append(scheduler.prefix_cache_hits - before)
    assert hits == [0, 0, 40]
    plain = LLM(model=str(hybrid_dirs["granitemoehybrid"]), enable_prefix_caching=False)
    expected = plain.generate([document + q for q in questions], GREEDY)
    for got, want in zip(outputs, expected):
        assert got.token_ids == want.outputs[0].token_ids
    assert_idle(llm)


def test_samples_fork_from_a_state_restored_in_a_step_without_work(hybrid_dirs) -> None:
    # 13 tokens in blocks of 4: the second time, the lead's prompt but its last token is cached
    # (12 tokens and the state after them): it forks at admission, in a step that computes
    # nothing; the restore and the forks' copies wait for the next step, and run in order.
    prompt = [[(7 * j + 3) % 300 + 5 for j in range(13)]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(model=str(hybrid_dirs["qwen3_next"]), enable_prefix_caching=False).generate(prompt, greedy)
    llm = LLM(model=str(hybrid_dirs["qwen3_next"]), block_size=4)
    llm.generate(prompt, greedy)
    samples = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2))
    assert [c.token_ids for c in samples[0].outputs] == [plain[0].outputs[0].token_ids] * 2
    assert_idle(llm)


def test_the_state_cache_bounds_the_sequences(hybrid_dirs) -> None:
    # 3 layers x (96 channels x 3 window floats + 4 x 16 x 8 state floats) = 9600 bytes a sequence,
    # twice that with prefix caching (a snapshot slot per sequence slot), in half the budget
    for caching, copies in ((True, 2), (False, 1)):
        llm = LLM(model=str(hybrid_dirs["qwen3_5"]), kv_cache_memory="1MiB", enable_prefix_caching=caching)
        slots = llm.engine.core.kv_cache.state_slots
        assert slots is not None and slots.num_slots == (1 << 20) // 2 // (9600 * copies)
        assert llm.engine.core.scheduler.max_num_seqs <= slots.num_slots
        assert llm.engine.core.runner.state_cache.recurrent[0].shape[0] == slots.num_slots * copies
    with pytest.raises(ValueError, match=r"recurrent state of 200 sequences \(--max-num-seqs\)"):
        LLM(model=str(hybrid_dirs["qwen3_5"]), kv_cache_memory="1MiB", max_num_seqs=200, enable_prefix_caching=False)


def test_sleep_releases_the_state_cache_and_wakes_to_the_same_outputs(hybrid_dirs) -> None:
    llm = LLM(model=str(hybrid_dirs["qwen3_5"]), kv_cache_memory="1MiB")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": prompts_for(llm.engine.core.model_config.vocab_size)[0]}
    before = llm.generate([prompt], params)[0].outputs[0].token_ids
    state = llm.engine.core.runner.state_cache
    tensors = [t for t in (*state.conv_windows, *state.recurrent) if t is not None]
    llm.sleep(1)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    llm.wake_up()
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == before
    assert_idle(llm)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (dict(speculative="ngram"), "speculative decoding"),
        (dict(tensor_parallel_size=2), "tensor parallelism"),
    ],
)
def test_unsupported_settings_are_refused_with_one_line(hybrid_dirs, setting, message: str) -> None:
    with pytest.raises(ValueError, match=f"Qwen3NextForCausalLM is a hybrid .*: {message}"):
        LLM(model=str(hybrid_dirs["qwen3_next"]), **setting)


def test_server_answers_with_the_offline_completion(hybrid_dirs) -> None:
    directory = hybrid_dirs["qwen3_next"]
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
        assert response.json()["choices"][0]["text"] == offline[0].outputs[0].text
    finally:
        live.stop()


def test_plan_and_banner_count_the_state(hybrid_dirs) -> None:
    from pagoda.config import EngineConfig
    from pagoda.core.kv_memory import KVMemory
    from pagoda.core.kv_plan import plan_kv_pool
    from pagoda.plan import ModelShape, kv_bytes_per_token

    config = ModelConfig.from_dir(hybrid_dirs["qwen3_5"])
    shape = ModelShape.from_model_config(config)
    # one attention layer keeps KV: 2 (K and V) x 2 heads x 16 x 4 bytes
    assert kv_bytes_per_token(shape, "fp32") == 256 == config.kv_bytes_per_token(4)
    assert shape.num_linear_layers == 3 and shape.linear_state_elements == (3 * 96 * 3, 3 * 4 * 16 * 8)
    nemotron = ModelShape.from_model_config(ModelConfig.from_dir(hybrid_dirs["nemotron_h"]))
    assert nemotron.num_kv_layers == 1 and kv_bytes_per_token(nemotron, "fp32") == 256  # its MLP blocks keep no KV
    engine = EngineConfig(model=str(hybrid_dirs["qwen3_5"]), kv_cache_memory="1MiB")
    memory = KVMemory(1 << 20, "--kv-cache-memory")
    plan = plan_kv_pool(
        engine.cache,
        engine.scheduler,
        config,
        memory,
        num_kv_heads=config.num_kv_heads,
        element_bytes=4,
        max_model_len=256,
        release_blocker=None,
    )
    slots = (1 << 20) // 2 // (2 * 9600)
    assert (plan.num_state_slots, plan.num_state_snapshots, plan.bytes_per_state_slot) == (slots, slots, 9600)
    assert plan.num_blocks * plan.bytes_per_block + plan.state_bytes <= memory.bytes
    line = plan.describe_memory()  # what the banner's KV pool line says
    assert line.endswith(
        f"; state cache: {slots} sequences fit (9,600 bytes each), {slots} prefix-cache snapshots at block boundaries"
    )
