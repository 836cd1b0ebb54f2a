"""The auto preemption policy's copy rate: fed from the block transfer's loads step by step,
as an exponential moving average that follows recent copies rather than the run's mean."""

from __future__ import annotations

import pytest

from pagoda.config import EngineConfig
from pagoda.core.kv_tiers import PreemptionPolicy
from pagoda.kv_transfer.block_transfer import TransferStats
from pagoda.kv_transfer.tiers import KVTiers


class FakeTransfer:
    def __init__(self) -> None:
        self.stats = TransferStats()

    def load(self, num_blocks: int, seconds: float) -> None:
        self.stats.blocks_to_device += num_blocks
        self.stats.seconds_to_device += seconds


def test_observe_copy_is_an_exponential_moving_average() -> None:
    policy = PreemptionPolicy("auto", prior_copy_s_per_block=1.0)
    policy.observe_copy(10, 20.0)
    assert policy.copy_s_per_block == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)
    policy.observe_copy(0, 1.0)  # nothing copied: no information
    assert policy.copy_s_per_block == pytest.approx(1.2)


def test_tiers_feed_each_steps_loads_so_the_rate_follows_recent_copies(tmp_path) -> None:
    config = EngineConfig(model=str(tmp_path), kv_offload_memory="1MiB", preemption_mode="auto")
    tiers = KVTiers(config.cache, bytes_per_block=4096, fingerprint=b"")
    transfer = FakeTransfer()
    tiers.transfer = transfer  # type: ignore[assignment]

    transfer.load(100, 100 * 1e-3)  # slow copies first
    tiers.observe_step(0, 0.0)
    for _ in range(30):  # then many fast ones
        transfer.load(10, 10 * 1e-5)
        tiers.observe_step(0, 0.0)
    cumulative_mean = transfer.stats.seconds_to_device / transfer.stats.blocks_to_device
    assert tiers.policy.copy_s_per_block == pytest.approx(1e-5, rel=0.05)
    assert cumulative_mean > 20 * tiers.policy.copy_s_per_block

    before = tiers.policy.copy_s_per_block
    tiers.observe_step(0, 0.0)  # no new loads: the estimate stays
    assert tiers.policy.copy_s_per_block == before
