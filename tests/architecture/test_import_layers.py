"""Imports run one way: core <- kv_transfer <- worker <- spec_decode <- engine <- serve/bench/cli.

Parses every module of the package (imports inside functions included: a lazy import is still
a dependency) and fails on an import from a lower layer into a higher one, on an import between
two units of the same layer, and on a cycle between modules. serve/ holds its engine only as an
EngineClient (engine/client.py), never by its class.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "pagoda"

# Lowest first. A unit is a top-level module or subpackage of pagoda; it may import units of
# lower layers and itself, nothing else. "pagoda" is the package's front (`from pagoda import
# LLM, SamplingParams`), for the applications on top.
LAYERS: list[tuple[str, ...]] = [
    (
        "errors",  # InvalidRequest: raised by sampling_params, tokenizer and engine alike
        "rl",  # a trainer's weight-update group and HTTP helper: torch only, engine/ receives with it
        "dataclass_flags",  # command-line flags generated from the settings dataclasses
        "stats",  # percentiles of samples and of histograms: bench, ops, serve's dashboard, benchmarks/
        "data_files",  # YAML/JSON settings files users write: guard's rules, serve's price table
        "http_client",  # SSE reader, server start and /health wait: bench, ops, tests, benchmarks/
        "gguf_layout",
    ),  # a GGUF header's counts and offsets checked against the file: tokenizer, quant
    ("gguf_tokenizer",),  # a GGUF file's vocabulary as a `tokenizers` tokenizer, as llama.cpp splits text
    ("diagnosis",),  # triage rules over metric samples (on stats): ops' doctor and serve's dashboard
    (
        "config",
        "sampling_params",
        "outputs",
        "tokenizer",
        "lora_request",
        "media_item",
    ),  # LoRARequest / AdapterIdentity, MediaItem (an image's pixels, hash, placeholders): what requests carry
    ("request",),
    ("native",),  # the C++ CPU kernels (pagoda/csrc) built on first use: torch only, reached through kernels/
    ("quant",),  # weight formats and KV cache dtypes: torch only, used by model/ and plan
    ("kernels",),  # the ops the model calls, one implementation each per device: native, PyTorch, Triton
    ("structured",),  # grammar-constrained decoding on llguidance (its bitmask op in kernels/): worker, engine, serve
    ("artifacts",),  # file digests, manifests, signatures (model-signing), inspect's review: model/, engine, cli
    ("model",),
    ("media",),  # images in: safe decoding, URLs, the image processor and placeholder expansion (engine's LLM, serve)
    ("lora",),  # LoRA adapters: PEFT loading, registry, device slots, the LoRALinear around model/'s Linear
    ("core",),
    ("kv_transfer",),
    ("worker",),
    ("spec_decode",),
    ("executor",),  # tensor-parallel workers (processes or Ray actors) beside the engine core
    ("engine",),
    ("replicas",),  # data-parallel replicas and their router: AsyncLLMs behind one front
    ("pagoda",),
    ("guard",),  # guardrails: pattern rules and a classifier model run through the engine
    ("serve", "bench", "plan", "eval", "batch_offline"),  # pagoda run-batch: OpenAI batch lines through the offline LLM
    ("ops",),  # gate and audit: HTTP clients that reuse bench's load generator, no engine code
    ("cli",),
]
LAYER_OF = {unit: index for index, units in enumerate(LAYERS) for unit in units}


def module_names() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ["pagoda", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield base, node.lineno
            for alias in node.names:  # `from pagoda.core import scheduler` imports a module
                yield f"{base}.{alias.name}", node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {pagoda module it imports: line}."""
    modules = module_names()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        graph[module] = {}
        for name, line in imported_names(module, path):
            if name in modules and name != module:
                graph[module].setdefault(name, line)
    return graph


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pagoda"


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(module) for module in module_names()} - {"bundled_models"}
    assert units - set(LAYER_OF) == set(), "add the new module or package to LAYERS"


def test_imports_point_down() -> None:
    wrong = []
    for module, imports in import_graph().items():
        unit = unit_of(module)
        for target, line in imports.items():
            other = unit_of(target)
            if other == unit:
                continue
            if LAYER_OF[other] >= LAYER_OF[unit]:
                kind = "sideways" if LAYER_OF[other] == LAYER_OF[unit] else "upward"
                wrong.append(f"{module}:{line} imports {target} ({kind}: {unit} -> {other})")
    assert wrong == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        path.append(module)
        for target in graph[module]:
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert cycles == []


def test_the_check_sees_imports() -> None:
    # Guard against a parser that silently finds nothing: known edges must be there.
    graph = import_graph()
    assert "pagoda.core.scheduler" in graph["pagoda.worker.model_runner"]
    assert "pagoda.worker.sampler" in graph["pagoda.spec_decode.rejection_sampler"]
    assert "pagoda.engine.llm" in graph["pagoda"]  # a lazy import inside a function counts


# What serve/ must not name: the engine clients' classes (it holds an EngineClient).
ENGINE_CLIENT_CLASSES = ("pagoda.engine.async_llm", "pagoda.replicas.replica_set", "pagoda.replicas.routed_stream")


def test_serve_is_typed_against_the_engine_client() -> None:
    serve_modules = {
        module: path
        for module, path in module_names().items()
        if module.startswith("pagoda.serve.") or module == "pagoda.serve"
    }
    wrong = []
    uses_client = []
    for module, path in serve_modules.items():
        for name, line in imported_names(module, path):
            if any(name == banned or name.startswith(banned + ".") for banned in ENGINE_CLIENT_CLASSES) or name.rsplit(
                ".", 1
            )[-1] in ("AsyncLLM", "ReplicaSet"):
                wrong.append(f"{module}:{line} imports {name}")
            if name == "pagoda.engine.client.EngineClient":
                uses_client.append(module)
    assert wrong == []
    assert "pagoda.serve.serving" in uses_client and "pagoda.serve.app" in uses_client
