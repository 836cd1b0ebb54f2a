"""The matmul floor of one decode token on this CPU: how long torch's fp32 kernels take for
just the weight products of one token of the llama.cpp comparison's model (every projection
and the LM head, one input row, one thread), next to llama-server's whole inter-token latency
on the same weights (from the committed vs_llamacpp result).

If torch's products alone take about as long as llama-server's whole token, no engine-side
work (scheduling, batching, IPC) can bring pagoda's c=1 ITL under llama-server's; only a faster
single-row product (or fewer bytes per weight) can. Variants, in interleaved rounds (medians):
- dense: F.linear on the [out, in] weight (MKL sgemv),
- packed: oneDNN's pre-packed blocked weight (what pagoda uses for batches),
- pagoda: what pagoda runs for one row today (FullWeight: dense for small weights, else packed),
- transposed: x @ W^T with W^T stored contiguous [in, out].

    .venv/bin/python benchmarks/gemv_floor.py --rounds 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODEL_SHAPE, REPO, RESULTS, VOCAB_SIZE, write_summary  # noqa: E402

NAME = "gemv_floor"


def projection_shapes(shape: dict[str, int], vocab: int) -> list[tuple[int, int]]:
    """(out, in) of every weight product of one decode token: fused qkv, o, fused gate/up, down
    per layer, and the LM head."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    qkv = hidden + 2 * shape["num_key_value_heads"] * head_dim
    layer = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return layer * shape["num_hidden_layers"] + [(vocab, hidden)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=40, help="tokens timed per variant per round")
    parser.add_argument("--out", default=str(RESULTS / f"{NAME}.json"))
    args = parser.parse_args(argv)

    import os

    import torch
    import torch.nn.functional as F

    from pagoda.quant.weight_formats import PACK_ROWS_HINT, SINGLE_ROW_DENSE_MAX_ELEMENTS

    torch.set_num_threads(1)
    shapes = projection_shapes(MODEL_SHAPE, VOCAB_SIZE)
    weights = [torch.randn(o, i) for o, i in shapes]
    transposed = [w.t().contiguous() for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in weights]
    inputs = {i: torch.randn(1, i) for _, i in shapes}
    linear = torch.ops.mkldnn._linear_pointwise

    def pagoda_row(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if w.numel() <= SINGLE_ROW_DENSE_MAX_ELEMENTS:
            return F.linear(inputs[w.shape[1]], w)
        return linear(inputs[w.shape[1]], p, None, "none", [], "")

    variants = {
        "dense": lambda: [F.linear(inputs[w.shape[1]], w) for w in weights],
        "packed": lambda: [linear(inputs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed)],
        "pagoda": lambda: [pagoda_row(w, p) for w, p in zip(weights, packed)],
        "transposed": lambda: [inputs[t.shape[0]] @ t for t in transposed],
    }
    per_round: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
        for name in order:
            run = variants[name]
            for _ in range(3):
                run()
            started = time.perf_counter()
            for _ in range(args.tokens):
                run()
            per_round[name].append((time.perf_counter() - started) / args.tokens * 1e3)
    reference = RESULTS / "vs_llamacpp_t1_pass2" / "summary.json"
    llama_itl = None
    if reference.exists():
        medians = json.loads(reference.read_text())["median_over_rounds"]
        llama_itl = medians.get("llama-server", {}).get("1", {}).get("itl_p50_ms", {}).get("median")
    weight_mib = sum(o * i for o, i in shapes) * 4 / 2**20
    summary = {
        "command": " ".join([".venv/bin/python", "benchmarks/gemv_floor.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_at_start": os.getloadavg(),
        "torch": torch.__version__,
        "model_shape": MODEL_SHAPE,
        "vocab_size": VOCAB_SIZE,
        "weight_mib_per_token": round(weight_mib, 1),
        "ms_per_token_median": {name: round(statistics.median(v), 3) for name, v in per_round.items()},
        "ms_per_token_min_max": {name: [round(min(v), 3), round(max(v), 3)] for name, v in per_round.items()},
        "effective_gb_per_s": {
            name: round(weight_mib * 2**20 / (statistics.median(v) / 1e3) / 1e9, 2) for name, v in per_round.items()
        },
        "llama_server_c1_median_itl_ms": llama_itl,
        "reference": str(reference.relative_to(REPO)),
    }
    write_summary(Path(args.out), summary)
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "weight_mib_per_token",
                    "ms_per_token_median",
                    "effective_gb_per_s",
                    "llama_server_c1_median_itl_ms",
                )
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
