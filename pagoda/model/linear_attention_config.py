"""The shape of a hybrid model's recurrent layers, which of its layers they are, and the state one
sequence keeps in each: a short convolution's window and a recurrent state, fixed in size
whatever the sequence's length (pagoda.core.state_slots holds them). `LinearAttentionConfig`:
Gated DeltaNet (pagoda.model.gated_delta_net); `Mamba2Config`: Mamba2 (pagoda.model.mamba2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LINEAR_ATTENTION = "linear_attention"
# The recurrent state is kept in float32 whatever the model's dtype (as transformers computes it).
RECURRENT_STATE_BYTES = 4


@dataclass(frozen=True)
class LinearAttentionConfig:
    layers: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or full attention (False)
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int
    # How the input projection lays out q, k, v, z and b, a: "grouped" per key head in two fused
    # tensors (Qwen3-Next's in_proj_qkvz, in_proj_ba), or "separate" (Qwen3.5's in_proj_qkv,
    # in_proj_z, in_proj_b, in_proj_a, which the loader fuses in that order).
    projection: str = "grouped"

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        """One sequence's delta-rule state in one layer: [Hv, Dk, Dv]."""
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    @property
    def num_linear_layers(self) -> int:
        return sum(self.layers)

    def state_bytes(self, element_bytes: int) -> int:
        """One sequence's state over every linear-attention layer."""
        return state_bytes(self, element_bytes)


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 layers (Granite 4.0-H): `intermediate_size` = num_heads * head_dim channels, the
    SSM state of `state_size` per head, B and C shared by the heads of each of `num_groups`."""

    layers: tuple[bool, ...]  # per layer: Mamba2 (True) or attention (False)
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int
    conv_kernel_size: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # The gated norm of the scan's output y with the gate z: "after_gate" norm(y * silu(z))
    # (Granite, Nemotron-H), "before_gate" norm(y) * silu(z), "none" y * silu(z) (Falcon-H1's choices).
    gated_norm: str = "after_gate"
    # Falcon-H1's muP: the input scaled before in_proj, and its output's z, x, B, C and dt parts each
    # by their own multiplier (None: not scaled).
    in_multiplier: float | None = None
    projection_multipliers: tuple[float, float, float, float, float] | None = None

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: x, B and C side by side."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        """One sequence's SSM state in one layer: [H, P, N]."""
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def num_linear_layers(self) -> int:
        return sum(self.layers)

    def state_bytes(self, element_bytes: int) -> int:
        return state_bytes(self, element_bytes)


RecurrentLayers = LinearAttentionConfig | Mamba2Config


def state_bytes(config: RecurrentLayers, element_bytes: int) -> int:
    """One sequence's state over every recurrent layer: the convolution windows (model dtype)
    and the recurrent states (float32)."""
    window = config.conv_dim * (config.conv_kernel_size - 1) * element_bytes
    recurrent = RECURRENT_STATE_BYTES
    for size in config.recurrent_shape:
        recurrent *= size
    return config.num_linear_layers * (window + recurrent)


def read_linear_attention(values: dict[str, Any], source: str, projection: str) -> LinearAttentionConfig | None:
    """From a config's `layer_types` and `linear_*` keys (transformers' Qwen3-Next and Qwen3.5);
    None when no layer is a linear-attention one."""
    num_layers = int(values["num_hidden_layers"])
    layer_types = values.get("layer_types")
    if layer_types is None:  # transformers' default: every fourth layer attends in full
        interval = int(values.get("full_attention_interval") or 4)
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"{source}: layer_types names {len(layer_types)} layers, num_hidden_layers {num_layers}")
    layers = tuple(t == LINEAR_ATTENTION for t in layer_types)
    if not any(layers):
        return None
    config = LinearAttentionConfig(
        layers=layers,
        num_key_heads=int(values.get("linear_num_key_heads") or 16),
        num_value_heads=int(values.get("linear_num_value_heads") or 32),
        key_head_dim=int(values.get("linear_key_head_dim") or 128),
        value_head_dim=int(values.get("linear_value_head_dim") or 128),
        conv_kernel_size=int(values.get("linear_conv_kernel_dim") or 4),
        projection=projection,
    )
    if config.num_value_heads % config.num_key_heads:
        raise ValueError(
            f"{source}: linear_num_value_heads ({config.num_value_heads}) is not a multiple of "
            f"linear_num_key_heads ({config.num_key_heads})"
        )
    return config
