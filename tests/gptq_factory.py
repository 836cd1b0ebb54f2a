"""GPTQ 4-bit checkpoints made from a tiny full-precision one: each chosen projection
round-to-nearest quantized into GPTQ's packed layout (qweight / qzeros / scales / g_idx)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

GROUP = 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack_along(codes: np.ndarray, axis: int) -> torch.Tensor:
    """8 4-bit codes per int32 along `axis`, the code at index 8r + i in bits 4i..4i+3."""
    codes = np.moveaxis(codes.astype(np.uint32), axis, -1)
    grouped = codes.reshape(*codes.shape[:-1], -1, 8)
    packed = np.zeros(grouped.shape[:-1], dtype=np.uint32)
    for i in range(8):
        packed |= grouped[..., i] << np.uint32(4 * i)
    return torch.from_numpy(np.moveaxis(packed, -1, axis).view(np.int32).copy())


def write_gptq(
    model_dir: Path, target: Path, checkpoint_format: str = "gptq", projections: Iterable[str] = PROJECTIONS
) -> dict[str, torch.Tensor]:
    """RTN-quantize the `projections` (matched as `.{projection}.weight` in tensor names) into
    GPTQ's layout; returns the dequantized weights by their full-precision names."""
    shutil.copytree(model_dir, target)
    tensors = load_file(str(target / "model.safetensors"))
    suffixes = tuple(f".{p}.weight" for p in projections)
    out, dequantized = {}, {}
    for name, tensor in tensors.items():
        if not name.endswith(suffixes):
            out[name] = tensor
            continue
        weight = tensor.float()  # [N, K]
        n, k = weight.shape
        groups = weight.reshape(n, k // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scales = ((high - low) / 15).clamp(min=1e-8).half().float()
        zeros = torch.round(-low / scales).clamp(0, 15)
        codes = torch.clamp(torch.round(groups / scales[..., None]) + zeros[..., None], 0, 15)
        dequantized[name] = ((codes - zeros[..., None]) * scales[..., None]).reshape(n, k)
        prefix = name[: -len(".weight")]
        stored_zeros = zeros - (1 if checkpoint_format == "gptq" else 0)
        out[f"{prefix}.qweight"] = _pack_along(codes.reshape(n, k).t().numpy().astype(np.int64), 0)
        out[f"{prefix}.qzeros"] = _pack_along(stored_zeros.t().numpy().astype(np.int64) & 0xF, 1)
        out[f"{prefix}.scales"] = scales.t().contiguous().half()
        out[f"{prefix}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
    save_file(out, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": checkpoint_format,
    }
    (target / "config.json").write_text(json.dumps(config))
    return dequantized
