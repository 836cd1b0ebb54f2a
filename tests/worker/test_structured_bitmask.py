"""The bitmask applies exactly: allowed logits unchanged, the rest -inf, other rows untouched."""

from __future__ import annotations

import torch

from pagoda.kernels.bitmask import allocate_bitmask, apply_bitmask


def reference(logits: torch.Tensor, allowed: list[set[int]], rows: list[int]) -> torch.Tensor:
    expected = logits.clone()
    for mask_row, row in enumerate(rows):
        for token in range(logits.shape[1]):
            if token not in allowed[mask_row]:
                expected[row, token] = float("-inf")
    return expected


def test_apply_matches_a_token_by_token_reference():
    generator = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(5, vocab, generator=generator)
    logits[1, 3] = float("-inf")
    rows = [0, 1, 3]
    allowed = [set(torch.randint(0, vocab, (30,), generator=generator).tolist()) | {3, 31, 32, 99} for _ in rows]
    bitmask = allocate_bitmask(len(rows), vocab)
    bitmask.zero_()
    for mask_row, tokens in enumerate(allowed):
        for token in tokens:
            word = bitmask[mask_row, token // 32].item() & 0xFFFFFFFF
            word |= 1 << (token % 32)
            bitmask[mask_row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
    expected = reference(logits, allowed, rows)
    got = logits.clone()
    apply_bitmask(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, expected)
    assert torch.equal(got[2], logits[2]) and torch.equal(got[4], logits[4])
    everything = logits.clone()
    apply_bitmask(everything, allocate_bitmask(5, vocab))  # all allowed: nothing changes
    assert torch.equal(everything, logits)
    wider = torch.randn(2, vocab + 40, generator=generator)  # logits past the tokenizer's vocabulary
    apply_bitmask(wider, allocate_bitmask(2, vocab))
    assert torch.isinf(wider[:, 128:]).all() and torch.isfinite(wider[:, :vocab]).all()


def test_parallel_fill_and_background_fill_match_row_by_row():
    """GrammarMasks fills rows with llguidance's executor (many cores) or one by one, in a
    worker thread or inline: the bitmask is the same."""
    from concurrent.futures import ThreadPoolExecutor

    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from pagoda.config import DEFAULT_MODEL_DIR
    from pagoda.request import Request
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
    from pagoda.structured.grammar import build_grammar
    from pagoda.structured.manager import GrammarMasks
    from pagoda.structured.matcher import RequestMatcher

    hf = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    tokenizer = llguidance.hf.from_tokenizer(hf)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}}
    template = llguidance.LLMatcher(tokenizer, build_grammar(StructuredOutputsParams(json=schema)))
    prefixes = ['{"a": 1', '{"a": 12, "b": ', "", '{"a": -']

    def requests(executor):
        result = []
        for i, prefix in enumerate(prefixes):
            request = Request(f"r{i}", [1], SamplingParams(), frozenset(), 8)
            request.structured_output = RequestMatcher(template.deep_copy(), "json", executor)
            assert request.structured_output.accept(tokenizer.tokenize_str(prefix)) == len(
                tokenizer.tokenize_str(prefix)
            )
            result.append(request)
        return result

    vocab = len(hf)
    plain = requests(None)
    drafts = hf.encode("3, ", add_special_tokens=False)  # the first request verifies drafts
    groups, row = [], 0
    for i, request in enumerate(plain):
        groups.append((row, request, drafts if i == 0 else []))
        row += 1 + (len(drafts) if i == 0 else 0)
    expected = GrammarMasks(groups, vocab).bitmask
    with ThreadPoolExecutor(1) as pool:
        for executor in (None, llguidance.LLExecutor(2)):
            other = requests(executor)
            masks = GrammarMasks([(row, other[i], d) for i, (row, _, d) in enumerate(groups)], vocab, pool)
            logits = torch.zeros(row, vocab)
            masks.apply(logits)
            assert torch.equal(masks.bitmask, expected)
    assert plain[0].structured_output.num_accepted == len(tokenizer.tokenize_str('{"a": 1'))  # drafts rolled back
