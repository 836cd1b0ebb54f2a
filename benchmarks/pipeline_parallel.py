"""Pipeline parallelism on the CPU: PP=2 (two processes, gloo, 1 thread each) vs PP=1 (one
process, 2 threads), threads held equal, on a random Llama whose matmuls dominate a step.

The engines stay up for the whole run and are measured in alternating rounds (A/B/C, C/B/A, ...),
so a change in the machine's load hits all; medians over the rounds are reported.

  c=1: one greedy request (64-token prompt), output tok/s after its first token and the
       per-token latency (ms between tokens);
  c=16: 16 requests at once (64-token prompts, 32 output tokens each), output tok/s wall and
       the per-token latency (the median gap between a request's tokens);
  bubble fraction (PP=2): 1 - (seconds the stages computed) / (stages x wall seconds), from the
       stages' own busy counters over each measurement;
  stage-0 wait fraction (PP=2): the share of the wall time stage 0 (the engine core: scheduling,
       its layers, sampling) sat waiting for the last stage's logits. Near zero means stage 0's
       loop is the bottleneck and the later stages wait for it.

The engine keeps up to P micro-batches of disjoint requests in flight, so at c=16 stage 1
computes one half of the requests while stage 0 computes the other; at c=1 there is only one
request, so one stage always waits for the other (a bubble of about one half with two stages).
Stage 0 is also the engine core (scheduling, batch preparation, sampling), so the same PP=2 is
measured with an uneven split as well (`UNEVEN`: fewer layers on stage 0).

    .venv/bin/python benchmarks/pipeline_parallel.py --rounds 3 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from pagoda.engine.threads import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch loads (the thread policy's one owner)

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.engine.engine_request import EngineRequest  # noqa: E402
from pagoda.engine.threads import set_engine_threads  # noqa: E402
from tensor_parallel import build_model as build_llama  # noqa: E402
from tensor_parallel import prompt  # noqa: E402

# ~30M parameters: 8 layers of hidden 512 (8 query / 4 KV heads, intermediate 1536), 4k vocabulary.
MODEL_SHAPE = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
TOTAL_THREADS = 2
# Stage 0 also schedules, prepares and samples each micro-batch: fewer layers balance the stages.
UNEVEN = "2,6"


def build_model(directory: Path) -> Path:
    import tensor_parallel

    tensor_parallel.MODEL_SHAPE = MODEL_SHAPE  # the same builder, this benchmark's shape
    return build_llama(directory)


class BusyMeter:
    """The stages' compute seconds over a measurement (PP=2 only)."""

    def __init__(self, llm: LLM) -> None:
        self.executor = getattr(llm.engine.core, "executor", None)
        self.start = self.executor.stage_busy_seconds() if self.executor is not None else None
        self.wait_start = self.executor.logits_wait_s if self.executor is not None else 0.0
        self.started = time.perf_counter()

    def bubble(self) -> tuple[float | None, float | None]:
        """(bubble fraction, stage-0 wait fraction)."""
        if self.executor is None:
            return None, None
        wall = time.perf_counter() - self.started
        busy = [end - start for start, end in zip(self.start, self.executor.stage_busy_seconds())]
        return 1.0 - sum(busy) / (len(busy) * wall), (self.executor.logits_wait_s - self.wait_start) / wall


def single_stream(llm: LLM, index: int, max_tokens: int) -> tuple[float, float, float | None, float | None]:
    """(output tok/s after the first token, ms per token, bubble and stage-0 wait fractions) of one request."""
    engine = llm.engine
    engine.add_request(
        EngineRequest(
            f"single-{index}", prompt(index), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )
    )
    meter = BusyMeter(llm)
    times = []
    while engine.has_unfinished_requests():
        deltas = engine.step().deltas
        now = time.perf_counter()
        for delta in deltas:
            for sample in delta.outputs:
                times.extend(now for _ in sample.token_ids)
    rate = (len(times) - 1) / (times[-1] - times[0])
    return rate, 1000.0 / rate, *meter.bubble()


