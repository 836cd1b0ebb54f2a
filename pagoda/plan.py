"""`pagoda plan`: the capacity worksheet — weights, KV cache and concurrency from config.json.

Pure arithmetic: nothing is loaded but config.json and, when weights are present, the
safetensors headers (the first few KiB of each file).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.artifacts.review import safetensors_header
from pagoda.config import EngineConfig, parse_bytes
from pagoda.core.capacity import blocks_for, sequences_that_fit
from pagoda.core.kv_cache_groups import kv_cache_groups, layers_per_page, pages_per_sequence
from pagoda.core.kv_memory import KVMemory, free_memory_bytes, kv_pool_memory
from pagoda.model.model_config import ModelConfig
from pagoda.quant.storage_bytes import (
    INT4_GROUP_SIZES,
    KV_SCALE_BYTES,
    int4_group_size_for,
    kv_cache_bytes_per_token,
    latent_kv_bytes_per_token,
    weight_bytes_per_parameter,
)

GIB = 2**30

# Bytes per element, as pagoda stores them (pagoda/quant/storage_bytes.py). int4 weights carry an
# fp16 (scale, zero) pair per group (--quantization-group-size, default 128); fp8/int8 KV add a
# 4-byte scale per head vector on top of one byte per element.
INT4_GROUP_SIZE = 128
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": weight_bytes_per_parameter("int4", 2.0, INT4_GROUP_SIZE),
}
# The engine's --kv-cache-dtype for each KV dtype of the worksheet ("auto": the model dtype's bytes).
KV_CACHE_DTYPE_OF = {"fp32": "auto", "bf16": "auto", "fp16": "auto", "fp8": "fp8_e4m3", "int8": "int8"}
DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "fp32": "fp32",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp16": "fp16",
    "fp8": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "int8": "int8",
    "int4": "int4",
}
KV_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}

# Typical traffic shapes when --classes is not given: (p50 prompt, p50 output, p95 prompt, p95 output).
DEFAULT_CLASSES = {
    "chat": (200, 300, 1000, 800),
    "rag": (3000, 200, 6000, 400),
    "summarize": (6000, 600, 12000, 1200),
    "agent": (4000, 150, 16000, 400),
}

CLASSES_HELP = """\
request classes, space-separated, each NAME=p50:PROMPT/OUTPUT[,p95:PROMPT/OUTPUT][,concurrency:N][,images:N]
  lengths in tokens; p95 defaults to p50; concurrency (alias c) is the target number of
  requests of this class in flight at once (default 1); images: images per request, whose
  image tokens a vision-language model adds to the prompt.
  example: --classes chat=p50:200/400,p95:1000/800,c:64 rag=p50:4000/200,p95:7000/300,c:16
