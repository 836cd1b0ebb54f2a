"""Mixture-of-experts GGUF files (Mixtral, Qwen3-MoE, Qwen2-MoE) written as llama.cpp's
converter writes them (tests/quant/gguf_factory.py): F32 serves exactly like the safetensors
model and transformers, Q8_0 / Q4_0 experts agree with it, and broken files name what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF support needs the `gguf` package")

from engine_helpers import prompts_for as engine_prompts  # noqa: E402
from engine_helpers import teacher_forced_agreement  # noqa: E402
from gguf_factory import write_gguf  # noqa: E402
from model_factory import assert_matches_reference, build_model, hf_references  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.model.loader import load_model, load_model_config  # noqa: E402
from pagoda.model.moe import SparseMoE  # noqa: E402

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
# The tiny models' shapes where they are not the factory's: GGUF has no sliding window for the
# `llama` architecture (Mixtral's Hub configs have none), and Q4_0 needs every expert's input
# dimension a multiple of 32.
MODELS = {
    "mixtral": dict(sliding_window=None),
    "qwen3_moe": dict(moe_intermediate_size=64),
    "qwen2_moe": dict(),
}


def prompts_for(vocab_size: int) -> list[list[int]]:
    return engine_prompts(vocab_size, (3, 11, 40), shared_length=8, seed=2)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per architecture: the safetensors directory and its GGUF files by tensor type."""
    root = tmp_path_factory.mktemp("gguf_moe")
    models = {}
    for arch, overrides in MODELS.items():
        directory = build_model(root / arch, arch, **overrides)
        files = {"safetensors": directory}
        for tensor_type in ("F32", "Q8_0", "Q4_0"):
            files[tensor_type] = write_gguf(directory, root / f"{arch}-{tensor_type}.gguf", tensor_type)
        models[arch] = files
    return models


def _generate(model: Path, prompts: list[list[int]], **engine_args):
    llm = LLM(model=str(model), kv_cache_memory="32MiB", **engine_args)
    return llm, llm.generate(prompts, GREEDY)


@pytest.mark.parametrize("arch", MODELS)
def test_f32_moe_gguf_matches_safetensors_and_transformers(moe_models, arch: str) -> None:
    prompts, references = hf_references(moe_models[arch]["safetensors"], prompts_for, NEW_TOKENS)
    _, from_safetensors = _generate(moe_models[arch]["safetensors"], prompts)
    llm, from_gguf = _generate(moe_models[arch]["F32"], prompts)
    assert [o.outputs[0].token_ids for o in from_gguf] == [o.outputs[0].token_ids for o in from_safetensors]
    assert_matches_reference(from_gguf, references, 1e-3)
    model = llm.engine.core.runner.model
    blocks = [layer.mlp for layer in model.model.layers]
    if arch == "qwen2_moe":  # layer 1 dense (mlp_only_layers), the others with a shared expert
        assert [isinstance(b, SparseMoE) for b in blocks] == [True, False, True]
        assert blocks[0].shared_expert is not None
    else:
        assert all(isinstance(b, SparseMoE) for b in blocks)


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", MODELS)
def test_quantized_moe_gguf_agrees_with_f32(moe_models, arch: str, tensor_type: str) -> None:
    files = moe_models[arch]
    prompts = prompts_for(384)
    _, reference = _generate(files["F32"], prompts)
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in reference]
    agreement = teacher_forced_agreement(files[tensor_type], sequences, [len(p) for p in prompts])
    print(f"{arch} {tensor_type}: teacher-forced greedy agreement with F32 {agreement:.3f}")
    # Observed Q8_0 0.96-1.0, Q4_0 0.46-0.67: random tiny models have many near-ties, and 4 bits
    # move them (pagoda's own --quantization int4 of the Qwen3-MoE safetensors agrees exactly as
    # often as its Q4_0 file, the dense Llama's Q4_0 file 0.58). Chance is 1/384.
    assert agreement >= (0.9 if tensor_type == "Q8_0" else 0.35)


def test_q4_0_experts_are_served_as_int4_codes(moe_models) -> None:
    path = moe_models["qwen3_moe"]["Q4_0"]
    model = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"))
    experts = model.model.layers[1].mlp.experts
    down = experts["5"].down_proj
    assert down.weight_format.name == "int4" and down.weight_format.group_size == 32
    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_down_exps.weight")
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))[5]
    effective = down.kernels.linear(down, torch.eye(down.in_features), None).t()
    torch.testing.assert_close(effective, expected, rtol=1e-2, atol=1e-3)


def test_fused_gate_up_experts_load_like_separate_ones(moe_models, tmp_path: Path) -> None:
    """`ffn_gate_up_exps` (the converter's --fuse-gate-up-exps): gate rows, then up rows."""
    directory = moe_models["qwen3_moe"]["safetensors"]
    fused = write_gguf(directory, tmp_path / "fused.gguf", "F32", fuse_gate_up=True)
    assert "blk.0.ffn_gate_up_exps.weight" in {t.name for t in gguf.GGUFReader(str(fused)).tensors}
    prompts = prompts_for(384)
    _, separate = _generate(moe_models["qwen3_moe"]["F32"], prompts)
    _, outputs = _generate(fused, prompts)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in separate]


@pytest.mark.parametrize(
    "omitted, message",
    [
        ("blk.1.ffn_up_exps.weight", "MoE layer 1 is missing tensor(s) blk.1.ffn_up_exps.weight"),
        ("blk.0.ffn_gate_inp.weight", "MoE layer 0 is missing tensor(s) blk.0.ffn_gate_inp.weight"),
    ],
)
def test_moe_gguf_missing_an_expert_tensor_names_it(moe_models, tmp_path: Path, omitted: str, message: str) -> None:
    broken = write_gguf(moe_models["mixtral"]["safetensors"], tmp_path / "broken.gguf", "F32", omit=(omitted,))
    with pytest.raises(ValueError, match=f"broken.gguf: {message.replace('(', '[(]').replace(')', '[)]')}"):
        load_model_config(broken)


def test_moe_gguf_metadata_errors(moe_models, tmp_path: Path) -> None:
    path = moe_models["qwen3_moe"]["F32"]
    reader = gguf.GGUFReader(str(path))
    # Rewrite the file with an expert count the stacked tensors do not have.
    writer = gguf.GGUFWriter(str(tmp_path / "count.gguf"), "qwen3moe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = 6 if field.name == "qwen3moe.expert_count" else field.contents()
        writer.add_key_value(
            field.name, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None
        )
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ValueError,
        match="count.gguf: tensor 'blk.0.ffn_down_exps.weight' stacks 8 experts, the metadata says expert_count 6",
    ):
        load_model_config(tmp_path / "count.gguf")
