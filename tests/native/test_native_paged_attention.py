"""The native paged decode attention against the torch reference (each request's K/V gathered
through its block table, decoded, then `attend`: SDPA or transformers' order for soft-caps and sinks).

Tolerance: the kernel accumulates in float32 with an online softmax (a running max and rescaled
partial sums block by block) and a polynomial exp accurate to about 2 ulps, so outputs, which
are convex combinations of value vectors of magnitude about 1, agree within 2e-5 absolute; with
quantized K/V both sides dequantize the same stored bytes, and only the order of applying the
per-vector scale differs (to the score or the weight instead of to each element).
"""

from __future__ import annotations

import pytest
import torch

from engine_helpers import prompts_for as engine_prompts
from model_factory import assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams, native
from pagoda.kernels.attention.backend import AttentionLayerSpec, BatchLayout
from pagoda.kernels.attention.torch_backend import NATIVE_KV_ELEMENTS, TorchAttentionBackend, attend, visibility_mask
from pagoda.quant.kv_cache_dtype import KVCacheFormat

if not native.available():
    pytest.skip(f"the native kernels do not build here: {native._build()}", allow_module_level=True)

KERNELS = native.resolve_native_kernels("on", torch.device("cpu"))
ATOL = 2e-5
QUANTIZED_ATOL = 1e-4  # float32 rounding of values an order of magnitude coarser (scale applied in another order)
# The CPU's own instruction set and every one below it, forced through the kernel's `isa` argument.
ISA_ORDER = ("avx512", "avx2", "scalar")
ISAS = list(ISA_ORDER[ISA_ORDER.index(KERNELS.isa) :])


