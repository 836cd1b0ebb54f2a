"""`pagoda inspect`: the review of every supported artifact format, its digests checked
against hashlib, the output formats, manifests, and the refusals."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.artifacts.digests import ArtifactError, ArtifactFiles
from pagoda.artifacts.review import render_markdown, render_table, review_artifact, safetensors_header
from pagoda.cli import main as cli_main
from pagoda.model.families.base import gguf_config

sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))

from model_factory import build_model  # noqa: E402


def hashlib_digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_safetensors_model(llama_dir: Path, tmp_path: Path) -> None:
    model = copy_model(llama_dir, tmp_path / "llama")
    review = review_artifact(model)
    assert {f.name: f.sha256 for f in review.files} == hashlib_digests(model)
    assert review.kind == "model" and review.architecture == "LlamaForCausalLM"
    header = safetensors_header(model / "model.safetensors")
    expected_params = sum(math.prod(t["shape"]) for t in header.values())
    assert review.parameters == expected_params and review.active_parameters is None
    config = json.loads((model / "config.json").read_text())
    assert review.context_length == config["max_position_embeddings"] and review.vocab_size == config["vocab_size"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert review.kv_bytes_per_token == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert review.quantization == "none" and review.license == "unknown"
    assert set(review.tokenizer_files) == {"tokenizer.json", "tokenizer_config.json"}
    assert review.tokenizer_files["tokenizer.json"] == hashlib_digests(model)["tokenizer.json"]
    assert (
        review.generation_config is not None
        and review.generation_config_sha256
        == hashlib.sha256((model / "generation_config.json").read_bytes()).hexdigest()
    )
    assert review.source == (config.get("_name_or_path") or "unknown")
    assert review.manifest == "none" and review.signature == "none"


def test_sharded_model_counts_every_shard(tmp_path: Path) -> None:
    whole = build_model(tmp_path / "whole", "llama")
    sharded = build_model(tmp_path / "sharded", "llama", max_shard_size="200KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    review = review_artifact(sharded)
    assert {f.name: f.sha256 for f in review.files} == hashlib_digests(sharded)
    assert review.parameters == review_artifact(whole).parameters


def test_gguf_file(llama_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from gguf_factory import write_gguf

    path = write_gguf(llama_dir, tmp_path / "model.gguf")
    review = review_artifact(path, gguf_config=gguf_config)
    assert review.kind == "gguf" and review.architecture == "LlamaForCausalLM"
    assert [(f.name, f.sha256) for f in review.files] == [("model.gguf", hashlib.sha256(path.read_bytes()).hexdigest())]
    assert review.quantization == "none" and review.dtype == "F32"
    assert review.parameters == review_artifact(llama_dir).parameters
    quantized = review_artifact(write_gguf(llama_dir, tmp_path / "q4.gguf", tensor_type="Q4_0"))
    assert quantized.quantization.startswith("GGUF") and "Q4_0" in quantized.quantization


def test_gptq_checkpoint_counts_its_codes(llama_dir: Path, tmp_path: Path) -> None:
    from test_quant_gptq import write_gptq

    write_gptq(llama_dir, tmp_path / "gptq")
    review = review_artifact(tmp_path / "gptq")
    assert review.quantization == "gptq 4-bit group size 32"
    assert "I32" in review.dtype  # the packed codes
    assert review.parameters == review_artifact(llama_dir).parameters
    assert {f.name: f.sha256 for f in review.files} == hashlib_digests(tmp_path / "gptq")


def test_mixture_of_experts_active_parameters(tmp_path: Path) -> None:
    model = build_model(tmp_path / "mixtral", "mixtral")
    review = review_artifact(model)
    header = safetensors_header(model / "model.safetensors")
    sizes = {name: math.prod(t["shape"]) for name, t in header.items()}
    routed = sum(size for name, size in sizes.items() if ".experts." in name)
    assert routed > 0 and review.parameters == sum(sizes.values())
    assert review.active_parameters == review.parameters - routed + routed * 2 // 4


def test_lora_adapter_and_base_compatibility(llama_dir: Path, model_dirs: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from lora_factory import ATTENTION_MODULES, build_adapter

    adapter = build_adapter(llama_dir, tmp_path / "adapter", target_modules=ATTENTION_MODULES, rank=4)
    review = review_artifact(adapter)
    assert review.kind == "lora-adapter" and review.adapter is not None
    assert review.adapter.rank == 4 and review.adapter.target_modules == sorted(ATTENTION_MODULES)
    assert review.adapter.compatibility.startswith("not checked")
    assert {f.name: f.sha256 for f in review.files} == hashlib_digests(adapter)
    assert review_artifact(adapter, base=llama_dir).adapter.compatibility == f"compatible with {llama_dir}"
    other = review_artifact(adapter, base=model_dirs["qwen3"]).adapter.compatibility  # head_dim 32: wider q
    assert other.startswith("incompatible") and "k_proj.lora_B.weight has shape [32, 4]" in other


def test_license_template_behaviours_and_manifest_origin(llama_dir: Path, tmp_path: Path) -> None:
    model = copy_model(llama_dir, tmp_path / "m")
    (model / "README.md").write_text("---\nlicense: other\nlicense_name: acme-research\n---\n# Model\n")
    (model / "chat_template.jinja").write_text(
        "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}<think>{{ m.content }}"
        "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    assert cli_main(["inspect", str(model), "--write-manifest", "--source", "acme/m", "--revision", "r1"]) == 0
    review = review_artifact(model)
    assert review.license == "acme-research"
    assert review.chat_template.source == "chat_template.jinja"
    assert review.chat_template.sha256 == hashlib.sha256((model / "chat_template.jinja").read_bytes()).hexdigest()
    assert {"tools", "reasoning", "generation prompt"} <= set(review.chat_template.behaviours)
    assert (review.source, review.revision) == ("acme/m", "r1")
    assert review.manifest.endswith("(every file matches)")
    (model / "README.md").unlink()
    (model / "LICENSE").write_text("Apache License\nVersion 2.0\n")
    assert review_artifact(model).license.startswith("Apache License (LICENSE")
    assert review_artifact(model).manifest.startswith("does not match")


def test_cli_formats(llama_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["inspect", str(llama_dir), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["architecture"] == "LlamaForCausalLM" and body["files"][0]["sha256"]
    assert cli_main(["inspect", str(llama_dir), "--markdown"]) == 0
    markdown = capsys.readouterr().out
    assert "| architecture | LlamaForCausalLM |" in markdown and "| `model.safetensors` |" in markdown
    review = review_artifact(llama_dir)
    assert render_markdown(review) in markdown
    assert cli_main(["inspect", str(llama_dir)]) == 0
    assert capsys.readouterr().out.strip() == render_table(review).strip()


def test_pickle_files_refused_and_listed(llama_dir: Path, tmp_path: Path) -> None:
    model = copy_model(llama_dir, tmp_path / "m")
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    (model / "extra").mkdir()
    (model / "extra" / "optimizer.pt").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=r"pickle files.*extra/optimizer\.pt, pytorch_model\.bin"):
        review_artifact(model)
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "inspect", str(model)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pytorch_model.bin" in lines[0] and "optimizer.pt" in lines[0]


def test_bad_inputs_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["inspect", str(tmp_path / "absent")]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hi")
    assert cli_main(["inspect", str(tmp_path / "empty")]) == 1
    assert "not a model artifact" in capsys.readouterr().err
    assert cli_main(["inspect", str(tmp_path / "empty" / "notes.txt")]) == 1
    assert "a single file must be a GGUF model" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert cli_main(["inspect", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "config.json: unreadable JSON" in err and len(err.strip().splitlines()) == 1


def test_manifest_names_exclude_itself(llama_dir: Path, tmp_path: Path) -> None:
    model = copy_model(llama_dir, tmp_path / "m")
    assert cli_main(["inspect", str(model), "--write-manifest", "--json"]) == 0
    files = ArtifactFiles.of(model)
    manifest = json.loads(files.manifest_path.read_text())
    assert manifest["files"] == hashlib_digests(llama_dir)


def test_cache_snapshot_links_count_as_their_files(llama_dir: Path, tmp_path: Path) -> None:
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for path in llama_dir.iterdir():
        shutil.copy(path, blobs / hashlib.sha256(path.read_bytes()).hexdigest())
        (snapshot / path.name).symlink_to(blobs / hashlib.sha256(path.read_bytes()).hexdigest())
    review = review_artifact(snapshot)
    assert {f.name: f.sha256 for f in review.files} == hashlib_digests(llama_dir)
