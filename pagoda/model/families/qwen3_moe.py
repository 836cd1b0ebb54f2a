"""Qwen3-MoE: Qwen3's attention (q/k norms) with Qwen2-MoE's experts, without a shared expert."""

from __future__ import annotations

from typing import Any

from pagoda.model.families.base import GGUFReading, ModelFamily
from pagoda.model.families.qwen2_moe import GGUF_LAYOUT, qwen_experts, qwen_gguf_config
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.quant.gguf_checkpoint import GGUFCheckpoint


def read_config(hf: HFConfig) -> ModelConfig:
    return hf.decoder(qk_norm=True, moe=qwen_experts(shared_expert=False))


def gguf_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    return qwen_gguf_config(checkpoint, "Qwen3MoeForCausalLM", "qwen3_moe", renormalize=True, shared_expert=False)


FAMILY = ModelFamily(read_config=read_config, gguf=GGUFReading(GGUF_LAYOUT, gguf_config))
