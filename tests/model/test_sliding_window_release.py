"""Blocks behind sliding windows go back to the pool during decoding, and outputs stay those of
transformers past the window: Mistral (every layer slides) and Gemma 2 (local and global layers)
on tiny checkpoints with an 8-token window and 4-token blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import assert_idle
from model_factory import assert_matches_reference, build_model, hf_greedy, load_hf_model
from pagoda import LLM, SamplingParams
from pagoda.engine.engine_request import EngineRequest

WINDOW = 8
BLOCK = 4
NEW_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
LOGPROB_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {arch: build_model(root / arch, arch, sliding_window=WINDOW) for arch in ("mistral", "gemma2")}


@pytest.fixture(scope="module")
def expected(windowed_dirs):
    result = {}
    for arch, directory in windowed_dirs.items():
        hf_model = load_hf_model(directory)
        generator = torch.Generator().manual_seed(3)
        shared = torch.randint(5, hf_model.config.vocab_size, (14,), generator=generator).tolist()
        prompts = [
            shared + torch.randint(5, hf_model.config.vocab_size, (n,), generator=generator).tolist() for n in (3, 21)
        ] + [torch.randint(5, hf_model.config.vocab_size, (6,), generator=generator).tolist()]
        result[arch] = prompts, [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in prompts]
    return result


def assert_matches(outputs, references) -> None:
    assert_matches_reference(outputs, references, LOGPROB_TOLERANCE)


@pytest.mark.parametrize("architecture", ["mistral", "gemma2"])
@pytest.mark.parametrize(
    "settings",
    [dict(), dict(max_num_batched_tokens=8), dict(num_kv_blocks=16, max_num_batched_tokens=8)],
    ids=["whole-prompts", "chunked", "preemption"],
)
def test_outputs_past_the_window_match_transformers(windowed_dirs, expected, architecture: str, settings: dict) -> None:
    prompts, references = expected[architecture]
    llm = LLM(model=str(windowed_dirs[architecture]), block_size=BLOCK, **settings)
    assert len(llm.engine.core.kv_groups) > 1 or llm.engine.core.kv_groups[0].window == WINDOW
    for _ in range(2):  # the second round starts from the prefix cache
        assert_matches(llm.generate(prompts, GREEDY), references)
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits > 0
    if "num_kv_blocks" in settings and architecture == "gemma2":
        assert stats.num_preemptions > 0
    assert_idle(llm)


@pytest.mark.parametrize("architecture", ["mistral", "gemma2"])
def test_held_blocks_stop_growing_on_the_local_layers_past_the_window(windowed_dirs, architecture: str) -> None:
    llm = LLM(model=str(windowed_dirs[architecture]), block_size=BLOCK, enable_prefix_caching=False)
    core = llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    core.add_request(EngineRequest("long", list(range(5, 10)), params))
    held = []
    while core.has_unfinished_requests():
        core.step()
        held.append(core.kv_cache.num_held_blocks())
    held = held[:-1]  # the last step finished and freed the request
    local_groups = sum(1 for g in core.kv_groups if g.window is not None)
    global_groups = len(core.kv_groups) - local_groups
    # Late in the decode: every local group holds at most 3 blocks, the global ones all of theirs.
    num_tokens = 5 + len(held)
    assert held[-1] <= 3 * local_groups + global_groups * -(-num_tokens // BLOCK)
    if global_groups == 0:
        assert max(held[20:]) <= 3 * local_groups
    else:  # past the window only the global group grows: one block every BLOCK tokens
        assert held[-1] - held[-1 - 8 * BLOCK] == 8 * global_groups
    assert core.kv_cache.num_held_blocks() == 0