def concurrent(llm: LLM, index: int, batch: int, max_tokens: int) -> tuple[float, float, float | None, float | None]:
    """(output tok/s wall, ms per token of a request (median inter-token gap), bubble and
    stage-0 wait fractions)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(EngineRequest(f"batch-{index}-{i}", prompt(index * batch + i), params))
    meter = BusyMeter(llm)
    start = time.perf_counter()
    last: dict[str, float] = {}
    gaps: list[float] = []
    tokens = 0
    while engine.has_unfinished_requests():
        deltas = engine.step().deltas
        now = time.perf_counter()
        for delta in deltas:
            count = sum(len(sample.token_ids) for sample in delta.outputs)
            tokens += count
            if delta.request_id in last and count:
                gaps.append((now - last[delta.request_id]) / count)
            last[delta.request_id] = now
    elapsed = time.perf_counter() - start
    return tokens / elapsed, 1000.0 * statistics.median(gaps), *meter.bubble()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pagoda-bench-pp/llama-30m"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model_dir = build_model(args.model_dir)
    load_at_start = os.getloadavg()
    common = dict(model=str(model_dir), num_threads=TOTAL_THREADS, num_kv_blocks=512, max_num_seqs=args.batch)
    engines = {
        "pp1": LLM(**common),
        "pp2": LLM(**common, pipeline_parallel_size=2),
        f"pp2_{UNEVEN.replace(',', '_')}": LLM(**common, pipeline_parallel_size=2, pp_layer_partition=UNEVEN),
    }
    metrics = (
        "c1_tok_s",
        "c1_ms_per_token",
        "c1_bubble",
        "c1_stage0_wait",
        "c16_tok_s",
        "c16_ms_per_token",
        "c16_bubble",
        "c16_stage0_wait",
    )
    results: dict[str, dict[str, list]] = {name: {key: [] for key in metrics} for name in engines}
    for llm in engines.values():  # warm-up: first-call allocations, page faults
        set_engine_threads(llm.engine.config, serving=False)
        concurrent(llm, 99, 2, 4)
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            llm = engines[name]
            # Both engines step on this thread: re-apply this engine's share (2 threads for
            # PP=1, 1 for each PP=2 stage) before measuring.
            set_engine_threads(llm.engine.config, serving=False)
            row = (
                *single_stream(llm, round_index, args.decode_tokens),
                *concurrent(llm, round_index, args.batch, args.batch_tokens),
            )
            for key, value in zip(metrics, row):
                results[name][key].append(value)
            print(
                f"round {round_index} {name}: "
                + ", ".join(f"{key} {value:.3f}" for key, value in zip(metrics, row) if value is not None),
                flush=True,
            )
    medians = {
        name: {key: statistics.median(values) for key, values in values_of.items() if values and values[0] is not None}
        for name, values_of in results.items()
    }
    summary = {
        "benchmark": "pipeline_parallel",
        "model": {"shape": MODEL_SHAPE, "dtype": "float32"},
        "threads_total": TOTAL_THREADS,
        "pipeline": "up to P micro-batches of disjoint requests in flight (each an even share of the requests)",
        "workload": {
            "c1": f"1 request, 64-token prompt, {args.decode_tokens} output tokens, greedy",
            "c16": f"{args.batch} requests at once, 64-token prompts, {args.batch_tokens} output tokens each, greedy",
        },
        "rounds": args.rounds,
        "per_round": results,
        "median": medians,
        "over_pp1": {
            name: {key: medians[name][key] / medians["pp1"][key] for key in medians["pp1"]}
            for name in engines
            if name != "pp1"
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            "note": "2 vCPU shared with other jobs during the run: absolute numbers are noisy, "
            "the interleaved ratios are what counts",
        },
    }
    print(json.dumps({"median": medians, "over_pp1": summary["over_pp1"]}, indent=2))
    for name, llm in engines.items():
        if name != "pp1":
            llm.engine.close()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pipeline_parallel.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
