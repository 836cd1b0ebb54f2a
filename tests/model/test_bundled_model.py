"""The bundled default models: standard layout, quality on held-out stdlib code, pagoda == transformers."""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaForCausalLM

import pagoda
from pagoda import LLM, SamplingParams

MODELS_DIR = Path(pagoda.__file__).parent / "bundled_models"
TARGET_DIR = MODELS_DIR / "pagoda-coder"
DRAFT_DIR = MODELS_DIR / "pagoda-coder-draft"
MODEL_DIRS = [TARGET_DIR, DRAFT_DIR]
REQUIRED_FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
    "heldout_files.txt",
    "training_metrics.json",
    "loss_curve.png",
]
MAX_BUNDLE_BYTES = 30 * 10**6
TARGET_PARAMS = (5_000_000, 15_000_000)
DRAFT_PARAMS = (500_000, 2_000_000)
# The perplexity measured when the model was trained, plus slack for other torch builds and CPUs;
# the ceiling catches a retrained model that is broken along with its recorded numbers.
PERPLEXITY_SLACK = 1.15
PERPLEXITY_CEILING = 80.0
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):\n"]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def metrics() -> dict:
    return json.loads((TARGET_DIR / "training_metrics.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET_DIR)


@pytest.fixture(scope="module")
def target_model() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_dir", MODEL_DIRS, ids=lambda d: d.name)
def test_standard_hugging_face_layout(model_dir: Path):
    missing = [name for name in REQUIRED_FILES if not (model_dir / name).is_file()]
    assert not missing, f"{model_dir.name} lacks {missing}"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["chat_template"]
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == config["eos_token_id"]
    assert 0 < generation_config["temperature"] <= 1 and 0 < generation_config["top_p"] <= 1


def test_target_and_draft_share_one_tokenizer():
    for name in ("tokenizer.json", "tokenizer_config.json", "heldout_files.txt"):
        assert (TARGET_DIR / name).read_bytes() == (DRAFT_DIR / name).read_bytes(), name


def test_bundle_fits_the_size_budget():
    total = sum(path.stat().st_size for model_dir in MODEL_DIRS for path in model_dir.rglob("*") if path.is_file())
    assert total <= MAX_BUNDLE_BYTES, f"bundled models take {total / 1e6:.1f} MB"


def test_models_load_with_expected_sizes(metrics: dict, target_model: LlamaForCausalLM):
    draft_model = LlamaForCausalLM.from_pretrained(DRAFT_DIR, dtype=torch.float32)
    for model, (low, high), name in [
        (target_model, TARGET_PARAMS, "pagoda-coder"),
        (draft_model, DRAFT_PARAMS, "pagoda-coder-draft"),
    ]:
        params = sum(p.numel() for p in model.parameters())
        assert low <= params <= high, f"{name} has {params:,} parameters"
        assert params == metrics["models"][name]["parameters"]
        assert model.config.max_position_embeddings >= metrics["training"]["seq_len"]
    assert (
        draft_model.config.vocab_size == target_model.config.vocab_size == len(AutoTokenizer.from_pretrained(DRAFT_DIR))
    )


def test_tokenizer_special_tokens_and_chat_template(tokenizer):
    assert tokenizer.bos_token == tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    code = "def f(x):\n    return {'a': x ** 2}  # café\n"
    ids = tokenizer(code).input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == code
    messages = [
        {"role": "user", "content": "Sort a list.\n\nIn place."},
        {"role": "assistant", "content": "xs.sort()\n"},
        {"role": "user", "content": "Reverse it."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|endoftext|># Sort a list.\n#\n# In place.\n\nxs.sort()\n<|endoftext|># Reverse it.\n\n"


def test_heldout_files_are_recorded(metrics: dict):
    heldout = (TARGET_DIR / "heldout_files.txt").read_text().splitlines()
    assert len(heldout) == metrics["data"]["num_heldout_files"] > 0
    assert heldout == sorted(heldout)
    assert metrics["test_sample"]["files"] == heldout[: len(metrics["test_sample"]["files"])]


def test_heldout_perplexity_within_bound(metrics: dict, tokenizer, target_model: LlamaForCausalLM):
    """Same computation as the training script's test_sample: float32, first N tokens of each file."""
    sample = metrics["test_sample"]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = [stdlib / relpath for relpath in sample["files"]]
    if not all(path.is_file() for path in paths):
        pytest.skip("the held-out stdlib files are not on this machine")
    if [hashlib.sha256(path.read_bytes()).hexdigest() for path in paths] != sample["sha256"]:
        pytest.skip("this machine's stdlib differs from the one the model was trained on")
    total, count = 0.0, 0
    with torch.no_grad():
        for path in paths:
            text = path.read_text(encoding="utf-8")
            ids = torch.tensor(tokenizer(text, truncation=True, max_length=sample["max_tokens_per_file"]).input_ids)
            logits = target_model(input_ids=ids[None, :-1]).logits[0].float()
            total += F.cross_entropy(logits, ids[1:], reduction="sum").item()
            count += len(ids) - 1
    assert count == sample["num_predicted_tokens"]
    perplexity = math.exp(total / count)
    bound = min(sample["perplexity"] * PERPLEXITY_SLACK, PERPLEXITY_CEILING)
    assert perplexity < bound, f"held-out perplexity {perplexity:.2f}, bound {bound:.2f}"


def test_pagoda_greedy_matches_transformers(tokenizer, target_model: LlamaForCausalLM):
    llm = LLM(model=str(TARGET_DIR), dtype="float32", device="cpu", num_threads=1, kv_cache_memory="32MiB")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs):
        prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = target_model.generate(
                prompt_ids,
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=tokenizer.pad_token_id,
            )
        expected = generated[0, prompt_ids.shape[1] :].tolist()
        assert len(expected) == NEW_TOKENS  # EOS must not have stopped transformers early
        assert output.prompt_token_ids == prompt_ids[0].tolist()
        assert output.outputs[0].token_ids == expected, prompt
