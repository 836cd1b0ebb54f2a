"""GPU benchmark: pagoda on random-weight models of real shapes, against the memory roofline and
against `transformers` in the same run.

Models (bf16, nothing downloaded: config.json, a word-level tokenizer covering the vocabulary
and random safetensors generated on the GPU are written to a temporary directory):
  qwen3-0.6b  Qwen3-0.6B shapes (28 layers, hidden 1024, 16 q / 8 kv heads of 128, tied embeddings)
  llama3-8b   Llama-3-8B shapes (32 layers, hidden 4096, 32 q / 8 kv heads of 128)
  tiny        a few-MB Qwen3-shaped model, for a smoke run of this script (also on CPU)

Per model:
  single-stream decode: one request, --single-prompt-len prompt tokens, --single-output-len new tokens;
      decode tokens/s from the first token to the last, and the roofline: the device-to-device
      copy bandwidth measured in this run over the bytes one decode token must read (every weight
      the forward touches + the KV cache of the context, averaged over the run)
  offline throughput: --num-seqs requests, prompt and output lengths uniform in [--min-len, --max-len],
      ignore_eos (the nano-vllm workload); output tokens/s and total tokens/s
  both again through `transformers` generate (bf16, SDPA; offline in static batches of
      --hf-batch-size with left padding, counting only the tokens each request asked for;
      --hf-num-seqs runs it on the workload's first N requests only, and the ratio is then one of
      output tokens per second, each side over the requests it ran)
  with --profile-batches: one decode step at each batch size under torch.profiler (host time
      per step, device kernel time, how many steps replayed a CUDA graph, the top kernels)

    python benchmarks/gpu.py                                   # everything, ~15-30 min on one H100
    python benchmarks/gpu.py --models qwen3-0.6b --num-seqs 64
    benchmarks/gpu_check.sh runs it cut to fit a few minutes (see benchmarks/README.md)
    python benchmarks/gpu.py --models tiny --device cpu --num-seqs 4 --max-len 32 \\
        --single-prompt-len 16 --single-output-len 16 --out /tmp/gpu.json   # smoke run
Results go to benchmarks/results/gpu.json (with the GPU's name and the date).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu.json"
GiB = 2**30

MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
    },
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    },
    "tiny": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    },
}


# ---- the model on disk ------------------------------------------------------------------------


def checkpoint_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if config["model_type"] == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one entry per model token id, so every id decodes."""
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>").save_pretrained(directory)


