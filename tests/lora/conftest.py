"""Adapters shared by the LoRA tests: four random adapters of the tiny Llama, ranks 4 to 16.

peft is imported only when a test asks for them: it imports triton, which the Triton kernel
tests must import first (under TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def lora_dirs(llama_dir, tmp_path_factory):
    pytest.importorskip("peft", reason="peft (the test extra) builds the PEFT adapters")
    from lora_factory import ALL_MODULES, ATTENTION_MODULES, MLP_MODULES, build_adapter

    root = tmp_path_factory.mktemp("lora")
    shapes = {
        "sql": (ALL_MODULES, 8),
        "chat": (ATTENTION_MODULES, 4),
        "code": (MLP_MODULES, 16),
        "math": (["q_proj", "v_proj", "down_proj"], 8),
    }
    return {
        name: build_adapter(llama_dir, root / name, target_modules=modules, rank=rank, seed=index + 10)
        for index, (name, (modules, rank)) in enumerate(shapes.items())
    }
