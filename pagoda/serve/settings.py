"""ServerSettings: the HTTP side's settings (the engine's are in EngineConfig, the replicas' in
DeploymentConfig), one field each; `pagoda serve`'s server flags are generated from it."""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pagoda.config import LogLevel, MetricsCompat, ReasoningParserName, ToolCallParserName, TransportKind, parse_bytes
from pagoda.dataclass_flags import add_flags, check_choices, from_flags
from pagoda.serve.admission.latency_targets import LatencyTargets
from pagoda.serve.admission.request_limits import RequestLimits
from pagoda.serve.admission.tenants import TenantRegistry
from pagoda.serve.api.chat_template import load_chat_template
from pagoda.serve.observability.prompt_log import check_sample_rate, parse_duration
from pagoda.serve.observability.tracing import check_traces_endpoint

# uvicorn's two HTTP/1.1 protocol implementations, or whichever is installed (httptools first).
HttpParser = Literal["auto", "httptools", "h11"]

if TYPE_CHECKING:
    from pagoda.guard import GuardrailsConfig
    from pagoda.serve.observability.cost import PriceTable

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_MAX_QUEUED_REQUESTS = 512
DEFAULT_MAX_QUEUED_TOKENS = 1_000_000
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 1024
# A request's head (request line and headers) larger than this gets 431: every real client's
# fits in a few KB (nginx's default buffers hold 32 KB).
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_RESPONSES_STORE_SIZE = 1000
DEFAULT_RESPONSES_STORE_TTL_S = 3600.0
DEFAULT_BATCH_CONCURRENCY = 4
DEFAULT_BATCH_MAX_FILE_BYTES = DEFAULT_MAX_REQUEST_BYTES
DEFAULT_BATCH_MAX_TENANT_BYTES = 2**30


def parse_optional_limit(text: str) -> int | None:
    """A queue limit flag: a count, or none / 0 / unlimited for no limit."""
    return None if text.lower() in ("none", "0", "unlimited") else int(text)


PoolingMethod = Literal["last", "mean"]  # pagoda/serve/api/embeddings.py


