"""The process transport's pipe carries no pickle in either direction: what the engine sends back
(ready, step outputs with their deltas, refusals and stats, its death) and its startup arguments
are typed msgpack, decoded against the expected types. A crafted pickle (whose __reduce__ would
create a marker file) sent to the front's reader or to the engine process runs nothing and is
refused: the front treats an engine that sent it as dead, the engine drops it and keeps serving."""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

import pytest

from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.step_output import EngineStepOutput, HandoffOutcome
from pagoda.engine.transport.encoding import (
    Dead,
    Failed,
    decode_config,
    decode_message,
    decode_reply,
    encode_config,
    encode_reply,
    factory_reference,
    resolve_factory,
)
from pagoda.engine.transport.process import ProcessTransport
from pagoda.errors import InvalidRequest
from pagoda.outputs import CompletionDelta, Logprob, RequestMetrics, RequestOutputDelta
from pagoda.sampling_params import SamplingParams
from server_utils import build_tiny_model


class _Marker:
    """Unpickling this creates the file at `path`: proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def crafted(marker: Path) -> bytes:
    return pickle.dumps(_Marker(marker))


def step_output() -> EngineStepOutput:
    delta = RequestOutputDelta(
        "r",
        [
            CompletionDelta(
                0, "hi", [1, 2], [{1: Logprob(-0.5, 1, "a"), 3: Logprob(float("-inf"), 2)}], -0.5, "stop", "</s>"
            )
        ],
        1,
        finished=True,
        num_cached_tokens=2,
        metrics=RequestMetrics(1.0, 2.0, num_preemptions=1),
        prompt_logprobs=[None, {5: Logprob(-1.0, 1, "x")}],
        prompt="p",
        prompt_token_ids=[1, 2],
    )
    refused = {
        "x": InvalidRequest("too long", param="prompt", code="context_length_exceeded"),
        "y": RuntimeError("the engine could not add the request"),
    }
    return EngineStepOutput([delta], ["a"], refused, {"z": HandoffOutcome(False, "refused")})


def test_what_the_engine_sends_round_trips_typed() -> None:
    sent = step_output()
    message = decode_reply(encode_reply(Dead("worker 1 died")))
    assert message == Dead("worker 1 died")
    batch = msgspec_round_trip(sent)  # a Batch also carries the stats: see the live test below
    assert batch.deltas == sent.deltas and batch.accepted == ["a"] and batch.handoffs == sent.handoffs
    refused = batch.refused
    assert isinstance(refused["x"], InvalidRequest) and (refused["x"].param, refused["x"].code) == (
        "prompt",
        "context_length_exceeded",
    )
    assert type(refused["y"]) is RuntimeError and str(refused["y"]) == "the engine could not add the request"


def msgspec_round_trip(output: EngineStepOutput) -> EngineStepOutput:
    import msgspec

    from pagoda.engine.transport.encoding import _dec_hook, _enc_hook

    return msgspec.msgpack.decode(
        msgspec.msgpack.encode(output, enc_hook=_enc_hook), type=EngineStepOutput, dec_hook=_dec_hook
    )


def test_the_startup_arguments_are_plain() -> None:
    config = EngineConfig(num_threads=1, num_kv_blocks=64, kv_transfer_secret="s" * 32)
    assert decode_config(encode_config(config)) == config
    assert factory_reference(None) is None
    assert factory_reference(build_tiny_model) == "server_utils:build_tiny_model"
    assert resolve_factory("server_utils:build_tiny_model") is build_tiny_model
    with pytest.raises(ValueError, match="module-level"):
        factory_reference(lambda config: None)


def test_a_pickle_decodes_to_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for decode in (decode_reply, decode_message, decode_config):
        with pytest.raises(ValueError, match="not a"):
            decode(crafted(marker))
    assert not marker.exists()


class _Process:
    def __init__(self) -> None:
        self.killed = False
        self.exitcode = None

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout: float | None = None) -> None:
        pass


def test_the_fronts_reader_refuses_a_pickle(tmp_path: Path) -> None:
    """An engine pipe that carries a pickle (the old encoding): nothing runs, the engine is stopped
    and reported dead."""
    marker = tmp_path / "ran"
    front, engine_side = Pipe()
    transport = object.__new__(ProcessTransport)
    deaths: list[BaseException] = []
    transport._conn, transport.process, transport._stopping = front, _Process(), False
    transport._on_death, transport._on_emitted = deaths.append, lambda *a: pytest.fail("emitted")
    reader = threading.Thread(target=transport._read)
    reader.start()
    engine_side.send(_Marker(marker))  # Connection.send pickles
    reader.join(10)
    assert not reader.is_alive() and transport.process.killed
    assert len(deaths) == 1 and "not a message from the engine" in str(deaths[0])
    assert not marker.exists()
    assert decode_reply(encode_reply(Failed("x"))) == Failed("x")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


def test_the_engine_process_refuses_a_pickle_and_keeps_serving(model_dir, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    engine = AsyncLLM(EngineConfig(model=str(model_dir), num_threads=1, num_kv_blocks=64), transport="process")
    try:
        engine._transport._outbox.put((crafted(marker), False))  # raw bytes on the pipe, as a peer could write
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)

        async def main() -> list:
            return [o async for o in engine.generate(EngineRequest("p1", [5, 6, 7], params))]

        final = asyncio.run(main())[-1]
        assert final.finished and len(final.outputs[0].token_ids) == 4 and len(final.prompt_logprobs) == 3
        assert engine.is_alive and engine.get_stats().num_generation_tokens >= 4
    finally:
        engine.shutdown()
    time.sleep(0.1)
    assert not marker.exists()


def test_no_module_of_the_package_reads_a_pipe_unpickling() -> None:
    """multiprocessing's Connection.recv() (and a Queue's get) unpickle: every pipe is read with recv_bytes."""
    root = Path(__file__).resolve().parents[2] / "pagoda"
    hits = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if any(
            call in path.read_text(encoding="utf-8")
            for call in (".recv()", "multiprocessing.Queue(", "context.Queue(", "context.SimpleQueue(")
        )
    ]
    assert hits == []
