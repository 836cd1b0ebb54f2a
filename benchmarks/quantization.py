"""Quantized serving: quality and speed of weight formats and KV cache dtypes, side by side.

1. Perplexity of the bundled pagoda-coder on held-out standard-library files (the engine's
   own prompt logprobs, `pagoda eval perplexity`'s code) for none / int8 / int4 weights and
   auto / int8 / fp8 KV caches.
2. Decode tok/s, single stream and batch 16, of a random ~316M-parameter Llama (hidden 1024
   x 24 layers: its float32 weights, 1.26 GB, do not fit in cache) for none / int8 / int4
   weights x auto / int8 / fp8 KV. Every combination is loaded at once and the rounds are
   interleaved (each round times every combination once); speedups are medians over rounds of
   the ratio to that round's baseline, so load on the shared machine hits both sides alike.
3. KV blocks per GiB per dtype, and the projection matmul kernels alone (why quantized
   layers run bfloat16 activations on CPU).

    .venv/bin/python benchmarks/quantization.py --out benchmarks/results

Decode tok/s = generated tokens after the first / (time of the full run - time of a run
generating one token), so prefill is excluded. CPU timings are only comparable inside one
run (ratios); say how loaded the machine was (`load_average_at_start`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_tokenizer, git_commit  # noqa: E402
from pagoda.config import DEFAULT_MODEL_DIR  # noqa: E402

LARGE_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=2048,
)
WEIGHTS = {
    "none": {},
    "int8": {"quantization": "int8"},
    "int4-g128": {"quantization": "int4", "quantization_group_size": 128},
}
KV_DTYPES = ("auto", "int8", "fp8")


def build_large_model(directory: Path) -> Path:
    import torch
    import transformers

    if (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    vocab = len(transformers.AutoTokenizer.from_pretrained(directory))
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        **LARGE_SHAPE,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def heldout_texts(limit: int) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    listed = (DEFAULT_MODEL_DIR / "heldout_files.txt").read_text().split()
    return [stdlib / name for name in listed if (stdlib / name).is_file()][:limit]


def measure_perplexity(num_files: int, max_tokens: int) -> list[dict]:
    from pagoda.engine.llm import LLM
    from pagoda.eval.perplexity import perplexity, tokenize_documents

    documents = [(str(p), p.read_text(errors="replace")) for p in heldout_texts(num_files)]
    # The bundled model's MLP is 704 wide: int4 groups of 64 or 32 divide it, 128 does not.
    runs = [
        ("none", "auto", {}),
        ("int8", "auto", {"quantization": "int8"}),
        ("int4-g64", "auto", {"quantization": "int4", "quantization_group_size": 64}),
        ("int4-g32", "auto", {"quantization": "int4", "quantization_group_size": 32}),
        (
            "int4-g32-sym",
            "auto",
            {"quantization": "int4", "quantization_group_size": 32, "quantization_zero_point": False},
        ),
        ("none", "int8", {}),
        ("none", "fp8_e4m3", {}),
        ("none", "fp8_e5m2", {}),
        ("none", "fp8", {}),
        ("int8", "int8", {"quantization": "int8"}),
    ]
    results = []
    token_lists = None
    for weights, kv, extra in runs:
        llm = LLM(kv_cache_dtype=kv, kv_cache_memory="256MiB", **extra)
        if token_lists is None:
            token_lists = tokenize_documents(llm, documents, max_tokens)
        start = time.perf_counter()
        result = perplexity(llm, token_lists, window=512, stride=256)
        results.append(
            {
                "weights": weights,
                "kv_cache_dtype": kv,
                "perplexity": result.perplexity,
                "num_scored_tokens": result.num_scored_tokens,
                "seconds": time.perf_counter() - start,
            }
        )
        print(f"perplexity {weights:>12} kv {kv:>8}: {result.perplexity:.4f}", flush=True)
        del llm
        gc.collect()
    base = results[0]["perplexity"]
    for entry in results:
        entry["delta_percent"] = (entry["perplexity"] / base - 1) * 100
    return results


def decode_rate(llm, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    from pagoda.sampling_params import SamplingParams

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    timed(2)  # warm up
    rates = []
    for _ in range(repeats):
        prefill = timed(1)
        full = timed(new_tokens + 1)
        rates.append(len(prompts) * new_tokens / max(full - prefill, 1e-9))
    return statistics.median(rates)


def measure_decode(model_dir: Path, threads: int, repeats: int) -> list[dict]:
    import torch

    from pagoda.engine.llm import LLM

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 4000, (32,), generator=generator).tolist() for _ in range(16)]
    combos = [(w, kv) for w in WEIGHTS for kv in KV_DTYPES]
    engines, load_seconds = {}, {}
    for weights, kv in combos:
        start = time.perf_counter()
        engines[weights, kv] = LLM(
            model=str(model_dir),
            kv_cache_dtype=kv,
            kv_cache_memory="256MiB",
            num_threads=threads,
            max_num_seqs=16,
            **WEIGHTS[weights],
        )
        load_seconds[weights, kv] = time.perf_counter() - start
    single = {combo: [] for combo in combos}
    batch = {combo: [] for combo in combos}
    for round_index in range(repeats):
        for combo in combos:
            single[combo].append(decode_rate(engines[combo], prompts[:1], 32, 1))
            batch[combo].append(decode_rate(engines[combo], prompts, 16, 1))
            print(
                f"round {round_index} decode {combo[0]:>10} kv {combo[1]:>5}: single {single[combo][-1]:6.2f} "
                f"tok/s, batch16 {batch[combo][-1]:7.2f} tok/s",
                flush=True,
            )
    baseline = ("none", "auto")
    results = []
    for combo in combos:
        weights, kv = combo
        results.append(
            {
                "weights": weights,
                "kv_cache_dtype": kv,
                "single_stream_tok_s": statistics.median(single[combo]),
                "batch16_tok_s": statistics.median(batch[combo]),
                "single_stream_rounds": single[combo],
                "batch16_rounds": batch[combo],
                # Per round against that round's baseline, then the median.
                "single_speedup": statistics.median(a / b for a, b in zip(single[combo], single[baseline])),
                "batch16_speedup": statistics.median(a / b for a, b in zip(batch[combo], batch[baseline])),
                "load_seconds": load_seconds[combo],
                "kv_blocks": engines[combo].engine.core.num_blocks,
            }
        )
    return results


def kv_blocks_per_gib() -> dict:
    from pagoda.model.model_config import ModelConfig
    from pagoda.quant.storage_bytes import kv_cache_bytes_per_token

    bundled = ModelConfig.from_dir(DEFAULT_MODEL_DIR)
    shapes = {
        "pagoda-coder (6 layers, 2 kv heads x 64)": (bundled.num_layers, bundled.num_kv_heads, bundled.head_dim),
        "large (24 layers, 16 kv heads x 64)": (24, 16, 64),
    }
    table = {}
    for label, (layers, heads, head_dim) in shapes.items():
        row = {}
        for dtype in ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "fp8"):
            per_token = kv_cache_bytes_per_token(layers, heads, head_dim, dtype, 4)
            row[dtype] = (2**30) // (per_token * 16)
        row["int8_vs_fp32"] = row["int8"] / row["auto"]
        row["fp8_vs_fp32"] = row["fp8"] / row["auto"]
        table[label] = row
    return table


def kernel_microbench(threads: int) -> list[dict]:
    """One 4096x1024 projection (the large model's MLP up/gate half), median of 20 calls; int4 at
    group sizes 32 / 64 / 128 and without the format's casts."""
    import torch
    import torch.nn.functional as F

    from pagoda.model.layers import Linear
    from pagoda.quant.weight_formats import Int4Weight, Int8Weight

    torch.set_num_threads(threads)
    out_features, in_features = 4096, 1024
    weight = torch.randn(out_features, in_features) * 0.02

    def layer(fmt):
        linear = Linear(in_features, out_features, False, torch.float32, torch.device("cpu"), fmt)
        linear.weight.data.copy_(weight)
        linear.finalize("bench")
        return linear

    int8, int4 = layer(Int8Weight()), layer(Int4Weight(group_size=128))
    int4_by_group = {group: layer(Int4Weight(group_size=group)) for group in (32, 64)}
    int8_q = int8.qweight
    int8_fp32_scales = int8.scales.float()
    bf16_weight = weight.to(torch.bfloat16)

    def median_us(fn) -> float:
        fn()
        samples = []
        for _ in range(20):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6

    def timings(m: int) -> dict[str, float]:
        x = torch.randn(m, in_features)
        xb = x.to(torch.bfloat16)
        return {
            "rows": m,
            "fp32_dense_us": median_us(lambda: F.linear(x, weight)),
            "bf16_dense_us": median_us(lambda: F.linear(xb, bf16_weight)),
            "int8_kernel_fp32_act_us": median_us(
                lambda: torch.ops.aten._weight_int8pack_mm(x, int8_q, int8_fp32_scales)
            ),
            "int8_dequant_then_matmul_us": median_us(lambda: F.linear(x, int8_q.float() * int8_fp32_scales[:, None])),
            "int8_format_us": median_us(lambda: int8(x)),
            "int4_format_us": median_us(lambda: int4(x)),
            # The kernel alone on bfloat16 input: what the format adds is its two casts.
            "int4_kernel_bf16_input_us": median_us(
                lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, int4.qweight, 128, int4.scales_and_zeros)
            ),
            **{f"int4_g{group}_format_us": median_us(lambda fmt=fmt: fmt(x)) for group, fmt in int4_by_group.items()},
        }

    rows = []
    for m in (1, 16):
        rows.append(timings(m))
        print("kernels", rows[-1], flush=True)
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    decode = results["decode"]
    labels = [f"{r['weights']}\nkv {r['kv_cache_dtype']}" for r in decode]
    for axis, key, title in (
        (axes[0], "single_stream_tok_s", "single-stream decode tok/s (316M Llama)"),
        (axes[1], "batch16_tok_s", "batch-16 decode tok/s (316M Llama)"),
    ):
        axis.bar(
            range(len(decode)),
            [r[key] for r in decode],
            color=["C0" if r["kv_cache_dtype"] == "auto" else "C1" for r in decode],
        )
        axis.set_xticks(range(len(decode)), labels, fontsize=7)
        axis.set_title(title, fontsize=10)
    ppl = results["perplexity"]
    axes[2].bar(range(len(ppl)), [r["delta_percent"] for r in ppl])
    axes[2].set_xticks(range(len(ppl)), [f"{r['weights']}\nkv {r['kv_cache_dtype']}" for r in ppl], fontsize=7)
    axes[2].set_title("perplexity delta vs full precision, % (pagoda-coder)", fontsize=10)
    axes[2].axhline(0, color="black", linewidth=0.5)
    fig.suptitle("CPU, shared machine: compare bars within this run only", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="directory for quantization.json and .png")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path("/tmp/pagoda-bench-quant-316m"),
        help="where the random large model is built (reused)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved decode rounds")
    parser.add_argument("--ppl-files", type=int, default=8)
    parser.add_argument("--ppl-tokens", type=int, default=8000)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from pagoda.bench.report import machine_info

    results = {
        "command": " ".join(["python", "benchmarks/quantization.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "load_average_at_start": os.getloadavg(),
        "threads": args.threads,
        "large_model": {"shape": LARGE_SHAPE, "weights": "random N(0, 0.02), float32", "params": None},
        "notes": "CPU decode with bfloat16 activations in int8/int4 layers; shared machine, timings noisy",
    }
    results["kv_blocks_per_gib"] = kv_blocks_per_gib()
    results["kernels_4096x1024"] = kernel_microbench(args.threads)
    results["perplexity"] = measure_perplexity(args.ppl_files, args.ppl_tokens)
    model_dir = build_large_model(args.model_dir)
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as reader:
        results["large_model"]["params"] = sum(_numel(reader.get_slice(n).get_shape()) for n in reader.keys())
    results["decode"] = measure_decode(model_dir, args.threads, args.repeats)
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quantization.json").write_text(text + "\n")
        plot(results, args.out / "quantization.png")
    else:
        print(text)


def _numel(shape: list[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


if __name__ == "__main__":
    main()
