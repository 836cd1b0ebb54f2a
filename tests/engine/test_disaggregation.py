"""Prefill/decode disaggregation at the engine level: a prefill engine + decode engine pair
gives the same greedy output as one engine, through each transport; the decode side's prefix
cache keeps shared blocks from travelling; a failed handoff is prefilled by the decode engine;
tenants never share transferred blocks; no KV block is held on either side afterwards."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch

from pagoda import LLM
from pagoda.config import EngineConfig
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.errors import InvalidRequest
from pagoda.kv_transfer.handoff import HandoffAuth, KVHandoff, KVListener, TransferError
from pagoda.lora_request import LoRARequest
from pagoda.sampling_params import SamplingParams

BLOCK = 16
SECRET = "k" * 32  # the deployment's KV transfer secret, shared by its prefill and decode engines
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(model_dir, role: str, **overrides) -> LLMEngine:
    config = dict(
        model=str(model_dir),
        role=role,
        num_kv_blocks=48,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=256,
        enable_prefix_caching=True,
        kv_transfer_secret=SECRET,
    )
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def prompts(count: int, length: int, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 300, (length + 5 * i,), generator=generator).tolist() for i in range(count)]


def run_to_end(llm: LLMEngine) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for delta in llm.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    return outputs


def single_engine_outputs(model_dir, token_lists, **overrides) -> dict[str, list[int]]:
    llm = engine(model_dir, "both", **overrides)
    for i, tokens in enumerate(token_lists):
        llm.add_request(EngineRequest(f"r{i}", tokens, GREEDY))
    return run_to_end(llm)


def prefill_all(llm: LLMEngine, token_lists, salts=None) -> list[KVHandoff]:
    for i, tokens in enumerate(token_lists):
        llm.add_request(EngineRequest(f"r{i}", tokens, GREEDY, cache_salt=salts[i] if salts else None))
    assert run_to_end(llm) == {}  # nothing is reported here: the decode engine streams it all
    handoffs = llm.kv_connector.take_handoffs()
    assert_idle(llm)  # blocks are freed at export, before any byte travels
    return handoffs


def hand_over(
    prefill: LLMEngine, decode: LLMEngine, handoffs, transport: str, *, timeout: float = 10.0, fallback: bool = True
) -> tuple[list[bool], list[bool]]:
    """Send each handoff from a thread; import it on this one. Returns (sent, imported)."""
    sent, imported = [], []
    with KVListener(transport, HandoffAuth(SECRET)) as listener:
        for handoff in handoffs:
            thread = threading.Thread(
                target=lambda h=handoff: sent.append(
                    prefill.kv_connector.send_handoff(h, transport, listener.address, timeout)
                )
            )
            thread.start()
            imported.append(decode.add_prefilled_request(listener.accept(timeout), fallback=fallback))
            thread.join()
    return sent, imported


def assert_idle(llm: LLMEngine) -> None:
    kv = llm.core.kv_cache
    assert not llm.has_unfinished_requests()
    assert kv.num_held_blocks() == 0 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_prefill_decode_pair_matches_one_engine(model_dirs, arch, transport):
    token_lists = prompts(3, 40)
    expected = single_engine_outputs(model_dirs[arch], token_lists)
    prefill, decode = engine(model_dirs[arch], "prefill"), engine(model_dirs[arch], "decode")
    handoffs = prefill_all(prefill, token_lists)
    assert [h.header.request_id for h in handoffs] == ["r0", "r1", "r2"]
    sent, imported = hand_over(prefill, decode, handoffs, transport)
    assert sent == imported == [True] * 3
    assert run_to_end(decode) == expected
    stats = decode.get_stats().disaggregation
    assert stats.handoffs_imported == 3 and stats.blocks_received == sum(h.header.num_blocks for h in handoffs)
    assert stats.phases["transfer"].count == stats.phases["first_decode"].count == 3
    sent_stats = prefill.get_stats().disaggregation
    assert sent_stats.blocks_sent == stats.blocks_received and sent_stats.bytes_sent == stats.bytes_received > 0
    assert sent_stats.phases["prefill"].count == sent_stats.phases["queue"].count == 3
    assert_idle(prefill)
    assert_idle(decode)


def test_quantized_kv_travels_as_stored(model_dirs):
    token_lists = prompts(2, 36, seed=8)
    expected = single_engine_outputs(model_dirs["qwen2"], token_lists, kv_cache_dtype="int8")
    prefill = engine(model_dirs["qwen2"], "prefill", kv_cache_dtype="int8")
    decode = engine(model_dirs["qwen2"], "decode", kv_cache_dtype="int8")
    handoffs = prefill_all(prefill, token_lists)
    # One byte per int8 value, then the vector's float32 scale (4 bytes), in uint8 storage.
    layout = handoffs[0].header.layout
    assert all(dtype == "uint8" for dtype, _ in layout)
    full_precision = engine(model_dirs["qwen2"], "prefill").kv_connector.handoffs.layout
    assert [shape[-1] for _, shape in layout] == [shape[-1] + 4 for _, shape in full_precision]
    assert hand_over(prefill, decode, handoffs, "tcp")[1] == [True, True]
    assert run_to_end(decode) == expected
    assert_idle(decode)


def test_shared_prefix_hits_the_decode_cache_and_tenants_stay_apart(llama_dir):
    system = prompts(1, 48, seed=11)[0]  # three full blocks shared by every request
    token_lists = [system + tail for tail in prompts(3, 10, seed=12)]
    salts = ["a", "a", "b"]
    llm = engine(llama_dir, "both")
    for i, tokens in enumerate(token_lists):
        llm.add_request(EngineRequest(f"r{i}", tokens, GREEDY, cache_salt=salts[i]))
    expected = run_to_end(llm)
    prefill, decode = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    handoffs = prefill_all(prefill, token_lists, salts)
    assert hand_over(prefill, decode, handoffs, "tcp")[1] == [True] * 3
    assert run_to_end(decode) == expected
    stats = decode.get_stats().disaggregation
    # r1 finds tenant a's three shared blocks in the decode cache; r2 (tenant b) does not.
    assert stats.blocks_cached == 3
    assert stats.blocks_received == sum(h.header.num_blocks for h in handoffs) - 3
    assert_idle(decode)


def test_mismatched_tenant_hashes_are_refused_and_prefilled_locally(llama_dir):
    token_lists = prompts(1, 40, seed=13)
    expected = single_engine_outputs(llama_dir, token_lists)
    prefill, decode = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    (handoff,) = prefill_all(prefill, token_lists)
    handoff.header.cache_salt = "other-tenant"  # the decode engine computes other hashes for it
    sent, imported = hand_over(prefill, decode, [handoff], "shm")
    assert sent == imported == [False]
    assert run_to_end(decode) == expected  # prefilled by the decode engine itself
    stats = decode.get_stats().disaggregation
    assert stats.failures["refused"] == 1 and stats.fallback_prefills == 1 and stats.blocks_received == 0
    assert prefill.get_stats().disaggregation.failures["send"] == 1
    # The blocks the decode engine cached are under its own hashes for tenant "other-tenant" only.
    cached = {b.block_hash for b in decode.core.kv_cache.pool.blocks if b.block_hash is not None}
    assert cached.isdisjoint(bytes.fromhex(h) for h in handoff.header.block_hashes)
    assert_idle(prefill)
    assert_idle(decode)


def test_stalled_transfer_times_out_and_decode_engine_prefills(llama_dir, monkeypatch):
    token_lists = prompts(2, 40, seed=14)
    expected = single_engine_outputs(llama_dir, token_lists)
    prefill, decode = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    handoffs = prefill_all(prefill, token_lists)
    import pagoda.kv_transfer.handoff as wire

    real_sendall = wire._sendall
    stall = threading.Event()

    def stalling_sendall(sock, session, *parts, **signed):
        # The sender (not this, the receiving thread) stalls before its second run of blocks.
        run = parts[0] if threading.current_thread() is not threading.main_thread() else b""
        if len(run) == wire._RUN.size and wire._RUN.unpack(run)[0] == 1:
            stall.wait(1.0)  # the receiver (timeout 0.5 s) gives up meanwhile
        real_sendall(sock, session, *parts, **signed)

    monkeypatch.setattr(wire, "CHUNK_BYTES", handoffs[0].header.block_nbytes)  # one block per frame
    monkeypatch.setattr(wire, "_sendall", stalling_sendall)
    sent, imported = hand_over(prefill, decode, handoffs[:1], "tcp", timeout=0.5)
    stall.set()
    monkeypatch.undo()
    assert sent == imported == [False]
    assert hand_over(prefill, decode, handoffs[1:], "tcp")[1] == [True]
    assert run_to_end(decode) == expected
    stats = decode.get_stats().disaggregation
    assert stats.failures["receive"] == 1 and stats.fallback_prefills == 1
    assert_idle(prefill)
    assert_idle(decode)


def test_without_fallback_a_failed_handoff_raises_and_holds_nothing(llama_dir):
    prefill, decode = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    (handoff,) = prefill_all(prefill, prompts(1, 40, seed=15))
    handoff.header.fingerprint = "another-model"
    with pytest.raises(TransferError, match="another model"):
        hand_over(prefill, decode, [handoff], "tcp", fallback=False)
    assert_idle(decode)
    assert decode.core.requests == {}


def _prefill_and_send(model_dir: str, token_lists, address: str, die_after_header: bool) -> None:
    """A prefill engine in its own process; with die_after_header it dies mid-transfer."""
    torch.set_num_threads(1)
    llm = engine(model_dir, "prefill")
    handoffs = prefill_all(llm, token_lists)
    if die_after_header:
        import pagoda.kv_transfer.handoff as wire

        original = wire._sendall

        def die_on_blocks(sock, session, *parts, **signed):
            if parts and len(parts[0]) == wire._RUN.size and wire._RUN.unpack(parts[0])[0] == 1:
                os._exit(3)  # killed after the header and the first block, mid-transfer
            original(sock, session, *parts, **signed)

        wire._sendall = die_on_blocks
        wire.CHUNK_BYTES = handoffs[0].header.block_nbytes  # one block per frame
    for handoff in handoffs:
        assert llm.kv_connector.send_handoff(handoff, "shm", address, timeout=20)


@pytest.mark.parametrize("killed", [False, True], ids=["ok", "sender-killed"])
def test_shm_across_processes(llama_dir, killed):
    token_lists = prompts(2, 40, seed=16)
    expected = single_engine_outputs(llama_dir, token_lists)
    decode = engine(llama_dir, "decode")
    context = multiprocessing.get_context("spawn")
    with KVListener("shm", HandoffAuth(SECRET)) as listener:
        sender = context.Process(target=_prefill_and_send, args=(str(llama_dir), token_lists, listener.address, killed))
        sender.start()
        imported = [decode.add_prefilled_request(listener.accept(timeout=60)) for _ in range(1 if killed else 2)]
        sender.join(30)
    assert sender.exitcode == (3 if killed else 0)
    outputs = run_to_end(decode)
    if killed:
        assert imported == [False]  # prefilled locally instead
        assert outputs == {"r0": expected["r0"]}
        assert decode.get_stats().disaggregation.failures["receive"] == 1
    else:
        assert imported == [True, True] and outputs == expected
    assert_idle(decode)


def test_roles_are_checked(llama_dir):
    with pytest.raises(ValueError, match="role"):
        EngineConfig(model=str(llama_dir), role="router")
    with pytest.raises(ValueError, match="draft is not supported with role"):
        EngineConfig(model=str(llama_dir), role="decode", speculative="draft", draft_model=str(llama_dir))
    with pytest.raises(ValueError, match="role prefill is not supported by the offline LLM"):
        LLM(model=str(llama_dir), role="prefill")
    prefill = engine(llama_dir, "prefill")
    with pytest.raises(InvalidRequest, match="n > 1"):
        prefill.add_request(EngineRequest("r", [5, 6, 7], SamplingParams(n=2)))
    # A request that ends with its first token is simply finished, not handed off.
    prefill.add_request(EngineRequest("one", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1)))
    outputs = run_to_end(prefill)
    assert len(outputs["one"]) == 1 and prefill.kv_connector.take_handoffs() == []
    assert_idle(prefill)


def test_adapter_identity_travels_and_a_different_adapter_is_refused(llama_dir, tmp_path):
    pytest.importorskip("peft", reason="peft (the test extra) builds the PEFT adapters")
    from lora_factory import ATTENTION_MODULES, build_adapter

    adapters = [
        build_adapter(llama_dir, tmp_path / f"a{seed}", target_modules=ATTENTION_MODULES, rank=4, seed=seed)
        for seed in (1, 2)
    ]
    token_lists = prompts(1, 40, seed=17)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def lora_engine(role: str, adapter) -> LLMEngine:
        return engine(llama_dir, role, enable_lora=True, lora_modules=[f"sql={adapter}"])

    def alone(adapter) -> list[int]:
        llm = lora_engine("both", adapter)
        llm.add_request(EngineRequest("r0", token_lists[0], params, lora_request=LoRARequest("sql")))
        return run_to_end(llm)["r0"]

    prefill = lora_engine("prefill", adapters[0])
    for role_adapter, expect_import in ((adapters[0], True), (adapters[1], False)):
        prefill.add_request(EngineRequest("r0", token_lists[0], params, lora_request=LoRARequest("sql")))
        run_to_end(prefill)
        (handoff,) = prefill.kv_connector.take_handoffs()
        assert handoff.header.lora_name == "sql"
        decode = lora_engine("decode", role_adapter)
        # Same adapter name; with other weights the hashes differ and the KV is not used.
        assert hand_over(prefill, decode, [handoff], "tcp")[1] == [expect_import]
        assert run_to_end(decode)["r0"] == alone(role_adapter)
        assert_idle(decode)
    assert_idle(prefill)


def test_listener_imports_awaited_requests_off_the_engine_thread_and_an_abort_mid_receive_leaks_nothing(
    llama_dir, monkeypatch
):
    """The router's path: the decode engine awaits the request, its own listener and receive
    threads take the KV, and step() applies the events. A request aborted while its blocks are
    being written keeps them until the write ends, then frees them; one that arrives for an
    unknown id is refused."""
    from pagoda.kv_transfer import handoff as wire

    token_lists = prompts(2, 40, seed=23)
    expected = single_engine_outputs(llama_dir, token_lists)
    prefill = engine(llama_dir, "prefill")
    handoffs = prefill_all(prefill, token_lists)
    decode = engine(llama_dir, "decode")
    assert decode.kv_connector.kv_address is not None and decode.kv_connector.kv_address.startswith("127.0.0.1:")
    woken = threading.Event()
    decode.kv_connector.set_wake(woken.set)
    for i, tokens in enumerate(token_lists):
        decode.add_request(EngineRequest(f"r{i}", tokens, GREEDY), awaiting_kv=True)
    assert not decode.has_unfinished_requests()  # nothing to step until a handoff arrives

    # r0 goes through untouched; r1's blocks wait on `release` after the header.
    release = threading.Event()
    real_sendall = wire._sendall

    def held_blocks(sock, session, *parts, **signed):
        if len(parts) > 1 and threading.current_thread().name == "held":
            release.wait(10)
        return real_sendall(sock, session, *parts, **signed)

    monkeypatch.setattr(wire, "_sendall", held_blocks)
    sent = []
    threads = [
        threading.Thread(
            target=lambda h=h: sent.append(prefill.kv_connector.send_handoff(h, "tcp", decode.kv_connector.kv_address)),
            name=name,
        )
        for h, name in zip(handoffs, ("free", "held"))
    ]
    for thread in threads:
        thread.start()
    outputs: dict[str, list[int]] = {}
    deadline = time.monotonic() + 10
    while "r1" not in decode.kv_connector._receiving or "r0" not in outputs:
        assert time.monotonic() < deadline
        woken.wait(0.05)
        woken.clear()
        for delta in decode.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    decode.abort_request(["r1"])  # its blocks are being written: freed when the write ends
    assert decode.core.kv_cache.num_held_blocks() > 0
    release.set()
    for thread in threads:
        thread.join()
    aborted = {}
    while decode.has_unfinished_requests() or "r1" in decode.kv_connector._receiving:
        for delta in decode.step().deltas:
            if delta.request_id == "r1":
                aborted = delta
            else:
                outputs.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
    assert outputs["r0"] == expected["r0"]
    assert aborted and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert sorted(sent) == [True, True]
    assert_idle(decode)
    # A handoff for a request this engine does not await is refused (the sender sees it).
    stray = prefill_all(prefill, token_lists[:1])[0]
    refused = []
    thread = threading.Thread(
        target=lambda: refused.append(prefill.kv_connector.send_handoff(stray, "tcp", decode.kv_connector.kv_address))
    )
    thread.start()
    while thread.is_alive():
        woken.wait(0.05)
        decode.step()
    assert refused == [False] and prefill.kv_connector.handoffs.stats.failures["send"] == 1
    assert decode.kv_connector.handoffs.stats.failures["refused"] == 1
    assert_idle(decode)
    decode.close()


def test_imported_requests_wait_for_a_running_slot(llama_dir):
    """--max-num-seqs holds on the decode side: an import beyond it waits, KV in place, and
    joins the running set ahead of waiting requests as slots free."""
    token_lists = prompts(3, 30, seed=31)
    expected = single_engine_outputs(llama_dir, token_lists)
    prefill = engine(llama_dir, "prefill")
    decode = engine(llama_dir, "decode", max_num_seqs=1)
    sent, imported = hand_over(prefill, decode, prefill_all(prefill, token_lists), "tcp")
    assert sent == imported == [True, True, True]
    assert len(decode.core.scheduler.running) == 1 and len(decode.core.scheduler.imported) == 2
    outputs: dict[str, list[int]] = {}
    while decode.has_unfinished_requests():
        for delta in decode.step().deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
        assert len(decode.core.scheduler.running) <= 1
    assert outputs == expected
    assert_idle(decode)
    decode.close()
