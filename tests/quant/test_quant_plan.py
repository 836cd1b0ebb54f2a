"""`pagoda plan` counts quantized KV and weights as the engine stores them: one KV-bytes formula
(pagoda/quant/storage_bytes.py) behind the plan, the engine's pool sizing and the allocated tensors."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import LLM
from pagoda.plan import PlanOptions, plan_from_options
from pagoda.quant.storage_bytes import weight_bytes_per_parameter


@pytest.mark.parametrize("plan_kv_dtype, kv_cache_dtype", [("fp32", "auto"), ("int8", "int8"), ("fp8", "fp8_e4m3")])
def test_plan_kv_bytes_match_the_engines_caches(llama_dir: Path, plan_kv_dtype: str, kv_cache_dtype: str) -> None:
    plan = plan_from_options(PlanOptions(model=str(llama_dir), memory="1GiB", dtype="fp32", kv_dtype=plan_kv_dtype))
    llm = LLM(model=str(llama_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="256KiB")
    core = llm.engine.core
    allocated = sum(k.nbytes + v.nbytes for k, v in core.runner.kv_caches)
    assert allocated == plan.kv_bytes_per_block * core.num_blocks
    # The pool is sized with the same bytes per block.
    assert core.num_blocks == core.config.kv_cache_bytes // plan.kv_bytes_per_block
    assert core.model_config.kv_bytes_per_token(4, kv_cache_dtype=kv_cache_dtype) == plan.kv_bytes_per_token


def test_plan_int4_weight_bytes_match_the_packed_layers(llama_dir: Path) -> None:
    plan = plan_from_options(
        PlanOptions(model=str(llama_dir), memory="1GiB", dtype="int4", kv_dtype="bf16", quantization_group_size=32)
    )
    bf16 = plan_from_options(PlanOptions(model=str(llama_dir), memory="1GiB", dtype="bf16"))
    # The plan counts PyTorch's packed layout (bf16 scale/zero pairs); the native kernels keep float32 ones.
    llm = LLM(
        model=str(llama_dir),
        quantization="int4",
        quantization_group_size=32,
        kv_cache_memory="256KiB",
        native_kernels="off",
    )
    packed = sum(
        m.qweight.nbytes + m.scales_and_zeros.nbytes
        for m in llm.engine.core.runner.model.modules()
        if hasattr(m, "scales_and_zeros")
    )
    linear_params = sum(
        m.in_features * m.out_features for m in llm.engine.core.runner.model.modules() if hasattr(m, "scales_and_zeros")
    )
    assert packed == linear_params * weight_bytes_per_parameter("int4", 2, 32)
    # Decoder linears in int4 (with their scale/zero pairs), everything else as in bf16.
    assert plan.weight_bytes == bf16.weight_bytes - 2 * linear_params + packed
    assert plan.quantization_group_size == 32
    with pytest.raises(ValueError, match="--quantization-group-size must be one of 32, 64, 128"):
        plan_from_options(PlanOptions(model=str(llama_dir), memory="1GiB", dtype="int4", quantization_group_size=48))
