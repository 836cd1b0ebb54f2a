"""Multi-head latent attention: a decode step with the absorbed projections against the expanded
form, at 2k context on CPU; and how many full-context sequences a fixed KV pool holds with
latents against equivalent GQA models (from `pagoda plan`'s formula).

Decode: a random DeepSeek-V3-shaped model (float32, 4 dense layers, hidden 512, 16 heads,
kv_lora_rank 256, rope 32, nope 64, v 64, plain q_proj), 4 requests with 2048-token prompts
decoding together, one engine; the torch backend's `absorb_latent_decode` switched between
interleaved rounds of decode steps; medians. The same cache of latents serves both forms. The op
alone (the attention of one layer, the same tensors) is timed the same way.

Capacity: DeepSeek-V3's own shape (transformers' DeepseekV3Config defaults: 61 layers, 128
heads, latent 512 + rope 64) at a fixed pool, against the same model with GQA K/V of head_dim
128 (16 or 8 KV heads) and with the per-head K (192) and V (128) that expanding the latents
gives (what a cache of expanded K/V would hold).

    .venv/bin/python benchmarks/mla_decode.py --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pagoda  # noqa: E402,F401  (first: idle OpenMP threads sleep, as in `pagoda serve`)
from pagoda.engine.engine_request import EngineRequest  # noqa: E402

# isort: split
from common import REPO, RESULTS, build_tokenizer, write_summary  # noqa: E402

NAME = "mla_decode"
CONTEXT = 2048
NUM_REQUESTS = 4
SHAPE = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    first_k_dense_replace=4,
    q_lora_rank=None,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    max_position_embeddings=4096,
)
POOL_BYTES = 64 * 2**30  # the fixed pool of the capacity comparison
POOL_CONTEXT = 32768


def build_model(directory: Path) -> Path:
    import torch
    import transformers

    if (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    vocab = len(transformers.AutoTokenizer.from_pretrained(directory))
    config = transformers.DeepseekV3Config(
        vocab_size=vocab, eos_token_id=0, pad_token_id=0, bos_token_id=None, tie_word_embeddings=False, **SHAPE
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def time_engine_steps(model_dir: Path, rounds: int, steps: int) -> dict[str, list[float]]:
    """Decode step times (ms) per round, absorbed and expanded interleaved."""
    from pagoda.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), max_model_len=4096, num_kv_blocks=1200, max_num_batched_tokens=2048, block_size=16
        )
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=rounds * steps * 2 + 8, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        engine.add_request(EngineRequest(f"r{i}", [rng.randrange(5, 4000) for _ in range(CONTEXT)], params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for s in engine.core.requests.values() for r in s):
        engine.step()
    backend = engine.core.runner.backend
    for _ in range(2):
        engine.step()
    step_ms: dict[str, list[float]] = {"absorbed": [], "expanded": []}
    for round_index in range(rounds):
        order = ["absorbed", "expanded"] if round_index % 2 == 0 else ["expanded", "absorbed"]
        for name in order:
            backend.absorb_latent_decode = name == "absorbed"
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            step_ms[name].append((time.perf_counter() - started) / steps * 1e3)
    return step_ms


def time_op(rounds: int, repeats: int) -> dict[str, list[float]]:
    """One layer's decode attention (ms) for NUM_REQUESTS queries over CONTEXT latents."""
    import torch

    from pagoda.kernels.attention.latent import LatentProjection, absorbed_attention, expanded_decode

    g = torch.Generator().manual_seed(0)
    heads, nope, rope, v, latent = 16, 64, 32, 64, 256
    projection = LatentProjection(torch.randn(heads * (nope + v), latent, generator=g) * 0.05, heads, nope, v)
    args = (
        torch.randn(NUM_REQUESTS, heads, nope, generator=g),
        torch.randn(NUM_REQUESTS, heads, rope, generator=g),
        torch.randn(NUM_REQUESTS, CONTEXT, latent, generator=g),
        torch.randn(NUM_REQUESTS, CONTEXT, rope, generator=g),
        projection,
        (nope + rope) ** -0.5,
        torch.ones(NUM_REQUESTS, CONTEXT, dtype=torch.bool),
    )
    forms = {"absorbed": absorbed_attention, "expanded": expanded_decode}
    op_ms: dict[str, list[float]] = {name: [] for name in forms}
    for round_index in range(rounds):
        for name in list(forms) if round_index % 2 == 0 else list(reversed(forms)):
            started = time.perf_counter()
            for _ in range(repeats):
                forms[name](*args)
            op_ms[name].append((time.perf_counter() - started) / repeats * 1e3)
    return op_ms


