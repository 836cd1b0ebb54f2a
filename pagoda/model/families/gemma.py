"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's norms (RMSNorm scaling by
(1 + w), a norm after attention and two around the MLP), embeddings scaled by sqrt(hidden),
tied embeddings unless the config says otherwise, and local layers sliding over a window.
Gemma 3 adds per-head q/k norms and a rope base of its own for the local layers
(`rope_local_base_freq`, or transformers 5's per-layer-type `rope_parameters`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pagoda.kernels import Kernels
from pagoda.model.decoder import DecoderModel
from pagoda.model.families.base import ModelFamily
from pagoda.model.families.llava import checkpoint_tensors
from pagoda.model.hf_config import HFConfig, windows_from_max_window_layers
from pagoda.model.model_config import ModelConfig
from pagoda.model.parallel import TensorParallelGroup
from pagoda.model.pipeline import PipelineStage
from pagoda.model.vision.siglip import Gemma3Encoder
from pagoda.model.vision_config import VisionConfig
from pagoda.quant.weight_formats import WeightFormat

_GEMMA2, _GEMMA3, _GEMMA3_VL = "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"


def _every_nth_layer_global(hf: HFConfig, window: int, num_layers: int) -> list[int | None]:
    """Configs older than `layer_types`: every `sliding_window_pattern`-th layer is global, the
    others slide."""
    pattern = int(hf.get("sliding_window_pattern") or (2 if hf.architecture == _GEMMA2 else 6))
    return [window if (i + 1) % pattern else None for i in range(num_layers)]


def read_config(hf: HFConfig) -> ModelConfig:
    # A Gemma-like architecture pagoda does not run (read by its model_type for `pagoda plan`) keeps
    # the shared reading's windows: its layer pattern is not known.
    gemma3 = hf.architecture in (_GEMMA3, _GEMMA3_VL) or hf.model_type == "gemma3_text"
    known = hf.architecture in (_GEMMA2, _GEMMA3, _GEMMA3_VL)
    config = hf.decoder(
        qk_norm=gemma3,
        sliding_windows=_every_nth_layer_global if known else windows_from_max_window_layers,
        gemma_norms=True,
        tie_word_embeddings=True,
        scale_embeddings=True,
        # transformers' defaults where a config names no base; Gemma 3's checkpoints name the
        # local layers' base `rope_local_base_freq`
        default_rope_theta=1e6 if gemma3 else 10000.0,
        default_sliding_rope_theta=_optional_float(hf.get("rope_local_base_freq")) or (10000.0 if gemma3 else None),
    )
    return replace(config, vision=_vision(hf)) if hf.architecture == _GEMMA3_VL else config


def _vision(hf: HFConfig) -> VisionConfig:
    """Gemma 3's image path: a SigLIP tower pooled to mm_tokens_per_image rows, the prompt's
    <start_of_image> expanded to itself, the image tokens and <end_of_image>, between blank lines
    as its processor writes them; the image's tokens attend to each other both ways."""
    tower = dict(hf.get("vision_config") or {})
    if tower.get("vision_use_head"):
        tower["vision_use_head"] = False  # the pooling head's output is never read
    ids = {key: hf.get(key) for key in ("image_token_index", "boi_token_index", "eoi_token_index")}
    if any(value is None for value in ids.values()):
        raise ValueError(f"{hf.source}: Gemma 3 needs image_token_index, boi_token_index and eoi_token_index")
    boi, eoi = int(ids["boi_token_index"]), int(ids["eoi_token_index"])
    return VisionConfig(
        kind="gemma3",
        image_token_id=int(ids["image_token_index"]),
        image_placeholder="<start_of_image>",
        tower=tower,
        options={"mm_tokens_per_image": int(hf.get("mm_tokens_per_image", 256))},
        placeholder_token_id=boi,
        wrap=((boi,), (eoi,)),
        text_around=("\n\n", "\n\n"),  # Gemma3Processor's full_image_sequence
        bidirectional=True,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class GemmaModel(DecoderModel):
    """The shared decoder, with Gemma 3's vision encoder beside it when the config has one."""

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
        if config.vision is not None:
            self.vision = Gemma3Encoder(config.vision, config.hidden_size, dtype, device, self.kernels)


def checkpoint_names(names: list[str]) -> list[str]:
    return [name[len("vision.") :] if name.startswith("vision.") else name for name in names]


# A Gemma 3 vision checkpoint spells its decoder and tower as LLaVA's do.
FAMILY = ModelFamily(
    read_config=read_config,
    checkpoint_tensors=checkpoint_tensors,
    checkpoint_names=checkpoint_names,
    model_class=GemmaModel,
)
