"""How long one engine step takes, as a function of what it computes: the route simulator's
clock (`pagoda bench route-sim`).

    step seconds = base + per_prefill_token x prompt tokens computed
                        + per_decode_seq x sequences decoding
                        + per_context_token x tokens those sequences attend over

The coefficients are fitted by least squares to steps the real engine timed (`calibrate`:
LLMEngine on the given model, on this machine, prefill-only steps of several sizes and decode
steps of several batch sizes and context lengths). DEFAULT_STEP_COST is such a fit for the
bundled pagoda-coder on this project's 2-core CPU machine, one torch thread
(benchmarks/route_sim.md says how it was taken).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepCost:
    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_context_token_s: float = 0.0
    source: str = "default"

    def seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int = 0) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * prefill_tokens
            + self.per_decode_seq_s * decode_seqs
            + self.per_context_token_s * context_tokens
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# calibrate("pagoda-coder", num_threads=1) on the project machine (2 vCPU Zen 4) while it was
# shared with other work (load average ~9): slower than a quiet machine, as a busy server is.
DEFAULT_STEP_COST = StepCost(
    base_s=1.24e-2,
    per_prefill_token_s=4.08e-4,
    per_decode_seq_s=2.34e-3,
    per_context_token_s=1.14e-6,
    source="pagoda-coder, 1 thread, 2-core CPU (shared)",
)


def calibrate(model: str, *, num_threads: int = 1, repeats: int = 5) -> StepCost:
    """Time the real engine's steps on `model` and fit the model above (least squares)."""
    import torch

    from pagoda.config import EngineConfig
    from pagoda.engine.engine_request import EngineRequest
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.sampling_params import SamplingParams

    torch.set_num_threads(num_threads)
    engine = LLMEngine(
        EngineConfig(model=model, num_threads=num_threads, enable_prefix_caching=False, max_num_batched_tokens=16384)
    )
    vocab = engine.core.model_config.vocab_size
    max_len = engine.max_model_len
    samples: list[tuple[int, int, int, float]] = []  # prefill, decode seqs, context, seconds
    counter = iter(range(1 << 30))

    def prompt(length: int) -> list[int]:
        start = next(counter) * 7919
        return [(start + i * 31) % (vocab - 10) + 5 for i in range(length)]

    def timed_step(prefill: int, seqs: int, context: int) -> None:
        began = time.perf_counter()
        engine.step()
        samples.append((prefill, seqs, context, time.perf_counter() - began))

    for _ in range(repeats):
        for length in (16, 64, 256, min(1024, max_len // 2)):
            engine.add_request(
                EngineRequest(f"p{next(counter)}", prompt(length), SamplingParams(max_tokens=1, ignore_eos=True))
            )
            timed_step(length, 0, 0)
            while engine.has_unfinished_requests():
                engine.step()
        for batch in (1, 4, 16, 32):
            for context in (32, min(384, max_len // 2)):
                for _ in range(batch):
                    engine.add_request(
                        EngineRequest(
                            f"d{next(counter)}", prompt(context), SamplingParams(max_tokens=4, ignore_eos=True)
                        )
                    )
                engine.step()  # the prompts, all in one step (the budget holds them)
                for _ in range(2):
                    timed_step(0, batch, batch * context)
                while engine.has_unfinished_requests():
                    engine.step()
    # The fastest of the repeats of each shape: the machine's other work only ever adds time.
    fastest: dict[tuple[int, int, int], float] = {}
    for prefill, seqs, context, seconds in samples:
        key = (prefill, seqs, context)
        fastest[key] = min(seconds, fastest.get(key, seconds))
    return fit([(*key, seconds) for key, seconds in fastest.items()], source=f"{model}, {num_threads} thread(s)")


def fit(samples: list[tuple[int, int, int, float]], *, source: str) -> StepCost:
    """Least-squares fit of (prefill tokens, decode seqs, context tokens) -> seconds, every
    coefficient kept >= 0 (a negative cost would let the simulator run backwards)."""
    import numpy as np

    x = np.array([[1.0, p, d, c] for p, d, c, _ in samples])
    y = np.array([s for *_, s in samples])
    active = [0, 1, 2, 3]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        negative = [active[i] for i, v in enumerate(coef) if v < 0 and active[i] != 0]
        if not negative:
            break
        active = [a for a in active if a not in negative]
    full = [0.0] * 4
    for index, value in zip(active, coef):
        full[index] = float(value)
    return StepCost(max(full[0], 0.0), full[1], full[2], full[3], source=source)
