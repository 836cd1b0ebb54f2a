"""Model load time with and without `--verify-manifest`: the check hashes every file on a thread
while the loader reads the weights, so it should cost little beyond the load itself.

The model is a random Llama-shaped checkpoint written once to `--model-dir` (bfloat16 safetensors
shards with the bundled model's tokenizer, and its manifest). Each round starts two fresh
processes, one per mode, in alternating order, and times the engine's construction
(`EngineCore(EngineConfig(...))`: config, weights, KV cache; an explicit --max-num-seqs so no
calibration runs). A first, discarded round warms the page cache, so every timed load reads
from memory as a restarted server on the same host does. Also timed: hashing the files alone
on one thread (what the check would cost if it ran before the load instead of beside it).

    PYTHONPATH=. .venv/bin/python benchmarks/verify_load.py --rounds 5 --out benchmarks/results/verify_load
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOAD_SNIPPET = """
import json, sys, time
from pagoda.engine.threads import prefer_passive_omp_wait
prefer_passive_omp_wait()
from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
config = EngineConfig(model=sys.argv[1], dtype="bfloat16", device=sys.argv[2], num_kv_blocks=16, max_num_seqs=4,
                      verify_manifest=sys.argv[3] == "verify")
start, cpu_start = time.perf_counter(), time.process_time()
core = EngineCore(config)
print(json.dumps({"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start,
                  "weights_digest": core.weights_digest}))
"""


def build_checkpoint(directory: Path, layers: int, hidden: int, intermediate: int) -> None:
    import torch
    from safetensors.torch import save_file

    from pagoda.artifacts.digests import ArtifactFiles
    from pagoda.artifacts.manifest import build_manifest, write_manifest
    from pagoda.config import DEFAULT_MODEL_DIR

    directory.mkdir(parents=True, exist_ok=True)
    bundled = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    heads, kv_heads = hidden // 128, max(1, hidden // 512)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": bundled["vocab_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": bundled.get("eos_token_id", 0),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (DEFAULT_MODEL_DIR / name).is_file():
            shutil.copy(DEFAULT_MODEL_DIR / name, directory / name)
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    head_dim, vocab = hidden // heads, config["vocab_size"]
    index, shard, shard_bytes, shard_number = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, shard_number
        if shard:
            name = f"model-{shard_number:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            index.update({tensor: name for tensor in shard})
            shard, shard_bytes, shard_number = {}, 0, shard_number + 1

    def add(name: str, tensor: torch.Tensor) -> None:
        nonlocal shard_bytes
        shard[name] = tensor
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= 1 << 30:
            flush()

    add("model.embed_tokens.weight", weight(vocab, hidden))
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        add(prefix + "self_attn.q_proj.weight", weight(heads * head_dim, hidden))
        add(prefix + "self_attn.k_proj.weight", weight(kv_heads * head_dim, hidden))
        add(prefix + "self_attn.v_proj.weight", weight(kv_heads * head_dim, hidden))
        add(prefix + "self_attn.o_proj.weight", weight(hidden, heads * head_dim))
        add(prefix + "mlp.gate_proj.weight", weight(intermediate, hidden))
        add(prefix + "mlp.up_proj.weight", weight(intermediate, hidden))
        add(prefix + "mlp.down_proj.weight", weight(hidden, intermediate))
        add(prefix + "input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16))
        add(prefix + "post_attention_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16))
    add("model.norm.weight", torch.ones(hidden, dtype=torch.bfloat16))
    add("lm_head.weight", weight(vocab, hidden))
    flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    files = ArtifactFiles.of(directory)
    write_manifest(files, build_manifest(files, source="random (benchmarks/verify_load.py)"))


def timed_load(model: Path, device: str, mode: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_SNIPPET, str(model), device, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"load ({mode}) failed:\n{result.stderr[-2000:]}")
    body = json.loads(result.stdout.strip().splitlines()[-1])
    if (body["weights_digest"] is not None) != (mode == "verify"):
        raise SystemExit(f"load ({mode}): unexpected weights_digest {body['weights_digest']!r}")
    return {"seconds": body["seconds"], "cpu_seconds": body["cpu_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pagoda-verify-load-model"))
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--hash",
        choices=("sha256", "blake3"),
        default="sha256",
        help="the manifest's digest algorithm (written anew before the rounds)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "verify_load")
    args = parser.parse_args()

    if not (args.model_dir / "pagoda-manifest.json").is_file():
        build_checkpoint(args.model_dir, args.layers, args.hidden, args.intermediate)
    from pagoda.artifacts.digests import ArtifactFiles, file_digest
    from pagoda.artifacts.manifest import build_manifest, read_manifest, write_manifest

    files = ArtifactFiles.of(args.model_dir)
    if read_manifest(files).hash != args.hash:
        write_manifest(files, build_manifest(files, source="random (benchmarks/verify_load.py)", hash=args.hash))
    total_bytes = sum((files.root / name).stat().st_size for name in files.names())
    timed_load(args.model_dir, args.device, "plain")  # warms the page cache; discarded
    start = time.perf_counter()
    for name in files.names():
        file_digest(files.root / name, args.hash)
    hash_seconds = time.perf_counter() - start

    rounds = []
    for index in range(args.rounds):
        order = ("plain", "verify") if index % 2 == 0 else ("verify", "plain")
        loads = {mode: timed_load(args.model_dir, args.device, mode) for mode in order}
        times = {mode: load["seconds"] for mode, load in loads.items()}
        rounds.append(
            {
                "order": list(order),
                **times,
                "ratio": times["verify"] / times["plain"],
                "cpu_seconds": {mode: load["cpu_seconds"] for mode, load in loads.items()},
                "load_average": os.getloadavg()[0],
            }
        )
        print(
            f"round {index}: plain {times['plain']:.2f} s, verify {times['verify']:.2f} s "
            f"({times['verify'] / times['plain']:.2f}x); CPU {loads['plain']['cpu_seconds']:.1f} / "
            f"{loads['verify']['cpu_seconds']:.1f} s; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    plain = statistics.median(r["plain"] for r in rounds)
    verify = statistics.median(r["verify"] for r in rounds)
    result = {
        "benchmark": "verify_load",
        "model": {
            "directory": str(args.model_dir),
            "bytes": total_bytes,
            "files": len(files.names()),
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "dtype": "bfloat16",
        },
        "device": args.device,
        "hash": args.hash,
        "command": " ".join(["benchmarks/verify_load.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
        "hash_alone_seconds": hash_seconds,
        "hash_alone_gb_per_s": total_bytes / hash_seconds / 1e9,
        "rounds": rounds,
        "median_plain_seconds": plain,
        "median_verify_seconds": verify,
        "median_ratio": verify / plain,
        "median_of_round_ratios": statistics.median(r["ratio"] for r in rounds),
        "median_cpu_seconds": {
            mode: statistics.median(r["cpu_seconds"][mode] for r in rounds) for mode in ("plain", "verify")
        },
        "target_ratio": 1.2,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.device if args.hash == "sha256" else f"{args.device}_{args.hash}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{total_bytes / 1e9:.2f} GB; hashing alone {hash_seconds:.2f} s; median load plain {plain:.2f} s, "
        f"verified {verify:.2f} s: {verify / plain:.2f}x"
    )


if __name__ == "__main__":
    main()
