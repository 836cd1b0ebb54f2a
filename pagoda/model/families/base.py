"""ModelFamily: what one family module gives the rest of pagoda.

Its config reader (Hugging Face keys to ModelConfig, through the shared reading of
pagoda.model.hf_config), the renaming of its checkpoints' tensors to pagoda's names (and back,
for error messages), how its GGUF files are read, and the model class that runs it (the shared
decoder unless the family's layers differ from it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.model import families
from pagoda.model.decoder import DecoderModel
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.quant.gguf_checkpoint import GGUFCheckpoint, GGUFLayout

# A checkpoint item as the loader streams it: (file, name, float tensor or None, int4 codes or None).
CheckpointItem = tuple[str, str, torch.Tensor | None, tuple | None]


def _same_items(items: Iterable[CheckpointItem]) -> Iterable[CheckpointItem]:
    return items


def _same_names(names: list[str]) -> list[str]:
    return names


@dataclass(frozen=True)
class GGUFReading:
    """How a family's GGUF files are read: where their tensors go, and the config.json keys
    their metadata makes (pagoda.quant.gguf_checkpoint reads what every decoder shares)."""

    layout: GGUFLayout
    config: Callable[[GGUFCheckpoint], dict[str, Any]]


@dataclass(frozen=True)
class ModelFamily:
    read_config: Callable[[HFConfig], ModelConfig]
    # Checkpoint tensors under pagoda's names (the identity when a family's checkpoints already use them).
    checkpoint_tensors: Callable[[Iterable[CheckpointItem]], Iterable[CheckpointItem]] = _same_items
    # pagoda's names as the family's checkpoints spell them, for messages about missing tensors.
    checkpoint_names: Callable[[list[str]], list[str]] = _same_names
    gguf: GGUFReading | None = None
    # The shared decoder runs every family today; one whose layers differ gives its own class.
    model_class: type[DecoderModel] = DecoderModel

    def read(self, config: dict[str, Any], source: str, architecture: str, require_supported: bool) -> ModelConfig:
        return self.read_config(HFConfig(config, source, architecture, require_supported))


def family_of(config: ModelConfig) -> ModelFamily:
    """The family that read a config."""
    return families.family(config.family).FAMILY


def gguf_reading(checkpoint: GGUFCheckpoint) -> GGUFReading:
    """How to read this GGUF file; ValueError naming it for an architecture no family reads."""
    module = families.gguf_family(checkpoint.architecture)
    if module is None or module.FAMILY.gguf is None:
        raise ValueError(
            f"{checkpoint.path}: GGUF architecture {checkpoint.architecture!r} is not supported; "
            f"pagoda serves {', '.join(sorted(families.gguf_architectures()))}"
        )
    return module.FAMILY.gguf


def gguf_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    """A transformers-style config.json dict built from a GGUF file's metadata."""
    return gguf_reading(checkpoint).config(checkpoint)
