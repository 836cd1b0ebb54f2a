"""The engine paths a dense model runs through, on mixture-of-experts models: n-gram speculation
keeps transformers' greedy outputs, structured output stays valid,
the host KV tier serves evicted prefixes without changing outputs, and a prefill/decode pair
equals one engine. Each leaves nothing held (tests/model/test_moe_models.py covers parity,
caching, chunking, preemption, n > 1 and the server; tests/executor the parallel layouts)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from engine_helpers import assert_idle, prompts_for
from model_factory import assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.kv_transfer.handoff import HandoffAuth, KVListener
from pagoda.sampling_params import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")

ARCHITECTURES = ("mixtral", "qwen3_moe")
NEW_TOKENS = 16
LOGPROB_TOLERANCE = 2e-5
SECRET = "k" * 32  # the KV transfer secret the prefill and decode engines share
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
BLOCK = 16


def repetitive_prompts(vocab_size: int) -> list[list[int]]:
    """Prompts with repeated n-grams, so the n-gram proposer has something to propose."""
    base = prompts_for(vocab_size, (6, 9), shared_length=0, seed=4)
    return [(p * 4)[:30] for p in base] + prompts_for(vocab_size, (25,), shared_length=0, seed=5)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_paths")
    return {arch: build_model(root / arch, arch) for arch in ARCHITECTURES}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_ngram_speculation_keeps_transformers_outputs(moe_dirs, architecture: str) -> None:
    prompts, references = hf_references(moe_dirs[architecture], repetitive_prompts, NEW_TOKENS)
    llm = LLM(model=str(moe_dirs[architecture]), speculative="ngram", num_speculative_tokens=3)
    assert_matches_reference(llm.generate(prompts, GREEDY, use_tqdm=False), references, LOGPROB_TOLERANCE)
    assert llm.engine.get_stats().spec_decode.num_draft_tokens > 0
    assert_idle(llm)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_structured_output_is_valid_json(moe_dirs, architecture: str) -> None:
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["a", "b"],
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
        },
    }
    llm = LLM(model=str(moe_dirs[architecture]))
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
    outputs = llm.generate(["a b c", "d e"], params, use_tqdm=False)
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert_idle(llm)


def distinct_prompts(count: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(5, 300, (length + 7 * i,), generator=generator).tolist() for i in range(count)]


def block_bytes(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * BLOCK * config["num_key_value_heads"] * head_dim * 4


def greedy_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_host_kv_tier_serves_evicted_prefixes_without_changing_outputs(moe_dirs, architecture: str) -> None:
    model_dir = moe_dirs[architecture]
    prompts = distinct_prompts(6, 40)
    common = dict(model=str(model_dir), num_kv_blocks=10, max_num_seqs=2, max_num_batched_tokens=64, block_size=BLOCK)
    baseline = LLM(**common)
    expected = [greedy_ids(baseline, prompts), greedy_ids(baseline, prompts)]
    llm = LLM(**common, kv_offload_memory=str(64 * block_bytes(model_dir)))
    assert [greedy_ids(llm, prompts), greedy_ids(llm, prompts)] == expected
    stats = llm.engine.get_stats()
    assert stats.kv_tiers.hits["host"] > 0
    llm.engine.core.kv_tiers.transfer.wait_all()
    assert_idle(llm)
    assert llm.engine.core.kv_tiers.host.num_private == 0


def engine(model_dir: Path, role: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            role=role,
            num_kv_blocks=48,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=256,
            enable_prefix_caching=True,
            kv_transfer_secret=SECRET,
        )
    )


def run_to_end(llm: LLMEngine) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for delta in llm.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    return outputs


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_prefill_decode_pair_matches_one_engine(moe_dirs, architecture: str) -> None:
    model_dir = moe_dirs[architecture]
    prompts = distinct_prompts(3, 40)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    single = engine(model_dir, "both")
    for i, tokens in enumerate(prompts):
        single.add_request(EngineRequest(f"r{i}", tokens, params))
    expected = run_to_end(single)

    prefill, decode = engine(model_dir, "prefill"), engine(model_dir, "decode")
    for i, tokens in enumerate(prompts):
        prefill.add_request(EngineRequest(f"r{i}", tokens, params))
    assert run_to_end(prefill) == {}
    imported = []
    with KVListener("shm", HandoffAuth(SECRET)) as listener:
        for handoff in prefill.kv_connector.take_handoffs():
            sender = threading.Thread(
                target=lambda h=handoff: prefill.kv_connector.send_handoff(h, "shm", listener.address, 10.0)
            )
            sender.start()
            imported.append(decode.add_prefilled_request(listener.accept(10.0), fallback=True))
            sender.join()
    assert imported == [True] * 3
    assert run_to_end(decode) == expected
    for llm in (prefill, decode):
        assert not llm.has_unfinished_requests()
        assert llm.core.kv_cache.num_held_blocks() == 0
