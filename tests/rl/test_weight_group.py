"""The weight-update group's announcements are checked on both sides before any broadcast."""

from __future__ import annotations

import pytest
import torch

from pagoda.rl.weight_group import TensorMeta, WeightGroupSpec, parse_metas


def test_announcements_parse_or_say_what_is_wrong() -> None:
    metas = parse_metas(["a", "b"], ["torch.bfloat16", "float32"], [[2, 3], []])
    assert metas == [TensorMeta("a", "bfloat16", (2, 3)), TensorMeta("b", "float32", ())]
    with pytest.raises(ValueError, match="as long as each other"):
        parse_metas(["a"], [], [[1]])
    with pytest.raises(ValueError, match="dtype must be one of"):
        parse_metas(["a"], ["int64"], [[1]])
    with pytest.raises(ValueError, match="non-negative integers"):
        parse_metas(["a"], ["float32"], [[-1]])
    with pytest.raises(ValueError, match="weights travel as"):
        TensorMeta.of("ids", torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(rank_offset=0), "rank_offset"),
        (dict(world_size=1), "rank_offset"),
        (dict(backend="mpi"), "backend"),
        (dict(master_port=0), "master_port"),
        (dict(timeout_s=0), "timeout_s"),
    ],
)
def test_a_group_spec_is_checked_before_joining(fields: dict, message: str) -> None:
    spec = dict(master_address="127.0.0.1", master_port=29555, rank_offset=1, world_size=2) | fields
    with pytest.raises(ValueError, match=message):
        WeightGroupSpec(**spec)
