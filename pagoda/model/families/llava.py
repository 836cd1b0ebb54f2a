"""LLaVA (`LlavaForConditionalGeneration`): a Llama-style decoder whose prompt carries an image
as `<image>` placeholder tokens, one per patch of a CLIP vision tower, their embeddings replaced
by the tower's features through an MLP projector (pagoda.model.vision.clip.LlavaEncoder).

The decoder is the shared one with ordinary positions. Checkpoints spell the decoder
`language_model.model.*` (saved files) or `model.language_model.*` (transformers 5 in memory),
the tower `vision_tower.*` or `vision_tower.vision_model.*`; all are read into pagoda's names,
the image path under `vision.`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch

from pagoda.kernels import Kernels
from pagoda.model.decoder import DecoderModel
from pagoda.model.families.base import CheckpointItem, ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.model.parallel import TensorParallelGroup
from pagoda.model.pipeline import PipelineStage
from pagoda.model.vision.clip import LlavaEncoder
from pagoda.model.vision_config import VisionConfig
from pagoda.quant.weight_formats import WeightFormat

# (checkpoint prefix, pagoda prefix), the longest first
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision.vision_tower."),
    ("model.vision_tower.", "vision.vision_tower."),
    ("vision_tower.vision_model.", "vision.vision_tower."),
    ("vision_tower.", "vision.vision_tower."),
    ("model.multi_modal_projector.", "vision.multi_modal_projector."),
    ("multi_modal_projector.", "vision.multi_modal_projector."),
)


def read_config(hf: HFConfig) -> ModelConfig:
    feature_layer = hf.get("vision_feature_layer", -2)
    if not isinstance(feature_layer, int):
        raise ValueError(f"{hf.source}: vision_feature_layer {feature_layer!r}: only one feature layer is supported")
    tower = hf.get("vision_config") or {}
    if tower.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"{hf.source}: LLaVA with a {tower.get('model_type')!r} vision tower is not supported")
    image_token_id = hf.get("image_token_id", hf.get("image_token_index"))
    if image_token_id is None:
        raise ValueError(f"{hf.source}: no image_token_id")
    vision = VisionConfig(
        kind="llava",
        image_token_id=int(image_token_id),
        image_placeholder="<image>",
        tower=dict(tower),
        options={
            "feature_layer": feature_layer,
            "select_strategy": hf.get("vision_feature_select_strategy", "default"),
            "projector_act": hf.get("projector_hidden_act", "gelu"),
            "projector_bias": bool(hf.get("multimodal_projector_bias", True)),
        },
    )
    return replace(hf.decoder(), vision=vision)


def checkpoint_tensors(items: Iterable[CheckpointItem]) -> Iterator[CheckpointItem]:
    for file_name, name, tensor, codes in items:
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield file_name, name, tensor, codes


def checkpoint_names(names: list[str]) -> list[str]:
    def spelled(name: str) -> str:
        if name.startswith("vision."):
            return name[len("vision.") :]
        return "language_model." + name

    return [spelled(name) for name in names]


class LlavaModel(DecoderModel):
    """The shared decoder with LLaVA's encoder beside it (on the first pipeline stage)."""

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
        self.vision = LlavaEncoder(config.vision, config.hidden_size, dtype, device, self.kernels)


FAMILY = ModelFamily(
    read_config=read_config,
    checkpoint_tensors=checkpoint_tensors,
    checkpoint_names=checkpoint_names,
    model_class=LlavaModel,
)
