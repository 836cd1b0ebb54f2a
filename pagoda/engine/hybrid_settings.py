"""What a hybrid model (recurrent layers beside attention: pagoda.model.gated_delta_net,
pagoda.model.mamba2) runs with today, checked before its weights load: each setting that would
need its recurrent state somewhere it is not yet carried is refused with one line saying so.
"""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.model.model_config import ModelConfig


def check_hybrid_settings(config: EngineConfig, model_config: ModelConfig) -> None:
    """ValueError naming the first setting a hybrid model cannot run with yet."""
    if model_config.linear_attention is None:
        return
    name = model_config.architecture
    refused = [
        (bool(config.speculative), "speculative decoding (its state is not rolled back for rejected drafts yet)"),
        (config.tensor_parallel_size > 1, "tensor parallelism (its recurrent layers are not sharded yet)"),
        (config.pipeline_parallel_size > 1, "pipeline parallelism"),
        (config.kv_offload_memory is not None, "a host KV tier (--kv-offload-memory: the state is not offloaded)"),
        (config.role != "both", f"a {config.role} engine (the state is not handed off with the KV)"),
        (config.enable_lora, "LoRA adapters"),
    ]
    for applies, what in refused:
        if applies:
            raise ValueError(
                f"{name} is a hybrid model (recurrent layers beside attention): {what} is not supported for it yet"
            )
