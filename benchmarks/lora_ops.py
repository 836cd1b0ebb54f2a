"""Which CPU formulation of the batched LoRA delta is fastest (pagoda/lora/delta.py).

Times one projection's delta for a step's tokens spread uniformly over 1, 4 or 16 adapters,
ranks 8 and 64, decode-sized (64 tokens) and prefill-sized (512 tokens) batches, on the
bundled model's gate_up projection (256 -> 2 x 704, two fused parts). Formulations:
  segmented  tokens sorted by slot, two GEMMs per adapter (pagoda's choice)
  gathered   per-token A/B gathered, one bmm each side (Punica's BGMV)
  dense      every token times every slot's A, masked to its own slot, then one GEMM over all
             slots' B (no gather; cost grows with slots x rank)
Interleaved rounds, median of each; one torch thread.

    PYTHONPATH=. .venv/bin/python benchmarks/lora_ops.py --rounds 3 --out benchmarks/results/lora
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from pagoda.kernels.lora_delta import gathered_delta, segmented_delta
from pagoda.lora.batch import LoRABatch, build_lora_batch


def dense_delta(
    x_rows: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor, batch: LoRABatch, width: int
) -> torch.Tensor:
    num_slots, full, in_features = lora_a.shape
    shrunk = (x_rows @ lora_a.reshape(num_slots * full, in_features).T).view(-1, num_slots, full)
    mask = torch.nn.functional.one_hot(batch.slots, num_slots).to(x_rows.dtype)
    return (shrunk * mask.unsqueeze(-1)).view(-1, num_slots * full) @ lora_b_t.reshape(num_slots * full, -1)


FORMULATIONS = {"segmented": segmented_delta, "gathered": gathered_delta, "dense": dense_delta}


def case(num_tokens: int, num_adapters: int, rank: int, rounds: int) -> dict:
    in_features, out_features, parts = 256, 2 * 704, 2
    width = rank * parts
    lora_a = torch.randn(num_adapters, width, in_features) * 0.02
    lora_b_t = torch.randn(num_adapters, width, out_features) * 0.02
    x = torch.randn(num_tokens, in_features)
    # Requests of 1 (decode) or 128 (prefill) tokens, adapters assigned round robin.
    per_request = 1 if num_tokens <= 64 else 128
    runs = [(i % num_adapters, per_request) for i in range(num_tokens // per_request)]
    batch = build_lora_batch(runs, {s: rank for s in range(num_adapters)}, torch.device("cpu"))
    x_rows = x.index_select(0, batch.rows)
    reference = gathered_delta(x_rows, lora_a, lora_b_t, batch, width)
    times: dict[str, list[float]] = {name: [] for name in FORMULATIONS}
    for _ in range(rounds):
        for name, fn in FORMULATIONS.items():
            start = time.perf_counter()
            for _ in range(10):
                out = fn(x_rows, lora_a, lora_b_t, batch, width)
            times[name].append((time.perf_counter() - start) / 10)
            torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)
    medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    return {
        "tokens": num_tokens,
        "adapters": num_adapters,
        "rank": rank,
        "median_us": {k: round(v, 1) for k, v in medians.items()},
        "fastest": min(medians, key=medians.get),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [
        case(tokens, adapters, rank, args.rounds) for tokens in (64, 512) for adapters in (1, 4, 16) for rank in (8, 64)
    ]
    for r in results:
        print(
            f"{r['tokens']:4d} tok {r['adapters']:2d} adapters rank {r['rank']:2d}: "
            + "  ".join(f"{k} {v:8.1f} us" for k, v in r["median_us"].items())
            + f"  -> {r['fastest']}"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora_ops.json").write_text(
            json.dumps(
                {
                    "command": "PYTHONPATH=. .venv/bin/python benchmarks/lora_ops.py " + " ".join(sys.argv[1:]),
                    "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread, shared with other jobs",
                    "projection": "gate_up of pagoda-coder: 256 -> 2 x 704, float32",
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