"""


def normalize_dtype(name: str) -> str:
    key = name.strip().lower().replace("torch.", "")
    if key not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_ALIASES[key]


# ---- the model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the worksheet shows and computes with. Parsed by the engine's own
    ModelConfig (pagoda/model/model_config.py); this is only the worksheet's view of it."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    config_dtype: str | None  # normalized: bf16, fp16, fp32, ...
    max_position_embeddings: int  # 2048 where config.json has none, as transformers assumes
    norms_per_layer: int = 2  # input and post-attention; Gemma adds two around the MLP
    # Per layer: its sliding window or None. The engine releases KV blocks behind windows.
    layer_sliding_windows: tuple[int | None, ...] = ()
    # Mixture of experts (0: a dense model): layers with a MoE block in place of the MLP, each
    # with num_experts routed experts (experts_per_token of them per token) and a shared one.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int = 0
    # Multi-head latent attention: per layer, each token caches (latent, rope key) of these sizes
    # for all heads, instead of K and V per KV head. None: K and V.
    kv_latent_dims: tuple[int, int] | None = None
    # Hybrid models: layers of linear attention (no KV, a fixed state per sequence), and that
    # state's elements per sequence: (convolution windows in the model dtype, recurrent states in float32).
    num_linear_layers: int = 0
    linear_state_elements: tuple[int, int] = (0, 0)
    num_kv_layers: int = 0  # layers that keep KV (0: every layer; not recurrent or MLP-only ones)
    # A vision-language model: its image placeholder tokens per image (0: they vary with the
    # image's size, Qwen2.5-VL's), whose encoder outputs the engine caches (hidden_size each).
    vision: bool = False
    image_tokens_per_image: int = 0
    # Its attention projections' parameters per layer (q, kv down and up, o), which the heads and
    # head_dim above do not give. None: q, k, v and o of the heads.
    latent_attention_params: int | None = None

    @property
    def is_mha(self) -> bool:
        return self.num_kv_heads == self.num_attention_heads

    @classmethod
    def from_model_config(cls, config: ModelConfig) -> ModelShape:
        dtype = config.config_dtype
        return cls(
            model_type=config.model_type,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=config.tie_word_embeddings,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            mlp_bias=config.mlp_bias,
            qk_norm=config.qk_norm,
            config_dtype=normalize_dtype(str(dtype)) if dtype and str(dtype).lower() in DTYPE_ALIASES else None,
            max_position_embeddings=config.max_position_embeddings,
            norms_per_layer=4 if config.gemma_norms else 2,
            layer_sliding_windows=tuple(config.layer_sliding_windows),
            kv_latent_dims=None if config.mla is None else config.mla.cache_dims,
            num_linear_layers=config.linear_attention.num_linear_layers if config.linear_attention else 0,
            linear_state_elements=_linear_state_elements(config),
            num_kv_layers=len(config.kv_layers),
            vision=config.vision is not None,
            image_tokens_per_image=_image_tokens_per_image(config),
            latent_attention_params=None if config.mla is None else _latent_attention_params(config),
            **(
                {}
                if config.moe is None
                else dict(
                    num_experts=config.moe.num_experts,
                    experts_per_token=config.moe.top_k,
                    moe_intermediate_size=config.moe.intermediate_size,
                    shared_expert_intermediate_size=config.moe.shared_expert_intermediate_size,
                    num_moe_layers=config.moe.num_sparse_layers,
                )
            ),
        )

    @property
    def idle_expert_params(self) -> int:
        """Expert parameters a token does not multiply: those of the experts it is not routed to."""
        return (
            self.num_moe_layers
            * (self.num_experts - self.experts_per_token)
            * 3
            * self.hidden_size
            * self.moe_intermediate_size
        )


def _linear_state_elements(config: ModelConfig) -> tuple[int, int]:
    """A hybrid model's state per sequence: (window elements, recurrent elements) over its
    linear-attention layers; (0, 0) for a model that attends in every layer."""
    linear = config.linear_attention
    if linear is None:
        return 0, 0
    n = linear.num_linear_layers
    recurrent = 1
    for size in linear.recurrent_shape:
        recurrent *= size
    return n * linear.conv_dim * (linear.conv_kernel_size - 1), n * recurrent


def _image_tokens_per_image(config: ModelConfig) -> int:
    """LLaVA's and Gemma 3's fixed count; 0 where it varies with the image (Qwen2.5-VL)."""
    if config.vision is None:
        return 0
    if config.vision.kind == "llava":
        return config.vision.llava_tokens_per_image()
    return int(config.vision.options.get("mm_tokens_per_image", 0))


def _latent_attention_params(config: ModelConfig) -> int:
    """Weights of one multi-head latent attention layer (pagoda.model.mla)."""
    mla = config.mla
    assert mla is not None
    hidden, heads = config.hidden_size, config.num_heads
    q_out = heads * mla.qk_head_dim
    query = hidden * q_out if mla.q_lora_rank is None else mla.q_lora_rank * (hidden + q_out)
    kv_down = hidden * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv_up = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return query + kv_down + kv_up + heads * mla.v_head_dim * hidden


def model_shape_from_config(config: dict[str, Any], source: str = "config.json") -> ModelShape:
    """Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 / Phi-3 family; other decoder-only configs
    with the same keys work too."""
    return ModelShape.from_model_config(ModelConfig.from_dict(config, source, require_supported=False))


@dataclass(frozen=True)
class ParamCount:
    """Parameters split by how quantization treats them: decoder linears get quantized, the rest stays."""

    embedding: int
    lm_head: int
    linear: int  # decoder-layer matmul weights
    other: int  # norms and biases
    source: str  # "architecture" or "safetensors headers"

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.linear + self.other


def count_params_from_architecture(shape: ModelShape) -> ParamCount:
    h, d = shape.hidden_size, shape.head_dim
    q_out, kv_out = shape.num_attention_heads * d, shape.num_kv_heads * d
    attn_linear = h * q_out + 2 * h * kv_out + q_out * h
    if shape.latent_attention_params is not None:
        attn_linear = shape.latent_attention_params
    mlp_linear = 3 * h * shape.intermediate_size
    # A MoE layer's block instead: the router, the experts, a shared expert and its gate.
    shared = shape.shared_expert_intermediate_size
    moe_linear = (
        h * shape.num_experts
        + shape.num_experts * 3 * h * shape.moe_intermediate_size
        + (3 * h * shared + h if shared else 0)
    )
    num_dense = shape.num_layers - shape.num_moe_layers
    per_layer_other = shape.norms_per_layer * h
    if shape.qkv_bias:
        per_layer_other += q_out + 2 * kv_out
    if shape.o_bias:
        per_layer_other += h
    if shape.mlp_bias:
        per_layer_other += 2 * shape.intermediate_size + h
    if shape.qk_norm:
        per_layer_other += 2 * d
    embedding = shape.vocab_size * h
    return ParamCount(
        embedding=embedding,
        lm_head=0 if shape.tie_word_embeddings else embedding,
        linear=shape.num_layers * attn_linear + num_dense * mlp_linear + shape.num_moe_layers * moe_linear,
        other=shape.num_layers * per_layer_other + h,  # + final norm
        source="architecture",
    )


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file (artifacts' reader: every length and tensor entry
    checked against the file). Reads nothing else."""
    return safetensors_header(path)


def count_params_from_safetensors(files: list[Path]) -> ParamCount:
    embedding = lm_head = linear = other = 0
    for path in files:
        for name, info in read_safetensors_header(path).items():
            numel = math.prod(info["shape"])
            if "embed_tokens" in name or name.endswith("wte.weight"):
                embedding += numel
            elif name.startswith("lm_head") or ".lm_head." in name:
                lm_head += numel
            elif len(info["shape"]) == 2:
                linear += numel
            else:
                other += numel
    return ParamCount(embedding, lm_head, linear, other, source="safetensors headers")


