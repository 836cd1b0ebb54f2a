"""GLM-4.5 / 4.6 MoE (`glm4_moe`): the shared attention with partial rotary (the first
`partial_rotary_factor` of each head's dims, 0.5 by default) and optional q/k norms
(`use_qk_norm`), q/k/v biases per `attention_bias` (never on o_proj), and DeepSeek's experts:
the sigmoid router with its correction bias and groups, routed scaling, ungated shared experts,
dense layers before `first_k_dense_replace` (pagoda.model.families.deepseek_v3).
"""

from __future__ import annotations

from pagoda.model.families.base import ModelFamily
from pagoda.model.families.deepseek_v3 import MOE_RENAMES, renaming, sigmoid_routed_experts
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig

# transformers defaults GLM-4.5 MoE's partial rotary to half the head when the config names none.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def read_config(hf: HFConfig) -> ModelConfig:
    values = hf.values
    rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
    if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in values:
        hf = HFConfig(
            {**values, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR},
            hf.source,
            hf.architecture,
            hf.require_supported,
        )
    return hf.decoder(
        o_bias=False, qk_norm=bool(hf.get("use_qk_norm")), moe=sigmoid_routed_experts, partial_rotary=True
    )


_tensors, _names = renaming(MOE_RENAMES)
FAMILY = ModelFamily(read_config=read_config, checkpoint_tensors=_tensors, checkpoint_names=_names)
