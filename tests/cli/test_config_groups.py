"""EngineConfig is the union of its sub-configs: each setting is declared in exactly one group,
construction stays flat, and a consumer's sub-config is a frozen copy of its group's fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagoda.config import ENGINE_CONFIG_GROUPS, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig


def test_every_setting_is_in_exactly_one_group() -> None:
    names = [f.name for group in ENGINE_CONFIG_GROUPS.values() for f in dataclasses.fields(group)]
    assert len(names) == len(set(names))
    assert set(names) == {f.name for f in dataclasses.fields(EngineConfig)}


def test_sub_configs_are_frozen_copies_that_follow_replace() -> None:
    config = EngineConfig(block_size=32, kv_offload_memory="1MiB", speculative="ngram", max_num_seqs=7)
    assert config.cache == CacheConfig(block_size=32, kv_offload_memory="1MiB")
    assert config.speculation == SpeculativeConfig(speculative="ngram")
    assert config.scheduler.max_num_seqs_bound == 7 == config.max_num_seqs_bound
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 64  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 64  # type: ignore[misc]
    assert dataclasses.replace(config, block_size=64).cache.block_size == 64


def test_a_group_checks_its_own_fields() -> None:
    with pytest.raises(ValueError, match="block_size must be a power of two, got 3"):
        CacheConfig(block_size=3)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)


def test_each_group_is_a_help_section() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    sections = {group.title: {action.dest for action in group._group_actions} for group in parser._action_groups}
    for title, group in ENGINE_CONFIG_GROUPS.items():
        flags = {f.name for f in dataclasses.fields(group) if "help" in f.metadata}
        assert sections[f"engine: {title}"] == flags
