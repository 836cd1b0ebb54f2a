"""pagoda's native CPU kernels: one C++ extension built from `pagoda/csrc/` at install or on first use.

The sources are compiled with `torch.utils.cpp_extension` by `make install` (through
`pagoda --version`) when a compiler is present, else just in time, once per machine and
version, into `$XDG_CACHE_HOME/pagoda/kernels/<key>` (else `~/.cache/pagoda/kernels/<key>`),
the key hashing the sources, the compiler flags, torch's and Python's versions. Nothing is
downloaded. Each instruction-set body (AVX-512, AVX2, scalar) carries its own target attribute
and is picked at run time, so the flags never say `-march=native` and a cache directory shared
between machines stays valid.

A process tries the build at most once (`_build`). When it fails (no compiler, no
`ninja`, a CPU the sources do not compile for) it logs one line and every caller keeps its
PyTorch path: `resolve_native_kernels("auto")` then answers None, `"on"` raises. The engine
reaches them only through pagoda.kernels, which resolves every op's implementation per device.

Every kernel has a PyTorch reference beside it (tests/native): results agree within the float32
rounding of a different summation order, not bit for bit (bit for bit where the order is the same,
as in the rotary). `describe()` names the kernel families the build holds, read from the extension:
each csrc/*.cpp registers `family_<name>() -> str` beside its ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._ops import _OpNamespace as OpNamespace

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc"
# Every .cpp under csrc/ is one concept (a kernel family); small_m_linear.cpp registers the op library with
# TORCH_LIBRARY, the others add to it with TORCH_LIBRARY_FRAGMENT. Shared ISA helpers live in simd.h.
SOURCES = tuple(sorted(path.name for path in SOURCE_DIR.glob("*.cpp")))
COMPILE_FLAGS = ("-O3", "-std=c++17")
# Inputs of up to this many rows (decode steps) take the native float32 product; larger ones
# (prefill) are compute-bound and oneDNN/MKL's blocked GEMM wins there.
MAX_ROWS = 16


class NativeKernelsUnavailable(RuntimeError):
    """The extension could not be built or loaded in this process."""


@dataclass(frozen=True)
class NativeKernels:
    """The built extension, as pagoda.kernels holds it. Pickles as its instruction set name and loads
    the extension again in the receiving process (tensor-parallel workers)."""

    isa: str

    def linear_f32(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 @ weight [N, K] float32 (rows contiguous)^T (+ bias)."""
        return load_extension().linear_f32(x, weight, bias)

    def linear_int8(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] float32 @ (qweight [N, K' >= K] int8 * scales [N] float32)^T (+ bias)."""
        return load_extension().linear_int8(x, qweight, scales, bias)

    def grouped_linear_f32(
        self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [R, K] float32, its rows grouped in order (counts [G] int64 per group, on the CPU)
        @ weight [G, N, K] float32 of each row's group^T (+ bias [G, N]): a MoE projection over the
        experts hit."""
        return load_extension().grouped_linear_f32(x, weight, counts, bias)

    def grouped_linear_int8(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        counts: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """The same with int8 weights [G, N, K' >= K] and float32 scales [G, N] per output row."""
        return load_extension().grouped_linear_int8(x, qweight, scales, counts, bias)

    def linear_bf16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 @ weight [N, K] bfloat16^T (+ bias), summed in float32, in x's dtype."""
        return load_extension().linear_bf16(x, weight, bias)

    def linear_int4(
        self,
        x: torch.Tensor,
        nibbles: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 @ pagoda's group-wise int4 weight^T (+ bias), in x's dtype: codes
        two per byte [N, K / 2] in GGUF Q4_0's nibble order per 32 inputs (`pack_int4_nibbles`), float32
        scales (and zeros) [N, K / group]; w = (code - 8) * scale + zero."""
        return load_extension().linear_int4(x, nibbles, scales, zeros, bias)

    def gguf_quantize_activation(
        self, x: torch.Tensor, k_blocks: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, K] float32 quantized as llama.cpp quantizes a layer's input: 8-bit blocks of 256 (Q8_K,
        `k_blocks`, for K-quants and IQ4_XS) or 32 (Q8_0, its scale a float16). Returns (codes int8
        [M, K], the block scale of each 16 codes float32 [M, K / 16], the block scale times their sum
        float32 [M, K / 16]): what `gguf_linear` reads."""
        codes, group_scales, group_sums = load_extension().gguf_quantize_activation(x, k_blocks)
        return codes, group_scales, group_sums

    def gguf_linear(
        self,
        activation: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        blocks: torch.Tensor,
        type_id: int,
        bias: torch.Tensor | None,
        isa: str = "",
    ) -> torch.Tensor:
        """float32 [M, N] = x @ W^T (+ bias): x as `gguf_quantize_activation` gave it (of the block size
        W's type reads), W GGUF rows as stored (uint8 [N, bytes], ggml type `type_id`); integer dot
        products with the block scales applied per block. isa: "" for the CPU's best, "avx2", "scalar"."""
        return load_extension().gguf_linear(*activation, blocks, type_id, bias, isa)

    def gguf_dequantize_rows(self, blocks: torch.Tensor, type_id: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of GGUF blocks (uint8 [N, bytes], ggml type `type_id`) as float32 [len(ids), K]."""
        return load_extension().gguf_dequantize_rows(blocks, type_id, ids)

    def gguf_product_path(self, isa: str = "") -> str:
        """Which integer path gguf_linear takes for `isa`: avx512-vnni, avx2 or scalar."""
        return str(load_extension().gguf_product_path(isa))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
        """RMSNorm of x [..., D] float32 as a new tensor; unit_offset: Gemma's (1 + weight)."""
        return load_extension().rms_norm(x, weight, eps, unit_offset)

    def rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> None:
        """RMSNorm in place over x [T, D] or [T, H, D] float32, rows of D contiguous (a strided view of
        the fused qkv output for per-head norms)."""
        load_extension().rms_norm_(x, weight, eps, unit_offset)

    def add_rms_norm_(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool,
        pre_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, D] (contiguous float32) becomes the new residual stream, x + residual (with pre_weight:
        RMSNorm(x; pre_weight) + residual, Gemma's norm of the attention output); returns its RMSNorm."""
        return load_extension().add_rms_norm_(x, residual, weight, eps, unit_offset, pre_weight)

    def rotary_(self, heads: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor) -> None:
        """Rotate-half rotary in place over heads [T, H, D] float32 (any token and head strides, e.g. the
        q and k heads of the fused qkv output) with the step's cos and sin_rolled rows [T, D]."""
        load_extension().rotary_(heads, cos, sin_rolled)

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        query_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
        kv_element: str = "",
        kv_scale_per_token: bool = False,
        kv_tensor_scale: float = 1.0,
        isa: str = "",
    ) -> torch.Tensor:
        """Attention of query [T, H, D] float32 over the paged caches [blocks, block_size, KVH, entry],
        read in place: request i's query_lens[i] rows from query_starts[i] are its last positions
        of seq_lens[i] (causal), its keys in the blocks block_tables[i] (int32) lists. kv_element
        "" reads float caches as their dtype; "int8" / "fp8_e4m3" / "fp8_e5m2" read uint8 entries,
        each followed by a float32 scale (kv_scale_per_token) or scaled by kv_tensor_scale. Rows
        of no request are left unwritten. isa: "" for the CPU's best, else "avx2" or "scalar"."""
        return load_extension().paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_starts,
            query_lens,
            seq_lens,
            scale,
            sliding_window,
            softcap,
            sinks,
            kv_element,
            kv_scale_per_token,
            kv_tensor_scale,
            isa,
        )

    def fused_moe(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        gate_up: torch.Tensor,
        gate_up_scales: torch.Tensor | None,
        gate_up_bias: torch.Tensor | None,
        down: torch.Tensor,
        down_scales: torch.Tensor | None,
        down_bias: torch.Tensor | None,
        first_expert: int,
        swiglu_limit: float | None,
        swiglu_alpha: float,
    ) -> torch.Tensor:
        """A MoE block's experts in one op: hidden [T, H] float32, each token's top-k experts
        (topk_ids [T, k] int64, numbered in the model) and routing weights [T, k]; the held experts'
        stacked gate_up [E, 2I, H'] (gate rows, then up rows) and down [E, H, I'], float32 or int8
        with float32 scales [E, N], biases [E, N] or None. Experts outside [first_expert,
        first_expert + E) are other ranks'. Activation SiLU, or with `swiglu_limit` gpt-oss's
        clamped SwiGLU. Returns sum_k w_k * expert_k(x) [T, H]."""
        return load_extension().fused_moe(
            hidden,
            topk_ids,
            topk_weights,
            gate_up,
            gate_up_scales,
            gate_up_bias,
            down,
            down_scales,
            down_bias,
            first_expert,
            swiglu_limit,
            swiglu_alpha,
        )

    def route_top_k(
        self, logits: torch.Tensor, top_k: int, renormalize: bool, softmax_over_top_k: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts from router logits [T, E] float32, as pagoda.kernels.moe.top_k_experts
        computes them: (weights [T, k] float32, experts [T, k] int64)."""
        return load_extension().route_top_k(logits, top_k, renormalize, softmax_over_top_k)

    def describe(self) -> str:
        return f"native CPU kernels ({self.isa}: {', '.join(kernel_families())})"


def kernel_families() -> list[str]:
    """What the built extension holds, one phrase per kernel family: each csrc/*.cpp registers an op
    `family_<name>() -> str` beside its kernels, so the list is read from the build itself."""
    extension = load_extension()
    prefix = f"{extension.name.rsplit('.', 1)[-1]}::family_"
    names = sorted(name.split("::", 1)[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix))
    return [getattr(extension, name)() for name in names]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagoda" / "kernels"


def build_key() -> str:
    digest = hashlib.sha256()
    for name in sorted(path.name for path in SOURCE_DIR.iterdir() if path.suffix in (".cpp", ".h")):
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join(COMPILE_FLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


@functools.cache
def _build() -> OpNamespace | NativeKernelsUnavailable:
    """Build (or reuse the cached build) once per process; the failure is remembered too."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        failure = NativeKernelsUnavailable(
            f"no native kernels for this CPU ({platform.machine()}); using the PyTorch path"
        )
        logger.warning("%s", failure)
        return failure
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        key = build_key()
        namespace = f"pagoda_native_{key}"
        directory = cache_dir() / key
        directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name=namespace,
            sources=[str(SOURCE_DIR / s) for s in SOURCES],
            extra_cflags=[*COMPILE_FLAGS, f"-DPAGODA_NATIVE_NAMESPACE={namespace}"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
        return getattr(torch.ops, namespace)
    except (Exception, SystemExit) as error:  # a missing compiler or ninja surfaces as several types
        reason = str(error).strip().splitlines()
        failure = NativeKernelsUnavailable(
            f"native CPU kernels did not build ({type(error).__name__}: "
            f"{reason[0] if reason else 'no message'}); using the PyTorch path"
        )
        logger.warning("%s", failure)
        return failure


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; a virtual environment's own (the `ninja` dependency) is
    not on it when its scripts run without activating it (`.venv/bin/pagoda`, `make install`)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the build then fails with cpp_extension's own message
    os.environ["PATH"] = os.pathsep.join((ninja.BIN_DIR, os.environ.get("PATH", "")))


def load_extension() -> OpNamespace:
    """The extension's ops (torch.ops.<its namespace>); NativeKernelsUnavailable when it could not be built."""
    built = _build()
    if isinstance(built, NativeKernelsUnavailable):
        raise built
    return built


def available() -> bool:
    """Whether the extension builds and loads here."""
    return not isinstance(_build(), NativeKernelsUnavailable)


def resolve_native_kernels(mode: str, device: torch.device) -> NativeKernels | None:
    """The kernels the engine uses for `--native-kernels mode`: None for off, for a device other
    than the CPU under auto, or when the build failed under auto; ValueError under `on` when they
    cannot run."""
    if mode == "off":
        return None
    if device.type != "cpu":
        if mode == "on":
            raise ValueError(f"--native-kernels on: the native kernels run on the CPU, the engine is on {device}")
        return None
    if not available():
        if mode == "on":
            raise ValueError(f"--native-kernels on: {_build()}")
        return None
    return NativeKernels(isa=load_extension().isa())


def version_line() -> str:
    """`pagoda --version`'s line about the kernels on this machine (building them if needed)."""
    if available():
        return f"{NativeKernels(isa=load_extension().isa()).describe()}, cached in {cache_dir() / build_key()}"
    return f"no native kernels: {_build()}"
