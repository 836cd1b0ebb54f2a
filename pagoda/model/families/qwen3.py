"""Qwen3: Qwen2's decoder without its always-on q/k/v biases (the config's `attention_bias`
decides), with an RMSNorm over each query and key head before the rotation."""

from __future__ import annotations

from typing import Any

from pagoda.model.families.base import GGUFReading, ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.quant.gguf_checkpoint import GGUFCheckpoint, GGUFLayout


def read_config(hf: HFConfig) -> ModelConfig:
    return hf.decoder(qk_norm=True)


def gguf_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    return {**checkpoint.decoder_config(), "architectures": ["Qwen3ForCausalLM"]}


FAMILY = ModelFamily(read_config=read_config, gguf=GGUFReading(GGUFLayout(), gguf_config))
