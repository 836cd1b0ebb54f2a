"""The forward profiler: times every kind of layer, counts tokens, and leaves the model as it was."""

from __future__ import annotations

from pagoda import LLM, SamplingParams
from pagoda.worker.forward_profile import KINDS, ForwardProfiler


def test_profiler_times_each_layer_kind_and_restores_the_model(llama_dir):
    llm = LLM(model=str(llama_dir))
    runner = llm.engine.core.runner
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids

    profiler = ForwardProfiler(runner.model, runner.backend)
    profiled = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    seconds = profiler.snapshot()
    assert profiled == expected
    assert list(seconds) == list(KINDS)
    assert all(seconds[kind] > 0 for kind in KINDS), seconds
    assert profiler.tokens == 4 + 5  # the prompt, then one token per decode step
    profiler.reset()
    assert profiler.tokens == 0 and not any(profiler.snapshot().values())

    profiler.close()
    assert "compute_logits" not in vars(runner.model) and "forward" not in vars(runner.backend)
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in runner.model.modules())
    assert llm.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids == expected
