"""pagoda's outputs against transformers running the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import build_model, hf_greedy, load_hf_model
from pagoda import LLM, SamplingParams, native

NEW_TOKENS = 32
LOGPROB_TOLERANCE = 1e-4  # float32


def mixed_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = [3, 11, 40, 57]  # 40 and 57 exceed Mistral's 24-token sliding window
    return [torch.randint(5, vocab_size, (n,), generator=generator).tolist() for n in lengths]


# Both ways: "off" is the transformers-exact mode (PyTorch's ops), "auto" the default (pagoda's
# native CPU kernels where they build, pagoda.native): its sums run in another order, and on these
# models greedy tokens still match and logprobs stay within LOGPROB_TOLERANCE.
@pytest.mark.parametrize("native_kernels", ["off", "auto"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_and_logprobs_match_transformers(model_dirs, architecture, native_kernels):
    if native_kernels == "auto" and not native.available():  # auto would run "off" again
        pytest.skip("the native kernels do not build here")
    directory = model_dirs[architecture]
    hf_model = load_hf_model(directory)
    prompts = mixed_prompts(hf_model.config.vocab_size)
    llm = LLM(model=str(directory), native_kernels=native_kernels)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        expected_tokens, expected_logprobs = hf_greedy(hf_model, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens
        assert completion.finish_reason == "length"
        logprobs = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < LOGPROB_TOLERANCE
        assert all(completion.logprobs[i][t].rank == 1 for i, t in enumerate(completion.token_ids))


def test_sharded_checkpoint_gives_same_outputs(tmp_path):
    single = build_model(tmp_path / "single", "llama", seed=3)
    sharded = build_model(tmp_path / "sharded", "llama", seed=3, max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    a = [o.outputs[0].token_ids for o in LLM(model=str(single)).generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in LLM(model=str(sharded)).generate(prompts, params)]
    assert a == b


def test_bfloat16_weights_load_and_generate(tmp_path):
    directory = build_model(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    outputs = LLM(model=str(directory), dtype="bfloat16").generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert len(outputs[0].outputs[0].token_ids) == 8


def _copy_model(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def test_unknown_architecture_is_a_clear_error(llama_dir, tmp_path):
    directory = _copy_model(llama_dir, tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(model=str(directory))


def test_missing_shard_names_the_file(tmp_path):
    directory = build_model(tmp_path / "sharded", "llama", max_shard_size="60KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (directory / victim).unlink()
    with pytest.raises(ValueError, match=victim):
        LLM(model=str(directory))


def test_shape_mismatch_names_file_and_tensor(llama_dir, tmp_path):
    directory = _copy_model(llama_dir, tmp_path / "m")
    tensors = load_file(str(directory / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors.*down_proj\.weight.*\(3, 3\)"):
        LLM(model=str(directory))


def test_missing_tensor_is_named(llama_dir, tmp_path):
    directory = _copy_model(llama_dir, tmp_path / "m")
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight"):
        LLM(model=str(directory))
