"""MoEConfig: the mixture-of-experts part of a model's config: router, experts and which
layers have them. Each MoE family (pagoda.model.families) reads its own keys into it; the keys
they share, the expert count and the experts per token, are read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each routed expert
    # Routing weights of the chosen experts divided by their sum (Mixtral always; Qwen: norm_topk_prob).
    renormalize: bool
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen2-MoE has one, gated by a sigmoid)
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block (True) or a dense MLP of intermediate_size
    # gpt-oss: the router has a bias and its softmax runs over the chosen experts' logits only.
    router_bias: bool = False
    softmax_over_top_k: bool = False
    expert_bias: bool = False  # the experts' gate/up and down projections have biases
    # The clamped SwiGLU (gpt-oss) in place of act(gate) * up: (clamp(up) + 1) * g * sigmoid(alpha * g)
    # with g = gate clamped above at `swiglu_limit` (None: the model's plain gated activation).
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # DeepSeek-V3 / GLM-4.5 (pagoda.kernels.moe.SigmoidRouting): sigmoid scores, the choice
    # steered by a learned correction bias (`e_score_correction_bias`) within the `top_k_groups`
    # best of `num_groups` groups of experts, the chosen weights multiplied by `routed_scaling_factor`.
    sigmoid_routing: bool = False
    num_groups: int = 1
    top_k_groups: int = 1
    routed_scaling_factor: float = 1.0
    # The shared expert's output scaled by sigmoid(`shared_expert_gate`(x)) (Qwen2-MoE); False:
    # added as it is (DeepSeek's shared experts, Granite's shared MLP).
    shared_expert_gated: bool = True

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


def expert_routing(config: dict[str, Any], source: str) -> tuple[int, int] | None:
    """(experts, experts per token) from `num_experts` or `num_local_experts` (transformers 5
    writes Qwen3-MoE's count as the latter) and `num_experts_per_tok`; None for a config without
    experts; ValueError for a router that cannot route."""
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if num_experts == 0:
        return None
    top_k = int(config.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{source}: num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})"
        )
    return num_experts, top_k
