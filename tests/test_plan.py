"""`pagoda plan`: the capacity arithmetic against hand-computed values."""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
from pathlib import Path

import pytest

from pagoda import plan as P
from pagoda.cli import plan as plan_cli

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# embed 128256*4096 = 525,336,576 (x2, untied); per layer: q,o 4096*4096 each, k,v 4096*1024 each,
# MLP 3*4096*14336, 2 norms of 4096 -> 218,112,000; x32 + final norm 4096.
LLAMA3_8B_PARAMS = 2 * 525_336_576 + 32 * 218_112_000 + 4096


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def llama3_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def test_llama3_8b_param_count_and_kv_bytes() -> None:
    shape = P.model_shape_from_config(LLAMA3_8B)
    params = P.count_params_from_architecture(shape)
    assert params.total == LLAMA3_8B_PARAMS == 8_030_261_248
    assert shape.config_dtype == "bf16"
    assert P.kv_bytes_per_token(shape, "bf16") == 131_072  # 32 * 2 * 8 * 128 * 2
    # fp8 as pagoda's KV cache stores it: 1 byte per element + a 4-byte scale per head vector.
    assert P.kv_bytes_per_token(shape, "fp8") == 32 * 2 * 8 * (128 + 4) == 67_584
    assert P.weight_bytes(params, "bf16") == 2 * LLAMA3_8B_PARAMS  # ~16.06 GB


