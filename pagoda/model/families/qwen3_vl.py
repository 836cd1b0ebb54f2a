"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): Qwen3's decoder (q/k norms) with interleaved
M-RoPE and DeepStack (the vision tower's intermediate rows added to the image tokens' hidden
states after the decoder's first layers), and a vision transformer with a learned, resampled
position table and full attention per image (pagoda.model.vision.qwen.Qwen3VLEncoder).
Positions and `<|image_pad|>` expansion are Qwen2.5-VL's, and so are its checkpoints' names.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagoda.kernels import Kernels
from pagoda.model.decoder import DecoderModel
from pagoda.model.families.base import ModelFamily
from pagoda.model.families.qwen2_5_vl import PLACEHOLDER, checkpoint_names, checkpoint_tensors
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.model.parallel import TensorParallelGroup
from pagoda.model.pipeline import PipelineStage
from pagoda.model.vision.qwen import Qwen3VLEncoder
from pagoda.model.vision_config import VisionConfig
from pagoda.quant.weight_formats import WeightFormat


def read_config(hf: HFConfig) -> ModelConfig:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    section = rope.get("mrope_section") or [24, 20, 20]
    tower = dict(hf.get("vision_config") or {})
    if hf.get("image_token_id") is None:
        raise ValueError(f"{hf.source}: no image_token_id")
    vision = VisionConfig(
        kind="qwen2_5_vl",  # preprocessing, placeholders and positions as Qwen2.5-VL's
        image_token_id=int(hf.get("image_token_id")),
        image_placeholder=PLACEHOLDER,
        tower=tower,
        options={"spatial_merge_size": int(tower.get("spatial_merge_size", 2))},
    )
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    plain = {k: v for k, v in rope.items() if k not in ("type", "rope_type", "mrope_section", "mrope_interleaved")}
    hf = replace(hf, values={**hf.values, key: {**plain, "rope_type": "default"}})
    config = hf.decoder(qk_norm=True)
    if sum(section) * 2 != config.head_dim:
        raise ValueError(f"{hf.source}: mrope_section {section} does not cover head_dim {config.head_dim}")
    return replace(config, vision=vision, mrope_section=tuple(int(n) for n in section), mrope_interleaved=True)


class Qwen3VLModel(DecoderModel):
    """The shared decoder (interleaved M-RoPE, DeepStack rows from `InputEmbeds`) with Qwen3-VL's
    vision transformer beside it."""

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
        self.vision = Qwen3VLEncoder(config.vision, dtype, device, self.kernels)


FAMILY = ModelFamily(
    read_config=read_config,
    checkpoint_tensors=checkpoint_tensors,
    checkpoint_names=checkpoint_names,
    model_class=Qwen3VLModel,
)
