"""bfloat16 vs float32 on the CPU (`--dtype bfloat16`): speed and quality, side by side.

This machine's Zen 4 has AVX-512 BF16, so oneDNN's pre-packed bf16 matmuls (FullWeight) run
natively, and a bf16 KV cache halves the bytes every decode step gathers. What it costs in
quality is measured with the project's own tools on the bundled pagoda-coder (a trained model,
its checkpoint stored in bfloat16): perplexity by prompt logprobs (pagoda/eval/perplexity.py,
window 512 / stride 256) on held-out standard-library files, and greedy agreement (tokens
identical to float32's, and how far the two greedy outputs run before they first differ).

Speed, on the ~10M random benchmark Llama (benchmarks/common.py), float32 vs bfloat16 engines:
- decode step at concurrency 1 and 16: both engines built in this process, rounds of
  `--steps` decode steps alternating between them (who goes first alternates too); median
  step time over rounds, in wall time and in this process's CPU time (levers.py's method);
- offline throughput: benchmarks/offline_throughput.py's workload (256 requests, prompt and
  output lengths uniform 32-256, ignore_eos) through `LLM.generate`, alternating, `--rounds`.

    .venv/bin/python benchmarks/bf16.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pagoda  # noqa: E402,F401  (first: idle OpenMP threads sleep, as in `pagoda serve`; see engine/threads.py)
from pagoda.engine.engine_request import EngineRequest  # noqa: E402

# isort: split
from common import META_KEYS, REPO, RESULTS, build_bench_model, metadata, write_summary  # noqa: E402

NAME = "bf16"
DTYPES = ("float32", "bfloat16")


def decode_steps(
    model_dir: Path, concurrency: int, prompt_len: int, steps: int, rounds: int, threads: int
) -> dict[str, Any]:
    import torch

    from pagoda.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.sampling_params import SamplingParams

    output_len = steps * rounds + 8
    engines = {
        dtype: LLMEngine(
            EngineConfig(
                model=str(model_dir),
                dtype=dtype,
                max_num_seqs=concurrency,
                num_threads=threads,
                max_model_len=prompt_len + output_len + 16,
            )
        )
        for dtype in DTYPES
    }
    torch.set_num_threads(threads)
    rng = random.Random(0)
    vocab = engines["float32"].core.model_config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(str(i), prompt, params))
        while any(r.num_output_tokens == 0 for samples in engine.core.requests.values() for r in samples):
            engine.step()  # every prefill first: the rounds time decode steps only
    wall: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    cpu: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    for round_index in range(rounds):
        for dtype in DTYPES if round_index % 2 == 0 else DTYPES[::-1]:
            engine = engines[dtype]
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(steps):
                engine.step()
            wall[dtype].append((time.perf_counter() - start) / steps)
            cpu[dtype].append((time.process_time() - cpu_start) / steps)
    result: dict[str, Any] = {
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "steps_per_round": steps,
        "rounds": rounds,
        "threads": threads,
    }
    for dtype in DTYPES:
        result[f"step_ms_{dtype}"] = 1000 * statistics.median(wall[dtype])
        result[f"cpu_ms_{dtype}"] = 1000 * statistics.median(cpu[dtype])
    result["speedup"] = result["step_ms_float32"] / result["step_ms_bfloat16"]
    result["cpu_speedup"] = result["cpu_ms_float32"] / result["cpu_ms_bfloat16"]
    result["per_round_ratio"] = [a / b for a, b in zip(wall["float32"], wall["bfloat16"])]
    result["cpu_per_round_ratio"] = [a / b for a, b in zip(cpu["float32"], cpu["bfloat16"])]
    return result


def offline(model_dir: Path, rounds: int, threads: int) -> dict[str, Any]:
    from offline_throughput import make_workload
    from pagoda import LLM, SamplingParams

    prompts, output_lens = make_workload(256, 32, 256, 4096, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    runs: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    for round_index in range(rounds):
        for dtype in DTYPES if round_index % 2 == 0 else DTYPES[::-1]:
            llm = LLM(model=str(model_dir), dtype=dtype, num_threads=threads)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            runs[dtype].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
            del llm, outputs
            gc.collect()
        print(
            f"offline round {round_index + 1}: " + ", ".join(f"{d} {runs[d][-1]:.0f} tok/s" for d in DTYPES), flush=True
        )
    ratios = [b / a for a, b in zip(runs["float32"], runs["bfloat16"])]
    return {
        "workload": "256 requests, prompt and output uniform 32-256, ignore_eos",
        "threads": threads,
        "output_tok_per_s": runs,
        "bf16_over_fp32_per_round": ratios,
        "bf16_over_fp32": statistics.median(ratios),
    }


def quality(num_files: int, max_tokens: int, num_prompts: int, greedy_tokens: int) -> dict[str, Any]:
    from pagoda import LLM, SamplingParams
    from pagoda.eval.perplexity import perplexity, tokenize_documents
    from quantization import heldout_texts

    documents = [(str(p), p.read_text(errors="replace")) for p in heldout_texts(num_files)]
    result: dict[str, Any] = {"model": "pagoda-coder (bundled; checkpoint in bfloat16)", "held_out_files": num_files}
    greedy: dict[str, list[list[int]]] = {}
    token_lists = None
    for dtype in DTYPES:
        llm = LLM(dtype=dtype, kv_cache_memory="256MiB")
        if token_lists is None:
            token_lists = tokenize_documents(llm, documents, max_tokens)
        ppl = perplexity(llm, token_lists, window=512, stride=256)
        result[f"perplexity_{dtype}"] = ppl.perplexity
        result["num_scored_tokens"] = ppl.num_scored_tokens
        # Greedy continuations of 64-token prefixes taken from the held-out files.
        prefixes = [
            tokens[start : start + 64] for tokens in token_lists for start in range(0, max(len(tokens) - 64, 1), 512)
        ][:num_prompts]
        outputs = llm.generate(
            prefixes, SamplingParams(temperature=0.0, max_tokens=greedy_tokens, ignore_eos=True), use_tqdm=False
        )
        greedy[dtype] = [list(o.outputs[0].token_ids) for o in outputs]
        print(f"{dtype}: perplexity {ppl.perplexity:.4f}", flush=True)
        del llm
        gc.collect()
    same_tokens = total = identical_outputs = 0
    first_divergence: list[int] = []
    for a, b in zip(greedy["float32"], greedy["bfloat16"]):
        same_tokens += sum(x == y for x, y in zip(a, b))
        total += len(a)
        identical_outputs += a == b
        first_divergence.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    result.update(
        perplexity_delta_percent=(result["perplexity_bfloat16"] / result["perplexity_float32"] - 1) * 100,
        greedy_prompts=len(first_divergence),
        greedy_tokens=greedy_tokens,
        greedy_identical_outputs=identical_outputs,
        greedy_position_agreement=same_tokens / total,
        greedy_first_divergence_median=statistics.median(first_divergence),
    )
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="decode steps per engine per round")
    parser.add_argument("--rounds", type=int, default=9, help="decode-step rounds")
    parser.add_argument("--offline-rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the decode steps")
    parser.add_argument("--offline-threads", type=int, default=2, help="as offline_throughput.py")
    parser.add_argument("--ppl-files", type=int, default=8)
    parser.add_argument("--ppl-tokens", type=int, default=8000)
    parser.add_argument("--greedy-prompts", type=int, default=16)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--skip", action="append", default=[], choices=["decode", "offline", "quality"])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)

    model_dir = build_bench_model(REPO / "tmp" / "bench-model")
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir).items() if k in META_KEYS}
    results: dict[str, Any] = {}
    if "decode" not in args.skip:
        results["decode"] = []
        for c in sorted({int(x) for x in args.concurrency.split(",")}):
            entry = decode_steps(model_dir, c, args.prompt_len, args.steps, args.rounds, args.threads)
            results["decode"].append(entry)
            print(
                f"decode c={c}: step fp32 {entry['step_ms_float32']:.2f} ms, bf16 {entry['step_ms_bfloat16']:.2f} ms: "
                f"{entry['speedup']:.2f}x (CPU {entry['cpu_speedup']:.2f}x)",
                flush=True,
            )
    if "offline" not in args.skip:
        results["offline"] = offline(model_dir, args.offline_rounds, args.offline_threads)
        print(f"offline bf16 / fp32: {results['offline']['bf16_over_fp32']:.2f}x", flush=True)
    if "quality" not in args.skip:
        results["quality"] = quality(args.ppl_files, args.ppl_tokens, args.greedy_prompts, args.greedy_tokens)
        q = results["quality"]
        print(
            f"perplexity fp32 {q['perplexity_float32']:.4f}, bf16 {q['perplexity_bfloat16']:.4f} "
            f"({q['perplexity_delta_percent']:+.3f}%); greedy identical {q['greedy_identical_outputs']}/"
            f"{q['greedy_prompts']}, position agreement {q['greedy_position_agreement']:.3f}",
            flush=True,
        )
    write_summary(Path(args.out) / f"{NAME}.json", {**meta, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
