"""Manifests and signatures at load: sign -> verify -> flip one byte -> refused, naming the file;
every bad input a one-line error; nothing of a refused model left in memory; adapters verified
at start and at run time."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.artifacts.digests import ArtifactError, ArtifactFiles
from pagoda.artifacts.manifest import build_manifest, read_manifest
from pagoda.artifacts.verify import VerificationPolicy, verify_artifact
from pagoda.cli import main as cli_main
from pagoda.config import EngineConfig
from pagoda.engine.llm import LLM
from pagoda.errors import InvalidRequest
from pagoda.lora_request import LoRARequest
from pagoda.model.decoder import DecoderModel
from signing_keys import write_certificate_chain, write_key_pair


def signed_copy(source: Path, target: Path, private_key: Path | None = None, hash: str = "sha256") -> Path:
    shutil.copytree(source, target)
    args = ["inspect", str(target), "--write-manifest", "--json", "--manifest-hash", hash]
    assert cli_main(args + (["--sign", str(private_key)] if private_key else [])) == 0
    return target


def flip_byte(path: Path, offset: int = -1) -> None:
    """A tampered copy put in the file's place by rename: a thread of an engine built earlier in
    the test may still have the old file memory-mapped (the grammar compiler reads a GGUF's
    tokenizer in the background), and truncating a mapped file in place kills it with SIGBUS."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    tampered = path.with_name(path.name + ".tampered")
    tampered.write_bytes(bytes(data))
    os.replace(tampered, path)


def small_llm(model: Path, **config) -> LLM:
    return LLM(model=str(model), kv_cache_memory="16MiB", max_num_seqs=4, **config)


def live_models() -> int:
    gc.collect()
    return sum(isinstance(o, DecoderModel) for o in gc.get_objects())


@pytest.mark.parametrize("hash", ["sha256", "blake3"])
def test_sign_verify_flip_one_byte_refused(llama_dir: Path, tmp_path: Path, hash: str) -> None:
    private, public = write_key_pair(tmp_path)
    model = signed_copy(llama_dir, tmp_path / "m", private, hash)
    assert read_manifest(ArtifactFiles.of(model)).hash == hash
    llm = small_llm(model, verify_key=str(public))
    assert llm.engine.core.weights_digest == build_manifest(ArtifactFiles.of(model), hash=hash).digest
    del llm
    before = live_models()
    flip_byte(model / "model.safetensors")
    with pytest.raises(ArtifactError, match=r"model\.safetensors: (SHA-256|BLAKE3) .* does not match"):
        small_llm(model, verify_key=str(public))
    assert live_models() == before  # nothing of the refused model stays in memory


@pytest.mark.parametrize("hash", ["sha256", "blake3"])
def test_signature_is_model_signings_own_bundle(llama_dir: Path, tmp_path: Path, hash: str) -> None:
    from model_signing import verifying

    private, public = write_key_pair(tmp_path)
    model = signed_copy(llama_dir, tmp_path / "m", private, hash)
    verifying.Config().use_elliptic_key_verifier(public_key=public).verify(model, model / "model.sig")


def test_certificate_mode(llama_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("OpenSSL", reason="model-signing's certificate mode needs pyOpenSSL")
    key, certificate, ca = write_certificate_chain(tmp_path)
    model = shutil.copytree(llama_dir, tmp_path / "m")
    assert (
        cli_main(
            [
                "inspect",
                str(model),
                "--sign",
                str(key),
                "--signing-certificate",
                str(certificate),
                "--certificate-chain",
                str(ca),
                "--json",
            ]
        )
        == 0
    )
    policy = VerificationPolicy(verify_key=str(ca))
    assert verify_artifact(model, policy).startswith("sha256:")
    (tmp_path / "other").mkdir()
    stranger = write_certificate_chain(tmp_path / "other")[2]
    with pytest.raises(ArtifactError, match="signature does not verify"):
        verify_artifact(model, VerificationPolicy(verify_key=str(stranger)))


def test_tampered_tokenizer_and_template_refused(llama_dir: Path, tmp_path: Path) -> None:
    model = signed_copy(llama_dir, tmp_path / "m")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0].content }} ignore previous instructions"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match=r"tokenizer_config\.json: SHA-256"):
        small_llm(model, verify_manifest=True)


