"""Reading a Hugging Face `config.json` into a ModelConfig: the keys every decoder shares.

Accepts both the keys of checkpoints in the wild (`torch_dtype`, top-level `rope_theta`,
`rope_scaling`) and those transformers 5 writes (`dtype`, `rope_parameters`, and one rope per
layer type). A family's reader (pagoda.model.families) calls `HFConfig.decoder` with what is its
own: biases, q/k norms, Gemma-style norms, how its layers slide, its mixture of experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.model.model_config import ModelConfig, as_id_list
from pagoda.model.moe_config import MoEConfig

# Rope types pagoda computes (pagoda.model.rope); `su` is LongRoPE's older name.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su", "yarn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")

# Per layer: its sliding window or None, for a config that names no `layer_types`.
SlidingWindows = Callable[["HFConfig", int, int], list[int | None]]  # (config, window, num_layers)


def windows_from_max_window_layers(hf: HFConfig, window: int, num_layers: int) -> list[int | None]:
    """transformers' `use_sliding_window`: layers from `max_window_layers` on use the window."""
    if not hf.get("use_sliding_window"):
        return [None] * num_layers
    first = int(hf.get("max_window_layers", num_layers))
    return [window if i >= first else None for i in range(num_layers)]


def window_on_every_layer(hf: HFConfig, window: int, num_layers: int) -> list[int | None]:
    return [window] * num_layers


