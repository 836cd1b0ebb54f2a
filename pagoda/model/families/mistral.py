"""Mistral: Llama with a sliding window on every layer (unless the config names `layer_types`)."""

from __future__ import annotations

from dataclasses import replace

from pagoda.model.families import llama
from pagoda.model.hf_config import HFConfig, window_on_every_layer
from pagoda.model.model_config import ModelConfig


def read_config(hf: HFConfig) -> ModelConfig:
    return hf.decoder(sliding_windows=window_on_every_layer)


# Llama's checkpoints and model; Mistral has no GGUF architecture of its own (llama.cpp writes `llama`).
FAMILY = replace(llama.FAMILY, read_config=read_config, gguf=None)
