"""Decode CUDA-graph runner, the parts that run without a GPU: buckets, padding of the static
inputs, and the padded forward (Triton kernels under the interpreter) against the plain one."""

from __future__ import annotations

import sys

import pytest
import torch

from pagoda.kernels.attention.backend import BatchLayout
from pagoda.kernels.attention.torch_backend import TorchAttentionBackend
from pagoda.worker.cuda_graphs import DecodeGraphRunner, DecodeInputs, bucket_for, decode_batch_sizes


def test_decode_batch_sizes():
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(3) == [1, 2, 3]
    assert decode_batch_sizes(8) == [1, 2, 4, 8]
    assert decode_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert decode_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    sizes = decode_batch_sizes(256)
    assert sizes[:7] == [1, 2, 4, 8, 16, 24, 32] and sizes[-1] == 256 and len(sizes) == 35


def test_bucket_for():
    sizes = decode_batch_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 20)] == [1, 2, 4, 8, 8, 16, 16, 20, 20]
    assert bucket_for(21, sizes) is None


def decode_layout(seq_lens: list[int], block_tables: list[list[int]], block_size: int = 16) -> BatchLayout:
    width = max(len(t) for t in block_tables)
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for n, t in zip(seq_lens, block_tables)]
    return BatchLayout(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(len(seq_lens) + 1),
        context_lens=torch.tensor([n - 1 for n in seq_lens]),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32),
        block_size=block_size,
        query_lens_host=[1] * len(seq_lens),
        context_lens_host=[n - 1 for n in seq_lens],
    )


