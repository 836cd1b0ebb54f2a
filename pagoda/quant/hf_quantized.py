"""Hugging Face checkpoints that carry a `quantization_config` in config.json.

Supported: GPTQ 4-bit (`quant_method: gptq`, `bits: 4`, group size 32/64/128, formats `gptq`
and `gptq_v2`, `desc_act` only when `g_idx` is the plain group order), the w4a16 format vLLM
users bring most and the one AWQ and compressed-tensors checkpoints are commonly converted
to. Its integer codes and per-group scale/zero are loaded into pagoda's int4 format without
re-quantizing (scales and zeros rounded to the kernel's bfloat16).

GPTQ layout per linear (in_features K, out_features N, groups G = K / group_size):
  qweight int32 [K / 8, N]: 8 codes along K per int32, code of row 8r + i at bits 4i..4i+3;
  qzeros  int32 [G, N / 8]: 8 zero points along N per int32, same bit order;
  scales  float16 [G, N];  g_idx int32 [K] (group of each input row; optional).
  w[n, k] = (q[k, n] - z[g, n]) * s[g, n], where the `gptq` (v1) format stores z - 1.

Other methods (awq, compressed-tensors, bitsandbytes, fp8, ...) are refused before loading
with one line naming config.json and what is supported.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagoda.quant.weight_formats import INT4_GROUP_SIZES, Int4Weight

SUPPORTED_HF_METHODS: tuple[str, ...] = ("gptq",)
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def checkpoint_quantization(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's quantization_config, or None for a full-precision checkpoint."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from None
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4":
        return None  # gpt-oss's MXFP4 experts: dequantized as they load (pagoda.model.families.gpt_oss)
    return quantization if isinstance(quantization, dict) else None


def check_checkpoint_quantization(model_dir: Path) -> None:
    """Raise ValueError for a quantization_config pagoda cannot load."""
    quantization = checkpoint_quantization(model_dir)
    if quantization is not None:
        gptq_weight_format(quantization, model_dir / "config.json")


def gptq_weight_format(quantization: dict[str, Any], source: Path) -> Int4Weight:
    method = quantization.get("quant_method", "(no quant_method)")
    if method not in SUPPORTED_HF_METHODS:
        raise ValueError(
            f"{source}: checkpoint quantization {method!r} is not supported (quantized Hugging Face "
            f"formats pagoda loads: GPTQ 4-bit); use a full-precision checkpoint with "
            f"--quantization int8|int4, or a GGUF file"
        )
    bits = quantization.get("bits")
    if bits != 4:
        raise ValueError(f"{source}: GPTQ with bits={bits} is not supported; pagoda loads 4-bit GPTQ")
    group_size = quantization.get("group_size")
    if group_size is None or group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"{source}: GPTQ group_size {group_size} is not supported; pagoda loads group sizes "
            f"{', '.join(map(str, INT4_GROUP_SIZES))}"
        )
    checkpoint_format = quantization.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"{source}: GPTQ checkpoint_format {checkpoint_format!r} is not supported (gptq, gptq_v2)")
    return Int4Weight(group_size=int(group_size), zero_point=True)


def resolve_checkpoint_format(model_dir: Path, requested_quantization: str) -> tuple[Int4Weight | None, dict | None]:
    """For a quantized checkpoint: its int4 format and quantization_config; (None, None) otherwise."""
    quantization = checkpoint_quantization(model_dir)
    if quantization is None:
        return None, None
    source = model_dir / "config.json"
    weight_format = gptq_weight_format(quantization, source)
    if requested_quantization not in ("none", "int4"):
        raise ValueError(
            f"{source}: the checkpoint is already GPTQ 4-bit; --quantization {requested_quantization} "
            f"cannot apply (leave it at none)"
        )
    return weight_format, quantization


def gptq_tensors(
    tensors: Iterator[tuple[str, str, torch.Tensor]], quantization: dict[str, Any]
) -> Iterator[tuple[str, str, torch.Tensor | None, tuple | None]]:
    """Pass plain tensors through; turn each linear's GPTQ parts into (name.weight, None,
    (codes [N, K], scales [N, G], zeros [N, G])) in the int4 format's convention."""
    group_size = int(quantization["group_size"])
    zero_offset = 1 if quantization.get("checkpoint_format", "gptq") == "gptq" else 0
    pending: dict[str, dict[str, torch.Tensor]] = {}
    files: dict[str, str] = {}
    for file_name, name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part in _GPTQ_PARTS:
            pending.setdefault(prefix, {})[part] = tensor
            files[prefix] = file_name
            continue
        yield file_name, name, tensor, None
    for prefix, parts in pending.items():
        missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
        if missing:
            raise ValueError(f"{files[prefix]}: GPTQ layer {prefix!r} lacks {', '.join(missing)}")
        try:
            codes_scales_zeros = _gptq_to_int4(parts, group_size, zero_offset)
        except ValueError as error:
            raise ValueError(f"{files[prefix]}: GPTQ layer {prefix!r}: {error}") from None
        yield files[prefix], f"{prefix}.weight", None, codes_scales_zeros


def _unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 holding 8 codes (low nibble first) -> codes, unpacked along `dim` (0 or 1)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if dim == 0:
        codes = (packed.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # [K/8, 8, N]
        return codes.reshape(-1, packed.shape[1])
    codes = (packed.unsqueeze(2) >> shifts[None, None, :]) & 0xF  # [G, N/8, 8]
    return codes.reshape(packed.shape[0], -1)


def _gptq_to_int4(
    parts: dict[str, torch.Tensor], group_size: int, zero_offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
    codes = _unpack_int4(qweight, 0)  # [K, N]
    in_features, out_features = codes.shape
    if scales.shape != (in_features // group_size, out_features):
        raise ValueError(
            f"scales have shape {tuple(scales.shape)}, expected "
            f"{(in_features // group_size, out_features)} for group size {group_size}"
        )
    zeros = _unpack_int4(qzeros, 1)[:, :out_features] + zero_offset  # [G, N]
    if "g_idx" in parts:
        expected = torch.arange(in_features, dtype=torch.int32) // group_size
        if not torch.equal(parts["g_idx"].to(torch.int32), expected):
            raise ValueError("act-order g_idx (desc_act with reordered groups) is not supported yet")
    # (q - z) * s == (q - 8) * s + (8 - z) * s: the int4 format's (scale, zero) convention.
    int4_zeros = (8 - zeros.float()) * scales
    return codes.t().contiguous().to(torch.int32), scales.t().contiguous(), int4_zeros.t().contiguous()
