"""The artifact review `pagoda inspect` prints: what a model directory, GGUF file or LoRA adapter
is (architecture, size, formats, tokenizer, template, license, origin) and what every file of it
hashes to. Pure reading: config.json, safetensors headers, GGUF metadata; no weights loaded."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.artifacts.digests import ArtifactError, ArtifactFiles, sha256_bytes, sha256_file
from pagoda.artifacts.manifest import read_manifest
from pagoda.artifacts.verify import compare_digests

if TYPE_CHECKING:
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint

# The config.json a GGUF file's metadata makes; its families know (pagoda.model.families.base.gguf_config).
GGUFConfigReader = Callable[["GGUFCheckpoint"], dict[str, Any]]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "LICENCE", "COPYING")
_ADAPTER_CONFIG = "adapter_config.json"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# What a chat template does beyond plain turns, by the names templates use for it.
_TEMPLATE_BEHAVIOURS = {
    "tools": ("tools", "tool_calls"),
    "reasoning": ("<think>", "enable_thinking", "reasoning_content", "thinking"),
    "system prompt": ("'system'", '"system"'),
    "generation prompt": ("add_generation_prompt",),
}
_LORA_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class FileDigest:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ChatTemplateReview:
    source: str  # the file (or GGUF key) it was read from
    sha256: str
    behaviours: list[str]


@dataclass(frozen=True)
class AdapterReview:
    base_model: str | None  # as the adapter declares it
    rank: int | None
    alpha: float | None
    target_modules: list[str]
    compatibility: str  # "compatible with BASE", "incompatible with BASE: why", or "not checked ..."


@dataclass
class ArtifactReview:
    path: str
    kind: str  # "model", "gguf" or "lora-adapter"
    architecture: str | None = None
    parameters: int | None = None
    active_parameters: int | None = None  # set for mixtures of experts only
    dtype: str | None = None
    quantization: str = "none"
    context_length: int | None = None
    vocab_size: int | None = None
    kv_bytes_per_token: int | None = None
    kv_dtype: str | None = None
    tokenizer_files: dict[str, str] = field(default_factory=dict)  # name -> SHA-256
    chat_template: ChatTemplateReview | None = None
    generation_config: dict[str, Any] | None = None
    generation_config_sha256: str | None = None
    license: str = "unknown"
    source: str = "unknown"
    revision: str = "unknown"
    adapter: AdapterReview | None = None
    manifest: str = "none"  # the manifest's id and whether the files match it
    signature: str = "none"
    files: list[FileDigest] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def review_artifact(
    path: str | Path, base: str | Path | None = None, *, gguf_config: GGUFConfigReader | None = None
) -> ArtifactReview:
    """Review a model directory, GGUF file (or a directory holding one) or PEFT adapter; `base`
    is the model an adapter is checked against. ArtifactError for pickle files or unreadable ones.
    gguf_config: how a GGUF file's metadata becomes a config.json; without it, the decoder's shape
    only, with the file's own `general.architecture` for its architecture."""
    files = ArtifactFiles.of(path)
    pickles = files.pickle_files()
    if pickles:
        raise ArtifactError(
            f"{path}: pickle files, which pagoda refuses (loading one can run any code it holds): "
            f"{', '.join(pickles)}; convert them to safetensors where you trust them"
        )
    if files.single_file is not None and not files.single_file.endswith(".gguf"):
        raise ArtifactError(f"{path}: a single file must be a GGUF model; pass the model's directory")
    digests = files.digests()
    review = ArtifactReview(path=str(path), kind="model")
    review.files = [FileDigest(name, (files.root / name).stat().st_size, digest) for name, digest in digests.items()]
    review.tokenizer_files = {n: d for n, d in digests.items() if Path(n).name in TOKENIZER_FILES}
    gguf_name = next((n for n in digests if n.endswith(".gguf")), None)
    if (files.root / _ADAPTER_CONFIG).is_file() and files.single_file is None:
        _review_adapter(review, files.root, base, gguf_config or _gguf_shape)
    elif gguf_name is not None:
        _review_gguf(review, files.root / gguf_name, gguf_config or _gguf_shape)
    else:
        _review_checkpoint(review, files.root, digests)
    if files.single_file is None:
        _review_template(review, files.root)
        _review_card(review, files.root)
    _review_manifest(review, files, digests)
    return review


