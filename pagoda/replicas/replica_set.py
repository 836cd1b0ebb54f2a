"""ReplicaSet: N independent engine replicas behind one front, with a router choosing for each
request (`--data-parallel-size N`, `--router`, `--replica-pools`, `--route-rules`).

Each replica is an AsyncLLM with its own engine (a spawned process, a thread, or a Ray actor:
replicas/ray_actors.py); the set is an EngineClient (engine/client.py) as one AsyncLLM is, so
the HTTP layer does not change with the number of replicas. Per request it
1. picks the candidates: live replicas of the request's pool (pools.py; all live replicas
   when the pool has none left),
2. lets the policy choose (policies.py) from their outstanding tokens and, for cache_aware,
   the prefix tree of what each replica was sent,
3. submits there; a replica that turns out dead is skipped and the request goes to the next
   choice, and a request whose replica dies before its first token moves (routed_stream.py).
A dead replica is out of rotation (its engine's state is gone) until its supervisor
(supervisor.py) has started it again, with backoff and within the restart budget; /health
reports the set degraded while at least one replica lives, and each replica's pid, status and
restarts.

Autoscaled (`--min-replicas` / `--max-replicas`, Ray): the set's Autoscaler (autoscaler.py)
adds a replica, which joins the rotation once its engine is ready and has the adapters loaded
at runtime, and drains one away: a draining replica takes no new request, and is stopped (its
engine and KV gone) once the requests it has are done. Replicas keep their index for life (the
router's per-replica state is keyed by it), so indexes of removed replicas are not reused.

Disaggregated (`--replica-roles prefill=P,decode=D`): a request is routed to a decode replica
that awaits its KV, then to a prefill replica that hands request and blocks over to it
(prefill_leg.py); requests a prefill engine cannot hand off (n > 1, structured output, prompt
logprobs) run whole on a decode replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.client import EngineAsleepError, generate_outputs
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.request_stream import RequestStream
from pagoda.engine.transport import EngineDeadError
from pagoda.kv_transfer.handoff import TRANSFER_SECRET_ENV, new_transfer_secret
from pagoda.lora_request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.replicas.policies import ReplicaLoad, RouteRequest, RouterPolicy, make_policy
from pagoda.replicas.pools import RouteRules, parse_replica_pools
from pagoda.replicas.prefill_leg import PrefillLeg, is_exportable
from pagoda.replicas.replica import Flight, Replica
from pagoda.replicas.routed_stream import RoutedStream
from pagoda.replicas.supervisor import EngineKeeper, EngineSupervisor, ModelFront, RestartPolicy
from pagoda.replicas.weights_source import WeightsSource
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import EngineStats

logger = logging.getLogger(__name__)

# Builds replica `index`'s AsyncLLM from its engine config (the caller picks transport or Ray).
ReplicaStarter = Callable[[int, EngineConfig], AsyncLLM]
# Starts replica `index` under its supervisor (blocks until its engine is ready; raises if not).
SupervisedStarter = Callable[[int], EngineSupervisor]


class ReplicaCountKeeper(Protocol):
    """What changes the number of replicas (autoscaler.py's Autoscaler), as the set sees it."""

    def state(self) -> dict[str, Any]:
        """Its part of the set's /health body."""

    def stop(self) -> None: ...


class ReplicaSet(ModelFront):
    """The front of several engine replicas: an EngineClient, as one AsyncLLM is."""

    def __init__(
        self,
        supervisors: Sequence[EngineSupervisor],
        policy: RouterPolicy,
        *,
        pools: Sequence[str | None] | None = None,
        rules: RouteRules | None = None,
        deployment: DeploymentConfig | None = None,
        start_replica: SupervisedStarter | None = None,
    ) -> None:
        """`supervisors`: each replica's, in index order (they own the engines);
        `start_replica`: how a replica is added (add_replica), None when none can be."""
        if not supervisors:
            raise ValueError("a replica set needs at least one replica")
        if pools is not None and len(pools) != len(supervisors):
            raise ValueError(f"{len(pools)} pool tags for {len(supervisors)} replicas")
        self.replicas = [
            Replica(i, supervisor, pools[i] if pools else None, role=supervisor.llm.config.role)
            for i, supervisor in enumerate(supervisors)
        ]
        roles = {r.role for r in self.replicas}
        if roles != {"both"} and roles != {"prefill", "decode"}:
            raise ValueError(
                f"replica roles {sorted(roles)}: either every replica does both, or there "
                f"are prefill and decode replicas"
            )
        self.disaggregated = roles != {"both"}
        self._legs: dict[str, PrefillLeg] = {}  # disaggregated: each request's running prefill leg
        self.policy = policy
        self.rules = rules
        self.deployment = deployment or DeploymentConfig(data_parallel_size=len(supervisors))
        if rules is not None:
            rules.check_pools({r.pool for r in self.replicas if r.pool is not None})
        super().__init__(supervisors[0].llm)
        self.lock = threading.Lock()  # guards the routing state when loops on several threads submit
        self._flights: dict[str, RoutedStream] = {}
        self._stopped = False
        self._start_replica = start_replica
        self._next_index = len(self.replicas)
        self.weights = WeightsSource()  # what restarted and added replicas load (the latest update's)
        for supervisor in supervisors:
            supervisor.weights = self.weights
        self.autoscaler: ReplicaCountKeeper | None = None  # one that grows and shrinks the set, if any

    @classmethod
    def start(cls, config: EngineConfig, deployment: DeploymentConfig, starter: ReplicaStarter) -> ReplicaSet:
        """Start `deployment.num_replicas` replicas side by side, each with its engine config
        (DeploymentConfig.replica_config) and its supervisor (restarts within the deployment's
        restart policy), and the router `deployment.router` in front; replicas already up are
        shut down if one fails."""
        deployment.validate_with(config)
        if deployment.replica_roles is not None:
            config = with_transfer_secret(config)
        pools = parse_replica_pools(deployment.replica_pools) if deployment.replica_pools else None
        rules = RouteRules.from_file(deployment.route_rules) if deployment.route_rules else None
        keepers = [
            EngineKeeper(
                functools.partial(starter, index, deployment.replica_config(config, index)), f"pagoda-replica-{index}"
            )
            for index in range(deployment.num_replicas)
        ]
        supervisors: list[EngineSupervisor] = []
        try:
            restarts = RestartPolicy.of(deployment)
            for index, keeper in enumerate(keepers):
                supervisors.append(EngineSupervisor(keeper, functools.partial(starter, index), str(index), restarts))
            stats = supervisors[0].llm.get_stats()
            # The prefix tree mirrors about one replica's KV pool.
            capacity = stats.num_total_blocks if stats is not None and stats.num_total_blocks else 1 << 16
            policy = make_policy(deployment.router, block_size=config.block_size, capacity_blocks=capacity)

            def start_replica(index: int) -> EngineSupervisor:
                keeper = EngineKeeper(
                    functools.partial(starter, index, deployment.replica_config(config, index)),
                    f"pagoda-replica-{index}",
                )
                return EngineSupervisor(keeper, functools.partial(starter, index), str(index), restarts)

            return cls(
                supervisors, policy, pools=pools, rules=rules, deployment=deployment, start_replica=start_replica
            )
        except BaseException:
            for supervisor in supervisors:
                supervisor.stop()
            for keeper in keepers[len(supervisors) :]:
                keeper.stop()
            raise

    # ---- the EngineClient surface --------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        """Serving while any replica lives."""
        return not self._stopped and any(r.is_alive for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        if self.is_alive:
            return None
        return next(
            (r.llm.error for r in self.replicas if r.llm.error is not None), EngineDeadError("every replica is stopped")
        )

    def health(self) -> dict[str, Any]:
        """ok (every replica lives), degraded (some do), restarting (none does, a restart is
        pending) or dead (with the error), and each replica's state: its engine's pid, alive,
        status (ok, restarting, failed: out of restarts, or dead), restarts and error (and
        `draining` while scaled away); autoscaled, the autoscaler's part (`autoscale`)."""
        replicas = list(self.replicas)
        states = [r.supervisor.state() for r in replicas]
        alive = [state.alive for state in states]
        if self._stopped:
            status = "dead"
        elif not any(alive):
            status = "restarting" if any(state.status == "restarting" for state in states) else "dead"
        elif self.sleep_level:
            status = "asleep"
        else:
            status = "ok" if all(alive) else "degraded"
        health: dict[str, Any] = {
            "status": status,
            "replicas": [
                {
                    "replica": r.label,
                    "pool": r.pool,
                    "role": r.role,
                    **state.as_dict(),
                    "requests": r.num_requests,
                    "outstanding_tokens": r.outstanding_tokens,
                    "moved_away": r.num_moved_away,
                    **({"draining": True} if r.draining else {}),
                }
                for r, state in zip(replicas, states)
            ],
        }
        if status not in ("ok", "degraded", "asleep"):
            health["error"] = repr(self.error)
        if self.autoscaler is not None:
            health["autoscale"] = self.autoscaler.state()
        return health

    def get_stats(self) -> EngineStats | None:
        """The replicas' stats summed (what one engine of their combined size would report)."""
        return sum_engine_stats([s for s in self.replica_stats().values() if s is not None])

    def replica_stats(self) -> dict[str, EngineStats | None]:
        """Each replica's latest stats, by its label (the metrics' `replica` label)."""
        return {r.label: r.llm.get_stats() for r in self.replicas}

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.replicas[0].llm.validate(prompt_token_ids, params)

    async def add_request(self, request: EngineRequest, *, wake: asyncio.Event | None = None) -> RoutedStream:
        """Route and submit a request; returns its stream once a replica accepted it.

        The request's `tenant` and `model` are what route rules match on. Raises InvalidRequest
        or EngineDeadError (no live replica)."""
        if self.sleep_level:
            raise EngineAsleepError("the model is asleep: POST /wake_up first")
        if isinstance(request.prompt, str):
            request = dataclasses.replace(request, prompt=self.tokenizer.encode(request.prompt))
        prompt = request.prompt_token_ids
        wake = wake if wake is not None else asyncio.Event()
        # An adapter's blocks never serve the base model or another adapter (their hashes
        # differ), so the router's prefix tree keys them apart as well.
        lora_request = request.lora_request
        route_salt = (request.cache_salt or "") + (f"\x00lora:{lora_request.lora_name}" if lora_request else "")
        route = RouteRequest(
            prompt,
            _max_output_tokens(request.params, len(prompt), self.max_model_len),
            route_salt,
            request.tenant,
            request.model,
        )
        attempts = 0

        async def submit(excluded: set[int]) -> tuple[RequestStream, Flight]:
            nonlocal attempts
            if not self.disaggregated:
                return await self._submit(request, route, excluded, wake)
            attempts += 1
            return await self._submit_disaggregated(request, attempts, route, excluded, wake)

        stream, flight = await submit(set())
        routed = RoutedStream(request.request_id, stream, flight, submit, wake, on_done=self._forget)
        with self.lock:
            self._flights[request.request_id] = routed
        return routed

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's whole output so far, after each step the consumer reads."""
        return generate_outputs(self, request)

    # ---- LoRA adapters: every replica loads the same ones ---------------------------------------

    @property
    def lora_names(self) -> list[str]:
        live = [r for r in self.replicas if self._check_alive(r)]
        return (live or self.replicas)[0].llm.lora_names

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter on every live replica (and on each replica that restarts later);
        InvalidRequest (the first refusal) if one refuses, after unloading it again from those
        that accepted."""
        live = [r for r in self.replicas if self._check_alive(r)]
        results = await asyncio.gather(*(r.supervisor.add_lora(lora_request) for r in live), return_exceptions=True)
        refusals = [result for result in results if isinstance(result, BaseException)]
        if refusals:
            loaded = [r for r, result in zip(live, results) if not isinstance(result, BaseException)]
            await asyncio.gather(
                *(r.supervisor.remove_lora(lora_request.lora_name) for r in loaded), return_exceptions=True
            )
            raise refusals[0]

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter from every live replica; InvalidRequest if none had it."""
        live = [r for r in self.replicas if self._check_alive(r)]
        results = await asyncio.gather(*(r.supervisor.remove_lora(name) for r in live), return_exceptions=True)
        errors = [result for result in results if isinstance(result, BaseException)]
        if live and len(errors) == len(results):
            raise errors[0]

    # ---- engine commands: every replica applies them, or none does -----------------------------

    @property
    def sleep_level(self) -> int:
        return max((r.llm.sleep_level for r in self.replicas if self._check_alive(r)), default=0)

    async def engine_command(self, command: str, args: dict[str, Any] | None = None) -> None:
        """Run an engine command on every live replica. A weight update is staged on all of them
        before any commits it (a refusal anywhere drops it everywhere); a weight update group
        gives replica i the rank `rank_offset + i`. InvalidRequest: the first refusal."""
        live = [r for r in self.replicas if self._check_alive(r)]
        if not live:
            raise EngineDeadError("no replica is running")
        args = dict(args or {})
        if command == "update_weights_from_disk":
            await self._on_all_or_none(live, "stage_weights_from_disk", args)
            await self._on_all(live, lambda r: ("finish_weight_update", {}))
        elif command == "update_weights":
            # The first replica also saves the tensors: restarted and added replicas load them.
            snapshot = {"snapshot": self.weights.next_snapshot()}
            await self._on_all_or_none_each(
                live, lambda r: ("update_weights", args | (snapshot if r is live[0] else {}))
            )
        elif command == "init_weight_update_group":
            offset = int(args.get("rank_offset", 1))
            await self._on_all(live, lambda r: (command, args | {"rank": offset + live.index(r)}))
        else:
            await self._on_all(live, lambda r: (command, args))
        self.weights.record(command, args)

    async def _on_all_or_none(self, live: list[Replica], command: str, args: dict[str, Any]) -> None:
        await self._on_all_or_none_each(live, lambda r: (command, args))

    async def _on_all_or_none_each(
        self, live: list[Replica], command_for: Callable[[Replica], tuple[str, dict[str, Any]]]
    ) -> None:
        try:
            await self._on_all(live, command_for)
        except BaseException:
            await asyncio.gather(
                *(r.llm.engine_command("finish_weight_update", {"abort": True}) for r in live), return_exceptions=True
            )
            raise

    async def _on_all(self, live: list[Replica], command_for: Callable[[Replica], tuple[str, dict[str, Any]]]) -> None:
        results = await asyncio.gather(*(r.llm.engine_command(*command_for(r)) for r in live), return_exceptions=True)
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            raise errors[0]

    def abort(self, request_ids: Iterable[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self.lock:
            routed = [(request_id, self._flights.pop(request_id, None)) for request_id in request_ids]
        for request_id, stream in routed:
            leg = self._legs.pop(request_id, None)
            if leg is not None:
                leg.cancel()  # aborts its request on the prefill replica
            if stream is None:
                continue
            by_replica.setdefault(stream.replica, []).append(request_id)
            stream.cancel()
        replicas = {r.index: r for r in self.replicas}
        for index, ids in by_replica.items():
            if index in replicas:  # else retired: its requests were done
                replicas[index].llm.abort(ids)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self.lock:
            self._stopped = True
            replicas = list(self.replicas)
        if self.autoscaler is not None:
            self.autoscaler.stop()
        with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
            list(pool.map(lambda r: r.supervisor.stop(timeout), replicas))
        self.weights.close()

    # ---- growing and shrinking (the Autoscaler's) ------------------------------------------------

    def add_replica(self) -> Replica:
        """Start one more replica and put it in rotation once its engine is ready and has the
        adapters the others loaded at runtime. Blocks while it starts (call it from a thread of
        its own); raises RuntimeError when it cannot start, EngineDeadError after shutdown."""
        if self._start_replica is None:
            raise RuntimeError("this replica set cannot add replicas")
        with self.lock:
            index = self._next_index
            self._next_index += 1
        supervisor = self._start_replica(index)
        supervisor.weights = self.weights
        try:
            supervisor.load_weights()
            while True:
                adapters = self._runtime_adapters()
                supervisor.match_adapters(adapters)
                with self.lock:
                    if self._stopped:
                        raise EngineDeadError("the replicas were shut down")
                    # An adapter loaded or unloaded meanwhile: match again.
                    if self._runtime_adapters().keys() != adapters.keys():
                        continue
                    if not supervisor.llm.is_alive:
                        raise RuntimeError(f"replica {index} stopped while starting: {supervisor.llm.error}")
                    replica = Replica(index, supervisor, role=supervisor.llm.config.role)
                    self.replicas.append(replica)
                    return replica
        except BaseException:
            supervisor.stop()
            raise

    def drain_replica(self) -> Replica | None:
        """Take the newest serving replica out of rotation (None when one or none is left); it
        keeps serving what it has until retire_drained stops it."""
        with self.lock:
            serving = [r for r in self.replicas if not r.draining]
            if len(serving) <= 1:
                return None
            replica = max(serving, key=lambda r: r.index)
            replica.draining = True
        return replica

    def retire_drained(self, replica: Replica, timeout: float | None = 10.0) -> bool:
        """Stop a draining replica once no request of its own is left, then drop it from the
        set (so /health lists it until its engine is gone); False while a request is left."""
        with self.lock:
            if replica not in self.replicas:
                return True  # stopped already
            if replica.num_requests:
                return False
        replica.supervisor.stop(timeout)
        with self.lock:
            self.replicas.remove(replica)
            self.policy.forget_replica(replica.index)
        return True

    def _runtime_adapters(self) -> dict[str, LoRARequest]:
        for replica in self.replicas:
            if not replica.draining and self._check_alive(replica):
                return replica.supervisor.adapters
        return {}

    # ---- routing -------------------------------------------------------------------------------

    def candidates(
        self,
        route: RouteRequest,
        excluded: set[int] = frozenset(),  # type: ignore[assignment]
        role: str = "both",
    ) -> list[Replica]:
        """Live replicas of the request's pool (every live replica when that pool has none),
        of the given role when disaggregated."""
        live = [
            r
            for r in self.replicas
            if r.index not in excluded
            and not r.draining
            and self._check_alive(r)
            and (r.role == role or not self.disaggregated)
        ]
        pool = self.rules.pool_of(route) if self.rules is not None else None
        if pool is not None:
            in_pool = [r for r in live if r.pool == pool]
            if in_pool:
                return in_pool
            if live:
                logger.warning("no live replica in pool %r; routing to any replica", pool)
        return live

    def choose(self, route: RouteRequest, excluded: set[int], role: str = "both") -> tuple[Replica, int] | None:
        """The policy's choice among the candidates, counted as routed there, and the prompt
        tokens it expects that replica to have cached; None when no candidate is left."""
        with self.lock:
            if self._stopped:
                raise EngineDeadError("the replicas were shut down")
            candidates = self.candidates(route, excluded, role)
            if not candidates:
                return None
            choice = self.policy.choose(route, [ReplicaLoad(r.index, r.outstanding_tokens) for r in candidates])
            replica = next(r for r in candidates if r.index == choice.replica)
            self.policy.routed(route, replica.index)
            replica.num_routed += 1
            return replica, choice.expected_cached_tokens

    async def _submit(
        self,
        request: EngineRequest,
        route: RouteRequest,
        excluded: set[int],
        wake: asyncio.Event,
        role: str = "both",
        handoff_above: int | None = None,
    ) -> tuple[RequestStream, Flight]:
        """Submit `request` (its prompt as token ids) to a replica. `handoff_above` (a decode
        replica, disaggregated): the request awaits its KV from a prefill replica if more than
        that many of its prompt tokens are not cached on the chosen replica, else that replica
        prefills it itself (see the flight's `awaiting_kv`)."""
        prompt, params = request.prompt, request.params
        excluded = set(excluded)
        while True:
            chosen = self.choose(route, excluded, role)
            if chosen is None:
                raise EngineDeadError(f"no {role + ' ' if self.disaggregated else ''}replica is running")
            replica, cached = chosen
            uncached = max(0, len(prompt) - cached)
            awaiting_kv = handoff_above is not None and uncached > handoff_above
            # A decode replica awaiting the KV computes no prompt token (unless it falls back).
            if awaiting_kv:
                uncached = 0
            with self.lock:
                flight = Flight(replica, uncached, route.max_tokens * params.n, awaiting_kv=awaiting_kv)
            try:
                stream = await replica.llm.add_request(request, wake=wake, awaiting_kv=awaiting_kv)
            except EngineDeadError:
                flight.close()
                replica.num_moved_away += 1
                excluded.add(replica.index)  # died since the last look: try the next choice
                continue
            except BaseException:
                flight.close()
                raise
            return stream, flight

    async def _submit_disaggregated(
        self, request: EngineRequest, attempt: int, route: RouteRequest, excluded: set[int], wake: asyncio.Event
    ) -> tuple[RequestStream, Flight]:
        """Submit to a decode replica and, when the request is to be handed off (it can be, and
        more than --max-local-prefill-tokens of its prompt are not cached there), start the
        prefill leg that feeds it; returns the decode replica's stream."""
        request_id = request.request_id
        handoff_above = self.deployment.max_local_prefill_tokens if is_exportable(request.params) else None
        stream, flight = await self._submit(request, route, excluded, wake, role="decode", handoff_above=handoff_above)
        previous = self._legs.pop(request_id, None)
        if previous is not None:  # the request moved off a dead decode replica
            previous.cancel()
        if flight.awaiting_kv:
            self._legs[request_id] = PrefillLeg(
                self.config.disaggregation,
                self.choose,
                self.lock,
                request,
                attempt,
                route,
                flight.replica,
                stream,
                on_end=self._leg_ended,
                prefill_timeout=self.deployment.kv_prefill_timeout,
            )
        return stream, flight

    def _leg_ended(self, leg: PrefillLeg) -> None:
        if self._legs.get(leg.request_id) is leg:
            del self._legs[leg.request_id]

    def _check_alive(self, replica: Replica) -> bool:
        llm = replica.llm
        if llm.is_alive:
            return True
        if replica.seen_dead is not llm:  # once per death: a restart brings a new engine
            replica.seen_dead = llm
            self.policy.forget_replica(replica.index)
            logger.error(
                "replica %d stopped (%s); taken out of rotation, %d of %d replicas left",
                replica.index,
                llm.error,
                sum(r.llm.is_alive for r in self.replicas),
                len(self.replicas),
            )
        return False

    def _forget(self, request_id: str) -> None:
        with self.lock:
            self._flights.pop(request_id, None)
        leg = self._legs.pop(request_id, None)
        if leg is not None:  # the request ended before its prefill leg did (it failed)
            leg.cancel()


def _max_output_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    limit = max(0, max_model_len - prompt_len)
    return limit if params.max_tokens is None else min(params.max_tokens, limit)


_SUMMED_FIELDS = (
    "num_running",
    "num_waiting",
    "num_total_blocks",
    "num_free_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "num_prompt_tokens",
    "num_generation_tokens",
)


def sum_engine_stats(stats: Sequence[EngineStats]) -> EngineStats | None:
    """Counters and sizes summed; the rest (step timings, histograms) from the first replica."""
    if not stats:
        return None
    summed = {name: sum(getattr(s, name) for s in stats) for name in _SUMMED_FIELDS}
    total = summed["num_total_blocks"]
    usage = 1.0 - summed["num_free_blocks"] / total if total else 0.0
    return dataclasses.replace(stats[0], **summed, kv_cache_usage=usage)


def with_transfer_secret(config: EngineConfig) -> EngineConfig:
    """A disaggregated deployment's engine config with its KV transfer secret: the operator's
    (--kv-transfer-secret, or PAGODA_KV_TRANSFER_SECRET), else one drawn here. Every replica's
    config derives from this one, so its prefill and decode engines (restarted or added ones
    too) sign and check their handoffs with the same secret."""
    if config.kv_transfer_secret is not None or os.environ.get(TRANSFER_SECRET_ENV):
        return config
    return dataclasses.replace(config, kv_transfer_secret=new_transfer_secret())