def test_llama3_8b_plan_on_80gib(llama3_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["--model", str(llama3_config.parent), "--memory", "80GiB", "--json"], capsys)
    assert rc == 0
    plan = json.loads(out)
    memory = 80 * 2**30
    reserve = memory // 10
    kv_memory = memory - reserve - 2 * LLAMA3_8B_PARAMS
    block_bytes = 131_072 * 16
    assert plan["weight_bytes"] == 16_060_522_496
    assert plan["reserve_bytes"] == reserve
    assert plan["kv_memory_bytes"] == kv_memory
    assert plan["kv_bytes_per_sequence"] == 131_072 * 8192 == 2**30
    assert plan["blocks_per_sequence"] == 512
    assert plan["num_blocks"] == kv_memory // block_bytes == 29_205
    assert plan["full_context_seqs"] == 29_205 // 512 == 57
    scenarios = {s["name"]: s for s in plan["scenarios"]}
    assert scenarios["KV cache fp8"]["full_context_seqs"] == (kv_memory // (67_584 * 16)) // 512
    assert scenarios["context 4096"]["full_context_seqs"] == 29_205 // 256
    # Decoder linears in int8, embeddings + lm_head + norms in bf16.
    linear = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert scenarios["weights int8"]["weight_bytes"] == linear + 2 * (LLAMA3_8B_PARAMS - linear)
    assert not any(name.startswith("GQA") for name in scenarios)  # already GQA


def test_classes_blocks_and_memory(llama3_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(
        [
            "--model",
            str(llama3_config),
            "--memory",
            "80GiB",
            "--json",
            "--classes",
            "chat=p50:200/400,p95:1000/800,c:64",
            "rag=p50:4000/200,c:16",
        ],
        capsys,
    )
    assert rc == 0
    plan = json.loads(out)
    chat, rag = plan["classes"]
    assert (chat["p50_tokens"], chat["p95_tokens"]) == (600, 1800)
    assert (chat["p50_blocks"], chat["p95_blocks"]) == (38, 113)  # ceil(600/16), ceil(1800/16)
    assert chat["blocks_needed_p95"] == 64 * 113
    assert chat["memory_needed_p95"] == 64 * 113 * 16 * 131_072
    assert chat["fits_at_p95"] == plan["num_blocks"] // 113
    assert rag["p95_tokens"] == 4200 and rag["blocks_needed_p50"] == 16 * 263
    assert plan["classes_total_memory_p95"] == (64 * 113 + 16 * 263) * 16 * 131_072


def test_human_table(llama3_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["--model", str(llama3_config), "--memory", "80GiB", "--context", "8192"], capsys)
    assert rc == 0
    assert "131,072 bytes" in out and "16.06 GB" in out and "8.03B" in out
    assert "full-context sequences that fit at once: 57" in out
    assert "weights int4" in out and "KV cache fp8" in out


def test_mha_model_offers_gqa_and_qwen_flags() -> None:
    mha = {**LLAMA3_8B, "num_key_value_heads": 32}
    shape = P.model_shape_from_config(mha)
    plan = P.build_plan(
        shape,
        P.count_params_from_architecture(shape),
        model="m",
        memory_bytes=80 * 2**30,
        dtype="bf16",
        kv_dtype="bf16",
        context=4096,
        block_size=16,
        reserve_bytes=0,
        classes=[],
    )
    gqa = {s.name: s for s in plan.scenarios if s.name.startswith("GQA")}
    assert gqa["GQA 8 KV heads"].kv_bytes_per_token == 131_072
    assert gqa["GQA 4 KV heads"].kv_bytes_per_token == 65_536

    qwen2 = {**LLAMA3_8B, "model_type": "qwen2", "tie_word_embeddings": True, "dtype": "float16"}
    s2 = P.model_shape_from_config(qwen2)
    assert s2.qkv_bias and not s2.o_bias and s2.config_dtype == "fp16"
    p2 = P.count_params_from_architecture(s2)
    assert p2.total == LLAMA3_8B_PARAMS - 525_336_576 + 32 * (4096 + 2 * 1024)

    qwen3 = {**LLAMA3_8B, "model_type": "qwen3", "head_dim": 128}
    p3 = P.count_params_from_architecture(P.model_shape_from_config(qwen3))
    assert p3.total == LLAMA3_8B_PARAMS + 32 * 2 * 128


def _write_safetensors(path: Path, tensors: dict[str, list[int]]) -> None:
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_params_from_safetensors_headers(tmp_path: Path) -> None:
    tiny = {
        **LLAMA3_8B,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": 10,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    _write_safetensors(
        tmp_path / "model-00001-of-00002.safetensors",
        {
            "model.embed_tokens.weight": [10, 8],
            "model.layers.0.self_attn.q_proj.weight": [8, 8],
            "model.layers.0.self_attn.k_proj.weight": [4, 8],
            "model.layers.0.self_attn.v_proj.weight": [4, 8],
            "model.layers.0.self_attn.o_proj.weight": [8, 8],
        },
    )
    _write_safetensors(
        tmp_path / "model-00002-of-00002.safetensors",
        {
            "model.layers.0.mlp.gate_proj.weight": [16, 8],
            "model.layers.0.mlp.up_proj.weight": [16, 8],
            "model.layers.0.mlp.down_proj.weight": [8, 16],
            "model.layers.0.input_layernorm.weight": [8],
            "model.layers.0.post_attention_layernorm.weight": [8],
            "model.norm.weight": [8],
        },
    )
    shape, params = P.load_model(str(tmp_path))
    assert params.source == "safetensors headers"
    assert params.total == P.count_params_from_architecture(shape).total == 80 + 192 + 384 + 24
    assert params.embedding == 80 and params.lm_head == 0 and params.other == 24


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3", "phi3"])
def test_architecture_count_matches_checkpoint(tmp_path: Path, architecture: str) -> None:
    """Gemma's four norms per layer (and Gemma 3's q/k norms), Phi-3's fused tensors."""
    from model_factory import build_model

    directory = build_model(tmp_path / architecture, architecture)
    shape, params = P.load_model(str(directory))
    assert params.source == "safetensors headers"
    assert params == dataclasses.replace(P.count_params_from_architecture(shape), source=params.source)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("chat", "expected NAME="),
        ("chat=p50:200", "PROMPT/OUTPUT"),
        ("chat=p95:1/2", "needs p50"),
        ("chat=p50:1/2,x:3", "unknown key"),
        ("chat=p50:1/2,c:0", "concurrency >= 1"),
    ],
)
def test_bad_class_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        P.parse_request_class(spec)


