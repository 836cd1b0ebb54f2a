"""MoEConfig: the mixture-of-experts part of a model's config (Mixtral, Qwen2-MoE, Qwen3-MoE,
gpt-oss).

Read from the keys the Hub configs and transformers write: Mixtral's `num_local_experts` (its
`intermediate_size` is the experts'), Qwen's `num_experts`, `moe_intermediate_size`,
`shared_expert_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step` and
`mlp_only_layers` (transformers 5 writes Qwen3-MoE's expert count as `num_local_experts`);
gpt-oss's `num_local_experts` (its `intermediate_size` is the experts'), `swiglu_alpha` and
`swiglu_limit`, with its router and experts biased.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")


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

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    @classmethod
    def from_hf(cls, config: dict[str, Any], architecture: str, num_layers: int, source: str) -> "MoEConfig | None":
        """None for a dense model; ValueError for a router that cannot route."""
        num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        if architecture not in MOE_ARCHITECTURES or num_experts == 0:
            return None
        top_k = int(config.get("num_experts_per_tok") or 0)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{source}: num_experts_per_tok ({top_k}) must be between 1 and the number of "
                             f"experts ({num_experts})")
        if architecture == "MixtralForCausalLM":
            return cls(num_experts, top_k, int(config["intermediate_size"]), True, 0, (True,) * num_layers)
        if architecture == "GptOssForCausalLM":
            return cls(num_experts, top_k, int(config["intermediate_size"]), True, 0, (True,) * num_layers,
                       router_bias=True, softmax_over_top_k=True, expert_bias=True,
                       swiglu_limit=float(config.get("swiglu_limit") or 7.0),
                       swiglu_alpha=float(config.get("swiglu_alpha") or 1.702))
        try:
            intermediate_size = int(config["moe_intermediate_size"])
        except KeyError:
            raise ValueError(f"{source}: missing required key 'moe_intermediate_size'") from None
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(int(i) for i in config.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        shared = int(config.get("shared_expert_intermediate_size") or 0) if architecture == "Qwen2MoeForCausalLM" else 0
        return cls(num_experts, top_k, intermediate_size, bool(config.get("norm_topk_prob", False)), shared, sparse)
