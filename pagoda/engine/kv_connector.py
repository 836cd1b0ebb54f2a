"""KVConnector: prefill/decode disaggregation as the engine sees it (as vLLM's KV connector).

It owns everything an engine of role prefill or decode holds for its KV handoffs: the
per-request mechanics (disaggregation.py's KVHandoffs), the handoff threads
(kv_transfer/handoff_threads.py), where each prefill request goes, which decode requests
await their KV and whose blocks are being written. The engine calls it at fixed points:

- on add: a prefill request's handoff target, a decode request that awaits its KV;
- before the step: apply the threads' events (a header arrived: allocate and start the
  receive; blocks received: the request joins the running set; a send ended: its outcome);
- after the step: time imported requests' first decodes; export every prefill request that
  has its first token;
- on abort and when a request is forgotten; on close.

It changes the scheduler's queues only through the scheduler's operations (add a request to
prefill here, add an imported one). Role "both" gets a connector with no threads: its hooks
do nothing, and its stats stay at zero.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence

from pagoda.config import EngineConfig
from pagoda.engine.disaggregation import DisaggStats, KVHandoffs
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.roles import HandoffTarget
from pagoda.engine.step_output import HandoffOutcome
from pagoda.kv_transfer.handoff import (
    TRANSFER_SECRET_ENV,
    HandoffAuth,
    HandoffRefused,
    IncomingHandoff,
    KVHandoff,
    TransferError,
    send_handoff,
)
from pagoda.kv_transfer.handoff_threads import HandoffThreads, HeaderArrived, Received, Sent
from pagoda.kv_transfer.tiers import model_fingerprint
from pagoda.outputs import RequestOutputDelta
from pagoda.request import Request, RequestStatus


class KVConnector:
    def __init__(self, config: EngineConfig, core: EngineCore) -> None:
        self.role = config.role
        self.core = core
        # The target model's caches, as KV handoffs carry them (roles need the whole model: no
        # pipeline stage's missing layers).
        self.handoffs = KVHandoffs(
            config.role,
            core.kv_cache,
            [t for pair in core.runner.kv_caches if pair is not None for t in pair],
            model_fingerprint(config, str(core.dtype).removeprefix("torch.")).hex(),
        )
        self._threads: HandoffThreads | None = None
        self._exported: list[KVHandoff] = []  # role prefill: exported without a target, not yet taken
        self._targets: dict[str, HandoffTarget] = {}  # role prefill: where each request goes
        self._awaiting: dict[str, Request] = {}  # role decode: waiting for their KV, no header yet
        # role decode: blocks being written by a receive thread: (incoming, request, skip, started)
        self._receiving: dict[str, tuple[IncomingHandoff, Request, int, float]] = {}
        self._aborted_receiving: set[str] = set()
        if config.role != "both":
            self._threads = HandoffThreads(HandoffAuth(transfer_secret(config)))
            if config.role == "decode":
                self._threads.listen(config.kv_transport, _listen_address(config), config.kv_transfer_timeout)

    @property
    def kv_address(self) -> str | None:
        """Role decode: where prefill engines send KV handoffs."""
        return self._threads.address if self._threads is not None else None

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake()` (from another thread) whenever a KV handoff event awaits step()."""
        if self._threads is not None:
            self._threads.set_wake(wake)

    def has_events(self) -> bool:
        """A handoff thread posted something the next step applies."""
        return self._threads is not None and self._threads.has_events()

    def stats(self) -> DisaggStats:
        stats = self.handoffs.stats.copy()
        if self._threads is not None:
            stats.failures["unauthenticated"] = self._threads.auth.rejected
        return stats

    # ---- the engine's fixed points -------------------------------------------------------------

    def on_add(self, request: Request, handoff: HandoffTarget | None, awaiting_kv: bool) -> None:
        """A request was added (the engine checked its role takes these)."""
        if handoff is not None:
            self._targets[request.parent_id] = handoff
        if awaiting_kv:
            self._awaiting[request.parent_id] = request

    def before_step(self, handoff_outcomes: dict[str, HandoffOutcome]) -> list[str]:
        """Apply the handoff threads' events. A prefill request's ended send is recorded in
        `handoff_outcomes`. Returns the requests aborted while their blocks were being written:
        the write has ended, so the engine aborts them now."""
        to_abort: list[str] = []
        if self._threads is None:
            return to_abort
        for event in self._threads.take_events():
            if isinstance(event, HeaderArrived):
                self._begin_receive(event.incoming)
            elif isinstance(event, Received):
                if self._end_receive(event):
                    to_abort.append(event.request_id)
            elif isinstance(event, Sent):
                handoff_outcomes[event.request_id] = self._sent(event)
        return to_abort

    def after_step(self, progressed: Sequence[Request], changed: Sequence[RequestOutputDelta]) -> set[str]:
        """Role prefill: every request that has its first token and goes on is exported (its
        KV copied out, its blocks freed) and sent to its target, or kept for take_handoffs.
        Returns the exported requests: the engine forgets them and drops their deltas (the
        decode engine's output carries the first token too)."""
        self.handoffs.after_step(progressed)
        exported: set[str] = set()
        if self.role != "prefill":
            return exported
        for delta in changed:
            samples = self.core.requests.get(delta.request_id)
            if delta.finished or not samples or samples[0].is_finished:
                continue
            handoff = self.handoffs.export(samples[0])
            self.core.scheduler.finish_requests([samples[0]], RequestStatus.FINISHED_STOPPED)
            target = self._targets.pop(delta.request_id, None)
            if target is None:
                self._exported.append(handoff)  # the engine-level API: the caller sends it
            else:
                handoff.header.request_id = target.request_id  # the decode engine's id for it
                self._role_threads().send(delta.request_id, handoff, target.transport, target.address, target.timeout)
            exported.add(delta.request_id)
        return exported

    def on_abort(self, request_id: str) -> bool:
        """True when the abort must wait: a receive thread is writing the request's blocks
        (they are freed once it ends, see before_step); else the engine aborts it now."""
        if request_id in self._receiving:
            self._aborted_receiving.add(request_id)
            return True
        self._awaiting.pop(request_id, None)
        return False

    def forget(self, request_id: str) -> None:
        self._targets.pop(request_id, None)
        self._awaiting.pop(request_id, None)
        self.handoffs.forget(request_id)

    def close(self) -> None:
        """Stop the handoff threads (a decode engine's KV listener with them)."""
        if self._threads is not None:
            self._threads.close()

    # ---- the engine-level API: a caller moves handoffs itself -----------------------------------

    def take_handoffs(self) -> list[KVHandoff]:
        """Role prefill: the requests exported without a target by the steps since the last call."""
        handoffs, self._exported = self._exported, []
        return handoffs

    def send_handoff(self, handoff: KVHandoff, transport: str, address: str, timeout: float = 10.0) -> bool:
        """Ship an exported request to a decode engine's listener. False (counted as a send
        failure) if it did not arrive; this engine holds no block of it either way."""
        try:
            num_sent = send_handoff(handoff, transport, address, timeout, self._role_threads().auth)
        except TransferError:
            self.handoffs.stats.failures["send"] += 1
            return False
        self.handoffs.record_sent(handoff, num_sent)
        return True

    def import_request(self, incoming: IncomingHandoff, request: Request, *, fallback: bool) -> bool:
        """Receive a handed-off request's blocks on this thread and start it decoding; True
        when they were. If the transfer fails or is refused, what was allocated is released
        and, with `fallback`, the request is prefilled here (False), else TransferError."""
        try:
            self.handoffs.import_request(incoming, request)
        except TransferError:
            if not fallback:
                raise
            self._prefill_here(request)
            return False
        self.core.scheduler.add_imported(request)
        return True

    def prefill_locally(self, request_ids: Iterable[str]) -> None:
        """Role decode: stop awaiting these requests' KV and prefill them here. A request whose
        KV is already arriving finishes its import (or falls back by itself if that fails)."""
        for request_id in request_ids:
            request = self._awaiting.pop(request_id, None)
            if request is not None:
                self._prefill_here(request)

    # ---- the handoff threads' events ------------------------------------------------------------

    def _role_threads(self) -> HandoffThreads:
        """The handoff threads, which every role but "both" has."""
        assert self._threads is not None, "KV handoffs run only on a prefill or decode engine"
        return self._threads

    def _prefill_here(self, request: Request) -> None:
        """Its KV will not come: prefill the request here from the prompt (and the sender's first
        token, if it was kept), as a preempted request recomputes."""
        self.handoffs.stats.fallback_prefills += 1
        self.core.scheduler.add_request(request)

    def _begin_receive(self, incoming: IncomingHandoff) -> None:
        request_id = incoming.header.request_id
        request = self._awaiting.pop(request_id, None)
        if request is None:  # aborted, prefilled here after a timeout, or never announced
            self.handoffs.stats.failures["refused"] += 1
            incoming.reject(f"request {request_id!r} is not awaiting a KV handoff here")
            return
        started = time.perf_counter()
        request.metrics.handoff_start_time = time.time()
        try:
            skip = self.handoffs.begin_import(incoming, request)
        except TransferError:  # refused (identity, no free blocks): nothing is held; prefill here
            self._prefill_here(request)
            return
        self._receiving[request_id] = (incoming, request, skip, started)
        self._role_threads().receive(
            incoming, request_id, skip, lambda indices, data: self.handoffs.write_blocks(request, indices, data)
        )

    def _end_receive(self, event: Received) -> bool:
        """True when the request was aborted meanwhile (its written blocks are to be freed)."""
        incoming, request, skip, started = self._receiving.pop(event.request_id)
        if event.request_id in self._aborted_receiving:
            self._aborted_receiving.discard(event.request_id)
            return True
        if event.error is not None:
            self.handoffs.abandon_import(request)
            self._prefill_here(request)
            return False
        self.handoffs.finish_import(incoming, request, skip, started)
        request.metrics.handoff_end_time = time.time()
        self.core.scheduler.add_imported(request)
        return False

    def _sent(self, event: Sent) -> HandoffOutcome:
        if event.error is None:
            self.handoffs.record_sent(event.handoff, event.num_sent)
            return HandoffOutcome(True)
        kind = "refused" if isinstance(event.error, HandoffRefused) else "send"
        self.handoffs.stats.failures[kind] += 1
        return HandoffOutcome(False, str(event.error))


def transfer_secret(config: EngineConfig) -> str:
    """The deployment's KV transfer secret: --kv-transfer-secret (a replica set draws one for its
    replicas), else the environment's PAGODA_KV_TRANSFER_SECRET (engines of one deployment
    started apart, on other machines). A prefill or decode engine without one does not start:
    its handoffs would be unauthenticated."""
    secret = config.kv_transfer_secret or os.environ.get(TRANSFER_SECRET_ENV)
    if not secret:
        raise ValueError(
            f"role {config.role} needs the deployment's KV transfer secret: set kv_transfer_secret "
            f"(--kv-transfer-secret) or {TRANSFER_SECRET_ENV}, the same on its prefill and decode engines"
        )
    return secret


def _listen_address(config: EngineConfig) -> str | None:
    """A decode engine's KV listener: --kv-listen, else loopback (every interface with Ray,
    whose prefill replicas may run on other nodes: every frame is signed); shm picks a socket
    path itself."""
    if config.kv_transport != "tcp":
        return None
    if config.kv_listen is not None:
        return config.kv_listen
    return "0.0.0.0:0" if config.distributed_executor_backend == "ray" else "127.0.0.1:0"