def find_safetensors(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


# ---- request classes ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestClass:
    name: str
    p50_prompt: int
    p50_output: int
    p95_prompt: int
    p95_output: int
    concurrency: int | None = None  # target in flight; None: only report what fits
    images: int = 0  # images per request (a vision-language model's image tokens join its prompt)


def _parse_lengths(text: str, spec: str) -> tuple[int, int]:
    try:
        prompt, output = text.split("/")
        return int(prompt), int(output)
    except ValueError:
        raise ValueError(f"bad lengths {text!r} in class {spec!r}; expected PROMPT/OUTPUT, e.g. 200/400") from None


def parse_request_class(spec: str) -> RequestClass:
    """'chat=p50:200/400,p95:1000/800,c:64' -> RequestClass."""
    if "=" not in spec:
        raise ValueError(f"bad class {spec!r}; expected NAME=p50:PROMPT/OUTPUT[,p95:PROMPT/OUTPUT][,c:N]")
    name, body = spec.split("=", 1)
    p50 = p95 = None
    concurrency = None
    images = 0
    for item in filter(None, body.split(",")):
        key, _, value = item.partition(":")
        key = key.strip().lower()
        if key == "p50":
            p50 = _parse_lengths(value, spec)
        elif key == "p95":
            p95 = _parse_lengths(value, spec)
        elif key in ("c", "concurrency"):
            try:
                concurrency = int(value)
            except ValueError:
                raise ValueError(f"bad concurrency {value!r} in class {spec!r}") from None
        elif key == "images":
            try:
                images = int(value)
            except ValueError:
                raise ValueError(f"bad image count {value!r} in class {spec!r}") from None
        else:
            raise ValueError(f"unknown key {key!r} in class {spec!r}; use p50, p95, c or images")
    if p50 is None:
        raise ValueError(f"class {spec!r} needs p50:PROMPT/OUTPUT")
    p95 = p95 or p50
    if min(*p50, *p95, images) < 0 or (concurrency is not None and concurrency < 1):
        raise ValueError(f"class {spec!r}: lengths and images must be >= 0 and concurrency >= 1")
    return RequestClass(name.strip(), p50[0], p50[1], p95[0], p95[1], concurrency, images)


# ---- the worksheet -----------------------------------------------------------------------------


@dataclass
class Scenario:
    """One 'what if': its weights, KV per token, and how many full-context sequences fit."""

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    context: int
    kv_memory_bytes: int
    num_blocks: int
    full_context_seqs: int


@dataclass
class ClassCapacity:
    name: str
    p50_tokens: int
    p95_tokens: int
    p50_blocks: int
    p95_blocks: int
    fits_at_p50: int
    fits_at_p95: int
    target_concurrency: int | None
    blocks_needed_p50: int | None
    blocks_needed_p95: int | None
    memory_needed_p50: int | None
    memory_needed_p95: int | None


@dataclass
class StageMemory:
    """One pipeline stage on its own device: its layers, weights and KV pool."""

    index: int
    first_layer: int
    end_layer: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_memory_bytes: int
    num_blocks: int


@dataclass
class Plan:
    model: str
    params: int
    params_source: str
    # Parameters one token's forward multiplies (a MoE model: only its experts'); = params if dense.
    active_params: int
    dtype: str
    kv_dtype: str
    memory_bytes: int
    reserve_bytes: int
    weight_bytes: int
    kv_memory_bytes: int
    context: int
    block_size: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_bytes_per_sequence: int
    blocks_per_sequence: int
    num_blocks: int
    full_context_seqs: int
    classes: list[ClassCapacity] = field(default_factory=list)
    classes_total_memory_p50: int | None = None
    classes_total_memory_p95: int | None = None
    scenarios: list[Scenario] = field(default_factory=list)
    shape: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    quantization_group_size: int = INT4_GROUP_SIZE  # int4 weights: inputs per (scale, zero) pair
    # Pipeline parallelism: each stage on a device of `memory_bytes`; the pool is the smallest
    # stage's (every stage has the same block ids, a block holding every layer's KV across the
    # stages). Empty / 0 without stages.
    stages: list[StageMemory] = field(default_factory=list)
    stage_pool_blocks: int = 0
    stage_full_context_seqs: int = 0
    kv_pool_source: str = ""  # without --memory: the bytes serve's KV pool takes here, and why
    # A hybrid model's linear-attention state, per sequence, held in the KV memory beside its blocks.
    state_bytes_per_sequence: int = 0
    # A vision-language model's encoder cache (--encoder-cache-tokens image tokens of hidden_size
    # activations), held beside the KV pool, not inside its budget; 0 for a text model.
    encoder_cache_tokens: int = 0
    encoder_cache_bytes: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, num_kv_heads: int | None = None) -> int:
    """The engine's formula (the one ModelConfig.kv_bytes_per_token sizes the pool with) for a
    worksheet KV dtype."""
    if shape.kv_latent_dims is not None:
        latent_dim, rope_dim = shape.kv_latent_dims
        return latent_kv_bytes_per_token(
            shape.num_layers, latent_dim, rope_dim, KV_CACHE_DTYPE_OF[kv_dtype], DTYPE_BYTES[kv_dtype]
        )
    heads = shape.num_kv_heads if num_kv_heads is None else num_kv_heads
    return kv_cache_bytes_per_token(
        shape.num_kv_layers or shape.num_layers,
        heads,
        shape.head_dim,
        KV_CACHE_DTYPE_OF[kv_dtype],
        DTYPE_BYTES[kv_dtype],
    )


def weight_bytes(
    params: ParamCount, dtype: str, weight_quant: str | None = None, group_size: int = INT4_GROUP_SIZE
) -> int:
    """Decoder linears in `weight_quant` (int8/int4, as pagoda's weight formats store them) or
    `dtype`; embeddings, lm_head, norms and biases in `dtype`."""
    base = DTYPE_BYTES[dtype]
    linear_bytes = weight_bytes_per_parameter(weight_quant, base, group_size) if weight_quant else base
    return int(params.linear * linear_bytes + (params.embedding + params.lm_head + params.other) * base)


def _scenario(
    name: str,
    w_bytes: int,
    kv_token: int,
    context: int,
    block_size: int,
    memory: int,
    reserve: int,
    windows: tuple[int | None, ...] = (),
) -> Scenario:
    kv_memory = max(0, memory - reserve - w_bytes)
    num_blocks = kv_memory // (kv_token * block_size)
    return Scenario(
        name,
        w_bytes,
        kv_token,
        context,
        kv_memory,
        num_blocks,
        sequences_in_pool(windows, num_blocks, block_size, context),
    )


def sequences_in_pool(windows: tuple[int | None, ...], num_blocks: int, block_size: int, tokens: int) -> int:
    """Sequences of `tokens` tokens a pool of `num_blocks` blocks (of every layer) holds at once,
    the layers with a sliding window holding only their window's blocks (as the engine does)."""
    if all(w is None for w in windows):
        return sequences_that_fit(num_blocks, block_size, tokens)
    groups = kv_cache_groups(windows, release=True)
    pages = num_blocks * len(windows) // layers_per_page(groups)
    return pages // pages_per_sequence(groups, tokens, block_size)


def stage_memory(
    shape: ModelShape,
    params: ParamCount,
    *,
    num_stages: int,
    partition: list[int] | None,
    dtype: str,
    kv_dtype: str,
    block_size: int,
    memory_bytes: int,
    reserve_bytes: int,
    group_size: int,
) -> list[StageMemory]:
    """Each stage's weights (its share of the decoder layers, the embedding on the first, the final
    norm and LM head on the last; tied embeddings: the embedding on the last too) and the KV
    blocks its memory holds for its layers. Layers are counted alike (a MoE model's dense and
    sparse layers are averaged)."""
    from pagoda.model.pipeline import pipeline_stages  # imports torch: only when stages are asked for

    stages = pipeline_stages(shape.num_layers, num_stages, partition)
    kv_token = kv_bytes_per_token(shape, kv_dtype)
    per_layer_other = params.other - shape.hidden_size  # the final norm is the last stage's
    result = []
    for stage in stages:
        count = len(stage.layers)
        holds_embedding = stage.is_first or (stage.is_last and shape.tie_word_embeddings)
        stage_params = ParamCount(
            embedding=params.embedding if holds_embedding else 0,
            lm_head=params.lm_head if stage.is_last else 0,
            linear=params.linear * count // shape.num_layers,
            other=per_layer_other * count // shape.num_layers + (shape.hidden_size if stage.is_last else 0),
            source=params.source,
        )
        w_bytes = _configured_weight_bytes(stage_params, dtype, group_size)
        stage_kv_token = kv_token * count // shape.num_layers
        kv_memory = max(0, memory_bytes - reserve_bytes - w_bytes)
        result.append(
            StageMemory(
                stage.index,
                stage.first_layer,
                stage.end_layer,
                w_bytes,
                stage_kv_token,
                kv_memory,
                kv_memory // (stage_kv_token * block_size),
            )
        )
    return result


