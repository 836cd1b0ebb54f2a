"""The --max-num-seqs default: the policy on a fake step-time function (deterministic), then
one engine and one server that report the value they chose."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from pagoda.config import EngineConfig
from pagoda.core.capacity import sequences_that_fit
from pagoda.engine import max_num_seqs
from pagoda.engine.max_num_seqs import CEILING, calibration_cache_path, choose_max_num_seqs, resolve_max_num_seqs
from pagoda.plan import build_plan, count_params_from_architecture, model_shape_from_config


class LinearStep:
    """A decode step of `batch` sequences takes base + per_seq * batch ms; records the calls."""

    def __init__(self, base: float, per_seq: float) -> None:
        self.base, self.per_seq, self.calls = base, per_seq, []

    def __call__(self, batch: int) -> float:
        self.calls.append(batch)
        return self.base + self.per_seq * batch


def choose(step, *, num_blocks=10_000, block_size=16, budget=50.0, token_budget=2048):
    return choose_max_num_seqs(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=token_budget,
        itl_budget_ms=budget,
        step_time_ms=step,
    )


class TableStep:
    """Decode steps timed as the table says (ms by batch size); records the calls."""

    def __init__(self, table: dict[int, float]) -> None:
        self.table, self.calls = table, []

    def __call__(self, batch: int) -> float:
        self.calls.append(batch)
        return self.table[batch]


def test_hardware_bound_interpolates_between_the_last_probe_within_budget_and_the_first_over() -> None:
    step = LinearStep(base=1.0, per_seq=0.6)  # 50 ms at 81 sequences; throughput flat from 16 on
    choice = choose(step)
    assert choice.value == choice.hardware_bound == 81 and not choice.explicit and choice.throughput_knee == 16
    assert step.calls == [1, 4, 16, 64, 256, 256]  # the first probe over budget is confirmed once
    assert choice.step_ms[-1] == (256, 154.6)
    assert "bound by the ITL budget" in choice.describe() and "81" in choice.describe()


def test_the_budget_never_cuts_concurrency_below_the_throughput_knee() -> None:
    """A model whose single step is over budget (the issue's 62.7 ms) but whose batch of 16 costs
    little more is served 16 at a time: throughput rises up to 16 and stops rising beyond."""
    step = TableStep({1: 62.7, 4: 65.0, 16: 80.0, 64: 300.0, 256: 1200.0})
    choice = choose(step)
    assert choice.hardware_bound == 1 and choice.throughput_knee == 16 and choice.value == 16
    assert step.calls == [1, 1, 4, 16, 64]  # over budget and past the knee at 64: 256 is never measured
    assert "bound by the throughput knee" in choice.describe() and "throughput rises up to 16" in choice.describe()


def test_throughput_still_rising_where_the_measurements_end_admits_the_largest_batch() -> None:
    slow = LinearStep(base=80.0, per_seq=1.0)  # 81 ms alone; 256 sequences per 336 ms step still gain
    choice = choose(slow)
    assert choice.hardware_bound == 1 and choice.throughput_knee == 256 and choice.value == CEILING


def test_throughput_knee_counts_a_rise_of_ten_percent_or_more() -> None:
    assert max_num_seqs.throughput_knee([]) is None
    assert max_num_seqs.throughput_knee([(1, 10.0)]) == 1
    assert max_num_seqs.throughput_knee([(1, 10.0), (4, 36.0)]) == 4  # 4 / 36 = 1.11 x 1 / 10
    assert max_num_seqs.throughput_knee([(1, 10.0), (4, 37.0)]) == 1  # 1.08 x: a wash
    assert max_num_seqs.throughput_knee([(1, 10.0), (4, 20.0), (16, 78.0), (64, 100.0)]) == 4


def test_kv_pool_bounds_it_with_the_formula_plan_uses() -> None:
    step = LinearStep(base=1.0, per_seq=0.01)  # fast hardware: the pool binds
    choice = choose(step, num_blocks=40)  # 40 blocks: 40 running sequences hold one each
    assert choice.value == choice.kv_bound == sequences_that_fit(40, 16, 1) == 40 and choice.hardware_bound is None
    assert step.calls == [1, 4, 16, 40]  # no batch the pool cannot hold is measured
    assert "bound by the KV pool" in choice.describe()
    # plan's worksheet counts sequences with the same function
    shape = model_shape_from_config(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 1000,
            "max_position_embeddings": 512,
        }
    )
    plan = build_plan(
        shape,
        count_params_from_architecture(shape),
        model="m",
        memory_bytes=2**24,
        dtype="fp32",
        kv_dtype="fp32",
        context=512,
        block_size=16,
        reserve_bytes=0,
        classes=[],
    )
    assert plan.full_context_seqs == sequences_that_fit(plan.num_blocks, 16, 512)


def test_ceiling_token_budget_and_a_budget_nothing_meets() -> None:
    fast = LinearStep(base=0.1, per_seq=0.001)
    assert choose(fast).value == CEILING and "bound by the ceiling of 256" in choose(fast).describe()
    small_steps = LinearStep(base=0.1, per_seq=0.001)
    # no step decodes more sequences than its token budget: larger batches are never measured
    assert choose(small_steps, token_budget=32).value == CEILING and max(small_steps.calls) == 32
    flat = LinearStep(base=0.0, per_seq=100.0)  # every sequence costs its own 100 ms: no batch gains
    choice = choose(flat)
    assert choice.value == 1 and flat.calls == [1, 1, 4]  # over budget alone, and 4 at once gain nothing


def test_a_noisy_probe_is_measured_again() -> None:
    spikes = iter([1.0, 2.0, 500.0, 3.0, 4.0, 9.0])  # 16 spikes once; the repeat is within budget

    def step(batch: int) -> float:
        return next(spikes)

    assert choose(step, budget=10.0).step_ms == ((1, 1.0), (4, 2.0), (16, 3.0), (64, 4.0), (256, 9.0))


def test_an_explicit_value_wins_without_calibrating() -> None:
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"calibration touched the engine ({name})")

    choice = resolve_max_num_seqs(Untouchable(), 7, itl_budget_ms=50.0)
    assert choice.value == 7 and choice.explicit and choice.describe() == "7 (--max-num-seqs)"


@pytest.fixture
def flat_throughput(monkeypatch):
    """Calibration runs the engine's real steps, then these times count: every sequence costs its
    own 100 ms (no batch gains throughput, each is over any small budget), so the choice is one."""
    real = max_num_seqs.calibrate_decode_step

    def calibrate(core):
        measure = real(core)

        def step_time_ms(batch: int) -> float:
            measure(batch)  # the real steps still run: the engine must be left as it was
            return 100.0 * batch

        return step_time_ms

    monkeypatch.setattr(max_num_seqs, "calibrate_decode_step", calibrate)


def test_engine_chooses_reports_and_leaves_no_trace(llama_dir, flat_throughput) -> None:
    from pagoda.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64, max_num_seqs_itl_ms=50.0))
    core = engine.core
    assert core.max_num_seqs_choice.value == core.scheduler.max_num_seqs == 1
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not core.requests
    assert stats.num_prompt_tokens == stats.num_generation_tokens == 0 and core.scheduler.prefix_cache_queries == 0


def test_offline_llm_is_bound_by_the_kv_pool_without_calibrating(llama_dir, flat_throughput) -> None:
    from pagoda.engine.llm import LLM

    llm = LLM(str(llama_dir), num_threads=1, num_kv_blocks=12)
    choice = llm.engine.core.max_num_seqs_choice
    assert choice.value == choice.kv_bound == 12 and choice.step_ms == () and choice.itl_budget_ms is None
    assert "no ITL budget" in choice.describe()
    calibrated = LLM(str(llama_dir), num_threads=1, num_kv_blocks=12, max_num_seqs_itl_ms=50.0)
    assert calibrated.engine.core.max_num_seqs_choice.value == 1


def test_server_reports_the_chosen_value_in_models_banner_and_limits(tmp_path, flat_throughput) -> None:
    from pagoda.serve.launch import max_num_seqs_line
    from server_utils import MODEL_NAME, build_tiny_model, start_server

    live = start_server(build_tiny_model(tmp_path), engine={"max_num_seqs": None, "max_num_seqs_itl_ms": 50.0})
    try:
        assert live.llm.config.max_num_seqs == 1
        line = max_num_seqs_line(live.llm)
        assert line.startswith("1 (auto, bound by the ITL budget") and "calibrated in" in line
        with httpx.Client(base_url=live.url, timeout=60) as http:
            assert http.get("/v1/models").json()["data"][0]["max_num_seqs"] == 1
            response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "a", "n": 2, "max_tokens": 2})
            assert response.status_code == 400 and "--max-num-seqs" in response.json()["error"]["message"]
    finally:
        live.stop()


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_never_above_what_the_pool_holds_one_block_each(llama_dir, cache_home) -> None:
    from pagoda.engine.llm_engine import LLMEngine

    # A budget every step meets: only the pool binds, at one block per running sequence (the
    # scheduler preempts when they grow), not at full context.
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=24, max_num_seqs_itl_ms=1e6))
    choice = engine.core.max_num_seqs_choice
    assert sequences_that_fit(24, 16, engine.core.max_model_len) < 24
    assert choice.value == choice.kv_bound == 24
    assert "bound by the KV pool" in choice.describe() and "a block each" in choice.describe()


def test_two_starts_give_the_same_value_the_second_from_the_cache(llama_dir, cache_home, monkeypatch) -> None:
    from pagoda.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(llama_dir), num_threads=1, num_kv_blocks=4096, max_model_len=64, max_num_seqs_itl_ms=20.0
    )
    first = LLMEngine(config).core.max_num_seqs_choice
    assert not first.cached and calibration_cache_path().is_file()
    assert str(cache_home) in str(calibration_cache_path())

    def no_calibration(core):
        def step_time_ms(batch: int) -> float:
            raise AssertionError("calibrated although the cache holds this machine and model")

        return step_time_ms

    monkeypatch.setattr(max_num_seqs, "calibrate_decode_step", no_calibration)
    second = LLMEngine(config).core.max_num_seqs_choice
    assert second.cached and "from the calibration cache" in second.describe()
    assert (second.value, second.step_ms) == (first.value, first.step_ms)


def test_a_damaged_cache_is_ignored_with_one_log_line(llama_dir, cache_home, caplog) -> None:
    from pagoda.engine.llm_engine import LLMEngine

    path = calibration_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="pagoda.engine.max_num_seqs"):
        choice = LLMEngine(
            EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64, max_num_seqs_itl_ms=1e6)
        ).core.max_num_seqs_choice
    warnings = [r for r in caplog.records if r.name == "pagoda.engine.max_num_seqs"]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert choice.value >= 1 and not choice.cached
    assert json.loads(path.read_text())["version"] == 1  # rewritten whole


def test_the_cache_key_changes_with_what_changes_a_step(llama_dir) -> None:
    """Native kernels, threads and weight quantization each change a step's time: none of them may
    reuse another's timings."""
    import types

    import torch

    def key(**fields) -> str:
        config = EngineConfig(model=str(llama_dir), **fields)
        core = types.SimpleNamespace(
            config=config, device=torch.device("cpu"), dtype=torch.float32, num_blocks=64, max_model_len=256
        )
        return max_num_seqs.calibration_key(core, 50.0)

    base = key()
    assert key() == base
    assert (
        len(
            {
                base,
                key(native_kernels="on"),
                key(quantization="int8"),
                key(quantization="int4"),
                key(quantization="int4", quantization_group_size=32),
            }
        )
        == 5
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert key() != base
    finally:
        torch.set_num_threads(threads)
