"""Structured output: what the grammar costs, side by side in one run.

1. Batch 16 on the bundled model, greedy, 64 output tokens each: all unconstrained vs half of
   the requests under a JSON schema (long enough that no request ends early), compared on
   output throughput and inter-token latency (ITL, per request: decode time / tokens).
2. Grammar compile time, cold vs cached, for a mid-size and a large JSON schema, on each
   tokenizer available (the bundled one; Llama-3 and Qwen2 from ../shared if present).
3. Time to first token of one request with the large schema, with a cold and a warm compile cache.
4. Per-step mask cost at a 152k vocabulary (Qwen2's): fill 8 matchers' bitmasks + apply to
   16 x 151936 logits.

    .venv/bin/python benchmarks/structured_output.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from pagoda.engine.engine_request import EngineRequest  # noqa: E402
from pagoda.engine.llm_engine import LLMEngine  # noqa: E402
from pagoda.outputs import OutputAccumulator  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402
from pagoda.structured import StructuredOutputsParams  # noqa: E402
from pagoda.structured.compiler import GrammarCompiler  # noqa: E402

SHARED_TOKENIZERS = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers"  # main checkout

# Enough array items that the JSON is always longer than the measured output length.
LONG_SCHEMA = {
    "type": "object",
    "required": ["rows"],
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "required": ["id", "name", "tags"],
                "additionalProperties": False,
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 16},
                    "tags": {"type": "array", "items": {"enum": ["new", "old", "hot"]}, "maxItems": 3},
                },
            },
        }
    },
}
MID_SCHEMA = {
    "type": "object",
    "required": ["id", "name", "role", "address"],
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["sku", "qty"],
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
            },
        },
    },
}


def large_schema(num_properties: int = 120) -> dict:
    """A wide schema with nested objects, enums, patterns and bounds (the kind agent frameworks send)."""
    properties = {}
    for i in range(num_properties):
        kind = i % 5
        if kind == 0:
            properties[f"field_{i}"] = {"type": "integer", "minimum": -i, "maximum": 1000 + i}
        elif kind == 1:
            properties[f"field_{i}"] = {"enum": [f"v{i}_{j}" for j in range(6)]}
        elif kind == 2:
            properties[f"field_{i}"] = {"type": "string", "pattern": f"^[a-z]{{1,{i % 7 + 2}}}-[0-9]{{2}}$"}
        elif kind == 3:
            properties[f"field_{i}"] = {"type": "array", "items": {"type": "number", "minimum": 0}, "maxItems": 4}
        else:
            properties[f"field_{i}"] = {
                "type": "object",
                "required": ["a"],
                "properties": {"a": {"type": "boolean"}, "b": {"type": "string", "maxLength": 10}},
            }
    return {"type": "object", "properties": properties, "required": list(properties)[: num_properties // 2]}


def batch_run(engine: LLMEngine, prompts: list[str], constrained: int, max_tokens: int) -> dict:
    for i, prompt in enumerate(prompts):
        structured = StructuredOutputsParams(json=LONG_SCHEMA) if i < constrained else None
        engine.add_request(
            EngineRequest(
                f"r{time.perf_counter_ns()}-{i}",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=structured),
            )
        )
    started = time.perf_counter()
    finished = []
    outputs = OutputAccumulator()  # step() returns deltas: whole outputs are built from them
    while engine.has_unfinished_requests():
        finished.extend(o for o in map(outputs.add, engine.step().deltas) if o.finished)
    wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    itls = [
        (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in finished
        if len(o.outputs[0].token_ids) > 1
    ]
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall,
        "itl_mean_ms": 1000 * statistics.mean(itls),
        "itl_median_ms": 1000 * statistics.median(itls),
        "all_full_length": all(len(o.outputs[0].token_ids) == max_tokens for o in finished),
    }


def compile_times(tokenizer_dir: Path, vocab_size: int | None = None) -> dict:
    from transformers import AutoTokenizer

    vocab = vocab_size or len(AutoTokenizer.from_pretrained(tokenizer_dir))
    started = time.perf_counter()
    compiler = GrammarCompiler(str(tokenizer_dir), vocab, [])
    compiler.tokenizer  # noqa: B018 - the one-time tokenizer index, built at engine start
    result = {"vocab_size": vocab, "tokenizer_index_s": time.perf_counter() - started}
    for name, schema in (("mid", MID_SCHEMA), ("large", large_schema())):
        params = StructuredOutputsParams(json=schema)
        started = time.perf_counter()
        template = compiler.submit(params).result()
        cold = time.perf_counter() - started
        started = time.perf_counter()
        compiler.submit(params).result().deep_copy()
        cached = time.perf_counter() - started
        result[name] = {"cold_ms": 1000 * cold, "cached_ms": 1000 * cached}
        del template
    compiler.shutdown()
    return result


def ttft_large_schema(model: str) -> dict:
    engine = LLMEngine(EngineConfig(model=model, num_threads=1))
    engine.core.structured.compiler.tokenizer  # noqa: B018 - as at a warmed-up server
    result = {}
    for label in ("cold_cache", "warm_cache"):
        params = SamplingParams(
            temperature=0.0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=large_schema())
        )
        engine.add_request(EngineRequest(label, "def main():", params))
        output = None
        outputs = OutputAccumulator()
        while engine.has_unfinished_requests():
            output = next((o for o in map(outputs.add, engine.step().deltas) if o.finished), output)
        result[label + "_ms"] = 1000 * output.metrics.time_to_first_token
    return result


def mask_cost(tokenizer_dir: Path, steps: int = 50) -> dict:
    from transformers import AutoTokenizer

    from pagoda.request import Request
    from pagoda.structured.manager import apply_grammar_masks
    from pagoda.structured.matcher import RequestMatcher

    vocab = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    compiler = GrammarCompiler(str(tokenizer_dir), vocab, [])
    template = compiler.submit(StructuredOutputsParams(json=LONG_SCHEMA)).result()
    requests = []
    for i in range(16):
        request = Request(f"m{i}", [1], SamplingParams(), frozenset(), 1)
        if i % 2 == 0:
            request.structured_output = RequestMatcher(template.deep_copy(), "json")
        requests.append(request)
    logits = torch.randn(16, vocab)
    timings = []
    for _ in range(steps):
        started = time.perf_counter()
        apply_grammar_masks(logits, [(i, r, []) for i, r in enumerate(requests)])
        timings.append(time.perf_counter() - started)
        for request in requests:  # advance each matcher by its argmax (a valid token)
            if request.structured_output is not None:
                row = logits[requests.index(request)]
                request.structured_output.accept([int(row.argmax())])
        logits = torch.randn(16, vocab)
    compiler.shutdown()
    return {
        "vocab_size": vocab,
        "constrained_rows": 8,
        "rows": 16,
        "per_step_ms_median": 1000 * statistics.median(timings),
        "per_step_ms_max": 1000 * max(timings),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--tokenizers",
        type=Path,
        default=SHARED_TOKENIZERS,
        help="directory with llama3-bpe/ and qwen2-bpe/ tokenizers (skipped if absent)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    prompts = [f'def task_{i}(data):\n    """Return the rows as JSON."""\n' for i in range(16)]
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads))
    batch_run(engine, prompts, 8, 8)  # warm-up, and compiles the schema once (cached from here on)
    rounds = {"unconstrained": [], "half_json_schema": []}
    for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits both alike
        rounds["unconstrained"].append(batch_run(engine, prompts, 0, args.max_tokens))
        rounds["half_json_schema"].append(batch_run(engine, prompts, 8, args.max_tokens))
    batch = {
        mode: {
            key: statistics.median(r[key] for r in runs) for key in ("throughput_tok_s", "itl_mean_ms", "itl_median_ms")
        }
        | {"all_full_length": all(r["all_full_length"] for r in runs)}
        for mode, runs in rounds.items()
    }
    # Ratios per round (each pair ran back to back), then their median: robust to drift in load.
    pairs = list(zip(rounds["unconstrained"], rounds["half_json_schema"]))
    batch["throughput_ratio_per_round"] = [c["throughput_tok_s"] / u["throughput_tok_s"] for u, c in pairs]
    batch["itl_ratio_per_round"] = [c["itl_mean_ms"] / u["itl_mean_ms"] for u, c in pairs]
    batch["throughput_ratio"] = statistics.median(batch["throughput_ratio_per_round"])
    batch["itl_ratio"] = statistics.median(batch["itl_ratio_per_round"])
    print(json.dumps(batch, indent=2))

    compiles = {"pagoda-coder": compile_times(Path(args.model))}
    for name in ("llama3-bpe", "qwen2-bpe"):
        if (args.tokenizers / name).is_dir():
            compiles[name] = compile_times(args.tokenizers / name)
    print(json.dumps(compiles, indent=2))
    ttft = ttft_large_schema(args.model)
    print(json.dumps(ttft, indent=2))
    qwen2 = args.tokenizers / "qwen2-bpe"
    masks = mask_cost(qwen2) if qwen2.is_dir() else None
    print(json.dumps(masks, indent=2))

    result = {
        "benchmark": "structured_output",
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": args.threads,
            "note": "shared with other jobs while measured: numbers are noisy; "
            "the ratios were measured side by side in one run",
        },
        "config": {
            "model": Path(args.model).name,
            "batch": 16,
            "constrained": 8,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "greedy": True,
            "backend": "llguidance",
        },
        "batch": batch,
        "compile": compiles,
        "ttft_large_schema": ttft,
        "mask_cost_qwen2_vocab": masks,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "structured_output.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
