"""Offline throughput: pagoda vs transformers static batching, side by side in one run.

Workload (issue "Core engine"): 256 requests, prompt and output lengths uniform in [32, 256],
ignore_eos, a ~10M-parameter random Llama in float32 on the CPU. The baseline is
`transformers.generate` in static batches of 16 with left padding; a static batch runs until
its longest request is done, and only the tokens each request asked for are counted.
Both run with the same torch thread count, alternating, several rounds; medians are reported.
Each run also records this process's CPU seconds (every thread): on a shared machine the ratio
of output tokens per CPU second says what each side's own work costs, without the time it
waited for a core, while the wall-clock ratio is the target's measure.

Also reports where a pagoda step's time goes with 64 running requests.

    .venv/bin/python benchmarks/offline_throughput.py --rounds 3 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pagoda.engine.threads import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch loads (the thread policy's one owner)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from model_factory import build_model  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.engine.engine_request import EngineRequest  # noqa: E402

MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=10,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)


def make_workload(num_requests: int, low: int, high: int, vocab_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(low, high + 1, (num_requests,), generator=generator).tolist()
    output_lens = torch.randint(low, high + 1, (num_requests,), generator=generator).tolist()
    prompts = [torch.randint(5, vocab_size, (n,), generator=generator).tolist() for n in prompt_lens]
    return prompts, output_lens


def run_pagoda(model_dir: Path, prompts, output_lens, threads: int, native_kernels: str = "off") -> dict:
    llm = LLM(model=str(model_dir), num_threads=threads, native_kernels=native_kernels)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == sum(output_lens)
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "output_tokens": generated,
        "output_tok_per_s": generated / elapsed,
        "output_tok_per_cpu_s": generated / cpu,
    }


def run_transformers(model_dir: Path, prompts, output_lens, threads: int, batch_size: int) -> dict:
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        new_tokens = max(output_lens[i : i + batch_size])
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    useful = sum(output_lens)
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "output_tokens": useful,
        "output_tok_per_s": useful / elapsed,
        "output_tok_per_cpu_s": useful / cpu,
    }


def step_breakdown(model_dir: Path, vocab_size: int, threads: int, running: int = 64) -> dict:
    """Per-phase step time with `running` requests decoding together."""
    llm = LLM(model=str(model_dir), num_threads=threads, max_num_seqs=running)
    engine = llm.engine
    prompts, _ = make_workload(running, 32, 256, vocab_size, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), prompt, params))
    while any(r.num_output_tokens == 0 for samples in engine.core.requests.values() for r in samples):
        engine.step()  # finish every prefill first
    phases = {"schedule": [], "prepare": [], "forward": [], "logits": [], "sample": [], "update": [], "total": []}
    for _ in range(40):
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        assert engine.get_stats().num_running == running
        timings = engine.get_stats().last_step_timings
        for name in ("schedule", "prepare", "forward", "logits", "sample", "update"):
            phases[name].append(getattr(timings, name))
        phases["total"].append(total)
    medians = {name: statistics.median(values) * 1000 for name, values in phases.items()}
    host = medians["schedule"] + medians["prepare"] + medians["update"]
    medians["other"] = medians["total"] - host - medians["forward"] - medians["logits"] - medians["sample"]
    return {
        "running_requests": running,
        "median_ms": medians,
        "host_fraction": (host + max(medians["other"], 0)) / medians["total"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline-batch-size", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="directory for offline_throughput.json")
    parser.add_argument(
        "--native-kernels",
        choices=("off", "on", "both"),
        default="off",
        help="pagoda's --native-kernels; both: each round also runs pagoda with them on",
    )
    args = parser.parse_args()
    modes = ("off", "on") if args.native_kernels == "both" else (args.native_kernels,)

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "llama10m", "llama", vocab_size=8192, **MODEL_SHAPE)
        config = json.loads((model_dir / "config.json").read_text())
        vocab_size = config["vocab_size"]
        num_params = sum(
            t.numel()
            for t in __import__("safetensors.torch").torch.load_file(str(model_dir / "model.safetensors")).values()
        )
        prompts, output_lens = make_workload(args.num_requests, args.min_len, args.max_len, vocab_size, seed=0)
        rounds = []
        for round_index in range(args.rounds):
            # who goes first alternates, so a load change within a round does not favour one side
            runs = {}
            if round_index % 2 == 0:
                runs.update({mode: run_pagoda(model_dir, prompts, output_lens, args.threads, mode) for mode in modes})
            baseline = run_transformers(model_dir, prompts, output_lens, args.threads, args.baseline_batch_size)
            if round_index % 2 == 1:
                runs.update(
                    {mode: run_pagoda(model_dir, prompts, output_lens, args.threads, mode) for mode in reversed(modes)}
                )
            pagoda = runs[modes[0]]
            ratio = pagoda["output_tok_per_s"] / baseline["output_tok_per_s"]
            cpu_ratio = pagoda["output_tok_per_cpu_s"] / baseline["output_tok_per_cpu_s"]
            record = {
                "pagoda": pagoda,
                "transformers": baseline,
                "ratio": ratio,
                "cpu_ratio": cpu_ratio,
                "load_average": os.getloadavg()[0],
            }
            if len(modes) == 2:
                record["pagoda_native_on"] = runs["on"]
                record["ratio_native_on"] = runs["on"]["output_tok_per_s"] / baseline["output_tok_per_s"]
            rounds.append(record)
            print(
                f"round {round_index + 1}: pagoda {pagoda['output_tok_per_s']:.0f} tok/s, "
                f"transformers {baseline['output_tok_per_s']:.0f} tok/s, ratio {ratio:.2f}x "
                f"(per CPU second {cpu_ratio:.2f}x; load {os.getloadavg()[0]:.1f})"
                + (f"; native kernels on {record['ratio_native_on']:.2f}x" if len(modes) == 2 else ""),
                flush=True,
            )
        breakdown = step_breakdown(model_dir, vocab_size, args.threads)

    result = {
        "benchmark": "offline_throughput",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "threads": args.threads,
        },
        "model": {
            "architecture": "LlamaForCausalLM",
            "params": num_params,
            "dtype": "float32",
            **MODEL_SHAPE,
            "vocab_size": vocab_size,
        },
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": [args.min_len, args.max_len],
            "output_len": [args.min_len, args.max_len],
            "ignore_eos": True,
            "baseline_batch_size": args.baseline_batch_size,
        },
        "rounds": rounds,
        "median": {
            "pagoda_output_tok_per_s": statistics.median(r["pagoda"]["output_tok_per_s"] for r in rounds),
            "transformers_output_tok_per_s": statistics.median(r["transformers"]["output_tok_per_s"] for r in rounds),
            "ratio": statistics.median(r["ratio"] for r in rounds),
            "cpu_ratio": statistics.median(r["cpu_ratio"] for r in rounds),
            **(
                {
                    "pagoda_native_on_output_tok_per_s": statistics.median(
                        r["pagoda_native_on"]["output_tok_per_s"] for r in rounds
                    ),
                    "ratio_native_on": statistics.median(r["ratio_native_on"] for r in rounds),
                }
                if len(modes) == 2
                else {}
            ),
        },
        "native_kernels": args.native_kernels,
        "load_average_start": load_start,
        "step_breakdown": breakdown,
    }
    print(json.dumps(result["median"], indent=2))
    print(json.dumps(breakdown, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offline_throughput.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
