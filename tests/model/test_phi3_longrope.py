"""Phi-3's LongRoPE per sequence against transformers (float32): a sequence within
original_max_position_embeddings runs on the short factors, a longer one on the long factors
from position 0, and one that grows past the boundary while decoding is computed again on the
long ones. One batch holds all three, with chunked prefill and prefix caching: KV computed on
one set of factors is never reused for the other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import assert_idle
from model_factory import assert_matches_reference, build_model, hf_greedy, load_hf_model
from pagoda import LLM, SamplingParams
from pagoda.model.model_config import ModelConfig

BOUNDARY = 32  # original_max_position_embeddings
MAX_POSITIONS = 128
LOGPROB_TOLERANCE = 1e-3
# (prompt length, new tokens): short throughout; crossing the boundary at its 7th token; long
# from the start; at the boundary, crossing on its first decoded token.
CASES = ((9, 12), (26, 16), (40, 16), (32, 4))


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(
        tmp_path_factory.mktemp("phi3_longrope"),
        "phi3",
        max_position_embeddings=MAX_POSITIONS,
        original_max_position_embeddings=BOUNDARY,
    )


@pytest.fixture(scope="module")
def cases(phi3_dir: Path) -> list[tuple[list[int], int, tuple[list[int], list[float]]]]:
    """(prompt, new tokens, transformers' greedy ids and logprobs) per case; the prompts past the
    first share a prefix."""
    model = load_hf_model(phi3_dir)
    generator = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    shared = torch.randint(5, vocab, (40,), generator=generator).tolist()
    prompts = [torch.randint(5, vocab, (CASES[0][0],), generator=generator).tolist()]
    prompts += [shared[:length] for length, _ in CASES[1:]]
    return [(prompt, new, hf_greedy(model, prompt, new)) for prompt, (_, new) in zip(prompts, CASES)]


def test_transformers_recomputes_a_crossing_sequence_on_the_long_factors(phi3_dir, cases) -> None:
    """The reference itself: generate's last logits equal one uncached forward of the whole
    sequence (long factors from position 0)."""
    model = load_hf_model(phi3_dir)
    prompt, _, (tokens, logprobs) = cases[1]
    sequence = prompt + tokens[:-1]
    assert len(sequence) > BOUNDARY
    with torch.no_grad():
        logits = model(torch.tensor([sequence]), use_cache=False).logits[0, -1]
    assert abs(torch.log_softmax(logits.float(), -1)[tokens[-1]].item() - logprobs[-1]) < 1e-4


def test_config_serves_the_long_context(phi3_dir) -> None:
    config = ModelConfig.from_dir(phi3_dir)
    assert (config.max_position_embeddings, config.long_rope_boundary) == (MAX_POSITIONS, BOUNDARY)


def test_both_sides_of_the_boundary_in_one_batch_match_transformers(phi3_dir, cases) -> None:
    llm = LLM(model=str(phi3_dir), block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    # Short-factor KV of the shared prefix in the cache: the long prompt must not reuse it.
    short_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([cases[1][0] + cases[2][0][26 : BOUNDARY - 1]], short_params)
    params = [SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0) for _, new, _ in cases]
    for _ in range(2):  # the second round finds the first's blocks, under both sets of factors
        outputs = llm.generate([prompt for prompt, _, _ in cases], params)
        assert_matches_reference(outputs, [reference for _, _, reference in cases], LOGPROB_TOLERANCE)
        assert_idle(llm)
    assert llm.engine.core.scheduler.num_rope_recomputes == 4  # the crossing and boundary cases, twice
    assert llm.engine.core.scheduler.prefix_cache_hits > 0


def test_preemption_and_no_prefix_cache_match_transformers(phi3_dir, cases) -> None:
    """A pool too small for the batch: preempted requests come back on the factors they left with."""
    llm = LLM(model=str(phi3_dir), block_size=4, num_kv_blocks=26, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0) for _, new, _ in cases]
    outputs = llm.generate([prompt for prompt, _, _ in cases], params)
    assert_matches_reference(outputs, [reference for _, _, reference in cases], LOGPROB_TOLERANCE)
    assert_idle(llm)
    assert llm.engine.core.scheduler.num_preemptions > 0
