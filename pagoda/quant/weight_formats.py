"""Weight formats (vLLM: quant methods): how a `Linear`'s weight is stored and loaded.

A format is a small stateless-per-layer strategy object shared by every quantized `Linear`; it
holds storage only (bytes, scales, layout), the products live in pagoda.kernels.linear:

- `create_weights(layer, ...)` registers a full-precision staging `weight` [out, in] that the
  loaders fill row slice by row slice (fused q/k/v and gate/up included);
- `finalize(layer, name)` converts the staged weight once loading is done (round-to-nearest
  quantization, packing into the layout the device's kernels read) and frees it.

Formats (weight-only: activations stay in floating point):

- `full`: the weight as loaded; on CPU pre-packed once for oneDNN's matmul, or, in the native
  layout (`native_layout`: the engine runs pagoda's native kernels), kept dense for their
  decode-sized products.
- `int8`: per-output-channel symmetric int8, scale = max|w_row| / 127, round to nearest;
  `aten._weight_int8pack_mm` (CPU), a Triton w8a16 kernel (CUDA); in the native layout (pagoda's
  native kernels) a float32 model's int8 products run natively in float32 at every row count,
  so an output never depends on how a step was batched or chunked.
- `int4`: group-wise int4 along the input dimension (group 32/64/128). With zero points
  (default) each group maps [min, max] onto 0..15; symmetric maps [-max|w|, max|w|] onto
  -7..7 (zero point 0). (scale, zero) pairs where w = (q - 8) * scale + zero (tinygemm's
  convention); codes in tinygemm's CPU packed layout for `aten._weight_int4pack_mm_for_cpu`,
  or two per byte (`pack_int4_nibbles`) for the native kernels and the Triton w4a16 kernel on CUDA
  (pagoda/kernels/triton/weight_matmul.py), which read the same order.

PyTorch's packed CPU kernels are vectorized only for bfloat16/float16 activations (with
float32 inputs they run far slower than a float32 dense matmul, with bfloat16 faster than it;
benchmarks/quantization.py), so quantized layers of a float32 model compute in bfloat16 and
cast the output back. A format whose kernel is missing on the device fails at startup
(pagoda.kernels.linear's `check`), never falls back to a slow path silently.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.quant.storage_bytes import INT4_GROUP_SIZES, int4_group_size_for, linear_weight_bytes
from pagoda.quant.storage_bytes import WEIGHT_QUANTIZATIONS as QUANTIZATION_CHOICES

INT8_K_TILE = 16


class WeightFormat(ABC):
    """Strategy owning the storage of a `Linear`'s weight (its product: pagoda.kernels.linear)."""

    name: str
    # Store the layout pagoda's native CPU kernels read (the engine runs them) where the weight is
    # on the CPU; else the one PyTorch's ops (CPU) or the Triton kernels (CUDA) read.
    native_layout: bool = False
    # Whether the LM head takes this format too (GGUF blocks); else it stays in full precision.
    holds_head: bool = False

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Register the full-precision staging weight the loaders write into."""
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )

    def for_layer(self, in_features: int) -> WeightFormat:
        """This format as a layer with `in_features` inputs holds it (int4 picks its group size)."""
        return self

    def check_shape(self, layer_name: str, in_features: int, out_features: int) -> None:
        """Raise ValueError when this format cannot hold a layer of this shape."""

    def finalize(self, layer: nn.Module, layer_name: str) -> None:
        """Called once after every tensor of the layer was loaded."""

    def weight_bytes(self, in_features: int, out_features: int, element_size: int) -> float:
        """Bytes one layer's weight takes in this format (for planning and logs)."""
        return linear_weight_bytes(in_features, out_features, "none", element_size)


# oneDNN blocks a pre-packed weight for an expected number of input rows. Packed for 16, the
# benchmark model's projections beat F.linear from 1 row to a few hundred; packed for 1 row
# they were slower at 1 row and gained less elsewhere (benchmarks/results/step_breakdown).
PACK_ROWS_HINT = 16

