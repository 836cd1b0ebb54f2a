"""A repeated image in a multi-turn chat: the second turn's time to first token against the first.

Offline engine, a random-weight LLaVA whose vision tower costs about what its prompt does (CLIP
224 px, 14 px patches: 256 image tokens, hidden 384 x 8 layers; a Llama decoder, hidden 256 x 4
layers). Turn 1 sends an image and a question; turn 2 sends the same conversation again (the
image, the answer, a new question), as a chat client does. TTFT = wall time of a
one-token generation. Measured with the prefix cache on (the default: turn 2 finds turn 1's
blocks, image included, and the encoder is not needed at all) and off (only the encoder cache
saves work: the prompt is computed again, the image is not encoded again), and with a
different image in turn 2 (both caches miss), median of --rounds.

    PYTHONPATH=. .venv/bin/python benchmarks/image_encoder_cache.py
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_factory import build_vision_model  # noqa: E402
from pagoda import LLM, SamplingParams  # noqa: E402

TOWER = dict(
    vision_config=dict(
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=6,
        image_size=224,
        patch_size=14,
        projection_dim=384,
    ),
    text_config=dict(model_type="llama", hidden_size=256, intermediate_size=768, num_hidden_layers=4),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)) for _ in range(2 * args.rounds + 2)]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    turn1 = "<|user|>What is in this picture? <image>\n<|assistant|>"
    turn2 = (
        turn1 + "A random pattern of coloured pixels.<|endoftext|>\n<|user|>Which colour is most common?\n<|assistant|>"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_vision_model(Path(tmp) / "llava", "llava", **TOWER)
        for name, engine in (("prefix cache on", {}), ("prefix cache off", {"enable_prefix_caching": False})):
            llm = LLM(model=str(model), kv_cache_memory="64MiB", **engine)
            llm.generate([{"prompt": turn1, "multi_modal_data": {"image": images[-1]}}], one)  # warm up
            firsts, seconds, misses = [], [], []
            for r in range(args.rounds):
                image, other = images[2 * r], images[2 * r + 1]
                for prompt, image_used, times in (
                    (turn1, image, firsts),
                    (turn2, image, seconds),
                    (turn2, other, misses),
                ):
                    start = time.perf_counter()
                    llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image_used}}], one)
                    times.append(time.perf_counter() - start)
            stats = llm.engine.core.scheduler.encoder_cache.stats
            results[name] = {
                "turn1_ttft_ms": 1000 * statistics.median(firsts),
                "turn2_same_image_ttft_ms": 1000 * statistics.median(seconds),
                "turn2_other_image_ttft_ms": 1000 * statistics.median(misses),
                "ratio_same_image": statistics.median(s / f for s, f in zip(seconds, firsts)),
                "images_encoded": stats.images_encoded,
                "encoder_cache_hits": stats.hits,
                "encoder_ms_per_image": 1000 * stats.encoder_seconds / max(stats.images_encoded, 1),
            }
            print(name, json.dumps(results[name], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
