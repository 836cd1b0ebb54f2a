"""Tiny random-weight models of each supported architecture, built with `transformers`, plus
a small byte-level BPE tokenizer, saved in the Hugging Face layout. Nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "Paged attention stores keys and values in fixed-size blocks; a block table maps them.",
    "for i in range(10):\n    print(i * i)\n# comments, numbers 0123456789 and symbols !@#$%^&*()[]{}",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|endoftext|>\n"
    "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class TinyModel:
    """One architecture's tiny random-weight model: transformers' config and model classes, the
    parity test group it joins, and its config beyond the common sizes (or a function of the
    seed that makes them)."""

    config_class: str
    model_class: str  # the architecture
    # "dense" (ARCHITECTURES), "more" (MORE_ARCHITECTURES), "moe" (MOE_ARCHITECTURES), "mla"
    # (MLA_ARCHITECTURES), "sigmoid_moe" (SIGMOID_MOE_ARCHITECTURES), "hybrid" (HYBRID_ARCHITECTURES)
    # or "classifier"
    group: str
    overrides: dict[str, Any] | Callable[[int], dict[str, Any]] = field(default_factory=dict)


def _phi3(seed: int) -> dict[str, Any]:
    # LongRoPE: short factors up to original_max_position_embeddings, long ones past it.
    head_dim = 64 // 4
    generator = torch.Generator().manual_seed(seed)
    return dict(
        max_position_embeddings=2048,
        original_max_position_embeddings=512,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": (1 + 3 * torch.rand(head_dim // 2, generator=generator)).tolist(),
            "long_factor": (4 + 8 * torch.rand(head_dim // 2, generator=generator)).tolist(),
        },
    )


_HYBRID = dict(
    head_dim=16,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


# Every family's test parameters: a new family adds its entry here, and the parity tests of its
# group (tests/model/test_model_correctness.py, test_gemma_phi3.py, test_moe_models.py) run it.
TINY_MODELS: dict[str, TinyModel] = {
    "llama": TinyModel(
        "LlamaConfig",
        "LlamaForCausalLM",
        "dense",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "qwen2": TinyModel("Qwen2Config", "Qwen2ForCausalLM", "dense", dict(tie_word_embeddings=True)),
    "qwen3": TinyModel("Qwen3Config", "Qwen3ForCausalLM", "dense", dict(head_dim=32)),
    "mistral": TinyModel("MistralConfig", "MistralForCausalLM", "dense", dict(sliding_window=24)),
    # Local layers slide over 24 tokens; soft-caps low enough to bend the scores and logits.
    "gemma2": TinyModel(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "more",
        dict(
            head_dim=16,
            sliding_window=24,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
            num_hidden_layers=3,
        ),
    ),
    # Layers 0, 2 local (their own rope base), 1 and 3 global with linear rope scaling.
    "gemma3": TinyModel(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "more",
        dict(
            head_dim=16,
            sliding_window=24,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
            num_hidden_layers=4,
            sliding_window_pattern=2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
    "phi3": TinyModel("Phi3Config", "Phi3ForCausalLM", "more", _phi3),
    # Top-2 of 4 experts, a sliding window shorter than the longer prompts.
    "mixtral": TinyModel(
        "MixtralConfig",
        "MixtralForCausalLM",
        "moe",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24),
    ),
    # Top-2 of 8 experts (not renormalized) plus the gated shared expert; layer 1 dense.
    "qwen2_moe": TinyModel(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        "moe",
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    # Top-3 of 8 experts, renormalized; q/k norms.
    "qwen3_moe": TinyModel(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        "moe",
        dict(head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True),
    ),
    # Top-2 of 4 biased experts behind a biased router; layer 0 slides over 24 tokens, layer 1
    # is global; YaRN rope; a SwiGLU limit low enough that the clamps bite.
    "gpt_oss": TinyModel(
        "GptOssConfig",
        "GptOssForCausalLM",
        "moe",
        dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=24,
            swiglu_limit=0.6,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # Multi-head latent attention (tests/model/test_deepseek_v3.py): a dense first layer, then
    # top-2 of 8 experts in the best 2 of 4 groups under the sigmoid router with its correction
    # bias, routed scaling and a shared expert; q through q_lora_rank; YaRN rope with mscale.
    "deepseek_v3": TinyModel(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        "mla",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
    # GLM-4.5 MoE (tests/model/test_glm4_moe.py): half-head partial rotary, q/k norms, a dense
    # first layer, then DeepSeek's router over top-2 of 8 experts in the best 2 of 4 groups, and
    # a shared expert.
    "glm4_moe": TinyModel(
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        "sigmoid_moe",
        dict(
            head_dim=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            routed_scaling_factor=1.8,
            use_qk_norm=True,
            attention_bias=True,
        ),
    ),
    # Hybrids (tests/model/test_hybrid_models.py): Gated DeltaNet in layers 0-2 (2 key heads
    # serving 4 value heads), gated attention with q/k norms and a half-head rotary in layer 3.
    "qwen3_next": TinyModel(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        "hybrid",
        dict(
            _HYBRID,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3_5": TinyModel("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "hybrid", dict(_HYBRID)),
    "qwen3_5_moe": TinyModel(
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        "hybrid",
        dict(
            _HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
        ),
    ),
    # Mamba2 in layers 0, 1 and 3 (4 heads of 32 channels, 2 groups, a 16-token state), attention
    # without rotary in layer 2; Granite's multipliers; top-2 of 4 experts and the shared MLP.
    "granitemoehybrid": TinyModel(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        "hybrid",
        dict(
            num_hidden_layers=4,
            layer_types=["mamba", "mamba", "attention", "mamba"],
            intermediate_size=32,
            shared_intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.0,
            position_embedding_type="nope",
        ),
    ),
    # Nemotron-H's single-mixer blocks: Mamba2, the squared-ReLU MLP, attention without rotary, MLP.
    "nemotron_h": TinyModel(
        "NemotronHConfig",
        "NemotronHForCausalLM",
        "hybrid",
        dict(
            layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
            head_dim=16,
            intermediate_size=96,
            mamba_num_heads=4,
            mamba_head_dim=32,
            n_groups=2,
            ssm_state_size=16,
            chunk_size=16,
        ),
    ),
    # Mamba2 and attention side by side in both layers (Mamba2 of 4 heads of 16, 2 groups, the norm
    # before the gate), every muP multiplier away from 1.
    "falcon_h1": TinyModel(
        "FalconH1Config",
        "FalconH1ForCausalLM",
        "hybrid",
        dict(
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=16,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            embedding_multiplier=1.5,
            lm_head_multiplier=0.5,
            mlp_multipliers=[0.8, 1.2],
            key_multiplier=0.7,
            attention_in_multiplier=1.1,
            attention_out_multiplier=0.9,
            ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
            ssm_in_multiplier=0.95,
            ssm_out_multiplier=1.05,
        ),
    ),
    # Sequence classifiers: the decoder under a `score` head (pagoda/model/classifier.py); their
    # tests are tests/engine/test_scoring.py and tests/serve/test_scoring_api.py.
    "llama_classifier": TinyModel("LlamaConfig", "LlamaForSequenceClassification", "classifier", dict(num_labels=1)),
    "qwen2_classifier": TinyModel(
        "Qwen2Config",
        "Qwen2ForSequenceClassification",
        "classifier",
        dict(
            num_labels=3,
            id2label={0: "negative", 1: "neutral", 2: "positive"},
            label2id={"negative": 0, "neutral": 1, "positive": 2},
        ),
    ),
    "qwen3_classifier": TinyModel(
        "Qwen3Config", "Qwen3ForSequenceClassification", "classifier", dict(head_dim=32, num_labels=1)
    ),
    # Vision-language models (`build_vision_model`): a tiny CLIP tower (32x32 images, 8x8 patches:
    # 16 image tokens) under a Llama decoder; their tests are tests/model/test_vision_models.py.
    "llava": TinyModel(
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        "vision",
        dict(
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
                projection_dim=32,
            ),
            text_config=dict(model_type="llama"),
            vision_feature_layer=-2,
        ),
    ),
    # 4-pixel patches merged 2x2, windows of 16 pixels (2x2 merged groups) on block 0, full
    # attention on block 1; M-RoPE sections of 2/3/3 frequencies over a 16-wide head.
    # Gemma 3 with its SigLIP tower: 32x32 images in 4-pixel patches pooled to 4 image tokens,
    # which attend to each other both ways; local layers sliding over 24 tokens.
    "gemma3_vl": TinyModel(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        "vision",
        dict(
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=4,
                vision_use_head=False,
            ),
            text_config=dict(
                model_type="gemma3_text",
                head_dim=16,
                sliding_window=24,
                sliding_window_pattern=2,
                query_pre_attn_scalar=16,
                tie_word_embeddings=True,
            ),
            mm_tokens_per_image=4,
            tie_word_embeddings=True,  # the wrapper's, as Gemma 3's checkpoints tie them
        ),
    ),
    # Qwen3-VL: 4-pixel patches merged 2x2, a 4x4 learned position table resampled per image,
    # DeepStack rows from vision blocks 0 and 1 into decoder layers 0 and 1; interleaved M-RoPE.
    "qwen3_vl": TinyModel(
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        "vision",
        dict(
            vision_config=dict(
                depth=3,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                num_position_embeddings=16,
                deepstack_visual_indexes=[0, 1],
            ),
            text_config=dict(
                model_type="qwen3_vl_text",
                head_dim=16,
                num_hidden_layers=3,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True,
                },
            ),
        ),
    ),
    "qwen2_5_vl": TinyModel(
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        "vision",
        dict(
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                window_size=16,
                fullatt_block_indexes=[1],
            ),
            text_config=dict(
                model_type="qwen2_5_vl_text",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            ),
        ),
    ),
}
ARCHITECTURES = tuple(name for name, model in TINY_MODELS.items() if model.group == "dense")
# Gemma 2, Gemma 3 (text) and Phi-3: built by `build_model` too, their fixtures in tests/model.
MORE_ARCHITECTURES = tuple(name for name, model in TINY_MODELS.items() if model.group == "more")
# Mixture of experts: built by `build_model`, their fixtures in tests/model/test_moe_models.py.
MOE_ARCHITECTURES = tuple(name for name, model in TINY_MODELS.items() if model.group == "moe")
# Multi-head latent attention: their fixtures in tests/model/test_deepseek_v3.py.
MLA_ARCHITECTURES = tuple(name for name, model in TINY_MODELS.items() if model.group == "mla")
# DeepSeek's router under the shared attention (GLM-4.5): tests/model/test_glm4_moe.py.
SIGMOID_MOE_ARCHITECTURES = tuple(name for name, model in TINY_MODELS.items() if model.group == "sigmoid_moe")
# Linear attention beside attention: built by `build_model`, their fixtures in tests/model/test_hybrid_models.py.
HYBRID_ARCHITECTURES = tuple(name for name, model in TINY_MODELS.items() if model.group == "hybrid")


def build_tokenizer(directory: Path, vocab_size: int = 384, extra_special: tuple[str, ...] = ()) -> int:
    """Train a byte-level BPE on a tiny corpus; returns its vocabulary size. `extra_special`:
    more special tokens (a vision model's image placeholder), after the usual ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 4096,
            }
        )
    )
    return tokenizer.get_vocab_size()


