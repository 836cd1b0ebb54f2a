"""Each speed lever of the engine, on vs off, measured side by side on decode steps.

For a lever, two engines are built in this process on the same weights: one as pagoda runs
(lever on), one with the lever taken out. Both get the same `--concurrency` requests (random
token-id prompts, greedy); after their prefills, rounds of `--steps` decode steps alternate
between the two engines (who goes first alternates too), and the median step time over rounds
is compared, in wall time and in this process's CPU time (on a shared machine the CPU time
per step is what the engine itself spent, without the time it waited for a core). Only the
ratios of the interleaved medians mean anything.
The token ids both engines generated are compared as well (a lever must not change outputs).

    .venv/bin/python benchmarks/levers.py --lever prepack --concurrency 1,16
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
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

NAME = "levers"
SHAPES = {"10m": MODEL_SHAPE, "100m": MODEL_SHAPE_100M}


def _without_prepacked_weights(engine: Any) -> None:
    import torch

    from pagoda.model.layers import Linear

    for module in engine.core.runner.model.modules():
        if isinstance(module, Linear) and hasattr(module, "packed_weight"):
            # The packed tensor replaced the dense weight: recover it (the layer applied to an
            # identity), then FullWeight.apply falls back to F.linear on it.
            eye = torch.eye(module.in_features, dtype=module.weight_dtype)
            dense = module.kernels.linear(module, eye, None).t().contiguous()
            delattr(module, "packed_weight")
            if hasattr(module, "single_row_weight"):
                delattr(module, "single_row_weight")
            module.register_buffer("weight", dense, persistent=False)


def _without_single_row_dense(engine: Any) -> None:
    from pagoda.model.layers import Linear

    for module in engine.core.runner.model.modules():
        if isinstance(module, Linear) and hasattr(module, "single_row_weight"):
            delattr(module, "single_row_weight")  # every row count goes through the packed kernel


def _all_cores(engine: Any) -> int:
    from pagoda.engine.threads import available_cores

    return available_cores()


def _unfused_layer_ops(engine: Any) -> None:
    """The decoder's small ops as they were before the fused forms (same math, more kernels):
    RMSNorm as transformers' five ops, cos/sin gathered again in every layer, q and k rotated
    apart with rotate_half's slice/neg/cat, decode attention gathering its queries and
    scattering its output even when its group is the whole batch. Bound to this engine only."""
    import types

    import torch

    from pagoda.model.decoder import Attention
    from pagoda.model.layers import RMSNorm

    model = engine.core.runner.model
    rotary = model.rotary
    half = rotary.half
    sin = torch.cat((-rotary.sin_rolled[:, :half], rotary.sin_rolled[:, half:]), dim=-1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def norm_forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)

    def attention_forward(
        self: Attention, hidden: torch.Tensor, positions: torch.Tensor, _rotary: Any, context: Any
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin_rows = rotary.cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin_rows, k * cos + rotate_half(k) * sin_rows
        key_cache, value_cache = context.kv_caches[self.layer_index]
        out = context.backend.forward(q, k, v.contiguous(), key_cache, value_cache, context.metadata, self.spec)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def model_forward(self: Any, input_ids: torch.Tensor, positions: torch.Tensor, context: Any) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, positions, None, context)  # positions where the tables were
        return self.model.norm(hidden)

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(norm_forward, module)
        elif isinstance(module, Attention):
            module.forward = types.MethodType(attention_forward, module)
    model.forward = types.MethodType(model_forward, model)

    backend = engine.core.runner.backend  # decode attention gathers q and scatters its output again
    prepare = backend.prepare

    def prepare_without_whole_batch(*args: Any, **kwargs: Any) -> Any:
        metadata = prepare(*args, **kwargs)
        metadata.whole_batch_decode = False
        return metadata

    backend.prepare = prepare_without_whole_batch


def _half_precision_decode_attention(engine: Any) -> None:
    """Decode attention in the model's half precision (torch's CPU flash kernel in bf16), as
    before the float32 upcast; meaningful with `--dtype bfloat16`."""
    engine.core.runner.backend.upcast_half_decode = False


# lever -> how to take it out of a built engine; returns the torch thread count the engine
# without the lever steps with (None: the same as with it)
LEVERS: dict[str, Callable[[Any], int | None]] = {
    "prepack": _without_prepacked_weights,
    "thread-policy": _all_cores,  # the serving policy (engine/threads.py) vs every core
    "single-row-dense": _without_single_row_dense,  # 1-row products on small weights through F.linear
    "layer-ops": _unfused_layer_ops,  # fused RMSNorm, q+k rotary in one op, tables once per step, whole-batch decode
    "bf16-decode-upcast": _half_precision_decode_attention,  # with --dtype bfloat16: decode SDPA in float32
}


def measure(
    model_dir: Path,
    lever: str,
    concurrency: int,
    prompt_len: int,
    steps: int,
    rounds: int,
    threads: int | None,
    dtype: str = "auto",
) -> dict[str, Any]:
    import torch

    from pagoda.config import EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine.threads import set_engine_threads
    from pagoda.sampling_params import SamplingParams

    output_len = steps * rounds + 8
    config = EngineConfig(
        model=str(model_dir),
        max_num_seqs=concurrency,
        num_threads=threads,
        max_model_len=prompt_len + output_len + 16,
        dtype=dtype,
    )
    used_threads = set_engine_threads(config, serving=True)
    engines = {"on": LLMEngine(config), "off": LLMEngine(config)}
    threads_for = {"on": used_threads, "off": LEVERS[lever](engines["off"]) or used_threads}
    vocab = engines["on"].core.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(concurrency)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokens: dict[str, dict[str, list[int]]] = {}
    for name, engine in engines.items():
        tokens[name] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(str(i), prompt, params))
        while any(r.num_output_tokens == 0 for samples in engine.core.requests.values() for r in samples):
            engine.step()  # every prefill first: the rounds time decode steps only
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    for round_index in range(rounds):
        for name in ("on", "off") if round_index % 2 == 0 else ("off", "on"):
            engine = engines[name]
            torch.set_num_threads(threads_for[name])
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(steps):
                for delta in engine.step().deltas:
                    tokens[name].setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
            seconds[name].append((time.perf_counter() - start) / steps)
            cpu[name].append((time.process_time() - cpu_start) / steps)
    on, off = statistics.median(seconds["on"]), statistics.median(seconds["off"])
    cpu_on, cpu_off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    torch.set_num_threads(used_threads)
    return {
        "lever": lever,
        "concurrency": concurrency,
        "dtype": dtype,
        "threads": threads_for,
        "steps_per_round": steps,
        "rounds": rounds,
        "step_ms_on": 1000 * on,
        "step_ms_off": 1000 * off,
        "speedup": off / on,
        "per_round_ratio": [b / a for a, b in zip(seconds["on"], seconds["off"])],
        "cpu_ms_on": 1000 * cpu_on,
        "cpu_ms_off": 1000 * cpu_off,
        "cpu_speedup": cpu_off / cpu_on,
        "cpu_per_round_ratio": [b / a for a, b in zip(cpu["on"], cpu["off"])],
        "identical_tokens": tokens["on"] == tokens["off"],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lever", choices=sorted(LEVERS), action="append", required=True)
    parser.add_argument("--model", choices=sorted(SHAPES), default="10m")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="decode steps per engine per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch threads (default: the serving policy)")
    parser.add_argument("--dtype", default="auto", help="the engines' --dtype (bf16-decode-upcast: bfloat16)")
    parser.add_argument("--out", default=str(RESULTS / NAME))
    args = parser.parse_args(argv)

    shape = SHAPES[args.model]
    model_dir = build_bench_model(
        REPO / "tmp" / ("bench-model" if args.model == "10m" else f"bench-model-{args.model}"), shape=shape
    )
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir, shape).items() if k in META_KEYS}
    results = []
    for lever in args.lever:
        for c in sorted({int(x) for x in args.concurrency.split(",")}):
            result = measure(model_dir, lever, c, args.prompt_len, args.steps, args.rounds, args.threads, args.dtype)
            results.append(result)
            print(
                f"{lever:<10} c={c:<3} step {result['step_ms_on']:7.2f} ms on vs {result['step_ms_off']:7.2f} ms off: "
                f"{result['speedup']:.2f}x (rounds {min(result['per_round_ratio']):.2f}-"
                f"{max(result['per_round_ratio']):.2f}); "
                f"CPU {result['cpu_ms_on']:.2f} vs {result['cpu_ms_off']:.2f} ms: "
                f"{result['cpu_speedup']:.2f}x (rounds {min(result['cpu_per_round_ratio']):.2f}-"
                f"{max(result['cpu_per_round_ratio']):.2f}); identical tokens: {result['identical_tokens']}",
                flush=True,
            )
    out = Path(args.out)
    suffix = "" if args.model == "10m" else f"_{args.model}"
    write_summary(out / f"{'_'.join(args.lever)}{suffix}.json", {**meta, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
