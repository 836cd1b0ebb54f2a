"""Where an engine step goes: scheduling, input preparation, forward by layer type, attention,
LM head, sampling, output processing and IPC, at fixed concurrency.

Runs the engine as `pagoda serve`'s engine process runs it (LLMEngine on the serving thread
policy, deltas pickled through a multiprocessing pipe to a reader thread after every step), in
this process so it can be instrumented: StepTimings gives the core's phases, a ForwardProfiler
(pagoda/worker/forward_profile.py) the layers, and the script times output processing and the
pipe send itself. Closed loop: `--concurrency` requests always in flight (prompts of
--prompt-len random token ids, --output-len tokens, greedy, ignore_eos).

Reported as mean milliseconds per step over decode-only steps (what sets the ITL) and over all
steps, written as text and JSON. The hooks cost a little themselves (in "forward, other").
"norm" includes the residual adds, which the norms fold in (pagoda.model.decoder), and Qwen3's and
Gemma 3's per-head q/k norms; "rotary" the rotation of q and k. With `--native-kernels on` each
row times the native kernel that replaces its PyTorch ops (the hooks sit on the same modules).

    .venv/bin/python benchmarks/step_breakdown.py --concurrency 1,16 --native-kernels off --label native_off
    .venv/bin/python benchmarks/step_breakdown.py --concurrency 1,16 --native-kernels on --label native_on
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pagoda  # noqa: E402,F401  (first: idle OpenMP threads sleep, as in `pagoda serve`; see engine/threads.py)
from pagoda.engine.engine_request import EngineRequest  # noqa: E402

# isort: split
from common import (  # noqa: E402
    META_KEYS,
    MODEL_SHAPE,
    MODEL_SHAPE_100M,
    REPO,
    RESULTS,
    build_bench_model,
    metadata,
    write_summary,
)

NAME = "step_breakdown"
SHAPES = {"10m": MODEL_SHAPE, "100m": MODEL_SHAPE_100M}
CORE_PHASES = ("schedule", "prepare", "propose", "forward", "logits", "sample", "update")


def measure(
    model_dir: Path,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    num_requests: int,
    threads: int | None,
    native_kernels: str = "off",
) -> dict[str, Any]:
    from pagoda.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.threads import set_engine_threads
    from pagoda.sampling_params import SamplingParams
    from pagoda.worker.forward_profile import KINDS, ForwardProfiler

    config = EngineConfig(
        model=str(model_dir),
        max_num_seqs=concurrency,
        num_threads=threads,
        max_model_len=prompt_len + output_len + 16,
        native_kernels=native_kernels,
    )
    used_threads = set_engine_threads(config, serving=True)
    engine = LLMEngine(config)
    runner = engine.core.runner
    profiler = ForwardProfiler(runner.model, runner.backend)

    processing = [0.0]
    process = engine.output_processor.process

    def timed_process(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return process(*args)
        finally:
            processing[0] += time.perf_counter() - start

    engine.output_processor.process = timed_process
    # The reader is another process, as the server's HTTP front is: a thread here would take
    # the GIL from the engine loop and be counted as IPC.
    context = multiprocessing.get_context("spawn")
    sender, receiver = context.Pipe()
    reader = context.Process(target=_drain, args=(receiver,), daemon=True)
    reader.start()
    receiver.close()
    sender.recv()  # the reader has imported what it unpickles: a full pipe would block sends

    vocab = engine.core.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    submitted = finished = 0
    steps = []
    while finished < num_requests:
        while submitted < num_requests and submitted - finished < concurrency:
            engine.add_request(
                EngineRequest(str(submitted), [rng.randrange(1, vocab) for _ in range(prompt_len)], params)
            )
            submitted += 1
        processing[0] = 0.0
        start = time.perf_counter()
        output = engine.step()
        stepped, send_cpu = time.perf_counter(), time.thread_time()
        sender.send(("batch", output, engine.get_stats()))
        sent, send_cpu = time.perf_counter(), time.thread_time() - send_cpu
        finished += sum(d.finished for d in output.deltas)
        timings = engine.core.last_step_timings
        record = {phase: getattr(timings, phase) for phase in CORE_PHASES}
        record["output_processing"] = processing[0]
        record["engine_other"] = (stepped - start) - processing[0] - sum(record[p] for p in CORE_PHASES)
        record["ipc_send"] = sent - stepped
        # What the engine thread itself spent on the send; the rest of its wall time is waiting
        # for a core after writing woke the reader (the scheduler's doing on a busy machine).
        record["ipc_send_cpu"] = send_cpu
        record["total"] = sent - start
        record["layers"] = profiler.snapshot()
        record["tokens"] = profiler.tokens
        profiler.reset()
        steps.append(record)
    sender.send(None)
    reader.join()
    profiler.close()

    decode_steps = [s for s in steps[concurrency:] if 0 < s["tokens"] <= concurrency]
    return {
        "concurrency": concurrency,
        "threads": used_threads,
        "native_kernels": _kernels_of(engine),
        "steps": len(steps),
        "decode_steps": len(decode_steps),
        "kinds": list(KINDS),
        "decode": _mean_ms(decode_steps),
        "all": _mean_ms(steps),
    }


def _kernels_of(engine: Any) -> str:
    return engine.core.kernels.describe() or "off (PyTorch ops)"


def _drain(conn: Any) -> None:
    import pagoda.engine.llm_engine  # noqa: F401  (the classes of the deltas and stats)

    conn.send("ready")
    while conn.recv() is not None:
        pass


def _mean_ms(steps: list[dict[str, Any]]) -> dict[str, Any]:
    if not steps:
        return {}
    n = len(steps)
    mean = {
        key: 1000 * sum(s[key] for s in steps) / n
        for key in (*CORE_PHASES, "output_processing", "engine_other", "ipc_send", "ipc_send_cpu", "total")
    }
    layers = {kind: 1000 * sum(s["layers"][kind] for s in steps) / n for kind in steps[0]["layers"]}
    lm_head = layers.pop("lm_head")  # the LM head is its own phase (StepTimings.logits)
    layers["other"] = mean["forward"] - sum(layers.values())
    mean["forward_layers"] = layers
    mean["lm_head_hooked"] = lm_head
    mean["tokens_per_step"] = sum(s["tokens"] for s in steps) / n
    return mean


def render(result: dict[str, Any], which: str) -> str:
    data = result[which]
    total = data["total"]
    rows = [("scheduling", data["schedule"]), ("input preparation", data["prepare"])]
    if data["propose"]:
        rows.append(("speculative proposals", data["propose"]))
    rows.append(("forward (decoder stack)", data["forward"]))
    rows += [(f"  {kind}", ms) for kind, ms in data["forward_layers"].items()]
    rows += [
        ("LM head (logits)", data["logits"]),
        ("sampling", data["sample"]),
        ("scheduler update", data["update"]),
        ("output processing (detokenize, stops)", data["output_processing"]),
        ("engine, untimed rest", data["engine_other"]),
        ("IPC (pickle + pipe send)", data["ipc_send"]),
    ]
    if "ipc_send_cpu" in data:
        rows.append(("  of which CPU time of the sending thread", data["ipc_send_cpu"]))
    steps = result["decode_steps"] if which == "decode" else result["steps"]
    lines = [
        f"concurrency {result['concurrency']}, {which} steps ({steps}), "
        f"{data['tokens_per_step']:.1f} tokens per step, {result['threads']} torch thread(s)",
        f"native kernels: {result.get('native_kernels', 'off (PyTorch ops)')}",
        f"{'phase':<42}{'ms/step':>9}{'share':>8}",
    ]
    lines += [f"{name:<42}{ms:>9.3f}{100 * ms / total:>7.1f}%" for name, ms in rows]
    lines.append(f"{'step total':<42}{total:>9.3f}{100.0:>7.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default="10m")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--threads", type=int, help="torch threads (default: the serving policy, engine/threads.py)")
    parser.add_argument(
        "--native-kernels",
        choices=("off", "on"),
        default="off",
        help="pagoda's native CPU kernels (pagoda.native) or PyTorch's ops",
    )
    parser.add_argument("--label", default="current", help="names the output files, e.g. before / after")
    parser.add_argument("--out", default=str(RESULTS / NAME))
    args = parser.parse_args(argv)

    shape = SHAPES[args.model]
    model_dir = build_bench_model(
        REPO / "tmp" / ("bench-model" if args.model == "10m" else f"bench-model-{args.model}"), shape=shape
    )
    out = Path(args.out)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir, shape).items() if k in META_KEYS}
    results, text = (
        [],
        [
            f"# {meta['command']}",
            f"# {meta['date']}, git {meta['git_commit']}, load average at start "
            f"{', '.join(f'{x:.1f}' for x in meta['load_average_at_start'] or [])} "
            f"(2-core machine shared with other work: absolute times are noisy)",
            "",
        ],
    )
    for c in sorted({int(x) for x in args.concurrency.split(",")}):
        result = measure(
            model_dir,
            c,
            args.prompt_len,
            args.output_len,
            max(4, args.requests_per_client * c),
            args.threads,
            args.native_kernels,
        )
        results.append(result)
        for which in ("decode", "all"):
            text += [render(result, which), ""]
    report = "\n".join(text)
    print(report)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.model == "10m" else f"_{args.model}"
    (out / f"{args.label}{suffix}.txt").write_text(report)
    write_summary(out / f"{args.label}{suffix}.json", {**meta, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
