"""GGUF checkpoints (llama.cpp's format): config from the metadata, tensors by their HF names.

What every decoder's GGUF shares is read here: the metadata of its shape and the tensors under the
names a family's GGUFLayout gives them; each family (pagoda.model.families) adds what is its own
(biases, experts, which transformers architecture the file is).

Read with the `gguf` package. Where the engine runs the native kernels, a file with quantized
projections is served from its own bytes (`GGUFBlockWeight`): each projection, the LM head and the
token embedding keep their ggml blocks as stored (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K..Q6_K,
IQ4_XS; `GGUF_BLOCK_TYPES`), each tensor in its own type, and the native products multiply them
as llama.cpp does; tensors of any other type are dequantized to float32 at load, named in one
log line. Without the native kernels: F32/F16/BF16 as they are; Q4_0 maps exactly onto pagoda's
int4 format (group 32, w = d * (q - 8): codes q, scale d, zero 0); every other type the package
can dequantize is dequantized to the model dtype at load and logged (re-quantize with
`--quantization int8|int4` if wanted).

llama.cpp permutes the rows of Llama's q/k projections (its rope pairs adjacent dimensions,
transformers' rotates halves; convert_hf_to_gguf.py `LlamaModel.permute`): undone here for the
layouts that say so (`GGUFLayout.permuted_qk`), as transformers' GGUF loader does. Qwen2/Qwen3 are
stored unpermuted.

Mixture-of-experts files (Mixtral, Qwen2-MoE, Qwen3-MoE; pagoda.quant.gguf_moe) stack each
projection of a layer's experts in one tensor: it is cut into one tensor per expert under the
expert's HF name, dequantized (or, Q4_0, kept as codes) one expert at a time.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagoda.gguf_layout import check_gguf_layout
from pagoda.quant.gguf_moe import STACKED_EXPERT_TENSORS, expert_tensor_kind
from pagoda.quant.weight_formats import (
    GGUF_BLOCK_TYPES,
    GGUF_FLOAT,
    FullWeight,
    GGUFBlocks,
    GGUFBlockWeight,
    Int4Weight,
    WeightFormat,
)

logger = logging.getLogger(__name__)

_PLAIN_TYPES = ("F32", "F16", "BF16")
# llama.cpp's names of a decoder layer's tensors (blk.N.<kind>) -> pagoda's (model.layers.N.<name>).
DECODER_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Decoder projections: the tensors whose type picks the weight format.
_PROJECTION_KINDS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    *STACKED_EXPERT_TENSORS,
)
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFLayout:
    """Where one GGUF architecture's tensors go: its layer tensors' names (stacked experts are
    always read, pagoda.quant.gguf_moe), and whether llama.cpp permuted its q/k rows."""

    layer_tensors: Mapping[str, str] = field(default_factory=lambda: dict(DECODER_LAYER_TENSORS))
    permuted_qk: bool = False


def find_gguf_file(path: str | Path) -> Path | None:
    """`path` itself when it is a .gguf file, the one .gguf in a directory without safetensors,
    else None. Several .gguf files in one directory: ValueError (which one is meant?)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" or _has_gguf_magic(path) else None
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(
            f"{path}: holds several GGUF files ({', '.join(p.name for p in found)}); pass one of them as --model"
        )
    return found[0] if found else None


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"


@dataclass
class GGUFTensor:
    hf_name: str
    type_name: str
    tensor: torch.Tensor | None  # float values (None for Q4_0 kept as codes, or for blocks)
    # Q4_0 kept as int4 codes (codes [N, K] 0..15, scales [N, K/32])
    int4_codes: tuple[torch.Tensor, torch.Tensor] | None = None
    blocks: GGUFBlocks | None = None  # the tensor as the file stores it (GGUFBlockWeight)


