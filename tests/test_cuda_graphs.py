"""Decode CUDA-graph runner, the parts that run without a GPU: buckets, padding of the static
inputs, and the padded forward (Triton kernels under the interpreter) against the plain one."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.attention.backend import BatchLayout
from pagoda.model.attention.torch_backend import TorchAttentionBackend
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
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(seq_lens) + 1),
        context_lens=torch.tensor([n - 1 for n in seq_lens]), seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32),
        block_size=block_size, query_lens_host=[1] * len(seq_lens), context_lens_host=[n - 1 for n in seq_lens])


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


def test_padded_forward_matches_unpadded(monkeypatch):
    """The forward a graph captures, run eagerly on CPU: padded rows must not disturb the real
    ones or the cache. Triton kernels under the interpreter; reference: the torch backend."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from pagoda.model.attention import triton_kernels
    if not type(triton_kernels._write_kv_kernel).__name__.startswith("Interpreted"):
        pytest.skip("Triton kernels were imported without the interpreter in this process")
    from pagoda.model.attention.triton_backend import TritonAttentionBackend
    from pagoda.model.llama import ForwardContext, LlamaFamilyModel
    from pagoda.model.model_config import ModelConfig

    config = ModelConfig.from_dict({
        "architectures": ["MistralForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "sliding_window": 24})
    torch.manual_seed(0)
    model = LlamaFamilyModel(config, torch.float32, torch.device("cpu"))
    for param in model.parameters():
        param.data.normal_(0.0, 0.2)
    cache_shape = (12, 16, config.num_kv_heads, config.head_dim)
    caches = [(torch.randn(cache_shape), torch.randn(cache_shape)) for _ in range(config.num_layers)]
    reference_caches = [(k.clone(), v.clone()) for k, v in caches]
    windows = set(config.layer_sliding_windows)

    layout = decode_layout([20, 3, 40], [[5, 6], [2], [9, 1, 3]])
    input_ids, positions = torch.tensor([11, 12, 13]), torch.tensor([19, 2, 39])
    runner = DecodeGraphRunner(model, TritonAttentionBackend(decode_splits=3, min_partition=16), caches, windows,
                               max_num_seqs=8, max_model_len=128, block_size=16, device=torch.device("cpu"))
    with torch.inference_mode():
        got = runner.run_eager(input_ids, positions, layout)  # bucket 4: one padded row
        reference = TorchAttentionBackend()
        want = model(input_ids, positions, ForwardContext(reference, reference.prepare(layout, windows),
                                                          reference_caches))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (k, v), (k_ref, v_ref) in zip(caches, reference_caches):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)
