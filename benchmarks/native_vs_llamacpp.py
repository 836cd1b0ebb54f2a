"""pagoda's native CPU kernels off and on beside llama.cpp's `llama-server` at -t 1 and -t 2, same weights.

For each configuration the script makes the model (random weights, Hugging Face layout) and its
GGUFs (llama.cpp's convert_hf_to_gguf.py to F32, llama-quantize --pure to Q8_0 / Q4_0: every
tensor in the named type), then runs four servers side by side for each comparison:
`pagoda serve --native-kernels off`, the same with `on`, `llama-server -t 1` and `-t 2` (f32 KV
cache, -np = the highest concurrency). All get the same closed-loop load (vs_llamacpp.py's
client: token-id prompts of --prompt-len, --output-len tokens with ignore_eos, greedy) at each
concurrency, the order of the servers reversed every other round; results are medians over
rounds of output tok/s and median ITL, with the load average before each run.

Configurations:
- 10m: the ~10M benchmark Llama (common.MODEL_SHAPE), fp32: pagoda fp32 vs the F32 GGUF.
- 100m: the hidden 768 x 12-layer Llama (common.MODEL_SHAPE_100M), fp32, likewise.
- qwen0.5b: a Qwen2.5-0.5B-shaped random Qwen2 (hidden 896, 24 layers, 14 heads / 2 KV heads,
  intermediate 4864, q/k/v bias, tied embeddings; vocabulary 32768, a BPE trained on the
  standard library, instead of Qwen's 151936). Two comparisons: pagoda `--quantization int8` vs
  the Q8_0 GGUF, and pagoda serving the Q4_0 GGUF itself vs llama-server on the same file; plus
  perplexity on held-out standard-library text (`pagoda eval perplexity`, window 512 / stride
  256, and llama.cpp's `llama-perplexity -c 512`), each tool's delta against its own fp32 run.

- moe: benchmarks/moe.py's Qwen3-MoE (128 experts, top-8, hidden 256, 4 layers), fp32: pagoda
  vs the F32 GGUF.

Where both sides serve the same fp32 weights their greedy outputs must agree up to near ties
(vs_llamacpp.py's check) before timing; for the MoE model they are compared and reported only
(a router's near ties between its 8th and 9th expert break apart under two summation orders).
The floor of each comparison is the bytes of weights one token reads in llama.cpp's file (every
tensor but the embedding table, read whole when it is also the LM head) over the read bandwidth
measured in the same run (torch `sum` over 256 MB, one and two threads); each side's fraction of
it is floor / its c=1 median ITL.

    .venv/bin/python benchmarks/native_vs_llamacpp.py --llama-cpp /path/to/llama.cpp --rounds 3
    .venv/bin/python benchmarks/native_vs_llamacpp.py --llama-cpp /path/to/llama.cpp --quick --out /tmp/nvl

--llama-cpp is a built llama.cpp tree: convert_hf_to_gguf.py at its root, llama-server,
llama-quantize and llama-perplexity under build/bin.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MODEL_SHAPE,
    MODEL_SHAPE_100M,
    PYTHON,
    RESULTS,
    build_bench_model,
    git_commit,
    pagoda_server_process,
    write_summary,
)
from native_kernels import read_bandwidth  # noqa: E402
from vs_llamacpp import NEAR_TIE, check_greedy_agreement, convert_to_gguf, llama_server, run_load, token_prompts, warm  # noqa: E402

NAME = "native_vs_llamacpp"
QWEN_VOCAB_SIZE = 32768
QWEN_SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
PERPLEXITY_WINDOW, PERPLEXITY_STRIDE = 512, 256
# The issue's targets, as (concurrency, metric, pagoda / llama-server at least) on output tok/s,
# or for "itl_p50_ms" llama-server / pagoda at least (pagoda's ITL at most llama-server's).
FP32_TARGETS = ((1, "itl_p50_ms", 1.0), (16, "output_tok_per_s", 1.2), (64, "output_tok_per_s", 1.2))
QUANTIZED_TARGETS = ((1, "output_tok_per_s", 1.0), (16, "output_tok_per_s", 1.2))
# MoE: the goal of at least llama-server's output tok/s at concurrency 16, c=1 reported.
MOE_TARGETS = ((16, "output_tok_per_s", 1.0),)


@dataclass(frozen=True)
class Comparison:
    label: str
    gguf_type: str  # the file llama-server serves: F32, Q8_0 or Q4_0
    pagoda_serves_gguf: bool  # pagoda loads that same file (else the safetensors model)
    pagoda_flags: tuple[str, ...]
    targets: tuple[tuple[int, str, float], ...]

    # A router choosing 8 of 128 experts has near ties that two summation orders break apart,
    # changing the experts a token takes: MoE outputs are compared and reported, not required equal.
    outputs_must_agree: bool = True

    @property
    def same_weights(self) -> bool:
        """Both sides compute with the same float32 weights: greedy outputs are compared."""
        return self.gguf_type == "F32"


@dataclass(frozen=True)
class Configuration:
    name: str
    description: str
    comparisons: tuple[Comparison, ...]
    shape: dict[str, int]
    architecture: str = "llama"  # "llama": common.build_bench_model; "qwen2": build_qwen_shaped_model;
    # "qwen3_moe": benchmarks/moe.py's model
    perplexity: bool = False


FP32 = Comparison("fp32", "F32", False, (), FP32_TARGETS)
CONFIGURATIONS = {
    "10m": Configuration("10m", "~10M Llama (common.MODEL_SHAPE), vocab 4096, fp32", (FP32,), MODEL_SHAPE),
    "100m": Configuration(
        "100m", "Llama hidden 768 x 12 layers (common.MODEL_SHAPE_100M), vocab 4096, fp32", (FP32,), MODEL_SHAPE_100M
    ),
    "qwen0.5b": Configuration(
        "qwen0.5b",
        f"Qwen2.5-0.5B-shaped Qwen2 (hidden 896, 24 layers, GQA 14/2, intermediate 4864, qkv bias, tied "
        f"embeddings), vocab {QWEN_VOCAB_SIZE}",
        (
            Comparison("int8 vs Q8_0", "Q8_0", False, ("--quantization", "int8"), QUANTIZED_TARGETS),
            Comparison("Q4_0 GGUF", "Q4_0", True, (), QUANTIZED_TARGETS),
        ),
        QWEN_SHAPE,
        architecture="qwen2",
        perplexity=True,
    ),
    "moe": Configuration(
        "moe",
        "Qwen3-30B-A3B's ratios scaled down (benchmarks/moe.py: 128 experts, top-8, hidden 256, "
        "expert intermediate 96, 4 layers), fp32",
        (Comparison("fp32 MoE", "F32", False, (), MOE_TARGETS, outputs_must_agree=False),),
        {},
        architecture="qwen3_moe",
    ),
}


def run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


# ---- models and files --------------------------------------------------------------------------


def build_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` trained on the ASCII lines of the whole standard library
    (the benchmark tokenizer's recipe on more text, so every id is a real token)."""
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))

    def ascii_lines():
        for path in files:
            for line in path.read_text(errors="ignore").splitlines():
                if line.isascii():
                    yield line + "\n"

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(ascii_lines(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the standard library gave a vocabulary of {tokenizer.get_vocab_size()}, not {vocab_size}")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    ).save_pretrained(directory)


def build_qwen_shaped_model(directory: Path, seed: int = 0) -> Path:
    """Tokenizer + random Qwen2 of QWEN_SHAPE in float32 (weights N(0, 0.08) as common's models);
    reused if already built."""
    import torch
    import transformers

    if (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory, QWEN_VOCAB_SIZE)
    config = transformers.Qwen2Config(
        vocab_size=QWEN_VOCAB_SIZE,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        **QWEN_SHAPE,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def build_model(configuration: Configuration, root: Path) -> Path:
    directory = root / configuration.name
    if configuration.architecture == "qwen2":
        return build_qwen_shaped_model(directory)
    if configuration.architecture == "qwen3_moe":
        from moe import models

        return models(directory)[0]
    return build_bench_model(directory, shape=configuration.shape)


def make_gguf(model_dir: Path, llama_cpp: Path, gguf_type: str) -> Path:
    """The model as a GGUF of `gguf_type` next to it: F32 by convert_hf_to_gguf.py, the others
    quantized from it with llama-quantize --pure (reused when newer than the F32 file)."""
    f32 = convert_to_gguf(model_dir, llama_cpp)
    if gguf_type == "F32":
        return f32
    out = model_dir.parent / f"{model_dir.name}.{gguf_type.lower()}.gguf"
    if not out.exists() or out.stat().st_mtime < f32.stat().st_mtime:
        run([str(llama_cpp / "build" / "bin" / "llama-quantize"), "--pure", str(f32), str(out), gguf_type])
    return out


def gguf_bytes_per_token(gguf: Path, llama_cpp: Path) -> int:
    """Bytes of the tensors one decode token reads: all of them but the embedding table, of which
    it reads one row, unless the table is also the LM head (no `output.weight`); of a MoE layer's
    stacked experts (`*_exps`), the share of the experts one token takes (used / count)."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    fields = {
        name: field.contents()
        for name, field in reader.fields.items()
        if name.endswith((".expert_count", ".expert_used_count"))
    }
    used = next((v for k, v in fields.items() if k.endswith("used_count")), 1)
    count = next((v for k, v in fields.items() if k.endswith(".expert_count")), 1)
    tensors = {t.name: int(t.n_bytes) * (used / count if "_exps." in t.name else 1) for t in reader.tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return int(sum(tensors.values()))


def version_line(binary: Path) -> str:
    output = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stderr
    return next((line for line in output.splitlines() if line.startswith("version")), output.strip()[:200])


# ---- speed -------------------------------------------------------------------------------------


def kv_cache_memory(model_dir: Path, tokens: int) -> str:
    """A KV pool that holds `tokens` float32 tokens with room to spare (pagoda's default may not)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    return f"{max(256, int(per_token * tokens * 1.25 / 2**20) + 64)}MiB"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(runs)}
    for key in ("output_tok_per_s", "itl_p50_ms", "ttft_p50_ms", "cores_busy"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def llama_best(medians: dict[str, dict[int, dict[str, Any]]], c: int) -> dict[str, Any]:
    """llama-server's better thread count at concurrency c, per metric."""
    llama = [name for name in medians if name.startswith("llama-server")]
    fastest = max(llama, key=lambda name: medians[name][c]["output_tok_per_s"]["median"])
    quickest = min(llama, key=lambda name: medians[name][c]["itl_p50_ms"]["median"])
    return {
        "output_tok_per_s": medians[fastest][c]["output_tok_per_s"]["median"],
        "output_tok_per_s_by": fastest,
        "itl_p50_ms": medians[quickest][c]["itl_p50_ms"]["median"],
        "itl_p50_ms_by": quickest,
    }


def judge(comparison: Comparison, medians: dict[str, dict[int, dict[str, Any]]], levels: list[int]) -> dict[str, Any]:
    """pagoda (off and on) over llama-server's better thread count, and the issue's targets."""
    ratios = {}
    for c in levels:
        best = llama_best(medians, c)
        ratios[c] = {
            "llama_server_best": best,
            **{
                name: {
                    "output_tok_per_s_ratio": medians[name][c]["output_tok_per_s"]["median"] / best["output_tok_per_s"],
                    "itl_p50_ratio": medians[name][c]["itl_p50_ms"]["median"] / best["itl_p50_ms"],
                }
                for name in ("pagoda native off", "pagoda native on")
            },
        }
    targets = []
    for c, metric, at_least in comparison.targets:
        if c not in ratios:
            continue
        entry = ratios[c]["pagoda native on"]
        achieved = 1 / entry["itl_p50_ratio"] if metric == "itl_p50_ms" else entry["output_tok_per_s_ratio"]
        wording = (
            "pagoda native on median ITL <= llama-server's"
            if metric == "itl_p50_ms"
            else f"pagoda native on output tok/s >= {at_least}x llama-server's"
        )
        targets.append({"concurrency": c, "target": wording, "achieved_ratio": achieved, "met": achieved >= at_least})
    return {"pagoda_over_llama_server_best": ratios, "targets": targets}


def run_comparison(
    comparison: Comparison, model_dir: Path, args: argparse.Namespace, levels: list[int], log_dir: Path
) -> dict[str, Any]:
    from transformers import AutoConfig

    llama_cpp = Path(args.llama_cpp)
    binary = llama_cpp / "build" / "bin" / "llama-server"
    gguf = make_gguf(model_dir, llama_cpp, comparison.gguf_type)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    context = args.prompt_len + max(args.output_len, args.check_tokens) + 16
    slots = max(levels)
    pagoda_model = gguf if comparison.pagoda_serves_gguf else model_dir
    pagoda_flags = [
        "--max-num-seqs",
        str(slots),
        "--max-model-len",
        str(context),
        "--kv-cache-memory",
        kv_cache_memory(model_dir, slots * context),
        *comparison.pagoda_flags,
        *(["--tokenizer", str(model_dir)] if comparison.pagoda_serves_gguf else []),
        *args.pagoda_flag,
    ]
    commands = {}
    with contextlib.ExitStack() as stack:
        servers: dict[str, tuple[str, int]] = {}
        for mode in ("off", "on"):
            flags = [*pagoda_flags, "--native-kernels", mode]
            log = log_dir / f"pagoda-{mode}.log"
            url, process = stack.enter_context(pagoda_server_process(pagoda_model, flags, log))
            servers[f"pagoda native {mode}"] = (url, process.pid)
            commands[f"pagoda native {mode}"] = f"pagoda serve --model {pagoda_model} " + " ".join(flags)
        for threads in (1, 2):
            servers[f"llama-server -t {threads}"] = stack.enter_context(
                llama_server(binary, gguf, slots, context, threads, log_dir / f"llama-server-t{threads}.log")
            )
            commands[f"llama-server -t {threads}"] = (
                f"llama-server -m {gguf} -np {slots} -c {slots * context} -t {threads} -tb {threads} -ctk f32 -ctv f32"
            )
        print(f"  servers up: {', '.join(servers)}", flush=True)

        agreement: dict[str, Any] = {}
        check = token_prompts(args.check_prompts, args.prompt_len, vocab_size, seed=1)
        if comparison.same_weights:
            for mode in ("off", "on"):
                result = check_greedy_agreement(
                    servers[f"pagoda native {mode}"][0], servers["llama-server -t 2"][0], check, args.check_tokens
                )
                agreement[f"pagoda native {mode} vs llama-server"] = result
                print(
                    f"  greedy, pagoda native {mode} vs llama-server: {result['identical']}/{len(check)} identical, "
                    f"{len(result['near_tie_divergences'])} near ties (< {NEAR_TIE}), "
                    f"{len(result['disagreements'])} disagreements",
                    flush=True,
                )
                if result["disagreements"] and comparison.outputs_must_agree:
                    raise RuntimeError(
                        f"greedy outputs of pagoda native {mode} and llama-server disagree on the same "
                        f"weights: {result['disagreements'][0]}"
                    )
        else:
            agreement["note"] = "different quantizations (or llama.cpp's Q8_0 activations): outputs not compared"
        for base, _ in servers.values():
            warm(base, token_prompts(2, args.prompt_len, vocab_size, seed=2))

        runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {c: [] for c in levels} for name in servers}
        for round_index in range(args.rounds):
            order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
            for c in levels:
                prompts = token_prompts(
                    max(2, args.requests_per_client * c), args.prompt_len, vocab_size, seed=1000 * round_index + c
                )
                for name in order:
                    base, pid = servers[name]
                    load = os.getloadavg()[0]
                    result = run_load(base, pid, prompts, args.output_len, c)
                    result["load_average_1m_before"] = load
                    runs[name][c].append(result)
                    print(
                        f"  round {round_index + 1} c={c:<3} {name:<18} {result['output_tok_per_s']:8.1f} tok/s  "
                        f"ITL p50 {result['itl_p50_ms']:7.2f} ms  cores {result['cores_busy'] or 0:.2f}  "
                        f"load {load:.1f}",
                        flush=True,
                    )

    medians = {name: {c: summarize(by_c[c]) for c in levels} for name, by_c in runs.items()}
    return {
        "label": comparison.label,
        "gguf": gguf.name,
        "gguf_type": comparison.gguf_type,
        "pagoda_weights": gguf.name if comparison.pagoda_serves_gguf else model_dir.name,
        "commands": commands,
        "greedy_agreement": agreement,
        "median_over_rounds": medians,
        **judge(comparison, medians, levels),
        "runs": runs,
        "bytes_per_token": gguf_bytes_per_token(gguf, llama_cpp),
    }


def add_floor(result: dict[str, Any], bandwidth: dict[int, float]) -> None:
    """The floor (bytes per token / read bandwidth) and each side's fraction of it at c=1."""
    floor = {f"{threads}_thread": result["bytes_per_token"] / bw * 1e3 for threads, bw in bandwidth.items()}
    result["floor_ms"] = floor
    medians = result["median_over_rounds"]
    if all(1 in by_c for by_c in medians.values()):
        result["fraction_of_floor_at_c1"] = {
            name: {key: ms / by_c[1]["itl_p50_ms"]["median"] for key, ms in floor.items()}
            for name, by_c in medians.items()
        }


# ---- quality -----------------------------------------------------------------------------------


def heldout_text(work: Path) -> Path:
    """The bundled model's held-out standard-library files, as one text file."""
    from quantization import heldout_texts

    text = work / "heldout.txt"
    text.write_text("\n".join(p.read_text(errors="replace") for p in heldout_texts(8)))
    return text


def pagoda_perplexity(model: Path, tokenizer: Path, text: Path, max_tokens: int, flags: list[str]) -> dict[str, Any]:
    command = [
        PYTHON,
        "-m",
        "pagoda.cli",
        "eval",
        "perplexity",
        "--model",
        str(model),
        "--tokenizer",
        str(tokenizer),
        "--text",
        str(text),
        "--window",
        str(PERPLEXITY_WINDOW),
        "--stride",
        str(PERPLEXITY_STRIDE),
        "--max-tokens",
        str(max_tokens),
        "--no-baseline",
        "--json",
        *flags,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    only = next(iter(report["runs"].values()))
    return {"perplexity": only["perplexity"], "scored_tokens": report["num_scored_tokens"], "flags": flags}


def llama_perplexity(llama_cpp: Path, gguf: Path, text: Path, chunks: int) -> dict[str, Any]:
    # llama.cpp's asynchronous logger sometimes exits before its last lines: run until they show.
    for _ in range(8):
        output = run(
            [
                str(llama_cpp / "build" / "bin" / "llama-perplexity"),
                "-m",
                str(gguf),
                "-f",
                str(text),
                "-c",
                str(PERPLEXITY_WINDOW),
                "--chunks",
                str(chunks),
                "-t",
                "2",
                "-b",
                str(PERPLEXITY_WINDOW),
            ]
        )
        final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", output)
        if final:
            return {
                "perplexity": float(final.group(1)),
                "plus_minus": float(final.group(2)),
                "scored_tokens": chunks * PERPLEXITY_WINDOW // 2,
            }
    raise RuntimeError(f"llama-perplexity printed no final estimate for {gguf}")


def measure_perplexity(model_dir: Path, llama_cpp: Path, work: Path, chunks: int) -> dict[str, Any]:
    """Each tool on the same text, fp32 and both quantizations; deltas against its own fp32."""
    text = heldout_text(work)
    ggufs = {name: make_gguf(model_dir, llama_cpp, name) for name in ("F32", "Q8_0", "Q4_0")}
    llama = {name: llama_perplexity(llama_cpp, path, text, chunks) for name, path in ggufs.items()}
    max_tokens = chunks * PERPLEXITY_WINDOW
    pagoda = {
        "fp32": pagoda_perplexity(model_dir, model_dir, text, max_tokens, []),
        "int8": pagoda_perplexity(model_dir, model_dir, text, max_tokens, ["--quantization", "int8"]),
        "Q4_0 GGUF": pagoda_perplexity(ggufs["Q4_0"], model_dir, text, max_tokens, []),
    }
    for results, base in ((llama, "F32"), (pagoda, "fp32")):
        for entry in results.values():
            entry["delta_percent"] = (entry["perplexity"] / results[base]["perplexity"] - 1) * 100
    for tool, results in (("llama.cpp", llama), ("pagoda", pagoda)):
        print(
            "  "
            + tool
            + ": "
            + ", ".join(
                f"{name} {entry['perplexity']:.2f} ({entry['delta_percent']:+.2f}%)" for name, entry in results.items()
            ),
            flush=True,
        )
    return {
        "text": f"{text.name}: the bundled model's first 8 held-out standard-library files",
        "pagoda": {"window": PERPLEXITY_WINDOW, "stride": PERPLEXITY_STRIDE, "runs": pagoda},
        "llama_perplexity": {
            "context": PERPLEXITY_WINDOW,
            "chunks": chunks,
            "scores": "the second half of each chunk",
            "runs": llama,
        },
        "note": "absolute values differ between the tools (different windows); compare each tool's deltas",
    }


# ---- report ------------------------------------------------------------------------------------


def table(results: dict[str, Any], levels: list[int]) -> str:
    lines = []
    for name, configuration in results.items():
        lines.append(f"{name}: {configuration['description']}")
        for comparison in configuration["comparisons"]:
            floor = comparison["floor_ms"]
            lines.append(
                f"  {comparison['label']} ({comparison['gguf']}; floor {floor['2_thread']:.2f} ms/token at "
                f"2 threads, {floor['1_thread']:.2f} ms at 1; {comparison['bytes_per_token'] / 1e6:.1f} MB "
                f"per token)"
            )
            medians = comparison["median_over_rounds"]
            for c in levels:
                cells = [
                    f"{target} {medians[target][c]['output_tok_per_s']['median']:7.1f} tok/s "
                    f"ITL {medians[target][c]['itl_p50_ms']['median']:6.2f} ms"
                    for target in medians
                ]
                lines.append(f"    c={c:<3} " + " | ".join(cells))
            for target in comparison["targets"]:
                lines.append(
                    f"    target c={target['concurrency']}: {target['target']}: "
                    f"{target['achieved_ratio']:.2f}x {'met' if target['met'] else 'NOT met'}"
                )
            fractions = comparison.get("fraction_of_floor_at_c1")
            if fractions:
                lines.append(
                    "    fraction of the 2-thread floor at c=1: "
                    + ", ".join(f"{target} {value['2_thread']:.0%}" for target, value in fractions.items())
                )
        quality = configuration.get("perplexity")
        if quality:
            for tool, key in (("pagoda", "pagoda"), ("llama.cpp", "llama_perplexity")):
                lines.append(
                    f"  perplexity {tool}: "
                    + ", ".join(
                        f"{label} {entry['perplexity']:.2f} ({entry['delta_percent']:+.2f}%)"
                        for label, entry in quality[key]["runs"].items()
                    )
                )
    return "\n".join(lines)


def measure_bandwidth(rounds: int) -> dict[int, float]:
    """Read bandwidth (bytes/s) with one and with two torch threads."""
    import torch

    bandwidth = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        bandwidth[threads] = read_bandwidth(rounds)
    torch.set_num_threads(1)
    print(
        "read bandwidth: " + ", ".join(f"{t} thread(s) {bw / 1e9:.1f} GB/s" for t, bw in bandwidth.items()), flush=True
    )
    return bandwidth


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--llama-cpp", default=os.environ.get("LLAMA_CPP_DIR"), help="built llama.cpp tree (default: $LLAMA_CPP_DIR)"
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGURATIONS), help=f"comma-separated, from {', '.join(CONFIGURATIONS)}"
    )
    parser.add_argument(
        "--model-root", default="/tmp/pagoda-bench-models", help="where models and their GGUFs are built (reused)"
    )
    parser.add_argument("--out", default=str(RESULTS / NAME), help="results directory")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrency levels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--requests-per-client", type=int, default=2, help="requests per run = max(2, this x concurrency)"
    )
    parser.add_argument("--check-prompts", type=int, default=4, help="token-id prompts whose greedy outputs must agree")
    parser.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--perplexity-chunks", type=int, default=16, help="512-token chunks of text scored")
    parser.add_argument("--bandwidth-rounds", type=int, default=15)
    parser.add_argument(
        "--pagoda-flag",
        action="append",
        default=[],
        help="extra `pagoda serve` flag for both pagoda servers (repeatable)",
    )
    parser.add_argument(
        "--comparisons",
        default="",
        help="comma-separated comparison labels to run (default: every one of each configuration), e.g. 'Q4_0 GGUF'",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="dry run: one round, one request per client, 2 check prompts, 2 perplexity chunks",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.requests_per_client, args.check_prompts, args.perplexity_chunks = 1, 1, 2, 2
        args.check_tokens, args.bandwidth_rounds = 16, 5
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        parser.error(f"unknown configuration {', '.join(unknown)}; choose from {', '.join(CONFIGURATIONS)}")
    llama_cpp = Path(args.llama_cpp) if args.llama_cpp else None
    needed = ["convert_hf_to_gguf.py", *(f"build/bin/llama-{tool}" for tool in ("server", "quantize", "perplexity"))]
    missing = [n for n in needed if llama_cpp is None or not (llama_cpp / n).is_file()]
    if missing:
        parser.error(f"--llama-cpp must be a built llama.cpp tree; missing: {', '.join(missing)}")
    if importlib.util.find_spec("sentencepiece") is None:
        parser.error("llama.cpp's convert_hf_to_gguf.py imports sentencepiece: pip install 'pagoda[bench]'")
    levels = sorted({int(c) for c in args.concurrency.split(",")})

    # SIGTERM ends the run like Ctrl-C: the servers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from pagoda import native
    from pagoda.bench.report import machine_info

    try:  # built once here, before the servers that use it start (and could time out building)
        native.load_extension()
    except native.NativeKernelsUnavailable as error:
        print(f"{NAME}: pagoda's native kernels are unavailable, nothing to compare: {error}", file=sys.stderr)
        return 1

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join([".venv/bin/python", f"benchmarks/{NAME}.py", *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "llama_server": version_line(llama_cpp / "build" / "bin" / "llama-server"),
        "native_kernels": native.version_line(),
        "load_average_at_start": os.getloadavg(),
        "quick": args.quick,
        "workload": {
            "prompt": f"{args.prompt_len} random token ids",
            "output": args.output_len,
            "ignore_eos": True,
            "greedy": True,
            "closed_loop": True,
            "requests_per_run": f"max(2, {args.requests_per_client} x concurrency)",
            "rounds": args.rounds,
            "order": "reversed every other round",
        },
    }
    bandwidth = measure_bandwidth(args.bandwidth_rounds)

    results: dict[str, Any] = {}
    for name in names:
        configuration = CONFIGURATIONS[name]
        model_dir = build_model(configuration, Path(args.model_root))
        entry: dict[str, Any] = {
            "description": configuration.description,
            "model_dir": str(model_dir),
            "comparisons": [],
        }
        wanted = {label.strip() for label in args.comparisons.split(",") if label.strip()}
        for comparison in configuration.comparisons:
            if wanted and comparison.label not in wanted:
                continue
            print(f"{name}: {comparison.label}", flush=True)
            log_dir = out / "logs" / name / comparison.gguf_type.lower()
            log_dir.mkdir(parents=True, exist_ok=True)
            result = run_comparison(comparison, model_dir, args, levels, log_dir)
            add_floor(result, bandwidth)
            entry["comparisons"].append(result)
        if configuration.perplexity:
            print(f"{name}: perplexity", flush=True)
            entry["perplexity"] = measure_perplexity(model_dir, llama_cpp, model_dir.parent, args.perplexity_chunks)
        results[name] = entry
        write_summary(out / "summary.json", {**meta, "configurations": results})  # what is done so far

    # Other load only lowers a measured bandwidth: the floor takes the higher of two measurements.
    at_end = measure_bandwidth(args.bandwidth_rounds)
    meta["read_bandwidth_gb_s"] = {
        "at_start": {f"{t}_thread": bw / 1e9 for t, bw in bandwidth.items()},
        "at_end": {f"{t}_thread": bw / 1e9 for t, bw in at_end.items()},
    }
    for name in names:
        for result in results[name]["comparisons"]:
            add_floor(result, {t: max(bw, at_end[t]) for t, bw in bandwidth.items()})
    meta["load_average_at_end"] = os.getloadavg()
    write_summary(out / "summary.json", {**meta, "configurations": results})
    report = table(results, levels)
    (out / "table.txt").write_text(report + "\n")
    print(report)
    print(f"wrote {out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