class GGUFCheckpoint:
    """An opened GGUF file. Raises ValueError naming the file for anything it cannot serve."""

    def __init__(self, path: str | Path) -> None:
        found = find_gguf_file(path)
        if found is None:
            raise ValueError(f"{path}: not a GGUF file")
        self.path = found
        try:
            import gguf
        except ImportError:
            raise ValueError(f"{self.path}: reading GGUF needs the `gguf` package (pip install gguf)") from None
        self._gguf = gguf
        check_gguf_layout(self.path)  # every count and offset against the file's size, first
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as error:  # the reader raises ValueError, IndexError, struct/numpy errors on bad bytes
            raise ValueError(
                f"{self.path}: not a readable GGUF file, corrupt or truncated ({type(error).__name__}: {error})"
            ) from None
        self.architecture = self._string("general.architecture")
        self.tensors = {t.name: t for t in self.reader.tensors}
        dequantizable = _dequantizable_type_names()
        for tensor in self.reader.tensors:
            type_name = tensor.tensor_type.name
            if type_name not in _PLAIN_TYPES and type_name != "Q4_0" and type_name not in dequantizable:
                raise ValueError(
                    f"{self.path}: tensor {tensor.name!r} has type {type_name}, which pagoda "
                    f"cannot read; supported: {', '.join(self.supported_types())}"
                )

    # ---- metadata ---------------------------------------------------------------------------

    def _field(self, key: str) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except Exception as error:
            raise ValueError(f"{self.path}: metadata {key!r} is unreadable ({error})") from None

    def _string(self, key: str) -> str:
        value = self._field(key)
        if value is None:
            raise ValueError(f"{self.path}: missing metadata {key!r}")
        return str(value)

    def arch_value(self, key: str, default: Any = None) -> Any:
        """The architecture's metadata `<general.architecture>.<key>`, or `default`."""
        value = self._field(f"{self.architecture}.{key}")
        return default if value is None else value

    def decoder_config(self, experts_may_stand_in: bool = False) -> dict[str, Any]:
        """The transformers-style config.json keys of the decoder's shape, from the metadata
        every architecture writes; a family adds its own (`architectures` among them).
        experts_may_stand_in: a MoE architecture, whose `feed_forward_length` only dense layers
        (mlp_only_layers) use, and whose experts' size stands in where it is absent."""
        required = {
            "block_count": "num_hidden_layers",
            "embedding_length": "hidden_size",
            "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads",
        }
        if experts_may_stand_in and self.arch_value("feed_forward_length") is None:
            required["expert_feed_forward_length"] = required.pop("feed_forward_length")
        config: dict[str, Any] = {}
        for key, name in required.items():
            value = self.arch_value(key)
            if value is None:
                raise ValueError(f"{self.path}: missing metadata {self.architecture}.{key}")
            config[name] = int(value)
        config["num_key_value_heads"] = int(self.arch_value("attention.head_count_kv", config["num_attention_heads"]))
        head_dim = self.arch_value("attention.key_length") or self.arch_value("rope.dimension_count")
        if head_dim is not None:
            config["head_dim"] = int(head_dim)
        config["max_position_embeddings"] = int(self.arch_value("context_length", 2048))
        config["rope_theta"] = float(self.arch_value("rope.freq_base", 10000.0))
        config["rms_norm_eps"] = float(self.arch_value("attention.layer_norm_rms_epsilon", 1e-6))
        if "rope_freqs.weight" in self.tensors or self.arch_value("rope.scaling.type") not in (None, "none"):
            raise ValueError(
                f"{self.path}: GGUF rope scaling (rope_freqs / rope.scaling.type) is not "
                f"supported yet; pagoda reads unscaled rope from GGUF"
            )
        embeddings = self.tensors.get("token_embd.weight")
        if embeddings is None:
            raise ValueError(f"{self.path}: missing tensor 'token_embd.weight'")
        config["vocab_size"] = int(embeddings.shape[1])  # GGUF shapes list the fastest dimension first
        config["tie_word_embeddings"] = "output.weight" not in self.tensors
        config["attention_bias"] = False  # a family whose files may carry one reads it
        eos = self._field("tokenizer.ggml.eos_token_id")
        if eos is not None:
            config["eos_token_id"] = int(eos)
        return config

    # ---- tensors ----------------------------------------------------------------------------

    @classmethod
    def supported_types(cls) -> list[str]:
        import gguf

        dequantizable = [
            t.name
            for t in gguf.GGMLQuantizationType
            if t.name not in _PLAIN_TYPES and t.name in _dequantizable_type_names()
        ]
        return list(_PLAIN_TYPES) + sorted(set(dequantizable) | {"Q4_0"})

    def linear_types(self) -> set[str]:
        """Tensor types of the decoder's projection weights (what the weight format is chosen from)."""
        return {
            t.tensor_type.name
            for name, t in self.tensors.items()
            if name.startswith("blk.")
            and name.endswith(".weight")
            and t.data.ndim in (2, 3)
            and name.split(".")[2] in _PROJECTION_KINDS
        }

    def has_quantized_projections(self) -> bool:
        """Whether some decoder projection is stored in a quantized type (not F32/F16/BF16)."""
        return bool(self.linear_types() - set(_PLAIN_TYPES))

    def iterate(
        self, config: dict[str, Any], layout: GGUFLayout, keep_q4_0_codes: bool, keep_blocks: bool = False
    ) -> Iterator[GGUFTensor]:
        """Every tensor under its Hugging Face name (`layout`'s). With `keep_blocks` (GGUFBlockWeight),
        projection weights and the LM head come as `GGUFBlocks` (a type without a native product, or
        F16/F32, as float32 rows), the token embedding too where its type has one; else Q4_0 projection
        weights come as int4 codes when `keep_q4_0_codes`, other quantized types dequantized to float32."""
        dequantized: list[tuple[str, str, int]] = []  # (name, type, bytes as stored)
        for name, tensor in self.tensors.items():
            type_name = tensor.tensor_type.name
            # None: a stacked experts tensor, read one HF tensor per expert
            hf_name = None if expert_tensor_kind(name) is not None else self._hf_name(name, layout)
            is_projection = hf_name is None or hf_name.endswith("_proj.weight")
            native_type = type_name in GGUF_BLOCK_TYPES
            # As blocks: every projection and the head (float rows where no product exists), the
            # embedding where its type has one (else as the float weight it is).
            in_blocks = keep_blocks and (
                is_projection or hf_name == "lm_head.weight" or (hf_name == "model.embed_tokens.weight" and native_type)
            )
            codes_of = _q4_0_codes if type_name == "Q4_0" and keep_q4_0_codes and is_projection else None
            if type_name not in _PLAIN_TYPES and codes_of is None and not (in_blocks and native_type):
                dequantized.append((name, type_name, int(tensor.n_bytes)))
            if hf_name is None:
                yield from self._expert_tensors(name, tensor, codes_of, in_blocks)
                continue
            try:
                if in_blocks:
                    yield GGUFTensor(
                        hf_name, type_name, None, blocks=self._blocks(name, config, layout, tensor, native_type)
                    )
                    continue
                if codes_of is not None:
                    codes, scales = codes_of(np.asarray(tensor.data))
                    codes = self._unpermute(name, config, layout, codes)
                    scales = self._unpermute(name, config, layout, scales)
                    yield GGUFTensor(hf_name, type_name, None, (codes, scales))
                    continue
                values = self._float_values(tensor)
            except ValueError:
                raise
            except Exception as error:
                raise self._unreadable(name, type_name, error) from None
            if hf_name.endswith("shared_expert_gate.weight") and values.dim() == 1:
                values = values.unsqueeze(0)  # [H] as some writers store it, the layer's [1, H]
            yield GGUFTensor(hf_name, type_name, self._unpermute(name, config, layout, values))
        if dequantized:
            counts = Counter(type_name for _, type_name, _ in dequantized)
            shown = ", ".join(f"{name} ({type_name})" for name, type_name, _ in dequantized[:6])
            more = f" and {len(dequantized) - 6} more" if len(dequantized) > 6 else ""
            logger.info(
                "%s: dequantized to float at load (no native product for their type%s): %s%s; %s; %.1f MB as stored",
                self.path.name,
                "" if keep_blocks else " with these kernels",
                shown,
                more,
                ", ".join(f"{count} {type_name}" for type_name, count in sorted(counts.items())),
                sum(size for _, _, size in dequantized) / 1e6,
            )

    def _blocks(
        self, name: str, config: dict[str, Any], layout: GGUFLayout, tensor: Any, native_type: bool
    ) -> GGUFBlocks:
        """A 2-D tensor's rows as stored (copied once out of the file's mapping), or as float32 rows."""
        if native_type:
            data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
            return GGUFBlocks(tensor.tensor_type.name, self._unpermute(name, config, layout, data))
        values = self._float_values(tensor).float()
        return GGUFBlocks(GGUF_FLOAT, self._unpermute(name, config, layout, values))

    def _float_values(self, tensor: Any) -> torch.Tensor:
        return self._dequantize(
            np.asarray(tensor.data), tensor.tensor_type, tuple(int(d) for d in reversed(tensor.shape))
        )

    def _dequantize(self, data: np.ndarray, tensor_type: Any, shape: tuple[int, ...]) -> torch.Tensor:
        """`data` (raw blocks or floats) as float32 values of `shape` (HF order)."""
        if tensor_type.name in ("F32", "F16"):
            values = torch.from_numpy(data.astype(np.float32, copy=False).copy())
        else:
            values = torch.from_numpy(
                np.ascontiguousarray(self._gguf.quants.dequantize(data, tensor_type), dtype=np.float32)
            )
        return values if tuple(values.shape) == shape else values.reshape(shape)

    def _expert_tensors(
        self,
        name: str,
        tensor: Any,
        codes_of: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]] | None,
        in_blocks: bool = False,
    ) -> Iterator[GGUFTensor]:
        """A stacked experts tensor [E, out, in] as one tensor per expert and projection
        (`ffn_gate_up_exps` rows split into gate and up), read one expert at a time; as (codes,
        scales) through `codes_of` (Q4_0 as int4), or as GGUFBlocks with `in_blocks`."""
        layer = name.split(".")[1]
        projections = STACKED_EXPERT_TENSORS[name.split(".")[2]]
        type_name = tensor.tensor_type.name
        num_experts, rows, columns = (int(d) for d in reversed(tensor.shape))
        if rows % len(projections):
            raise ValueError(f"{self.path}: tensor {name!r} has {rows} rows, not a gate half and an up half")
        part_rows = rows // len(projections)
        try:
            data = np.asarray(tensor.data)
            for expert in range(num_experts):
                # (float values, None) or (None, (codes, scales)) per projection, as GGUFTensor holds them
                parts: list[tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]]
                if in_blocks:
                    if type_name in GGUF_BLOCK_TYPES:
                        whole = GGUFBlocks(type_name, torch.from_numpy(np.array(data[expert], dtype=np.uint8)))
                    else:
                        whole = GGUFBlocks(
                            GGUF_FLOAT, self._dequantize(data[expert], tensor.tensor_type, (rows, columns)).float()
                        )
                    for projection, piece in zip(projections, whole.data.split(part_rows)):
                        yield GGUFTensor(
                            f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight",
                            type_name,
                            None,
                            blocks=GGUFBlocks(whole.type_name, piece.contiguous()),
                        )
                    continue
                if codes_of is not None:
                    codes, scales = codes_of(data[expert])
                    parts = [(None, (c, s)) for c, s in zip(codes.split(part_rows), scales.split(part_rows))]
                else:
                    values = self._dequantize(data[expert], tensor.tensor_type, (rows, columns))
                    parts = [(v, None) for v in values.split(part_rows)]
                for projection, (part_values, part_codes) in zip(projections, parts):
                    yield GGUFTensor(
                        f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight",
                        type_name,
                        part_values,
                        part_codes,
                    )
        except ValueError:
            raise
        except Exception as error:
            raise self._unreadable(name, type_name, error) from None

    def _unreadable(self, name: str, type_name: str, error: Exception) -> ValueError:
        return ValueError(
            f"{self.path}: tensor {name!r} ({type_name}) could not be read, corrupt or "
            f"truncated ({type(error).__name__}: {error})"
        )

    def _hf_name(self, name: str, layout: GGUFLayout) -> str:
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) >= 4 and parts[2] in layout.layer_tensors:
            return f"model.layers.{parts[1]}.{layout.layer_tensors[parts[2]]}.{parts[3]}"
        if parts[0] in _GLOBAL_TENSORS and len(parts) == 2:
            return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
        raise ValueError(f"{self.path}: unexpected tensor {name!r} for GGUF architecture {self.architecture}")

    def _unpermute(self, name: str, config: dict[str, Any], layout: GGUFLayout, rows: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's q/k row permutation (where the layout has it)."""
        if not layout.permuted_qk:
            return rows
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if kind == "attn_q":
            heads = config["num_attention_heads"]
        elif kind == "attn_k":
            heads = config["num_key_value_heads"]
        else:
            return rows
        shape = rows.shape
        half = shape[0] // heads // 2
        return rows.reshape(heads, half, 2, *shape[1:]).transpose(1, 2).reshape(shape).contiguous()


def _dequantizable_type_names() -> set[str]:
    from gguf import quants

    names = set()
    for value in vars(quants).values():
        qtype = getattr(value, "qtype", None)
        if qtype is not None and "dequantize_blocks" in vars(value):
            names.add(qtype.name)
    return names


def _q4_0_codes(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q4_0 rows [N, K/32 * 18 bytes] -> (codes int32 [N, K], scales float32 [N, K/32]).
    A block is a float16 scale d and 32 4-bit codes q, value d * (q - 8); byte j holds code j
    in its low nibble and code j + 16 in its high nibble."""
    rows = blocks.shape[0]
    blocks = blocks.reshape(rows, -1, 18)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 2:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int32)
    return torch.from_numpy(codes.reshape(rows, -1)), torch.from_numpy(scales)


def gguf_weight_format(
    checkpoint: GGUFCheckpoint, requested: WeightFormat | None, whole_layers: bool = True
) -> WeightFormat:
    """The decoder projections' format for a GGUF file: a requested int8/int4 format wins
    (tensors dequantized and re-quantized, except Q4_0 into int4 group 32, which is exact);
    in the native layout (the engine runs the native kernels), a file with quantized projections
    is served from its blocks (GGUFBlockWeight; `whole_layers`: no tensor parallelism splits a
    layer's blocks); otherwise Q4_0 projections are served as int4 group 32 and everything else
    as floats."""
    if requested is not None and not isinstance(requested, FullWeight):
        return requested
    types = checkpoint.linear_types()
    native_layout = requested is not None and requested.native_layout
    if native_layout and whole_layers and checkpoint.has_quantized_projections():
        return GGUFBlockWeight()
    if "Q4_0" in types:
        others = sorted(types - {"Q4_0"})
        if others:
            logger.info(
                "%s: Q4_0 projections served as int4 group 32; %s projections re-quantized to it",
                checkpoint.path.name,
                ", ".join(others),
            )
        return Int4Weight(group_size=32, zero_point=False, native_layout=native_layout)
    return requested or FullWeight()
