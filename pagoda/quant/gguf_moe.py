"""Mixture-of-experts GGUF files as llama.cpp's convert_hf_to_gguf.py writes them.

An architecture's metadata names its experts `expert_count` / `expert_used_count` and, where
they differ from `feed_forward_length`, their size `expert_feed_forward_length` (and a shared
expert's, `expert_shared_feed_forward_length`). A MoE layer holds its router `ffn_gate_inp`
[E, H] and each projection of all its experts stacked in one tensor: `ffn_gate_exps` /
`ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I] (or gate and up fused, `ffn_gate_up_exps`
[E, 2I, H], gate rows first); a shared expert adds `ffn_{gate,up,down}_shexp` and its gate
`ffn_gate_inp_shexp`. A layer with the dense `ffn_gate`/`ffn_up`/`ffn_down` and no router is a
dense layer (Qwen's `mlp_only_layers`). Which architectures have experts, and what their
transformers config is, is each family's (pagoda.model.families).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class GGUFExperts:
    """What a MoE GGUF's metadata and tensors say of its experts."""

    num_experts: int
    top_k: int
    sparse_layers: list[bool]  # per layer: a router and experts (True) or a dense MLP
    intermediate_size: int | None  # of each expert; None without a MoE layer
    shared_intermediate_size: int | None  # of the shared expert; None without one


def read_experts(
    path: Path, architecture: str, arch_value: Callable[[str], Any], tensors: dict[str, Any], num_layers: int
) -> GGUFExperts:
    """ValueError naming the file for missing metadata or a MoE layer missing a tensor."""
    num_experts = arch_value("expert_count")
    top_k = arch_value("expert_used_count")
    for key, value in (("expert_count", num_experts), ("expert_used_count", top_k)):
        if not value:
            raise ValueError(f"{path}: missing metadata {architecture}.{key} (a MoE GGUF needs it)")
    num_experts, top_k = int(num_experts), int(top_k)
    sparse = [
        f"blk.{i}.ffn_gate_inp.weight" in tensors or f"blk.{i}.ffn_gate.weight" not in tensors
        for i in range(num_layers)
    ]
    shared = any(f"blk.{i}.{kind}.weight" in tensors for i in range(num_layers) for kind in _SHARED_EXPERT_KINDS)
    for layer in (i for i in range(num_layers) if sparse[i]):
        _check_layer(path, tensors, layer, num_experts, shared)
    first = sparse.index(True) if any(sparse) else None
    intermediate_size = (
        None
        if first is None
        else int(arch_value("expert_feed_forward_length") or _rows(tensors, f"blk.{first}.ffn_down_exps.weight", -1))
    )
    shared_size = None
    if shared:
        shared_size = int(
            arch_value("expert_shared_feed_forward_length")
            or _rows(tensors, f"blk.{first or 0}.ffn_down_shexp.weight", -1)
        )
    return GGUFExperts(num_experts, top_k, sparse, intermediate_size, shared_size)


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
                raise ValueError(
                    f"{path}: tensor {name!r} stacks {stacked} experts, the metadata says expert_count {num_experts}"
                )


def _rows(tensors: dict[str, Any], name: str, dim: int) -> int:
    """A tensor's size along `dim` in HF order (GGUF lists the fastest dimension first)."""
    return int(list(reversed([int(d) for d in tensors[name].shape]))[dim])
