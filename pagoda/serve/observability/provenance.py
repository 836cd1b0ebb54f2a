"""Per-request provenance: what served a request, found again by its id.

A `Provenance` names the artifacts behind one answer (the model's weights, tokenizer, chat
template and generation config by digest, the adapter by content hash, the guardrail policy by
version, the engine config by fingerprint) and the route it took (model, pool, replica; the
fallback and the live canary's candidate the model-routing layer records). Its id is the
request's id: the `x-pagoda-provenance` response header carries it, the request's log line
holds the record, and `GET /admin/provenance/{id}` returns it while it is among the recent ones.

Everything but the route is computed once: the model's digests at startup (`ModelProvenance.of`,
small files only), an adapter's hash when it is loaded (`ProvenanceBook.adapter_loaded`).
Hashing the weights at startup would cost seconds per gigabyte, so the weights digest is the
one a loader verified against a manifest when the engine reports one (`weights_digest`), else
`unverified:` and a digest of config.json with the weight files' names and sizes, which changes
whenever a file is swapped for one of another size, and is cheap.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.engine.client import EngineClient, StreamRoute

logger = logging.getLogger(__name__)

HEADER = "x-pagoda-provenance"
# How many recent records /admin/provenance/{id} can find (the request log keeps them all).
RECENT_RECORDS = 10_000

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
# EngineConfig fields that say where things are, not how tokens are computed: left out of the
# fingerprint so the same deployment on another host (or replica role) fingerprints the same.
_PLACE_FIELDS = frozenset(
    {
        "model",
        "tokenizer",
        "draft_model",
        "lora_modules",
        "kv_offload_disk",
        "kv_listen",
        "ray_address",
        "role",
        "kv_transfer_secret",
    }
)


def sha256_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha256_files(paths: Iterable[Path], root: Path | None = None) -> str:
    """One digest over several files: each file's name (relative to `root`) and SHA-256."""
    digest = hashlib.sha256()
    for path in sorted(paths):
        name = str(path.relative_to(root)) if root is not None else path.name
        digest.update(f"{name}\0{_file_sha256(path)}\n".encode())
    return "sha256:" + digest.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def unverified_weights_digest(model: str | Path) -> str:
    """`unverified:` + SHA-256 of config.json and the sorted (name, size) of the weight files:
    what stands in for the weights' digest until a loader verified a manifest."""
    path = Path(model)
    digest = hashlib.sha256()
    if path.is_file():  # a GGUF file
        weights = [path]
    else:
        config = path / "config.json"
        if config.is_file():
            digest.update(config.read_bytes())
        weights = [p for p in path.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    root = path.parent if path.is_file() else path
    for name, size in sorted((str(p.relative_to(root)), p.stat().st_size) for p in weights):
        digest.update(f"\n{name}\0{size}".encode())
    return "unverified:sha256:" + digest.hexdigest()


def tokenizer_digest(directory: str | Path) -> str | None:
    """The tokenizer's files together (None when the directory has none: a GGUF's vocabulary
    is inside the weights)."""
    root = Path(directory)
    if not root.is_dir():
        return None
    files = [root / name for name in TOKENIZER_FILES if (root / name).is_file()]
    return sha256_files(files, root) if files else None


def chat_template_digest(template: str | dict[str, str] | list[Any] | None) -> str | None:
    """The chat template the tokenizer renders with (a named set of templates as sorted JSON)."""
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return sha256_bytes(text.encode())


def file_digest(path: str | Path | None) -> str | None:
    """A small file's SHA-256, or None when there is no such file."""
    if path is None or not Path(path).is_file():
        return None
    return sha256_bytes(Path(path).read_bytes())


def engine_config_fingerprint(config: EngineConfig) -> str:
    """A digest of the engine settings that decide how tokens are computed."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in _PLACE_FIELDS}
    return sha256_bytes(json.dumps(fields, sort_keys=True, default=str).encode())


def adapter_digest(path: str | Path) -> str:
    """A LoRA adapter's content hash: its directory's files (config and weights)."""
    root = Path(path)
    return sha256_files([p for p in root.iterdir() if p.is_file()], root)


@dataclass(frozen=True)
class ModelProvenance:
    """What one served model is made of, computed once at startup."""

    model: str  # the served model name
    weights_digest: str
    tokenizer_digest: str | None
    chat_template_digest: str | None
    generation_config_digest: str | None
    # The guardrails file's digest ("unversioned" for rules given without a file); None without.
    guardrail_policy: str | None
    engine_config_fingerprint: str

    @classmethod
    def of(
        cls, llm: EngineClient, model_name: str, *, guardrails: bool = False, guardrails_file: str | None = None
    ) -> ModelProvenance:
        config = llm.config
        model_dir = Path(config.model)
        # A loader that verified a manifest reports the manifest's digest of the weights.
        verified = llm.weights_digest
        tokenizer_dir = Path(config.tokenizer) if config.tokenizer else model_dir
        template = getattr(getattr(llm.tokenizer, "hf", None), "chat_template", None)
        return cls(
            model=model_name,
            weights_digest=verified or unverified_weights_digest(model_dir),
            tokenizer_digest=tokenizer_digest(tokenizer_dir),
            chat_template_digest=chat_template_digest(template),
            generation_config_digest=file_digest(model_dir / "generation_config.json") if model_dir.is_dir() else None,
            guardrail_policy=(file_digest(guardrails_file) or "unversioned") if guardrails else None,
            engine_config_fingerprint=engine_config_fingerprint(config),
        )


@dataclass(frozen=True)
class RouteTaken:
    """Where the request went: the model, the pool and replica that served it (None behind
    one engine), the route rule that chose the model (`route`), whether it is a fallback, and
    the candidate when a live canary sent it there (`canary`)."""

    model: str
    pool: str | None = None
    replica: str | None = None
    route: str | None = None
    fallback: bool = False
    canary: str | None = None

    @classmethod
    def of(cls, model: str, routes: Iterable[StreamRoute | None], label: str | None = None) -> RouteTaken:
        """The route of a request whose prompts went where `routes` say (a batch's prompts may
        go to several replicas: their labels are joined); `label` is its x-pagoda-route
        (`model:NAME`, `route:ROUTE:NAME`, `fallback:NAME` or `canary:NAME`)."""
        kind, _, rest = (label or "").partition(":")
        route = rest.rsplit(":", 1)[0] if kind == "route" else None
        taken = [r for r in routes if r is not None]
        pools = sorted({r.pool for r in taken if r.pool is not None})
        replicas = sorted({r.replica for r in taken}, key=lambda name: (len(name), name))
        return cls(
            model,
            ",".join(pools) or None,
            ",".join(replicas) or None,
            route,
            kind == "fallback",
            rest if kind == "canary" else None,
        )


@dataclass(frozen=True)
class Provenance:
    """One request's provenance record; `id` is the request's id."""

    id: str
    model: ModelProvenance
    route: RouteTaken
    adapter: str | None = None
    adapter_hash: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The record as the log line, the admin endpoint and the gate show it (flat, with the
        route nested)."""
        return {
            "id": self.id,
            **dataclasses.asdict(self.model),
            "adapter": self.adapter,
            "adapter_hash": self.adapter_hash,
            "route": dataclasses.asdict(self.route),
        }


class ProvenanceBook:
    """One app's provenance: the model's record, the loaded adapters' hashes and the recent
    requests' records by id (bounded; the oldest go first)."""

    def __init__(self, model: ModelProvenance, max_records: int = RECENT_RECORDS) -> None:
        self.model = model
        self._max_records = max_records
        self._adapters: dict[str, str] = {}  # name -> content hash
        self._records: collections.OrderedDict[str, Provenance] = collections.OrderedDict()
        self._lock = threading.Lock()  # adapters are hashed on worker threads

    def adapter_loaded(self, name: str, path: str | Path) -> None:
        """Hash an adapter just loaded (reads its files: call it off the event loop). An adapter
        the engine read from where this process cannot (another host) gets no hash."""
        try:
            content_hash = adapter_digest(path)
        except OSError as exc:
            logger.warning("LoRA adapter %r: cannot hash %s for provenance (%s)", name, path, exc)
            self.adapter_unloaded(name)
            return
        with self._lock:
            self._adapters[name] = content_hash

    def adapter_unloaded(self, name: str) -> None:
        with self._lock:
            self._adapters.pop(name, None)

    def adapter_hash(self, name: str) -> str | None:
        return self._adapters.get(name)

    def record(
        self, request_id: str, adapter: str | None, routes: Iterable[StreamRoute | None], label: str | None = None
    ) -> Provenance:
        """The provenance of a request just routed (`label`: its x-pagoda-route), kept to be
        found by its id."""
        provenance = Provenance(
            request_id,
            self.model,
            RouteTaken.of(self.model.model, routes, label),
            adapter,
            self.adapter_hash(adapter) if adapter is not None else None,
        )
        with self._lock:
            self._records[request_id] = provenance
            while len(self._records) > self._max_records:
                self._records.popitem(last=False)
        return provenance

    def find(self, provenance_id: str) -> Provenance | None:
        return self._records.get(provenance_id)
