"""The native CPU kernels against their PyTorch references, and how the engine picks them.

Tolerances: the kernels sum in a different order than MKL/oneDNN (16-wide partial sums, then a
horizontal add), so float32 results agree to a few ulps of the output's magnitude, not bit for
bit: |native - torch| <= 1e-5 * (1 + |torch|) elementwise over K <= 1,000.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from pagoda import native
from pagoda.kernels import Kernels, describe_native
from pagoda.model.layers import Linear
from pagoda.quant.weight_formats import FullWeight, Int8Weight, make_weight_format, quantize_int8_per_channel

RTOL = ATOL = 1e-5

if not native.available():
    pytest.skip(f"the native kernels do not build here: {native._build()}", allow_module_level=True)

KERNELS = native.resolve_native_kernels("on", torch.device("cpu"))
NATIVE = Kernels(torch.device("cpu"), KERNELS)  # every op on the native kernels
SHAPES = [(1, 33, 7), (3, 256, 256), (16, 100, 70), (5, 1000, 129), (37, 64, 20)]  # (M, K, N): tails included


def assert_close(actual: torch.Tensor, expected: torch.Tensor, scale: float = 1.0) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL * scale)


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_f32_product_matches_torch(m, k, n):
    generator = torch.Generator().manual_seed(m * k + n)
    x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((m, k), (n, k), (n,)))
    assert_close(KERNELS.linear_f32(x, weight, bias), F.linear(x, weight, bias), scale=k**0.5)
    assert_close(KERNELS.linear_f32(x, weight, None), F.linear(x, weight), scale=k**0.5)


@pytest.mark.parametrize("m, k, n", SHAPES)
def test_int8_product_matches_dequantized_torch(m, k, n):
    generator = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=generator)
    qweight, scales = quantize_int8_per_channel(torch.randn(n, k, generator=generator))
    padded = F.pad(qweight, (0, 11))  # the int8 format pads K; the kernel reads only x's K columns
    expected = F.linear(x, qweight.float() * scales[:, None])
    assert_close(KERNELS.linear_int8(x, padded, scales, None), expected, scale=k**0.5)


def test_rejects_mismatched_shapes_and_takes_empty_inputs():
    with pytest.raises(RuntimeError, match="inputs"):
        KERNELS.linear_f32(torch.randn(1, 9), torch.randn(4, 8), None)
    assert KERNELS.linear_f32(torch.randn(0, 8), torch.randn(4, 8), None).shape == (0, 4)


def _linear(weight_format, weight: torch.Tensor, bias: bool, kernels: Kernels | None = None) -> Linear:
    layer = Linear(
        weight.shape[1], weight.shape[0], bias, torch.float32, torch.device("cpu"), weight_format, kernels=kernels
    )
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.normal_()
    layer.finalize("proj")
    return layer


@pytest.mark.parametrize("rows", [1, 16, 17, 40])  # decode sizes through the kernel, prefill through F.linear
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_weight_format_with_native_kernels_matches_without(quantization, rows):
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(rows))
    plain = _linear(make_weight_format(quantization), weight, bias=False)
    fast = _linear(make_weight_format(quantization, native_layout=True), weight, bias=False, kernels=NATIVE)
    x = torch.randn(2, rows, 64, generator=torch.Generator().manual_seed(100 + rows))
    # int8 without the kernels computes in bfloat16 (aten's packed kernel), with them in float32:
    # bfloat16's rounding of the activations (2^-8 relative) over 64 products of outputs of about
    # 8 leaves differences of a few hundredths, and the largest of 3072 reaches about 0.1.
    tolerance = dict(rtol=2e-2, atol=0.15) if quantization == "int8" else dict(rtol=RTOL, atol=ATOL * 8)
    torch.testing.assert_close(fast(x), plain(x), **tolerance)
    if quantization == "none":  # one copy of the weight: dense for the kernel, nothing packed beside it
        assert not hasattr(fast, "packed_weight") and not hasattr(fast, "single_row_weight")


def test_formats_carry_the_layout_and_kernels_pickle_as_a_reload():
    assert make_weight_format("none", native_layout=True).native_layout
    assert make_weight_format("int8", native_layout=True).native_layout
    assert isinstance(make_weight_format("none"), FullWeight) and not make_weight_format("int8").native_layout
    assert pickle.loads(pickle.dumps(Int8Weight(native_layout=True))).native_layout
    reloaded = pickle.loads(pickle.dumps(NATIVE))
    assert reloaded.linear.native == KERNELS and reloaded.native_layout


def test_modes_off_on_and_other_devices():
    cpu = torch.device("cpu")
    assert native.resolve_native_kernels("off", cpu) is None
    assert native.resolve_native_kernels("auto", cpu) == KERNELS
    assert native.resolve_native_kernels("auto", torch.device("cuda")) is None
    with pytest.raises(ValueError, match="run on the CPU"):
        native.resolve_native_kernels("on", torch.device("cuda"))
    assert KERNELS.isa in ("avx512", "avx2", "scalar")
    assert KERNELS.isa in describe_native("auto", cpu)


def test_a_failed_build_falls_back_under_auto_and_fails_under_on(monkeypatch):
    failure = native.NativeKernelsUnavailable("native CPU kernels did not build (no compiler)")
    monkeypatch.setattr(native, "_build", lambda: failure)
    cpu = torch.device("cpu")
    assert not native.available()
    assert native.resolve_native_kernels("auto", cpu) is None
    with pytest.raises(ValueError, match="--native-kernels on: native CPU kernels did not build"):
        native.resolve_native_kernels("on", cpu)
    assert native.version_line().startswith("no native kernels")
    assert describe_native("on", cpu) is None


def test_build_key_changes_with_the_sources(tmp_path, monkeypatch):
    key = native.build_key()
    (tmp_path / "a.cpp").write_text("int f() { return 1; }")
    monkeypatch.setattr(native, "SOURCE_DIR", tmp_path)
    other = native.build_key()
    (tmp_path / "a.cpp").write_text("int f() { return 2; }")
    assert len({key, other, native.build_key()}) == 3
    assert native.cache_dir().parts[-2:] == ("pagoda", "kernels")


def test_version_names_the_active_kernels(capsys):
    from pagoda.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("pagoda ") and f"native CPU kernels ({KERNELS.isa}" in lines[1]
