"""llama.cpp beside pagoda on the same weights: Q8_0 / Q4_0 against pagoda's int8 / int4.

1. Quality, bundled pagoda-coder: the checkpoint converted to an f32 GGUF with llama.cpp's
   convert_hf_to_gguf.py, quantized with llama-quantize to Q8_0 and Q4_0; llama-perplexity on
   the held-out standard-library text (-c 512: each 512-token chunk scores its second half)
   next to pagoda's engine perplexity on the same text (window 512, stride 256) for the
   safetensors model at none / int8 / int4 g32 (Q4_0's group) and for the three GGUFs loaded
   by pagoda (F32 as is, Q8_0 dequantized, Q4_0 as int4 g32 codes). Each tool's delta is
   against its own f32 run. Agreement: pagoda's teacher-forced top-1 tokens on each GGUF (and
   on its own int8/int4) against the safetensors model at full precision.
2. Speed, the random 316M Llama of benchmarks/quantization.py: llama-bench token generation
   (-p 0 -n 32, one thread) for F32 / Q8_0 / Q4_0 interleaved round by round with pagoda's
   single-stream decode (32-token prompt, 32 new tokens, one thread) for none / int8 / int4
   g32 and the Q4_0 GGUF. Speedups are medians over rounds of the ratio to each tool's f32
   in that round.

    python benchmarks/llamacpp_quantization.py --out benchmarks/results

convert_hf_to_gguf.py does not know the bundled tokenizer's pre-tokenizer hash; its
pre-tokenizer is GPT-2's byte-level regex, so the conversion runs with llama.cpp's "gpt-2"
pre-tokenizer named explicitly. llama-quantize keeps its defaults (output / tied embedding
tensor in Q6_K for Q4_0 and Q8_0 for Q8_0), which pagoda dequantizes at load: the LM head is
full precision in pagoda's runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit  # noqa: E402
from pagoda.config import DEFAULT_MODEL_DIR  # noqa: E402
from quantization import build_large_model, heldout_texts  # noqa: E402

CONVERT_WITH_GPT2_PRETOKENIZER = r"""
import runpy, sys
sys.path.insert(0, sys.argv[1])
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""
GGUF_TYPES = ("F32", "Q8_0", "Q4_0")


def run(command: list[str], **kwargs) -> str:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def make_ggufs(llama_cpp: Path, model_dir: Path, work: Path, stem: str) -> dict[str, Path]:
    files = {name: work / f"{stem}-{name.lower()}.gguf" for name in GGUF_TYPES}
    if not files["F32"].exists():
        run(
            [
                sys.executable,
                "-c",
                CONVERT_WITH_GPT2_PRETOKENIZER,
                str(llama_cpp),
                str(model_dir),
                "--outtype",
                "f32",
                "--outfile",
                str(files["F32"]),
            ]
        )
    for name in ("Q8_0", "Q4_0"):
        if not files[name].exists():
            run([str(llama_cpp / "build/bin/llama-quantize"), str(files["F32"]), str(files[name]), name])
    return files


def llama_perplexity(llama_cpp: Path, model: Path, text: Path, chunks: int, threads: int) -> dict:
    # llama.cpp's asynchronous logger sometimes exits before writing its last lines (about one run
    # in two here, whether to a pipe or to --log-file): run again until the final estimate shows.
    for _ in range(8):
        output = run(
            [
                str(llama_cpp / "build/bin/llama-perplexity"),
                "-m",
                str(model),
                "-f",
                str(text),
                "-c",
                "512",
                "--chunks",
                str(chunks),
                "-t",
                str(threads),
                "-b",
                "512",
            ]
        )
        final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
        if final:
            break
    else:
        raise RuntimeError(f"llama-perplexity printed no final estimate for {model}")
    return {"perplexity": float(final.group(1)), "plus_minus": float(final.group(2)), "scored_tokens": chunks * 256}


