"""The model families pagoda runs, and the registry that finds each one's module.

A family module (`pagoda.model.families.<module>`) defines `FAMILY`, a ModelFamily
(pagoda.model.families.base): its config reader, checkpoint and GGUF names, and model class.
This registry names each family's module with what selects it: the transformers architectures
of config.json (a family's `*ForSequenceClassification` runs its decoder under a classifier
head), the GGUF files' `general.architecture`, and the `model_type`s that name the family (transformers picks a
model's class by its model_type: a config's model_type, where a
family claims it, picks the family before its architecture does; it also reads, for `pagoda
plan`, configs of architectures pagoda does not run). Modules are imported on first use, so
reading one family's config imports none of the others.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# module: (transformers architectures, GGUF architectures, model types that pick it)
_FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "llama": (("LlamaForCausalLM", "LlamaForSequenceClassification"), ("llama",), ()),
    "qwen2": (("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"), ("qwen2",), ("qwen2",)),
    "qwen3": (("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"), ("qwen3",), ("qwen3",)),
    "mistral": (("MistralForCausalLM",), (), ()),
    "gemma": (
        ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
        (),
        ("gemma", "gemma2", "gemma3", "gemma3_text"),
    ),
    "phi3": (("Phi3ForCausalLM",), (), ()),
    "mixtral": (("MixtralForCausalLM",), (), ()),
    "qwen2_moe": (("Qwen2MoeForCausalLM",), ("qwen2moe",), ("qwen2_moe",)),
    "qwen3_moe": (("Qwen3MoeForCausalLM",), ("qwen3moe",), ("qwen3_moe",)),
    "gpt_oss": (("GptOssForCausalLM",), (), ("gpt_oss",)),
    "deepseek_v3": (("DeepseekV3ForCausalLM",), (), ("deepseek_v3", "kimi_k2")),
    "glm4_moe": (("Glm4MoeForCausalLM",), (), ("glm4_moe",)),
    "qwen3_next": (("Qwen3NextForCausalLM",), (), ("qwen3_next",)),
    "qwen3_5": (("Qwen3_5ForCausalLM",), (), ("qwen3_5_text",)),
    "qwen3_5_moe": (("Qwen3_5MoeForCausalLM",), (), ("qwen3_5_moe_text",)),
    "granitemoehybrid": (("GraniteMoeHybridForCausalLM",), (), ("granitemoehybrid",)),
    "nemotron_h": (("NemotronHForCausalLM",), (), ("nemotron_h",)),
    "falcon_h1": (("FalconH1ForCausalLM",), (), ("falcon_h1",)),
    "llava": (("LlavaForConditionalGeneration",), (), ("llava",)),
    "qwen2_5_vl": (("Qwen2_5_VLForConditionalGeneration",), (), ("qwen2_5_vl", "qwen2_5_vl_text")),
    "qwen3_vl": (("Qwen3VLForConditionalGeneration",), (), ("qwen3_vl", "qwen3_vl_text")),
}
_SEQUENCE_CLASSIFIER = "ForSequenceClassification"
# What a config without `model_type`, or of an unknown one, is read as.
_FALLBACK = "llama"
DEFAULT_MODEL_TYPE = "llama"

_BY_ARCHITECTURE = {name: module for module, (names, _, _) in _FAMILIES.items() for name in names}
_BY_GGUF = {name: module for module, (_, names, _) in _FAMILIES.items() for name in names}
_BY_MODEL_TYPE = {name: module for module, (_, _, names) in _FAMILIES.items() for name in names}


def architectures() -> tuple[str, ...]:
    """The transformers architectures pagoda runs."""
    return tuple(_BY_ARCHITECTURE)


def is_sequence_classifier(architecture: str) -> bool:
    """A `*ForSequenceClassification` architecture: the decoder with a classifier head
    (pagoda.model.classifier) instead of an LM head."""
    return architecture in _BY_ARCHITECTURE and architecture.endswith(_SEQUENCE_CLASSIFIER)


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF `general.architecture` values pagoda reads."""
    return tuple(_BY_GGUF)


def is_supported(architecture: str) -> bool:
    return architecture in _BY_ARCHITECTURE


def family_name(architecture: str, model_type: str) -> str:
    """The family that reads a config: its model_type's, else its architecture's, else Llama's."""
    return _BY_MODEL_TYPE.get(model_type) or _BY_ARCHITECTURE.get(architecture) or _FALLBACK


def family(name: str) -> ModuleType:
    """A family's module, by its name (KeyError for one the registry does not list)."""
    if name not in _FAMILIES:
        raise KeyError(name)
    return _module(name)


def gguf_family(gguf_architecture: str) -> ModuleType | None:
    """The module of the family that reads GGUF files of this `general.architecture`, or None."""
    name = _BY_GGUF.get(gguf_architecture)
    return None if name is None else _module(name)


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name}")
