"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): Qwen2's decoder with M-RoPE (each rope
frequency section rotated by the temporal, height or width position: pagoda.model.mrope) and
a vision transformer with window attention whose merged patches replace the `<|image_pad|>`
tokens, one per merged patch (pagoda.model.vision.qwen.Qwen25VLEncoder).

Checkpoints spell the decoder `model.*` (or `model.language_model.*`) and the tower `visual.*`
(or `model.visual.*`); the tower is read under `vision.`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from pagoda.kernels import Kernels
from pagoda.model.decoder import DecoderModel
from pagoda.model.families.base import CheckpointItem, ModelFamily
from pagoda.model.families.qwen2 import attention_biases
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.model.parallel import TensorParallelGroup
from pagoda.model.pipeline import PipelineStage
from pagoda.model.vision.qwen import Qwen25VLEncoder
from pagoda.model.vision_config import VisionConfig
from pagoda.quant.weight_formats import WeightFormat

_RENAMES = (
    ("model.language_model.", "model."),
    ("model.visual.", "vision."),
    ("visual.", "vision."),
)
# What one image is in a chat prompt's text (the processor's and the chat template's spelling).
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def read_config(hf: HFConfig) -> ModelConfig:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    section = rope.get("mrope_section") or [16, 24, 24]
    tower = dict(hf.get("vision_config") or {})
    if hf.get("image_token_id") is None:
        raise ValueError(f"{hf.source}: no image_token_id")
    vision = VisionConfig(
        kind="qwen2_5_vl",
        image_token_id=int(hf.get("image_token_id")),
        image_placeholder=PLACEHOLDER,
        tower=tower,
        options={"spatial_merge_size": int(tower.get("spatial_merge_size", 2))},
    )
    # Hub-era configs name the rope `{"type": "mrope", "mrope_section": ...}`: default rope whose
    # frequencies take their positions by section (the sections are read above).
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if rope.get("type", rope.get("rope_type")) == "mrope":
        plain = {k: v for k, v in rope.items() if k not in ("type", "rope_type", "mrope_section")}
        hf = replace(hf, values={**hf.values, key: {**plain, "rope_type": "default"}})
    config = hf.decoder(**attention_biases(hf))
    if sum(section) * 2 != config.head_dim:
        raise ValueError(f"{hf.source}: mrope_section {section} does not cover head_dim {config.head_dim}")
    return replace(config, vision=vision, mrope_section=tuple(int(n) for n in section))


def checkpoint_tensors(items: Iterable[CheckpointItem]) -> Iterator[CheckpointItem]:
    for file_name, name, tensor, codes in items:
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield file_name, name, tensor, codes


def checkpoint_names(names: list[str]) -> list[str]:
    return ["visual." + name[len("vision.") :] if name.startswith("vision.") else name for name in names]


class Qwen25VLModel(DecoderModel):
    """The shared decoder (M-RoPE from its config) with Qwen2.5-VL's vision transformer beside it."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None = None,
        tp: TensorParallelGroup | None = None,
        stage: PipelineStage | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__(config, dtype, device, weight_format, tp, stage, kernels)
        assert config.vision is not None, "read_config sets it"
        self.vision = Qwen25VLEncoder(config.vision, dtype, device, self.kernels)


FAMILY = ModelFamily(
    read_config=read_config,
    checkpoint_tensors=checkpoint_tensors,
    checkpoint_names=checkpoint_names,
    model_class=Qwen25VLModel,
)
