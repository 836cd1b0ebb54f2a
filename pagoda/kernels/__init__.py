"""The ops the model calls, each resolved once per device to one implementation (docs/DESIGN.md,
"Kernels"). vLLM's CustomOp picks a forward per platform; here `resolve_kernels` builds one
`Kernels` for the engine's device and `--native-kernels` setting, model construction takes it,
and layers call `kernels.linear(layer, x, bias)`, `kernels.norm.rms_norm(...)`,
`kernels.rotary(...)`, `kernels.moe(...)`, `kernels.delta_rule.chunked(...)`,
`kernels.causal_conv.step(...)` without asking which implementation runs.

Implementations: pagoda's native CPU kernels (pagoda.native, C++ in pagoda/csrc), PyTorch's
ops (the reference every other implementation is tested against, and the one for devices
without their own), and the Triton kernels on CUDA (pagoda.kernels.triton, imported only there
and only where triton is installed).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from pagoda.kernels.attention import AttentionBackend, select_backend
from pagoda.kernels.causal_conv import TorchCausalConv
from pagoda.kernels.delta_rule import TorchDeltaRule
from pagoda.kernels.linear import NativeLinear, TorchLinear, TritonLinear
from pagoda.kernels.lora_delta import add_lora_delta
from pagoda.kernels.moe import MoEKernels
from pagoda.kernels.norm import NativeNorm, TorchNorm
from pagoda.kernels.rotary import NativeRotary, TorchRotary
from pagoda.kernels.ssd import TorchSSD
from pagoda.native import NativeKernels, resolve_native_kernels, version_line
from pagoda.quant.kv_cache_dtype import KVCacheFormat

__all__ = ["Kernels", "resolve_kernels", "describe_native", "native_version_line"]


class Kernels:
    """Every op's implementation for one device. Pickles as its device and native kernels, and
    resolves again in the receiving process (tensor-parallel and pipeline workers)."""

    def __init__(self, device: torch.device, native: NativeKernels | None = None) -> None:
        self.device = torch.device(device)
        if native is not None and self.device.type != "cpu":
            raise ValueError(f"the native kernels run on the CPU, not on {self.device}")
        self._native = native
        on_cuda = self.device.type == "cuda"
        if native is not None:
            self.linear: TorchLinear = NativeLinear(native)
            self.norm: TorchNorm = NativeNorm(native)
            self.rotary: TorchRotary = NativeRotary(native)
        else:
            self.linear = TritonLinear(_triton_module("weight_matmul")) if on_cuda else TorchLinear()
            self.norm = TorchNorm()
            self.rotary = TorchRotary()
        # Linear-attention and state-space layers (Gated DeltaNet, Mamba2): the chunked and
        # single-step gated delta rule and SSD scan, and the short causal convolution, PyTorch's
        # on every device so far.
        self.delta_rule = TorchDeltaRule()
        self.ssd = TorchSSD()
        self.causal_conv = TorchCausalConv()
        self.moe = MoEKernels(self.device, native, _triton_module("fused_moe") if on_cuda else None)
        lora = _triton_module("lora_delta") if on_cuda else None
        # The batched LoRA delta added to a projection's output in place (pagoda.kernels.lora_delta):
        # output, x, lora_a, lora_b_t, the step's LoRABatch, width -> output.
        self.lora_delta = lora.add_lora_delta_triton if lora is not None else add_lora_delta
        self._lora_missing = on_cuda and lora is None
        # Weight formats store what this device's products read (pagoda.quant.weight_formats).
        self.native_layout = native is not None

    def __reduce__(self) -> tuple:
        return Kernels, (self.device, self._native)

    def __repr__(self) -> str:
        return f"Kernels({self.device}, linear={self.linear.name})"

    def attention_backend(self, name: str, kv_format: KVCacheFormat | None = None) -> AttentionBackend:
        """The paged-attention backend for `--attention-backend name` (auto, torch, triton): Triton
        on CUDA where it is installed, the torch reference otherwise, which attends decode-sized
        requests through the native kernel where the engine runs them."""
        return select_backend(name, self.device, kv_format, self._native)

    def check_lora(self) -> None:
        """Raise ValueError where the LoRA delta's kernels are missing on this device."""
        if self._lora_missing:
            raise ValueError(f"LoRA on {self.device} needs triton (pip install 'pagoda[gpu]')")

    def describe(self) -> str | None:
        """What the startup banner lists about the native kernels, or None without them."""
        return self._native.describe() if self._native is not None else None


def resolve_kernels(device: torch.device, native_kernels: str = "off") -> Kernels:
    """The kernels for `device` under `--native-kernels native_kernels` (auto, on, off); ValueError
    under `on` when the native kernels cannot run here."""
    return Kernels(device, resolve_native_kernels(native_kernels, device))


def describe_native(native_kernels: str, device: torch.device) -> str | None:
    """The startup banner's line about the native kernels: the active ones, or None."""
    try:
        native = resolve_native_kernels(native_kernels, device)
    except ValueError:
        return None
    return native.describe() if native is not None else None


def native_version_line() -> str:
    """`pagoda --version`'s line about the native kernels on this machine (building them if needed)."""
    return version_line()


def _triton_module(name: str) -> ModuleType | None:
    """pagoda.kernels.triton.<name>, or None where triton is not installed."""
    try:
        return importlib.import_module(f"pagoda.kernels.triton.{name}")
    except ImportError:
        return None
