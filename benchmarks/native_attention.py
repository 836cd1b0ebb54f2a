"""Attention time per decode step: the native paged attention against the torch path (block
gathers, padding, SDPA), side by side.

One decode step of a model's attention is the backend's `prepare` plus one `forward` per layer
(writing the new K/V, then attending), on random caches laid out as the engine lays them out
(block size 16, each request's blocks spread over the pool). For each model shape (the ~10M bench
Llama and the ~100M one; `--kv-cache-dtype` for a quantized cache), concurrency (1, 16) and
context (128, 512, 2048), the two backends alternate within each round; a round's time is the
median of `--steps` steps, the result the median of the rounds. Beside wall time, the process's
CPU time per step (which a shared machine inflates less: time spent waiting for a core is not
counted). The load average at the start and at the end is recorded beside the numbers.

    .venv/bin/python benchmarks/native_attention.py --rounds 5 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODEL_SHAPE, MODEL_SHAPE_100M, RESULTS, git_commit, write_summary  # noqa: E402

NAME = "native_kernels"
MODELS = {"10m": MODEL_SHAPE, "100m": MODEL_SHAPE_100M}
BLOCK_SIZE = 16


def decode_step(shape: dict[str, int], concurrency: int, context: int, kv_cache_dtype: str, seed: int = 0):
    """A decode step's layout, queries, new K/V and per-layer caches for `concurrency` requests
    of `context` tokens each, their blocks shuffled over the pool."""
    import torch

    from pagoda.kernels.attention.backend import AttentionLayerSpec, BatchLayout
    from pagoda.quant.kv_cache_dtype import make_kv_cache_format

    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape["hidden_size"] // heads
    blocks_per_request = -(-(context + 1) // BLOCK_SIZE)
    num_blocks = concurrency * blocks_per_request + 1
    pool = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = [[pool.pop() for _ in range(blocks_per_request)] for _ in range(concurrency)]
    layout = BatchLayout(
        slot_mapping=torch.tensor([t[context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE for t in tables]),
        query_start_loc=torch.arange(concurrency + 1),
        context_lens=torch.full((concurrency,), context),
        seq_lens=torch.full((concurrency,), context + 1),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        block_size=BLOCK_SIZE,
        query_lens_host=[1] * concurrency,
        context_lens_host=[context] * concurrency,
    )
    kv_format = make_kv_cache_format(kv_cache_dtype, torch.float32)
    caches = [
        tuple(
            kv_format.encode(torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=generator))
            for _ in range(2)
        )
        for _ in range(shape["num_hidden_layers"])
    ]
    query = torch.randn(concurrency, heads, head_dim, generator=generator)
    key, value = (torch.randn(concurrency, kv_heads, head_dim, generator=generator) for _ in range(2))
    spec = AttentionLayerSpec(heads, kv_heads, head_dim, head_dim**-0.5, None)
    return layout, query, key, value, caches, spec, kv_format


def time_step(backend: Any, step: tuple, steps: int) -> tuple[float, float]:
    """Median wall and CPU seconds of `steps` decode steps' attention (prepare + every layer's forward)."""
    layout, query, key, value, caches, spec, _ = step
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        metadata = backend.prepare(layout, {None})
        for key_cache, value_cache in caches:
            backend.forward(query, key, value, key_cache, value_cache, metadata, spec)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="decode steps timed per round (their median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS / NAME / "attention_dev.json")
    args = parser.parse_args(argv)

    import torch

    from pagoda import native
    from pagoda.kernels.attention.torch_backend import TorchAttentionBackend

    torch.set_num_threads(args.threads)
    kernels = native.resolve_native_kernels("on", torch.device("cpu"))
    load_at_start = os.getloadavg()
    rows = []
    for model in args.models:
        shape = MODELS[model]
        for concurrency in args.concurrency:
            for context in args.context:
                step = decode_step(shape, concurrency, context, args.kv_cache_dtype)
                kv_format = step[-1]
                backends = {
                    "torch": TorchAttentionBackend(kv_format),
                    "native": TorchAttentionBackend(kv_format, kernels),
                }
                rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in backends}
                for r in range(args.rounds):
                    order = list(backends) if r % 2 == 0 else list(reversed(backends))
                    for name in order:
                        rounds[name].append(time_step(backends[name], step, args.steps))
                wall = {name: statistics.median(w for w, _ in times) * 1e3 for name, times in rounds.items()}
                cpu = {name: statistics.median(c for _, c in times) * 1e3 for name, times in rounds.items()}
                row = {
                    "model": model,
                    "concurrency": concurrency,
                    "context": context,
                    "torch_ms": round(wall["torch"], 3),
                    "native_ms": round(wall["native"], 3),
                    "speedup": round(wall["torch"] / wall["native"], 2),
                    "torch_cpu_ms": round(cpu["torch"], 3),
                    "native_cpu_ms": round(cpu["native"], 3),
                    "cpu_speedup": round(cpu["torch"] / cpu["native"], 2),
                    "rounds_ms": {name: [round(w * 1e3, 3) for w, _ in times] for name, times in rounds.items()},
                }
                rows.append(row)
                print(
                    f"{model:>5} c={concurrency:<3} context={context:<5} wall: torch {wall['torch']:8.3f} ms  "
                    f"native {wall['native']:8.3f} ms  {row['speedup']:.2f}x;  CPU: {row['cpu_speedup']:.2f}x",
                    flush=True,
                )
    payload = {
        "command": " ".join([".venv/bin/python", "benchmarks/native_attention.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "what": "attention time per decode step (prepare + every layer's forward), float32 queries, "
        f"KV cache {args.kv_cache_dtype}, block size {BLOCK_SIZE}, medians of alternating rounds",
        "kernels": kernels.describe(),
        "threads": args.threads,
        "rounds": args.rounds,
        "steps": args.steps,
        "shapes": {model: MODELS[model] for model in args.models},
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "results": rows,
    }
    write_summary(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
