"""Speculative decoding: ITL and throughput with speculation off, n-gram and draft model,
side by side in one run, at concurrency 1 and 16; plus the batch-size sweep behind
`--speculative-max-batch`.

Workloads (greedy, fixed output length):
  edit:  code-editing prompts — a Python function from the held-out stdlib files, then an
         instruction to rewrite it and its first line again, so the answer repeats long spans
         of the prompt (where prompt lookup shines);
  write: plain code continuation from the start of a held-out function (where a draft model helps).

    .venv/bin/python benchmarks/spec_decode.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from pagoda.engine.threads import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch loads (the thread policy's one owner)

from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from pagoda.engine.engine_request import EngineRequest  # noqa: E402
from pagoda.engine.llm_engine import LLMEngine  # noqa: E402
from pagoda.engine.threads import set_engine_threads  # noqa: E402
from pagoda.outputs import OutputAccumulator  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402
from pagoda.stats import percentile  # noqa: E402

DRAFT_DIR = DEFAULT_MODEL_DIR.parent / "pagoda-coder-draft"


def heldout_functions(model_dir: Path, count: int, min_lines: int = 8, max_lines: int = 24) -> list[str]:
    """Source of `count` functions from the stdlib files the bundled model never saw."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    listed = (model_dir / "heldout_files.txt").read_text().split()
    functions = []
    for relative in listed:
        path = stdlib / relative
        if not path.is_file():
            continue
        source = path.read_text(errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                body = lines[node.lineno - 1 : node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                functions.append("\n".join(line[indent:] for line in body))
                if len(functions) == count:
                    return functions
    return functions


def edit_prompt(function: str) -> str:
    first_line = function.splitlines()[0]
    return f"{function}\n\n\n# The same function, with clearer variable names:\n{first_line}\n"


def write_prompt(function: str) -> str:
    return "\n".join(function.splitlines()[:2]) + "\n"


def run_closed_loop(engine: LLMEngine, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Keep `concurrency` requests in flight until all prompts are done."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(enumerate(prompts))
    in_flight: set[str] = set()
    finished = []
    outputs = OutputAccumulator()  # step() returns deltas: the outputs built from them
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            index, prompt = pending.pop(0)
            engine.add_request(EngineRequest(str(index), prompt, params))
            in_flight.add(str(index))
        for delta in engine.step().deltas:
            output = outputs.add(delta)
            if output.finished:
                in_flight.discard(output.request_id)
                finished.append(output)
    elapsed = time.perf_counter() - start
    itls = []
    for output in finished:
        metrics = output.metrics
        num_tokens = len(output.outputs[0].token_ids)
        if num_tokens > 1:
            itls.append((metrics.finished_time - metrics.first_token_time) / (num_tokens - 1))
    output_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    return {
        "seconds": elapsed,
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / elapsed,
        "itl_ms_median": statistics.median(itls) * 1000,
        "itl_ms_p90": percentile(itls, 90) * 1000,
        "tokens": [o.outputs[0].token_ids for o in sorted(finished, key=lambda o: int(o.request_id))],
    }


def measure(
    mode: str,
    workload: list[str],
    concurrency: int,
    max_tokens: int,
    threads: int,
    num_speculative_tokens: int,
    max_batch: int,
) -> dict:
    extra = {}
    if mode == "ngram":
        extra = dict(speculative="ngram", num_speculative_tokens=num_speculative_tokens)
    elif mode == "draft":
        extra = dict(speculative="draft", draft_model=str(DRAFT_DIR), num_speculative_tokens=num_speculative_tokens)
    config = EngineConfig(num_threads=threads, speculative_max_batch=max_batch, **extra)
    set_engine_threads(config, serving=False)
    engine = LLMEngine(config)
    result = run_closed_loop(engine, workload, concurrency, max_tokens)
    spec = engine.get_stats().spec_decode
    result.update(
        acceptance_rate=spec.acceptance_rate,
        mean_accepted_length=spec.mean_accepted_length,
        num_drafts=spec.num_drafts,
        num_draft_tokens=spec.num_draft_tokens,
        accepted_per_position=spec.accepted_per_position,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=[1, 2, 4, 8, 16, 32],
        help="batch sizes for the n-gram on/off sweep (empty: skip)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    functions = heldout_functions(DEFAULT_MODEL_DIR, max(args.num_prompts, max(args.sweep or [0])))
    workloads = {
        "edit": [edit_prompt(f) for f in functions[: args.num_prompts]],
        "write": [write_prompt(f) for f in functions[: args.num_prompts]],
    }
    runs = []
    for workload_name, prompts in workloads.items():
        for concurrency in args.concurrency:
            # Speculation stays on at every concurrency here, to show what it does there.
            results = {
                mode: measure(
                    mode,
                    prompts,
                    concurrency,
                    args.max_tokens,
                    args.threads,
                    args.num_speculative_tokens,
                    max_batch=10**6,
                )
                for mode in ("off", "ngram", "draft")
            }
            baseline = results["off"]
            for mode, result in results.items():
                assert result["tokens"] == baseline["tokens"], f"{mode} changed greedy output"
                row = {key: value for key, value in result.items() if key != "tokens"}
                row.update(
                    workload=workload_name,
                    concurrency=concurrency,
                    mode=mode,
                    itl_speedup=baseline["itl_ms_median"] / result["itl_ms_median"],
                    throughput_ratio=result["output_tok_per_s"] / baseline["output_tok_per_s"],
                )
                runs.append(row)
                print(
                    f"{workload_name:5s} c={concurrency:<3d} {mode:5s} ITL {row['itl_ms_median']:7.2f} ms "
                    f"({row['itl_speedup']:.2f}x)  {row['output_tok_per_s']:7.1f} tok/s "
                    f"({row['throughput_ratio']:.2f}x)  acceptance {row['acceptance_rate']:.2f} "
                    f"mean accepted length {row['mean_accepted_length']:.2f}",
                    flush=True,
                )

    sweep = []
    edit_pool = [edit_prompt(f) for f in functions]
    for batch in args.sweep:
        prompts = (edit_pool * (batch // len(edit_pool) + 1))[:batch]
        off = measure("off", prompts, batch, args.max_tokens, args.threads, args.num_speculative_tokens, 10**6)
        ngram = measure("ngram", prompts, batch, args.max_tokens, args.threads, args.num_speculative_tokens, 10**6)
        sweep.append(
            {
                "batch": batch,
                "itl_ms_off": off["itl_ms_median"],
                "itl_ms_ngram": ngram["itl_ms_median"],
                "itl_speedup": off["itl_ms_median"] / ngram["itl_ms_median"],
                "acceptance_rate": ngram["acceptance_rate"],
            }
        )
        print(
            f"sweep batch {batch:3d}: ITL off {off['itl_ms_median']:.2f} ms, ngram {ngram['itl_ms_median']:.2f} ms "
            f"({sweep[-1]['itl_speedup']:.2f}x)",
            flush=True,
        )

    result = {
        "benchmark": "spec_decode",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": args.threads,
        },
        "models": {"target": DEFAULT_MODEL_DIR.name, "draft": DRAFT_DIR.name},
        "settings": {
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "num_speculative_tokens": args.num_speculative_tokens,
            "greedy": True,
        },
        "runs": runs,
        "batch_sweep_ngram_edit": sweep,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spec_decode.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
