"""vLLM's `vllm serve` flags on `pagoda serve`, so that a vLLM launch line runs here unchanged.

Most of vLLM's flags are pagoda's own under the same name (--max-model-len, --tensor-parallel-size,
--served-model-name, --dtype, --host/--port, --api-key, --tool-call-parser, --chat-template,
--max-num-seqs, --enable-prefix-caching, ...). This module adds the rest, mapped onto pagoda's
settings where they mean something here, and refuses the ones that do not with one line that
names what to use instead. Only the command line changes: the settings dataclasses keep their
own names.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, NoReturn

from pagoda.config import EngineConfig

# vLLM's --dtype spellings that pagoda's --dtype names otherwise.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# vLLM flags with no meaning here -> what to do instead (one line each).
REFUSED = {
    "--trust-remote-code": "pagoda never runs a model repository's code (it implements the architectures it "
    "serves itself): drop the flag",
    "--download-dir": "pagoda loads local models only: download first (e.g. `huggingface-cli download ID "
    "--local-dir DIR`) and pass DIR as the model",
    "--revision": "pagoda loads local models only: download the revision you want and pass its directory",
    "--hf-token": "pagoda loads local models only and never contacts the hub: drop the flag",
    "--load-format": "pagoda reads safetensors and GGUF files as they are: drop the flag",
    "--tokenizer-mode": "pagoda uses the model's fast tokenizer (tokenizer.json, or the GGUF file's "
    "vocabulary): drop the flag, or pass --tokenizer DIR",
    "--speculative-config": "use --speculative ngram|draft with --num-speculative-tokens N "
    "(and --draft-model DIR for draft)",
    "--swap-space": "use --kv-offload-memory SIZE (a host-memory KV tier) with --preemption-mode swap",
    "--cpu-offload-gb": "pagoda keeps the weights on the serving device: size the model to it, or use "
    "--quantization int8|int4",
    "--kv-transfer-config": "use --replica-roles prefill=N,decode=M (or --role) with --kv-transport tcp|shm",
    "--ssl-keyfile": "pagoda serves plain HTTP: put a TLS-terminating proxy in front of it",
    "--ssl-certfile": "pagoda serves plain HTTP: put a TLS-terminating proxy in front of it",
    "--limit-mm-per-prompt": "pagoda serves text models: drop the flag",
    "--guided-decoding-backend": "pagoda's structured output always runs llguidance: drop the flag",
}


class _Refuse(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> NoReturn:
        raise SystemExit(
            f"pagoda serve: {option_string} is vLLM's and has no meaning here: {REFUSED[self.option_strings[0]]}"
        )


def _dtype(text: str) -> str:
    return DTYPE_ALIASES.get(text, text)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that pagoda's own do not already cover (call after the settings' flags)."""
    group = parser.add_argument_group(
        "vLLM's command line", "accepted as `vllm serve` takes them; refused with the way out: " + ", ".join(REFUSED)
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command line: pagoda parses tool calls (--tool-call-parser) "
        "whenever a request brings tools",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="share of the device's memory this server may use: on a GPU the KV pool is "
        "sized to it less the weights (instead of --kv-cache-memory); on CPU it is the "
        "budget the weights and --kv-cache-memory must fit in (default: unset)",
    )
    group.add_argument(
        "--num-gpu-blocks-override", type=int, dest="num_kv_blocks", metavar="N", help="as --num-kv-blocks"
    )
    group.add_argument(
        "--disable-log-requests", action="store_true", help="accepted: pagoda logs no prompts unless --log-prompts"
    )
    group.add_argument(
        "--disable-log-stats", action="store_true", help="accepted: statistics are on /metrics, not in the log"
    )
    group.add_argument(
        "--uvicorn-log-level",
        dest="log_level",
        type=lambda level: "debug" if level == "trace" else level,
        choices=("critical", "error", "warning", "info", "debug"),
        metavar="LEVEL",
        help="as --log-level (vLLM's trace is debug)",
    )
    for flag in REFUSED:
        group.add_argument(
            flag,
            dest="refused_" + flag.lstrip("-").replace("-", "_"),
            nargs="?",
            action=_Refuse,
            help=argparse.SUPPRESS,
        )
    dtype = next(action for action in parser._actions if action.dest == "dtype")
    dtype.type = _dtype
    dtype.help = f"{dtype.help}; vLLM's half and float are float16 and float32"


def apply_gpu_memory_utilization(
    engine: EngineConfig, fraction: float | None, kv_cache_memory_given: bool
) -> EngineConfig:
    """The engine config with --gpu-memory-utilization applied, as vLLM's: the KV pool is the share
    of the device's memory (on CPU, the host's) the weights leave. On CPU an explicit
    --kv-cache-memory keeps its size, and the weights and the pool must fit in the share
    (SystemExit with the numbers when they do not)."""
    if fraction is None:
        return engine
    if not 0 < fraction <= 1:
        raise SystemExit(f"pagoda serve: --gpu-memory-utilization must be in (0, 1], got {fraction}")
    import torch

    from pagoda.plan import fmt_bytes, machine_memory_bytes, model_need, serving_weight_bytes

    on_gpu = engine.device != "cpu" and torch.cuda.is_available()
    budget = int(fraction * machine_memory_bytes("cuda" if on_gpu else "cpu"))
    if on_gpu or not kv_cache_memory_given:
        if kv_cache_memory_given:
            raise SystemExit("pagoda serve: give --gpu-memory-utilization or --kv-cache-memory, not both")
        weights = serving_weight_bytes(engine)
        kv_bytes = budget - weights
        if kv_bytes <= 0:
            raise SystemExit(
                f"pagoda serve: --gpu-memory-utilization {fraction} gives {fmt_bytes(budget)}, "
                f"less than the weights ({fmt_bytes(weights)}): raise it"
            )
        return dataclasses.replace(engine, kv_cache_memory=str(kv_bytes))
    need = model_need("model", 0, engine, engines=1)
    used = need.weight_bytes + need.kv_bytes
    if used > budget:
        raise SystemExit(
            f"pagoda serve: on CPU --gpu-memory-utilization {fraction} is a budget of "
            f"{fmt_bytes(budget)}; the weights ({fmt_bytes(need.weight_bytes)}) and the KV pool "
            f"(--kv-cache-memory {engine.kv_cache_memory}) need {fmt_bytes(used)}: lower "
            f"--kv-cache-memory or raise the fraction"
        )
    return engine
