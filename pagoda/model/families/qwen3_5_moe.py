"""Qwen3.5-MoE (text): Qwen3.5's hybrid layers (pagoda.model.families.qwen3_5) with a sparse MoE
block in every layer: routed experts, always renormalized over the top k, plus the gated shared
expert. Its configs name no dense `intermediate_size`."""

from __future__ import annotations

from dataclasses import replace

from pagoda.model.families.base import ModelFamily
from pagoda.model.families.qwen2_moe import qwen_experts
from pagoda.model.families.qwen3_next import hybrid_config
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig


def read_config(hf: HFConfig) -> ModelConfig:
    values = {"intermediate_size": hf.get("moe_intermediate_size"), **hf.values, "norm_topk_prob": True}
    hf = replace(hf, values={k: v for k, v in values.items() if k != "mlp_only_layers"})
    return hybrid_config(
        hf, hf.decoder(qk_norm=True, partial_rotary=True, moe=qwen_experts(shared_expert=True)), "separate"
    )


FAMILY = ModelFamily(read_config=read_config)
