"""What names a LoRA adapter outside the engine: the caller's request for one, and the identity
a loaded adapter gives the requests that use it.

Low in the package on purpose: `Request` carries an adapter identity (its prefix-cache block
hashes include it) and the fronts build `LoRARequest`s, while the weights themselves live in
pagoda.lora, above the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request wants, as vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`.

    `lora_name` is what the server lists as a model; `lora_path` a PEFT directory
    (adapter_config.json + adapter_model.safetensors). Offline, the first request naming an
    adapter loads it from its path; later ones reuse it by name.
    """

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest needs a non-empty lora_name")


@dataclass(frozen=True)
class AdapterIdentity:
    """One loaded adapter as requests see it. `content_hash` is a digest of its weights and
    config, so a name reloaded with different weights never matches blocks cached under the
    old ones; `load_id` tells apart two loads of the same content (device slots key on it)."""

    name: str
    content_hash: str
    load_id: int

    @property
    def cache_key(self) -> tuple[str, str, str]:
        """What enters every prefix-cache block hash of a request using this adapter."""
        return ("lora", self.name, self.content_hash)