def build_model(
    directory: Path,
    architecture: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a random-weight model of `architecture` (and a tokenizer) into `directory`."""
    import transformers

    directory = Path(directory)
    if TINY_MODELS.get(architecture, TINY_MODELS["llama"]).group == "vision":
        return build_vision_model(directory, architecture, seed=seed, dtype=dtype, **overrides)
    vocab_size = build_tokenizer(directory)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if architecture not in TINY_MODELS:
        raise ValueError(f"unknown architecture {architecture}")
    tiny = TINY_MODELS[architecture]
    if tiny.group == "vision":
        return build_vision_model(directory, architecture, seed=seed, dtype=dtype, **overrides)
    config_class, model_class = getattr(transformers, tiny.config_class), getattr(transformers, tiny.model_class)
    common.update(tiny.overrides(seed) if callable(tiny.overrides) else tiny.overrides)
    common.update(overrides)
    config = config_class(**common)
    torch.manual_seed(seed)
    model = model_class(config).to(dtype)
    # Larger-than-default weights give peaked distributions, so greedy ties are not a coin flip.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # linear weights, and stacked experts' [E, out, in]
                param.normal_(0.0, 0.08)
            elif architecture == "gpt_oss" and not name.endswith("layernorm.weight") and name != "model.norm.weight":
                # biases and attention sinks large enough to matter (transformers starts them at 0)
                param.normal_(0.0, 1.0 if name.endswith("sinks") else 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: make it steer the choice
                buffer.normal_(0.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


# Each vision family's config keys naming special tokens (added to its tokenizer).
VISION_TOKENS = {
    "llava": {"image_token_id": "<image>"},
    "gemma3_vl": {
        "image_token_index": "<image_soft_token>",
        "boi_token_index": "<start_of_image>",
        "eoi_token_index": "<end_of_image>",
    },
    "qwen3_vl": {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    },
    "qwen2_5_vl": {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    },
}


def build_vision_model(
    directory: Path, architecture: str = "llava", *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """Save a random-weight vision-language model, its tokenizer (the image placeholder a special
    token) and its image processor's config into `directory`."""
    import transformers

    directory = Path(directory)
    tokens = VISION_TOKENS[architecture]
    vocab_size = build_tokenizer(directory, extra_special=tuple(tokens.values()))
    vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    token_ids = {key: vocab[token] for key, token in tokens.items()}
    tiny = TINY_MODELS[architecture]
    settings = dict(tiny.overrides(seed) if callable(tiny.overrides) else tiny.overrides)
    settings.update(overrides)
    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    text.update(settings.pop("text_config", {}))
    config = getattr(transformers, tiny.config_class)(
        text_config=text, **{"tie_word_embeddings": False, **token_ids, **settings}
    )
    torch.manual_seed(seed)
    model = getattr(transformers, tiny.model_class)(config).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    if architecture == "llava":
        size = config.vision_config.image_size
        processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        )
    elif architecture == "gemma3_vl":
        size = config.vision_config.image_size
        processor = transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size})
    else:  # images resized to 16..4096 pixels in whole merged patches (8x8 pixels)
        vision = config.vision_config
        processor = transformers.Qwen2VLImageProcessorPil(
            min_pixels=16 * 16,
            max_pixels=64 * 64,
            patch_size=vision.patch_size,
            merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size,
        )
    processor.save_pretrained(directory)
    return directory


def load_hf_model(directory: Path, dtype: torch.dtype = torch.float32):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and the raw logprob of each chosen token."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [torch.log_softmax(logits[0].float(), -1)[t].item() for logits, t in zip(out.logits, tokens)]
    return tokens, logprobs


Reference = tuple[list[int], list[float]]


def hf_references(directory: Path, prompts_for_vocab, max_new_tokens: int) -> tuple[list[list[int]], list[Reference]]:
    """The prompts (built for the checkpoint's vocabulary) and transformers' greedy reference for each."""
    model = load_hf_model(directory)
    prompts = prompts_for_vocab(model.config.vocab_size)
    return prompts, [hf_greedy(model, prompt, max_new_tokens) for prompt in prompts]


def assert_matches_reference(outputs, references: list[Reference], tolerance: float) -> None:
    """Every sample of every output has the reference's greedy ids, and each chosen token's logprob
    is within tolerance of transformers'."""
    for output, (tokens, logprobs) in zip(outputs, references, strict=True):
        for completion in output.outputs:
            assert completion.token_ids == tokens
            got = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
            assert max(abs(a - b) for a, b in zip(got, logprobs)) < tolerance