def test_user_errors_are_clear(tmp_path: Path, llama3_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(["--model", str(tmp_path / "nope"), "--memory", "8GiB"], capsys)
    assert rc == 2 and "no config.json" in err
    rc, _, err = run_cli(["--model", str(llama3_config), "--memory", "8GiB", "--kv-dtype", "int3"], capsys)
    assert rc == 2 and "unknown dtype" in err
    rc, out, _ = run_cli(["--model", str(llama3_config), "--memory", "8GiB"], capsys)
    assert rc == 0 and "warning: the weights and reserve do not leave any memory" in out


def test_reads_configs_pagoda_cannot_serve_and_shares_the_engines_parsing() -> None:
    from pagoda.model.model_config import ModelConfig

    gemma_like = {
        **LLAMA3_8B,
        "architectures": ["SomeNewForCausalLM"],
        "model_type": "somenew",
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_dict(gemma_like)  # the engine refuses it ...
    shape = P.model_shape_from_config(gemma_like)  # ... the worksheet still reads its shape
    assert (shape.model_type, shape.num_layers, shape.num_kv_heads) == ("somenew", 32, 8)
    # One KV formula: the engine's pool sizing (ModelConfig) and the worksheet agree.
    engine_config = ModelConfig.from_dict(LLAMA3_8B)
    assert engine_config.kv_bytes_per_token(2) == P.kv_bytes_per_token(P.model_shape_from_config(LLAMA3_8B), "bf16")


def test_sliding_window_layers_count_window_sized_kv() -> None:
    """Gemma 2's shape: half the layers keep only their 4096-token window, so at 8k context
    each sequence costs about three quarters of the KV it would with every block kept."""
    config = {
        "architectures": ["Gemma2ForCausalLM"],
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "num_hidden_layers": 26,
        "vocab_size": 256000,
        "intermediate_size": 9216,
        "sliding_window": 4096,
        "max_position_embeddings": 8192,
    }
    windowed = P.model_shape_from_config(config)
    kept = dataclasses.replace(windowed, layer_sliding_windows=())
    plans = [
        P.build_plan(
            shape,
            P.count_params_from_architecture(shape),
            model="m",
            memory_bytes=24 * 2**30,
            dtype="bf16",
            kv_dtype="bf16",
            context=8192,
            block_size=16,
            reserve_bytes=2**30,
            classes=[],
        )
        for shape in (windowed, kept)
    ]
    assert plans[0].full_context_seqs > 1.3 * plans[1].full_context_seqs
    assert "sliding windows  13 of 26 layers" in P.render_plan(plans[0])


QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 48,
    "vocab_size": 151936,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# embed 151936*2048 = 311,164,928 (x2, untied); per layer: q,o 2048*4096 each, k,v 2048*512 each,
# router 2048*128, experts 128*3*2048*768, 2 norms of 2048, q/k norms of 128 -> 623,120,640;
# x48 + final norm 2048 = 30,532,122,624 (the published 30.5B). A token multiplies 8 of the 128
# experts: 120*3*2048*768 per layer fewer, 3,353,032,704 (the published 3.3B active).
QWEN3_30B_A3B_PARAMS = 2 * 311_164_928 + 48 * 623_120_640 + 2048


def test_moe_weights_count_every_expert_and_compute_the_active_ones(tmp_path: Path, capsys) -> None:
    shape = P.model_shape_from_config(QWEN3_30B_A3B)
    params = P.count_params_from_architecture(shape)
    assert params.total == QWEN3_30B_A3B_PARAMS == 30_532_122_624
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_30B_A3B))
    rc, out, _ = run_cli(["--model", str(path), "--memory", "80GiB", "--json"], capsys)
    plan = json.loads(out)
    assert rc == 0 and plan["params"] == QWEN3_30B_A3B_PARAMS
    assert plan["active_params"] == QWEN3_30B_A3B_PARAMS - 48 * 120 * 3 * 2048 * 768 == 3_353_032_704
    assert plan["weight_bytes"] == 2 * QWEN3_30B_A3B_PARAMS  # bf16: all experts are resident
    # KV as for a dense model of the same attention: 48 layers x 2 x 4 KV heads x 128 x 2 bytes
    assert plan["kv_bytes_per_token"] == 48 * 2 * 4 * 128 * 2
    _, text, _ = run_cli(["--model", str(path), "--memory", "80GiB"], capsys)
    assert "active per token 3,353,032,704" in text and "8 of 128 experts in 48 MoE layers" in text


