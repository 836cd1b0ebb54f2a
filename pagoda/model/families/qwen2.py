"""Qwen2: the shared decoder with q/k/v biases (always, unless a config's `qkv_bias` says
otherwise; Qwen2-MoE names it so) and none on the output projection; layers from
`max_window_layers` on slide when `use_sliding_window` is set (the shared reading's rule)."""

from __future__ import annotations

from typing import Any, TypedDict

from pagoda.model.families.base import GGUFReading, ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.quant.gguf_checkpoint import GGUFCheckpoint, GGUFLayout


class AttentionBiases(TypedDict):
    qkv_bias: bool
    o_bias: bool


def attention_biases(hf: HFConfig) -> AttentionBiases:
    """Qwen2's q/k/v and output biases, as `HFConfig.decoder` takes them."""
    return {"qkv_bias": bool(hf.get("qkv_bias", True)), "o_bias": False}


def read_config(hf: HFConfig) -> ModelConfig:
    return hf.decoder(**attention_biases(hf))


def gguf_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    return {**checkpoint.decoder_config(), "architectures": ["Qwen2ForCausalLM"]}


FAMILY = ModelFamily(read_config=read_config, gguf=GGUFReading(GGUFLayout(), gguf_config))
