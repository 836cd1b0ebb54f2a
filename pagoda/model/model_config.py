"""ModelConfig: what pagoda needs from a Hugging Face `config.json` and `generation_config.json`:
the shape of a decoder (sizes, heads, rope, windows, norms, biases, experts), naming no
architecture. Each architecture's family (pagoda.model.families) reads its config into one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pagoda.model import families
from pagoda.model.classifier_config import ClassifierConfig, read_classifier
from pagoda.model.linear_attention_config import RecurrentLayers
from pagoda.model.mla_config import MLAConfig
from pagoda.model.moe_config import MoEConfig
from pagoda.model.vision_config import VisionConfig
from pagoda.quant.storage_bytes import kv_cache_bytes_per_token, latent_kv_bytes_per_token


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
    model_type: str = ""
    family: str = ""  # the family that read it (pagoda.model.families): its checkpoint names and model class
    # Variations of the shared decoder (pagoda.model.decoder) some families use (Gemma first).
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
    # A sequence classifier over the last token (pagoda.model.classifier): the checkpoint's
    # `score` head, or LM-head rows of a reranker's tokens; None: a plain LM.
    classifier: ClassifierConfig | None = None
    # A vision-language model's image path (pagoda.model.vision); None: text only.
    vision: VisionConfig | None = None
    # M-RoPE (Qwen2.5-VL): rope frequencies in sections rotated by the temporal, height and width
    # positions; None: one position per token.
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL: the sections' frequencies interleaved t, h, w, ...
    # Multi-head latent attention (pagoda.model.mla): each token caches one latent and one rope
    # key per layer, shared by every head; head_dim is then the rope dims (transformers' choice).
    mla: MLAConfig | None = None
    # --- hybrid models (Qwen3-Next, Qwen3.5) ---
    # Recurrent layers in place of attention in some layers: Gated DeltaNet linear attention
    # (pagoda.model.gated_delta_net) or Mamba2 (pagoda.model.mamba2); None: every layer attends
    # and keeps KV.
    linear_attention: RecurrentLayers | None = None
    # q_proj also yields a gate per head: the attention output is multiplied by its sigmoid.
    attention_output_gate: bool = False
    # The share of each head's dims the rope rotates, the first ones (GLM-4.5, Qwen3-Next: 0.5); 1: all.
    partial_rotary_factor: float = 1.0
    # RMSNorm scales by (1 + w) (Gemma's form) without Gemma's extra norms.
    zero_centered_norms: bool = False
    # Granite: each block's output scaled before the residual add, attention without rotary
    # (its position comes from the recurrent layers), logits divided by a constant.
    residual_multiplier: float | None = None
    no_rope: bool = False
    logits_divisor: float | None = None
    # Nemotron-H: layers of an MLP alone (neither attention nor a recurrent mixer, so no KV).
    mlp_only_layers: tuple[int, ...] = ()
    # Falcon-H1: attention and the recurrent mixer side by side in every layer (each keeps KV).
    attention_beside_recurrent: bool = False
    # Constants a family's own layer class reads (Falcon-H1's muP multipliers); empty for the shared decoder.
    layer_multipliers: dict[str, Any] = field(default_factory=dict)
    # --- end hybrid models ---

    @property
    def unit_offset_norms(self) -> bool:
        """RMSNorms scale by (1 + w): Gemma's and the zero-centered ones."""
        return self.gemma_norms or self.zero_centered_norms

    @property
    def rotary_dim(self) -> int:
        """Features of each head the rotary embedding rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep KV: all but recurrent and MLP-only ones."""
        linear = self.linear_attention
        return tuple(
            i
            for i in range(self.num_layers)
            if (linear is None or not linear.layers[i] or self.attention_beside_recurrent)
            and i not in self.mlp_only_layers
        )

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

    def kv_bytes_per_token(
        self, bytes_per_element: float, num_kv_heads: int | None = None, *, kv_cache_dtype: str = "auto"
    ) -> int:
        """KV cache bytes per token: the model dtype's `bytes_per_element` each ("auto"), or a
        quantized `kv_cache_dtype` with its per-vector scales; num_kv_heads: a what-if other than
        the model's. The one formula behind the engine's pool sizing and `pagoda plan`. A latent
        attention model's is its latents' and rope keys' size, whatever the heads."""
        if self.mla is not None:
            latent_dim, rope_dim = self.mla.cache_dims
            return latent_kv_bytes_per_token(self.num_layers, latent_dim, rope_dim, kv_cache_dtype, bytes_per_element)
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return kv_cache_bytes_per_token(len(self.kv_layers), heads, self.head_dim, kv_cache_dtype, bytes_per_element)

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        """The last dimension of a layer's two cache tensors per cached head: (key, value), or a
        latent attention model's (latent, rope key) of its one cached "head"."""
        return (self.head_dim, self.head_dim) if self.mla is None else self.mla.cache_dims

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
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
    def from_dict(
        cls, config: dict[str, Any], source: str = "config.json", *, require_supported: bool = True
    ) -> ModelConfig:
        """require_supported=False reads the shape of any Llama-like decoder (for `pagoda plan`):
        other architectures and rope types are accepted, not only those pagoda can run; an
        architecture pagoda does not know is read by the family its `model_type` names, else as
        a Llama, and as a dense decoder. A config whose model_type a family claims is read by that
        family (transformers picks the model class by model_type too)."""
        if "text_config" in config and "num_hidden_layers" not in config:
            config = {**config, **config["text_config"]}  # a multimodal wrapper around a decoder
        if "model_type" not in config:
            config = {**config, "model_type": families.DEFAULT_MODEL_TYPE}
        model_type = str(config["model_type"])
        architectures = config.get("architectures") or []
        architecture = next((a for a in architectures if families.is_supported(a)), None)
        supported = architecture is not None
        if architecture is None:
            if require_supported:
                raise ValueError(
                    f"{source}: unsupported architecture {architectures or '(none)'}; "
                    f"pagoda supports {', '.join(families.architectures())}"
                )
            architecture = architectures[0] if architectures else model_type
        family = families.family_name(architecture, model_type)
        model_config = families.family(family).FAMILY.read(config, source, architecture, require_supported)
        classifier = read_classifier(config, families.is_sequence_classifier(architecture))
        if classifier is not None and not classifier.generates:
            # A sequence-classification checkpoint has no LM head: the embedding matrix stands
            # in for it where a step computes the prefill's (dropped) token.
            model_config = replace(model_config, tie_word_embeddings=True)
        # An architecture pagoda does not run is read as a dense decoder: its experts' keys are its own.
        return replace(model_config, family=family, moe=model_config.moe if supported else None, classifier=classifier)

    def _apply_generation_config(self, generation: dict[str, Any]) -> None:
        for token_id in as_id_list(generation.get("eos_token_id")):
            if token_id not in self.eos_token_ids:
                self.eos_token_ids.append(token_id)
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if generation.get(key) is not None:
                self.generation_defaults[key] = generation[key]
        if generation.get("do_sample") is False:
            self.generation_defaults["temperature"] = 0.0


def as_id_list(value: Any) -> list[int]:
    """A token id or a list of them (config.json's `eos_token_id`) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