def paged_problem(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    kv_format: KVCacheFormat | None,
    seed: int = 0,
):
    """Random K/V for each request written into a shuffled paged cache, and the queries."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    entry = kv_format.entry_size(head_dim) if kv_format is not None else head_dim
    dtype = kv_format.storage_dtype if kv_format is not None else torch.float32
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, entry, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for i, (n, count) in enumerate(zip(seq_lens, blocks_per_seq)):
        table = [order.pop() for _ in range(count)]
        block_tables[i, :count] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=generator)
        v = torch.randn(n, num_kv_heads, head_dim, generator=generator)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)])
        encode = kv_format.encode if kv_format is not None else (lambda x: x)
        key_cache.view(-1, num_kv_heads, entry)[slots] = encode(k)
        value_cache.view(-1, num_kv_heads, entry)[slots] = encode(v)
        decode = kv_format.decode if kv_format is not None else (lambda x: x)
        keys.append(decode(encode(k)))
        values.append(decode(encode(v)))
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    starts = torch.tensor([0, *query_lens]).cumsum(0)[:-1]
    return query, key_cache, value_cache, block_tables, starts, keys, values


def reference(query, starts, query_lens, keys, values, spec: AttentionLayerSpec) -> torch.Tensor:
    out = torch.empty_like(query)
    for start, n, k, v in zip(starts.tolist(), query_lens, keys, values):
        length = k.shape[0]
        mask = visibility_mask(torch.arange(length - n, length), torch.arange(length), spec.sliding_window)
        q = query[start : start + n].transpose(0, 1).unsqueeze(0)
        result = attend(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), mask, spec)
        out[start : start + n] = result.squeeze(0).transpose(0, 1)
    return out


def run_kernel(query, key_cache, value_cache, block_tables, starts, query_lens, seq_lens, spec, kv_format, isa=""):
    element, per_token, tensor_scale = "", False, 1.0
    if kv_format is not None:
        element = NATIVE_KV_ELEMENTS[kv_format.element_dtype]
        per_token, tensor_scale = kv_format.scale_per_token, kv_format.tensor_scale
    return KERNELS.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        starts,
        torch.tensor(query_lens),
        torch.tensor(seq_lens),
        spec.scale,
        spec.sliding_window,
        spec.logit_softcap,
        spec.sinks,
        element,
        per_token,
        tensor_scale,
        isa,
    )


def check(
    seq_lens,
    query_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size=16,
    window=None,
    softcap=None,
    sinks=False,
    kv_dtype="auto",
    isa="",
    seed=0,
):
    kv_format = KVCacheFormat(kv_dtype, torch.float32) if kv_dtype != "auto" else None
    query, key_cache, value_cache, tables, starts, keys, values = paged_problem(
        seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, kv_format, seed
    )
    sink_logits = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed + 7)) if sinks else None
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, window, softcap, sink_logits)
    expected = reference(query, starts, query_lens, keys, values, spec)
    actual = run_kernel(query, key_cache, value_cache, tables, starts, query_lens, seq_lens, spec, kv_format, isa)
    tolerance = ATOL if kv_format is None else QUANTIZED_ATOL
    torch.testing.assert_close(actual, expected, rtol=0, atol=tolerance)


# Lengths on both sides of block boundaries (block_size 16), one token, and a long one.
SEQ_LENS = [1, 15, 16, 17, 33, 130]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (14, 2)])  # GQA 1, 2, 7
def test_decode_matches_torch(num_heads, num_kv_heads, head_dim, isa):
    check(SEQ_LENS, [1] * len(SEQ_LENS), num_heads, num_kv_heads, head_dim, isa=isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("feature", ["window", "softcap", "sinks", "all"])
def test_window_softcap_and_sinks_match_torch(feature, isa):
    window = 24 if feature in ("window", "all") else None
    softcap = 2.0 if feature in ("softcap", "all") else None
    check(
        SEQ_LENS,
        [1] * len(SEQ_LENS),
        8,
        2,
        64,
        window=window,
        softcap=softcap,
        sinks=feature in ("sinks", "all"),
        isa=isa,
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2", "fp8"])
def test_quantized_kv_matches_torch_on_the_same_bytes(kv_dtype, isa):
    check(SEQ_LENS, [1] * len(SEQ_LENS), 8, 2, 64, kv_dtype=kv_dtype, isa=isa)
    check([40, 9], [1, 1], 4, 2, 72, window=24, kv_dtype=kv_dtype, isa=isa)  # a head_dim off the vector width


@pytest.mark.parametrize("isa", ISAS)
def test_several_query_tokens_per_sequence_are_causal(isa):
    # Speculative verification: each request's last few positions, its rows seeing only keys up to theirs.
    check([5, 20, 47], [5, 3, 4], 6, 2, 64, window=16, sinks=True, isa=isa)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_other_block_sizes_and_odd_head_dims(block_size):
    check([1, 7, 50], [1, 1, 1], 4, 1, 16, block_size=block_size)
    check([3, 31], [1, 2], 2, 2, 20, block_size=block_size, softcap=5.0)


def test_rejects_what_it_cannot_read():
    query = torch.randn(1, 4, 64)
    cache = torch.zeros(2, 16, 2, 64)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    args = (tables, torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="keys"):
        KERNELS.paged_attention(query, cache, cache, *args, torch.tensor([40]), 0.1, None, None, None)
    with pytest.raises(RuntimeError, match="query heads"):
        KERNELS.paged_attention(torch.randn(1, 3, 64), cache, cache, *args, torch.tensor([3]), 0.1, None, None, None)
    with pytest.raises(RuntimeError, match="head_dim"):
        KERNELS.paged_attention(torch.randn(1, 4, 32), cache, cache, *args, torch.tensor([3]), 0.1, None, None, None)


def mixed_layout(context_lens: list[int], query_lens: list[int], block_size: int = 16) -> BatchLayout:
    """Requests whose blocks are laid out consecutively after block 0; the new tokens' slots follow their context."""
    tables, slots, next_block = [], [], 1
    for context, n in zip(context_lens, query_lens):
        blocks = -(-(context + n) // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        slots += [tables[-1][t // block_size] * block_size + t % block_size for t in range(context, context + n)]
        next_block += blocks
    width = max(len(t) for t in tables)
    return BatchLayout(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0),
        context_lens=torch.tensor(context_lens),
        seq_lens=torch.tensor(context_lens) + torch.tensor(query_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=block_size,
        query_lens_host=list(query_lens),
        context_lens_host=list(context_lens),
    )


@pytest.mark.parametrize(
    "kv_dtype, dtype",
    [
        ("auto", torch.float32),
        ("int8", torch.float32),
        ("fp8", torch.float32),
        ("auto", torch.bfloat16),
        ("auto", torch.float16),
    ],
)
def test_backend_with_native_kernels_matches_without(kv_dtype, dtype):
    # Decodes, a verification of 3 tokens, a first chunk of 5 and a prefill chunk of 20 over a context:
    # all but the last through the kernel, the last through SDPA, in one batch.
    context_lens, query_lens = [7, 40, 0, 10, 100], [1, 3, 5, 20, 1]
    layout = mixed_layout(context_lens, query_lens)
    generator = torch.Generator().manual_seed(3)
    tokens, num_blocks = sum(query_lens), int(layout.block_tables.max()) + 1
    query = torch.randn(tokens, 8, 32, generator=generator).to(dtype)
    key, value = (torch.randn(tokens, 2, 32, generator=generator).to(dtype) for _ in range(2))
    kv_format = KVCacheFormat(kv_dtype, dtype)
    history = [torch.randn(num_blocks, 16, 2, 32, generator=generator).to(dtype) for _ in range(2)]
    caches = [kv_format.encode(h) for h in history]
    spec = AttentionLayerSpec(8, 2, 32, 32**-0.5, 24, 3.0, torch.randn(8, generator=generator))
    outputs = []
    for kernels in (None, KERNELS):
        backend = TorchAttentionBackend(kv_format, kernels)
        metadata = backend.prepare(layout, {24})
        assert (metadata.native is not None) == (kernels is not None)
        outputs.append(backend.forward(query, key, value, *(c.clone() for c in caches), metadata, spec))
    assert outputs[1].dtype == dtype
    # Half precision: the SDPA path attends the verification and the chunk in it, the kernel in float32.
    torch.testing.assert_close(
        outputs[1].float(), outputs[0].float(), rtol=0, atol=ATOL if dtype == torch.float32 else 2e-2
    )


def test_a_batch_of_prefill_chunks_only_keeps_the_sdpa_path():
    layout = mixed_layout([0, 4], [17, 30])
    metadata = TorchAttentionBackend(None, KERNELS).prepare(layout, {None})
    assert metadata.native is None and len(metadata.prefills) == 2


NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def parity_prompts(vocab_size: int) -> list[list[int]]:
    return engine_prompts(vocab_size, (3, 11, 40, 57), shared_length=12, seed=1)  # 40 and 57 pass the 24-token windows


# Llama (GQA 2), Gemma 2 (soft-capped scores, alternating sliding windows), gpt-oss (sinks, a sliding layer);
# ngram speculation and prefill chunks of at most 16 tokens (over cached prefixes, in blocks of 4) send several
# query tokens per sequence through the kernel.
@pytest.mark.parametrize(
    "architecture, engine_args",
    [
        ("llama", {}),
        ("gemma2", {}),
        ("gpt_oss", {}),
        ("gpt_oss", dict(speculative="ngram", num_speculative_tokens=3)),
        ("gemma2", dict(enable_prefix_caching=True, max_num_batched_tokens=16, block_size=4)),
    ],
    ids=["llama", "gemma2", "gpt_oss", "gpt_oss-ngram", "gemma2-chunks"],
)
def test_greedy_matches_transformers_with_native_attention(tmp_path, architecture, engine_args):
    directory = build_model(tmp_path / architecture, architecture)
    prompts, references = hf_references(directory, parity_prompts, NEW_TOKENS)
    llm = LLM(model=str(directory), native_kernels="on", **engine_args)
    assert llm.engine.core.runner.backend.native is not None
    assert_matches_reference(llm.generate(prompts, GREEDY), references, 1e-4)


def test_int8_kv_cache_gives_the_same_greedy_ids_with_and_without_the_kernel(tmp_path):
    directory = build_model(tmp_path / "llama", "llama")
    prompts = parity_prompts(384)
    outputs = [
        LLM(model=str(directory), kv_cache_dtype="int8", native_kernels=mode).generate(prompts, GREEDY)
        for mode in ("off", "on")
    ]
    for off, on in zip(*outputs, strict=True):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
