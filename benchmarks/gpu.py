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
      --hf-batch-size with left padding, counting only the tokens each request asked for)

    python benchmarks/gpu.py                                   # everything, ~15-30 min on one H100
    python benchmarks/gpu.py --models qwen3-0.6b --num-seqs 64
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
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu.json"
GiB = 2 ** 30

MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
    },
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu",
    },
    "tiny": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
        "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
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
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>").save_pretrained(
        directory)


def write_random_model(directory: Path, config: dict[str, Any], device: torch.device, seed: int = 0,
                       shard_bytes: int = 4 * GiB) -> int:
    """config.json, tokenizer and bf16 safetensors shards of N(0, 0.02) weights (norms = 1),
    drawn on `device`. Returns the number of parameters."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(
        {**config, "torch_dtype": "bfloat16", "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0},
        indent=2))
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
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 2 * num_params}, "weight_map": weight_map}, indent=2))
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

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("single-stream", prompt, params)
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
    return {"time_to_first_token_s": first_time - start, "decode_tokens": decode_tokens,
            "decode_tok_per_s": decode_tokens / (now - first_time)}


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
    return {"seconds": elapsed, "output_tokens": generated, "output_tok_per_s": generated / elapsed,
            "total_tok_per_s": total / elapsed}


def hf_generate(model: Any, batch: list[list[int]], new_tokens: int, device: torch.device) -> None:
    width = max(len(p) for p in batch)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    synchronize(device)


def hf_single_stream(model: Any, prompt: list[int], output_len: int, device: torch.device) -> dict[str, float]:
    """Decode rate from the difference of a 1-token and an output_len-token generate."""
    start = time.perf_counter()
    hf_generate(model, [prompt], 1, device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    hf_generate(model, [prompt], output_len, device)
    full = time.perf_counter() - start
    return {"time_to_first_token_s": prefill, "decode_tokens": output_len - 1,
            "decode_tok_per_s": (output_len - 1) / (full - prefill)}


def hf_offline(model: Any, prompts: list[list[int]], output_lens: list[int], batch_size: int,
               device: torch.device) -> dict[str, float]:
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        hf_generate(model, prompts[i:i + batch_size], max(output_lens[i:i + batch_size]), device)
    elapsed = time.perf_counter() - start
    useful = sum(output_lens)
    total = useful + sum(len(p) for p in prompts)
    return {"seconds": elapsed, "output_tokens": useful, "output_tok_per_s": useful / elapsed,
            "total_tok_per_s": total / elapsed, "batch_size": batch_size}


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


def bench_pagoda(args: argparse.Namespace, model_dir: Path, config: dict[str, Any], device: torch.device,
                 workload: tuple[list[list[int]], list[int]], single_prompt: list[int]) -> dict[str, Any]:
    from pagoda import LLM

    weight_bytes = 2 * sum(math.prod(s) for s in checkpoint_shapes(config).values())
    max_model_len = max(args.max_len * 2, args.single_prompt_len + args.single_output_len)
    llm = LLM(model=str(model_dir), dtype=args.dtype, device=str(device), max_model_len=max_model_len,
              kv_cache_memory=kv_cache_memory(args, device, weight_bytes), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False)
    core = llm.engine.core
    result: dict[str, Any] = {"attention_backend": core.runner.backend.name, "kv_blocks": core.num_blocks,
                              "enforce_eager": args.enforce_eager}
    pagoda_single_stream(llm, single_prompt[:64], 16)  # warm-up: kernels compiled, allocator settled
    result["single_stream"] = pagoda_single_stream(llm, single_prompt, args.single_output_len)
    print(f"  pagoda single stream: {result['single_stream']['decode_tok_per_s']:.1f} tok/s", flush=True)
    result["offline"] = pagoda_offline(llm, *workload)
    print(f"  pagoda offline: {result['offline']['output_tok_per_s']:.0f} output tok/s", flush=True)
    del llm, core
    free_memory(device)
    return result


def bench_transformers(args: argparse.Namespace, model_dir: Path, device: torch.device,
                       workload: tuple[list[list[int]], list[int]], single_prompt: list[int]) -> dict[str, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa").to(device).eval()
    result: dict[str, Any] = {"version": transformers.__version__}
    with torch.inference_mode():
        hf_generate(model, [single_prompt[:64]], 8, device)  # warm-up
        result["single_stream"] = hf_single_stream(model, single_prompt, args.single_output_len, device)
        print(f"  transformers single stream: {result['single_stream']['decode_tok_per_s']:.1f} tok/s", flush=True)
        if not args.skip_hf_offline:
            result["offline"] = hf_offline(model, *workload, args.hf_batch_size, device)
            print(f"  transformers offline: {result['offline']['output_tok_per_s']:.0f} output tok/s", flush=True)
    del model
    free_memory(device)
    return result


def run_model(args: argparse.Namespace, name: str, device: torch.device, bandwidth: float,
              workdir: Path) -> dict[str, Any]:
    config = MODELS[name]
    print(f"{name}: writing random weights", flush=True)
    model_dir = workdir / name
    num_params = write_random_model(model_dir, config, device, seed=args.seed)
    free_memory(device)
    workload = make_workload(args.num_seqs, args.min_len, args.max_len, config["vocab_size"], args.seed)
    single_prompt = make_workload(1, args.single_prompt_len, args.single_prompt_len, config["vocab_size"],
                                  args.seed + 1)[0][0]

    mean_context = args.single_prompt_len + args.single_output_len / 2
    weight_bytes, kv_bytes = decode_bytes_per_token(config, mean_context)
    roofline = bandwidth / (weight_bytes + kv_bytes)
    result: dict[str, Any] = {
        "config": {k: config[k] for k in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                          "tie_word_embeddings")},
        "params": num_params,
        "single_stream_roofline": {"weight_bytes_per_token": weight_bytes, "kv_bytes_per_token": kv_bytes,
                                   "mean_context": mean_context, "tok_per_s": roofline},
    }
    print(f"{name}: {num_params / 1e6:.0f}M params; roofline {roofline:.0f} tok/s", flush=True)
    result["pagoda"] = bench_pagoda(args, model_dir, config, device, workload, single_prompt)
    if not args.skip_hf:
        result["transformers"] = bench_transformers(args, model_dir, device, workload, single_prompt)

    pagoda_single = result["pagoda"]["single_stream"]["decode_tok_per_s"]
    summary = {"pagoda_single_stream_fraction_of_roofline": pagoda_single / roofline}
    hf = result.get("transformers", {})
    if "single_stream" in hf:
        summary["single_stream_vs_transformers"] = pagoda_single / hf["single_stream"]["decode_tok_per_s"]
    if "offline" in hf:
        summary["offline_vs_transformers"] = (result["pagoda"]["offline"]["output_tok_per_s"]
                                              / hf["offline"]["output_tok_per_s"])
    result["summary"] = summary
    print(f"{name}: {json.dumps(summary)}", flush=True)
    return result


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-0.6b,llama3-8b",
                        help=f"comma-separated, from {', '.join(MODELS)} (default: %(default)s)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--single-prompt-len", type=int, default=512)
    parser.add_argument("--single-output-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory", default="auto",
                        help="pagoda's KV pool, e.g. 40GiB (default: most of the free GPU memory)")
    parser.add_argument("--enforce-eager", action="store_true", help="run pagoda without CUDA graphs")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    parser.add_argument("--skip-hf-offline", action="store_true", help="transformers single stream only")
    parser.add_argument("--bandwidth-bytes", type=int, default=4 * GiB, help="size of the copy that measures bandwidth")
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
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "pagoda_commit": git_commit()},
        "copy_bandwidth_bytes_per_s": bandwidth,
        "workload": {"num_seqs": args.num_seqs, "prompt_len": [args.min_len, args.max_len],
                     "output_len": [args.min_len, args.max_len], "ignore_eos": True, "dtype": args.dtype,
                     "single_stream": {"prompt_len": args.single_prompt_len, "output_len": args.single_output_len}},
        "models": {},
    }
    try:
        import triton
        results["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for name in args.models.split(","):
            results["models"][name] = run_model(args, name, device, bandwidth, Path(tmp))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")  # after each model: partial results survive
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
