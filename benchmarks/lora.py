"""Multi-LoRA serving: throughput and inter-token latency with 1, 4 and 16 adapters mixed in
one batch (ranks 8 and 64), against the base model alone on the same workload, and against the
naive alternative of one batch per adapter (what an engine that cannot mix adapters does,
llama.cpp among them).

Workload: `--num-requests` requests of `--prompt-len` random prompt tokens and `--max-tokens`
greedy output tokens each, all submitted at once, request i using adapter i mod N (uniform).
Adapters are random PEFT adapters (every projection: q/k/v/o/gate/up/down) of the bundled
pagoda-coder model. Every mode has its own engine and the modes are stepped in turn, one step
each, timing only their own steps: throughput is tokens over a mode's own step time, ITL a
request's own step time between tokens. The JSON keeps each mode's medians over rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/lora.py --rounds 5 --out benchmarks/results/lora
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
from safetensors.torch import save_file  # noqa: E402

from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from pagoda.engine.engine_request import EngineRequest  # noqa: E402
from pagoda.engine.llm_engine import LLMEngine  # noqa: E402
from pagoda.engine.threads import set_engine_threads  # noqa: E402
from pagoda.lora.adapter import module_shapes  # noqa: E402
from pagoda.lora_request import LoRARequest  # noqa: E402
from pagoda.model.loader import load_model_config  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402
from pagoda.stats import percentile  # noqa: E402


def write_adapter(directory: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (all seven projections) for the bundled model."""
    config = load_model_config(DEFAULT_MODEL_DIR)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (in_features, out_features) in module_shapes(config).items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(module_shapes(config)),
                "bias": "none",
                "base_model_name_or_path": str(DEFAULT_MODEL_DIR),
            }
        )
    )
    return directory


