"""Adapters against the reference: transformers + peft on the same tiny model and the same
random adapter (random, non-zero A and B). Greedy tokens must be identical and each chosen
token's logprob within LOGPROB_TOLERANCE (pagoda folds the scaling into B and computes the
fused q/k/v and gate/up deltas in one matmul each: float32 rounding differences only)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="peft (the test extra) is the reference for LoRA outputs")

from lora_factory import ALL_MODULES, ATTENTION_MODULES, MLP_MODULES, build_adapter, load_hf_adapter_model  # noqa: E402
from model_factory import hf_greedy  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.lora_request import LoRARequest  # noqa: E402

LOGPROB_TOLERANCE = 1e-3
MAX_TOKENS = 16
EOS = 0  # the tiny models' eos_token_id
PROMPT = [5, 17, 42, 99, 100, 7, 8, 200, 31, 64, 12, 250]

TARGET_SETS = {"attention": ATTENTION_MODULES, "mlp": MLP_MODULES, "all": ALL_MODULES, "qv": ["q_proj", "v_proj"]}
CASES = [(targets, rank, False) for targets in TARGET_SETS for rank in (4, 16)] + [("all", 8, True)]


@pytest.fixture(scope="module")
def llama_adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_adapters")
    return {
        case: build_adapter(
            llama_dir,
            root / f"{case[0]}-r{case[1]}-{'rs' if case[2] else 'plain'}",
            target_modules=TARGET_SETS[case[0]],
            rank=case[1],
            use_rslora=case[2],
            alpha=2 * case[1] if not case[2] else 8,
            seed=index + 1,
        )
        for index, case in enumerate(CASES)
    }


def _compare(base_dir, adapters: dict, llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    names = list(adapters)
    outputs = llm.generate(
        [PROMPT] * len(names),
        params,
        lora_request=[LoRARequest(str(n), i + 1, str(adapters[n])) for i, n in enumerate(names)],
    )
    base_tokens = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    for name, output in zip(names, outputs):
        reference_tokens, reference_logprobs = hf_greedy(
            load_hf_adapter_model(base_dir, adapters[name]), PROMPT, MAX_TOKENS
        )
        sample = output.outputs[0]
        # transformers' min_new_tokens bans EOS, ignore_eos does not: compare up to our first EOS.
        length = sample.token_ids.index(EOS) if EOS in sample.token_ids else MAX_TOKENS
        assert length >= 4, f"{name}: EOS too early for a meaningful comparison"
        assert sample.token_ids[:length] == reference_tokens[:length], name
        ours = [entry[token].logprob for entry, token in zip(sample.logprobs, sample.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours[:length], reference_logprobs)) < LOGPROB_TOLERANCE, name
        assert sample.token_ids != base_tokens, f"{name}: the adapter changed nothing (test too weak)"


def test_llama_target_sets_and_ranks_match_peft(llama_dir, llama_adapters) -> None:
    # All cases in one engine: they also share steps (one batch of mixed adapters).
    llm = LLM(
        model=str(llama_dir), enable_lora=True, max_loras=len(llama_adapters), max_lora_rank=16, num_kv_blocks=128
    )
    _compare(llama_dir, llama_adapters, llm)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "mistral"])
def test_other_architectures_match_peft(model_dirs, tmp_path, architecture) -> None:
    base_dir = model_dirs[architecture]
    adapters = {
        "all-r8": build_adapter(base_dir, tmp_path / "all", rank=8, seed=3),
        "qv-r4": build_adapter(base_dir, tmp_path / "qv", target_modules=["q_proj", "v_proj"], rank=4, seed=4),
    }
    llm = LLM(model=str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    _compare(base_dir, adapters, llm)


def test_quantized_base_with_adapter_runs_the_base_format(llama_dir, llama_adapters) -> None:
    """LoRA wraps Linear whatever its weight format: with int8 base weights the adapter still
    applies (compared with the same int8 engine's own single-request run) and base requests are
    unchanged by the wrapper."""
    adapter = llama_adapters[("all", 4, False)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(model=str(llama_dir), quantization="int8", num_kv_blocks=64)
    lora = LLM(model=str(llama_dir), quantization="int8", enable_lora=True, max_lora_rank=16, num_kv_blocks=64)
    with_adapter = lora.generate([PROMPT, PROMPT], params, lora_request=[LoRARequest("a", 1, str(adapter)), None])
    assert with_adapter[1].outputs[0].token_ids == plain.generate([PROMPT], params)[0].outputs[0].token_ids
    assert with_adapter[0].outputs[0].token_ids != with_adapter[1].outputs[0].token_ids
    assert torch.get_num_threads() == 1


def test_an_adapter_without_lora_alpha_takes_peft_default(llama_dir, tmp_path) -> None:
    # PEFT's LoraConfig defaults lora_alpha to 8, whatever the rank: a config that omits it is
    # scaled 8 / r, as PEFT loads it (rank 16 here, so any other stand-in would show).
    import json

    adapter = build_adapter(llama_dir, tmp_path / "no-alpha", rank=16, alpha=8, seed=7)
    config_path = adapter / "adapter_config.json"
    config = json.loads(config_path.read_text())
    del config["lora_alpha"]
    config_path.write_text(json.dumps(config))
    llm = LLM(model=str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=16, num_kv_blocks=64)
    _compare(llama_dir, {"no-alpha": adapter}, llm)
