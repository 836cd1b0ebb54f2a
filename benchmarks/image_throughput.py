"""Offline throughput with one image per request: pagoda against transformers' `generate` on the
same weights (static batches, left-padded, as one would batch it by hand).

The random LLaVA of benchmarks/image_encoder_cache.py (CLIP 224 px: 256 image tokens per image,
tower hidden 384 x 8 layers; Llama decoder 256 x 4), --requests requests, each its own image and
a short question, --output-tokens greedy tokens each (ignore_eos). Output tokens per second of
wall time, rounds alternating, the median ratio reported.

    PYTHONPATH=. .venv/bin/python benchmarks/image_throughput.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from image_encoder_cache import TOWER  # noqa: E402
from model_factory import build_vision_model  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402

QUESTIONS = ["What is in this picture?", "Describe the colours.", "Count the shapes here.", "Is it a cat?"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' static batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import transformers
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)) for _ in range(args.requests)]
    prompts = [f"<|user|>{QUESTIONS[i % len(QUESTIONS)]} <image>\n<|assistant|>" for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_vision_model(Path(tmp) / "llava", "llava", **TOWER)
        llm = LLM(model=str(model_dir), kv_cache_memory="256MiB", enable_prefix_caching=False)
        hf = transformers.LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
        processor = transformers.AutoImageProcessor.from_pretrained(model_dir)

        def run_pagoda() -> tuple[float, list[list[int]]]:
            start = time.perf_counter()
            outputs = llm.generate(
                [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)], params
            )
            return time.perf_counter() - start, [o.prompt_token_ids for o in outputs]

        _, expanded = run_pagoda()  # warm up; the expanded prompts are transformers' inputs too

        def run_transformers() -> float:
            start = time.perf_counter()
            for first in range(0, args.requests, args.batch_size):
                batch = expanded[first : first + args.batch_size]
                width = max(len(ids) for ids in batch)
                ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
                pixels = processor(images=images[first : first + args.batch_size], return_tensors="pt")["pixel_values"]
                with torch.no_grad():
                    hf.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        pixel_values=pixels,
                        do_sample=False,
                        max_new_tokens=args.output_tokens,
                        min_new_tokens=args.output_tokens,
                        pad_token_id=0,
                    )
            return time.perf_counter() - start

        tokens = args.requests * args.output_tokens
        rounds = []
        for r in range(args.rounds):
            order = ("pagoda", "transformers") if r % 2 == 0 else ("transformers", "pagoda")
            seconds = {}
            for name in order:
                seconds[name] = run_pagoda()[0] if name == "pagoda" else run_transformers()
            rounds.append({name: tokens / s for name, s in seconds.items()})
            print(f"round {r}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in rounds[-1].items()), flush=True)
        result = {
            "requests": args.requests,
            "output_tokens": args.output_tokens,
            "transformers_batch": args.batch_size,
            "rounds": rounds,
            "median_ratio": statistics.median(r["pagoda"] / r["transformers"] for r in rounds),
        }
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
