"""A weight update streamed from a trainer over gloo: how long the engine takes to receive,
stage and commit a whole model, and how soon generation resumes after it (issue targets: a
0.5B-shaped model in under 2 s, generation within 100 ms).

The model is Qwen2.5-0.5B-shaped (hidden 896, 24 layers, MLP 4864, vocab 151936, tied
embeddings) with random weights, saved once under --work-dir. The trainer is a thread of this
process with its own gloo rank (pagoda.rl.weight_group, as trainer_client uses it); the engine
applies the phases as its loop would (LLMEngine.run_command), so HTTP is left out of the time.

    PYTHONPATH=. .venv/bin/python benchmarks/weight_update.py --out benchmarks/results/weight_update
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import threading
import time
from pathlib import Path

import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.engine_request import EngineRequest
from pagoda.rl.weight_group import TensorMeta, WeightGroupSpec, broadcast, join, receive

SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def build_checkpoint(directory: Path, dtype: torch.dtype, layers: int) -> Path:
    import transformers

    from tokenizers import Tokenizer, models, pre_tokenizers

    if (directory / "model.safetensors").is_file():
        return directory
    config = transformers.Qwen2Config(**{**SHAPE, "num_hidden_layers": layers}, eos_token_id=0, bos_token_id=None)
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    model.tie_weights()  # to_empty unties the embedding and the LM head
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(1000)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t0"})
    )
    return directory


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default="/tmp/pagoda-weight-update")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--compare-sequential",
        action="store_true",
        help="alternate rounds with the reference path: receive every tensor, then stage them",
    )
    parser.add_argument("--label", default="", help="names the results file (weight_update-LABEL.json)")
    parser.add_argument(
        "--snapshot-dir", default=None, help="also save each update as a snapshot here (as a server does)"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model_dir = build_checkpoint(
        Path(args.work_dir) / f"qwen2-0.5b-shaped-{args.dtype}-{args.layers}", dtype, args.layers
    )
    llm = LLM(model=str(model_dir), dtype=args.dtype, num_kv_blocks=64, max_model_len=512)
    engine = llm.engine
    from safetensors.torch import load_file

    tensors = list(load_file(model_dir / "model.safetensors").items())
    metas = [TensorMeta.of(name, tensor) for name, tensor in tensors]
    spec = WeightGroupSpec("127.0.0.1", free_port(), 1, 2)
    trainer: dict[str, object] = {}
    joined = threading.Thread(target=lambda: trainer.update(group=join(spec, 0)))
    joined.start()
    engine.run_command(
        "init",
        "init_weight_update_group",
        {"master_address": spec.master_address, "master_port": spec.master_port, "rank_offset": 1, "world_size": 2},
    )
    joined.join()

    prompts = iter(range(1, 1 << 20, 32))

    def first_token(request_id: str) -> float:
        """Seconds from adding a 32-token prompt to its first token (the engine idle before); a
        new prompt each time, so no prefix-cache hit flatters the request before the update."""
        first = next(prompts) % 900
        started = time.perf_counter()
        prompt = list(range(first, first + 32))
        engine.add_request(EngineRequest(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1)))
        while not any(d.finished for d in engine.step().deltas):
            pass
        return time.perf_counter() - started

    first_token("warm-up")
    results = []
    for round_index in range(args.rounds):
        load_before = os.getloadavg()[0]
        baseline = first_token(f"before-{round_index}")
        sender = threading.Thread(target=broadcast, args=(trainer["group"], [t for _, t in tensors]))
        # --compare-sequential: every other round receives everything first, then stages it
        # (the path before the transfer overlapped staging), side by side under the same load.
        sequential = args.compare_sequential and round_index % 2 == 1
        started = time.perf_counter()
        engine.run_command("start", "start_weight_update", {})
        sender.start()
        snapshot = {"snapshot": f"{args.snapshot_dir}/round-{round_index}"} if args.snapshot_dir else {}
        if sequential:
            updates = engine.weight_updates
            items = [("trainer", n, t, None) for n, t in receive(updates.group, metas).items()]
            updates._staged = updates._stage(lambda: iter(items), None, None, True)  # noqa: B023 (called here)
            del items
        else:
            engine.run_command(
                "update",
                "update_weights",
                {
                    "names": [m.name for m in metas],
                    "dtypes": [m.dtype for m in metas],
                    "shapes": [list(m.shape) for m in metas],
                }
                | snapshot,
            )
        sender.join()
        received = time.perf_counter()
        engine.run_command("finish", "finish_weight_update", {})
        committed = time.perf_counter()
        refused = engine.step().refused
        assert not refused, refused
        after = first_token(f"after-{round_index}")
        results.append(
            {
                "path": "sequential" if sequential else "engine",
                "receive_and_stage_s": received - started,
                "commit_s": committed - received,
                "update_s": committed - started,
                # Generation resumes: the first token after the update's end, beside the same
                # request's first token just before the update (the difference is the update's).
                "first_token_after_s": after,
                "first_token_before_s": baseline,
                "resume_overhead_s": after - baseline,
                "load_average_1m": [load_before, os.getloadavg()[0]],
            }
        )
        print(json.dumps(results[-1]))
    steady = results[1:] or results  # the first round also pays the staging memory's first faults
    by_path = {
        path: {
            "update_s_median": statistics.median(r["update_s"] for r in rounds),
            "resume_overhead_s_median": statistics.median(r["resume_overhead_s"] for r in rounds),
            "rounds": len(rounds),
        }
        for path in ("engine", "sequential")
        for rounds in [[r for r in steady if r["path"] == path]]
        if rounds
    }
    summary = {
        "label": args.label,
        "model": "Qwen2.5-0.5B-shaped (random)",
        "dtype": args.dtype,
        "layers": args.layers,
        "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
        "snapshot": bool(args.snapshot_dir),
        "rounds": results,
        "update_s_median_after_first": statistics.median(r["update_s"] for r in steady),
        "resume_overhead_s_median_after_first": statistics.median(r["resume_overhead_s"] for r in steady),
        "by_path_after_first": by_path,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"weight_update{'-' + args.label if args.label else ''}.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