# A packed oneDNN call has a fixed cost above MKL's F.linear before any arithmetic, which a
# single row (a decode step at concurrency 1) does not earn back on a small weight: there a
# 1-row product is faster through F.linear, while for larger weights or from 2 rows up the
# packed kernel is as fast or faster (benchmarks/results/levers/single-row-dense*.json).
# Weights up to this many elements (1 MiB in float32) also keep their dense copy for 1-row
# inputs: a bounded extra memory.
SINGLE_ROW_DENSE_MAX_ELEMENTS = 1 << 18


class FullWeight(WeightFormat):
    """The weight as loaded. On CPU, float32 and bfloat16 weights are pre-packed once into
    oneDNN's blocked layout (llama.cpp's REPACK, in torch: what inductor's weight freezing
    does), so no matmul re-packs the weight as `F.linear` does on every call. The packed
    tensor replaces the dense `weight` (one copy of each projection in memory, not two), except
    that small float32 weights keep it for 1-row inputs (SINGLE_ROW_DENSE_MAX_ELEMENTS).

    In the native layout, a float32 or bfloat16 CPU weight stays dense instead (`native_weight`,
    the layout the native kernel streams row by row; still one copy)."""

    name = "full"

    def __init__(self, native_layout: bool = False) -> None:
        self.native_layout = native_layout

    def finalize(self, layer: nn.Module, layer_name: str) -> None:
        weight = _staging_weight(layer).detach()
        if self.native_layout and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16):
            _replace_staging_weight(layer, native_weight=weight.contiguous())
        elif _can_prepack(weight):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
            _set_plain_attribute(layer, "weight_dtype", weight.dtype)
            small = weight.dtype == torch.float32 and weight.numel() <= SINGLE_ROW_DENSE_MAX_ELEMENTS
            single_row = {"single_row_weight": weight} if small else {}
            _replace_staging_weight(layer, packed_weight=packed, **single_row)


def _can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """Activation dtype the packed kernels run in for a model of `dtype` (see module docstring)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def _staging_weight(layer: nn.Module) -> torch.Tensor:
    """The full-precision `weight` `create_weights` registered, which the loaders filled."""
    weight = layer.weight
    assert isinstance(weight, torch.Tensor), "create_weights registers the staging weight as a Parameter"
    return weight


def _set_plain_attribute(layer: nn.Module, name: str, value: object) -> None:
    """Hold a value that is neither a tensor nor a module on `layer`: nn.Module's __setattr__ is typed
    for those two only, though it keeps any other value as a plain attribute."""
    setattr(layer, name, value)


def _stage_rows(layer: nn.Module, rows: tuple[Any, ...]) -> None:
    """Append (row_offset, codes, scales[, zeros]) to the rows staged on `layer` until `finalize`."""
    staged = getattr(layer, "staged_codes", None)
    if staged is None:
        staged = []
        _set_plain_attribute(layer, "staged_codes", staged)
    staged.append(rows)


def _replace_staging_weight(layer: nn.Module, **buffers: torch.Tensor) -> None:
    del layer.weight
    for name, tensor in buffers.items():
        layer.register_buffer(name, tensor, persistent=False)


class Int8Weight(WeightFormat):
    """Per-output-channel symmetric int8, weight-only."""

    name = "int8"

    def __init__(self, native_layout: bool = False) -> None:
        self.native_layout = native_layout

    def finalize(self, layer: nn.Module, layer_name: str) -> None:
        staging = _staging_weight(layer)
        weight = staging.detach().float()
        qweight, scales = quantize_int8_per_channel(weight)
        if self.native_layout and weight.device.type == "cpu" and staging.dtype == torch.float32:
            # The native product reads the same int8 rows and float32 scales (a few bytes per row).
            layer.register_buffer("native_scales", scales.contiguous(), persistent=False)
        # The bf16 CPU kernel reads the input dimension in tiles of 16 (and crashes on a
        # remainder): pad odd sizes with zero columns; the product pads x to match.
        padding = -weight.shape[1] % INT8_K_TILE
        if padding:
            qweight = F.pad(qweight, (0, padding))
        _replace_staging_weight(layer, qweight=qweight.contiguous(), scales=scales.to(kernel_dtype(staging.dtype)))

    def weight_bytes(self, in_features: int, out_features: int, element_size: int) -> float:
        return linear_weight_bytes(in_features, out_features, "int8", element_size)


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 per row: (int8 [N, K], float32 scales [N])."""
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scales


