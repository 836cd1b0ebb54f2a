"""Mixture-of-experts GGUF files as llama.cpp's convert_hf_to_gguf.py writes them.

Mixtral is the `llama` architecture with `llama.expert_count` / `expert_used_count` (its
`feed_forward_length` is the experts'); Qwen2-MoE and Qwen3-MoE are `qwen2moe` / `qwen3moe` with
`expert_feed_forward_length` (and Qwen2-MoE's `expert_shared_feed_forward_length`). A MoE layer
holds its router `ffn_gate_inp` [E, H] and each projection of all its experts stacked in one
tensor: `ffn_gate_exps` / `ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I] (or gate and up
fused, `ffn_gate_up_exps` [E, 2I, H], gate rows first); Qwen2-MoE adds the shared expert
`ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp`. A layer with the dense
`ffn_gate`/`ffn_up`/`ffn_down` and no router is a dense layer (Qwen's `mlp_only_layers`).

GGUF carries no `norm_topk_prob`: the routing weights are renormalized as llama.cpp computes
them for the architecture (Mixtral and Qwen3-MoE yes, Qwen2-MoE no).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

# GGUF `general.architecture` of the MoE-only architectures -> transformers architecture.
MOE_GGUF_ARCHITECTURES = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
_RENORMALIZE = {"llama": True, "qwen2moe": False, "qwen3moe": True}
# Per-layer MoE tensors that are not stacked over experts, by their HF names (pagoda's).
MOE_LAYER_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Stacked experts [E, out, in] -> the projection(s) each expert's slice holds, in row order.
STACKED_EXPERT_TENSORS = {
    "ffn_gate_exps": ("gate_proj",),
    "ffn_up_exps": ("up_proj",),
    "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}
_SHARED_EXPERT_KINDS = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


def expert_tensor_kind(name: str) -> str | None:
    """`ffn_gate_exps` etc. for a stacked expert tensor's GGUF name, else None."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in STACKED_EXPERT_TENSORS:
        return parts[2]
    return None


def is_moe_gguf(architecture: str, arch_value: Callable[[str], Any]) -> bool:
    return architecture in MOE_GGUF_ARCHITECTURES or (architecture == "llama" and bool(arch_value("expert_count")))


def moe_hf_config(path: Path, architecture: str, arch_value: Callable[[str], Any], tensors: dict[str, Any],
                  num_layers: int) -> dict[str, Any]:
    """The MoE keys of a transformers config for a MoE GGUF (architecture included); ValueError
    naming the file for missing metadata or a MoE layer missing a tensor."""
    num_experts = arch_value("expert_count")
    top_k = arch_value("expert_used_count")
    for key, value in (("expert_count", num_experts), ("expert_used_count", top_k)):
        if not value:
            raise ValueError(f"{path}: missing metadata {architecture}.{key} (a MoE GGUF needs it)")
    num_experts, top_k = int(num_experts), int(top_k)
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in tensors or f"blk.{i}.ffn_gate.weight" not in tensors
              for i in range(num_layers)]
    shared = any(f"blk.{i}.{kind}.weight" in tensors for i in range(num_layers) for kind in _SHARED_EXPERT_KINDS)
    for layer in (i for i in range(num_layers) if sparse[i]):
        _check_layer(path, tensors, layer, num_experts, shared)
    if architecture == "llama":
        if not all(sparse):
            raise ValueError(f"{path}: layer {sparse.index(False)} has no router (blk.N.ffn_gate_inp); "
                             f"Mixtral GGUFs have experts in every layer")
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": num_experts,
                "num_experts_per_tok": top_k}
    first = sparse.index(True) if any(sparse) else 0
    config: dict[str, Any] = {
        "architectures": [MOE_GGUF_ARCHITECTURES[architecture]],
        "model_type": _MODEL_TYPES[architecture],
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(arch_value("expert_feed_forward_length")
                                     or _rows(tensors, f"blk.{first}.ffn_down_exps.weight", -1)),
        "norm_topk_prob": _RENORMALIZE[architecture],
        "mlp_only_layers": [i for i in range(num_layers) if not sparse[i]],
    }
    if shared:
        if architecture != "qwen2moe":
            raise ValueError(f"{path}: shared-expert tensors (ffn_*_shexp) in a {architecture} GGUF; only "
                             f"qwen2moe has a shared expert")
        config["shared_expert_intermediate_size"] = int(arch_value("expert_shared_feed_forward_length")
                                                        or _rows(tensors, f"blk.{first}.ffn_down_shexp.weight", -1))
    return config


def _check_layer(path: Path, tensors: dict[str, Any], layer: int, num_experts: int, shared: bool) -> None:
    prefix = f"blk.{layer}."
    fused = prefix + "ffn_gate_up_exps.weight" in tensors
    kinds = ["ffn_gate_inp", "ffn_down_exps"] + (["ffn_gate_up_exps"] if fused else ["ffn_gate_exps", "ffn_up_exps"])
    if shared:
        kinds += list(_SHARED_EXPERT_KINDS)
    missing = [f"{prefix}{kind}.weight" for kind in kinds if f"{prefix}{kind}.weight" not in tensors]
    if missing:
        raise ValueError(f"{path}: MoE layer {layer} is missing tensor(s) {', '.join(missing)}")
    for kind in kinds:
        if kind in STACKED_EXPERT_TENSORS:
            name = f"{prefix}{kind}.weight"
            stacked = _rows(tensors, name, 0)
            if stacked != num_experts:
                raise ValueError(f"{path}: tensor {name!r} stacks {stacked} experts, the metadata says "
                                 f"expert_count {num_experts}")


def _rows(tensors: dict[str, Any], name: str, dim: int) -> int:
    """A tensor's size along `dim` in HF order (GGUF lists the fastest dimension first)."""
    return int(list(reversed([int(d) for d in tensors[name].shape]))[dim])
