"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention (pagoda.model.gated_delta_net) in three
of every four layers (`layer_types`) and gated full attention in the fourth: an output gate per
head from q_proj, q/k norms, rotary over a quarter of each head (`partial_rotary_factor`). Its
RMSNorms scale by (1 + w). Qwen2-MoE's experts with the gated shared expert (every
`decoder_sparse_step`-th layer but `mlp_only_layers`), top-k renormalized by `norm_topk_prob`."""

from __future__ import annotations

from dataclasses import replace

from pagoda.model.families.base import ModelFamily
from pagoda.model.families.qwen2_moe import qwen_experts
from pagoda.model.hf_config import HFConfig
from pagoda.model.linear_attention_config import read_linear_attention
from pagoda.model.model_config import ModelConfig


def hybrid_config(hf: HFConfig, config: ModelConfig, projection: str) -> ModelConfig:
    """A Qwen hybrid's traits over its decoder config: the linear-attention layers (their
    projections laid out `projection`), the gated attention and the zero-centered norms."""
    return replace(
        config,
        linear_attention=read_linear_attention(hf.values, hf.source, projection),
        attention_output_gate=True,
        zero_centered_norms=True,
    )


def read_config(hf: HFConfig) -> ModelConfig:
    decoder = hf.decoder(qk_norm=True, partial_rotary=True, moe=qwen_experts(shared_expert=True))
    return hybrid_config(hf, decoder, "grouped")


FAMILY = ModelFamily(read_config=read_config)
