"""Kernels resolves each op's implementation once per device: PyTorch's without the native
kernels, the native ones on the CPU with them (never elsewhere), and pickles as a reload."""

from __future__ import annotations

import pickle

import pytest
import torch

from pagoda.kernels import Kernels, resolve_kernels
from pagoda.native import NativeKernels
from pagoda.quant.weight_formats import GGUFBlockWeight, make_weight_format


def test_without_native_kernels_every_op_is_pytorchs() -> None:
    kernels = resolve_kernels(torch.device("cpu"), "off")
    assert (kernels.linear.name, kernels.norm.name, kernels.rotary.name) == ("torch", "torch", "torch")
    assert kernels.moe.native is None and kernels.moe.triton is None
    assert not kernels.native_layout and kernels.describe() is None
    assert kernels.attention_backend("auto").name == "torch"
    assert pickle.loads(pickle.dumps(kernels)).linear.name == "torch"


def test_native_kernels_run_on_the_cpu_only() -> None:
    handle = NativeKernels(isa="scalar")  # a handle only: nothing is loaded until an op runs
    kernels = Kernels(torch.device("cpu"), handle)
    assert (kernels.linear.name, kernels.norm.name, kernels.rotary.name) == ("native", "native", "native")
    assert kernels.native_layout and kernels.moe.native is handle
    with pytest.raises(ValueError, match="run on the CPU"):
        Kernels(torch.device("cuda"), handle)


def test_a_format_without_a_product_on_the_device_fails_its_check() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="served by the native CPU kernels"):
        resolve_kernels(cpu, "off").linear.check(GGUFBlockWeight(), cpu, torch.float32)
    Kernels(cpu, NativeKernels(isa="scalar")).linear.check(GGUFBlockWeight(), cpu, torch.float32)
    resolve_kernels(cpu, "off").linear.check(make_weight_format("int8"), cpu, torch.float32)
