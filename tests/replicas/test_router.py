"""Router policies and the per-tenant prefix tree behind cache-aware routing (no engines)."""

from __future__ import annotations

import pytest

from pagoda.replicas.policies import CacheAware, LeastLoad, ReplicaLoad, RoundRobin, RouteRequest, make_policy
from pagoda.replicas.prefix_tree import PrefixTree, prefix_block_hashes

BLOCK = 4
SYSTEM = list(range(100, 116))  # four full blocks


def idle(n: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, 0) for i in range(n)]


def request(tokens: list[int], tenant: str = "alice", max_tokens: int = 8) -> RouteRequest:
    return RouteRequest(tokens, max_tokens, tenant_key=tenant, tenant=tenant)


def test_block_hashes_chain_the_prefix_and_are_keyed_by_tenant() -> None:
    a = prefix_block_hashes(SYSTEM + [1, 2, 3], BLOCK, "alice")
    assert len(a) == 4  # partial blocks are not cached by the engines either
    assert prefix_block_hashes(SYSTEM + [9], BLOCK, "alice") == a
    # A block's hash names its whole prefix: same tokens after a different start differ.
    assert prefix_block_hashes([0] * 4 + SYSTEM[4:], BLOCK, "alice")[1:] != a[1:]
    assert set(prefix_block_hashes(SYSTEM, BLOCK, "bob")).isdisjoint(a)


def test_prefix_tree_matches_leading_blocks_and_forgets_least_recent() -> None:
    tree = PrefixTree(BLOCK, capacity_blocks=6)
    hashes = prefix_block_hashes(SYSTEM, BLOCK, "t")
    tree.insert(0, hashes)
    tree.insert(1, hashes[:2])
    assert tree.match(hashes, [0, 1, 2]) == {0: 4, 1: 2, 2: 0}
    other = prefix_block_hashes(list(range(200, 216)), BLOCK, "t")
    tree.insert(0, other)  # 8 blocks for 6: the oldest tail blocks of the first prompt go
    assert tree.num_blocks(0) == 6
    assert tree.match(hashes, [0]) == {0: 2}  # its leading blocks were kept longest
    assert tree.match(other, [0]) == {0: 4}
    tree.remove_replica(0)
    assert tree.match(other, [0, 1]) == {0: 0, 1: 0}
    assert tree.match(hashes, [0, 1]) == {0: 0, 1: 2}


def test_round_robin_and_least_load() -> None:
    policy = RoundRobin()
    assert [policy.choose(request([1]), idle(3)).replica for _ in range(4)] == [0, 1, 2, 0]
    least = LeastLoad()
    loads = [ReplicaLoad(0, 50), ReplicaLoad(1, 10), ReplicaLoad(2, 30)]
    assert least.choose(request([1]), loads).replica == 1
    # Idle replicas share the work in turn instead of all of it landing on the first.
    assert {least.choose(request([1]), idle(3)).replica for _ in range(3)} == {0, 1, 2}


def test_cache_aware_follows_the_tenants_prefix() -> None:
    policy = CacheAware(BLOCK)
    first = policy.choose(request(SYSTEM + [1]), idle(4))
    assert first.reason == "load" and first.expected_cached_tokens == 0
    policy.routed(request(SYSTEM + [1]), first.replica)
    for tail in ([2], [3, 4, 5], [6] * 9):
        again = policy.choose(request(SYSTEM + tail), idle(4))
        assert (again.replica, again.reason, again.expected_cached_tokens) == (first.replica, "prefix", 16)


def test_cache_aware_never_routes_by_another_tenants_cache() -> None:
    policy = CacheAware(BLOCK)
    policy.routed(request(SYSTEM, tenant="alice"), 2)
    # bob's identical prompt: no match of his own, so load decides; with replica 2 the
    # least loaded, it is chosen for load, and with it loaded, it is avoided.
    loads = [ReplicaLoad(0, 10), ReplicaLoad(1, 10), ReplicaLoad(2, 12)]
    choice = policy.choose(request(SYSTEM, tenant="bob"), loads)
    assert choice.reason == "load" and choice.expected_cached_tokens == 0 and choice.replica != 2
    assert policy.choose(request(SYSTEM, tenant="alice"), loads).replica == 2


def test_cache_aware_falls_back_to_least_load_when_the_holder_is_overloaded() -> None:
    policy = CacheAware(BLOCK, balance_rel=1.25, balance_abs_tokens=100)
    policy.routed(request(SYSTEM), 0)
    busy = [ReplicaLoad(0, 1000), ReplicaLoad(1, 100), ReplicaLoad(2, 100)]
    choice = policy.choose(request(SYSTEM), busy)
    assert choice.reason == "load" and choice.replica in (1, 2)
    fair = [ReplicaLoad(0, 300), ReplicaLoad(1, 100), ReplicaLoad(2, 100)]
    assert policy.choose(request(SYSTEM), fair).replica == 0  # within 1.25 x mean + 100


def test_forgotten_replica_loses_its_prefixes() -> None:
    policy = CacheAware(BLOCK)
    policy.routed(request(SYSTEM), 1)
    policy.forget_replica(1)
    assert policy.choose(request(SYSTEM), idle(3)).reason == "load"


def test_make_policy_names() -> None:
    assert [make_policy(n).name for n in ("round_robin", "least_load", "cache_aware")] == [
        "round_robin",
        "least_load",
        "cache_aware",
    ]
    with pytest.raises(ValueError, match="router must be one of"):
        make_policy("random")