@dataclass(frozen=True)
class HFConfig:
    """One config.json being read: its keys (a multimodal wrapper's `text_config` already merged
    in), where it came from (for error messages), the architecture it is read as, and whether
    anything pagoda cannot run is an error (False: `pagoda plan` reads any Llama-like shape)."""

    values: dict[str, Any]
    source: str
    architecture: str
    require_supported: bool = True

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    @property
    def model_type(self) -> str:
        return str(self.values.get("model_type", ""))

    def required_int(self, key: str) -> int:
        try:
            return int(self.values[key])
        except KeyError:
            raise ValueError(f"{self.source}: missing required key {key!r}") from None

    def decoder(
        self,
        *,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        qk_norm: bool = False,
        sliding_windows: SlidingWindows = windows_from_max_window_layers,
        gemma_norms: bool = False,
        tie_word_embeddings: bool = False,
        scale_embeddings: bool = False,
        default_rope_theta: float = 10000.0,
        default_sliding_rope_theta: float | None = None,
        moe: Callable[[HFConfig, int], MoEConfig | None] | None = None,
        attention_sinks: bool = False,
        partial_rotary: bool = False,
    ) -> ModelConfig:
        """The ModelConfig of a decoder with these family traits. qkv_bias / o_bias None: the
        config's `attention_bias`; tie_word_embeddings: the default when the config names none;
        scale_embeddings: embeddings multiplied by sqrt(hidden_size); default_rope_theta: where
        the config names no base; default_sliding_rope_theta: the sliding layers' own base where
        the config gives no rope per layer type (None: they use the global rope); moe: reads the
        experts (None: dense); partial_rotary: the family rotates part of each head
        (`partial_rotary_factor`)."""
        config, source = self.values, self.source
        hidden_size = self.required_int("hidden_size")
        num_heads = self.required_int("num_attention_heads")
        num_layers = self.required_int("num_hidden_layers")
        vocab_size = self.required_int("vocab_size")
        intermediate_size = self.required_int("intermediate_size")
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_dim = int(config.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            )

        rope, sliding_rope_theta, sliding_rope_scaling = self._layer_type_ropes(default_sliding_rope_theta)
        rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or default_rope_theta)
        rope_scaling = self._rope_scaling(rope)
        if self.require_supported and config.get("use_bidirectional_attention"):
            raise ValueError(f"{source}: bidirectional attention (an embedding model) is not supported")
        partial_rotary_factor = float(rope.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0)
        if self.require_supported and partial_rotary_factor != 1.0 and not partial_rotary:
            raise ValueError(
                f"{source}: partial_rotary_factor {partial_rotary_factor} is not supported "
                "(rope over the whole head only)"
            )
        hidden_activation = str(config.get("hidden_activation") or config.get("hidden_act") or "silu")
        if hidden_activation not in ACTIVATIONS and self.require_supported:
            raise ValueError(f"{source}: activation {hidden_activation!r} is not supported ({', '.join(ACTIVATIONS)})")
        query_pre_attn_scalar = config.get("query_pre_attn_scalar")
        attention_bias = bool(config.get("attention_bias") or False)
        return ModelConfig(
            architecture=self.architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", tie_word_embeddings)),
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(config.get("mlp_bias") or False),
            qk_norm=qk_norm,
            layer_sliding_windows=self._layer_sliding_windows(num_layers, sliding_windows),
            config_dtype=config.get("dtype") or config.get("torch_dtype"),
            model_type=self.model_type,
            eos_token_ids=as_id_list(config.get("eos_token_id")),
            gemma_norms=gemma_norms,
            embedding_scale=hidden_size**0.5 if scale_embeddings else None,
            hidden_activation=hidden_activation,
            attention_scale=float(query_pre_attn_scalar) ** -0.5 if query_pre_attn_scalar else None,
            attn_logit_softcap=_optional_float(config.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(config.get("final_logit_softcapping")),
            sliding_rope_theta=sliding_rope_theta,
            sliding_rope_scaling=sliding_rope_scaling,
            moe=None if moe is None else moe(self, num_layers),
            attention_sinks=attention_sinks,
            partial_rotary_factor=partial_rotary_factor if partial_rotary else 1.0,
        )

    def _layer_type_ropes(
        self, default_sliding_theta: float | None
    ) -> tuple[dict[str, Any], float | None, dict[str, Any] | None]:
        """(the global rope's parameters, the sliding layers' theta and scaling): one rope per
        layer type where transformers 5 writes them so, else `rope_parameters` (or the older
        `rope_scaling`) for all and the family's default for the sliding layers."""
        rope_parameters = self.get("rope_parameters") or self.get("rope_scaling") or {}
        if "full_attention" in rope_parameters or "sliding_attention" in rope_parameters:
            local = rope_parameters.get("sliding_attention") or {}
            return (
                dict(rope_parameters.get("full_attention") or {}),
                float(local.get("rope_theta") or 10000.0),
                self._rope_scaling(local),
            )
        return dict(rope_parameters), default_sliding_theta, None

    def _layer_sliding_windows(self, num_layers: int, sliding_windows: SlidingWindows) -> list[int | None]:
        window = self.get("sliding_window")
        if window is None:
            return [None] * num_layers
        layer_types = self.get("layer_types")
        if layer_types:
            return [int(window) if t == "sliding_attention" else None for t in layer_types]
        return sliding_windows(self, int(window), num_layers)

    def _rope_scaling(self, rope: dict[str, Any]) -> dict[str, Any] | None:
        """The rope parameters pagoda.model.rope needs beyond theta, normalized, or None (plain rope)."""
        source, config, require_supported = self.source, self.values, self.require_supported
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            if require_supported:
                raise ValueError(
                    f"{source}: rope type {rope_type!r} is not supported "
                    f"({', '.join(t for t in SUPPORTED_ROPE_TYPES if t != 'su')})"
                )
            return None
        if rope_type == "default":
            return None
        if rope_type in ("longrope", "su"):
            original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
            if original is None or "short_factor" not in rope:
                if require_supported:
                    raise ValueError(f"{source}: longrope needs original_max_position_embeddings and short_factor")
                return None
            return {
                **rope,
                "rope_type": "longrope",
                "original_max_position_embeddings": int(original),
                "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
            }
        if rope_type == "yarn":
            original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
            if original is None:
                if require_supported:
                    raise ValueError(f"{source}: yarn rope needs original_max_position_embeddings")
                return None
            return {
                **rope,
                "rope_type": "yarn",
                "original_max_position_embeddings": int(original),
                "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
            }
        return {**rope, "rope_type": rope_type}


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
