"""Sliding-window KV release: how many sequences a fixed KV pool runs at once for a
Gemma-2-shaped model (local and global layers alternating), with and without releasing the
blocks behind the local layers' window.

A tiny random Gemma 2 checkpoint (4 layers, 64-token window), one pool of `--num-kv-blocks`
blocks of every layer, and `--num-requests` greedy requests of `--prompt-len` + `--output-len`
tokens submitted at once (--max-num-seqs above them, so the pool is the limit). Without release
is the same engine with every block kept (the path a host tier, KV handoff or a draft model
takes). Reports the most sequences the pool runs to the end together (the largest wave of
requests that finishes with no preemption, found by bisection), and for the flood of requests:
mean sequences running per step, preemptions, steps and wall time.

    .venv/bin/python benchmarks/sliding_window.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, RESULTS, build_tokenizer, metadata, write_summary  # noqa: E402

NAME = "sliding_window"
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=64,
)


def build_gemma2(directory: Path) -> Path:
    import torch
    import transformers

    if (directory / "config.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    vocab_size = len(transformers.AutoTokenizer.from_pretrained(directory))
    config = transformers.Gemma2Config(
        vocab_size=vocab_size, max_position_embeddings=4096, query_pre_attn_scalar=16, tie_word_embeddings=True, **SHAPE
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def run(model_dir: Path, release: bool, args: argparse.Namespace, num_requests: int | None = None) -> dict:
    from pagoda import LLM, SamplingParams
    from pagoda.engine.engine_request import EngineRequest

    num_requests = num_requests or args.num_requests
    blocker = None if release else "kept whole for the comparison"
    with mock.patch("pagoda.engine.assembly.release_blocker", lambda config: blocker):
        llm = LLM(
            model=str(model_dir),
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            max_num_seqs=num_requests,
            enable_prefix_caching=False,
            num_threads=args.threads,
        )
    core = llm.engine.core
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(num_requests):
        core.add_request(EngineRequest(f"r{i}", [5 + (i * 7 + j) % 200 for j in range(args.prompt_len)], params))
    running, steps = [], 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
        running.append(len(core.scheduler.running))
    elapsed = time.perf_counter() - start
    result = {
        "release": release,
        "kv_cache_groups": [list(g.layers) for g in core.kv_groups],
        "pool_blocks": core.num_blocks,
        "max_running": max(running),
        "mean_running": round(sum(running) / len(running), 2),
        "preemptions": core.scheduler.num_preemptions,
        "steps": steps,
        "seconds": round(elapsed, 2),
        "output_tok_per_s": round(num_requests * args.output_len / elapsed, 1),
    }
    llm.engine.close()
    return result


def largest_wave(model_dir: Path, release: bool, args: argparse.Namespace) -> int:
    """The most requests submitted together that all run to the end without a preemption."""
    low, high = 1, 4 * args.num_requests
    while low < high:
        mid = (low + high + 1) // 2
        if run(model_dir, release, args, mid)["preemptions"] == 0:
            low = mid
        else:
            high = mid - 1
    return low


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-gemma2"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--num-kv-blocks", type=int, default=128, help="blocks of every layer")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=480)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    model_dir = build_gemma2(Path(args.model_dir))
    results = []
    for release in (False, True):
        result = run(model_dir, release, args)
        result["max_concurrent_without_preemption"] = largest_wave(model_dir, release, args)
        results.append(result)
    for r in results:
        print(
            f"release={r['release']!s:5}  runs {r['max_concurrent_without_preemption']:3} at once  "
            f"flood: mean running {r['mean_running']:6}  "
            f"preemptions {r['preemptions']:3}  steps {r['steps']:5}  {r['seconds']:7.2f} s  "
            f"{r['output_tok_per_s']:8.1f} tok/s"
        )
    payload = {
        **metadata(f"{NAME}.py", argv, model_dir, {**SHAPE, "architecture": "Gemma2ForCausalLM"}),
        "settings": vars(args),
        "results": results,
        "max_concurrent_ratio": round(
            results[1]["max_concurrent_without_preemption"] / results[0]["max_concurrent_without_preemption"], 2
        ),
    }
    write_summary(Path(args.out) / "summary.json", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