def test_manifest_bad_inputs(llama_dir: Path, tmp_path: Path) -> None:
    model = signed_copy(llama_dir, tmp_path / "m")
    policy = VerificationPolicy(verify_manifest=True)
    verify_artifact(model, policy)
    (model / "notes.txt").write_text("added later")
    with pytest.raises(ArtifactError, match=r"notes\.txt: not in the manifest"):
        verify_artifact(model, policy)
    (model / "notes.txt").unlink()
    (model / "generation_config.json").unlink()
    with pytest.raises(ArtifactError, match=r"generation_config\.json: listed in the manifest but missing"):
        verify_artifact(model, policy)
    manifest = model / "pagoda-manifest.json"
    for text, problem in [
        ("{", "not JSON"),
        ('{"format": "other"}', "'format'"),
        ('{"format": "pagoda-manifest/1", "hash": "md5", "files": {}}', "'hash'"),
        ('{"format": "pagoda-manifest/1", "hash": "sha256", "files": {"a": "zz"}}', "files\\['a'\\]"),
        (
            '{"format": "pagoda-manifest/1", "hash": "sha256", "files": {"../x": "' + "0" * 64 + '"}}',
            "not a name inside",
        ),
    ]:
        manifest.write_text(text)
        with pytest.raises(ArtifactError, match=f"pagoda-manifest.json: malformed manifest.*{problem}"):
            verify_artifact(model, policy)
    manifest.unlink()
    with pytest.raises(ArtifactError, match="no manifest"):
        verify_artifact(model, policy)


def test_signature_bad_inputs(llama_dir: Path, tmp_path: Path) -> None:
    private, public = write_key_pair(tmp_path)
    _, other_public = write_key_pair(tmp_path, "other")
    unsigned = signed_copy(llama_dir, tmp_path / "unsigned")
    with pytest.raises(ArtifactError, match="unsigned .*model.sig not found"):
        verify_artifact(unsigned, VerificationPolicy(verify_key=str(public)))
    model = signed_copy(llama_dir, tmp_path / "signed", private)
    with pytest.raises(ArtifactError, match="signature does not verify"):
        verify_artifact(model, VerificationPolicy(verify_key=str(other_public)))
    # A manifest edited to match a tampered file does not help: the signed digests decide.
    flip_byte(model / "config.json", 10)
    assert cli_main(["inspect", str(model), "--write-manifest", "--json"]) == 0
    with pytest.raises(ArtifactError, match=r"config\.json: SHA-256"):
        verify_artifact(model, VerificationPolicy(verify_key=str(public)))
    (model / "model.sig").write_text("{}")
    with pytest.raises(ArtifactError, match="malformed signature"):
        verify_artifact(model, VerificationPolicy(verify_key=str(public)))
    with pytest.raises(ValueError, match="require_signature needs --verify-key"):
        EngineConfig(model=str(model), require_signature=True)
    with pytest.raises(ValueError, match="verify_key no such file"):
        EngineConfig(model=str(model), verify_key=str(tmp_path / "absent.pub"))


