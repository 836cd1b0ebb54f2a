"""Where the offline engine's time goes on offline_throughput.py's workload.

Runs the same 256 requests (prompt and output lengths uniform 32-256, ignore_eos, the ~10M
random Llama, float32, 2 threads) through the engine step by step, twice:
- phases: StepTimings summed over every step (scheduling, input preparation, forward, LM head,
  sampling, bookkeeping), against the steps' wall time; the remainder is output processing;
- ops: the same run under torch.profiler, self CPU time per aten op (the forward's kernels:
  projections, attention's block gathers and SDPA, elementwise ops).
Writes both as text.

    .venv/bin/python benchmarks/offline_profile.py --out benchmarks/results/offline_throughput_pass3/profile.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from offline_throughput import MODEL_SHAPE, make_workload  # noqa: E402  (imports pagoda first)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from model_factory import build_model  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.engine.engine_request import EngineRequest  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "logits", "sample", "update")


def run_steps(
    model_dir: Path, prompts: list[list[int]], output_lens: list[int], threads: int
) -> tuple[float, Counter, int]:
    engine = LLM(model=str(model_dir), num_threads=threads).engine
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(
            EngineRequest(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        )
    phases: Counter = Counter()
    wall = 0.0
    steps = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        wall += time.perf_counter() - start
        timings = engine.get_stats().last_step_timings
        for name in PHASES:
            phases[name] += getattr(timings, name)
        steps += 1
    return wall, phases, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ops", type=int, default=25, help="aten ops listed")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    lines = [
        f"$ .venv/bin/python benchmarks/offline_profile.py {' '.join(sys.argv[1:])}",
        f"date {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, load average at start {os.getloadavg()[0]:.1f} "
        f"(shared 2-core machine), torch {torch.__version__}, {args.threads} threads",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "llama10m", "llama", vocab_size=8192, **MODEL_SHAPE)
        prompts, output_lens = make_workload(256, 32, 256, 8192, seed=0)
        wall, phases, steps = run_steps(model_dir, prompts, output_lens, args.threads)
        lines.append(f"Phases over {steps} steps, {wall:.2f} s of step wall time:")
        for name in PHASES:
            lines.append(f"  {name:<10} {phases[name]:8.2f} s  {100 * phases[name] / wall:5.1f}%")
        rest = wall - sum(phases.values())
        lines += [
            f"  {'outputs':<10} {rest:8.2f} s  {100 * rest / wall:5.1f}%  (output processing, detokenization)",
            "",
        ]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            start = time.perf_counter()
            run_steps(model_dir, prompts, output_lens, args.threads)
            profiled = time.perf_counter() - start
    lines.append(f"aten ops, self CPU time of the calling thread, under torch.profiler ({profiled:.1f} s wall):")
    lines.append(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.ops))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