@dataclass(frozen=True)
class Int4Weight(WeightFormat):
    """Group-wise int4 (tinygemm layout), with zero points or symmetric. Without a group size
    (--quantization-group-size not given) each layer takes the largest of 128, 64, 32 that
    divides its input dimension (`for_layer`)."""

    group_size: int | None = None
    zero_point: bool = True
    native_layout: bool = False
    name = "int4"  # not annotated: a class attribute, no dataclass field

    def for_layer(self, in_features: int) -> Int4Weight:
        if self.group_size is not None:
            return self
        return replace(self, group_size=int4_group_size_for(in_features) or max(INT4_GROUP_SIZES))

    @property
    def layer_group_size(self) -> int:
        """The group size of a layer's format: every Linear holds the one `for_layer` gave it."""
        assert self.group_size is not None, "an int4 format without a group size gives each layer its own (for_layer)"
        return self.group_size

    def check_shape(self, layer_name: str, in_features: int, out_features: int) -> None:
        group_size = self.for_layer(in_features).layer_group_size
        if in_features % group_size:
            fits = int4_group_size_for(in_features)
            advice = (
                (
                    f"pass --quantization-group-size {fits} (or leave it out: each layer then takes the "
                    f"largest that divides it)"
                )
                if fits
                else f"no int4 group size ({', '.join(str(g) for g in INT4_GROUP_SIZES)}) divides it; use int8"
            )
            raise ValueError(
                f"{layer_name}: int4 group size {group_size} does not divide its input "
                f"dimension {in_features}; {advice}"
            )
        if out_features % 16:
            raise ValueError(
                f"{layer_name}: int4 needs an output dimension divisible by 16 "
                f"(the packed kernel's tile), got {out_features}"
            )

    def stage_codes(
        self,
        layer: nn.Module,
        row_offset: int,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None = None,
    ) -> None:
        """Load rows that are already int4 in this layout (e.g. GGUF Q4_0) without re-quantizing:
        w = (codes - 8) * scales + zeros, codes int32 [rows, K], scales/zeros [rows, K / group]."""
        if codes.shape[1] != layer.in_features or scales.shape[1] * self.layer_group_size != layer.in_features:
            raise ValueError(
                f"int4 codes of shape {tuple(codes.shape)} / scales {tuple(scales.shape)} do not "
                f"fit a [{layer.out_features}, {layer.in_features}] layer with group {self.group_size}"
            )
        zeros = torch.zeros_like(scales) if zeros is None else zeros
        _stage_rows(layer, (row_offset, codes, scales, zeros))

    def finalize(self, layer: nn.Module, layer_name: str) -> None:
        staging = _staging_weight(layer)
        out_features, in_features = staging.shape
        self.check_shape(layer_name, in_features, out_features)
        staged = getattr(layer, "staged_codes", [])
        if sum(codes.shape[0] for _, codes, _, _ in staged) == out_features:
            codes = torch.empty(out_features, in_features, dtype=torch.int32)
            scales = torch.empty(out_features, in_features // self.layer_group_size)
            zeros = torch.empty_like(scales)
        else:  # some rows came as floats: round them to nearest; staged rows overwrite theirs
            codes, scales, zeros = quantize_int4_grouped(
                staging.detach().float().cpu(), self.layer_group_size, self.zero_point
            )
        for row_offset, part_codes, part_scales, part_zeros in staged:
            rows = slice(row_offset, row_offset + part_codes.shape[0])
            codes[rows], scales[rows], zeros[rows] = part_codes, part_scales, part_zeros
        if staged:
            del layer.staged_codes
        self.load_codes(layer, codes, scales, zeros)

    def load_codes(self, layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Install already-quantized codes: w = (codes - 8) * scales + zeros per group.
        codes int32 [N, K] in 0..15; scales/zeros [N, K / group_size]."""
        staging = _staging_weight(layer)
        dtype = kernel_dtype(staging.dtype)
        device = staging.device
        if self.native_layout and device.type == "cpu":
            # The native product reads the codes two per byte and dequantizes them in registers, at every
            # row count (one arithmetic however a step is batched); no tinygemm copy is kept.
            symmetric = not bool(zeros.any())
            _replace_staging_weight(
                layer,
                native_nibbles=pack_int4_nibbles(codes),
                native_scales=scales.float().contiguous(),
                **({} if symmetric else {"native_zeros": zeros.float().contiguous()}),
            )
            return
        # tinygemm (CPU) and the Triton kernel (CUDA) want [K / group, N, 2] (scale, zero) pairs.
        scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        packed = _pack_int4(codes.to(device), device)
        _replace_staging_weight(layer, qweight=packed, scales_and_zeros=scales_and_zeros.to(device))

    def weight_bytes(self, in_features: int, out_features: int, element_size: int) -> float:
        return linear_weight_bytes(
            in_features, out_features, "int4", element_size, self.for_layer(in_features).layer_group_size
        )


def quantize_int4_grouped(
    weight: torch.Tensor, group_size: int, zero_point: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 per group of `group_size` inputs.

    Returns (codes int32 [N, K] in 0..15, scales [N, G], zeros [N, G]) with
    w ~= (codes - 8) * scale + zero (tinygemm's convention)."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // group_size, group_size)
    if zero_point:
        low = groups.amin(dim=-1)
        high = groups.amax(dim=-1)
        scales = ((high - low) / 15.0).clamp(min=1e-12)
        codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
        zeros = low + 8.0 * scales
    else:
        scales = (groups.abs().amax(dim=-1) / 7.0).clamp(min=1e-12)
        codes = torch.round(groups / scales[..., None]).clamp(-8, 7) + 8
        zeros = torch.zeros_like(scales)
    return codes.reshape(out_features, in_features).to(torch.int32), scales, zeros


def dequantize_int4_grouped(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    out_features, in_features = codes.shape
    groups = codes.reshape(out_features, -1, group_size).float() - 8.0
    return (groups * scales[..., None] + zeros[..., None]).reshape(out_features, in_features)


# The GGUF tensor types pagoda/csrc/gguf_blocks.cpp multiplies from their own bytes: name -> (ggml's type
# id, values per block, bytes per block). Their activations go in 8-bit blocks of 32 (legacy types) or 256
# (K-quants, IQ4_XS).
GGUF_BLOCK_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "IQ4_NL": (20, 32, 18),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
    "IQ4_XS": (23, 256, 136),
}
# A part held as float32 rows (an F16/F32 tensor, or a type without a native product, dequantized at load).
GGUF_FLOAT = "F32"


@dataclass(frozen=True)
class GGUFBlocks:
    """One GGUF tensor's rows as the file stores them: `data` uint8 [rows, row bytes] of ggml blocks of
    `type_name` (a GGUF_BLOCK_TYPES key), or float32 [rows, K] values (`type_name` GGUF_FLOAT)."""

    type_name: str
    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, K): the float tensor the blocks stand for."""
        rows, width = self.data.shape
        if self.type_name == GGUF_FLOAT:
            return rows, width
        _, values, size = GGUF_BLOCK_TYPES[self.type_name]
        return rows, width // size * values

    @property
    def type_id(self) -> int:
        return GGUF_BLOCK_TYPES[self.type_name][0]

    @property
    def k_blocks(self) -> bool:
        """Whether its activation goes in blocks of 256 (K-quants, IQ4_XS) rather than 32."""
        return GGUF_BLOCK_TYPES[self.type_name][1] == 256


class GGUFBlockWeight(WeightFormat):
    """GGUF projections served from the file's bytes by the native kernels, each tensor in its own type
    (a Q4_K_M file mixes Q4_K and Q6_K, often within one layer): the loader stages each part's rows
    as `GGUFBlocks` (`stage_blocks`, fused q/k/v and gate/up parts by row offset), and `finalize`
    keeps them as buffers `gguf_part_<i>` with `gguf_parts` = ((row offset, rows, type), ...),
    parts of one type next to each other concatenated into one. Nothing is expanded: memory holds
    the file's blocks (types without a native product, and F16 rows, as float32 rows). The LM
    head takes this format too (`holds_head`)."""

    name = "gguf"
    group_size = 32
    native_layout = True  # only the native kernels read ggml's blocks
    holds_head = True

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Every row comes as blocks (`stage_blocks`): the staging weight only names the shape, on the meta
        device, so loading never holds a float copy of the projection."""
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device="meta"), requires_grad=False
        )

    def check_shape(self, layer_name: str, in_features: int, out_features: int) -> None:
        if in_features % 32:
            raise ValueError(f"{layer_name}: GGUF blocks of 32 do not divide its input dimension {in_features}")

    def stage_blocks(self, layer: nn.Module, row_offset: int, blocks: GGUFBlocks) -> None:
        """Rows [row_offset, row_offset + rows) of the layer, as the file stores them."""
        rows, columns = blocks.shape
        if columns != layer.in_features:
            raise ValueError(
                f"{blocks.type_name} rows of {columns} values do not fit a "
                f"[{layer.out_features}, {layer.in_features}] layer"
            )
        _stage_rows(layer, (row_offset, blocks))

    def finalize(self, layer: nn.Module, layer_name: str) -> None:
        staged = sorted(getattr(layer, "staged_codes", []), key=lambda item: item[0])
        out_features = _staging_weight(layer).shape[0]
        if sum(blocks.shape[0] for _, blocks in staged) != out_features:
            raise ValueError(f"{layer_name}: not every row of the layer came from the GGUF file")
        merged: list[tuple[int, GGUFBlocks]] = []
        for offset, blocks in staged:
            if merged and merged[-1][1].type_name == blocks.type_name:
                first, previous = merged[-1]
                merged[-1] = (first, GGUFBlocks(blocks.type_name, torch.cat([previous.data, blocks.data])))
            else:
                merged.append((offset, blocks))
        if staged:
            del layer.staged_codes
        _replace_staging_weight(
            layer, **{f"gguf_part_{i}": blocks.data.contiguous() for i, (_, blocks) in enumerate(merged)}
        )
        _set_plain_attribute(
            layer, "gguf_parts", tuple((offset, blocks.shape[0], blocks.type_name) for offset, blocks in merged)
        )

    def weight_bytes(self, in_features: int, out_features: int, element_size: int) -> float:
        return out_features * in_features * 4.5 / 8  # what the file holds; ~4.5 bits per weight for Q4_K_M


def pack_int4_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (0..15, K a multiple of 32) -> uint8 [N, K / 2] in GGUF Q4_0's order: per 32
    inputs, byte j holds code j in its low nibble and code j + 16 in its high one."""
    rows, columns = codes.shape
    blocks = codes.to(torch.uint8).reshape(rows, columns // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, columns // 2).contiguous()


def _pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """int4 codes in the layout the device's product reads: two per byte (`pack_int4_nibbles`,
    the Triton kernel's order) on CUDA, tinygemm's packed layout on the CPU."""
    if device.type == "cuda":
        return pack_int4_nibbles(codes.to(device))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def make_weight_format(
    quantization: str, group_size: int | None = None, zero_point: bool = True, native_layout: bool = False
) -> WeightFormat:
    """The format for `--quantization`; ValueError for unknown names or group sizes. int4 without
    `group_size`: each layer's own (Int4Weight.for_layer). `native_layout`: store CPU weights as
    the native kernels read them (pagoda.kernels' `Kernels.native_layout`)."""
    if quantization in ("none", "full"):
        return FullWeight(native_layout)
    if quantization == "int8":
        return Int8Weight(native_layout)
    if quantization == "int4":
        if group_size is not None and group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of "
                f"{', '.join(str(g) for g in INT4_GROUP_SIZES)}, got {group_size}"
            )
        return Int4Weight(group_size=group_size, zero_point=zero_point, native_layout=native_layout)
    raise ValueError(f"quantization {quantization!r} is not supported; choose one of {', '.join(QUANTIZATION_CHOICES)}")
