"""The parsers of files pagoda is handed, fuzzed: GGUF (header, counts, metadata strings and
arrays, tensor infos, dimensions, alignment, offsets), safetensors headers, tokenizer files,
PEFT adapter configs and chat templates.

Each target is seeded with the shapes of the peer engines' advisories (llama.cpp CVE-2025-49847
and Ollama CVE-2026-7482: counts and lengths past the file, tensor data outside it) and then
mutated by hypothesis, deterministically (`derandomize`) and within a bounded number of examples,
so the whole file runs in about a minute. Every input must end in the parser's one error type
(ValueError and its subclasses: ArtifactError, InvalidRequest) or in success: no other exception,
no hang, and no allocation beyond a small multiple of the file's size. `pagoda inspect` and
`pagoda generate` on each crafted GGUF print one line and exit non-zero, with no traceback.
"""

from __future__ import annotations

import json
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.gguf_layout import check_gguf_layout
from pagoda.quant.gguf_checkpoint import GGUFCheckpoint

FUZZ = settings(
    max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
# Peak Python allocation a parser may make for a file of n bytes: a small multiple, plus the
# fixed cost of the reader's own objects.
ALLOWED_PEAK = lambda size: 16 * size + (8 << 20)  # noqa: E731


def seed_gguf(path: Path) -> bytes:
    """A tiny, valid GGUF: a llama header, a few metadata kinds (strings, arrays of numbers and
    of strings, the alignment) and two tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("seed")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_token_list(["a", "b", "c"])
    writer.add_array("seed.numbers", [1, 2, 3])
    writer.add_uint32("general.alignment", 32)
    writer.add_tensor("token_embd.weight", np.ones((3, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return seed_gguf(tmp_path_factory.mktemp("seed") / "seed.gguf")


def header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def gguf_string(text: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text


def tensor_info(name: bytes, dims: list[int], kind: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    return (
        gguf_string(name)
        + struct.pack("<I", len(dims) if n_dims is None else n_dims)
        + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", kind, offset)
    )


def kv(key: bytes, kind: int, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", kind) + payload


ARCH = kv(b"general.architecture", 8, gguf_string(b"llama"))
CRAFTED: dict[str, bytes] = {
    "tensor count past the file": header(1 << 62, 0),
    "metadata count past the file": header(0, (1 << 64) - 1),
    "string length past the file": header(0, 1) + gguf_string(b"general.name", 1 << 60),
    "key length past the file": header(0, 1) + struct.pack("<Q", 1 << 63) + b"k",
    "array count past the file": header(0, 2) + ARCH + kv(b"x", 9, struct.pack("<IQ", 10, 1 << 61)),
    "string array count past the file": header(0, 2) + ARCH + kv(b"x", 9, struct.pack("<IQ", 8, 1 << 40)),
    "arrays nested without end": header(0, 1) + kv(b"x", 9, struct.pack("<IQ", 9, 1) * 64),
    "unknown value type": header(0, 2) + ARCH + kv(b"x", 77, b"\0" * 16),
    "alignment zero": header(0, 2) + ARCH + kv(b"general.alignment", 4, struct.pack("<I", 0)),
    "alignment not a power of two": header(0, 2) + ARCH + kv(b"general.alignment", 4, struct.pack("<I", 48)),
    "too many dimensions": header(1, 1) + ARCH + tensor_info(b"t", [1] * 64),
    "dimension count past the file": header(1, 1) + ARCH + tensor_info(b"t", [4], n_dims=1 << 31),
    "zero dimension": header(1, 1) + ARCH + tensor_info(b"t", [0, 4]),
    "dimensions overflowing": header(1, 1) + ARCH + tensor_info(b"t", [1 << 40, 1 << 40, 1 << 40]),
    "unknown tensor type": header(1, 1) + ARCH + tensor_info(b"t", [4], kind=999),
    "tensor data past the file": header(1, 1) + ARCH + tensor_info(b"t", [1 << 20]),
    "tensor offset past the file": header(1, 1) + ARCH + tensor_info(b"t", [4], offset=(1 << 63)),
    "tensor offset unaligned": header(1, 1) + ARCH + tensor_info(b"t", [4], offset=3) + b"\0" * 64,
    "partial block": header(1, 1) + ARCH + tensor_info(b"t", [33], kind=2),
    "version 1": header(0, 0, version=1),
    "version from the future": header(0, 0, version=99),
    "no magic": b"GGUX" + b"\0" * 64,
    "empty": b"",
}


def reads_safely(path: Path) -> None:
    """Open `path` as pagoda opens a GGUF model; only ValueError may come out, within the
    allocation bound."""
    tracemalloc.start()
    try:
        GGUFCheckpoint(path)
    except ValueError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= ALLOWED_PEAK(path.stat().st_size), f"{peak} bytes allocated for a {path.stat().st_size}-byte file"


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_gguf_headers_are_refused_by_the_layout_check(name: str, tmp_path: Path) -> None:
    path = tmp_path / "crafted.gguf"
    path.write_bytes(CRAFTED[name])
    with pytest.raises(ValueError, match="crafted.gguf"):
        check_gguf_layout(path)
    reads_safely(path)


def test_the_seed_passes(seed: bytes, tmp_path: Path) -> None:
    path = tmp_path / "seed.gguf"
    path.write_bytes(seed)
    check_gguf_layout(path)
    assert GGUFCheckpoint(path).architecture == "llama"


def _header_length(seed: bytes) -> int:
    return min(len(seed), 1024)  # the metadata and tensor infos of the seed


EXTREMES = st.sampled_from(
    [0, 1, 7, 31, 32, 255, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 62, (1 << 63) - 1, (1 << 64) - 1]
)


@FUZZ
@given(data=st.data())
def test_mutated_gguf_files_are_read_or_refused(
    seed: bytes, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    mutated = bytearray(seed)
    span = _header_length(seed)
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        how = data.draw(st.sampled_from(["extreme u64", "extreme u32", "byte", "truncate"]), label="how")
        at = data.draw(st.integers(4, span - 8), label="at")
        if how == "extreme u64":
            struct.pack_into("<Q", mutated, at, data.draw(EXTREMES, label="u64"))
        elif how == "extreme u32":
            struct.pack_into("<I", mutated, at, data.draw(EXTREMES, label="u32") & 0xFFFFFFFF)
        elif how == "byte":
            mutated[at] = data.draw(st.integers(0, 255), label="byte")
        else:
            del mutated[at:]
            break
    path = tmp_path_factory.mktemp("gguf") / "mutated.gguf"
    path.write_bytes(bytes(mutated))
    reads_safely(path)


# ---- pagoda inspect / generate on the crafted files ----------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "tensor count past the file",
        "string length past the file",
        "tensor data past the file",
        "dimensions overflowing",
        "no magic",
    ],
)
@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_the_cli_gives_one_line_and_a_nonzero_exit(name: str, command: str, tmp_path: Path, capsys) -> None:
    from pagoda.cli import main

    path = tmp_path / "model.gguf"
    path.write_bytes(CRAFTED[name])
    argv = (
        ["inspect", str(path)]
        if command == "inspect"
        else ["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "1"]
    )
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse-style exits carry their message in the exception
        code = exit_.code if isinstance(exit_.code, int) else 1
        if not isinstance(exit_.code, int) and exit_.code is not None:
            print(exit_.code, file=__import__("sys").stderr)
    captured = capsys.readouterr()
    assert code != 0
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert "model.gguf" in lines[0]


# ---- safetensors headers ---------------------------------------------------------------------------


def safetensors_bytes(header_json: bytes, body: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header_json) if length is None else length) + header_json + body


SAFETENSORS_CRAFTED = {
    "header length past the file": safetensors_bytes(b"{}", length=1 << 62),
    "header length at the review limit": safetensors_bytes(b"{}", length=100 << 20),
    "offsets past the file": safetensors_bytes(
        json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}).encode()
    ),
    "shape overflowing": safetensors_bytes(
        json.dumps({"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 16]}}).encode(), b"\0" * 16
    ),
    "unknown dtype": safetensors_bytes(
        json.dumps({"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}).encode(), b"\0" * 16
    ),
    "not an object": safetensors_bytes(b"[1, 2]"),
    "not json": safetensors_bytes(b"\xff\xfe{"),
    "deep nesting": safetensors_bytes(b"[" * 10000 + b"]" * 10000),
}


def _model_dir_with(tmp: Path, weights: bytes) -> Path:
    from model_factory import build_model

    model = tmp / "model"
    if not (model / "config.json").exists():
        build_model(model, "llama")
    for shard in model.glob("*.safetensors"):
        shard.unlink()
    (model / "model.safetensors.index.json").unlink(missing_ok=True)
    (model / "model.safetensors").write_bytes(weights)
    return model


@pytest.fixture(scope="module")
def fuzz_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("st")


def safetensors_reads_safely(model: Path) -> None:
    from pagoda.artifacts.review import review_artifact
    from pagoda.model.loader import load_model_config

    size = (model / "model.safetensors").stat().st_size
    tracemalloc.start()
    try:
        for read in (lambda: review_artifact(model), lambda: _load_weights(model, load_model_config(str(model)))):
            try:
                read()
            except ValueError:
                pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= ALLOWED_PEAK(size) + (32 << 20)  # plus the tiny model built around the file


def _load_weights(model: Path, config) -> None:
    import torch

    from pagoda.model.loader import load_model

    load_model(str(model), config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", sorted(SAFETENSORS_CRAFTED))
def test_crafted_safetensors_headers_are_refused(name: str, fuzz_model: Path) -> None:
    safetensors_reads_safely(_model_dir_with(fuzz_model, SAFETENSORS_CRAFTED[name]))


@settings(FUZZ, max_examples=40)
@given(
    header=st.recursive(
        st.none() | st.booleans() | st.integers(-(1 << 64), 1 << 64) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=12,
    ),
    body=st.binary(max_size=64),
)
def test_fuzzed_safetensors_headers_are_read_or_refused(fuzz_model: Path, header, body: bytes) -> None:
    text = json.dumps({"w": header} if not isinstance(header, dict) else header).encode()
    safetensors_reads_safely(_model_dir_with(fuzz_model, safetensors_bytes(text, body)))


# ---- tokenizer files, PEFT adapter configs, chat templates -------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pagoda.config import DEFAULT_MODEL_DIR

    directory = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, directory / name)
    return directory


TOKENIZER_CRAFTED = [
    b"",
    b"{",
    b"[]",
    b"null",
    b'{"model": 5}',
    b'{"model": {"type": "BPE", "vocab": [1]}}',
    b"\xff\xfe\x00",
    b"[" * 5000 + b"]" * 5000,
    b'{"version": "1.0", "model": {"type": "WordPiece", "vocab": {}, "unk_token": 7}}',
]


@settings(FUZZ, max_examples=40)
@given(
    content=st.sampled_from(TOKENIZER_CRAFTED) | st.binary(max_size=200),
    config=st.sampled_from(
        [
            b"{}",
            b"[]",
            b'{"tokenizer_class": "NoSuchTokenizer"}',
            b'{"model_max_length": "x"}',
            b'{"auto_map": {"AutoTokenizer": ["evil.E", null]}}',
        ]
    ),
)
def test_fuzzed_tokenizer_files_are_read_or_refused(
    tokenizer_dir: Path, tmp_path_factory, content: bytes, config: bytes
) -> None:
    from pagoda.tokenizer import Tokenizer

    directory = tmp_path_factory.mktemp("tokfuzz")
    (directory / "tokenizer.json").write_bytes(content)
    (directory / "tokenizer_config.json").write_bytes(config)
    try:
        Tokenizer.from_pretrained(directory)
    except ValueError:
        pass


@pytest.fixture(scope="module")
def adapter_base(tmp_path_factory: pytest.TempPathFactory):
    from model_factory import build_model
    from pagoda.model.loader import load_model_config

    model = build_model(tmp_path_factory.mktemp("base") / "model", "llama")
    return load_model_config(str(model))


@settings(FUZZ, max_examples=60)
@given(
    config=st.recursive(
        st.none() | st.booleans() | st.integers(-(1 << 40), 1 << 40) | st.floats() | st.text(max_size=12),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "r",
                        "lora_alpha",
                        "target_modules",
                        "peft_type",
                        "use_dora",
                        "fan_in_fan_out",
                        "rank_pattern",
                        "alpha_pattern",
                        "bias",
                        "modules_to_save",
                        "layers_to_transform",
                        "use_rslora",
                    ]
                ),
                inner,
                max_size=6,
            )
        ),
        max_leaves=16,
    )
)
def test_fuzzed_adapter_configs_are_read_or_refused(adapter_base, tmp_path_factory, config) -> None:
    from pagoda.lora.adapter import load_peft_adapter

    directory = tmp_path_factory.mktemp("adapter")
    (directory / "adapter_config.json").write_text(json.dumps(config))
    (directory / "adapter_model.safetensors").write_bytes(safetensors_bytes(b"{}"))
    try:
        load_peft_adapter("fuzz", directory, adapter_base, max_rank=16)
    except ValueError:
        pass


TEMPLATE_PIECES = [
    "{{ messages[0].content }}",
    "{% for m in messages %}{{ m.role }}{% endfor %}",
    "{{ 1/0 }}",
    "{% include 'x' %}",
    "{% import 'x' as y %}",
    "{{ range(100001)|list }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__mro__ }}",
    "{% if %}",
    "{{",
    "{% for %}",
    "{{ raise_exception('x') }}",
    "{{ 'a' * 3 }}",
    "{{ messages|tojson }}",
    "{% set x = namespace(a=1) %}{{ x.a }}",
    "{{ cycler.__init__.__globals__ }}",
    "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
]


@settings(FUZZ, max_examples=80)
@given(pieces=st.lists(st.sampled_from(TEMPLATE_PIECES) | st.text(max_size=10), min_size=1, max_size=4))
def test_fuzzed_chat_templates_render_or_are_refused(tokenizer_dir: Path, pieces: list[str]) -> None:
    from pagoda.errors import InvalidRequest

    tokenizer = _tokenizer(tokenizer_dir)
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="".join(pieces))
    except InvalidRequest:
        return
    assert "__globals__" not in rendered and "<class" not in rendered  # the sandbox held


_TOKENIZERS: dict[Path, object] = {}


def _tokenizer(directory: Path):
    from pagoda.tokenizer import Tokenizer

    if directory not in _TOKENIZERS:
        _TOKENIZERS[directory] = Tokenizer.from_pretrained(directory)
    return _TOKENIZERS[directory]


def test_serve_refuses_a_crafted_gguf_in_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    path = tmp_path / "model.gguf"
    path.write_bytes(CRAFTED["tensor count past the file"])
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "model.gguf" in lines[0]


def _cli_one_line(argv: list[str], capsys) -> str:
    from pagoda.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize(
    "name",
    ["header length past the file", "offsets past the file", "shape overflowing", "not an object", "deep nesting"],
)
@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_the_cli_refuses_a_crafted_safetensors_file_in_one_line(
    name: str, command: str, fuzz_model: Path, capsys
) -> None:
    model = _model_dir_with(fuzz_model, SAFETENSORS_CRAFTED[name])
    capsys.readouterr()  # the model factory's progress bar
    argv = (
        ["inspect", str(model)]
        if command == "inspect"
        else ["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "1"]
    )
    assert "model.safetensors" in _cli_one_line(argv, capsys)


@pytest.mark.parametrize("content", [b"{", b'{"model": 5}', b"[" * 5000 + b"]" * 5000])
def test_generate_refuses_a_crafted_tokenizer_in_one_line(content: bytes, tmp_path: Path, capsys) -> None:
    from model_factory import build_model

    model = build_model(tmp_path / "model", "llama")
    from pagoda.config import DEFAULT_MODEL_DIR

    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer_config.json", model / "tokenizer_config.json")
    (model / "tokenizer.json").write_bytes(content)
    capsys.readouterr()  # the model factory's progress bar
    line = _cli_one_line(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "1"], capsys)
    assert "tokenizer" in line
