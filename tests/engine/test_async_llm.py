"""AsyncLLM on its own: the engine thread, streams, early exit, validation, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM, EngineDeadError
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.threads import engine_thread_count
from pagoda.sampling_params import SamplingParams
from server_utils import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def llm(model_dir) -> AsyncLLM:
    engine = AsyncLLM(EngineConfig(model=str(model_dir), num_threads=1, num_kv_blocks=64))
    yield engine
    engine.shutdown()


def wait_idle(llm: AsyncLLM) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stats = llm.get_stats()
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return
        time.sleep(0.01)
    pytest.fail(f"engine not idle: {llm.get_stats()}")


def test_generate_streams_growing_outputs(llm: AsyncLLM) -> None:
    async def main() -> list:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        return [o async for o in llm.generate(EngineRequest("r1", [5, 6, 7], params))]

    outputs = asyncio.run(main())
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    # Snapshots: an earlier output is not changed by later steps.
    assert len(outputs[0].outputs[0].token_ids) == lengths[0]


def test_leaving_early_aborts(llm: AsyncLLM) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        async for output in llm.generate(EngineRequest("r2", [5, 6, 7], params)):
            if len(output.outputs[0].token_ids) >= 3:
                break

    asyncio.run(main())
    wait_idle(llm)


def test_validation_error_before_streaming(llm: AsyncLLM) -> None:
    async def main() -> None:
        await llm.add_request(EngineRequest("r3", [], SamplingParams()))

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main())
    assert llm.is_alive


def test_default_threads_leave_a_core(tmp_path) -> None:
    config = EngineConfig(model=str(tmp_path), num_threads=None)
    assert engine_thread_count(config) >= 1
    assert engine_thread_count(EngineConfig(model=str(tmp_path), num_threads=3)) == 3


def test_shutdown(model_dir) -> None:
    engine = AsyncLLM(EngineConfig(model=str(model_dir), num_threads=1, num_kv_blocks=16))
    engine.shutdown()
    assert not engine.is_alive

    async def main() -> None:
        await engine.add_request(EngineRequest("late", [1, 2], SamplingParams()))

    with pytest.raises(EngineDeadError):
        asyncio.run(main())


def test_process_transport(model_dir) -> None:
    engine = AsyncLLM(EngineConfig(model=str(model_dir), num_threads=1, num_kv_blocks=64), transport="process")
    try:
        assert engine.is_alive and engine.max_model_len == 512
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)

        async def main() -> list:
            whole = [o async for o in engine.generate(EngineRequest("p1", [5, 6, 7], params))]
            with pytest.raises(ValueError, match="empty"):
                await engine.add_request(EngineRequest("p2", [], SamplingParams()))
            async for output in engine.generate(
                EngineRequest("p3", [5, 6], SamplingParams(max_tokens=400, ignore_eos=True))
            ):
                if len(output.outputs[0].token_ids) >= 3:
                    break
            return whole

        outputs = asyncio.run(main())
        final = outputs[-1]
        assert final.finished and len(final.outputs[0].token_ids) == 12
        assert len(final.outputs[0].logprobs) == 12 and final.prompt_token_ids == [5, 6, 7]
        # Deltas rebuild the same output the engine thread would have produced.
        with_thread = AsyncLLM(EngineConfig(model=str(model_dir), num_threads=1, num_kv_blocks=64))
        try:

            async def same() -> list:
                return [o async for o in with_thread.generate(EngineRequest("t1", [5, 6, 7], params))]

            reference = asyncio.run(same())[-1].outputs[0]
        finally:
            with_thread.shutdown()
        assert final.outputs[0].token_ids == reference.token_ids
        assert final.outputs[0].text == reference.text
        wait_idle(engine)

        engine._transport.process.kill()  # an engine crash: the front notices and fails what is pending
        deadline = time.monotonic() + 10
        while engine.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_alive and engine.error is not None

        async def late() -> None:
            await engine.add_request(EngineRequest("p4", [1, 2], SamplingParams()))

        with pytest.raises(EngineDeadError):
            asyncio.run(late())
    finally:
        engine.shutdown()