def pagoda_scores(llm, token_ids: list[int]) -> tuple[float, list[int], int]:
    """Perplexity (window 512, stride 256) and the top-1 token the model predicts at each scored position."""
    import math

    from pagoda.eval.perplexity import make_windows
    from pagoda.sampling_params import SamplingParams

    windows = make_windows(token_ids, 512, 256)
    outputs = llm.generate(
        [w.token_ids for w in windows], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    )
    nll, top1 = 0.0, []
    for window, output in zip(windows, outputs):
        for position in range(window.first_scored, len(window.token_ids)):
            entries = output.prompt_logprobs[position]
            nll -= entries[window.token_ids[position]].logprob
            top1.append(next(token for token, entry in entries.items() if entry.rank == 1))
    return math.exp(nll / len(top1)), top1, len(top1)


def measure_quality(llama_cpp: Path, work: Path, chunks: int, threads: int) -> dict:
    from pagoda.engine.llm import LLM

    text = work / "heldout.txt"
    text.write_text("\n".join(p.read_text(errors="replace") for p in heldout_texts(8)))
    ggufs = make_ggufs(llama_cpp, DEFAULT_MODEL_DIR, work, "pagoda-coder")
    llama = {name: llama_perplexity(llama_cpp, path, text, chunks, threads) for name, path in ggufs.items()}
    for name, entry in llama.items():
        entry["delta_percent"] = (entry["perplexity"] / llama["F32"]["perplexity"] - 1) * 100
        entry["file_bytes"] = ggufs[name].stat().st_size
        print(f"llama.cpp {name}: ppl {entry['perplexity']:.4f} ({entry['delta_percent']:+.2f}%)", flush=True)

    runs = {
        "safetensors none": dict(model=str(DEFAULT_MODEL_DIR)),
        "safetensors int8": dict(model=str(DEFAULT_MODEL_DIR), quantization="int8"),
        "safetensors int4 g32": dict(model=str(DEFAULT_MODEL_DIR), quantization="int4", quantization_group_size=32),
        **{f"gguf {name}": dict(model=str(path), tokenizer=str(DEFAULT_MODEL_DIR)) for name, path in ggufs.items()},
    }
    pagoda, reference_top1, token_ids = {}, None, None
    for label, options in runs.items():
        llm = LLM(kv_cache_memory="256MiB", num_threads=threads, **options)
        if token_ids is None:  # llama-perplexity's text, as many tokens as its chunks cover
            token_ids = llm.tokenizer.encode(text.read_text())[: chunks * 512]
        ppl, top1, scored = pagoda_scores(llm, token_ids)
        reference_top1 = reference_top1 or top1
        pagoda[label] = {
            "perplexity": ppl,
            "scored_tokens": scored,
            "top1_agreement_vs_safetensors_none": sum(a == b for a, b in zip(top1, reference_top1)) / scored,
        }
        print(
            f"pagoda {label}: ppl {ppl:.4f}, top-1 agreement {pagoda[label]['top1_agreement_vs_safetensors_none']:.4f}",
            flush=True,
        )
        del llm
        gc.collect()
    for entry in pagoda.values():
        entry["delta_percent"] = (entry["perplexity"] / pagoda["safetensors none"]["perplexity"] - 1) * 100
    return {
        "text": f"{len(heldout_texts(8))} held-out stdlib files ({DEFAULT_MODEL_DIR.name}/heldout_files.txt), "
        f"first {chunks} x 512 tokens",
        "llama_cpp_perplexity": llama,
        "pagoda_perplexity": pagoda,
    }


def llama_bench(llama_cpp: Path, models: dict[str, Path], threads: int) -> dict[str, float]:
    output = run(
        [
            str(llama_cpp / "build/bin/llama-bench"),
            *[a for p in models.values() for a in ("-m", str(p))],
            "-p",
            "0",
            "-n",
            "32",
            "-t",
            str(threads),
            "-r",
            "1",
            "-o",
            "json",
        ]
    )
    rows = json.loads(output[output.index("[") : output.rindex("]") + 1])
    by_path = {row["model_filename"]: row["avg_ts"] for row in rows}
    return {name: by_path[str(path)] for name, path in models.items()}


