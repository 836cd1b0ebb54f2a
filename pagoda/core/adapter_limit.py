"""--max-loras in the scheduler: how many distinct LoRA adapters the running set may hold."""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.request import Request


class AdapterLimit:
    """--max-loras in the scheduler: the running set never holds more distinct adapters.

    A waiting request whose adapter does not fit steps aside for later ones whose adapter
    does (base-model requests always fit), but only `max_bypasses` times: then admission stops
    until it fits, which it does once running requests of other adapters finish. So an
    adapter's requests are delayed, never starved."""

    def __init__(self, max_loras: int, max_bypasses: int) -> None:
        self.max_loras = max_loras
        self.max_bypasses = max_bypasses
        self._bypasses: dict[str, int] = {}  # request id -> later requests admitted before it

    @staticmethod
    def adapters_of(requests: Iterable[Request]) -> set[int]:
        return {r.lora.load_id for r in requests if r.lora is not None}

    def fits(self, request: Request, active: set[int]) -> bool:
        return request.lora is None or request.lora.load_id in active or len(active) < self.max_loras

    def may_pass(self, waiting_aside: list[Request]) -> bool:
        return all(self._bypasses.get(r.request_id, 0) < self.max_bypasses for r in waiting_aside)

    def admitted(self, request: Request, active: set[int], passed_over: list[Request]) -> None:
        if request.lora is not None:
            active.add(request.lora.load_id)
        self._bypasses.pop(request.request_id, None)
        for waiting in passed_over:
            self._bypasses[waiting.request_id] = self._bypasses.get(waiting.request_id, 0) + 1

    def forget(self, request: Request) -> None:
        self._bypasses.pop(request.request_id, None)
