"""Speculative decoding never changes what the target model would produce."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from model_factory import build_model
from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.request import Request
from pagoda.spec_decode import rejection_sampler
from pagoda.spec_decode.ngram_proposer import NgramProposer
from pagoda.worker.sampler import Sampler


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, llama_dir):
    # Same tokenizer as the target (build_model trains the same one), one layer, other weights.
    return build_model(tmp_path_factory.mktemp("draft") / "draft", "llama", seed=5, num_hidden_layers=1)


def mixed_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 300, (n,), generator=generator).tolist() for n in (5, 30, 70, 12)]
    prompts.append([5, 6, 7, 8, 9] * 6)  # repetitive: n-gram matches
    return prompts


def greedy(directory, prompts, **engine_args):
    llm = LLM(model=str(directory), **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm


def assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.kv_cache.num_held_blocks() == 0  # both models' KV live in these blocks


def test_greedy_output_is_identical_with_speculation(llama_dir, draft_dir):
    prompts = mixed_prompts()
    baseline, _ = greedy(llama_dir, prompts)
    runs = {
        "ngram": dict(speculative="ngram"),
        "draft": dict(speculative="draft", draft_model=str(draft_dir)),
        "draft, preempted": dict(
            speculative="draft", draft_model=str(draft_dir), num_kv_blocks=12, num_speculative_tokens=3
        ),
        "ngram, preempted, chunked": dict(speculative="ngram", num_kv_blocks=12, max_num_batched_tokens=24),
    }
    for name, engine_args in runs.items():
        outputs, llm = greedy(llama_dir, prompts, **engine_args)
        assert outputs == baseline, name
        stats = llm.engine.get_stats()
        assert stats.spec_decode.num_drafts > 0, name
        if "preempted" in name:
            assert stats.num_preemptions > 0, name
        # Usage counts emitted tokens only, never rejected drafts.
        assert stats.num_generation_tokens == sum(len(o) for o in outputs), name
        assert_idle(llm)


def test_draft_identical_to_target_accepts_everything(llama_dir):
    """A draft equal to the target must agree at every position: proof that the draft's KV,
    kept in the target's blocks, stays in step through acceptance, rollback and prefix hits."""
    prompts = mixed_prompts()
    _, llm = greedy(llama_dir, prompts + prompts[:2], speculative="draft", draft_model=str(llama_dir))
    spec = llm.engine.get_stats().spec_decode
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.mean_accepted_length == pytest.approx(1 + spec.num_draft_tokens / spec.num_drafts)


def test_sampled_speculation_is_reproducible_and_leaves_no_blocks(llama_dir, draft_dir):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True, repetition_penalty=1.1)
    prompts = mixed_prompts()
    runs = []
    for _ in range(2):
        llm = LLM(model=str(llama_dir), speculative="draft", draft_model=str(draft_dir))
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert_idle(llm)
    assert runs[0] == runs[1]


def test_aborts_during_speculation_free_every_block(llama_dir, draft_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), speculative="draft", draft_model=str(draft_dir)))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i, prompt in enumerate(mixed_prompts()):
        engine.add_request(EngineRequest(str(i), prompt, params))
    for _ in range(6):
        engine.step()
    engine.abort_request([str(i) for i in range(5)])
    engine.step()
    assert engine.core.kv_cache.num_held_blocks() == 0
    assert engine.get_stats().spec_decode.num_drafts > 0


def test_speculation_pauses_beyond_the_batch_limit(llama_dir):
    prompts = mixed_prompts()
    _, llm = greedy(llama_dir, prompts, speculative="ngram", speculative_max_batch=2)
    busy = llm.engine.get_stats().spec_decode.num_drafts
    _, llm = greedy(llama_dir, prompts, speculative="ngram", speculative_max_batch=64)
    assert busy < llm.engine.get_stats().spec_decode.num_drafts


def test_ngram_proposer_uses_the_most_recent_longest_match():
    proposer = NgramProposer(ngram_min=1, ngram_max=3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert proposer.propose([4, 5, 6], 2) == []
    assert proposer.propose([5, 1, 5], 3) == [1, 5]
    # Token ids whose bytes straddle boundaries must not match: only whole tokens count.
    assert proposer.propose([256, 1, 0, 1], 1) == [0]


# ---- the acceptance rule preserves the target distribution --------------------------------------

VOCAB = 6
TRIALS = 6000


def emitted_frequencies(draft_probs: torch.Tensor | None, drafts_from_q: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Emit tokens from fixed target logits at 2 positions, drafts drawn from q; returns counts
    of the first and second emitted tokens and the target distributions."""
    target = torch.tensor(
        [[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 1.5, 0.4, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0, 0.0, 0.0]]
    )
    sampler = Sampler(VOCAB, torch.device("cpu"), seed=1)
    params = SamplingParams(temperature=1.0)
    request = Request("r", [1], params, frozenset(), 100)
    draw = torch.Generator().manual_seed(2)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    q = draft_probs if draft_probs is not None else None
    for _ in range(TRIALS):
        if drafts_from_q:
            drafts = [int(torch.multinomial(q[i], 1, generator=draw)) for i in range(2)]
        else:
            drafts = [3, 2]  # a deterministic proposer (n-gram): q is a point mass
        result = rejection_sampler.verify(sampler, target, request, drafts, q)
        first[result.token_ids[0]] += 1
        if len(result.token_ids) > 1:
            second[result.token_ids[1]] += 1
    return first, second, target.softmax(-1)


def fits(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return chisquare(counts.numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("proposer", ["draft model", "point mass"])
def test_rejection_sampling_preserves_the_target_distribution(proposer):
    q = torch.tensor([[0.05, 0.1, 0.5, 0.2, 0.1, 0.05], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
    first, second, p = emitted_frequencies(q if proposer == "draft model" else None, proposer == "draft model")
    assert fits(first, p[0]) > 1e-3
    assert fits(second, p[1]) > 1e-3


def test_a_wrong_acceptance_rule_fails_the_distribution_test(monkeypatch):
    """Drawing from p itself after a rejection (a common mistake) over-weights the tokens the
    draft favours; the same chi-square test must catch it."""
    monkeypatch.setattr(rejection_sampler, "residual_distribution", lambda p, q: p)
    q = torch.tensor([[0.05, 0.1, 0.5, 0.2, 0.1, 0.05], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
    first, _, p = emitted_frequencies(q, drafts_from_q=True)
    assert fits(first, p[0]) < 1e-6
