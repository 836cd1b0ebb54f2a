"""Single-stream decode with pagoda's native CPU kernels on and off, beside the memory floor.

For each model (the ~10M bench Llama, MODEL_SHAPE, and the ~100M one, MODEL_SHAPE_100M) two
offline engines are loaded side by side, `--native-kernels off` and `on`, and rounds alternate
between them. A round times one request of a 128-token prompt twice: with 1 new token (prefill)
and with 1 + N new tokens; its inter-token latency is the difference over N. Medians over rounds.

The floor is the bytes of weights one token reads (every decoder projection and the LM head, in
float32) over the read bandwidth measured in the same run with the same thread count (torch
`sum` over 256 MB, medians of rounds): no engine that reads the weights once per token beats it.

    .venv/bin/python benchmarks/native_kernels.py --rounds 7 --threads 1
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

from common import MODEL_SHAPE, MODEL_SHAPE_100M, RESULTS, VOCAB_SIZE, build_bench_model, metadata, write_summary  # noqa: E402

NAME = "native_kernels"
MODELS = {"10m": MODEL_SHAPE, "100m": MODEL_SHAPE_100M}
PROMPT_TOKENS = 128


def weight_bytes_per_token(shape: dict[str, int], vocab: int) -> int:
    """float32 bytes of every weight product of one decode token: q/k/v, o, gate/up, down per
    layer and the (untied) LM head."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    qkv = hidden * (hidden + 2 * shape["num_key_value_heads"] * head_dim)
    per_layer = qkv + hidden * hidden + 3 * hidden * inter
    return 4 * (per_layer * shape["num_hidden_layers"] + vocab * hidden)


def read_bandwidth(rounds: int) -> float:
    """Bytes per second torch's `sum` reads from a 256 MB float32 tensor (median of rounds)."""
    import torch

    data = torch.ones(64 * 1024 * 1024)
    data.sum()
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(seconds)


def time_request(llm: Any, prompt: list[int], max_tokens: int) -> float:
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params)
    return time.perf_counter() - start


def run_model(name: str, shape: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    from pagoda import LLM, SamplingParams

    model_dir = build_bench_model(Path(args.model_root) / name, shape=shape)
    engines = {
        mode: LLM(
            model=str(model_dir),
            native_kernels=mode,
            num_threads=args.threads,
            enable_prefix_caching=False,
            kv_cache_memory="256MiB",
        )
        for mode in ("off", "on")
    }
    prompt = [5 + i % 200 for i in range(PROMPT_TOKENS)]
    outputs = {}
    for mode, llm in engines.items():  # warm-up, and the greedy outputs of both for the record
        result = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        outputs[mode] = result[0].outputs[0].token_ids
    itl: dict[str, list[float]] = {"off": [], "on": []}
    order = ["off", "on"]
    for round_index in range(args.rounds):
        for mode in order if round_index % 2 == 0 else order[::-1]:
            prefill = time_request(engines[mode], prompt, 1)
            whole = time_request(engines[mode], prompt, 1 + args.new_tokens)
            itl[mode].append((whole - prefill) / args.new_tokens * 1e3)
        print(f"{name} round {round_index}: off {itl['off'][-1]:.2f} ms, on {itl['on'][-1]:.2f} ms", flush=True)
    floor_bytes = weight_bytes_per_token(shape, VOCAB_SIZE)
    return {
        "model": metadata(f"{NAME}.py", [], model_dir, shape)["model"],
        "itl_ms": {
            mode: {"median": statistics.median(v), "rounds": [round(x, 3) for x in v]} for mode, v in itl.items()
        },
        "speedup_median": statistics.median(itl["off"]) / statistics.median(itl["on"]),
        "weight_bytes_per_token": floor_bytes,
        "greedy_ids_equal_first_32": outputs["off"] == outputs["on"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of both engines")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--model-root", default="/tmp/pagoda-bench-models")
    parser.add_argument("--out", type=Path, default=RESULTS / NAME / "results.json")
    args = parser.parse_args(argv)

    import torch

    from pagoda import native

    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()
    bandwidth = read_bandwidth(args.rounds * 3)
    models = {name: run_model(name, MODELS[name], args) for name in args.models}
    for result in models.values():
        floor_ms = result["weight_bytes_per_token"] / bandwidth * 1e3
        result["floor_ms"] = floor_ms
        result["fraction_of_floor"] = {mode: floor_ms / result["itl_ms"][mode]["median"] for mode in ("off", "on")}
    first = build_bench_model(Path(args.model_root) / args.models[0], shape=MODELS[args.models[0]])
    meta = metadata(f"{NAME}.py", sys.argv[1:] if argv is None else argv, first)
    meta.pop("model")
    meta["load_average_at_start"] = load_at_start
    payload = {
        **meta,
        "threads": args.threads,
        "native_kernels": native.version_line(),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "load_average_at_end": os.getloadavg(),
        "models": models,
    }
    write_summary(args.out, payload)
    for name, result in models.items():
        print(
            f"{name}: ITL off {result['itl_ms']['off']['median']:.2f} ms, on {result['itl_ms']['on']['median']:.2f} ms "
            f"(x{result['speedup_median']:.2f}); floor {result['floor_ms']:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
