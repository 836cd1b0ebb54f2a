"""Llama (2, 3 and their rope scalings): the shared decoder as it is, biases where the config
says so.

Its GGUF files (`llama`) hold llama.cpp's permuted q/k rows, and a bias only when the file has
one. llama.cpp writes Mixtral as `llama` with experts (`llama.expert_count`): such a file is read
as a Mixtral (pagoda.model.families.mixtral).
"""

from __future__ import annotations

from typing import Any

from pagoda.model.families import mixtral
from pagoda.model.families.base import GGUFReading, ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.quant.gguf_checkpoint import DECODER_LAYER_TENSORS, GGUFCheckpoint, GGUFLayout
from pagoda.quant.gguf_moe import MOE_LAYER_TENSORS


def read_config(hf: HFConfig) -> ModelConfig:
    return hf.decoder()


def gguf_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    config = checkpoint.decoder_config()
    config["architectures"] = ["LlamaForCausalLM"]
    config["attention_bias"] = "blk.0.attn_q.bias" in checkpoint.tensors
    if checkpoint.arch_value("expert_count"):
        config = mixtral.with_gguf_experts(checkpoint, config)
    return config


FAMILY = ModelFamily(
    read_config=read_config,
    gguf=GGUFReading(GGUFLayout({**DECODER_LAYER_TENSORS, **MOE_LAYER_TENSORS}, permuted_qk=True), gguf_config),
)