def write_random_model(
    directory: Path, config: dict[str, Any], device: torch.device, seed: int = 0, shard_bytes: int = 4 * GiB
) -> int:
    """config.json, tokenizer and bf16 safetensors shards of N(0, 0.02) weights (norms = 1),
    drawn on `device`. Returns the number of parameters."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(
        json.dumps(
            {**config, "torch_dtype": "bfloat16", "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0}, indent=2
        )
    )
    write_tokenizer(directory, config["vocab_size"])
    generator = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_size = num_params = 0
    names = list(checkpoint_shapes(config).items())

    def flush() -> None:
        nonlocal shard, shard_size
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update({tensor: name for tensor in shard})
        shard, shard_size = {}, 0

    for name, shape in names:
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            tensor = torch.randn(shape, generator=generator, dtype=torch.float32, device=device).mul_(0.02)
            tensor = tensor.to(torch.bfloat16)
        shard[name] = tensor.cpu()
        shard_size += tensor.numel() * 2
        num_params += tensor.numel()
        if shard_size >= shard_bytes:
            flush()
    if shard:
        flush()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 2 * num_params}, "weight_map": weight_map}, indent=2)
    )
    return num_params


# ---- the roofline -----------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, size_bytes: int, iterations: int = 20) -> float:
    """Bytes/s moved by a large device-to-device copy (each copy reads and writes size_bytes)."""
    source = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        target.copy_(source)
    synchronize(device)
    elapsed = time.perf_counter() - start
    del source, target
    return 2 * size_bytes * iterations / elapsed


def decode_bytes_per_token(config: dict[str, Any], mean_context: float) -> tuple[int, float]:
    """(weight bytes, KV bytes) one decode step of one sequence reads in bf16. An untied
    embedding table contributes one row; a tied one is read whole as the LM head."""
    shapes = checkpoint_shapes(config)
    weights = 2 * sum(math.prod(s) for s in shapes.values())
    if not config["tie_word_embeddings"]:
        weights -= 2 * (config["vocab_size"] - 1) * config["hidden_size"]
    kv_per_position = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
    return weights, kv_per_position * mean_context


# ---- workloads --------------------------------------------------------------------------------


def make_workload(num_seqs: int, low: int, high: int, vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(low, high + 1, (num_seqs,), generator=generator).tolist()
    output_lens = torch.randint(low, high + 1, (num_seqs,), generator=generator).tolist()
    prompts = [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in prompt_lens]
    return prompts, output_lens


def pagoda_single_stream(llm: Any, prompt: list[int], output_len: int) -> dict[str, float]:
    from pagoda import SamplingParams
    from pagoda.engine.engine_request import EngineRequest

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(EngineRequest("single-stream", prompt, params))
    start = time.perf_counter()
    first_time = first_count = None
    count = 0
    while True:
        deltas = engine.step().deltas
        now = time.perf_counter()
        delta = next((d for d in deltas if d.request_id == "single-stream"), None)
        if delta is None:
            continue
        count += sum(len(sample.token_ids) for sample in delta.outputs)
        if first_time is None and count:
            first_time, first_count = now, count
        if delta.finished:
            break
    decode_tokens = count - first_count
    return {
        "time_to_first_token_s": first_time - start,
        "decode_tokens": decode_tokens,
        "decode_tok_per_s": decode_tokens / (now - first_time),
    }


def pagoda_offline(llm: Any, prompts: list[list[int]], output_lens: list[int]) -> dict[str, float]:
    from pagoda import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if generated != sum(output_lens):
        raise RuntimeError(f"pagoda generated {generated} tokens, {sum(output_lens)} were asked for")
    total = generated + sum(len(p) for p in prompts)
    return {
        "seconds": elapsed,
        "output_tokens": generated,
        "output_tok_per_s": generated / elapsed,
        "total_tok_per_s": total / elapsed,
    }


def profile_decode(
    llm: Any,
    batch_size: int,
    vocab_size: int,
    device: torch.device,
    seed: int,
    prompt_len: int = 128,
    warmup_steps: int = 3,
    steps: int = 3,
) -> tuple[dict[str, Any], str]:
    """`batch_size` requests prefilled, then `steps` decode-only engine steps under torch.profiler:
    wall time per step against device kernel time (the rest is the GPU waiting on the host), the
    runner's host phases, how many steps replayed a CUDA graph, and a table of the top ops."""
    from torch.profiler import ProfilerActivity, profile

    from pagoda import SamplingParams
    from pagoda.engine.engine_request import EngineRequest

    engine, core = llm.engine, llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=warmup_steps + 2 * steps + 8, ignore_eos=True)
    prompts = make_workload(batch_size, prompt_len, prompt_len, vocab_size, seed + 2)[0]
    ids = [f"profile-{batch_size}-{i}" for i in range(batch_size)]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(EngineRequest(request_id, prompt, params))
    emitted: dict[str, int] = dict.fromkeys(ids, 0)
    finished: set[str] = set()

    def step() -> None:
        for delta in engine.step().deltas:
            if delta.request_id in emitted:
                emitted[delta.request_id] += sum(len(sample.token_ids) for sample in delta.outputs)
                if delta.finished:
                    finished.add(delta.request_id)

    while min(emitted.values()) == 0:  # every prompt prefilled: from here on steps are decode-only
        step()
    for _ in range(warmup_steps):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):  # the same steps without the profiler's own cost
        step()
    synchronize(device)
    plain_wall = (time.perf_counter() - start) / steps
    graphs = core.runner.decode_graphs
    replays = [0]
    if graphs is not None:
        replay = graphs.run

        def counting_run(*args: Any, **kwargs: Any) -> Any:
            replays[0] += 1
            return replay(*args, **kwargs)

        graphs.run = counting_run
    phases = {name: 0.0 for name in ("schedule", "prepare", "forward", "logits", "sample", "update")}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
            for name in phases:
                phases[name] += getattr(core.last_step_timings, name)
        synchronize(device)
        wall = (time.perf_counter() - start) / steps
    if graphs is not None:
        del graphs.run  # the instance attribute goes: the class's method again
    while len(finished) < batch_size:
        step()

    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_s = sum(e.self_device_time_total for e in kernels) / 1e6 / steps
    summary = {
        "batch_size": batch_size,
        "context": prompt_len + warmup_steps + steps,
        "steps": steps,
        "step_wall_ms": 1e3 * plain_wall,
        "step_wall_ms_profiled": 1e3 * wall,
        "kernel_ms": 1e3 * kernel_s,
        "gpu_idle_ms": 1e3 * max(plain_wall - kernel_s, 0.0) if device.type == "cuda" else None,
        "kernels_per_step": sum(e.count for e in kernels) / steps,
        "host_phases_ms": {name: 1e3 * seconds / steps for name, seconds in phases.items()},
        "graph_replays": replays[0] if graphs is not None else None,
        "graph_coverage": replays[0] / steps if graphs is not None else 0.0,
    }
    sort_by = "self_device_time_total" if kernels else "self_cpu_time_total"
    return summary, averages.table(sort_by=sort_by, row_limit=20)