def parse_reserve(text: str, memory: int) -> int:
    text = text.strip()
    if text.endswith("%"):
        return int(memory * float(text[:-1]) / 100)
    return parse_bytes(text)


def build_plan(
    shape: ModelShape,
    params: ParamCount,
    *,
    model: str,
    memory_bytes: int,
    dtype: str,
    kv_dtype: str,
    context: int,
    block_size: int,
    reserve_bytes: int,
    classes: list[RequestClass],
    group_size: int | None = None,
    pipeline_parallel_size: int = 1,
    pp_layer_partition: list[int] | None = None,
    kv_pool_source: str = "",
) -> Plan:
    _check_knobs(context, block_size, kv_dtype, group_size)
    warnings = []
    group_size, group_warning = int4_group_size(shape, group_size)
    if group_warning and dtype == "int4":
        warnings.append(group_warning)
    if shape.max_position_embeddings and context > shape.max_position_embeddings:
        warnings.append(
            f"context {context} exceeds the model's max_position_embeddings {shape.max_position_embeddings}"
        )
    w_bytes = _configured_weight_bytes(params, dtype, group_size)
    kv_token = kv_bytes_per_token(shape, kv_dtype)
    windows = shape.layer_sliding_windows
    base = _scenario("as configured", w_bytes, kv_token, context, block_size, memory_bytes, reserve_bytes, windows)
    if base.kv_memory_bytes == 0:
        warnings.append("the weights and reserve do not leave any memory for the KV cache")
    block_bytes = kv_token * block_size
    stages, stage_pool_blocks = [], 0
    if pipeline_parallel_size > 1:
        stages = stage_memory(
            shape,
            params,
            num_stages=pipeline_parallel_size,
            partition=pp_layer_partition,
            dtype=dtype,
            kv_dtype=kv_dtype,
            block_size=block_size,
            memory_bytes=memory_bytes,
            reserve_bytes=reserve_bytes,
            group_size=group_size,
        )
        stage_pool_blocks = min(stage.num_blocks for stage in stages)
    class_rows = [
        _class_capacity(
            rc, context, block_size, block_bytes, base.num_blocks, warnings, windows, shape.image_tokens_per_image
        )
        for rc in classes
    ]
    # The classes with a target concurrency: _class_capacity sets their memory needs with it.
    needs_p50 = [row.memory_needed_p50 for row in class_rows if row.memory_needed_p50 is not None]
    needs_p95 = [row.memory_needed_p95 for row in class_rows if row.memory_needed_p95 is not None]
    blocks_per_seq = blocks_for(context, block_size)
    windows_elements, recurrent_elements = shape.linear_state_elements
    state_bytes = int(
        windows_elements * (2 if dtype in ("int8", "int4") else DTYPE_BYTES[dtype]) + recurrent_elements * 4
    )
    full_context_seqs = base.full_context_seqs
    if state_bytes:  # each sequence also holds its state, whatever its length
        full_context_seqs = min(full_context_seqs, base.kv_memory_bytes // (blocks_per_seq * block_bytes + state_bytes))
    return Plan(
        model=model,
        params=params.total,
        params_source=params.source,
        active_params=params.total - shape.idle_expert_params,
        dtype=dtype,
        kv_dtype=kv_dtype,
        memory_bytes=memory_bytes,
        reserve_bytes=reserve_bytes,
        weight_bytes=w_bytes,
        kv_memory_bytes=base.kv_memory_bytes,
        context=context,
        block_size=block_size,
        kv_bytes_per_token=kv_token,
        kv_bytes_per_block=block_bytes,
        kv_bytes_per_sequence=blocks_per_seq * block_bytes,
        blocks_per_sequence=blocks_per_seq,
        num_blocks=base.num_blocks,
        full_context_seqs=full_context_seqs,
        classes=class_rows,
        classes_total_memory_p50=sum(needs_p50) if needs_p50 else None,
        classes_total_memory_p95=sum(needs_p95) if needs_p95 else None,
        scenarios=[
            base,
            *_what_if_scenarios(
                shape,
                params,
                base,
                dtype=dtype,
                kv_dtype=kv_dtype,
                block_size=block_size,
                memory_bytes=memory_bytes,
                reserve_bytes=reserve_bytes,
                group_size=group_size,
            ),
        ],
        shape=dataclasses.asdict(shape),
        warnings=warnings,
        quantization_group_size=group_size,
        stages=stages,
        stage_pool_blocks=stage_pool_blocks,
        stage_full_context_seqs=sequences_in_pool(windows, stage_pool_blocks, block_size, context) if stages else 0,
        kv_pool_source=kv_pool_source,
        state_bytes_per_sequence=state_bytes,
        encoder_cache_tokens=ENCODER_CACHE_TOKENS if shape.vision else 0,
        encoder_cache_bytes=encoder_cache_bytes(shape, dtype) if shape.vision else 0,
    )


# The engine's --encoder-cache-tokens default.
ENCODER_CACHE_TOKENS: int = EngineConfig.encoder_cache_tokens


def encoder_cache_bytes(shape: ModelShape, dtype: str, tokens: int = ENCODER_CACHE_TOKENS) -> int:
    """A full encoder cache: one hidden-size row per image token, in the activations' dtype
    (bf16 beside int8/int4 weights)."""
    element = DTYPE_BYTES[dtype] if dtype in ("fp32", "bf16", "fp16") else 2.0
    return int(tokens * shape.hidden_size * element)


def int4_group_size(shape: ModelShape, group_size: int | None) -> tuple[int, str | None]:
    """The int4 group size the worksheet counts with, as the server chooses it: `group_size` when
    given, else the largest of 128, 64, 32 dividing every decoder linear's input (each layer
    takes its own; the smallest of theirs is counted, a slight overestimate); and a warning when
    the server would refuse it."""
    inputs = sorted({shape.hidden_size, shape.intermediate_size, shape.num_attention_heads * shape.head_dim})
    if group_size is not None:
        bad = [d for d in inputs if d % group_size]
        return group_size, (
            f"int4 group size {group_size} does not divide the layer input dimension(s) "
            f"{', '.join(map(str, bad))}: the server refuses it; leave --quantization-group-size "
            f"out to let each layer take the largest that divides it"
        ) if bad else None
    chosen = [int4_group_size_for(d) for d in inputs]
    fitting = [g for g in chosen if g is not None]
    if len(fitting) < len(chosen):
        bad = [d for d, g in zip(inputs, chosen) if g is None]
        return max(INT4_GROUP_SIZES), (
            f"no int4 group size ({', '.join(map(str, INT4_GROUP_SIZES))}) divides the "
            f"layer input dimension(s) {', '.join(map(str, bad))}: int4 cannot hold "
            f"this model; use int8"
        )
    return min(fitting), None


def _check_knobs(context: int, block_size: int, kv_dtype: str, group_size: int | None) -> None:
    if context < 1:
        raise ValueError(f"--context must be >= 1, got {context}")
    if block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {block_size}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if group_size is not None and group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"--quantization-group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size}"
        )


