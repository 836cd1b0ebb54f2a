"""Bad quantization input from the command line: one line naming the file / tensor and what
is supported, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagoda.cli import main


def _run(capsys: pytest.CaptureFixture, *argv: str) -> str:
    code = main(list(argv))
    captured = capsys.readouterr()
    assert code != 0
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def _copy(model: Path, target: Path) -> Path:
    shutil.copytree(model, target)
    return target


def test_group_size_that_does_not_divide(capsys, llama_dir: Path) -> None:
    line = _run(
        capsys,
        "generate",
        "--model",
        str(llama_dir),
        "--prompt",
        "hi",
        "--quantization",
        "int4",
        "--quantization-group-size",
        "128",
    )
    assert str(llama_dir) in line and "model.layers.0.self_attn.qkv_proj" in line
    assert "int4 group size 128 does not divide its input dimension 64" in line


def test_unknown_quantization_type_in_checkpoint(capsys, llama_dir: Path, tmp_path: Path) -> None:
    model = _copy(llama_dir, tmp_path / "awq")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model / "config.json").write_text(json.dumps(config))
    line = _run(capsys, "generate", "--model", str(model), "--prompt", "hi")
    assert f"{model / 'config.json'}: checkpoint quantization 'awq' is not supported" in line


def test_truncated_safetensors(capsys, llama_dir: Path, tmp_path: Path) -> None:
    model = _copy(llama_dir, tmp_path / "truncated")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20000])
    line = _run(capsys, "generate", "--model", str(model), "--prompt", "hi")
    assert f"{weights}: unreadable safetensors file, corrupt or truncated" in line


def test_corrupt_gguf_and_unsupported_arch(capsys, tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="GGUF support needs the `gguf` package")
    import gguf
    import numpy as np

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    line = _run(capsys, "generate", "--model", str(corrupt), "--prompt", "hi")
    assert f"{corrupt}: not a readable GGUF file, corrupt or truncated" in line

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = _run(capsys, "chat", "--model", str(path))
    assert "GGUF architecture 'mamba' is not supported; pagoda serves llama, qwen2, qwen2moe, qwen3, qwen3moe" in line


def test_unknown_kv_dtype_and_quantization_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "hi", "--kv-cache-dtype", "int4"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--quantization", "awq"])


def test_eval_perplexity_missing_text(capsys) -> None:
    line = _run(capsys, "eval", "perplexity", "--text", "/nonexistent/dir")
    assert line == "pagoda eval perplexity: /nonexistent/dir: no such file or directory"
