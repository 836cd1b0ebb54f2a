"""LoRA through the engine: mixed batches, the per-step adapter limit, prefix-cache
isolation, run-time load/unload with evictions, and the idle invariant after all of it."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine_helpers import assert_idle
from pagoda import LLM, SamplingParams
from pagoda.engine.engine_request import EngineRequest
from pagoda.errors import InvalidRequest
from pagoda.lora_request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = [
    [5, 17, 42, 99, 100, 7, 8, 200, 31, 64, 12, 250, 3, 9, 77, 120, 41, 6, 90, 11],
    [33, 44, 55, 66, 77, 88],
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111],
    [7, 7, 9, 12, 250, 300, 41],
]


def lora_llm(llama_dir, **overrides) -> LLM:
    args = dict(enable_lora=True, max_loras=4, max_lora_rank=16, num_kv_blocks=96, block_size=4)
    return LLM(model=str(llama_dir), **{**args, **overrides})


def record_steps(llm: LLM) -> list[set[str]]:
    """Adapter names (and "base") of each forward from now on."""
    steps: list[set[str]] = []
    manager = llm.engine.core.lora
    begin = manager.begin_step

    def spy(token_runs):
        steps.append({identity.name if identity else "base" for identity, _ in token_runs})
        return begin(token_runs)

    manager.begin_step = spy
    return steps


def test_mixed_batch_equals_each_request_alone(llama_dir, lora_dirs) -> None:
    requests = [
        LoRARequest("sql", 1, str(lora_dirs["sql"])),
        LoRARequest("chat", 2, str(lora_dirs["chat"])),
        LoRARequest("code", 3, str(lora_dirs["code"])),
        None,
    ]
    alone = []
    for prompt, lora_request in zip(PROMPTS, requests):
        llm = lora_llm(llama_dir)
        alone.append(llm.generate([prompt], GREEDY, lora_request=lora_request)[0].outputs[0])
    llm = lora_llm(llama_dir)
    steps = record_steps(llm)
    mixed = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, lora_request=requests)]
    assert any(step == {"sql", "chat", "code", "base"} for step in steps)  # really one batch
    for one, together in zip(alone, mixed):
        assert together.token_ids == one.token_ids
        got = [e[t].logprob for e, t in zip(together.logprobs, together.token_ids)]
        want = [e[t].logprob for e, t in zip(one.logprobs, one.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    # Base-model requests are untouched by the LoRA layers: same as an engine without LoRA.
    plain = LLM(model=str(llama_dir), num_kv_blocks=96, block_size=4)
    assert plain.generate([PROMPTS[3]], GREEDY)[0].outputs[0].token_ids == mixed[3].token_ids
    assert_idle(llm)


def test_a_step_never_holds_more_than_max_loras_and_none_starves(llama_dir, lora_dirs) -> None:
    llm = lora_llm(llama_dir, max_loras=2, max_num_seqs=8)
    steps = record_steps(llm)
    names = ["sql", "chat", "code", "math"]
    requests = [LoRARequest(names[i % 4], 0, str(lora_dirs[names[i % 4]])) for i in range(16)] + [None] * 4
    prompts = [PROMPTS[i % 4] for i in range(20)]
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), lora_request=requests
    )
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert max(len(step - {"base"}) for step in steps) == 2
    assert llm.engine.core.lora.slots.num_loads > 2  # adapters were evicted and brought back
    assert_idle(llm)


def test_prefix_cache_never_crosses_adapters(llama_dir, lora_dirs, tmp_path) -> None:
    llm = lora_llm(llama_dir)
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(lora_request):
        return llm.generate([prompt], params, lora_request=lora_request)[0].num_cached_tokens

    sql = LoRARequest("sql", 1, str(lora_dirs["sql"]))
    assert cached(sql) == 0
    assert cached(sql) > 0  # the same adapter reuses its blocks
    assert cached(None) == 0  # the base model never sees the adapter's KV
    assert cached(LoRARequest("chat", 2, str(lora_dirs["chat"]))) == 0
    assert cached(None) > 0
    # Same name, different weights: the content hash keeps the old blocks out of reach.
    llm.engine.remove_lora("sql")
    assert cached(LoRARequest("sql", 1, str(lora_dirs["code"]))) == 0
    llm.engine.remove_lora("sql")
    copy = tmp_path / "sql-copy"
    shutil.copytree(lora_dirs["sql"], copy)  # same content, other path: the same KV is valid
    assert cached(LoRARequest("sql", 1, str(copy))) > 0
    assert_idle(llm)


def test_unload_and_reload_mid_run_keeps_running_requests_and_idles(llama_dir, lora_dirs) -> None:
    llm = lora_llm(llama_dir, max_loras=1)
    engine = llm.engine
    engine.add_lora(LoRARequest("sql", 1, str(lora_dirs["sql"])))
    engine.add_lora(LoRARequest("chat", 2, str(lora_dirs["chat"])))
    expected = {
        name: lora_llm(llama_dir)
        .generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest(name, 1, str(lora_dirs[name])))[0]
        .outputs[0]
        .token_ids
        for name in ("sql", "chat")
    }
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request(EngineRequest("a", PROMPTS[0], params, lora_request=LoRARequest("sql", 1)))
    engine.add_request(EngineRequest("b", PROMPTS[0], params, lora_request=LoRARequest("chat", 2)))
    outputs: dict[str, list[int]] = {"a": [], "b": []}

    def step() -> None:
        for delta in engine.step().deltas:
            for sample in delta.outputs:
                outputs[delta.request_id].extend(sample.token_ids)

    for _ in range(3):
        step()
    engine.remove_lora("sql")  # "a" keeps running with it; new requests cannot name it
    with pytest.raises(InvalidRequest) as error:
        engine.add_request(EngineRequest("c", PROMPTS[1], params, lora_request=LoRARequest("sql", 1)))
    assert error.value.code == "model_not_found"
    engine.add_lora(LoRARequest("sql", 3, str(lora_dirs["sql"])))  # reloaded under the same name
    engine.add_request(EngineRequest("c", PROMPTS[0], params, lora_request=LoRARequest("sql", 3)))
    outputs["c"] = []
    while engine.has_unfinished_requests():
        step()
    assert outputs["a"] == expected["sql"] and outputs["c"] == expected["sql"]
    assert outputs["b"] == expected["chat"]
    assert engine.core.lora.slots.num_loads >= 3  # one slot: every switch is an eviction
    assert_idle(llm)
    assert sorted(engine.list_loras()) == ["chat", "sql"]


def test_bad_adapters_are_refused_with_the_reason(llama_dir, lora_dirs, model_dirs, tmp_path) -> None:
    from lora_factory import build_adapter

    llm = lora_llm(llama_dir, max_lora_rank=8)
    engine = llm.engine

    def refused(path, name="bad") -> str:
        with pytest.raises(InvalidRequest) as error:
            engine.add_lora(LoRARequest(name, 9, str(path)))
        assert name in error.value.message
        return error.value.message

    assert "exceeds --max-lora-rank 8" in refused(lora_dirs["code"])  # rank 16
    other = build_adapter(model_dirs["qwen3"], tmp_path / "qwen3", rank=4)
    assert "another base model" in refused(other)
    (tmp_path / "empty").mkdir()
    assert "missing adapter_config.json" in refused(tmp_path / "empty")
    assert "no such directory" in refused(tmp_path / "absent")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(lora_dirs["sql"], corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert "corrupt or truncated" in refused(corrupt)
    lm_head = build_adapter(llama_dir, tmp_path / "lm_head", target_modules=["q_proj", "lm_head"], rank=4)
    assert "lm_head" in refused(lm_head)
    deeper = tmp_path / "deeper"  # an adapter for a base model with more layers
    shutil.copytree(lora_dirs["sql"], deeper)
    tensors = load_file(deeper / "adapter_model.safetensors")
    save_file(
        {name.replace("layers.1.", "layers.7."): tensor for name, tensor in tensors.items()},
        deeper / "adapter_model.safetensors",
    )
    assert "adapts layer 7 but the base model has 2 layers" in refused(deeper)
    engine.add_lora(LoRARequest("sql", 1, str(lora_dirs["sql"])))
    assert "already loaded" in refused(lora_dirs["sql"], name="sql")
    with pytest.raises(InvalidRequest) as error:
        engine.remove_lora("nope")
    assert error.value.code == "model_not_found"
    # The running engine is unaffected by all of it.
    out = llm.generate([PROMPTS[1]], GREEDY, lora_request=LoRARequest("sql", 1))
    assert len(out[0].outputs[0].token_ids) == 12
    assert_idle(llm)


def test_startup_errors_name_the_adapter(llama_dir, lora_dirs, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"'big'.*exceeds --max-lora-rank 8"):
        LLM(
            model=str(llama_dir),
            enable_lora=True,
            max_lora_rank=8,
            num_kv_blocks=16,
            lora_modules=[f"big={lora_dirs['code']}"],
        )
    with pytest.raises(ValueError, match="NAME=PATH"):
        LLM(model=str(llama_dir), enable_lora=True, lora_modules=["no-path"])
    with pytest.raises(ValueError, match="'sql' only once"):
        LLM(model=str(llama_dir), enable_lora=True, lora_modules=[f"sql={tmp_path}", f"sql={tmp_path}"])
    with pytest.raises(ValueError, match="--enable-lora"):
        LLM(model=str(llama_dir), lora_modules=[f"sql={lora_dirs['sql']}"])
    plain = LLM(model=str(llama_dir), num_kv_blocks=16)
    with pytest.raises(InvalidRequest, match="without --enable-lora"):
        plain.generate([PROMPTS[1]], GREEDY, lora_request=LoRARequest("sql", 1, str(lora_dirs["sql"])))


def test_host_tier_keeps_adapters_apart(llama_dir, lora_dirs) -> None:
    """Evicted blocks carry their adapter-qualified hash to the host tier: a lookup through the
    tier finds them for the same adapter only."""
    import torch

    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(5, 300, (60,), generator=generator).tolist()
    fillers = [torch.randint(5, 300, (60,), generator=generator).tolist() for _ in range(4)]
    llm = LLM(
        model=str(llama_dir),
        enable_lora=True,
        max_lora_rank=16,
        num_kv_blocks=12,
        max_num_seqs=2,
        kv_offload_memory="4MiB",
    )
    sql, chat = LoRARequest("sql", 1, str(lora_dirs["sql"])), LoRARequest("chat", 2, str(lora_dirs["chat"]))
    first = llm.generate([prompt], GREEDY, lora_request=sql)[0]
    llm.generate(fillers, GREEDY)  # pushes the prompt's blocks out of the 12-block device pool
    kv = llm.engine.core.kv_cache
    host_hits = kv.tier_hits["host"]
    assert llm.generate([prompt], GREEDY, lora_request=chat)[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    again = llm.generate([prompt], GREEDY, lora_request=sql)[0]
    assert again.num_cached_tokens > 0 and kv.tier_hits["host"] > host_hits
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_idle(llm)
