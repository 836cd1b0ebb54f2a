"""GGUF checkpoints: tiny test models written with gguf's GGUFWriter (as llama.cpp's converter
writes them) load and generate like the safetensors originals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF support needs the `gguf` package")

from engine_helpers import teacher_forced_agreement  # noqa: E402
from gguf_factory import write_gguf  # noqa: E402
from model_factory import build_model  # noqa: E402
from pagoda.engine.llm import LLM  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys", "for i in range(10):"]


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # GGUF stores unscaled rope here (llama3 scaling travels as a rope_freqs tensor, not read yet).
    return build_model(
        tmp_path_factory.mktemp("gguf") / "llama",
        "llama",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


@pytest.fixture(scope="module")
def gguf_files(plain_llama: Path, model_dirs: dict[str, Path]) -> dict[str, Path]:
    root = plain_llama.parent
    files = {t: write_gguf(plain_llama, root / f"tiny-{t}.gguf", t) for t in ("F32", "Q8_0", "Q4_0")}
    qwen_dir = root / "qwen2-gguf"
    qwen_dir.mkdir()
    files["qwen2-F32"] = write_gguf(model_dirs["qwen2"], qwen_dir / "qwen2.gguf", "F32")
    return files


def _greedy(model: str | Path, prompts, max_tokens: int = 24, **engine_args):
    llm = LLM(model=str(model), kv_cache_memory="32MiB", **engine_args)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return llm, outputs


def test_f32_gguf_matches_safetensors_token_for_token(plain_llama: Path, gguf_files: dict[str, Path]) -> None:
    reference_llm, reference = _greedy(plain_llama, PROMPTS)
    gguf_llm, outputs = _greedy(gguf_files["F32"], PROMPTS)
    # The tokenizer came from the GGUF metadata.
    assert gguf_llm.tokenizer.encode("def fibonacci(n):") == reference_llm.tokenizer.encode("def fibonacci(n):")
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in reference]


def test_qwen2_f32_gguf_in_a_directory(model_dirs: dict[str, Path], gguf_files: dict[str, Path]) -> None:
    """Qwen2: q/k stored unpermuted, biases, tied embeddings; --model names the directory."""
    _, reference = _greedy(model_dirs["qwen2"], PROMPTS[:2])
    _, outputs = _greedy(gguf_files["qwen2-F32"].parent, PROMPTS[:2])
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]


def test_q8_0_gguf_agrees_with_full_precision(plain_llama: Path, gguf_files: dict[str, Path]) -> None:
    _, reference = _greedy(plain_llama, PROMPTS, max_tokens=32)
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in reference]
    prompt_lens = [len(o.prompt_token_ids) for o in reference]
    # Observed 125/128 on this random model (free-running greedy diverges earlier: random
    # tiny models have many near-ties).
    assert teacher_forced_agreement(gguf_files["Q8_0"], sequences, prompt_lens) >= 0.95


def test_q4_0_gguf_is_served_as_int4_exactly(gguf_files: dict[str, Path]) -> None:
    from pagoda.model.loader import load_model, load_model_config
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint

    path = gguf_files["Q4_0"]
    model = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"))
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight_format.name == "int4" and layer.weight_format.group_size == 32
    tensor = GGUFCheckpoint(path).tensors["blk.0.ffn_down.weight"]
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    # Identity input: the layer returns its effective weight (transposed), bf16-rounded.
    effective = layer(torch.eye(layer.in_features)).t()
    torch.testing.assert_close(effective, expected, rtol=1e-2, atol=1e-3)
    _, outputs = _greedy(path, PROMPTS[:1], max_tokens=8)
    assert len(outputs[0].outputs[0].token_ids) == 8


def test_gguf_with_requested_int8(gguf_files: dict[str, Path]) -> None:
    llm, outputs = _greedy(gguf_files["Q8_0"], PROMPTS[:1], max_tokens=8, quantization="int8")
    assert llm.engine.core.runner.model.model.layers[0].self_attn.qkv_proj.weight_format.name == "int8"
    assert len(outputs[0].outputs[0].token_ids) == 8


def test_bad_gguf_files_are_clear_errors(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    from pagoda.model.loader import load_model_config

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_files["F32"].read_bytes()[:3000])
    with pytest.raises(ValueError, match="truncated.gguf: not a readable GGUF file, corrupt or truncated"):
        load_model_config(truncated)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"NOPE" + bytes(200))
    with pytest.raises(ValueError, match="garbage.gguf: not a readable GGUF file"):
        load_model_config(garbage)

    other_arch = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(other_arch), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="phi.gguf: GGUF architecture 'phi2' is not supported; pagoda serves llama"):
        load_model_config(other_arch)

    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"GGUF")
    (two / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="holds several GGUF files"):
        load_model_config(two)


def test_supported_types_include_k_quants() -> None:
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint

    supported = GGUFCheckpoint.supported_types()
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"):
        assert name in supported


def test_k_quant_tensors_are_dequantized_and_unpermuted(tmp_path: Path) -> None:
    """Q4_K (a permuted Llama q projection), Q5_K and Q6_K load as the gguf package's
    dequantized values; the model then serves in full precision."""
    from pagoda.model.loader import load_model, load_model_config
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint

    # K-quant blocks hold 256 values: every input dimension must be a multiple of 256.
    model_dir = build_model(
        tmp_path / "wide",
        "llama",
        hidden_size=256,
        intermediate_size=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    path = write_gguf(
        model_dir, tmp_path / "kq.gguf", "F32", k_quants={"attn_q": "Q4_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K"}
    )
    checkpoint = GGUFCheckpoint(path)

    def dequantized(name: str) -> torch.Tensor:
        tensor = checkpoint.tensors[name]
        assert tensor.tensor_type.name in ("Q4_K", "Q5_K", "Q6_K")
        return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))

    model = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"))
    layer = model.model.layers[1]
    assert layer.mlp.down_proj.weight_format.name == "full"

    def effective(linear):  # the weight a (possibly pre-packed) layer multiplies by, [out, in]
        return linear.kernels.linear(linear, torch.eye(linear.in_features), None).t()

    torch.testing.assert_close(effective(layer.mlp.down_proj), dequantized("blk.1.ffn_down.weight"))
    torch.testing.assert_close(effective(layer.mlp.gate_up_proj)[512:], dequantized("blk.1.ffn_up.weight"))
    # transformers' reverse of llama.cpp's q permutation, 4 heads.
    q = dequantized("blk.1.attn_q.weight")
    unpermuted = q.reshape(4, q.shape[0] // 8, 2, -1).transpose(1, 2).reshape(q.shape)
    torch.testing.assert_close(effective(layer.self_attn.qkv_proj)[:256], unpermuted)
    _, outputs = _greedy(path, PROMPTS[:1], max_tokens=4)
    assert len(outputs[0].outputs[0].token_ids) == 4


def test_serve_banner_reads_the_config_from_a_gguf_file(gguf_files: dict[str, Path]) -> None:
    from pagoda.config import DeploymentConfig, EngineConfig
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.serve.launch import startup_banner
    from pagoda.serve.settings import ServerSettings

    config = EngineConfig(model=str(gguf_files["F32"]), num_kv_blocks=32, num_threads=1)
    llm = AsyncLLM(config, transport="thread")
    try:
        banner = startup_banner(config, DeploymentConfig(), ServerSettings(served_model_name="tiny"), llm)
    finally:
        llm.shutdown()
    assert "tiny-F32.gguf" in banner and "KV pool" in banner