def hf_generate(model: Any, batch: list[list[int]], new_tokens: int, device: torch.device) -> None:
    width = max(len(p) for p in batch)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    synchronize(device)


def hf_single_stream(model: Any, prompt: list[int], output_len: int, device: torch.device) -> dict[str, float]:
    """Decode rate from the difference of a 1-token and an output_len-token generate."""
    start = time.perf_counter()
    hf_generate(model, [prompt], 1, device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    hf_generate(model, [prompt], output_len, device)
    full = time.perf_counter() - start
    return {
        "time_to_first_token_s": prefill,
        "decode_tokens": output_len - 1,
        "decode_tok_per_s": (output_len - 1) / (full - prefill),
    }


def hf_offline(
    model: Any, prompts: list[list[int]], output_lens: list[int], batch_size: int, device: torch.device
) -> dict[str, float]:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        hf_generate(model, prompts[i : i + batch_size], max(output_lens[i : i + batch_size]), device)
    elapsed = time.perf_counter() - start
    useful = sum(output_lens)
    total = useful + sum(len(p) for p in prompts)
    return {
        "seconds": elapsed,
        "output_tokens": useful,
        "output_tok_per_s": useful / elapsed,
        "total_tok_per_s": total / elapsed,
        "batch_size": batch_size,
    }


# ---- driver -----------------------------------------------------------------------------------


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def kv_cache_memory(args: argparse.Namespace, device: torch.device, weight_bytes: int) -> str:
    if args.kv_cache_memory != "auto":
        return args.kv_cache_memory
    if device.type != "cuda":
        return "1GiB"
    free, _ = torch.cuda.mem_get_info(device)
    # Leave room for activations of a max_num_batched_tokens step, the logits and CUDA graphs.
    return str(max(int(0.85 * (free - weight_bytes) - 4 * GiB), GiB))


def bench_pagoda(
    args: argparse.Namespace,
    model_dir: Path,
    config: dict[str, Any],
    device: torch.device,
    workload: tuple[list[list[int]], list[int]],
    single_prompt: list[int],
    result: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Fills `result`, calling `save` after each measurement (a run cut off keeps what it did)."""
    from pagoda import LLM

    weight_bytes = 2 * sum(math.prod(s) for s in checkpoint_shapes(config).values())
    max_model_len = max(args.max_len * 2, args.single_prompt_len + args.single_output_len)
    llm = LLM(
        model=str(model_dir),
        dtype=args.dtype,
        device=str(device),
        max_model_len=max_model_len,
        kv_cache_memory=kv_cache_memory(args, device, weight_bytes),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=False,
    )
    core = llm.engine.core
    result.update(
        {
            "attention_backend": core.runner.backend.name,
            "kv_blocks": core.num_blocks,
            "enforce_eager": args.enforce_eager,
            "cuda_graphs": core.runner.decode_graphs is not None,
        }
    )
    print(
        f"  pagoda: {result['attention_backend']} attention, {core.num_blocks} KV blocks, "
        f"CUDA graphs {'on' if result['cuda_graphs'] else 'off'}",
        flush=True,
    )
    pagoda_single_stream(llm, single_prompt[:64], 16)  # warm-up: kernels compiled, allocator settled
    result["single_stream"] = pagoda_single_stream(llm, single_prompt, args.single_output_len)
    print(f"  pagoda single stream: {result['single_stream']['decode_tok_per_s']:.1f} tok/s", flush=True)
    save()
    if not args.skip_offline:
        result["offline"] = pagoda_offline(llm, *workload)
        print(f"  pagoda offline: {result['offline']['output_tok_per_s']:.0f} output tok/s", flush=True)
        save()
    if args.profile_batches:
        result["decode_profile"] = {}
        for batch_size in args.profile_batches:
            summary, table = profile_decode(
                llm,
                batch_size,
                config["vocab_size"],
                device,
                args.seed,
                prompt_len=min(args.profile_prompt_len, max_model_len // 2),
            )
            result["decode_profile"][str(batch_size)] = summary
            save()
            print(f"  decode step at batch {batch_size}: {json.dumps(summary)}", flush=True)
            if args.profile_out is not None:
                with args.profile_out.open("a") as log:
                    log.write(
                        f"== {model_dir.name}, one decode step at batch {batch_size} "
                        f"({device_name(device)})\n{json.dumps(summary, indent=2)}\n{table}\n\n"
                    )
    del llm, core
    free_memory(device)


def bench_transformers(
    args: argparse.Namespace,
    model_dir: Path,
    device: torch.device,
    workload: tuple[list[list[int]], list[int]],
    single_prompt: list[int],
    result: dict[str, Any],
    save: Callable[[], None],
) -> None:
    import transformers

    placement = {"device_map": str(device)} if args.hf_device_map else {}
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa", **placement
        )
        .to(device)
        .eval()
    )
    result["version"] = transformers.__version__
    with torch.inference_mode():
        hf_generate(model, [single_prompt[:64]], 8, device)  # warm-up
        result["single_stream"] = hf_single_stream(
            model, single_prompt, args.hf_single_output_len or args.single_output_len, device
        )
        print(f"  transformers single stream: {result['single_stream']['decode_tok_per_s']:.1f} tok/s", flush=True)
        save()
        if not args.skip_hf_offline and not args.skip_offline:
            prompts, output_lens = workload
            subset = args.hf_num_seqs or len(prompts)
            result["offline"] = hf_offline(model, prompts[:subset], output_lens[:subset], args.hf_batch_size, device)
            result["offline"]["num_seqs"] = subset
            print(
                f"  transformers offline ({subset} of {len(prompts)} requests): "
                f"{result['offline']['output_tok_per_s']:.0f} output tok/s",
                flush=True,
            )
            save()
    del model
    free_memory(device)


def summarize(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """The headline ratios from whatever `result` holds so far."""
    summary: dict[str, Any] = {}
    pagoda, hf = result.get("pagoda", {}), result.get("transformers", {})
    if "single_stream" not in pagoda:
        return summary
    pagoda_single = pagoda["single_stream"]["decode_tok_per_s"]
    summary["pagoda_single_stream_fraction_of_roofline"] = pagoda_single / result["single_stream_roofline"]["tok_per_s"]
    if "single_stream" in hf:
        summary["single_stream_vs_transformers"] = pagoda_single / hf["single_stream"]["decode_tok_per_s"]
    if "offline" in hf and "offline" in pagoda:
        summary["offline_vs_transformers"] = pagoda["offline"]["output_tok_per_s"] / hf["offline"]["output_tok_per_s"]
        if hf["offline"]["num_seqs"] < args.num_seqs:
            summary["offline_vs_transformers_note"] = (
                f"output tok/s of pagoda on {args.num_seqs} requests over transformers on the first "
                f"{hf['offline']['num_seqs']}"
            )
    return summary


def run_model(
    args: argparse.Namespace,
    name: str,
    device: torch.device,
    bandwidth: float,
    workdir: Path,
    result: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Fills `result` for model `name`; `save` writes everything measured so far."""
    config = MODELS[name]
    print(f"{name}: writing random weights", flush=True)
    model_dir = workdir / name
    num_params = write_random_model(model_dir, config, device, seed=args.seed)
    free_memory(device)
    workload = make_workload(args.num_seqs, args.min_len, args.max_len, config["vocab_size"], args.seed)
    single_prompt = make_workload(
        1, args.single_prompt_len, args.single_prompt_len, config["vocab_size"], args.seed + 1
    )[0][0]

    mean_context = args.single_prompt_len + args.single_output_len / 2
    weight_bytes, kv_bytes = decode_bytes_per_token(config, mean_context)
    roofline = bandwidth / (weight_bytes + kv_bytes)
    result.update(
        {
            "config": {
                k: config[k]
                for k in (
                    "architectures",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "vocab_size",
                    "tie_word_embeddings",
                )
            },
            "params": num_params,
            "single_stream_roofline": {
                "weight_bytes_per_token": weight_bytes,
                "kv_bytes_per_token": kv_bytes,
                "mean_context": mean_context,
                "tok_per_s": roofline,
            },
        }
    )
    print(f"{name}: {num_params / 1e6:.0f}M params; roofline {roofline:.0f} tok/s", flush=True)
    save()
    bench_pagoda(args, model_dir, config, device, workload, single_prompt, result.setdefault("pagoda", {}), save)
    if not args.skip_hf:
        bench_transformers(
            args, model_dir, device, workload, single_prompt, result.setdefault("transformers", {}), save
        )
    save()
    print(f"{name}: {json.dumps(result['summary'])}", flush=True)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def driver_version(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models",
        default="qwen3-0.6b,llama3-8b",
        help=f"comma-separated, from {', '.join(MODELS)} (default: %(default)s)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--single-prompt-len", type=int, default=512)
    parser.add_argument("--single-output-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--kv-cache-memory", default="auto", help="pagoda's KV pool, e.g. 40GiB (default: most of the free GPU memory)"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="run pagoda without CUDA graphs")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    parser.add_argument("--skip-hf-offline", action="store_true", help="transformers single stream only")
    parser.add_argument("--skip-offline", action="store_true", help="single stream only (pagoda and transformers)")
    parser.add_argument(
        "--hf-num-seqs", type=int, default=0, help="transformers offline on the first N requests only (default: all)"
    )
    parser.add_argument(
        "--hf-single-output-len",
        type=int,
        default=0,
        help="transformers single-stream output length (default: --single-output-len)",
    )
    parser.add_argument(
        "--profile-batches",
        type=lambda s: [int(b) for b in s.split(",") if b],
        default=[],
        help="profile one pagoda decode step at each of these batch sizes, e.g. 1,64",
    )
    parser.add_argument("--profile-prompt-len", type=int, default=512, help="context of the profiled requests")
    parser.add_argument("--profile-out", type=Path, default=None, help="append the profiles' kernel tables here")
    parser.add_argument("--bandwidth-bytes", type=int, default=4 * GiB, help="size of the copy that measures bandwidth")
    parser.add_argument(
        "--hf-device-map",
        action="store_true",
        help="load transformers' weights straight onto the device (accelerate's device_map)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="where the models go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark is for GPUs (--device cpu with --models tiny for a smoke run)")
    bandwidth = copy_bandwidth(device, args.bandwidth_bytes)
    print(f"{device_name(device)}: device-to-device copy {bandwidth / 1e9:.0f} GB/s", flush=True)
    results: dict[str, Any] = {
        "benchmark": "gpu",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": device_name(device),
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "driver": driver_version(device),
            "pagoda_commit": git_commit(),
        },
        "copy_bandwidth_bytes_per_s": bandwidth,
        "workload": {
            "num_seqs": args.num_seqs,
            "prompt_len": [args.min_len, args.max_len],
            "output_len": [args.min_len, args.max_len],
            "ignore_eos": True,
            "dtype": args.dtype,
            "single_stream": {"prompt_len": args.single_prompt_len, "output_len": args.single_output_len},
        },
        "models": {},
    }
    try:
        import triton

        results["versions"]["triton"] = triton.__version__
    except ImportError:
        pass

    def save() -> None:  # after every measurement: a run cut off keeps what it did
        for model in results["models"].values():
            model["summary"] = summarize(args, model)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for name in args.models.split(","):
            run_model(args, name, device, bandwidth, Path(tmp), results["models"].setdefault(name, {}), save)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