def test_pipeline_stages_report_their_own_memory(llama3_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(
        [
            "--model",
            str(llama3_config),
            "--memory",
            "24GiB",
            "--json",
            "--pipeline-parallel-size",
            "2",
            "--pp-layer-partition",
            "15,17",
        ],
        capsys,
    )
    assert rc == 0
    plan = json.loads(out)
    first, last = plan["stages"]
    assert (first["first_layer"], first["end_layer"], last["first_layer"], last["end_layer"]) == (0, 15, 15, 32)
    embedding, per_layer = 525_336_576, 218_112_000
    assert first["weight_bytes"] == 2 * (embedding + 15 * per_layer)
    assert last["weight_bytes"] == 2 * (embedding + 17 * per_layer + 4096)  # LM head and final norm
    assert first["kv_bytes_per_token"] == 15 * 4096 and last["kv_bytes_per_token"] == 17 * 4096
    memory = 24 * 2**30
    for stage in (first, last):
        assert stage["kv_memory_bytes"] == memory - memory // 10 - stage["weight_bytes"]
        assert stage["num_blocks"] == stage["kv_memory_bytes"] // (stage["kv_bytes_per_token"] * 16)
    assert plan["stage_pool_blocks"] == min(first["num_blocks"], last["num_blocks"])
    assert plan["stage_full_context_seqs"] == plan["stage_pool_blocks"] // 512
    rc, out, _ = run_cli(["--model", str(llama3_config), "--memory", "24GiB", "--pipeline-parallel-size", "2"], capsys)
    assert rc == 0 and "pipeline stages, each on its own 24.00 GiB device" in out and "0-15" in out


def test_pipeline_partition_errors_name_the_numbers(llama3_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(
        [
            "--model",
            str(llama3_config),
            "--memory",
            "24GiB",
            "--pipeline-parallel-size",
            "2",
            "--pp-layer-partition",
            "10,10",
        ],
        capsys,
    )
    assert rc == 2 and "pp_layer_partition 10,10 sums to 20 layers, the model has 32" in err
    rc, _, err = run_cli(["--model", str(llama3_config), "--memory", "24GiB", "--pipeline-parallel-size", "33"], capsys)
    assert rc == 2 and "pipeline_parallel_size 33 is larger than the model's 32 layers" in err


def test_plan_and_serve_agree_on_dtype_and_kv_pool(tmp_path) -> None:
    """`plan --models` counts each model as `serve` would run it here: the dtype serve resolves
    on this machine and the KV pool the engine allocates for the same flags."""
    from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig
    from pagoda.engine.engine_core import EngineCore

    for flags in (
        {},  # auto: both capped at what --max-num-seqs full-context sequences use (this model is small)
        {"kv_cache_memory": "8MiB"},
        {"num_kv_blocks": 40},
        {"kv_cache_memory": "8MiB", "kv_cache_dtype": "int8"},
    ):
        engine = EngineConfig(model=str(DEFAULT_MODEL_DIR), device="cpu", num_threads=1, **flags)
        need = P.model_need("m", 1, engine, engines=1)
        core = EngineCore(engine)
        assert need.dtype == P.normalize_dtype(str(core.dtype)) == "fp32"
        pool_bytes = (
            core.num_blocks
            * engine.block_size
            * P.kv_bytes_per_token(
                P.load_model(str(DEFAULT_MODEL_DIR))[0], P.serving_kv_dtype(engine.kv_cache_dtype, need.dtype)
            )
        )
        assert abs(need.kv_bytes - pool_bytes) <= pool_bytes / core.num_blocks, flags  # within one block


@pytest.mark.parametrize("flags", [{}, {"kv_cache_memory": "8MiB"}, {"kv_cache_memory": "8MiB", "context": 256}])
def test_plan_without_memory_is_what_serve_runs_here(flags) -> None:
    """`pagoda plan --model M` with no --memory: serve's dtype on this (CPU) machine, its KV dtype and
    the KV pool it allocates for the same flags (the blocks its banner prints)."""
    import torch

    from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig
    from pagoda.engine.engine_core import EngineCore

    if torch.cuda.is_available():
        pytest.skip("compares with serve on CPU")
    plan = P.plan_from_options(
        P.PlanOptions(
            model=str(DEFAULT_MODEL_DIR), kv_cache_memory=flags.get("kv_cache_memory"), context=flags.get("context")
        )
    )
    engine = EngineConfig(
        model=str(DEFAULT_MODEL_DIR),
        device="cpu",
        num_threads=1,
        kv_cache_memory=flags.get("kv_cache_memory", "auto"),
        max_model_len=flags.get("context"),
    )
    core = EngineCore(engine)
    assert plan.dtype == P.normalize_dtype(str(core.dtype)) == "fp32" and plan.kv_dtype == "fp32"
    assert plan.num_blocks == core.num_blocks and plan.context == core.max_model_len
    from pagoda.serve.launch import kv_pool_line  # the banner's line for these numbers

    assert kv_pool_line(engine, core.model_config, core.num_blocks, core.max_model_len) == (
        f"{plan.num_blocks} blocks x {plan.block_size} = {plan.num_blocks * plan.block_size} tokens "
        f"({plan.full_context_seqs} sequences at full context)"
    )


def test_a_vision_language_model_counts_its_image_tokens_and_encoder_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LLaVA-1.5-7B's shape: CLIP ViT-L at 336 px in 14 px patches, 576 image tokens; the
    encoder cache's 8192 default image tokens of 4096 bf16 values are 64 MiB."""
    text = {k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "model_type")}
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": 32000,
        "vision_feature_layer": -2,
        "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14, "hidden_size": 1024},
        "text_config": {**text, "model_type": "llama"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc, out, _ = run_cli(["--model", str(tmp_path), "--memory", "80GiB", "--json"], capsys)
    plan = json.loads(out)
    assert rc == 0 and plan["shape"]["image_tokens_per_image"] == 576
    assert plan["encoder_cache_tokens"] == 8192 and plan["encoder_cache_bytes"] == 8192 * 4096 * 2 == 64 * 2**20
    rc, out, _ = run_cli(["--model", str(tmp_path), "--memory", "80GiB"], capsys)
    assert "576 image tokens per image; encoder cache up to 64.00 MiB" in out
    # Without --memory: this machine's plan (an 8B model's float32 weights leave no free memory here
    # for the default share, so the pool is given).
    # Image tokens per request class: a class of two images a request adds 2 x 576 tokens to its prompts.
    rc, out, _ = run_cli(
        ["--model", str(tmp_path), "--memory", "80GiB", "--json", "--classes", "chat=p50:200/300,images:2"], capsys
    )
    (row,) = json.loads(out)["classes"]
    assert rc == 0 and row["p50_tokens"] == 200 + 2 * 576 + 300
    with pytest.raises(ValueError, match="images must be >= 0"):
        P.parse_request_class("chat=p50:200/300,images:-1")
    text_plan = json.loads(
        run_cli(["--model", str(tmp_path / "config.json"), "--kv-cache-memory", "1GiB", "--json"], capsys)[1]
    )
    assert text_plan["encoder_cache_bytes"] == 8192 * 4096 * P.DTYPE_BYTES[text_plan["dtype"]]