def capacity() -> dict[str, Any]:
    """Full-context sequences a fixed pool holds: DeepSeek-V3's latents against GQA / expanded K/V."""
    import transformers

    from pagoda.core.capacity import sequences_that_fit
    from pagoda.model.model_config import ModelConfig
    from pagoda.plan import ModelShape, kv_bytes_per_token

    config = transformers.DeepseekV3Config().to_dict()
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    shape = ModelShape.from_model_config(ModelConfig.from_dict(config))
    block_size = 16
    variants = {
        "MLA latent 512 + rope 64 (DeepSeek-V3)": shape,
        "GQA 16 KV heads x 128 (128 q heads / 8)": dataclasses.replace(
            shape, kv_latent_dims=None, num_kv_heads=16, head_dim=128
        ),
        "GQA 8 KV heads x 128": dataclasses.replace(shape, kv_latent_dims=None, num_kv_heads=8, head_dim=128),
    }
    rows: dict[str, Any] = {}
    for name, variant in variants.items():
        per_token = kv_bytes_per_token(variant, "bf16")
        blocks = POOL_BYTES // (per_token * block_size)
        rows[name] = {
            "kv_bytes_per_token": per_token,
            "sequences_that_fit": sequences_that_fit(blocks, block_size, POOL_CONTEXT),
        }
    # Expanded per-head K (nope + rope = 192) and V (128) for all 128 heads: 2 bytes each, 61 layers.
    expanded = 61 * 128 * (192 + 128) * 2
    rows["expanded K/V (128 heads x (192 + 128))"] = {
        "kv_bytes_per_token": expanded,
        "sequences_that_fit": sequences_that_fit(POOL_BYTES // (expanded * block_size), block_size, POOL_CONTEXT),
    }
    latent = rows["MLA latent 512 + rope 64 (DeepSeek-V3)"]
    for row in rows.values():
        # None where not one full-context sequence fits the pool
        fit = row["sequences_that_fit"]
        row["mla_sequences_ratio"] = round(latent["sequences_that_fit"] / fit, 2) if fit else None
        row["mla_bytes_ratio"] = round(row["kv_bytes_per_token"] / latent["kv_bytes_per_token"], 2)
    return {"pool": f"{POOL_BYTES // 2**30} GiB bf16, context {POOL_CONTEXT}, block {block_size}", "models": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-mla-model"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="decode steps timed per round and form")
    parser.add_argument("--out", default=str(RESULTS / f"{NAME}.json"))
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    load_at_start = os.getloadavg()
    model_dir = build_model(Path(args.model_dir))
    step_ms = time_engine_steps(model_dir, args.rounds, args.steps)
    op_ms = time_op(args.rounds, args.steps)
    step_medians = {name: round(statistics.median(v), 2) for name, v in step_ms.items()}
    op_medians = {name: round(statistics.median(v), 3) for name, v in op_ms.items()}
    summary = {
        "command": " ".join([".venv/bin/python", "benchmarks/mla_decode.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "workload": (
            f"{NUM_REQUESTS} decodes at {CONTEXT}-token context, DeepSeek-V3-shaped random model fp32 "
            f"({', '.join(f'{k}={v}' for k, v in SHAPE.items())}), 1 thread"
        ),
        "step_ms_median": step_medians,
        "step_ms_rounds": {name: [round(v, 2) for v in values] for name, values in step_ms.items()},
        "step_speedup": round(step_medians["expanded"] / step_medians["absorbed"], 2),
        "op_ms_median": op_medians,
        "op_speedup": round(op_medians["expanded"] / op_medians["absorbed"], 2),
        "capacity": capacity(),
    }
    write_summary(Path(args.out), summary)
    print("step", step_medians, "speedup", summary["step_speedup"])
    print("op", op_medians, "speedup", summary["op_speedup"])
    for name, row in summary["capacity"]["models"].items():
        print(f"{name}: {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
