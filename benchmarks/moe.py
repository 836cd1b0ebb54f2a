"""Mixture of experts on the CPU: a Qwen3-30B-A3B-shaped MoE scaled down (128 experts, top-8,
expert width 0.375 x hidden as in the original, hidden 256, 4 layers, float32, random weights).

  offline (uniform): 16 prompts of 64 tokens, 32 greedy output tokens each, output tok/s wall,
    pagoda vs transformers' generate (batch 16) on the same weights;
  offline (standard): the project's offline workload (benchmarks/offline_throughput.py: prompt
    and output lengths uniform in [32, 256], all requests at once, transformers in static
    batches of 16 with left padding, only the tokens asked for counted) on the same MoE weights;
  decode step: (time for 33 output tokens - time for 1) / 32 at batch 1 and 16, the MoE model vs
    a dense model with the same active parameters (intermediate = 8 x the expert width);
  block: one MoE block's forward at 1, 16 and 256 tokens: pagoda's loop over the hit experts,
    its grouped products (torch._grouped_mm), its native grouped kernel and the native fused-MoE
    op (one op for the block's experts), vs transformers' own
    block (Qwen3MoeSparseMoeBlock with transformers 5's default experts implementation, which is
    also torch's grouped_mm) on the same weights;
  parallel: the offline run with tensor_parallel_size 2, experts split (TP=2) vs placed whole
    (EP=2), one thread per rank.

pagoda runs each of these as configured by default, with `--native-kernels on` (pagoda.native;
"native" in the names below), and the decode steps also with `--quantization int8` on the
native kernels ("int8_native"), the dense model likewise; the MoE decode steps on the native
kernels take the fused-MoE op, and "_grouped" names the same engines with the op turned off (the
native grouped products instead). Every configuration is
measured in alternating rounds and medians are reported; the machine is shared, so compare
ratios within one run.

    .venv/bin/python benchmarks/moe.py --rounds 5 --out benchmarks/results/moe/speed.json

On a loaded machine write to benchmarks/results/moe/speed_dev.json instead (fewer standard requests
with --standard-requests N, --no-parallel to skip EP/TP).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pagoda.engine.threads import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch loads

import torch  # noqa: E402

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.kernels import moe as moe_module  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
from model_factory import build_model  # noqa: E402
from offline_throughput import make_workload, run_transformers  # noqa: E402

SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
)
MOE = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=96, intermediate_size=768, norm_topk_prob=True)
BATCH, PROMPT, OUTPUT = 16, 64, 32
THREADS = 2


def models(root: Path) -> tuple[Path, Path]:
    moe = root / "moe"
    dense = root / "dense"
    if not (moe / "model.safetensors").exists():
        build_model(moe, "qwen3_moe", **SHAPE, **MOE)
    if not (dense / "model.safetensors").exists():  # the same active parameters per token
        build_model(
            dense, "qwen3", **SHAPE, intermediate_size=MOE["num_experts_per_tok"] * MOE["moe_intermediate_size"]
        )
    return moe, dense


def prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(5, vocab_size, (PROMPT,), generator=generator).tolist() for _ in range(BATCH)]


def timed_generate(llm: LLM, batch: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(batch, params)
    return time.perf_counter() - started


def hf_generate_seconds(model, batch: list[list[int]]) -> float:
    ids = torch.tensor(batch)
    started = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=OUTPUT,
            min_new_tokens=OUTPUT,
            pad_token_id=0,
        )
    return time.perf_counter() - started


def block_seconds(block, hidden: torch.Tensor, repeats: int) -> float:
    with torch.no_grad():
        block(hidden)
        started = time.perf_counter()
        for _ in range(repeats):
            block(hidden)
    return (time.perf_counter() - started) / repeats


def pagoda_block_seconds(block, hidden: torch.Tensor, repeats: int, path: str, native) -> float:
    """One of the experts' execution paths: "loop", "grouped" (torch._grouped_mm), "native" (the
    native grouped products) or "fused" (the native fused-MoE op)."""
    share, fused_max = moe_module.GROUPED_MIN_ACTIVE_SHARE, moe_module.FUSED_MAX_TOKENS
    moe_module.GROUPED_MIN_ACTIVE_SHARE = {"loop": 0, "grouped": block.experts.num_experts}.get(path, share)
    moe_module.FUSED_MAX_TOKENS = hidden.shape[0] if path == "fused" else 0
    moe_kernels = block.kernels.moe
    own_native = moe_kernels.native
    moe_kernels.native = native if path in ("native", "fused") else None
    try:
        return block_seconds(block, hidden, repeats)
    finally:
        moe_module.GROUPED_MIN_ACTIVE_SHARE, moe_module.FUSED_MAX_TOKENS = share, fused_max
        moe_kernels.native = own_native


def unfused_decode_step_ms(llm: LLM, batch: list[list[int]]) -> float:
    """The decode step with the fused-MoE op turned off (the native grouped products instead)."""
    fused_max = moe_module.FUSED_MAX_TOKENS
    moe_module.FUSED_MAX_TOKENS = 0
    try:
        return decode_step_ms(llm, batch)
    finally:
        moe_module.FUSED_MAX_TOKENS = fused_max


def standard_offline_tok_s(llm: LLM, prompts: list[list[int]], output_lens: list[int]) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == sum(output_lens)
    return generated / (time.perf_counter() - started)


def decode_step_ms(llm: LLM, batch: list[list[int]]) -> float:
    full = timed_generate(llm, batch, OUTPUT + 1)
    first = timed_generate(llm, batch, 1)
    return 1000 * (full - first) / OUTPUT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", type=Path, default=Path("/tmp/pagoda-moe-bench"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "moe" / "speed.json")
    parser.add_argument("--no-parallel", action="store_true", help="skip the TP=2 / EP=2 runs")
    parser.add_argument(
        "--standard-requests", type=int, default=256, help="requests in the standard offline workload (0 skips it)"
    )
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    load_at_start = os.getloadavg()
    moe_dir, dense_dir = models(args.models)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    batch = prompts(hf.config.vocab_size)
    standard_prompts, standard_output_lens = make_workload(
        args.standard_requests, 32, 256, hf.config.vocab_size, seed=0
    )
    engines = {
        f"{model}{suffix}": LLM(model=str(path), num_threads=THREADS, native_kernels=mode, quantization=quantization)
        for model, path in (("moe", moe_dir), ("dense", dense_dir))
        for suffix, mode, quantization in (
            ("", "off", "none"),
            ("_native", "on", "none"),
            ("_int8_native", "on", "int8"),
        )
    }
    parallel = (
        {}
        if args.no_parallel
        else {
            name: LLM(model=str(moe_dir), tensor_parallel_size=2, enable_expert_parallel=ep, num_threads=THREADS)
            for name, ep in (("tp2", False), ("ep2", True))
        }
    )
    pagoda_block = engines["moe"].engine.core.runner.model.model.layers[0].mlp
    native = engines["moe_native"].engine.core.kernels.moe.native
    hf_block = hf.model.layers[0].mlp
    samples: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    for round_index in range(args.rounds):
        record("offline_tok_s/pagoda", BATCH * OUTPUT / timed_generate(engines["moe"], batch, OUTPUT))
        record("offline_tok_s/transformers", BATCH * OUTPUT / hf_generate_seconds(hf, batch))
        record("offline_tok_s/pagoda_native", BATCH * OUTPUT / timed_generate(engines["moe_native"], batch, OUTPUT))
        if args.standard_requests:
            for name in ("moe", "moe_native"):
                record(
                    f"offline_standard_tok_s/pagoda{name[3:]}",
                    standard_offline_tok_s(engines[name], standard_prompts, standard_output_lens),
                )
            baseline = run_transformers(moe_dir, standard_prompts, standard_output_lens, THREADS, BATCH)
            record("offline_standard_tok_s/transformers", baseline["output_tok_per_s"])
        for size in (1, BATCH):
            for name, llm in engines.items():
                record(f"decode_step_ms/batch_{size}/{name}", decode_step_ms(llm, batch[:size]))
                if name.startswith("moe") and name.endswith("native"):
                    record(f"decode_step_ms/batch_{size}/{name}_grouped", unfused_decode_step_ms(llm, batch[:size]))
        for tokens in (1, 16, 256):
            hidden = torch.randn(tokens, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(tokens))
            for path in ("loop", "grouped", "native", "fused"):
                record(
                    f"block_ms/{tokens}_tokens/pagoda_{path}",
                    1000 * pagoda_block_seconds(pagoda_block, hidden, 20, path, native),
                )
            record(f"block_ms/{tokens}_tokens/transformers", 1000 * block_seconds(hf_block, hidden.unsqueeze(0), 20))
        for name, llm in parallel.items():
            record(f"offline_tok_s/{name}", BATCH * OUTPUT / timed_generate(llm, batch, OUTPUT))
        print(f"round {round_index + 1}/{args.rounds} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    for llm in parallel.values():
        llm.engine.close()

    medians = {name: statistics.median(values) for name, values in samples.items()}
    ratios = {
        "offline_pagoda_over_transformers": medians["offline_tok_s/pagoda"] / medians["offline_tok_s/transformers"],
        "offline_pagoda_native_over_transformers": medians["offline_tok_s/pagoda_native"]
        / medians["offline_tok_s/transformers"],
    }
    if args.standard_requests:
        for name in ("pagoda", "pagoda_native"):
            ratios[f"offline_standard_{name}_over_transformers"] = (
                medians[f"offline_standard_tok_s/{name}"] / medians["offline_standard_tok_s/transformers"]
            )
    for size in (1, BATCH):
        for suffix in ("", "_native", "_int8_native"):
            ratios[f"decode_step_moe_over_dense/batch_{size}{suffix}"] = (
                medians[f"decode_step_ms/batch_{size}/moe{suffix}"]
                / medians[f"decode_step_ms/batch_{size}/dense{suffix}"]
            )
        for suffix in ("_native", "_int8_native"):
            ratios[f"decode_step_moe_over_dense/batch_{size}{suffix}_grouped"] = (
                medians[f"decode_step_ms/batch_{size}/moe{suffix}_grouped"]
                / medians[f"decode_step_ms/batch_{size}/dense{suffix}"]
            )
    for tokens in (1, 16, 256):
        for path in ("loop", "grouped", "native", "fused"):
            ratios[f"block_{tokens}_transformers_over_{path}"] = (
                medians[f"block_ms/{tokens}_tokens/transformers"] / medians[f"block_ms/{tokens}_tokens/pagoda_{path}"]
            )
    if parallel:
        ratios["offline_ep2_over_tp2"] = medians["offline_tok_s/ep2"] / medians["offline_tok_s/tp2"]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "command": "python benchmarks/moe.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": {"start": list(load_at_start), "end": list(os.getloadavg())},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, {THREADS} threads, "
        f"torch {torch.__version__}, transformers {transformers.__version__}",
        "model": {
            **SHAPE,
            **MOE,
            "architecture": "Qwen3MoeForCausalLM",
            "dtype": "float32",
            "dense_intermediate_size": MOE["num_experts_per_tok"] * MOE["moe_intermediate_size"],
        },
        "workload": {
            "uniform": {"batch": BATCH, "prompt_tokens": PROMPT, "output_tokens": OUTPUT},
            "standard": {
                "requests": args.standard_requests,
                "prompt_tokens": [32, 256],
                "output_tokens": [32, 256],
                "transformers_batch": BATCH,
            },
            "rounds": args.rounds,
        },
        "medians": medians,
        "ratios": ratios,
        "samples": samples,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"medians": medians, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
