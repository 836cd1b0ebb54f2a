"""The linear op: y = x @ W^T + b for a `Linear`'s weight, one product per weight-format type.

A weight format (pagoda.quant.weight_formats) holds the storage; the product that reads it is
chosen here, once per device, as one of three implementations:

- `TorchLinear`, the PyTorch reference on any device: `full` through oneDNN's pre-packed
  matmul on CPU (F.linear where it kept no packed copy, and for single rows of small weights),
  int8 through `aten._weight_int8pack_mm`, int4 through tinygemm's
  `aten._weight_int4pack_mm_for_cpu`; quantized products in bfloat16 for a float32 model (the
  packed kernels are vectorized only for 16-bit activations), the output cast back.
- `NativeLinear` (CPU, pagoda's native kernels): weights stored in the native layout
  (`native_layout`) go through the native products: dense float32/bfloat16 for inputs of up to
  native.MAX_ROWS rows (decode steps; prefill stays with F.linear), int8 and int4 for float32
  inputs at every row count (one arithmetic however a step is batched), and GGUF blocks of every
  type with a native product as llama.cpp multiplies them (the layer input quantized once to
  8-bit blocks per activation block size, shared by a fused layer's parts; integer dot products).
- `TritonLinear` (CUDA): the Triton w8a16 / w4a16 kernels (kernels/triton/weight_matmul.py).

A format whose product is missing on the device fails at startup (`check`), never falls back
to a slow path silently.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from pagoda.native import MAX_ROWS as NATIVE_MAX_ROWS
from pagoda.native import NativeKernels
from pagoda.quant.weight_formats import (
    GGUF_FLOAT,
    INT4_GROUP_SIZES,
    FullWeight,
    GGUFBlocks,
    GGUFBlockWeight,
    Int4Weight,
    Int8Weight,
    WeightFormat,
    kernel_dtype,
    pack_int4_nibbles,
)


class LinearLayer(Protocol):
    """What a product reads of its layer (pagoda.model.layers.Linear) by name; the storage its
    weight format registered (`weight`, `qweight`, `scales`, ...) it reads with `_read`."""

    weight_format: WeightFormat
    out_features: int


Product = Callable[[LinearLayer, torch.Tensor, torch.Tensor | None], torch.Tensor]


class TorchLinear:
    """PyTorch's products: the reference every other implementation is compared with."""

    name = "torch"

    def __init__(self) -> None:
        self.products: dict[type[WeightFormat], Product] = {
            FullWeight: self.full,
            Int8Weight: self.int8,
            Int4Weight: self.int4,
        }

    def __call__(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] through `layer.weight_format`'s product."""
        return self.products[type(layer.weight_format)](layer, x, bias)

    def full(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = getattr(layer, "packed_weight", None)
        if packed is None:
            return F.linear(x, _read(layer, "weight", torch.Tensor), bias)
        flat = x.reshape(-1, x.shape[-1]).to(_read(layer, "weight_dtype", torch.dtype)).contiguous()
        single_row = getattr(layer, "single_row_weight", None)
        if single_row is not None and flat.shape[0] == 1:
            out = F.linear(flat, single_row, bias)
        elif flat.shape[0] == 0:
            out = flat.new_empty(0, layer.out_features)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def int8(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        scales = _read(layer, "scales", torch.Tensor)
        flat = x.reshape(-1, shape[-1]).to(scales.dtype)
        out = self.int8_matmul(flat, _read(layer, "qweight", torch.Tensor), scales)
        out = out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def int8_matmul(self, flat: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if flat.shape[1] != qweight.shape[1]:  # the weight's input dimension was padded to a tile of 16
            flat = F.pad(flat, (0, qweight.shape[1] - flat.shape[1]))
        return torch.ops.aten._weight_int8pack_mm(flat, qweight, scales)

    def int4(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        scales_and_zeros = _read(layer, "scales_and_zeros", torch.Tensor)
        weight_format = layer.weight_format
        assert isinstance(weight_format, Int4Weight) and weight_format.group_size is not None, (
            "an int4 layer's format holds its group size (`Int4Weight.for_layer`)"
        )
        flat = x.reshape(-1, shape[-1]).to(scales_and_zeros.dtype)
        out = self.int4_matmul(flat, _read(layer, "qweight", torch.Tensor), scales_and_zeros, weight_format.group_size)
        out = out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def int4_matmul(
        self, flat: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, qweight, group_size, scales_and_zeros)

    def gguf_rows(self, blocks: GGUFBlocks, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a GGUF tensor kept as blocks (an embedding's lookup), as float32."""
        raise ValueError("GGUF blocks are served by the native CPU kernels")

    def gguf_product(self, blocks: GGUFBlocks, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T for a GGUF tensor kept as blocks (a tied LM head), float32."""
        raise ValueError("GGUF blocks are served by the native CPU kernels")

    def check(self, weight_format: WeightFormat, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ValueError when `weight_format`'s product does not run on `device`: a tiny product
        is run once at startup."""
        if isinstance(weight_format, GGUFBlockWeight):
            raise ValueError(f"GGUF blocks are served by the native CPU kernels; the engine is on {device}")
        if isinstance(weight_format, Int8Weight):

            def probe_int8() -> None:
                x = torch.ones(1, 16, dtype=kernel_dtype(dtype), device=device)
                self.int8_matmul(
                    x, torch.ones(16, 16, dtype=torch.int8, device=device), torch.ones(16, dtype=x.dtype, device=device)
                )

            _probe("int8", self.int8_kernel_name, device, probe_int8)
        elif isinstance(weight_format, Int4Weight):
            group_size = weight_format.group_size or max(INT4_GROUP_SIZES)

            def probe_int4() -> None:
                k = max(group_size, 256)
                packed = self.pack_int4(torch.zeros(16, k, dtype=torch.int32, device=device), device)
                sz = torch.ones(k // group_size, 16, 2, dtype=kernel_dtype(dtype), device=device)
                self.int4_matmul(torch.ones(1, k, dtype=kernel_dtype(dtype), device=device), packed, sz, group_size)

            _probe("int4", self.int4_kernel_name, device, probe_int4)

    int8_kernel_name = "aten._weight_int8pack_mm"
    int4_kernel_name = "aten._weight_int4pack_mm_for_cpu"

    def pack_int4(self, codes: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Codes in the layout `int4_matmul` reads (the probe's)."""
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


class NativeLinear(TorchLinear):
    """pagoda's native CPU products for weights stored in the native layout; others as PyTorch's."""

    name = "native"

    def __init__(self, native: NativeKernels) -> None:
        super().__init__()
        self.native = native
        self.products[GGUFBlockWeight] = self.gguf_blocks

    def full(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = getattr(layer, "native_weight", None)
        if weight is None:
            return super().full(layer, x, bias)
        flat = x.reshape(-1, x.shape[-1])
        if flat.dtype != weight.dtype or flat.shape[0] > NATIVE_MAX_ROWS:
            return F.linear(x, weight, bias)
        product = self.native.linear_f32 if weight.dtype == torch.float32 else self.native.linear_bf16
        out = product(flat, weight, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def int8(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        scales = getattr(layer, "native_scales", None)
        if scales is None or x.dtype != torch.float32:
            return super().int8(layer, x, bias)
        out = self.native.linear_int8(x.reshape(-1, x.shape[-1]), _read(layer, "qweight", torch.Tensor), scales, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def int4(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        nibbles = getattr(layer, "native_nibbles", None)
        if nibbles is None:
            return super().int4(layer, x, bias)
        out = self.native.linear_int4(
            x.reshape(-1, x.shape[-1]),
            nibbles,
            _read(layer, "native_scales", torch.Tensor),
            getattr(layer, "native_zeros", None),
            bias,
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def gguf_blocks(self, layer: LinearLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Each part of the layer (GGUFBlockWeight's `gguf_parts`) in its own type; the input
        quantized once per activation block size and shared by the parts (fused q/k/v, gate/up)."""
        flat = x.reshape(-1, x.shape[-1]).float()
        parts = _read(layer, "gguf_parts", tuple)
        activations: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if len(parts) == 1:
            out = self._gguf_part(GGUFBlocks(parts[0][2], _read(layer, "gguf_part_0", torch.Tensor)), flat, activations)
        else:
            out = flat.new_empty(flat.shape[0], layer.out_features)
            for index, (offset, rows, type_name) in enumerate(parts):
                blocks = GGUFBlocks(type_name, _read(layer, f"gguf_part_{index}", torch.Tensor))
                out[:, offset : offset + rows] = self._gguf_part(blocks, flat, activations)
        if bias is not None:
            out = out + bias
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])

    def _gguf_part(
        self,
        blocks: GGUFBlocks,
        flat: torch.Tensor,
        activations: dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        if blocks.type_name == GGUF_FLOAT:
            return F.linear(flat, blocks.data)
        activation = activations.get(blocks.k_blocks)
        if activation is None:
            activation = activations[blocks.k_blocks] = self.native.gguf_quantize_activation(flat, blocks.k_blocks)
        return self.native.gguf_linear(activation, blocks.data, blocks.type_id, None)

    def gguf_rows(self, blocks: GGUFBlocks, ids: torch.Tensor) -> torch.Tensor:
        if blocks.type_name == GGUF_FLOAT:
            return F.embedding(ids, blocks.data)
        return self.native.gguf_dequantize_rows(blocks.data, blocks.type_id, ids)

    def gguf_product(self, blocks: GGUFBlocks, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        out = self._gguf_part(blocks, flat, {})
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def check(self, weight_format: WeightFormat, device: torch.device, dtype: torch.dtype) -> None:
        if not isinstance(weight_format, GGUFBlockWeight):
            super().check(weight_format, device, dtype)


class TritonLinear(TorchLinear):
    """CUDA: the Triton w8a16 / w4a16 kernels (None where triton is not installed: then the
    quantized formats fail their startup check)."""

    name = "triton"
    int8_kernel_name = "the Triton w8a16 kernel"
    int4_kernel_name = "the Triton w4a16 kernel"

    def __init__(self, matmul: ModuleType | None) -> None:
        super().__init__()
        self.matmul = matmul

    def _kernels(self) -> ModuleType:
        if self.matmul is None:
            raise RuntimeError("quantized weights on CUDA need the `triton` package (pip install 'pagoda[gpu]')")
        return self.matmul

    def int8_matmul(self, flat: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return self._kernels().int8_matmul(flat, qweight, scales, flat.shape[1])

    def int4_matmul(
        self, flat: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return self._kernels().int4_matmul(flat, qweight, scales_and_zeros, group_size)

    def pack_int4(self, codes: torch.Tensor, device: torch.device) -> torch.Tensor:
        return pack_int4_nibbles(codes)


Stored = TypeVar("Stored")


def _read(layer: LinearLayer, name: str, kind: type[Stored]) -> Stored:
    """The attribute `name` its weight format registered on `layer`, as a `kind`."""
    value = getattr(layer, name)
    assert isinstance(value, kind), f"a linear layer's {name} is a {kind.__name__}"
    return value


def _probe(format_name: str, kernel: str, device: torch.device, probe: Callable[[], None]) -> None:
    try:
        probe()
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"quantization {format_name}: its kernel {kernel} does not run on {device} "
            f"with torch {torch.__version__} ({first_line})"
        ) from None