def test_inputs_load_pads_rows():
    inputs = DecodeInputs.allocate(8, 4, torch.device("cpu"))
    inputs.block_tables.fill_(7)  # stale contents from an earlier step
    layout = decode_layout([20, 3, 40], [[5, 6], [2], [9, 1, 3]])
    inputs.load(torch.tensor([11, 12, 13]), torch.tensor([19, 2, 39]), layout, batch_size=4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [19, 2, 39, 0]
    assert inputs.slot_mapping[:4].tolist() == layout.slot_mapping.tolist() + [-1]
    assert inputs.seq_lens[:4].tolist() == [20, 3, 40, 1]
    assert inputs.context_lens[:4].tolist() == [19, 2, 39, 0]
    assert inputs.block_tables[:4, :3].tolist() == [[5, 6, 0], [2, 0, 0], [9, 1, 3], [0, 0, 0]]
    assert inputs.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    padded = inputs.layout(4, 16, max_model_len=64)
    assert padded.num_reqs == 4 and padded.context_lens_host == [63] * 4
    assert padded.seq_lens.data_ptr() == inputs.seq_lens.data_ptr()  # views of the static buffers


def test_runner_refuses_backend_without_graph_support():
    with pytest.raises(ValueError, match="CUDA graphs"):
        DecodeGraphRunner(None, TorchAttentionBackend(), [], {None}, 4, 64, 16, torch.device("cpu"))


def test_fits():
    runner = object.__new__(DecodeGraphRunner)
    runner.batch_sizes, runner.max_blocks_per_seq = decode_batch_sizes(4), 4
    assert runner.fits(decode_layout([20, 3], [[5, 6], [2]]))
    assert not runner.fits(decode_layout([20] * 5, [[1, 2]] * 5))  # more requests than the largest bucket
    prefill = decode_layout([20], [[5, 6]])
    prefill.query_lens_host = [4]
    assert not runner.fits(prefill)


def tiny_model(device: torch.device):
    from pagoda.model.decoder import DecoderModel
    from pagoda.model.model_config import ModelConfig

    config = ModelConfig.from_dict(
        {
            "architectures": ["MistralForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "sliding_window": 24,
        }
    )
    torch.manual_seed(0)
    model = DecoderModel(config, torch.float32, device)
    for param in model.parameters():
        param.data.normal_(0.0, 0.2)
    cache_shape = (12, 16, config.num_kv_heads, config.head_dim)
    caches = [
        (torch.randn(cache_shape, device=device), torch.randn(cache_shape, device=device))
        for _ in range(config.num_layers)
    ]
    return model, caches, set(config.layer_sliding_windows)


def reference_forward(model, caches, windows, input_ids, positions, layout):
    from pagoda.model.decoder import ForwardContext

    reference = TorchAttentionBackend()
    with torch.inference_mode():
        return model(
            input_ids, positions, ForwardContext(reference, [reference.prepare(layout, windows)] * len(caches), caches)
        )


def to_device(layout: BatchLayout, device: torch.device) -> BatchLayout:
    for name in ("slot_mapping", "query_start_loc", "context_lens", "seq_lens", "block_tables"):
        setattr(layout, name, getattr(layout, name).to(device))
    return layout


def _triton_interpreted() -> bool:
    import triton.language.standard as standard

    return type(standard.cdiv).__name__.startswith("Interpreted")


def test_padded_forward_matches_unpadded(monkeypatch):
    """The forward a graph captures, run eagerly: padded rows must not disturb the real ones or
    the cache. Triton kernels (under the interpreter without a GPU) against the torch backend."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        # TRITON_INTERPRET is read when triton's own helpers are decorated, at its first import;
        # an earlier import in this process (llguidance.torch imports triton for its GPU bitmask
        # kernel) fixes the compiled mode for good.
        if "triton" in sys.modules and not _triton_interpreted():
            pytest.skip(
                "triton was imported without TRITON_INTERPRET=1 in this process "
                "(make test-triton runs this file on its own)"
            )
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from pagoda.kernels.triton import paged_attention as triton_kernels

    if (device.type == "cpu") != type(triton_kernels._write_kv_kernel).__name__.startswith("Interpreted"):
        pytest.skip("Triton kernels were imported in the other mode (interpreted or compiled) in this process")
    from pagoda.kernels.attention.triton_backend import TritonAttentionBackend

    model, caches, windows = tiny_model(device)
    reference_caches = [(k.clone(), v.clone()) for k, v in caches]
    layout = to_device(decode_layout([20, 3, 40], [[5, 6], [2], [9, 1, 3]]), device)
    input_ids, positions = torch.tensor([11, 12, 13], device=device), torch.tensor([19, 2, 39], device=device)
    runner = DecodeGraphRunner(
        model,
        TritonAttentionBackend(decode_splits=3, min_partition=16),
        caches,
        windows,
        max_num_seqs=8,
        max_model_len=128,
        block_size=16,
        device=device,
    )
    got = runner.run_eager(input_ids, positions, layout)  # bucket 4: one padded row
    want = reference_forward(model, reference_caches, windows, input_ids, positions, layout)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (k, v), (k_ref, v_ref) in zip(caches, reference_caches):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graph_replay_matches_eager():
    """Capture every bucket, then replay batches of several sizes (different buckets, stale
    buffer contents between them) against the eager torch backend."""
    pytest.importorskip("triton")
    from pagoda.kernels.attention.triton_backend import TritonAttentionBackend

    device = torch.device("cuda")
    model, caches, windows = tiny_model(device)
    reference_caches = [(k.clone(), v.clone()) for k, v in caches]
    runner = DecodeGraphRunner(
        model,
        TritonAttentionBackend(),
        caches,
        windows,
        max_num_seqs=8,
        max_model_len=128,
        block_size=16,
        device=device,
    )
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    batches = [
        ([20, 3, 40], [[5, 6], [2], [9, 1, 3]]),
        ([41], [[9, 1, 3]]),
        ([21, 4, 100, 7, 60], [[5, 6], [2], [10, 11, 4, 7, 8, 0, 3], [1], [9, 1, 3, 8]]),
    ]
    for step, (seq_lens, tables) in enumerate(batches):
        layout = to_device(decode_layout(seq_lens, tables), device)
        input_ids = torch.arange(len(seq_lens), device=device) + step
        positions = layout.seq_lens - 1
        got = runner.run(input_ids, positions, layout).clone()
        want = reference_forward(model, reference_caches, windows, input_ids, positions, layout)
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    for (k, v), (k_ref, v_ref) in zip(caches, reference_caches):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)