@dataclass
class ServerSettings:
    """What `pagoda serve` runs the HTTP side with. The fields with help are its flags; the rest
    are built at launch from those flags and the engine's config (launch.py), or given directly
    by a caller that builds the app itself."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    served_model_names: list[str] = field(
        default_factory=list,
        metadata={
            "flag": "--served-model-name",
            "metavar": "NAME",
            "help": "model names clients use: the first is the one answers carry, every one answers "
            "(default: the model directory's name)",
        },
    )
    models_file: str | None = field(
        default=None,
        metadata={
            "flag": "--models",
            "metavar": "FILE",
            "help": "YAML file of several models to serve (each with its own engines, aliases and "
            "fallbacks) and the routes that pick one per request; the engine and replica "
            "flags are every model's defaults",
        },
    )
    served_model_name: str | None = None  # the first of --served-model-name, or set at launch
    api_key: str | None = field(
        default=None, metadata={"help": "require this key (Authorization: Bearer KEY); one tenant"}
    )
    api_keys: str | None = field(
        default=None, metadata={"metavar": "FILE", "help": "YAML or JSON file of tenants, their API keys and limits"}
    )
    max_request_bytes: int = field(
        default=DEFAULT_MAX_REQUEST_BYTES, metadata={"parse": parse_bytes, "help": "largest request body"}
    )
    max_queued_requests: int | None = field(
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        metadata={
            "parse": parse_optional_limit,
            "help": "sequences (each prompt of a request times n) waiting for their first token "
            "before new requests get 503; a request with more is refused with 400 "
            f"(default: {DEFAULT_MAX_QUEUED_REQUESTS}; 'none' for no limit)",
        },
    )
    max_queued_tokens: int | None = field(
        default=DEFAULT_MAX_QUEUED_TOKENS,
        metadata={
            "parse": parse_optional_limit,
            "help": "prompt tokens of queued requests before new ones get 503, never below the "
            "context length "
            f"(default: {DEFAULT_MAX_QUEUED_TOKENS}; 'none' for no limit)",
        },
    )
    engine_transport: TransportKind = field(
        default="process",
        metadata={
            "help": "run the engine in its own process (default: it keeps its own GIL, so the HTTP side "
            "cannot stall it, and a crash leaves the server up to answer 503), or on a thread of "
            "the server process (starts faster)"
        },
    )
    tool_call_parser: ToolCallParserName = field(
        default="hermes", metadata={"help": "how the model writes tool calls (default: hermes, as Qwen2.5/3 do)"}
    )
    reasoning_parser: ReasoningParserName | None = field(
        default=None,
        metadata={
            "help": "split a reasoning model's <think> segment from the answer: chat's "
            "reasoning_content, the Messages API's thinking blocks (default: off)"
        },
    )
    guardrails_file: str | None = field(
        default=None,
        metadata={
            "flag": "--guardrails",
            "metavar": "FILE",
            "help": "YAML file of input/output guardrail rules (regex, blocklist, pii, classifier) per "
            "tenant (default: off)",
        },
    )
    allowed_media_domains: list[str] = field(
        default_factory=list,
        metadata={
            "metavar": "DOMAIN",
            "help": "vision-language models: hosts (and their subdomains) whose http(s) image URLs the server "
            "fetches, each resolved address checked to be public, on every redirect too (default: none, "
            "data: URLs only)",
        },
    )
    max_image_bytes: int = field(
        default=20 * 1024 * 1024,
        metadata={"parse": parse_bytes, "help": "largest image a request may carry or the server fetch (encoded)"},
    )
    max_image_pixels: int = field(
        default=40_000_000, metadata={"help": "largest image, width x height, decoded (the decompression-bomb cap)"}
    )
    max_images_per_request: int = field(default=16, metadata={"help": "most images in one request"})
    media_fetch_timeout: float = field(
        default=10.0, metadata={"help": "seconds one image URL may take, redirects included"}
    )
    allow_runtime_lora: bool = field(
        default=False,
        metadata={
            "help": "let admin keys load and unload LoRA adapters at run time (POST "
            "/v1/load_lora_adapter, /v1/unload_lora_adapter; needs --enable-lora)"
        },
    )
    lora_root: str | None = field(
        default=None,
        metadata={
            "metavar": "DIR",
            "help": "with --allow-runtime-lora: adapters load only from directories under DIR "
            "(symbolic links resolved); default: any directory the server can read",
        },
    )
    log_prompts: bool = field(
        default=False,
        metadata={
            "help": "write prompts, outputs and error messages, PII-redacted, to the prompt log "
            "(owner-only files in --prompt-log-dir; never to the request log)"
        },
    )
    log_level: LogLevel = field(default="info", metadata={"help": "server log level"})
    shutdown_timeout: float = field(
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metadata={
            "help": "on Ctrl-C or SIGTERM, seconds to let running requests finish while new ones get "
            "503; a second Ctrl-C exits at once"
        },
    )
    target_ttft_ms: float | None = field(
        default=None,
        metadata={
            "help": "latency-aware admission: refuse new requests (503 + Retry-After) while the recent "
            "p90 time to first token exceeds this (default: off)"
        },
    )
    target_itl_ms: float | None = field(
        default=None,
        metadata={
            "help": "latency-aware admission: refuse new requests while the recent p90 inter-token "
            "latency exceeds this (default: off)"
        },
    )
    metrics_token: str | None = field(
        default=None,
        metadata={
            "metavar": "TOKEN",
            "help": "require Authorization: Bearer TOKEN on GET /metrics (for scrapers; "
            "default: /metrics is open, as in vLLM)",
        },
    )
    metrics_tenant_labels: bool = field(
        default=False,
        metadata={
            "help": "name tenants and LoRA adapters in /metrics label values (default: those values are "
            "empty and their series summed, so a scrape cannot learn what another tenant sees)"
        },
    )
    metrics_compat: MetricsCompat = field(
        default="none",
        metadata={"help": "also export every metric under vLLM's vllm: names, for existing vLLM dashboards"},
    )
    header_timeout: float = field(
        default=DEFAULT_HEADER_TIMEOUT_S,
        metadata={
            "help": "seconds a client has to send a request's headers, from connecting or from the end "
            "of its previous response, before the connection is closed (default: "
            f"{DEFAULT_HEADER_TIMEOUT_S:g}: ample for any real client, and a client that sends "
            "its headers a byte at a time cannot hold a connection longer)"
        },
    )
    body_timeout: float = field(
        default=DEFAULT_BODY_TIMEOUT_S,
        metadata={
            "help": "seconds a client has to send a request's whole body once its headers are in; a "
            f"body still arriving then gets 408 and the connection is closed (default: "
            f"{DEFAULT_BODY_TIMEOUT_S:g}: a full --max-request-bytes body at well under 1 MB/s)"
        },
    )
    keep_alive_timeout: float = field(
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        metadata={
            "help": "seconds an idle keep-alive connection stays open after a response (default: "
            f"{DEFAULT_KEEP_ALIVE_TIMEOUT_S:g}, as vLLM)"
        },
    )
    max_connections: int = field(
        default=DEFAULT_MAX_CONNECTIONS,
        metadata={
            "help": "open client connections at once; one more gets 503 and is closed (default: "
            f"{DEFAULT_MAX_CONNECTIONS}: above --max-queued-requests with room for streams and "
            "/health, and within the usual open-files limit, which serve raises to fit)"
        },
    )
    max_connections_per_client: int | None = field(
        default=None,
        metadata={
            "help": "open connections from one client address at once; one more gets 503 and is closed "
            "(default: 7/8 of --max-connections, so one client cannot hold them all; raise it to "
            "--max-connections behind a proxy, whose connections all come from one address)"
        },
    )
    max_header_bytes: int = field(
        default=DEFAULT_MAX_HEADER_BYTES,
        metadata={
            "help": "bytes of a request's head (request line and headers); a larger head gets 431 and the "
            f"connection is closed before it is read further (default: {DEFAULT_MAX_HEADER_BYTES})"
        },
    )
    pooling: PoolingMethod | None = field(
        default=None,
        metadata={
            "help": "how /v1/embeddings pools a prompt's final hidden states (default: the model's "
            "sentence-transformers config (modules.json) when it has one, else last)"
        },
    )

    http_parser: HttpParser = field(
        default="auto",
        metadata={
            "help": "the HTTP/1.1 parser under the connection guards: httptools (C, the faster one under "
            "overload) or h11 (pure Python); auto picks httptools when it is installed"
        },
    )

    otlp_traces_endpoint: str | None = field(
        default=None,
        metadata={
            "metavar": "URL",
            "help": "export one OpenTelemetry span per request (queue, prefill, "
            "decode, handoff phases; parent from the traceparent header) as "
            "OTLP/HTTP to this collector URL, e.g. http://localhost:4318/v1/traces "
            "(needs pagoda[otel]; default: off)",
        },
    )
    prompt_log_dir: str | None = field(
        default=None,
        metadata={
            "metavar": "DIR",
            "help": "directory of the --log-prompts files and their access audit "
            "(default: $XDG_STATE_HOME/pagoda/prompt-log)",
        },
    )
    prompt_log_sample: float | None = field(
        default=None,
        metadata={
            "metavar": "RATE",
            "help": "with --log-prompts, keep each request with this probability (0 to 1; default: 1, every request)",
        },
    )
    prompt_log_retention: str | None = field(
        default=None,
        metadata={
            "metavar": "DURATION",
            "help": "with --log-prompts, delete prompt-log records older than "
            "this (e.g. 30d, 12h, 90m), rotating files while running "
            "(default: kept)",
        },
    )
    responses_store: bool = field(
        default=True,
        metadata={
            "help": "keep the answers of POST /v1/responses in memory, per API key, for "
            "previous_response_id and GET / DELETE /v1/responses/{id} (--no-responses-store: "
            "keep none; clients send the whole conversation)"
        },
    )
    responses_store_size: int = field(
        default=DEFAULT_RESPONSES_STORE_SIZE,
        metadata={
            "help": f"stored responses at most; the oldest is forgotten first (default: {DEFAULT_RESPONSES_STORE_SIZE})"
        },
    )
    responses_store_ttl: float = field(
        default=DEFAULT_RESPONSES_STORE_TTL_S,
        metadata={"help": f"seconds a stored response is kept (default: {DEFAULT_RESPONSES_STORE_TTL_S:g})"},
    )
    batch_store: str | None = field(
        default=None,
        metadata={
            "metavar": "PATH",
            "help": "SQLite database of the Batch API's files and batches (/v1/files, /v1/batches), "
            "the files' bytes in PATH.files/ beside it; a restart resumes unfinished "
            "batches ('memory': kept in memory only; default: "
            "$XDG_STATE_HOME/pagoda/batches.sqlite)",
        },
    )
    batch_concurrency: int = field(
        default=DEFAULT_BATCH_CONCURRENCY,
        metadata={
            "help": "batch lines in flight at once, over every batch; they run at the lowest priority and "
            f"wait while online requests queue (default: {DEFAULT_BATCH_CONCURRENCY})"
        },
    )
    batch_max_file_bytes: int = field(
        default=DEFAULT_BATCH_MAX_FILE_BYTES,
        metadata={
            "parse": parse_bytes,
            "help": "largest file uploaded to /v1/files (uploads are also bounded by --max-request-bytes)",
        },
    )
    batch_max_tenant_bytes: int = field(
        default=DEFAULT_BATCH_MAX_TENANT_BYTES,
        metadata={
            "parse": parse_bytes,
            "help": "bytes of files one API key's tenant may hold, batch outputs included (default: 1GiB)",
        },
    )
    price_table: str | None = field(
        default=None,
        metadata={
            "metavar": "FILE",
            "help": "YAML or JSON prices per served model (USD per 1K prompt, cached-prompt "
            "and completion tokens): each request's cost in the request log, "
            "pagoda:cost_usd_total and the dashboard (default: token counts only)",
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "metavar": "FILE_OR_TEXT",
            "help": "render chat messages with this Jinja template (a file, or the template itself) "
            "instead of the model's",
        },
    )
    trust_request_chat_template: bool = field(
        default=False,
        metadata={
            "help": "accept a request's own chat_template (a template is code the server runs; "
            "default: such requests get 400)"
        },
    )

    # ---- built at launch (no flags) ----
    model_path: str = ""  # the engine's model directory, shown by /v1/models
    tenants: TenantRegistry = field(default_factory=TenantRegistry.open)  # from --api-key(s)
    guardrails: GuardrailsConfig | None = None  # --guardrails FILE, loaded
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    latency_targets: LatencyTargets = field(init=False)  # from --target-ttft-ms / --target-itl-ms
    prompt_log_retention_s: float | None = field(init=False)  # --prompt-log-retention, parsed
    prices: PriceTable | None = None  # --price-table FILE, loaded

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        for name in ("max_queued_requests", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.metrics_token is not None and not self.metrics_token.strip():
            raise ValueError("--metrics-token must not be empty")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        for name in ("header_timeout", "keep_alive_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 1:
            raise ValueError(f"--max-connections-per-client must be >= 1, got {self.max_connections_per_client}")
        if self.lora_root is not None and not Path(self.lora_root).is_dir():
            raise ValueError(f"--lora-root {self.lora_root}: not a directory")
        if self.max_header_bytes < 1024:
            raise ValueError(f"--max-header-bytes must be >= 1024, got {self.max_header_bytes}")
        if self.http_parser == "httptools" and importlib.util.find_spec("httptools") is None:
            raise ValueError(
                "--http-parser httptools: the httptools package is not installed "
                "(pip install httptools), or choose --http-parser h11"
            )
        self.prompt_log_retention_s = self._check_prompt_log()
        if self.otlp_traces_endpoint is not None:
            check_traces_endpoint(self.otlp_traces_endpoint)
        if self.chat_template is not None:  # the template's text from here on
            self.chat_template = load_chat_template(self.chat_template)
        self.latency_targets = LatencyTargets(  # raises for a target that is not a positive number
            ttft_s=None if self.target_ttft_ms is None else self.target_ttft_ms / 1000,
            itl_s=None if self.target_itl_ms is None else self.target_itl_ms / 1000,
        )
        if self.responses_store_size < 1:
            raise ValueError(f"--responses-store-size must be >= 1, got {self.responses_store_size}")
        if not self.responses_store_ttl > 0:
            raise ValueError(f"--responses-store-ttl must be > 0, got {self.responses_store_ttl}")
        for name in ("batch_concurrency", "batch_max_file_bytes", "batch_max_tenant_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    def _check_prompt_log(self) -> float | None:
        """--prompt-log-* checked (they need --log-prompts); the retention in seconds."""
        if not self.log_prompts:
            for name in ("prompt_log_dir", "prompt_log_sample", "prompt_log_retention"):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name.replace('_', '-')} needs --log-prompts")
            return None
        if self.prompt_log_sample is not None:
            check_sample_rate(self.prompt_log_sample)
        return parse_duration(self.prompt_log_retention) if self.prompt_log_retention is not None else None

    @property
    def prompt_log_directory(self) -> Path:
        if self.prompt_log_dir is not None:
            return Path(self.prompt_log_dir)
        state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(state) / "pagoda" / "prompt-log"

    @staticmethod
    def default_batch_store() -> str:
        """Where `pagoda serve` keeps the Batch API's store without --batch-store."""
        state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return str(Path(state) / "pagoda" / "batches.sqlite")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_flags(parser, cls, "server")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerSettings:
        return from_flags(cls, args)