def _configured_weight_bytes(params: ParamCount, dtype: str, group_size: int) -> int:
    """int8/int4 name the decoder linears' format; everything else stays in bf16."""
    if dtype in ("int8", "int4"):
        return weight_bytes(params, "bf16", dtype, group_size)
    return weight_bytes(params, dtype)


def _class_capacity(
    rc: RequestClass,
    context: int,
    block_size: int,
    block_bytes: int,
    num_blocks: int,
    warnings: list[str],
    windows: tuple[int | None, ...] = (),
    image_tokens_per_image: int = 0,
) -> ClassCapacity:
    """How many requests of one class fit at p50 and p95, and what its target concurrency needs.
    Its images' tokens join its prompts (a model whose count varies with the image: warned)."""
    if rc.images and not image_tokens_per_image:
        warnings.append(
            f"class {rc.name}: this model's image tokens vary with the image (or it takes none); not counted"
        )
    image_tokens = rc.images * image_tokens_per_image
    p50_tokens = min(rc.p50_prompt + image_tokens + rc.p50_output, context)
    p95_tokens = min(rc.p95_prompt + image_tokens + rc.p95_output, context)
    if rc.p95_prompt + image_tokens + rc.p95_output > context:
        warnings.append(f"class {rc.name}: p95 prompt+output exceeds the context {context}; clipped")
    p50_blocks, p95_blocks = blocks_for(p50_tokens, block_size), blocks_for(p95_tokens, block_size)
    need50 = need95 = mem50 = mem95 = None
    if rc.concurrency is not None:
        need50, need95 = rc.concurrency * p50_blocks, rc.concurrency * p95_blocks
        mem50, mem95 = need50 * block_bytes, need95 * block_bytes
    return ClassCapacity(
        rc.name,
        p50_tokens,
        p95_tokens,
        p50_blocks,
        p95_blocks,
        sequences_in_pool(windows, num_blocks, block_size, p50_tokens),
        sequences_in_pool(windows, num_blocks, block_size, p95_tokens),
        rc.concurrency,
        need50,
        need95,
        mem50,
        mem95,
    )


