"""Decode steps with one long context among short ones: split decode groups vs one padded group.

8 requests with 64-token prompts and one with a 1500-token prompt decode together (the
disaggregation benchmark's chat streams beside a RAG request). The CPU attention backend
sorts decodes by context length and attends them in padded SDPA calls; with
DECODE_GROUP_MAX_PADDING a row that would pad its group by too much starts a new group, so the
short rows no longer attend over 1500 padded positions. One engine, the grouping switched
between interleaved rounds of decode steps; medians. Outputs are bit-identical either way
(tests/model/test_torch_attention.py).

    .venv/bin/python benchmarks/decode_groups.py --rounds 8
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pagoda  # noqa: E402,F401  (first: idle OpenMP threads sleep, as in `pagoda serve`)
from pagoda.engine.engine_request import EngineRequest  # noqa: E402

# isort: split
from common import REPO, RESULTS, build_bench_model, write_summary  # noqa: E402

NAME = "decode_groups"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="decode steps timed per round and grouping")
    parser.add_argument("--out", default=str(RESULTS / f"{NAME}.json"))
    args = parser.parse_args(argv)

    import torch

    import pagoda.kernels.attention.torch_backend as torch_backend
    from pagoda.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.sampling_params import SamplingParams

    torch.set_num_threads(1)
    model_dir = build_bench_model(Path(args.model_dir))
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), max_model_len=2048, num_kv_blocks=2000, max_num_batched_tokens=2048)
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.rounds * args.steps * 2 + 16, ignore_eos=True)
    for i in range(8):
        engine.add_request(EngineRequest(f"chat{i}", [rng.randrange(5, 4000) for _ in range(64)], params))
    engine.add_request(EngineRequest("long", [rng.randrange(5, 4000) for _ in range(1500)], params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for s in engine.core.requests.values() for r in s):
        engine.step()
    for _ in range(3):
        engine.step()
    split = torch_backend.decode_groups.__defaults__
    padded = (torch_backend.DECODE_GROUP_SIZE, 10**12)  # the grouping before: 16 rows per group
    step_ms: dict[str, list[float]] = {"split": [], "one padded group": []}
    for round_index in range(args.rounds):
        order = [("split", split), ("one padded group", padded)]
        for name, defaults in order if round_index % 2 == 0 else reversed(order):
            torch_backend.decode_groups.__defaults__ = defaults
            started = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            step_ms[name].append((time.perf_counter() - started) / args.steps * 1e3)
    torch_backend.decode_groups.__defaults__ = split
    medians = {name: round(statistics.median(v), 2) for name, v in step_ms.items()}
    summary = {
        "command": " ".join([".venv/bin/python", "benchmarks/decode_groups.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_at_start": os.getloadavg(),
        "workload": "8 decodes with 64-token prompts + 1 with a 1500-token prompt, 10M benchmark Llama fp32, 1 thread",
        "step_ms_median": medians,
        "step_ms_rounds": {name: [round(v, 2) for v in values] for name, values in step_ms.items()},
        "speedup": round(medians["one padded group"] / medians["split"], 2),
    }
    write_summary(Path(args.out), summary)
    print(medians, "speedup", summary["speedup"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
