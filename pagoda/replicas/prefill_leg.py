"""The prefill half of a disaggregated request (`--replica-roles prefill=P,decode=D`).

The router first submits the request to a decode replica, which holds it awaiting its KV (the
client's stream is that replica's stream from the start), then runs this leg: the request goes
to a prefill replica with the decode replica's KV listener as its handoff target; the prefill
engine computes the prompt and the first token and sends request and blocks there itself (the
blocks never pass through the router). The leg only watches how it ended:

- handed off: nothing to do, the decode replica continues (if the transfer itself failed, the
  decode engine prefilled the request by itself: the client sees no error either way);
- the send failed or was refused, no prefill replica is left, the prefill replica refused the
  request, or it did not hand off within --kv-prefill-timeout: the decode replica prefills the
  request itself;
- the prefill replica died: the next live prefill replica is tried;
- the request finished at its first token (EOS, max_tokens 1, a stop string): that output is
  the client's, and the decode replica forgets the request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pagoda.config import DisaggregationConfig
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.request_stream import RequestStream
from pagoda.engine.roles import HandoffTarget
from pagoda.engine.step_output import HandoffOutcome
from pagoda.engine.transport import EngineDeadError
from pagoda.errors import InvalidRequest
from pagoda.replicas.policies import RouteRequest
from pagoda.replicas.replica import Flight, Replica
from pagoda.sampling_params import SamplingParams

# The router's choice among live replicas of a role: (replica, prompt tokens it expects cached),
# counted as routed there; None when none is left (ReplicaSet.choose).
Choose = Callable[[RouteRequest, set[int], str], "tuple[Replica, int] | None"]

logger = logging.getLogger(__name__)


def is_exportable(params: SamplingParams) -> bool:
    """What a prefill engine can hand off (engine/validation.py check_exportable); other
    requests run whole on a decode replica."""
    return params.n == 1 and params.structured_outputs is None and params.prompt_logprobs is None


class PrefillLeg:
    """Runs one request's prefill leg as a task on the router's event loop."""

    def __init__(
        self,
        config: DisaggregationConfig,
        choose: Choose,
        lock: threading.Lock,
        request: EngineRequest,
        attempt: int,
        route: RouteRequest,
        decode: Replica,
        decode_stream: RequestStream,
        on_end: Callable[[PrefillLeg], None],
        *,
        prefill_timeout: float,
    ) -> None:
        """`request`: as submitted to the decode replica (its prompt as token ids). `lock`
        guards the replicas' load counters (the router's lock); `prefill_timeout`: seconds the
        prefill replica has to hand the request off (--kv-prefill-timeout)."""
        self.config = config
        self.prefill_timeout = prefill_timeout
        self._choose = choose
        self._lock = lock
        self.request_id = request.request_id
        # Its own id on the prefill replica: a retried request's old leg may still be there.
        self.leg_id = f"{request.request_id}@prefill{attempt}"
        self.leg_request = replace(request, request_id=self.leg_id)
        self.route = route
        self.decode = decode
        self.decode_stream = decode_stream
        self.outcome = "running"  # then: handed_off, finished, fallback, cancelled
        self._on_end = on_end
        self._prefill: Replica | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    def cancel(self) -> None:
        self._task.cancel()

    async def _run(self) -> None:
        config = self.config
        target = HandoffTarget(
            config.kv_transport, str(self.decode.llm.kv_address), self.request_id, config.kv_transfer_timeout
        )
        excluded: set[int] = set()
        try:
            while True:
                choice = self._choose(self.route, excluded, "prefill")
                if choice is None:
                    self._fall_back("no prefill replica is running")
                    return
                self._prefill, cached = choice
                with self._lock:
                    flight = Flight(self._prefill, max(0, len(self.leg_request.prompt) - cached), 0)
                try:
                    outcome = await self._prefill_on(self._prefill, target, self.prefill_timeout)
                except EngineDeadError:
                    self._prefill.num_moved_away += 1
                    excluded.add(self._prefill.index)
                    continue
                except InvalidRequest as refusal:
                    self._fall_back(f"the prefill replica refused it: {refusal}")
                    return
                except asyncio.TimeoutError:
                    self._prefill.llm.abort([self.leg_id])
                    self._fall_back(f"no handoff within {self.prefill_timeout} s")
                    return
                finally:
                    flight.close()
                self._handle(outcome)
                return
        except asyncio.CancelledError:
            if self._prefill is not None:
                self._prefill.llm.abort([self.leg_id])
            self.outcome = "cancelled"
            raise
        finally:
            self._on_end(self)

    async def _prefill_on(self, prefill: Replica, target: HandoffTarget, timeout: float) -> HandoffOutcome | Any:
        async def submit_and_wait() -> HandoffOutcome | Any:
            stream = await prefill.llm.add_request(self.leg_request, handoff=target)
            return await stream.handoff_outcome()

        return await asyncio.wait_for(submit_and_wait(), timeout)

    def _handle(self, outcome: Any) -> None:
        if isinstance(outcome, HandoffOutcome):
            if outcome.sent:
                self.outcome = "handed_off"
            else:
                self._fall_back(f"the handoff failed: {outcome.reason}")
            return
        # Finished at its first token on the prefill replica: that output is the client's.
        self.outcome = "finished"
        self.decode.llm.abort([self.request_id])
        outcome.request_id = self.request_id
        self.decode_stream.deliver(outcome)

    def _fall_back(self, reason: str) -> None:
        self.outcome = "fallback"
        logger.warning("request %s is prefilled on decode replica %d: %s", self.request_id, self.decode.index, reason)
        self.decode.llm.prefill_locally([self.request_id])