def measure_speed(llama_cpp: Path, work: Path, model_dir: Path, rounds: int, threads: int) -> dict:
    import torch

    from pagoda.engine.llm import LLM
    from pagoda.sampling_params import SamplingParams

    ggufs = make_ggufs(llama_cpp, model_dir, work, "llama-316m")
    engines = {
        "none": LLM(model=str(model_dir), kv_cache_memory="128MiB", num_threads=threads),
        "int8": LLM(model=str(model_dir), quantization="int8", kv_cache_memory="128MiB", num_threads=threads),
        "int4 g32": LLM(
            model=str(model_dir),
            quantization="int4",
            quantization_group_size=32,
            kv_cache_memory="128MiB",
            num_threads=threads,
        ),
        "gguf Q4_0": LLM(
            model=str(ggufs["Q4_0"]), tokenizer=str(model_dir), kv_cache_memory="128MiB", num_threads=threads
        ),
    }
    prompt = [torch.randint(5, 4000, (32,), generator=torch.Generator().manual_seed(0)).tolist()]

    def decode_rate(llm) -> float:
        def timed(tokens: int) -> float:
            start = time.perf_counter()
            llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
            return time.perf_counter() - start

        return 32 / max(timed(33) - timed(1), 1e-9)

    for llm in engines.values():
        decode_rate(llm)  # warm up
    llama_rounds = {name: [] for name in GGUF_TYPES}
    pagoda_rounds = {name: [] for name in engines}
    for index in range(rounds):
        for name, rate in llama_bench(llama_cpp, ggufs, threads).items():
            llama_rounds[name].append(rate)
        for name, llm in engines.items():
            pagoda_rounds[name].append(decode_rate(llm))
        print(
            f"round {index}: llama.cpp "
            + ", ".join(f"{k} {v[-1]:.1f}" for k, v in llama_rounds.items())
            + " | pagoda "
            + ", ".join(f"{k} {v[-1]:.1f}" for k, v in pagoda_rounds.items()),
            flush=True,
        )

    def summary(rates: dict[str, list[float]], base: str) -> dict:
        return {
            name: {
                "tok_s_median": statistics.median(values),
                "rounds": values,
                "speedup_vs_f32": statistics.median(a / b for a, b in zip(values, rates[base])),
            }
            for name, values in rates.items()
        }

    return {
        "llama_cpp_tg32": summary(llama_rounds, "F32"),
        "pagoda_single_stream": summary(pagoda_rounds, "none"),
        "gguf_bytes": {name: path.stat().st_size for name, path in ggufs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--llama-cpp",
        type=Path,
        default=Path("/work/tools/llama.cpp"),
        help="llama.cpp checkout with build/bin/llama-{quantize,perplexity,bench}",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagoda-bench-llamacpp"), help="GGUF files (reused)")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path("/tmp/pagoda-bench-quant-316m"),
        help="the random 316M Llama of benchmarks/quantization.py (built if missing)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--chunks", type=int, default=24, help="512-token chunks of text scored")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    from pagoda.bench.report import machine_info

    results = {
        "command": " ".join(["python", "benchmarks/llamacpp_quantization.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "llama_cpp": run([str(args.llama_cpp / "build/bin/llama-perplexity"), "--version"]).strip().splitlines()[0]
        + " (vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist)",
        "machine": machine_info(),
        "load_average_at_start": os.getloadavg(),
        "threads": args.threads,
        "notes": "shared 2-core machine: compare ratios within one tool and one run",
    }
    results["quality"] = measure_quality(args.llama_cpp, args.work, args.chunks, args.threads)
    if not args.skip_speed:
        results["speed"] = measure_speed(
            args.llama_cpp, args.work, build_large_model(args.model_dir), args.rounds, args.threads
        )
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "llamacpp_quantization.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