class ModeRun:
    """One mode's engine working through its batches (one batch for a mixed mode; one per
    adapter, one after another, for the naive mode), a step at a time. Only its own steps are
    timed, so modes stepped in turn share the machine's state fairly (the machine is shared
    and its load drifts; whole runs back to back would compare different loads)."""

    def __init__(
        self, engine: LLMEngine, batches: list[list[tuple[list[int], LoRARequest | None]]], max_tokens: int
    ) -> None:
        self.engine = engine
        self.batches = list(batches)
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.busy_seconds = 0.0
        self.num_tokens = 0
        self.gaps: list[float] = []  # per request: own step time between consecutive tokens
        self._since_token: dict[str, float] = {}
        self._ids = 0

    @property
    def done(self) -> bool:
        return not self.batches and not self.engine.has_unfinished_requests()

    def step(self) -> None:
        if not self.engine.has_unfinished_requests():
            for prompt, lora in self.batches.pop(0):
                self._ids += 1
                self.engine.add_request(EngineRequest(f"r{self._ids}", prompt, self.params, lora_request=lora))
                self._since_token[f"r{self._ids}"] = -1.0  # no token yet: the first gap is TTFT
        start = time.perf_counter()
        deltas = self.engine.step().deltas
        elapsed = time.perf_counter() - start
        self.busy_seconds += elapsed
        for request_id in self._since_token:
            if self._since_token[request_id] >= 0:
                self._since_token[request_id] += elapsed
        for delta in deltas:
            emitted = sum(len(sample.token_ids) for sample in delta.outputs)
            if not emitted:
                continue
            self.num_tokens += emitted
            if self._since_token[delta.request_id] >= 0:
                self.gaps.append(self._since_token[delta.request_id] / emitted)
            self._since_token[delta.request_id] = 0.0
            if delta.finished:
                del self._since_token[delta.request_id]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pagoda-lora-bench-"))
    adapters = {
        rank: [write_adapter(root / f"r{rank}-{i}", rank, seed=rank * 100 + i) for i in range(16)] for rank in (8, 64)
    }
    blocks = args.num_requests * -(-(args.prompt_len + args.max_tokens) // 16) + 16
    common = dict(
        num_threads=args.threads, max_num_seqs=args.num_requests, num_kv_blocks=blocks, enable_prefix_caching=False
    )
    base_config = EngineConfig(**common)
    set_engine_threads(base_config, serving=False)
    generator = torch.Generator().manual_seed(0)
    vocab = load_model_config(DEFAULT_MODEL_DIR).vocab_size
    prompts = [
        torch.randint(5, vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(args.num_requests)
    ]

    def adapters_for(num: int, rank: int) -> list[LoRARequest | None]:
        return [LoRARequest(f"r{rank}-{i % num}") for i in range(args.num_requests)]

    def lora_engine(rank: int, num: int) -> LLMEngine:
        engine = LLMEngine(EngineConfig(**common, enable_lora=True, max_loras=max(num, 1), max_lora_rank=rank))
        for i in range(num):
            engine.add_lora(LoRARequest(f"r{rank}-{i}", 0, str(adapters[rank][i])))
        return engine

    everyone = list(range(args.num_requests))
    # mode name -> (engine factory, batches of request indices, adapter of each request)
    modes: dict[str, tuple] = {
        "base": (lambda: LLMEngine(base_config), [everyone], [None] * args.num_requests),
        "base, LoRA engine (no adapter used)": (lambda: lora_engine(8, 1), [everyone], [None] * args.num_requests),
    }
    for rank in (8, 64):
        for num in (1, 4, 16):
            modes[f"{num} adapters, rank {rank}, mixed"] = (
                lambda rank=rank, num=num: lora_engine(rank, num),
                [everyone],
                adapters_for(num, rank),
            )
        for num in (4, 16):
            modes[f"{num} adapters, rank {rank}, one batch per adapter"] = (
                lambda rank=rank, num=num: lora_engine(rank, num),
                [[i for i in everyone if i % num == a] for a in range(num)],
                adapters_for(num, rank),
            )

    samples: dict[str, list[dict]] = {mode: [] for mode in modes}
    engines = {mode: factory() for mode, (factory, _, _) in modes.items()}
    for engine in engines.values():  # warm up
        engine.add_request(EngineRequest("warm", prompts[0], SamplingParams(max_tokens=2)))
        while engine.has_unfinished_requests():
            engine.step()
    for round_index in range(args.rounds):
        runs = {
            mode: ModeRun(
                engines[mode], [[(prompts[i], loras[i]) for i in batch] for batch in batches], args.max_tokens
            )
            for mode, (_, batches, loras) in modes.items()
        }
        while not all(run.done for run in runs.values()):
            for run in runs.values():  # one step of each mode in turn
                if not run.done:
                    run.step()
        for mode, run in runs.items():
            samples[mode].append(
                {
                    "tok_per_s": run.num_tokens / run.busy_seconds,
                    "itl_p50_ms": percentile(run.gaps, 50) * 1e3,
                    "itl_p99_ms": percentile(run.gaps, 99) * 1e3,
                }
            )
            print(
                f"round {round_index} {mode:45s} {samples[mode][-1]['tok_per_s']:8.1f} tok/s  "
                f"p99 ITL {samples[mode][-1]['itl_p99_ms']:6.1f} ms",
                flush=True,
            )

    base_tps = statistics.median(s["tok_per_s"] for s in samples["base"])
    results = {}
    for mode, runs in samples.items():
        tps = statistics.median(r["tok_per_s"] for r in runs)
        # Paired: each round's ratio to the base run stepped beside it, then the median.
        paired = statistics.median(r["tok_per_s"] / b["tok_per_s"] for r, b in zip(runs, samples["base"]))
        results[mode] = {
            "output_tok_per_s": round(tps, 1),
            "vs_base": round(tps / base_tps, 3),
            "vs_base_paired": round(paired, 3),
            "itl_p50_ms": round(statistics.median(r["itl_p50_ms"] for r in runs), 2),
            "itl_p99_ms": round(statistics.median(r["itl_p99_ms"] for r in runs), 2),
            "rounds": [{k: round(v, 2) for k, v in r.items()} for r in runs],
        }
    print(json.dumps({m: {k: v for k, v in r.items() if k != "rounds"} for m, r in results.items()}, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(
            json.dumps(
                {
                    "command": "PYTHONPATH=. .venv/bin/python benchmarks/lora.py " + " ".join(sys.argv[1:]),
                    "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs, "
                    f"{args.threads} torch thread(s); modes stepped in turn, own step time only, "
                    f"medians over rounds",
                    "model": "pagoda-coder (bundled, 6 layers, hidden 256), float32, CPU",
                    "workload": {
                        "num_requests": args.num_requests,
                        "prompt_len": args.prompt_len,
                        "max_tokens": args.max_tokens,
                        "rounds": args.rounds,
                        "adapters": "random PEFT LoRA on q/k/v/o/gate/up/down, request i -> adapter i mod N",
                    },
                    "delta_formulation": "segmented (benchmarks/lora_ops.py)",
                    "target": "4 adapters mixed >= 0.75x base throughput",
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
