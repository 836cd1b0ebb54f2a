"""A LoRA adapter in PEFT's format, read and checked against the base model.

A PEFT directory holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, ...) and
`adapter_model.safetensors` with one `lora_A` [r, in] and one `lora_B` [out, r] per adapted
projection, named `base_model.model.model.layers.{i}.{self_attn|mlp}.{x}_proj.lora_{A|B}.weight`.
The delta of a projection is `x @ A^T @ B^T * scaling`, scaling = alpha / r (alpha / sqrt(r)
with rsLoRA). Everything a user can get wrong is an InvalidRequest naming the adapter.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagoda.errors import InvalidRequest
from pagoda.model.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, as PEFT names them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass(frozen=True)
class ModuleLoRA:
    """One adapted projection: A [r, in] and B [out, r] with the scaling folded into B."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """An adapter's weights in host memory, keyed by (layer index, PEFT module name)."""

    name: str
    path: str
    rank: int  # the largest rank of any of its modules
    modules: dict[tuple[int, str], ModuleLoRA]
    content_hash: str

    @property
    def target_modules(self) -> list[str]:
        return sorted({module for _, module in self.modules}, key=TARGET_MODULES.index)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable projection of the base model."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def load_peft_adapter(
    name: str, path: str | Path, config: ModelConfig, *, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """Read and validate a PEFT LoRA directory for the base model `config`."""
    directory = Path(path)

    def fail(reason: str) -> InvalidRequest:
        return InvalidRequest(
            f"LoRA adapter {name!r} ({directory}): {reason}", param="lora_path", code="invalid_lora_adapter"
        )

    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not directory.is_dir():
        raise fail("no such directory")
    if not config_path.is_file():
        raise fail(f"missing {CONFIG_FILE}")
    if not weights_path.is_file():
        raise fail(f"missing {WEIGHTS_FILE} (only safetensors adapters are supported)")
    config_bytes = config_path.read_bytes()
    try:
        peft_config = json.loads(config_bytes)
    except ValueError as error:
        raise fail(f"{CONFIG_FILE} is not valid JSON ({error})") from None
    if not isinstance(peft_config, dict):
        raise fail(f"{CONFIG_FILE} must hold a JSON object")
    _check_peft_config(peft_config, fail)

    tensors = _read_tensors(weights_path, fail)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            raise fail(
                f"unsupported tensor {tensor_name!r} (only lora_A/lora_B of the decoder projections "
                f"{', '.join(TARGET_MODULES)} are supported)"
            )
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGET_MODULES:
            raise fail(
                f"targets {module!r}, which the base model does not have as an adaptable projection "
                f"(supported: {', '.join(TARGET_MODULES)})"
            )
        if layer >= config.num_layers:
            raise fail(f"adapts layer {layer} but the base model has {config.num_layers} layers")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")

    shapes = module_shapes(config)
    # Checked above; without one, PEFT's LoraConfig default (8) is what the adapter was trained with.
    alpha = float(peft_config.get("lora_alpha", 8))
    rslora = bool(peft_config.get("use_rslora", False))
    modules: dict[tuple[int, str], ModuleLoRA] = {}
    for (layer, module), pair in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(pair) != {"A", "B"}:
            raise fail(f"{where} has lora_{next(iter(pair))} without its lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise fail(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not form a LoRA pair")
        rank = a.shape[0]
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise fail(
                f"{where} maps {a.shape[1]} -> {b.shape[0]} features but the base model's "
                f"{module} maps {in_features} -> {out_features} (adapter for another base model?)"
            )
        if rank > max_rank:
            raise fail(f"rank {rank} ({where}) exceeds --max-lora-rank {max_rank}")
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        modules[(layer, module)] = ModuleLoRA(
            a=a.to(torch.float32).to(dtype).contiguous(), b=(b.to(torch.float32) * scaling).to(dtype).contiguous()
        )
    digest = hashlib.blake2b(config_bytes, digest_size=16)
    digest.update(weights_path.read_bytes())
    return LoRAAdapter(
        name=name,
        path=str(directory),
        rank=max(m.rank for m in modules.values()),
        modules=modules,
        content_hash=digest.hexdigest(),
    )


def _check_peft_config(peft_config: dict, fail) -> None:
    peft_type = str(peft_config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type} is not LoRA")
    if peft_config.get("use_dora"):
        raise fail("DoRA adapters (use_dora) are not supported")
    if peft_config.get("bias", "none") != "none":
        raise fail(f"adapters that train biases (bias={peft_config['bias']!r}) are not supported")
    if peft_config.get("modules_to_save"):
        raise fail("modules_to_save (fully trained extra modules) are not supported")
    if peft_config.get("alpha_pattern"):
        raise fail("per-module alpha_pattern is not supported")
    alpha = peft_config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise fail(f"lora_alpha must be a positive number, got {alpha!r}")


def _read_tensors(path: Path, fail) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as reader:
            return {name: reader.get_tensor(name) for name in reader.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise fail(f"unreadable {WEIGHTS_FILE}, corrupt or truncated ({error})") from None
