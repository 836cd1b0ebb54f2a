"""ModelConfig: what pagoda needs from a Hugging Face `config.json` and `generation_config.json`.

Accepts both the keys of checkpoints in the wild (`torch_dtype`, top-level `rope_theta`,
`rope_scaling`) and those transformers 5 writes (`dtype`, `rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.model.moe_config import MOE_ARCHITECTURES, MoEConfig
from pagoda.quant.storage_bytes import kv_cache_bytes_per_token

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM") + MOE_ARCHITECTURES
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Rope types pagoda computes (pagoda.model.rope); `su` is LongRoPE's older name.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su", "yarn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or a dict with `rope_type` linear, llama3, longrope or yarn
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # Per layer: the sliding window (keys within the last `w` positions, self included) or None.
    layer_sliding_windows: list[int | None]
    config_dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    model_type: str = "llama"
    # Gemma's differences from the Llama family, read by the one model (pagoda.model.llama).
    gemma_norms: bool = False  # RMSNorm scales by (1 + w); post-attention and pre/post-MLP norms
    embedding_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    hidden_activation: str = "silu"  # of the gate: silu, gelu_pytorch_tanh or gelu (exact)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores become cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # the same on the LM head's logits
    # Rope of the sliding-window layers where it differs from the global one (Gemma 3).
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    # Mixture of experts (pagoda.model.moe): router, experts and which layers have them; None: dense.
    moe: MoEConfig | None = None
    # gpt-oss: a learned logit per attention head joins each softmax's denominator (a key that
    # soaks up attention and contributes no value).
    attention_sinks: bool = False

    def layer_rope(self, layer_index: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of one layer's rotary embedding."""
        if self.sliding_rope_theta is not None and self.layer_sliding_windows[layer_index] is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def long_rope_boundary(self) -> int | None:
        """LongRoPE (pagoda.model.rope): the longest sequence computed with the short factors;
        longer ones use the long factors from position 0. None: one set of factors."""
        if self.rope_scaling is None or self.rope_scaling["rope_type"] != "longrope":
            return None
        return int(self.rope_scaling["original_max_position_embeddings"])

    def kv_bytes_per_token(self, bytes_per_element: float, num_kv_heads: int | None = None, *,
                           kv_cache_dtype: str = "auto") -> int:
        """KV cache bytes per token: the model dtype's `bytes_per_element` each ("auto"), or a
        quantized `kv_cache_dtype` with its per-vector scales; num_kv_heads: a what-if other than
        the model's. The one formula behind the engine's pool sizing and `pagoda plan`."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return kv_cache_bytes_per_token(self.num_layers, heads, self.head_dim, kv_cache_dtype, bytes_per_element)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        config = json.loads(config_path.read_text())
        model_config = cls.from_dict(config, source=str(config_path))
        generation_path = model_dir / "generation_config.json"
        if generation_path.is_file():
            model_config._apply_generation_config(json.loads(generation_path.read_text()))
        return model_config

    @classmethod
    def from_dict(cls, config: dict[str, Any], source: str = "config.json", *,
                  require_supported: bool = True) -> "ModelConfig":
        """require_supported=False reads the shape of any Llama-like decoder (for `pagoda plan`):
        other architectures and rope types are accepted, not only those pagoda can run."""
        if "text_config" in config and "num_hidden_layers" not in config:
            config = {**config, **config["text_config"]}  # a multimodal wrapper around a decoder
        model_type = str(config.get("model_type", "llama"))
        architectures = config.get("architectures") or []
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            if require_supported:
                raise ValueError(f"{source}: unsupported architecture {architectures or '(none)'}; "
                                 f"pagoda supports {', '.join(SUPPORTED_ARCHITECTURES)}")
            architecture = architectures[0] if architectures else model_type
        try:
            hidden_size = int(config["hidden_size"])
            num_heads = int(config["num_attention_heads"])
            num_layers = int(config["num_hidden_layers"])
            vocab_size = int(config["vocab_size"])
            intermediate_size = int(config["intermediate_size"])
        except KeyError as missing:
            raise ValueError(f"{source}: missing required key {missing}") from None
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_dim = int(config.get("head_dim") or hidden_size // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")

        is_gemma = architecture in GEMMA_ARCHITECTURES or model_type.startswith("gemma")
        is_gemma3 = architecture == "Gemma3ForCausalLM" or model_type == "gemma3_text"
        rope_parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
        sliding_rope_theta, sliding_rope_scaling = None, None
        if "full_attention" in rope_parameters or "sliding_attention" in rope_parameters:
            # Gemma 3 as transformers 5 writes it: one rope per layer type
            local = rope_parameters.get("sliding_attention") or {}
            rope = dict(rope_parameters.get("full_attention") or {})
            sliding_rope_theta = float(local.get("rope_theta") or 10000.0)
            sliding_rope_scaling = _rope_scaling(local, config, source, require_supported)
        else:
            rope = dict(rope_parameters)
            if config.get("rope_local_base_freq") is not None:  # Gemma 3 as its checkpoints write it
                sliding_rope_theta = float(config["rope_local_base_freq"])
        # Defaults where a config names no base: transformers' (Gemma 3's global and local ones, gpt-oss's)
        is_gpt_oss = architecture == "GptOssForCausalLM" or model_type == "gpt_oss"
        default_theta = 1e6 if is_gemma3 else 150000.0 if is_gpt_oss else 10000.0
        rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or default_theta)
        rope_scaling = _rope_scaling(rope, config, source, require_supported)
        if is_gemma3 and sliding_rope_theta is None:
            sliding_rope_theta = 10000.0
        if require_supported and config.get("use_bidirectional_attention"):
            raise ValueError(f"{source}: bidirectional attention (an embedding model) is not supported")
        if require_supported and float(rope.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor {rope['partial_rotary_factor']} is not supported "
                             "(rope over the whole head only)")
        max_position_embeddings = int(config.get("max_position_embeddings", 2048))
        hidden_activation = str(config.get("hidden_activation") or config.get("hidden_act") or "silu")
        if hidden_activation not in ACTIVATIONS and require_supported:
            raise ValueError(f"{source}: activation {hidden_activation!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        query_pre_attn_scalar = config.get("query_pre_attn_scalar")

        attention_bias = bool(config.get("attention_bias") or False)
        # Transformers picks the model class by model_type; the architecture names it too.
        is_qwen2 = architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or model_type in ("qwen2", "qwen2_moe")
        is_qwen3 = architecture == "Qwen3ForCausalLM" or model_type.startswith("qwen3")
        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_position_embeddings,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", is_gemma)),  # Gemma ties by default
            # Qwen2 always has q/k/v bias; Qwen2-MoE names it qkv_bias
            qkv_bias=bool(config.get("qkv_bias", True)) if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(config.get("mlp_bias") or False),
            qk_norm=is_qwen3 or is_gemma3,
            layer_sliding_windows=_layer_sliding_windows(config, architecture, num_layers),
            config_dtype=config.get("dtype") or config.get("torch_dtype"),
            eos_token_ids=_as_id_list(config.get("eos_token_id")),
            model_type=model_type,
            gemma_norms=is_gemma,
            embedding_scale=hidden_size ** 0.5 if is_gemma else None,
            hidden_activation=hidden_activation,
            attention_scale=float(query_pre_attn_scalar) ** -0.5 if query_pre_attn_scalar else None,
            attn_logit_softcap=_optional_float(config.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(config.get("final_logit_softcapping")),
            sliding_rope_theta=sliding_rope_theta,
            sliding_rope_scaling=sliding_rope_scaling,
            moe=MoEConfig.from_hf(config, architecture, num_layers, source),
            attention_sinks=is_gpt_oss,
        )

    def _apply_generation_config(self, generation: dict[str, Any]) -> None:
        for token_id in _as_id_list(generation.get("eos_token_id")):
            if token_id not in self.eos_token_ids:
                self.eos_token_ids.append(token_id)
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if generation.get(key) is not None:
                self.generation_defaults[key] = generation[key]
        if generation.get("do_sample") is False:
            self.generation_defaults["temperature"] = 0.0


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _rope_scaling(rope: dict[str, Any], config: dict[str, Any], source: str,
                  require_supported: bool) -> dict[str, Any] | None:
    """The rope parameters pagoda.model.rope needs beyond theta, normalized, or None (plain rope)."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        if require_supported:
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported "
                             f"({', '.join(t for t in SUPPORTED_ROPE_TYPES if t != 'su')})")
        return None
    if rope_type == "default":
        return None
    if rope_type in ("longrope", "su"):
        original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
        if original is None or "short_factor" not in rope:
            if require_supported:
                raise ValueError(f"{source}: longrope needs original_max_position_embeddings and short_factor")
            return None
        return {**rope, "rope_type": "longrope", "original_max_position_embeddings": int(original),
                "max_position_embeddings": int(config.get("max_position_embeddings", 2048))}
    if rope_type == "yarn":
        original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
        if original is None:
            if require_supported:
                raise ValueError(f"{source}: yarn rope needs original_max_position_embeddings")
            return None
        return {**rope, "rope_type": "yarn", "original_max_position_embeddings": int(original),
                "max_position_embeddings": int(config.get("max_position_embeddings", 2048))}
    return {**rope, "rope_type": rope_type}


def _layer_sliding_windows(config: dict[str, Any], architecture: str, num_layers: int) -> list[int | None]:
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if window is None:
        return [None] * num_layers
    if layer_types:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        return [int(window)] * num_layers
    if architecture in GEMMA_ARCHITECTURES:
        # Configs older than `layer_types`: every `pattern`-th layer is global, the others slide.
        pattern = int(config.get("sliding_window_pattern") or (2 if architecture == "Gemma2ForCausalLM" else 6))
        return [int(window) if (i + 1) % pattern else None for i in range(num_layers)]
    if config.get("use_sliding_window"):
        # Qwen2/Qwen3: layers from max_window_layers on use the window.
        first = int(config.get("max_window_layers", num_layers))
        return [int(window) if i >= first else None for i in range(num_layers)]
    return [None] * num_layers
