"""Qwen3.5 (text): Qwen3-Next's hybrid layers (pagoda.model.families.qwen3_next) with a dense MLP
in every layer, and the Gated DeltaNet input projections in four tensors (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a). The text model's multimodal rotary reduces to the plain one over a
quarter of each head when every position id is the text's."""

from __future__ import annotations

from pagoda.model.families.base import ModelFamily
from pagoda.model.families.qwen3_next import hybrid_config
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig


def read_config(hf: HFConfig) -> ModelConfig:
    return hybrid_config(hf, hf.decoder(qk_norm=True, partial_rotary=True), "separate")


FAMILY = ModelFamily(read_config=read_config)
