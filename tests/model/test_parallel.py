"""Tensor-parallel shards, without processes: each rank's model is built and loaded alone and
its layers' effective weights (the layer applied to an identity) compared with the matching
slice of the whole model's. Collectives are never called here (the group's backend is a
placeholder); tests/executor runs the ranks together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_factory import build_model
from pagoda.model.loader import build_empty_model, load_model, load_model_config
from pagoda.model.parallel import TensorParallelGroup
from pagoda.quant.weight_formats import make_weight_format

CPU = torch.device("cpu")


def rank_group(rank: int, world_size: int) -> TensorParallelGroup:
    return TensorParallelGroup(rank, world_size, backend=object())  # no collective is run


def effective(layer: torch.nn.Module) -> torch.Tensor:
    """The weight the layer multiplies by [out, in], without bias or all-reduce."""
    return layer.kernels.linear(layer, torch.eye(layer.in_features), None).t()


def load(model_dir: Path, quantization: str = "none", group: TensorParallelGroup | None = None):
    return load_model(
        model_dir, load_model_config(model_dir), torch.float32, CPU, make_weight_format(quantization, 32), group
    )


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_each_rank_holds_its_slice_of_every_projection(llama_dir: Path, quantization: str) -> None:
    whole = load(llama_dir, quantization)
    config = whole.config
    head_dim, q_size = config.head_dim, config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * head_dim
    full_qkv = effective(whole.model.layers[1].self_attn.qkv_proj)
    full_gate_up = effective(whole.model.layers[0].mlp.gate_up_proj)
    reference_down = whole.model.layers[0].mlp.down_proj
    for rank in range(2):
        part = load(llama_dir, quantization, rank_group(rank, 2))
        attention = part.model.layers[1].self_attn
        assert (attention.num_heads, attention.num_kv_heads, part.num_kv_heads) == (2, 1, 1)
        q = slice(rank * q_size // 2, (rank + 1) * q_size // 2)
        kv = slice(q_size + rank * kv_size // 2, q_size + (rank + 1) * kv_size // 2)
        v = slice(kv.start + kv_size, kv.stop + kv_size)
        # Column parallel: rows are quantized one by one (int8 per row, int4 groups along the
        # input), so a rank's rows equal the whole layer's.
        expected_qkv = torch.cat([full_qkv[q], full_qkv[kv], full_qkv[v]])
        torch.testing.assert_close(effective(attention.qkv_proj), expected_qkv, rtol=0, atol=0)
        half = config.intermediate_size // 2
        rows = slice(rank * half, (rank + 1) * half)
        expected_gate_up = torch.cat([full_gate_up[rows], full_gate_up[config.intermediate_size :][rows]])
        torch.testing.assert_close(effective(part.model.layers[0].mlp.gate_up_proj), expected_gate_up, rtol=0, atol=0)
        # Row parallel: the rank's input columns; int4 groups fall inside them, so they match
        # exactly; int8 scales are per row of the rank's slice (a little finer than the whole's).
        down = part.model.layers[0].mlp.down_proj
        assert down.reduce is not None and down.in_features == half
        expected_down = effective(reference_down)[:, rows]
        tolerance = {"rtol": 0.05, "atol": 0.01} if quantization == "int8" else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(effective(down), expected_down, **tolerance)
        # Vocabulary parallel embedding and LM head.
        vocab = -(-config.vocab_size // 2)
        stop = min((rank + 1) * vocab, config.vocab_size)
        torch.testing.assert_close(
            part.model.embed_tokens.weight[: stop - rank * vocab], whole.model.embed_tokens.weight[rank * vocab : stop]
        )
        torch.testing.assert_close(
            effective(part.lm_head)[: stop - rank * vocab], effective(whole.lm_head)[rank * vocab : stop]
        )


def test_fewer_kv_heads_than_ranks_replicates_them(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "mqa", "qwen2", num_key_value_heads=1)  # q/k/v bias too
    whole = load(model_dir)
    head_dim = whole.config.head_dim
    q_size = whole.config.num_heads * head_dim
    full = whole.model.layers[0].self_attn.qkv_proj
    for rank in range(2):
        attention = load(model_dir, group=rank_group(rank, 2)).model.layers[0].self_attn
        assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
        # Every rank keeps the single KV head (rows q_size .. q_size + 2 * head_dim), bias included.
        torch.testing.assert_close(effective(attention.qkv_proj)[q_size // 2 :], effective(full)[q_size:])
        torch.testing.assert_close(attention.qkv_proj.bias[q_size // 2 :], full.bias[q_size:])
        torch.testing.assert_close(
            attention.qkv_proj.bias[: q_size // 2], full.bias[rank * q_size // 2 : (rank + 1) * q_size // 2]
        )
        # Row-parallel o_proj keeps its whole bias (added once, after the all-reduce).
        assert attention.o_proj.bias is None or attention.o_proj.bias.shape[0] == whole.config.hidden_size


def test_gptq_int4_codes_are_sliced_by_rows_and_groups(llama_dir: Path, tmp_path: Path) -> None:
    from quant.test_quant_gptq import write_gptq

    target = tmp_path / "gptq"
    dequantized = write_gptq(llama_dir, target)
    config = load_model_config(target)
    half = config.intermediate_size // 2
    for rank in range(2):
        model = load_model(target, config, torch.float32, CPU, None, rank_group(rank, 2))
        down = model.model.layers[0].mlp.down_proj
        expected = dequantized["model.layers.0.mlp.down_proj.weight"][:, rank * half : (rank + 1) * half]
        torch.testing.assert_close(effective(down), expected, rtol=2e-2, atol=2e-3)


def test_splits_that_do_not_fit_are_startup_errors(llama_dir: Path) -> None:
    config = load_model_config(llama_dir)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        build_empty_model(config, torch.float32, CPU, None, "tiny", rank_group(0, 3))
    # int4 groups of 64 fit the whole o_proj input (64) but not a rank's half of it.
    int4 = make_weight_format("int4", 64)
    build_empty_model(config, torch.float32, CPU, int4, "tiny")
    with pytest.raises(
        ValueError,
        match="o_proj: int4 group size 64 does not divide its input dimension 32.*"
        "this rank's slice with tensor_parallel_size 2",
    ):
        build_empty_model(config, torch.float32, CPU, int4, "tiny", rank_group(0, 2))
