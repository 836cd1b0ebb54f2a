"""`pagoda eval perplexity`: perplexity of a model on local text, and its delta against the
same model at full precision (weights unquantized, KV cache in the model dtype)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from pagoda.config import EngineConfig

    parser = subparsers.add_parser("eval", help="evaluate model quality with the engine (perplexity)",
                                   description="Evaluate model quality with the engine itself.")
    evals = parser.add_subparsers(dest="eval_command", metavar="EVAL", required=True)
    perplexity = evals.add_parser(
        "perplexity", help="perplexity on local text, with the delta against full precision",
        description="Perplexity over sliding windows of prompt logprobs, for the engine as configured "
                    "(--quantization, --kv-cache-dtype, ...) and for the same model at full precision.")
    perplexity.add_argument("--text", required=True, help="a text file, or a directory of text files (recursive)")
    perplexity.add_argument("--window", type=int, default=512, help="tokens per window (capped by the model length)")
    perplexity.add_argument("--stride", type=int, default=256,
                            help="tokens a window advances; each token gets at least window - stride of context")
    perplexity.add_argument("--max-tokens", type=int, default=20000,
                            help="score at most this many tokens (0: all)")
    perplexity.add_argument("--no-baseline", action="store_true", help="skip the full-precision run")
    perplexity.add_argument("--json", action="store_true", help="print one JSON object")
    EngineConfig.add_cli_args(perplexity)
    perplexity.set_defaults(func=run_perplexity)


def run_perplexity(args: argparse.Namespace) -> int:
    from pagoda.config import EngineConfig
    from pagoda.engine.llm import LLM
    from pagoda.eval.perplexity import perplexity, read_documents, tokenize_documents

    try:
        config = EngineConfig.from_cli_args(args)
        documents = read_documents(args.text)
        configs = [("configured", config)]
        is_full = config.quantization == "none" and config.kv_cache_dtype == "auto"
        if not args.no_baseline and not is_full:
            configs.insert(0, ("full precision", dataclasses.replace(config, quantization="none",
                                                                     kv_cache_dtype="auto")))
        results = {}
        token_lists = None
        for label, engine_config in configs:
            start = time.perf_counter()
            llm = LLM(**vars(engine_config))
            if token_lists is None:
                token_lists = tokenize_documents(llm, documents, args.max_tokens or None)
            window = min(args.window, llm.engine.core.max_model_len)
            result = perplexity(llm, token_lists, window, min(args.stride, window - 1))
            results[label] = (result, time.perf_counter() - start, engine_config)
            del llm
    except ValueError as error:
        print(f"pagoda eval perplexity: {error}", file=sys.stderr)
        return 2
    _report(results, args)
    return 0


def _describe(config) -> str:
    weights = config.quantization if config.quantization == "none" or config.quantization == "int8" else \
        f"int4 g{config.quantization_group_size}{'' if config.quantization_zero_point else ' sym'}"
    return f"weights {weights}, kv {config.kv_cache_dtype}"


def _report(results: dict, args: argparse.Namespace) -> None:
    baseline = results.get("full precision")
    configured, _, config = results["configured"]
    delta = None
    if baseline is not None:
        delta = (configured.perplexity / baseline[0].perplexity - 1.0) * 100
    if args.json:
        print(json.dumps({
            "model": config.model, "text": args.text, "window": args.window, "stride": args.stride,
            "num_scored_tokens": configured.num_scored_tokens, "num_documents": configured.num_documents,
            "runs": {label: {"perplexity": r.perplexity, "mean_nll": r.mean_nll, "seconds": round(s, 2),
                             "quantization": c.quantization, "kv_cache_dtype": c.kv_cache_dtype}
                     for label, (r, s, c) in results.items()},
            "delta_percent": delta,
        }))
        return
    print(f"model {config.model}: {configured.num_scored_tokens} tokens scored in {configured.num_documents} "
          f"document(s), {configured.num_windows} window(s)")
    for label, (result, seconds, run_config) in results.items():
        print(f"  {label:<15} {_describe(run_config):<32} perplexity {result.perplexity:.4f}  ({seconds:.1f}s)")
    if delta is not None:
        print(f"  delta vs full precision: {delta:+.2f}%")
