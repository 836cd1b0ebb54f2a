"""Multi-LoRA serving: throughput and inter-token latency with 1, 4 and 16 adapters mixed in
one batch (ranks 8 and 64), against the base model alone on the same workload, and against the
naive alternative of one batch per adapter (what an engine that cannot mix adapters does,
llama.cpp among them).

Workload: `--num-requests` requests of `--prompt-len` random prompt tokens and `--max-tokens`
greedy output tokens each, all submitted at once, request i using adapter i mod N (uniform).
Adapters are random PEFT adapters (every projection: q/k/v/o/gate/up/down) of the bundled
pagoda-coder model. Modes run interleaved, round by round; the JSON keeps each mode's medians.

    PYTHONPATH=. .venv/bin/python benchmarks/lora.py --out benchmarks/results/lora
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from pagoda.engine.threads import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch loads (the thread policy's one owner)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from pagoda.engine.llm_engine import LLMEngine  # noqa: E402
from pagoda.engine.threads import set_engine_threads  # noqa: E402
from pagoda.lora.adapter import module_shapes  # noqa: E402
from pagoda.lora_request import LoRARequest  # noqa: E402
from pagoda.model.loader import load_model_config  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402

COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/lora.py --out benchmarks/results/lora"


def write_adapter(directory: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (all seven projections) for the bundled model."""
    config = load_model_config(DEFAULT_MODEL_DIR)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (in_features, out_features) in module_shapes(config).items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(module_shapes(config)),
        "bias": "none", "base_model_name_or_path": str(DEFAULT_MODEL_DIR)}))
    return directory


def run_batch(engine: LLMEngine, prompts: list[list[int]], loras: list[LoRARequest | None],
              max_tokens: int) -> tuple[float, int, list[float]]:
    """All requests at once until done: (seconds, output tokens, inter-token gaps in seconds)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(request_id, prompt, params, lora_request=lora)
    last_token_at: dict[str, float] = {}
    gaps: list[float] = []
    num_tokens = 0
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            emitted = sum(len(sample.token_ids) for sample in delta.outputs)
            if not emitted:
                continue
            num_tokens += emitted
            if delta.request_id in last_token_at:
                gaps.append(now - last_token_at[delta.request_id])
            last_token_at[delta.request_id] = now
    return time.perf_counter() - start, num_tokens, gaps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pagoda-lora-bench-"))
    adapters = {rank: [write_adapter(root / f"r{rank}-{i}", rank, seed=rank * 100 + i) for i in range(16)]
                for rank in (8, 64)}
    common = dict(num_threads=args.threads, max_num_seqs=args.num_requests, num_kv_blocks=1024,
                  enable_prefix_caching=False)
    base_config = EngineConfig(**common)
    set_engine_threads(base_config, serving=False)
    base = LLMEngine(base_config)
    lora = LLMEngine(EngineConfig(**common, enable_lora=True, max_loras=16, max_lora_rank=64))
    for rank, paths in adapters.items():
        for i, path in enumerate(paths):
            lora.add_lora(LoRARequest(f"r{rank}-{i}", 0, str(path)))
    generator = torch.Generator().manual_seed(0)
    vocab = base.core.model_config.vocab_size
    prompts = [torch.randint(5, vocab, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.num_requests)]

    def adapters_for(num: int, rank: int) -> list[LoRARequest | None]:
        return [LoRARequest(f"r{rank}-{i % num}") for i in range(args.num_requests)]

    # mode name -> list of (engine, request indices, adapters) batches run one after another
    modes: dict[str, list[tuple[LLMEngine, list[int], list[LoRARequest | None]]]] = {
        "base": [(base, list(range(args.num_requests)), [None] * args.num_requests)],
        "base, LoRA engine": [(lora, list(range(args.num_requests)), [None] * args.num_requests)],
    }
    for rank in (8, 64):
        for num in (1, 4, 16):
            modes[f"{num} adapters, rank {rank}, mixed"] = [(lora, list(range(args.num_requests)),
                                                             adapters_for(num, rank))]
        for num in (4, 16):
            loras = adapters_for(num, rank)
            modes[f"{num} adapters, rank {rank}, one batch per adapter"] = [
                (lora, [i for i in range(args.num_requests) if i % num == a],
                 [loras[i] for i in range(args.num_requests) if i % num == a]) for a in range(num)]

    for engine in (base, lora):  # warm up
        run_batch(engine, prompts[:4], [None] * 4, 4)
    samples: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_index in range(args.rounds):
        for mode, batches in modes.items():
            seconds, tokens, gaps = 0.0, 0, []
            for engine, indices, loras in batches:
                s, t, g = run_batch(engine, [prompts[i] for i in indices], loras, args.max_tokens)
                seconds, tokens, gaps = seconds + s, tokens + t, gaps + g
            samples[mode].append({"tok_per_s": tokens / seconds, "itl_p50_ms": percentile(gaps, 0.5) * 1e3,
                                  "itl_p99_ms": percentile(gaps, 0.99) * 1e3})
            print(f"round {round_index} {mode:45s} {tokens / seconds:8.1f} tok/s  "
                  f"p99 ITL {samples[mode][-1]['itl_p99_ms']:6.1f} ms", flush=True)

    base_tps = statistics.median(s["tok_per_s"] for s in samples["base"])
    results = {}
    for mode, runs in samples.items():
        tps = statistics.median(r["tok_per_s"] for r in runs)
        results[mode] = {"output_tok_per_s": round(tps, 1), "vs_base": round(tps / base_tps, 3),
                         "itl_p50_ms": round(statistics.median(r["itl_p50_ms"] for r in runs), 2),
                         "itl_p99_ms": round(statistics.median(r["itl_p99_ms"] for r in runs), 2),
                         "rounds": [{k: round(v, 2) for k, v in r.items()} for r in runs]}
    print(json.dumps({m: {k: v for k, v in r.items() if k != "rounds"} for m, r in results.items()}, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({
            "command": COMMAND,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, "
                       f"{args.threads} torch thread(s); modes interleaved per round, medians",
            "model": "pagoda-coder (bundled, 6 layers, hidden 256), float32, CPU",
            "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                         "max_tokens": args.max_tokens, "rounds": args.rounds,
                         "adapters": "random PEFT LoRA on q/k/v/o/gate/up/down, request i -> adapter i mod N"},
            "delta_formulation": "segmented (benchmarks/lora_ops.py)",
            "target": "4 adapters mixed >= 0.75x base throughput",
            "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
