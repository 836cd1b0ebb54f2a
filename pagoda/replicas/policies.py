"""Router policies: which replica serves a request (`--router`).

A policy sees each candidate replica as its index and its outstanding tokens (prompt tokens not
yet computed plus tokens still to generate, as the router counts them); the caller (the live
ReplicaSet or the route simulator) keeps that count and says which replicas are candidates
(alive, in the request's pool). The same policy objects drive both, so what `pagoda bench
route-sim` measures is what the server does.

- round_robin: each candidate in turn.
- least_load: the fewest outstanding tokens.
- cache_aware: the replica holding the longest cached prefix of the prompt for this tenant
  (prefix_tree.py), unless none holds a useful one or that one is overloaded: then least load.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import get_args

from pagoda.config import RouterName
from pagoda.replicas.prefix_tree import BlockHash, PrefixTree, prefix_block_hashes


@dataclass
class RouteRequest:
    """What the router knows of a request."""

    prompt_token_ids: Sequence[int]
    max_tokens: int
    tenant_key: Hashable = ""  # the cache salt: tenants sharing it share cache entries
    tenant: str | None = None  # for pool rules
    model: str | None = None
    _hashes: dict[int, list[BlockHash]] = field(default_factory=dict, repr=False)

    def block_hashes(self, block_size: int) -> list[BlockHash]:
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = prefix_block_hashes(self.prompt_token_ids, block_size, self.tenant_key)
        return hashes


@dataclass(frozen=True)
class ReplicaLoad:
    """A candidate replica as a policy sees it."""

    index: int
    outstanding_tokens: int


@dataclass(frozen=True)
class RouteChoice:
    replica: int
    expected_cached_tokens: int = 0  # what the router believes the replica has cached
    reason: str = ""  # "prefix", "load" or "turn": why this replica (logs, tests)


class RouterPolicy(ABC):
    name: RouterName

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> RouteChoice:
        """Pick one of `candidates` (never empty)."""

    def routed(self, request: RouteRequest, replica: int) -> None:
        """The request was sent to `replica` (the policy may remember it)."""

    def forget_replica(self, replica: int) -> None:
        """`replica` is gone (died); whatever the policy remembers of it is stale."""


class RoundRobin(RouterPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> RouteChoice:
        return RouteChoice(candidates[next(self._turn) % len(candidates)].index, reason="turn")


class LeastLoad(RouterPolicy):
    name = "least_load"

    def __init__(self) -> None:
        # Ties (idle replicas) are broken in turn, so a quiet fleet still spreads its work.
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> RouteChoice:
        return RouteChoice(least_loaded(candidates, next(self._turn)), reason="load")


def least_loaded(candidates: Sequence[ReplicaLoad], turn: int) -> int:
    lowest = min(c.outstanding_tokens for c in candidates)
    tied = [c.index for c in candidates if c.outstanding_tokens == lowest]
    return tied[turn % len(tied)]


class CacheAware(RouterPolicy):
    """Longest cached prefix for the tenant, balanced by load.

    A replica is overloaded when its outstanding tokens exceed `balance_rel` times the
    candidates' mean plus `balance_abs_tokens` (SGLang's router balances the same way, on
    queue lengths); then cached blocks are not worth the wait and least load decides. A match
    shorter than `min_match_blocks` is not a useful prefix.
    """

    name = "cache_aware"

    def __init__(
        self,
        block_size: int = 16,
        capacity_blocks: int = 1 << 16,
        *,
        min_match_blocks: int = 1,
        balance_rel: float = 1.25,
        balance_abs_tokens: int = 256,
    ) -> None:
        self.tree = PrefixTree(block_size, capacity_blocks)
        self.min_match_blocks = min_match_blocks
        self.balance_rel = balance_rel
        self.balance_abs_tokens = balance_abs_tokens
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[ReplicaLoad]) -> RouteChoice:
        block_size = self.tree.block_size
        matched = self.tree.match(request.block_hashes(block_size), [c.index for c in candidates])
        loads = {c.index: c.outstanding_tokens for c in candidates}
        best_depth = max(matched.values())
        turn = next(self._turn)
        if best_depth >= self.min_match_blocks:
            limit = self.balance_rel * sum(loads.values()) / len(loads) + self.balance_abs_tokens
            holders = [c for c in candidates if matched[c.index] == best_depth and c.outstanding_tokens <= limit]
            if holders:
                return RouteChoice(least_loaded(holders, turn), best_depth * block_size, "prefix")
        chosen = least_loaded(candidates, turn)
        return RouteChoice(chosen, matched[chosen] * block_size, "load")

    def routed(self, request: RouteRequest, replica: int) -> None:
        self.tree.insert(replica, request.block_hashes(self.tree.block_size))

    def forget_replica(self, replica: int) -> None:
        self.tree.remove_replica(replica)


# Each --router name's policy (tests/replicas/test_router.py: the names are RouterName's).
POLICIES: dict[str, type[RouterPolicy]] = {policy.name: policy for policy in (RoundRobin, LeastLoad, CacheAware)}


def make_policy(name: str, *, block_size: int = 16, capacity_blocks: int = 1 << 16) -> RouterPolicy:
    """A fresh policy by its `--router` name; `block_size` and `capacity_blocks` describe the
    replicas' KV caches (what cache_aware's prefix tree mirrors)."""
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"router must be one of {', '.join(get_args(RouterName))}, got {name!r}")
    return CacheAware(block_size, capacity_blocks) if policy is CacheAware else policy()