# ---- checkpoints ------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ArtifactError(f"{path}: unreadable JSON ({error})") from None
    if not isinstance(body, dict):
        raise ArtifactError(f"{path}: must hold a JSON object")
    return body


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors' dtypes and shapes from a safetensors file's JSON header. The header's
    stated length is checked against the file before a byte of it is read."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            size = os.fstat(file.fileno()).st_size
            if length > min(100 << 20, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(file.read(length))
    except RecursionError:
        raise ArtifactError(f"{path}: unreadable safetensors header (nested too deeply)") from None
    except (OSError, ValueError, struct.error) as error:
        raise ArtifactError(f"{path}: unreadable safetensors header ({error})") from None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for k, v in header.items() if k != "__metadata__"):
        raise ArtifactError(f"{path}: unreadable safetensors header (not a map of tensor entries)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    for name, entry in header.items():
        problem = _safetensors_entry_problem(entry, data_bytes)
        if problem is not None:
            raise ArtifactError(f"{path}: unreadable safetensors header (tensor {name[:80]!r}: {problem})")
    return header


# Bytes per element of safetensors' dtypes (a dtype not listed is checked for bounds only).
_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}


def _safetensors_entry_problem(entry: dict[str, Any], data_bytes: int) -> str | None:
    """What is wrong with one tensor entry of a header whose data section has `data_bytes`."""
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        return "no dtype"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return "its shape is not a list of sizes"
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        return "its data_offsets are not two integers"
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        return f"its data [{begin}, {end}) lies outside the file's {data_bytes} data bytes"
    if dtype in _SAFETENSORS_DTYPE_BYTES:
        numel = 1
        for dim in shape:
            numel *= dim
        if numel * _SAFETENSORS_DTYPE_BYTES[dtype] != end - begin:
            return f"shape {shape} of {dtype} does not match its {end - begin} bytes"
    return None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's keys: a multimodal config's `text_config`, else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _review_checkpoint(review: ArtifactReview, root: Path, digests: dict[str, str]) -> None:
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ArtifactError(f"{root}: no config.json, GGUF file or adapter_config.json: not a model artifact")
    config = _read_json(config_path)
    text = _text_config(config)
    architectures = config.get("architectures") or [config.get("model_type")]
    review.architecture = str(architectures[0]) if architectures and architectures[0] else None
    review.dtype = config.get("dtype") or config.get("torch_dtype")
    review.context_length = text.get("max_position_embeddings")
    review.vocab_size = text.get("vocab_size")
    quantization = config.get("quantization_config")
    bits = 16
    if isinstance(quantization, dict):
        bits = int(quantization.get("bits") or 16)
        parts = [str(quantization.get("quant_method", "unknown")), f"{bits}-bit" if "bits" in quantization else ""]
        if quantization.get("group_size"):
            parts.append(f"group size {quantization['group_size']}")
        review.quantization = " ".join(p for p in parts if p)
    tensors: dict[str, dict[str, Any]] = {}
    for name in digests:
        if name.endswith(".safetensors"):
            tensors.update(safetensors_header(root / name))
    tensor_dtypes = sorted({t.get("dtype", "?") for t in tensors.values()})
    if tensor_dtypes:
        review.dtype = f"{review.dtype or 'unspecified'} (tensors: {', '.join(tensor_dtypes)})"
    counts = {name: _logical_elements(name, t.get("shape", []), bits) for name, t in tensors.items()}
    _count_parameters(review, counts, text, expert_marker=".experts.")
    _kv_bytes(review, text, str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"))
    review.source = str(config.get("_name_or_path") or "unknown")
    generation_path = root / "generation_config.json"
    if generation_path.is_file():
        review.generation_config = _read_json(generation_path)
        review.generation_config_sha256 = digests.get("generation_config.json")


def _logical_elements(name: str, shape: list[int], bits: int) -> int:
    """Weights a tensor stands for: GPTQ's packed int32 codes count each code, its scales,
    zeros and group indices count nothing."""
    elements = 1
    for size in shape:
        elements *= int(size)
    if name.endswith(".qweight"):
        return elements * (32 // bits)
    if name.endswith((".qzeros", ".scales", ".g_idx")):
        return 0
    return elements


def _count_parameters(
    review: ArtifactReview, counts: dict[str, int], config: dict[str, Any], expert_marker: str
) -> None:
    review.parameters = sum(counts.values())
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    top_k = config.get("num_experts_per_tok")
    if num_experts and top_k:
        routed = sum(count for name, count in counts.items() if expert_marker in name)
        review.active_parameters = review.parameters - routed + routed * int(top_k) // int(num_experts)


def _kv_bytes(review: ArtifactReview, config: dict[str, Any], dtype: str) -> None:
    """K and V of every layer for one token, at the checkpoint's dtype (bfloat16 if unknown)."""
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    if not layers or not heads:
        return
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    review.kv_dtype = dtype if dtype in _DTYPE_BYTES else "bfloat16"
    if config.get("kv_lora_rank"):  # multi-head latent attention: a latent and a rope key per layer
        latent = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
        review.kv_bytes_per_token = int(layers) * latent * _DTYPE_BYTES[review.kv_dtype]
        return
    review.kv_bytes_per_token = 2 * int(layers) * int(kv_heads) * int(head_dim) * _DTYPE_BYTES[review.kv_dtype]


# ---- GGUF ---------------------------------------------------------------------------------------


def _gguf_shape(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    return {**checkpoint.decoder_config(experts_may_stand_in=True), "architectures": [checkpoint.architecture]}


def _review_gguf(review: ArtifactReview, path: Path, gguf_config: GGUFConfigReader) -> None:
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint

    review.kind = "gguf"
    try:
        checkpoint = GGUFCheckpoint(path)
        config = gguf_config(checkpoint)
    except ValueError as error:
        raise ArtifactError(str(error)) from None
    review.architecture = config["architectures"][0]
    review.context_length = config.get("max_position_embeddings")
    review.vocab_size = config.get("vocab_size")
    types = sorted({t.tensor_type.name for t in checkpoint.reader.tensors})
    review.dtype = ", ".join(types)
    quantized = [t for t in types if t not in ("F32", "F16", "BF16")]
    review.quantization = f"GGUF {', '.join(quantized)}" if quantized else "none"
    counts = {t.name: int(t.n_elements) for t in checkpoint.reader.tensors}
    _count_parameters(review, counts, config, expert_marker="_exps.")
    _kv_bytes(review, config, "float32" if types == ["F32"] else "bfloat16")
    metadata = {
        key: _gguf_value(checkpoint, key)
        for key in (
            "general.license",
            "general.source.url",
            "general.source.huggingface.repository",
            "general.name",
            "tokenizer.chat_template",
        )
    }
    review.license = str(metadata["general.license"] or "unknown")
    review.source = str(
        metadata["general.source.huggingface.repository"]
        or metadata["general.source.url"]
        or metadata["general.name"]
        or "unknown"
    )
    template = metadata["tokenizer.chat_template"]
    if isinstance(template, str):
        review.chat_template = _template_review("tokenizer.chat_template (GGUF metadata)", template)


def _gguf_value(checkpoint: Any, key: str) -> Any:
    field_ = checkpoint.reader.fields.get(key)
    try:
        return field_.contents() if field_ is not None else None
    except Exception:  # a malformed optional field is reported as absent
        return None


# ---- LoRA adapters -------------------------------------------------------------------------------


def _review_adapter(review: ArtifactReview, root: Path, base: str | Path | None, gguf_config: GGUFConfigReader) -> None:
    review.kind = "lora-adapter"
    config = _read_json(root / _ADAPTER_CONFIG)
    weights = root / "adapter_model.safetensors"
    tensors = safetensors_header(weights) if weights.is_file() else {}
    review.parameters = sum(_logical_elements(n, t.get("shape", []), 16) for n, t in tensors.items())
    review.dtype = ", ".join(sorted({t.get("dtype", "?") for t in tensors.values()})) or None
    review.architecture = f"LoRA ({config.get('peft_type', 'LORA')})"
    declared = config.get("base_model_name_or_path")
    review.source = str(declared or "unknown")
    targets = config.get("target_modules") or []
    targets = sorted(targets) if isinstance(targets, list) else [str(targets)]
    if base is None:
        compatibility = "not checked (pass --base MODEL)"
    else:
        problem = _adapter_mismatch(tensors, Path(base), gguf_config)
        compatibility = f"compatible with {base}" if problem is None else f"incompatible with {base}: {problem}"
    review.adapter = AdapterReview(
        str(declared) if declared else None, config.get("r"), config.get("lora_alpha"), targets, compatibility
    )


def _adapter_mismatch(tensors: dict[str, dict[str, Any]], base: Path, gguf_config: GGUFConfigReader) -> str | None:
    """Why the adapter's A/B shapes do not fit the base model's projections, or None."""
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint, find_gguf_file

    gguf_file = find_gguf_file(base) if base.exists() else None
    try:
        config = gguf_config(GGUFCheckpoint(gguf_file)) if gguf_file else _read_json(base / "config.json")
    except ValueError as error:
        return f"its config is unreadable ({error})"
    config = _text_config(config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    hidden, inter = config["hidden_size"], config.get("intermediate_size", 0)
    q, kv = heads * head_dim, (config.get("num_key_value_heads") or heads) * head_dim
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    for name, tensor in sorted(tensors.items()):
        match = _LORA_TENSOR.search(name)
        if match is None:
            return f"tensor {name!r} is not a LoRA A/B of a decoder projection"
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= config["num_hidden_layers"]:
            return f"{name} adapts layer {layer}; the base has {config['num_hidden_layers']} layers"
        if module not in shapes:
            return f"{name} targets {module!r}, which the base model does not have"
        in_features, out_features = shapes[module]
        shape = tensor.get("shape", [])
        expected_side, actual_side = (in_features, shape[1]) if which == "A" else (out_features, shape[0])
        if len(shape) != 2 or actual_side != expected_side:
            return (
                f"{name} has shape {shape}; the base's {module} needs {'in' if which == 'A' else 'out'} "
                f"features {expected_side}"
            )
    return None


# ---- tokenizer, template, card, manifest --------------------------------------------------------------


def _template_review(source: str, template: str) -> ChatTemplateReview:
    behaviours = [name for name, markers in _TEMPLATE_BEHAVIOURS.items() if any(m in template for m in markers)]
    return ChatTemplateReview(source, sha256_bytes(template.encode()), behaviours)


def _review_template(review: ArtifactReview, root: Path) -> None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        review.chat_template = _template_review(jinja.name, jinja.read_text(errors="replace"))
        return
    config_path = root / "tokenizer_config.json"
    if not config_path.is_file():
        return
    template = _read_json(config_path).get("chat_template")
    if isinstance(template, list):  # named templates: the default one is what chat requests use
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        review.chat_template = _template_review("tokenizer_config.json chat_template", template)


def _review_card(review: ArtifactReview, root: Path) -> None:
    """License from the model card's front matter, else a LICENSE file; unknown otherwise."""
    card = root / "README.md"
    if card.is_file():
        text = card.read_text(errors="replace")
        front = text.split("---", 2)[1] if text.startswith("---") and text.count("---") >= 2 else ""
        values = dict(re.findall(r"^(license|license_name|base_model):\s*(.+?)\s*$", front, re.M))
        license_ = values.get("license_name") if values.get("license") == "other" else values.get("license")
        if license_:
            review.license = license_.strip("'\"")
    if review.license == "unknown":
        for name in LICENSE_FILES:
            path = root / name
            if path.is_file():
                first = next(
                    (line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()), ""
                )
                review.license = f"{first[:80]} ({name}, sha256 {sha256_file(path)[:12]})"
                break


def _review_manifest(review: ArtifactReview, files: ArtifactFiles, digests: dict[str, str]) -> None:
    if files.manifest_path.is_file():
        try:
            manifest = read_manifest(files)
            if manifest.hash != "sha256":  # the review's digests are SHA-256
                digests = files.digests(manifest.hash)
            compare_digests(files, manifest.files, digests, manifest.hash)
            review.manifest = f"{manifest.digest} (every file matches)"
        except ArtifactError as error:
            review.manifest = f"does not match: {error}"
        else:
            if manifest.source:
                review.source = manifest.source
            if manifest.revision:
                review.revision = manifest.revision
    if files.signature_path.is_file():
        review.signature = f"{files.signature_path.name} (check it with --verify-key)"


# ---- rendering ---------------------------------------------------------------------------------------


def review_rows(review: ArtifactReview) -> list[tuple[str, str]]:
    """(field, value) rows of everything but the file list, in the order a reviewer reads them."""

    def count(n: int | None) -> str:
        return "unknown" if n is None else f"{n:,}"

    rows = [
        ("path", review.path),
        ("kind", review.kind),
        ("architecture", review.architecture or "unknown"),
        ("parameters", count(review.parameters)),
    ]
    if review.active_parameters is not None:
        rows.append(("active parameters", count(review.active_parameters)))
    rows += [
        ("dtype", review.dtype or "unknown"),
        ("quantization", review.quantization),
        ("context length", count(review.context_length)),
        ("vocabulary", count(review.vocab_size)),
    ]
    if review.kv_bytes_per_token is not None:
        rows.append(("KV bytes per token", f"{review.kv_bytes_per_token:,} ({review.kv_dtype})"))
    for name, digest in review.tokenizer_files.items():
        rows.append(("tokenizer file", f"{name} sha256 {digest}"))
    if review.chat_template is not None:
        template = review.chat_template
        rows.append(("chat template", f"{template.source} sha256 {template.sha256}"))
        rows.append(("template behaviours", ", ".join(template.behaviours) or "plain turns"))
    if review.generation_config is not None:
        rows.append(("generation config", json.dumps(review.generation_config, sort_keys=True)))
    if review.adapter is not None:
        adapter = review.adapter
        rows += [
            ("adapter base model", adapter.base_model or "unknown"),
            ("adapter rank / alpha", f"{adapter.rank} / {adapter.alpha}"),
            ("adapter targets", ", ".join(adapter.target_modules) or "unknown"),
            ("base compatibility", adapter.compatibility),
        ]
    rows += [
        ("license", review.license),
        ("source", review.source),
        ("revision", review.revision),
        ("manifest", review.manifest),
        ("signature", review.signature),
    ]
    return rows


def render_table(review: ArtifactReview) -> str:
    rows = review_rows(review)
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append("")
    size_width = max((len(f"{f.size:,}") for f in review.files), default=1)
    lines.append(f"files ({len(review.files)}):")
    lines += [f"  {f.sha256}  {f.size:>{size_width},}  {f.name}" for f in review.files]
    return "\n".join(lines)


def render_markdown(review: ArtifactReview) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [f"## Artifact review: `{review.path}`", "", "| field | value |", "|---|---|"]
    lines += [f"| {name} | {cell(value)} |" for name, value in review_rows(review)]
    lines += ["", "| file | bytes | sha256 |", "|---|---:|---|"]
    lines += [f"| `{cell(f.name)}` | {f.size:,} | `{f.sha256}` |" for f in review.files]
    return "\n".join(lines)


def render_json(review: ArtifactReview) -> str:
    return json.dumps(review.to_dict(), indent=2)
