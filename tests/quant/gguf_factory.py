"""Write a tiny Hugging Face test model as a GGUF file, the way llama.cpp's
convert_hf_to_gguf.py does: llama.cpp tensor names, Llama q/k rows permuted for its rope,
1-D tensors and MoE routers in F32, other tensors in the requested type (F16 where a row does
not fit the type's blocks), the tokenizer in the metadata. MoE models (Mixtral as `llama`,
Qwen2-MoE, Qwen3-MoE) get the expert metadata and each layer's experts stacked per projection
(`ffn_gate_exps` [E, I, H], ...), or gate and up fused (`ffn_gate_up_exps`) as with the
converter's --fuse-gate-up-exps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
# One expert's projection in the checkpoint: (layer, expert, projection) -> its stacked GGUF kind.
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_KINDS = {
    "gate_proj": "ffn_gate_exps",
    "w1": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "w3": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w2": "ffn_down_exps",
}
_F32_KINDS = ("ffn_gate_inp", "ffn_gate_inp_shexp")


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        parts = stem.split(".", 3)
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}.{suffix}"
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


# Bytes per 256-value block and the offsets of its float16 scales, for K-quants the gguf package
# cannot quantize: tests fill such tensors with random codes and known scales.
K_QUANT_LAYOUTS = {
    "Q2_K": (84, (80, 82)),
    "Q3_K": (110, (108,)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
    "IQ4_XS": (136, (0,)),
    "IQ2_XXS": (66, (0,)),  # a type without a native product
}


def random_k_quant(rows: int, columns: int, type_name: str, seed: int, scale: float = 0.002) -> np.ndarray:
    """Valid `type_name` data [rows, bytes] with random codes and float16 scales `scale`."""
    block_bytes, scale_offsets = K_QUANT_LAYOUTS[type_name]
    blocks = np.random.default_rng(seed).integers(0, 256, (rows * columns // 256, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        blocks[:, offset : offset + 2] = np.full((blocks.shape[0], 1), scale, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _stack_experts(tensors: dict[str, np.ndarray], fuse_gate_up: bool) -> dict[str, np.ndarray]:
    """Per-expert checkpoint tensors replaced by one [E, out, in] tensor per layer and projection
    under its GGUF name (the converter's merge), in the checkpoint's order otherwise."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, values in tensors.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = values
            continue
        layer, expert, projection = match.groups()
        gguf_name = f"blk.{layer}.{_EXPERT_KINDS[projection]}.weight"
        if gguf_name not in stacks:
            stacks[gguf_name] = {}
            out[gguf_name] = None  # keeps the position of the layer's first expert
        stacks[gguf_name][int(expert)] = values
    for gguf_name, experts in stacks.items():
        out[gguf_name] = np.stack([experts[e] for e in range(len(experts))])
    if fuse_gate_up:
        for gguf_name in [n for n in out if n.endswith(".ffn_gate_exps.weight")]:
            up = out.pop(gguf_name.replace("ffn_gate_exps", "ffn_up_exps"))
            out[gguf_name.replace("ffn_gate_exps", "ffn_gate_up_exps")] = np.concatenate([out.pop(gguf_name), up], 1)
    return out


def write_gguf(
    model_dir: Path,
    path: Path,
    tensor_type: str = "F32",
    k_quants: dict[str, str] | None = None,
    omit: tuple[str, ...] = (),
    fuse_gate_up: bool = False,
    k_quant_scale: float = 0.002,
) -> Path:
    """`k_quants` maps llama.cpp tensor kinds (e.g. "ffn_down") to a K-quant type filled by
    `random_k_quant` (seeded by the tensor's position, its float16 scales `k_quant_scale`) instead
    of the model's weights. `omit`:
    GGUF tensor names left out (a broken file)."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    arch = _ARCHITECTURES[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(model_dir.name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size") is not None:
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    qtype = gguf.GGMLQuantizationType[tensor_type]
    writer.add_file_type({"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}.get(tensor_type, 0))

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config.get("pad_token_id") or 0)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])

    tensors = _stack_experts(load_file(str(model_dir / "model.safetensors")), fuse_gate_up)
    for index, (name, values) in enumerate(tensors.items()):
        values = values.astype(np.float32)
        gguf_name = name if name.startswith("blk.") else _gguf_name(name)
        if gguf_name in omit:
            continue
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if k_quants and kind in k_quants:
            k_type = gguf.GGMLQuantizationType[k_quants[kind]]
            writer.add_tensor(
                gguf_name,
                random_k_quant(*values.shape, k_quants[kind], seed=index, scale=k_quant_scale),
                raw_dtype=k_type,
            )
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            values = _permute(values, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            values = _permute(values, kv_heads)
        if values.ndim >= 2 and tensor_type != "F32" and kind not in _F32_KINDS:
            try:
                writer.add_tensor(gguf_name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
            except gguf.QuantError:  # rows not a multiple of the block: F16, as the converter falls back
                writer.add_tensor(gguf_name, values.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
