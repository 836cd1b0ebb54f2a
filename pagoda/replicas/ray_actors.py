"""Replicas as Ray actors (`--distributed-executor-backend ray`): the same engine loop as the
process transport, run inside an actor placed by its own placement group, on an existing
cluster (`--ray-address auto`) or a local Ray started on demand.

Each replica gets a placement group of one bundle (its CPUs, and a GPU when the engine runs on
one) with STRICT_PACK, so everything of one replica stays on one node and Ray spreads the
replicas over the cluster's nodes as their resources allow. The front (the API server's
process) talks to the actor through a RayActorTransport: a writer thread sends add/abort
messages in order, a reader thread long-polls the actor for each step's results; an actor
that dies (its node lost, its process killed) is reported as the replica's death, and the
ReplicaSet takes it out of rotation as it does a dead engine process.

What pagoda hands the actor and gets back is bytes of the process transport's encodings
(engine/transport/encoding.py): the config as msgpack and the factory by name, the front's
messages as JSON, the engine's replies as typed msgpack; the actor decodes what it is sent
against the expected types, as the front does what it gets. Ray still carries those bytes in
its own serialization (Ray's channel, inside the cluster).

Only this module imports ray, and only when the Ray backend is chosen.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.transport.base import EngineFactory, EngineInfo, EngineTransport, OnDeath, OnEmitted
from pagoda.engine.transport.encoding import (
    Batch,
    Dead,
    Failed,
    Ready,
    decode_config,
    decode_message,
    decode_reply,
    encode_config,
    encode_message,
    encode_reply,
    factory_reference,
    resolve_factory,
)
from pagoda.engine.transport.engine_loop import EngineInbox, build_engine, run_engine_loop
from pagoda.engine.transport.messages import Shutdown, ToEngine

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import EngineStats
    from pagoda.engine.step_output import EngineStepOutput

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5  # a reader's long poll; bounds how late a shutdown is noticed


class EngineActor:
    """Runs one engine inside a Ray actor (threaded: `send` and `next_batches` may overlap)."""

    def __init__(self, config: bytes, factory: str | None) -> None:
        """`config`: the EngineConfig as encode_config wrote it; `factory`: factory_reference's name."""
        self._inbox = EngineInbox()
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()  # encoded Batch or Dead
        self._ready = threading.Event()
        self._info = b""  # encoded Ready or Failed
        threading.Thread(target=self._run, args=(config, factory), name="pagoda-engine", daemon=True).start()

    def _run(self, config: bytes, factory: str | None) -> None:
        try:
            engine = build_engine(decode_config(config), resolve_factory(factory))
        except BaseException as exc:
            self._info = encode_reply(Failed(f"{type(exc).__name__}: {exc}"))
            self._ready.set()
            return
        self._info = encode_reply(Ready.of(EngineInfo.of(engine)))
        self._ready.set()

        def emit(output: EngineStepOutput, stats: EngineStats) -> None:
            self._outbox.put(encode_reply(Batch(output, stats)))

        try:
            run_engine_loop(engine, self._inbox, emit)
        except BaseException as exc:
            logger.exception("engine loop died")
            self._outbox.put(encode_reply(Dead(f"{type(exc).__name__}: {exc}")))

    def ready(self) -> bytes:
        """The engine's Ready once built, or Failed with what stopped it (encoded)."""
        self._ready.wait()
        return self._info

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def send(self, messages: list[bytes]) -> None:
        for payload in messages:
            try:
                message = decode_message(payload)
            except ValueError as error:  # not the front speaking: refused, nothing built from it
                logger.error("engine actor: refused a message: %s", error)
                continue
            self._inbox.put(message)

    def next_batches(self, timeout: float) -> list[bytes]:
        """Every step result since the last call, waiting up to `timeout` for the first."""
        try:
            batches = [self._outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                batches.append(self._outbox.get_nowait())
            except queue.Empty:
                return batches


class RayActorTransport(EngineTransport):
    """An engine in a Ray actor of its own placement group, seen as an EngineTransport."""

    kind = "Ray actor"

    def __init__(
        self,
        config: EngineConfig,
        factory: EngineFactory | None,
        on_emitted: OnEmitted,
        on_death: OnDeath,
        *,
        startup_timeout: float | None = None,
        num_cpus: int = 1,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagoda.tokenizer import Tokenizer

        super().__init__(config, on_emitted, on_death)
        bundle: dict[str, float] = {"CPU": num_cpus}
        if config.device.startswith("cuda"):
            bundle["GPU"] = 1
        # Bundle 0 holds the engine (tensor-parallel rank 0); with --tensor-parallel-size N the
        # engine places ranks 1..N-1 in bundles 1..N-1 of this group (executor/ray_workers.py),
        # so a replica and its ranks land on one node.
        rank_bundle = {"GPU": 1} if "GPU" in bundle else {"CPU": 1}
        bundles = [bundle] + [dict(rank_bundle) for _ in range(config.tensor_parallel_size - 1)]
        self.placement_group = placement_group(bundles, strategy="STRICT_PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=startup_timeout)
            # Ray builds the handle's `.remote` methods at run time: the handle is typed as Any.
            actor_class: Any = ray.remote(EngineActor)
            self.actor: Any = actor_class.options(
                num_cpus=num_cpus,
                num_gpus=bundle.get("GPU", 0),
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=0
                ),
            ).remote(encode_config(config), factory_reference(factory))
            self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
            ready = decode_reply(ray.get(self.actor.ready.remote(), timeout=startup_timeout))
            if not isinstance(ready, Ready):
                reason = ready.reason if isinstance(ready, (Failed, Dead)) else "it reported a step before it was ready"
                raise RuntimeError("the engine failed to start") from RuntimeError(reason)
            self.info = ready.info()
            self.node_id: str = ray.get(self.actor.node_id.remote())
        except BaseException as exc:
            remove_placement_group(self.placement_group)
            if isinstance(exc, (ray.exceptions.RayError, TimeoutError)):
                raise RuntimeError("the engine failed to start") from exc
            raise
        self._alive = True
        self._stopping = False
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()  # encoded by send()
        for target, name in ((self._read, "pagoda-ray-reader"), (self._write, "pagoda-ray-writer")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def send(self, message: ToEngine) -> None:
        self._outbox.put(encode_message(message))

    def is_alive(self) -> bool:
        return self._alive

    def shutdown(self, timeout: float | None) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._stopping = True
        self._outbox.put(encode_message(Shutdown()))
        try:
            ray.kill(self.actor)
        finally:
            self._alive = False
            remove_placement_group(self.placement_group)

    def _write(self) -> None:
        import ray

        while True:
            messages = [self._outbox.get()]
            while True:
                try:
                    messages.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            if self._stopping:
                return
            try:
                # One call at a time, waited for: the actor applies messages in send order.
                ray.get(self.actor.send.remote(messages))
            except ray.exceptions.RayError:
                return  # the actor is gone; the reader reports it

    def _read(self) -> None:
        import ray

        while not self._stopping:
            try:
                batches = ray.get(self.actor.next_batches.remote(POLL_SECONDS))
            except ray.exceptions.RayError as exc:
                self._die(RuntimeError(f"the replica's Ray actor died: {exc}"))
                return
            for payload in batches:
                try:
                    message = decode_reply(payload)
                except ValueError as error:
                    logger.error("Ray replica: refused a message from its actor: %s", error)
                    self._die(RuntimeError(f"the replica's Ray actor sent {error}"))
                    return
                if isinstance(message, Batch):
                    self._on_emitted(message.output, message.stats)
                elif isinstance(message, Dead):
                    self._die(RuntimeError(message.reason))
                    return

    def _die(self, error: BaseException) -> None:
        self._alive = False
        if not self._stopping:
            self._on_death(error)


def start_ray_replica(index: int, config: EngineConfig) -> AsyncLLM:
    """Replica `index`, its engine configured by `config`, as a Ray actor (joining or starting
    Ray first)."""
    connect_ray(config.ray_address)
    threads = config.num_threads or 1
    replica = dataclasses.replace(config, num_threads=threads)

    def transport(
        config: EngineConfig,
        factory: EngineFactory | None,
        on_emitted: OnEmitted,
        on_death: OnDeath,
        *,
        startup_timeout: float | None = None,
    ) -> RayActorTransport:
        return RayActorTransport(
            config, factory, on_emitted, on_death, startup_timeout=startup_timeout, num_cpus=threads
        )

    return AsyncLLM(replica, transport=transport)


def connect_ray(address: str | None) -> None:
    """Join the cluster at `address` ("auto", "ray://host:port"), or start a local Ray."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--distributed-executor-backend ray needs Ray: pip install 'pagoda[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
