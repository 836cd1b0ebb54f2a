"""Lowering Triton kernels to GPU binaries without a GPU (Triton's bundled ptxas), for the compile
tests: the interpreter checks what a kernel computes, not that it compiles for sm_80 / sm_90.

A test's script (run in a fresh process without TRITON_INTERPRET, by `compile_for_gpu`) replaces
each kernel by `compiling(kernel)` and calls the launchers as the model does: every launch then
compiles the variant it asks for (signature and constexprs as Triton's launcher would specialize
them) instead of running it. The script reads the target from `arch_and_dtype()`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}


def arch_and_dtype() -> tuple[int, torch.dtype]:
    """In the script: the compute capability and dtype `compile_for_gpu` was called with."""
    return int(sys.argv[1]), getattr(torch, sys.argv[2])


def compiling(fn: Any) -> Any:
    """A stand-in for the @triton.jit kernel `fn`: `stand_in[grid](*args)` compiles, for the
    script's target, the variant those arguments select."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch_and_dtype()[0], 32)

    def launch(*args: Any, **kwargs: Any) -> None:
        values = dict(zip(fn.arg_names, args), **kwargs)
        options = {k: values.pop(k) for k in ("num_warps", "num_stages") if k in values}
        signature, constexprs = {}, {}
        for param in fn.params:
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + TYPES[value.dtype]
            elif isinstance(value, float):
                signature[param.name] = "fp32"
            elif value == 1:  # as Triton's launcher specializes it
                signature[param.name], constexprs[param.name] = "constexpr", 1
            else:
                signature[param.name] = "i32"
        triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)

    return type("Compiling", (), {"__getitem__": lambda self, grid: launch})()


def compile_for_gpu(script: str, arch: int, dtype: str) -> subprocess.CompletedProcess:
    """Run `script` in a fresh process for (arch, dtype), this module importable there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", script, str(arch), dtype], env=env, capture_output=True, text=True, timeout=600
    )
