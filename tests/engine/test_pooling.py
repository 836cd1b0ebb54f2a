"""The engine's pooling path: a prompt's final-norm hidden states pooled ("last" or "mean")
equal transformers' last hidden state, batched and chunked like any prefill, with no KV kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n", "import os", "hello world, " * 6]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    # A small token budget: the longer prompts are computed in several chunks.
    return LLM(model=str(llama_dir), num_kv_blocks=64, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def hidden_states(llama_dir: Path, llm: LLM) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    tokenizer = llm.get_tokenizer()
    with torch.no_grad():
        return [model.model(torch.tensor([tokenizer.encode(p)])).last_hidden_state[0] for p in PROMPTS]


@pytest.mark.parametrize("method", ["last", "mean"])
def test_pooled_prompts_equal_transformers(llm: LLM, hidden_states: list[torch.Tensor], method: str) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, pooling=method))
    for output, hidden in zip(outputs, hidden_states):
        expected = hidden[-1] if method == "last" else hidden.mean(dim=0)
        assert output.embedding is not None and len(output.embedding) == hidden.shape[-1]
        assert torch.allclose(torch.tensor(output.embedding), expected, atol=1e-4, rtol=1e-3)
        assert len(output.outputs[0].token_ids) == 1  # the prefill's token; nothing decoded
    stats = llm.engine.core.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_pooling_ignores_cached_prefixes(llm: LLM, hidden_states: list[torch.Tensor]) -> None:
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))  # fills the prefix cache
    (output,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1, pooling="mean"))
    assert torch.allclose(torch.tensor(output.embedding), hidden_states[0].mean(dim=0), atol=1e-4, rtol=1e-3)


def test_generation_has_no_embedding(llm: LLM) -> None:
    (output,) = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2))
    assert output.embedding is None


def test_unknown_pooling_is_refused() -> None:
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="cls")