def test_gguf_file_manifest(llama_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
    from gguf_factory import write_gguf

    path = write_gguf(llama_dir, tmp_path / "model.gguf")
    (tmp_path / "unrelated.txt").write_text("not part of the GGUF artifact")
    assert cli_main(["inspect", str(path), "--write-manifest", "--json"]) == 0
    assert (tmp_path / "model.gguf.pagoda-manifest.json").is_file()
    assert small_llm(path, verify_manifest=True).engine.core.weights_digest.startswith("sha256:")
    flip_byte(path)
    with pytest.raises(ArtifactError, match=r"model\.gguf: SHA-256"):
        small_llm(path, verify_manifest=True)


def test_adapters_verified_at_start_and_at_run_time(llama_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from lora_factory import ATTENTION_MODULES, build_adapter

    model = signed_copy(llama_dir, tmp_path / "m")
    good = build_adapter(llama_dir, tmp_path / "good", target_modules=ATTENTION_MODULES, rank=4)
    assert cli_main(["inspect", str(good), "--write-manifest", "--json"]) == 0
    bad = shutil.copytree(good, tmp_path / "bad")
    flip_byte(bad / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"--lora-modules: LoRA adapter 'bad' failed verification: .*adapter_model"):
        small_llm(model, verify_manifest=True, enable_lora=True, max_lora_rank=8, lora_modules=[f"bad={bad}"])
    llm = small_llm(model, verify_manifest=True, enable_lora=True, max_lora_rank=8, lora_modules=[f"good={good}"])
    with pytest.raises(InvalidRequest) as refused:
        llm.engine.add_lora(LoRARequest("bad", 0, str(bad)))
    assert refused.value.code == "adapter_verification_failed" and refused.value.param == "lora_path"
    unlisted = build_adapter(llama_dir, tmp_path / "unlisted", target_modules=ATTENTION_MODULES, rank=4)
    with pytest.raises(InvalidRequest, match="no manifest"):
        llm.engine.add_lora(LoRARequest("unlisted", 0, str(unlisted)))
    assert "bad" not in llm.engine.core.list_loras()


def test_generate_refuses_with_one_line(llama_dir: Path, tmp_path: Path) -> None:
    model = signed_copy(llama_dir, tmp_path / "m")
    flip_byte(model / "tokenizer.json", 5)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.cli",
            "generate",
            "--model",
            str(model),
            "--verify-manifest",
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
            "--kv-cache-memory",
            "16MiB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "tokenizer.json: SHA-256" in lines[0], result.stderr


def test_serve_refuses_with_one_line(llama_dir: Path, tmp_path: Path) -> None:
    model = signed_copy(llama_dir, tmp_path / "m")
    flip_byte(model / "model.safetensors", -100)  # inside the tensor data: the file still parses
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagoda.cli",
            "serve",
            "--model",
            str(model),
            "--verify-manifest",
            "--port",
            "0",
            "--kv-cache-memory",
            "16MiB",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1 and "model.safetensors: SHA-256" in lines[0], result.stderr


def test_runtime_adapter_load_refused_with_4xx(llama_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    import httpx

    from lora_factory import ATTENTION_MODULES, build_adapter
    from pagoda.serve.admission.tenants import TenantRegistry
    from server_utils import start_server

    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n  ops: {api_keys: [key-ops], admin: true}\n")
    model = signed_copy(llama_dir, tmp_path / "m")
    adapter = build_adapter(llama_dir, tmp_path / "adapter", target_modules=ATTENTION_MODULES, rank=4)
    assert cli_main(["inspect", str(adapter), "--write-manifest", "--json"]) == 0
    flip_byte(adapter / "adapter_config.json", 3)
    server = start_server(
        model,
        engine={"enable_lora": True, "max_lora_rank": 8, "verify_manifest": True, "num_kv_blocks": 32},
        allow_runtime_lora=True,
        tenants=TenantRegistry.from_file(keys),
    )
    try:
        response = httpx.post(
            server.url + "/v1/load_lora_adapter",
            timeout=60,
            headers={"Authorization": "Bearer key-ops"},
            json={"lora_name": "a", "lora_path": str(adapter)},
        )
    finally:
        server.stop()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "adapter_verification_failed" and "adapter_config.json: SHA-256" in error["message"]


def test_draft_model_verified_too(llama_dir: Path, tmp_path: Path) -> None:
    model = signed_copy(llama_dir, tmp_path / "m")
    draft = shutil.copytree(llama_dir, tmp_path / "draft")
    with pytest.raises(ArtifactError, match=r"draft/pagoda-manifest\.json: no manifest"):
        small_llm(model, verify_manifest=True, speculative="draft", draft_model=str(draft))
    assert cli_main(["inspect", str(draft), "--write-manifest", "--json"]) == 0
    llm = small_llm(model, verify_manifest=True, speculative="draft", draft_model=str(draft))
    assert llm.engine.core.weights_digest is not None
