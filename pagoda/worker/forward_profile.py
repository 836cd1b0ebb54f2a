"""Where a step's forward goes, by kind of layer: a profiling aid for benchmarks and tuning.

`ForwardProfiler` attaches forward hooks to a runner's model (embedding, norms, rotary, each
projection of attention and MLP), wraps its attention backend's `forward` and the model's
`compute_logits`, and sums wall seconds per kind. On CPU every op is synchronous, so the
clocks measure the work itself; on CUDA they would measure launches, so it refuses CUDA.
What no hook covers (activations, residual adds, splits and views, and the hooks' own cost)
is the forward's remainder, reported by whoever knows the forward's total (StepTimings).

It patches the objects it profiles until `close()`: never leave it on in serving.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch import nn

from pagoda.model.layers import Linear, RMSNorm, RotaryEmbedding
from pagoda.model.parallel import VocabParallelEmbedding

# The order kinds are reported in: a step's forward, bottom to top.
KINDS = ("embedding", "norm", "rotary", "qkv_proj", "attention", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def _kind_of(name: str, module: nn.Module) -> str | None:
    if isinstance(module, (nn.Embedding, VocabParallelEmbedding)):
        return "embedding"
    if isinstance(module, RMSNorm):
        return "norm"
    if isinstance(module, RotaryEmbedding):
        return "rotary"
    if isinstance(module, Linear):
        leaf = name.rsplit(".", 1)[-1]
        return leaf if leaf in KINDS and leaf != "lm_head" else None  # timed through compute_logits
    return None


class ForwardProfiler:
    """Seconds per kind of layer, and tokens through the model, summed since `reset()`."""

    def __init__(self, model: nn.Module, backend: Any) -> None:
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("ForwardProfiler times host wall clock: CPU only (use torch.profiler on GPUs)")
        self.seconds: dict[str, float] = defaultdict(float)
        self.tokens = 0
        self._started: dict[int, float] = {}
        self._handles = []
        self._restore: list[Callable[[], None]] = []
        for name, module in model.named_modules():
            kind = _kind_of(name, module)
            if kind is not None:
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post(kind)))
        self._wrap(backend, "forward", "attention")
        self._wrap(model, "compute_logits", "lm_head")

    def _pre(self, module: nn.Module, args: Any) -> None:
        self._started[id(module)] = time.perf_counter()

    def _post(self, kind: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.seconds[kind] += time.perf_counter() - self._started.pop(id(module))
            if kind == "embedding":
                self.tokens += args[0].numel()

        return hook

    def _wrap(self, owner: Any, method: str, kind: str) -> None:
        original = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start

        setattr(owner, method, timed)  # an instance attribute shadows the class's method
        self._restore.append(lambda: delattr(owner, method))

    def reset(self) -> None:
        self.seconds.clear()
        self.tokens = 0

    def snapshot(self) -> dict[str, float]:
        """Seconds per kind since the last reset, in forward order."""
        return {kind: self.seconds.get(kind, 0.0) for kind in KINDS}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        for restore in self._restore:
            restore()
        self._handles, self._restore = [], []
