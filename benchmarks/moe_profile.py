"""Where a MoE decode step's time goes: benchmarks/moe.py's Qwen3-30B-A3B-shaped model (128
experts, top-8) and its dense twin with the same active parameters, float32, 2 threads.

For each batch size (1 and 16 sequences, 64-token prompts) the engine prefills, then runs
decode steps: first timed per phase (StepTimings), then under torch.profiler (self CPU time
and call count per aten op, divided by the steps profiled: per-step numbers), and the MoE
blocks' share of the forward measured by timing `SparseMoE.forward` itself. Writes text.

    .venv/bin/python benchmarks/moe_profile.py --out benchmarks/results/moe/profile_before.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from moe import models, prompts  # noqa: E402  (imports pagoda first)
from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.engine.engine_request import EngineRequest  # noqa: E402
from pagoda.model.moe import SparseMoE  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "logits", "sample", "update")
THREADS = 2


def start_decoding(llm: LLM, batch: list[list[int]], steps: int) -> None:
    """Adds the requests and steps until every one has its first token (prefill done)."""
    engine = llm.engine
    for i, prompt in enumerate(batch):
        engine.add_request(
            EngineRequest(
                f"r{time.monotonic_ns()}-{i}",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True),
            )
        )
    for _ in range(8):
        engine.step()
        if all(len(r.output_token_ids) >= 1 for r in engine.core.scheduler.running) and len(
            engine.core.scheduler.running
        ) == len(batch):
            return


def drain(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def timed_phases(llm: LLM, batch: list[list[int]], steps: int) -> tuple[float, Counter, float]:
    """Wall seconds of `steps` decode steps, their phases, and the seconds inside MoE blocks."""
    moe_seconds = [0.0]
    blocks = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, SparseMoE)]

    def before(module, args):
        module._started = time.perf_counter()

    def after(module, args, output):
        moe_seconds[0] += time.perf_counter() - module._started

    handles = [h for b in blocks for h in (b.register_forward_pre_hook(before), b.register_forward_hook(after))]
    start_decoding(llm, batch, steps)
    moe_seconds[0] = 0.0
    phases: Counter = Counter()
    wall = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        llm.engine.step()
        wall += time.perf_counter() - started
        timings = llm.engine.get_stats().last_step_timings
        for name in PHASES:
            phases[name] += getattr(timings, name)
    drain(llm)
    for handle in handles:
        handle.remove()
    return wall, phases, moe_seconds[0]


def op_table(llm: LLM, batch: list[list[int]], steps: int, rows: int) -> list[str]:
    start_decoding(llm, batch, steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            llm.engine.step()
    drain(llm)
    events = sorted(profile.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    lines = [f"  {'op':<44} {'self ms/step':>12} {'share':>6} {'calls/step':>10}"]
    for event in events[:rows]:
        lines.append(
            f"  {event.key[:44]:<44} {event.self_cpu_time_total / 1000 / steps:12.3f} "
            f"{100 * event.self_cpu_time_total / total:5.1f}% {event.count / steps:10.1f}"
        )
    lines.append(f"  {'(all ops)':<44} {total / 1000 / steps:12.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--ops", type=int, default=22, help="aten ops listed")
    parser.add_argument("--models", type=Path, default=Path("/tmp/pagoda-moe-bench"))
    parser.add_argument("--native-kernels", choices=("off", "on"), default="off")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    moe_dir, dense_dir = models(args.models)
    commit = os.popen("git rev-parse --short HEAD").read().strip()
    lines = [
        f"$ .venv/bin/python benchmarks/moe_profile.py {' '.join(sys.argv[1:])}",
        f"date {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, commit {commit}, load average at start "
        f"{os.getloadavg()[0]:.1f} (shared 2-core machine), torch {torch.__version__}, {THREADS} threads, "
        f"native kernels {args.native_kernels}",
        "",
    ]
    engines = {
        name: LLM(model=str(path), num_threads=THREADS, native_kernels=args.native_kernels)
        for name, path in (("moe", moe_dir), ("dense", dense_dir))
    }
    for size in (1, 16):
        batch = prompts(engines["moe"].engine.core.model_config.vocab_size)[:size]
        for name, llm in engines.items():
            timed_phases(llm, batch, 4)  # warm-up
            wall, phases, moe_seconds = timed_phases(llm, batch, args.steps)
            lines.append(
                f"== {name}, batch {size}: {1000 * wall / args.steps:.2f} ms per decode step "
                f"(load average {os.getloadavg()[0]:.1f})"
            )
            for phase in PHASES:
                lines.append(
                    f"  {phase:<10} {1000 * phases[phase] / args.steps:8.2f} ms  {100 * phases[phase] / wall:5.1f}%"
                )
            if name == "moe":
                lines.append(
                    f"  inside the MoE blocks: {1000 * moe_seconds / args.steps:.2f} ms "
                    f"({100 * moe_seconds / wall:.1f}% of the step)"
                )
            lines.append("  aten ops under torch.profiler, per decode step:")
            lines += op_table(llm, batch, args.steps, args.ops)
            lines.append("")
            print("\n".join(lines[-args.ops - 14 :]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