def _what_if_scenarios(
    shape: ModelShape,
    params: ParamCount,
    base: Scenario,
    *,
    dtype: str,
    kv_dtype: str,
    block_size: int,
    memory_bytes: int,
    reserve_bytes: int,
    group_size: int = INT4_GROUP_SIZE,
) -> list[Scenario]:
    """Each lever alone: quantized weights, a smaller KV dtype, a shorter context, GQA."""
    base_dtype = "bf16" if dtype in ("int8", "int4") else dtype
    context = base.context

    def scenario(
        name: str, *, w: int = base.weight_bytes, kv: int = base.kv_bytes_per_token, ctx: int = context
    ) -> Scenario:
        return _scenario(name, w, kv, ctx, block_size, memory_bytes, reserve_bytes, shape.layer_sliding_windows)

    scenarios = []
    for quant in ("int8", "int4"):
        if DTYPE_BYTES[quant] < DTYPE_BYTES[dtype]:
            scenarios.append(scenario(f"weights {quant}", w=weight_bytes(params, base_dtype, quant, group_size)))
    for quant in ("fp8", "int8"):
        if DTYPE_BYTES[quant] < DTYPE_BYTES[kv_dtype]:
            scenarios.append(scenario(f"KV cache {quant}", kv=kv_bytes_per_token(shape, quant)))
    for divisor in (2, 4):
        if context // divisor >= block_size:
            scenarios.append(scenario(f"context {context // divisor}", ctx=context // divisor))
    if shape.is_mha and shape.kv_latent_dims is None:
        for group in (4, 8):
            kv_heads = shape.num_attention_heads // group
            if kv_heads >= 1 and shape.num_attention_heads % group == 0:
                scenarios.append(scenario(f"GQA {kv_heads} KV heads", kv=kv_bytes_per_token(shape, kv_dtype, kv_heads)))
    return scenarios


# ---- loading and rendering -----------------------------------------------------------------


def load_model(model: str) -> tuple[ModelShape, ParamCount]:
    """A model directory, its config.json, or a GGUF file (its metadata; parameters from the architecture)."""
    from pagoda.model.families.base import gguf_config
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint, find_gguf_file

    path = Path(model)
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        shape = model_shape_from_config(gguf_config(GGUFCheckpoint(gguf_file)), str(gguf_file))
        return shape, count_params_from_architecture(shape)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ValueError(f"no config.json at {config_path}; pass a model directory or its config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    shape = model_shape_from_config(config, str(config_path))
    weight_files = find_safetensors(config_path.parent)
    params = count_params_from_safetensors(weight_files) if weight_files else count_params_from_architecture(shape)
    return shape, params


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _kv_vector(kv_dtype: str, head_dim: int) -> str:
    """One head's key (or value) vector as the cache stores it."""
    if KV_CACHE_DTYPE_OF[kv_dtype] == "auto":
        return f"{head_dim} x {DTYPE_BYTES[kv_dtype]:g} B {kv_dtype}"
    return f"({head_dim} x 1 B + {KV_SCALE_BYTES} B scale) {kv_dtype}"


def _kv_per_token(kv_dtype: str, shape: dict[str, Any]) -> str:
    """What one token's KV bytes are made of."""
    latent = shape.get("kv_latent_dims")
    if latent:
        return (
            f"{shape['num_layers']} layers x latent {_kv_vector(kv_dtype, latent[0])} + rope key "
            f"{_kv_vector(kv_dtype, latent[1])}, shared by the {shape['num_attention_heads']} heads"
        )
    vector = _kv_vector(kv_dtype, shape["head_dim"])
    kv_layers = shape.get("num_kv_layers") or shape["num_layers"]  # a hybrid's recurrent and MLP-only layers keep none
    return f"{kv_layers} layers x 2 x {shape['num_kv_heads']} KV heads x {vector}"


def _sliding_window_lines(shape: dict[str, Any]) -> list[str]:
    windows = [w for w in shape.get("layer_sliding_windows") or () if w is not None]
    if not windows:
        return []
    return [
        f"sliding windows  {len(windows)} of {shape['num_layers']} layers keep only the KV of their last "
        f"{', '.join(map(str, sorted(set(windows))))} tokens (blocks behind are released)"
    ]


def render_plan(plan: Plan) -> str:
    s = plan.shape
    out = [
        f"model            {plan.model}",
        f"architecture     {s['model_type']}: {s['num_layers']} layers, hidden {s['hidden_size']}, "
        f"{s['num_attention_heads']} heads / {s['num_kv_heads']} KV heads x {s['head_dim']}, "
        f"vocab {s['vocab_size']}{', tied embeddings' if s['tie_word_embeddings'] else ''}",
        f"parameters       {plan.params:,} ({fmt_count(plan.params)}, from {plan.params_source})",
        *(
            [
                f"active per token {plan.active_params:,} ({fmt_count(plan.active_params)}: "
                f"{s['experts_per_token']} of "
                f"{s['num_experts']} experts in {s['num_moe_layers']} MoE layers; the weights hold them all)"
            ]
            if s.get("num_experts")
            else []
        ),
        f"weights          {fmt_bytes(plan.weight_bytes)}"
        + (f" = {plan.weight_bytes / 1e9:.2f} GB" if plan.weight_bytes >= 10**7 else "")
        + f" in {plan.dtype}"
        + (" (decoder linears; the rest bf16)" if plan.dtype in ("int8", "int4") else ""),
        f"memory           {fmt_bytes(plan.memory_bytes)}, minus {fmt_bytes(plan.reserve_bytes)} reserved for "
        f"activations/overhead, minus weights = {fmt_bytes(plan.kv_memory_bytes)} for the KV cache",
        *([f"KV pool          {plan.kv_pool_source}"] if plan.kv_pool_source else []),
        f"KV per token     {plan.kv_bytes_per_token:,} bytes ({_kv_per_token(plan.kv_dtype, s)})",
        f"KV per block     {fmt_bytes(plan.kv_bytes_per_block)} ({plan.block_size} tokens)",
        f"KV per sequence  {fmt_bytes(plan.kv_bytes_per_sequence)} at context {plan.context} "
        f"({plan.blocks_per_sequence} blocks)",
        f"KV blocks        {plan.num_blocks:,} ({plan.num_blocks * plan.block_size:,} tokens)",
        *_sliding_window_lines(s),
        *(
            [
                f"state per seq    {fmt_bytes(plan.state_bytes_per_sequence)} ({s['num_linear_layers']} "
                f"recurrent layers: a convolution window and a recurrent state each, "
                f"whatever the length; counted below; prefix caching adds one snapshot of it per sequence)"
            ]
            if plan.state_bytes_per_sequence
            else []
        ),
        f"full-context sequences that fit at once: {plan.full_context_seqs:,}",
        *(
            [
                "images           "
                + (
                    f"{s['image_tokens_per_image']} image tokens per image"
                    if s["image_tokens_per_image"]
                    else "image tokens per image vary with its size"
                )
                + f"; encoder cache up to {fmt_bytes(plan.encoder_cache_bytes)} "
                f"({plan.encoder_cache_tokens:,} image tokens x hidden {s['hidden_size']}), beside the KV pool"
            ]
            if s.get("vision")
            else []
        ),
        "",
    ]
    if plan.stages:
        out.append(
            f"pipeline stages, each on its own {fmt_bytes(plan.memory_bytes)} device: the KV pool is the "
            f"smallest stage's, {plan.stage_pool_blocks:,} blocks of every layer, "
            f"{plan.stage_full_context_seqs:,} full-context sequences at once"
        )
        out.append(
            _table(
                ["stage", "layers", "weights", "KV B/token", "KV memory", "blocks"],
                [
                    [
                        str(st.index),
                        f"{st.first_layer}-{st.end_layer - 1}",
                        fmt_bytes(st.weight_bytes),
                        f"{st.kv_bytes_per_token:,}",
                        fmt_bytes(st.kv_memory_bytes),
                        f"{st.num_blocks:,}",
                    ]
                    for st in plan.stages
                ],
            )
        )
        out.append("")
    if plan.classes:
        rows = []
        for c in plan.classes:
            rows.append(
                [
                    c.name,
                    f"{c.p50_tokens}/{c.p95_tokens}",
                    f"{c.p50_blocks}/{c.p95_blocks}",
                    f"{c.fits_at_p50:,}/{c.fits_at_p95:,}",
                    "-" if c.target_concurrency is None else str(c.target_concurrency),
                    "-" if c.blocks_needed_p95 is None else f"{c.blocks_needed_p50:,}/{c.blocks_needed_p95:,}",
                    "-"
                    if c.memory_needed_p95 is None
                    else f"{fmt_bytes(c.memory_needed_p50)}/{fmt_bytes(c.memory_needed_p95)}",
                ]
            )
        out.append("request classes (p50/p95; tokens = prompt + image tokens + output, each class alone in the cache)")
        out.append(
            _table(["class", "tokens", "blocks/req", "fit at once", "target", "blocks needed", "KV needed"], rows)
        )
        total_p50, total_p95 = plan.classes_total_memory_p50, plan.classes_total_memory_p95
        if total_p50 is not None and total_p95 is not None:  # set together, with any class's target
            verdict = (
                "fits"
                if total_p95 <= plan.kv_memory_bytes
                else ("fits at p50 only" if total_p50 <= plan.kv_memory_bytes else "does NOT fit")
            )
            out.append(
                f"all targets together need {fmt_bytes(total_p50)} (p50) / "
                f"{fmt_bytes(total_p95)} (p95) of KV cache "
                f"of {fmt_bytes(plan.kv_memory_bytes)}: {verdict}"
            )
        out.append("")
    rows = [
        [
            sc.name,
            fmt_bytes(sc.weight_bytes),
            f"{sc.kv_bytes_per_token:,}",
            str(sc.context),
            fmt_bytes(sc.kv_memory_bytes),
            f"{sc.num_blocks:,}",
            f"{sc.full_context_seqs:,}",
            f"{sc.full_context_seqs / plan.full_context_seqs:.2f}x" if plan.full_context_seqs else "-",
        ]
        for sc in plan.scenarios
    ]
    out.append("what if")
    out.append(
        _table(
            ["scenario", "weights", "KV B/token", "context", "KV memory", "blocks", "full-context seqs", "vs now"], rows
        )
    )
    out.append(
        f"(int4 = 4-bit decoder linears + an fp16 (scale, zero) pair per {plan.quantization_group_size} "
        "inputs; embeddings, lm_head and norms stay in the model dtype; fp8/int8 KV = 1 byte per "
        "element + a 4-byte scale per head vector)"
    )
    for w in plan.warnings:
        out.append(f"warning: {w}")
    return "\n".join(out)


# ---- from options to a plan -------------------------------------------------------------------


@dataclass
class PlanOptions:
    """What `pagoda plan` is asked: the model, the memory, and the knobs that change the answer."""

    model: str  # model directory or its config.json
    # accelerator memory, e.g. 80GiB; None: the KV pool `pagoda serve` allocates on this machine
    # (--kv-cache-memory), with the dtype it runs here
    memory: str | None = None
    kv_cache_memory: str | None = None  # with memory None: serve's --kv-cache-memory (default: serve's)
    kv_cache_memory_share: float | None = None  # with memory None: serve's --kv-cache-memory-share
    dtype: str | None = None  # weight dtype (default: the config's, else bf16)
    kv_dtype: str | None = None  # default: the weight dtype, or bf16 if that is quantized
    context: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    reserve: str = "10%"  # percentage of memory or bytes
    classes: list[str] | None = None  # request class specs; default: DEFAULT_CLASSES
    quantization_group_size: int | None = None  # int4 weights (--dtype int4): inputs per scale/zero (None: as
    # the server chooses, the largest of 128/64/32 dividing each layer)
    pipeline_parallel_size: int = 1  # stages, each on a device of `memory`
    pp_layer_partition: str | None = None  # layers per stage, e.g. "3,5" (None: an even split)


def plan_from_options(options: PlanOptions) -> Plan:
    shape, params = load_model(options.model)
    if options.memory is None:
        return _serving_plan(options, shape, params)
    dtype = normalize_dtype(options.dtype) if options.dtype else (shape.config_dtype or "bf16")
    if dtype == "fp8":
        raise ValueError("--dtype fp8 is not supported for weights; use int8 or int4")
    if options.kv_dtype:
        kv_dtype = normalize_dtype(options.kv_dtype)
    else:
        kv_dtype = dtype if dtype in KV_DTYPES and dtype not in ("int8",) else "bf16"
    memory = parse_bytes(options.memory)
    context = options.context or shape.max_position_embeddings
    if options.classes:
        classes = [parse_request_class(spec) for spec in options.classes]
    else:
        classes = [RequestClass(name, *lengths) for name, lengths in DEFAULT_CLASSES.items()]
    return build_plan(
        shape,
        params,
        model=options.model,
        memory_bytes=memory,
        dtype=dtype,
        kv_dtype=kv_dtype,
        context=context,
        block_size=options.block_size,
        reserve_bytes=parse_reserve(options.reserve, memory),
        classes=classes,
        group_size=options.quantization_group_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        pp_layer_partition=_layer_counts(options.pp_layer_partition),
    )


def _serving_plan(options: PlanOptions, shape: ModelShape, params: ParamCount) -> Plan:
    """The plan of what `pagoda serve` runs on this machine with these flags: its dtype, its KV
    dtype and the KV pool it allocates (the numbers its banner prints)."""
    # Values as given: EngineConfig checks each flag's choices itself (check_choices), as serve's do.
    flags: dict[str, Any] = {
        "dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(
            normalize_dtype(options.dtype), options.dtype
        )
        if options.dtype
        else "auto",
        "block_size": options.block_size,
        "max_model_len": options.context,
    }
    if options.kv_cache_memory:
        flags["kv_cache_memory"] = options.kv_cache_memory
    if options.kv_cache_memory_share is not None:
        flags["kv_cache_memory_share"] = options.kv_cache_memory_share
    engine = EngineConfig(model=options.model, **flags)
    dtype = serving_dtype(engine.dtype, shape.config_dtype, engine.device)
    kv_dtype = normalize_dtype(options.kv_dtype) if options.kv_dtype else serving_kv_dtype("auto", dtype)
    context = options.context or shape.max_position_embeddings
    group_size, _ = int4_group_size(shape, options.quantization_group_size)
    kv_token = kv_bytes_per_token(shape, kv_dtype)
    weights = _configured_weight_bytes(params, dtype, group_size)
    kv_memory = serving_kv_memory(engine, weights)
    blocks = serving_pool_blocks(engine, kv_token, context, kv_memory.bytes)
    pool = blocks * kv_token * options.block_size
    memory = weights + pool
    classes = (
        [parse_request_class(spec) for spec in options.classes]
        if options.classes
        else [RequestClass(name, *lengths) for name, lengths in DEFAULT_CLASSES.items()]
    )
    return build_plan(
        shape,
        params,
        model=options.model,
        memory_bytes=memory,
        dtype=dtype,
        kv_dtype=kv_dtype,
        context=context,
        block_size=options.block_size,
        reserve_bytes=0,
        classes=classes,
        group_size=options.quantization_group_size,
        kv_pool_source=f"{fmt_bytes(kv_memory.bytes)}: {kv_memory.describe()}"
        + (f", of which {blocks:,} blocks are of use (--max-num-seqs x the context)" if pool < kv_memory.bytes else ""),
    )


def _layer_counts(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--pp-layer-partition must be comma-separated layer counts like 3,5, got {text!r}") from None


# ---- several models on one machine (pagoda serve --models) -------------------------------------


@dataclass(frozen=True)
class ModelNeed:
    """What one model of a models file needs as `pagoda serve` would run it: its engines' weights
    in the dtype serve resolves on this machine, and the KV pool serve allocates for each
    (--kv-cache-memory, or --num-kv-blocks blocks)."""

    name: str
    line: int  # where the models file names it
    model: str
    dtype: str
    context: int
    engines: int  # replicas; tensor-parallel ranks share one replica's weights
    weight_bytes: int
    kv_bytes: int  # one engine's KV pool

    @property
    def total_bytes(self) -> int:
        return self.engines * (self.weight_bytes + self.kv_bytes)


def serving_dtype(dtype: str, config_dtype: str | None, device: str) -> str:
    """The weight dtype `pagoda serve` runs (as plan names dtypes): --dtype, or with auto the
    engine's rule (engine_core.resolve_dtype: float32 on CPU, the config's on a GPU)."""
    from pagoda.engine.assembly import resolve_device, resolve_dtype

    hf_names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    resolved = resolve_dtype(
        dtype if dtype == "auto" else hf_names.get(normalize_dtype(dtype), dtype),
        hf_names.get(config_dtype or ""),
        resolve_device(device),
    )
    return normalize_dtype(str(resolved))


def serving_kv_dtype(kv_cache_dtype: str, weight_dtype: str) -> str:
    """--kv-cache-dtype as plan names it: auto stores the KV in the weights' dtype."""
    if kv_cache_dtype == "auto":
        return weight_dtype if weight_dtype in KV_DTYPES and weight_dtype != "int8" else "bf16"
    return normalize_dtype(kv_cache_dtype)


def serving_kv_memory(engine: EngineConfig, weight_bytes: int) -> KVMemory:
    """The bytes serve's KV pool may take on this machine now (pagoda.core.kv_memory):
    --kv-cache-memory, or the share of what is free less the weights, which are not loaded yet."""
    from pagoda.engine.assembly import resolve_device

    if engine.kv_cache_bytes is not None or engine.num_kv_blocks is not None:
        return kv_pool_memory(engine.cache, None)
    free = free_memory_bytes(resolve_device(engine.device)) - weight_bytes * engine.tensor_parallel_size
    return kv_pool_memory(engine.cache, free, parts=engine.num_replicas)


def serving_pool_blocks(engine: EngineConfig, kv_token: int, context: int, pool_bytes: int) -> int:
    """The KV blocks the engine allocates for these settings (pagoda.core.kv_plan.num_kv_blocks):
    --num-kv-blocks, else `pool_bytes`' worth (serving_kv_memory), at most what --max-num-seqs
    sequences of the full context can use."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    blocks = pool_bytes // (kv_token * engine.block_size)
    one_group = kv_cache_groups([None], release=False)  # every layer's blocks together, as plan counts them
    return min(
        blocks,
        engine.max_num_seqs_bound
        * pages_per_sequence(one_group, context, engine.block_size, engine.max_num_batched_tokens),
    )


def serving_weight_bytes(engine: EngineConfig) -> int:
    """The bytes of the weights serve loads with these settings, in the dtype it runs here."""
    shape, params = load_model(engine.model)
    weight_dtype = serving_dtype(engine.dtype, shape.config_dtype, engine.device)
    return weight_bytes(params, weight_dtype, engine.quantization if engine.quantization in ("int8", "int4") else None)


def model_need(name: str, line: int, engine: EngineConfig, *, engines: int) -> ModelNeed:
    """One model of a models file, with the engine settings serve would give it."""
    shape, _ = load_model(engine.model)
    weight_dtype = serving_dtype(engine.dtype, shape.config_dtype, engine.device)
    context = engine.max_model_len or shape.max_position_embeddings or 2048
    kv_token = kv_bytes_per_token(shape, serving_kv_dtype(engine.kv_cache_dtype, weight_dtype))
    weights = serving_weight_bytes(engine)
    pool_bytes = serving_kv_memory(engine, weights).bytes
    kv_bytes = serving_pool_blocks(engine, kv_token, context, pool_bytes) * engine.block_size * kv_token
    return ModelNeed(name, line, engine.model, weight_dtype, context, engines, weights, kv_bytes)


@dataclass(frozen=True)
class ModelsFit:
    needs: list[ModelNeed]
    memory_bytes: int
    reserve_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(need.total_bytes for need in self.needs)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.memory_bytes - self.reserve_bytes

    def describe(self, path: str, separator: str = "\n") -> str:
        """A line per model (its file line, engines and memory), the total and the verdict."""
        lines = [
            f"{path}:{need.line}: {need.name}: {need.engines} x ({fmt_bytes(need.weight_bytes)} weights "
            f"in {need.dtype} + {fmt_bytes(need.kv_bytes)} KV pool, {need.context}-token context) "
            f"= {fmt_bytes(need.total_bytes)}"
            for need in self.needs
        ]
        usable = self.memory_bytes - self.reserve_bytes
        verdict = "fit" if self.fits else "do NOT fit"
        lines.append(
            f"total {fmt_bytes(self.total_bytes)} of {fmt_bytes(usable)} usable "
            f"({fmt_bytes(self.memory_bytes)} less {fmt_bytes(self.reserve_bytes)} reserve): "
            f"the models {verdict}"
        )
        return separator.join(lines)


def machine_memory_bytes(device: str) -> int:
    """What the engines' device offers: every visible GPU's memory, or the host's RAM."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
