"""Random PEFT LoRA adapters for the tiny test models (tests/model_factory.py), saved in
PEFT's format: adapter_config.json + adapter_model.safetensors. A and B are both random and
non-zero (PEFT's default init leaves B at zero, which would test nothing)."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
ALL_MODULES = ATTENTION_MODULES + MLP_MODULES


def build_adapter(
    base_dir: Path,
    directory: Path,
    *,
    target_modules: list[str] = ALL_MODULES,
    rank: int = 8,
    alpha: float = 16,
    use_rslora: bool = False,
    seed: int = 0,
    scale: float = 0.1,
) -> Path:
    """Save a random LoRA adapter for the model in `base_dir` into `directory`."""
    from peft import LoraConfig, get_peft_model

    from model_factory import load_hf_model

    directory = Path(directory)
    base = load_hf_model(base_dir)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        use_rslora=use_rslora,
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def load_hf_adapter_model(base_dir: Path, adapter_dir: Path):
    """transformers + peft: the base model with the adapter applied (the reference)."""
    from peft import PeftModel

    from model_factory import load_hf_model

    return PeftModel.from_pretrained(load_hf_model(base_dir), str(adapter_dir)).eval()
