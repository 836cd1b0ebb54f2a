"""Tensor parallelism on the CPU: TP=2 (two processes, gloo, 1 thread each) vs TP=1 (one
process, 2 threads), threads held equal, on a random Llama big enough that matmuls dominate.

Both engines stay up for the whole run and are measured in alternating rounds (A/B/A/B...), so
a change in the machine's load hits both; medians over the rounds are reported.

  single-stream decode: one greedy request (64-token prompt), output tok/s after its first token;
  throughput: 16 requests at once (64-token prompts, 32 output tokens each), output tok/s wall;
  and the latency of one gloo all-reduce between two local processes (what a step pays 26 times).

    .venv/bin/python benchmarks/tensor_parallel.py --rounds 3 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from pagoda.engine.threads import prefer_passive_omp_wait

prefer_passive_omp_wait()  # before torch loads (the thread policy's one owner)

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.engine.engine_request import EngineRequest  # noqa: E402
from pagoda.engine.threads import set_engine_threads  # noqa: E402

# ~150M parameters: 12 layers of hidden 1024 (16 query / 8 KV heads, intermediate 2816), 4k vocabulary.
MODEL_SHAPE = dict(
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=1024,
)
TOTAL_THREADS = 2


def build_model(directory: Path) -> Path:
    """A random-weight Llama (float32) with a copy of the tests' tiny tokenizer is enough: the
    benchmark feeds token ids."""
    import torch
    import transformers

    if (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        eos_token_id=0, pad_token_id=0, bos_token_id=None, tie_word_embeddings=False, rope_theta=10000.0, **MODEL_SHAPE
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(MODEL_SHAPE["vocab_size"])}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t0", "pad_token": "t0"})
    )
    return directory


def prompt(index: int, length: int = 64) -> list[int]:
    return [(index * 131 + i * 7) % 4000 + 5 for i in range(length)]


def single_stream(llm: LLM, index: int, max_tokens: int) -> float:
    """Output tok/s of one request after its first token."""
    engine = llm.engine
    engine.add_request(
        EngineRequest(
            f"single-{index}", prompt(index), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )
    )
    times = []
    while engine.has_unfinished_requests():
        deltas = engine.step().deltas
        now = time.perf_counter()
        for delta in deltas:
            for sample in delta.outputs:
                times.extend(now for _ in sample.token_ids)
    return (len(times) - 1) / (times[-1] - times[0])


def throughput(llm: LLM, index: int, batch: int, max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([prompt(index * batch + i) for i in range(batch)], params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def _collective_peer(port: int, hidden: int, rows: tuple[int, ...], repeats: int) -> None:
    import torch

    from pagoda.executor.group import Endpoint, connect

    torch.set_num_threads(1)
    groups = connect(1, 2, torch.device("cpu"), Endpoint("127.0.0.1", port), 60)
    for count in rows:
        x = torch.ones(count, hidden)
        for _ in range(repeats):
            groups.model.all_reduce(x)


def collective_latency_us(hidden: int, rows: tuple[int, ...] = (1, 16), repeats: int = 300) -> dict[str, float]:
    """Mean latency of one gloo all-reduce of [rows, hidden] float32 between two local
    processes (what each row-parallel layer pays twice per decoder layer), through
    pagoda.executor's own group."""
    import multiprocessing

    import torch

    from pagoda.executor.group import host_store, join

    torch.set_num_threads(1)
    store = host_store("127.0.0.1", 2, 60)
    peer = multiprocessing.get_context("spawn").Process(
        target=_collective_peer, args=(store.port, hidden, rows, repeats)
    )
    peer.start()
    groups = join(0, 2, torch.device("cpu"), store)
    latencies = {}
    for count in rows:
        x = torch.ones(count, hidden)
        for _ in range(repeats // 10):
            groups.model.all_reduce(x)
        start = time.perf_counter()
        for _ in range(repeats - repeats // 10):
            groups.model.all_reduce(x)
        latencies[f"{count}x{hidden}"] = (time.perf_counter() - start) / (repeats - repeats // 10) * 1e6
    peer.join()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pagoda-bench-tp/llama-150m"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    model_dir = build_model(args.model_dir)
    load_at_start = os.getloadavg()
    common = dict(model=str(model_dir), num_threads=TOTAL_THREADS, num_kv_blocks=512, max_num_seqs=args.batch)
    engines = {"tp1": LLM(**common), "tp2": LLM(**common, tensor_parallel_size=2)}
    num_params = sum(p.numel() for p in engines["tp1"].engine.core.runner.model.parameters())
    results: dict[str, dict[str, list[float]]] = {
        name: {"decode_tok_s": [], "throughput_tok_s": []} for name in engines
    }
    for llm in engines.values():  # warm-up: first-call allocations, page faults
        set_engine_threads(llm.engine.config, serving=False)
        throughput(llm, 99, 2, 4)
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            llm = engines[name]
            # Torch's thread count is per thread and both engines step on this one: re-apply
            # this engine's share (2 threads for TP=1, 1 for each TP=2 rank) before measuring.
            set_engine_threads(llm.engine.config, serving=False)
            results[name]["decode_tok_s"].append(single_stream(llm, round_index, args.decode_tokens))
            results[name]["throughput_tok_s"].append(throughput(llm, round_index, args.batch, args.batch_tokens))
            print(
                f"round {round_index} {name}: decode {results[name]['decode_tok_s'][-1]:.2f} tok/s, "
                f"throughput {results[name]['throughput_tok_s'][-1]:.1f} tok/s",
                flush=True,
            )
    latency = collective_latency_us(MODEL_SHAPE["hidden_size"])
    print(f"gloo all-reduce latency (us): {latency}", flush=True)
    medians = {
        name: {key: statistics.median(values) for key, values in metrics.items()} for name, metrics in results.items()
    }
    summary = {
        "benchmark": "tensor_parallel",
        "model": {"shape": MODEL_SHAPE, "parameters": num_params, "dtype": "float32"},
        "threads_total": TOTAL_THREADS,
        "workload": {
            "decode": f"1 request, 64-token prompt, {args.decode_tokens} output tokens, greedy",
            "throughput": f"{args.batch} requests at once, 64-token prompts, {args.batch_tokens} output "
            f"tokens each, greedy",
        },
        "rounds": args.rounds,
        "per_round": results,
        "median": medians,
        "tp2_over_tp1": {key: medians["tp2"][key] / medians["tp1"][key] for key in medians["tp1"]},
        "allreduce_latency_us": latency,
        "collectives_per_step": 2 * MODEL_SHAPE["num_hidden_layers"] + 2,  # + embedding, logits gather
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            "note": "2 vCPU shared with other jobs during the run: absolute numbers are noisy, "
            "the interleaved ratios are what counts",
        },
    }
    print(json.dumps({"median": medians, "tp2_over_tp1": summary["tp2_over_tp1"]}, indent=2))
    engines["tp2"].engine.close()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tensor_parallel.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
