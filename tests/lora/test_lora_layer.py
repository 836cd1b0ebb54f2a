"""The batched delta and the LoRA layer, against a per-token loop."""

from __future__ import annotations

import torch

from pagoda.kernels.lora_delta import gathered_delta, segmented_delta
from pagoda.lora.adapter import LoRAAdapter, ModuleLoRA
from pagoda.lora.batch import NO_SLOT, LoRAStepState, build_lora_batch
from pagoda.lora.layer import LoRALinear, LoRAPart
from pagoda.lora.slots import SlotTable
from pagoda.model.layers import Linear


def _adapter(name: str, rank: int, parts: list[LoRAPart], in_features: int, seed: int) -> LoRAAdapter:
    generator = torch.Generator().manual_seed(seed)
    modules = {
        (0, p.module): ModuleLoRA(
            a=torch.randn(rank, in_features, generator=generator), b=torch.randn(p.size, rank, generator=generator)
        )
        for p in parts
    }
    return LoRAAdapter(name=name, path="", rank=rank, modules=modules, content_hash=name)


def test_fused_layer_matches_per_token_reference_and_leaves_base_rows_bit_identical() -> None:
    torch.manual_seed(0)
    in_features, parts = 32, [LoRAPart("q_proj", 0, 16), LoRAPart("k_proj", 16, 8), LoRAPart("v_proj", 24, 8)]
    base = Linear(in_features, 32, False, torch.float32, torch.device("cpu"))
    base.weight.data.normal_()
    base.finalize("qkv")
    state = LoRAStepState()
    layer = LoRALinear(
        base, 0, parts, max_loras=3, max_rank=8, state=state, dtype=torch.float32, device=torch.device("cpu")
    )
    adapters = [
        _adapter("a", 8, parts, in_features, 1),
        _adapter("b", 2, parts[:2], in_features, 2),
        _adapter("c", 5, parts[2:], in_features, 3),
    ]
    for slot, adapter in enumerate(adapters):
        layer.load_slot(slot, adapter)
    runs = [(1, 3), (NO_SLOT, 2), (0, 1), (2, 4), (NO_SLOT, 1), (1, 2), (0, 5)]
    token_slots = [slot for slot, count in runs for _ in range(count)]
    x = torch.randn(len(token_slots), in_features)
    state.batch = build_lora_batch(runs, {0: 8, 1: 2, 2: 5}, torch.device("cpu"))
    out = layer(x)
    expected = base(x)
    for row, slot in enumerate(token_slots):
        if slot == NO_SLOT:
            continue
        for part in parts:
            weights = adapters[slot].modules.get((0, part.module))
            if weights is not None:
                expected[row, part.offset : part.offset + part.size] += x[row] @ weights.a.T @ weights.b.T
    base_rows = [row for row, slot in enumerate(token_slots) if slot == NO_SLOT]
    assert torch.equal(out[base_rows], base(x)[base_rows])  # bit-identical, not just close
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    # The two formulations agree on the adapter rows.
    batch = state.batch
    rows = x.index_select(0, batch.rows)
    width = batch.rank * len(parts)
    torch.testing.assert_close(
        segmented_delta(rows, layer.lora_a, layer.lora_b_t, batch, width),
        gathered_delta(rows, layer.lora_a, layer.lora_b_t, batch, width),
    )
    state.batch = None
    assert torch.equal(layer(x), base(x))  # no adapter in the step: the base layer alone


def test_one_adapter_for_the_whole_batch_takes_the_direct_path() -> None:
    parts = [LoRAPart("o_proj", 0, 16)]
    base = Linear(16, 16, False, torch.float32, torch.device("cpu"))
    base.weight.data.normal_()
    base.finalize("o")
    state = LoRAStepState()
    layer = LoRALinear(
        base, 0, parts, max_loras=2, max_rank=4, state=state, dtype=torch.float32, device=torch.device("cpu")
    )
    adapter = _adapter("a", 4, parts, 16, 5)
    layer.load_slot(1, adapter)
    x = torch.randn(6, 16)
    state.batch = build_lora_batch([(1, 6)], {1: 4}, torch.device("cpu"))
    weights = adapter.modules[(0, "o_proj")]
    torch.testing.assert_close(layer(x), base(x) + x @ weights.a.T @ weights.b.T, rtol=1e-5, atol=1e-4)


def test_slot_table_is_lru_and_keeps_the_steps_adapters() -> None:
    table = SlotTable(2)
    slots, copies = table.assign([10, 11])
    assert copies == [(10, 0), (11, 1)]
    _, copies = table.assign([10])  # 10 is now the most recent
    assert copies == []
    slots, copies = table.assign([12, 10])  # evicts 11, the least recently used
    assert copies == [(12, 1)] and slots == {12: 1, 10: 0}
    slots, copies = table.assign([11, 12])  # 10 is LRU now; 12 is needed, so it stays
    assert copies == [(11, 0)] and slots == {11: 0, 12: 1}
    assert table.num_loads == 4
