"""ModelConfig: what pagoda needs from a Hugging Face `config.json` and `generation_config.json`.

Accepts both the keys of checkpoints in the wild (`torch_dtype`, top-level `rope_theta`,
`rope_scaling`) and those transformers 5 writes (`dtype`, `rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.quant.storage_bytes import kv_cache_bytes_per_token

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


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
    rope_scaling: dict[str, Any] | None
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

        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "llama3") and require_supported:
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (default, llama3)")
        rope_scaling = rope if rope_type == "llama3" else None

        attention_bias = bool(config.get("attention_bias") or False)
        # Transformers picks the model class by model_type; the architecture names it too.
        is_qwen2 = architecture == "Qwen2ForCausalLM" or model_type in ("qwen2", "qwen2_moe")
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
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,  # Qwen2 always has q/k/v bias
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(config.get("mlp_bias") or False),
            qk_norm=is_qwen3,
            layer_sliding_windows=_layer_sliding_windows(config, architecture, num_layers),
            config_dtype=config.get("dtype") or config.get("torch_dtype"),
            eos_token_ids=_as_id_list(config.get("eos_token_id")),
            model_type=model_type,
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


def _layer_sliding_windows(config: dict[str, Any], architecture: str, num_layers: int) -> list[int | None]:
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if window is None:
        return [None] * num_layers
    if layer_types:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    if architecture == "MistralForCausalLM":
        return [int(window)] * num_layers
    if config.get("use_sliding_window"):
        # Qwen2/Qwen3: layers from max_window_layers on use the window.
        first = int(config.get("max_window_layers", num_layers))
        return [int(window) if i >= first else None for i in range(num_layers)]
    return [None] * num_layers
