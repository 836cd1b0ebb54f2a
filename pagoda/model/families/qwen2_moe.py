"""Qwen2-MoE: Qwen2's attention with sparse MoE blocks: `num_experts` experts of
`moe_intermediate_size`, renormalized when `norm_topk_prob`, in every `decoder_sparse_step`-th
layer but those of `mlp_only_layers` (dense MLPs of `intermediate_size`), plus a shared expert of
`shared_expert_intermediate_size` gated by a sigmoid. Qwen3-MoE reads its experts the same way.

Its GGUF files (`qwen2moe`) carry no `norm_topk_prob`: the routing weights are renormalized as
llama.cpp computes them for the architecture (not for Qwen2-MoE, yes for Qwen3-MoE).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagoda.model.families import qwen2
from pagoda.model.families.base import GGUFReading, ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe_config import MoEConfig, expert_routing
from pagoda.quant.gguf_checkpoint import DECODER_LAYER_TENSORS, GGUFCheckpoint, GGUFLayout
from pagoda.quant.gguf_moe import MOE_LAYER_TENSORS, read_experts

GGUF_LAYOUT = GGUFLayout({**DECODER_LAYER_TENSORS, **MOE_LAYER_TENSORS})


def qwen_experts(shared_expert: bool) -> Callable[[HFConfig, int], MoEConfig | None]:
    """The MoE reader of a Qwen-MoE config; shared_expert: the family has one."""

    def read(hf: HFConfig, num_layers: int) -> MoEConfig | None:
        routing = expert_routing(hf.values, hf.source)
        if routing is None:
            return None
        num_experts, top_k = routing
        intermediate_size = hf.required_int("moe_intermediate_size")
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = set(int(i) for i in hf.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        shared = int(hf.get("shared_expert_intermediate_size") or 0) if shared_expert else 0
        return MoEConfig(num_experts, top_k, intermediate_size, bool(hf.get("norm_topk_prob", False)), shared, sparse)

    return read


def read_config(hf: HFConfig) -> ModelConfig:
    return hf.decoder(**qwen2.attention_biases(hf), moe=qwen_experts(shared_expert=True))


def qwen_gguf_config(
    checkpoint: GGUFCheckpoint, architecture: str, model_type: str, renormalize: bool, shared_expert: bool
) -> dict[str, Any]:
    """The config of a Qwen-MoE GGUF: the decoder's keys and its experts'."""
    config = checkpoint.decoder_config(experts_may_stand_in=True)
    experts = read_experts(
        checkpoint.path, checkpoint.architecture, checkpoint.arch_value, checkpoint.tensors, config["num_hidden_layers"]
    )
    config.update(
        {
            "architectures": [architecture],
            "model_type": model_type,
            "num_experts": experts.num_experts,
            "num_experts_per_tok": experts.top_k,
            "moe_intermediate_size": experts.intermediate_size,
            "norm_topk_prob": renormalize,
            "mlp_only_layers": [i for i, sparse in enumerate(experts.sparse_layers) if not sparse],
        }
    )
    if experts.shared_intermediate_size is not None:
        if not shared_expert:
            raise ValueError(
                f"{checkpoint.path}: shared-expert tensors (ffn_*_shexp) in a {checkpoint.architecture} "
                f"GGUF; only qwen2moe has a shared expert"
            )
        config["shared_expert_intermediate_size"] = experts.shared_intermediate_size
    return config


def gguf_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    config = qwen_gguf_config(checkpoint, "Qwen2MoeForCausalLM", "qwen2_moe", renormalize=False, shared_expert=True)
    config["qkv_bias"] = "blk.0.attn_q.bias" in checkpoint.tensors
    return config


FAMILY = ModelFamily(read_config=read_config, gguf=GGUFReading(GGUF_LAYOUT, gguf_config))
