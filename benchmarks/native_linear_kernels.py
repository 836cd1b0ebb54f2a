"""Per-kernel time of the native small-M products against the torch path each weight format takes
without them, on the ~100M model's projection shapes (hidden 768, intermediate 2048, GQA 12/4).

Pairs (native / torch, the same weights, torch as each format runs without the native kernels):
bf16 (linear_bf16 / oneDNN's pre-packed bfloat16 product, FullWeight's), int4 group 32 (linear_int4 /
aten._weight_int4pack_mm_for_cpu in bfloat16), GGUF Q8_0 (linear_q8_0 on the blocks / oneDNN's
pre-packed product of the dequantized float32 copy served today), GGUF Q4_0 (linear_q4_0 / the
int4pack kernel Q4_0 is served by today). Float32 x. Rounds alternate native and torch; medians of rounds, each
round the mean of `--calls` calls; the load average is recorded beside them.

    .venv/bin/python benchmarks/native_linear_kernels.py --threads 1 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagoda import native
from pagoda.quant.weight_formats import PACK_ROWS_HINT, pack_int4_nibbles, quantize_int4_grouped

RESULT = Path(__file__).resolve().parent / "results" / "native_kernels" / "linear_dev.json"
SHAPES = {"qkv": (768, 1280), "o": (768, 768), "gate_up": (768, 4096), "down": (2048, 768)}  # (K, N)


def per_call(fn: Callable[[], torch.Tensor], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def pairs(kernels: native.NativeKernels, k: int, n: int, m: int) -> dict[str, tuple[Callable, Callable]]:
    generator = torch.Generator().manual_seed(k + n)
    x = torch.randn(m, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) * 0.05
    bf16 = weight.bfloat16()
    codes, scales, zeros = quantize_int4_grouped(weight, 32, True)
    nibbles = pack_int4_nibbles(codes)
    tinygemm = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).bfloat16().contiguous()
    q8 = torch.round(weight / 0.004).clamp(-127, 127).to(torch.int8)
    d = torch.full((n, k // 32), 0.004).half()
    q8_blocks = (
        torch.cat([d.view(torch.uint8).reshape(n, -1, 2), q8.view(torch.uint8).reshape(n, -1, 32)], -1)
        .reshape(n, -1)
        .contiguous()
    )
    q8_dense = q8.float() * 0.004
    q4_blocks = torch.cat([d.view(torch.uint8).reshape(n, -1, 2), nibbles.reshape(n, -1, 16)], -1).reshape(n, -1)
    q4_blocks = q4_blocks.contiguous()
    xb = x.bfloat16()
    bf16_packed = torch.ops.mkldnn._reorder_linear_weight(bf16, PACK_ROWS_HINT)
    q8_packed = torch.ops.mkldnn._reorder_linear_weight(q8_dense, PACK_ROWS_HINT)
    return {
        "bf16": (
            lambda: kernels.linear_bf16(x, bf16, None),
            lambda: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), bf16_packed, None, "none", [], "").float(),
        ),
        "int4_g32": (
            lambda: kernels.linear_int4(x, nibbles, scales, zeros, None),
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, tinygemm, 32, scales_and_zeros).float(),
        ),
        "q8_0": (
            lambda: kernels.linear_q8_0(x, q8_blocks, None),
            lambda: torch.ops.mkldnn._linear_pointwise(x, q8_packed, None, "none", [], ""),
        ),
        "q4_0": (
            lambda: kernels.linear_q4_0(x, q4_blocks, None),
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, tinygemm, 32, scales_and_zeros).float(),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native.resolve_native_kernels("on", torch.device("cpu"))
    results = []
    load_before = os.getloadavg()
    for m in args.rows:
        for shape_name, (k, n) in SHAPES.items():
            for kernel, (native_fn, torch_fn) in pairs(kernels, k, n, m).items():
                native_fn(), torch_fn()
                times: dict[str, list[float]] = {"native": [], "torch": []}
                for _ in range(args.rounds):
                    times["native"].append(per_call(native_fn, args.calls))
                    times["torch"].append(per_call(torch_fn, args.calls))
                native_us = statistics.median(times["native"]) * 1e6
                torch_us = statistics.median(times["torch"]) * 1e6
                results.append(
                    {
                        "kernel": kernel,
                        "projection": shape_name,
                        "m": m,
                        "k": k,
                        "n": n,
                        "native_us": round(native_us, 1),
                        "torch_us": round(torch_us, 1),
                        "speedup": round(torch_us / native_us, 2),
                    }
                )
                print(
                    f"m={m:2d} {shape_name:8s} {kernel:9s} native {native_us:8.1f} us  torch {torch_us:8.1f} us  "
                    f"x{torch_us / native_us:.2f}",
                    flush=True,
                )
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(
        json.dumps(
            {
                "command": f".venv/bin/python benchmarks/native_linear_kernels.py --threads {args.threads} "
                f"--rounds {args.rounds} --calls {args.calls} --rows {' '.join(map(str, args.rows))}",
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "isa": kernels.isa,
                "threads": args.threads,
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
                "note": "other agents shared the 2 cores while this ran: compare native and torch within a row only",
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
