"""What the engine core and the model runner call for structured output.

A constrained request waits here (not in the scheduler) until its grammar is compiled, so a
slow grammar never holds up the batch or the requests queued behind it. Once compiled, each
of its samples gets its own matcher and the lead is handed to the scheduler.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagoda.kernels.bitmask import allocate_bitmask, apply_bitmask
from pagoda.request import Request
from pagoda.structured.compiler import GrammarCompiler, StructuredOutputStats, error_summary
from pagoda.structured.grammar import GrammarError
from pagoda.structured.matcher import RequestMatcher

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    request_id: str
    samples: list[Request]
    future: concurrent.futures.Future
    submitted: float


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        timeout_s: float,
        max_workers: int = 1,
    ) -> None:
        self.timeout_s = timeout_s
        self.compiler = GrammarCompiler(tokenizer_path, vocab_size, list(eos_token_ids), max_workers=max_workers)
        self._pending: list[_Pending] = []

    # ---- waiting for grammars ------------------------------------------------------------------

    def submit(self, request_id: str, samples: list[Request]) -> None:
        params = samples[0].sampling_params.structured_outputs
        assert params is not None, "only a constrained request waits for its grammar"
        future = self.compiler.submit(params)
        self._pending.append(_Pending(request_id, samples, future, time.monotonic()))

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout_s: float) -> None:
        """Block until a pending grammar is done or `timeout_s` passes (an otherwise idle step)."""
        if self._pending:
            concurrent.futures.wait(
                [p.future for p in self._pending], timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def poll(self) -> tuple[list[tuple[str, list[Request]]], list[tuple[str, str]]]:
        """(request id, samples) whose grammars are ready, matchers attached; and
        (request id, error message) for those that failed or timed out."""
        ready, failed, still = [], [], []
        now = time.monotonic()
        for pending in self._pending:
            if all(s.is_finished for s in pending.samples):
                continue  # aborted while waiting
            if pending.future.done():
                error = pending.future.exception()
                if error is None:
                    template = pending.future.result()
                    params = pending.samples[0].sampling_params.structured_outputs
                    assert params is not None, "only a constrained request waits for its grammar"
                    kind = params.kind
                    for sample in pending.samples:
                        sample.structured_output = RequestMatcher(template.deep_copy(), kind, self.compiler.executor)
                    ready.append((pending.request_id, pending.samples))
                else:
                    self.compiler.record(failure=True)
                    message = (
                        str(error)
                        if isinstance(error, GrammarError)
                        else f"structured_outputs: the grammar could not be compiled: {error}"
                    )
                    failed.append((pending.request_id, message))
            elif now - pending.submitted > self.timeout_s:
                self.compiler.record(timeout=True)
                failed.append(
                    (
                        pending.request_id,
                        f"structured_outputs: compiling the grammar took longer than "
                        f"{self.timeout_s:g} s (--structured-output-timeout)",
                    )
                )
            else:
                still.append(pending)
        self._pending = still
        return ready, failed

    # ---- each step -----------------------------------------------------------------------------

    @staticmethod
    def advance(progressed: Sequence[Request], outputs_before: dict[int, int]) -> list[Request]:
        """Feed this step's new tokens to the matchers. Returns the unfinished requests whose
        grammar is now complete (they stop here: nothing but EOS could follow)."""
        done = []
        for request in progressed:
            matcher = request.structured_output
            if matcher is None:
                continue
            new_tokens = request.output_token_ids[outputs_before[id(request)] :]
            extra = len(new_tokens) - matcher.accept(new_tokens)
            if extra:
                # Tokens the grammar did not take are never emitted: past its end (a speculative
                # step can verify EOS there, where a plain step would already have stopped), or
                # sampled from an all-allowed row after the matcher failed.
                del request.output_token_ids[-extra:]
                del request.all_token_ids[-extra:]
                request.stop_reason = None
            if matcher.failed:
                # The first line only: the rest dumps the grammar and the tokens (request content).
                logger.warning(
                    "request %s: its grammar failed (%s); stopping it",
                    request.request_id,
                    error_summary(matcher.matcher.get_error() or "a token outside the grammar"),
                )
            if not request.is_finished and (matcher.is_terminated or matcher.failed):
                done.append(request)
        return done

    def stats(self) -> StructuredOutputStats:
        return self.compiler.snapshot()

    def shutdown(self) -> None:
        self.compiler.shutdown()


class GrammarMasks:
    """One step's bitmask for the rows of constrained requests, filled in a worker thread while
    the model's forward runs (llguidance releases the GIL while it computes a mask), then
    applied to the logits in one operation.

    `groups`: (first logits row, request, drafts) per request about to sample; a request with
    k drafts owns k + 1 consecutive rows. Rows of unconstrained requests are left untouched.
    Masking happens before logit bias, penalties, temperature and top-k/p, and before logprobs
    are computed: reported logprobs are those of the masked distribution, as in vLLM (its model
    runner applies the grammar bitmask to the logits before its sampler sees them).
    """

    def __init__(
        self,
        groups: Sequence[tuple[int, Request, Sequence[int]]],
        vocab_size: int,
        pool: concurrent.futures.Executor | None = None,
    ) -> None:
        self.constrained = [
            (row, request, list(drafts)) for row, request, drafts in groups if request.structured_output is not None
        ]
        self.rows = [r for row, _, drafts in self.constrained for r in range(row, row + len(drafts) + 1)]
        self.bitmask = allocate_bitmask(len(self.rows), vocab_size) if self.constrained else None
        self._filled = pool.submit(self._fill) if pool is not None and self.constrained else None
        if self._filled is None and self.constrained:
            self._fill()

    def _fill(self) -> None:
        # The bitmask may be an inference tensor (allocated inside the runner's inference_mode);
        # the worker thread edits it under the same mode.
        with torch.inference_mode():
            self._fill_rows()

    def _fill_rows(self) -> None:
        bitmask = self.bitmask
        assert bitmask is not None, "masks are filled only when some row is constrained"
        batched: list[tuple[RequestMatcher, int]] = []  # (matcher, bitmask row), filled in one call
        position = 0
        for _, request, drafts in self.constrained:
            matcher = request.structured_output
            if drafts:
                matcher.fill_draft_masks(bitmask, position, drafts)
            elif matcher.executor is not None and not matcher.failed:
                batched.append((matcher, position))
            else:
                matcher.fill_mask(bitmask, position)
            position += len(drafts) + 1
        if len(batched) == 1:
            batched[0][0].fill_mask(bitmask, batched[0][1])
        elif batched:
            executor = batched[0][0].executor
            assert executor is not None, "only matchers with an executor are batched"
            try:
                executor.unsafe_compute_mask_ptr(
                    [(m.matcher, r) for m, r in batched],
                    bitmask.data_ptr(),
                    bitmask.shape[1] * bitmask.element_size(),
                    bitmask.shape[0],
                )
            except (RuntimeError, ValueError):  # one matcher's failure: redo row by row to find it
                for matcher, row in batched:
                    matcher.fill_mask(bitmask, row)
            for matcher, row in batched:
                matcher.check_filled(bitmask, row)

    def apply(self, logits: torch.Tensor) -> None:
        if not self.constrained:
            return
        assert self.bitmask is not None, "allocated whenever some row is constrained"
        if self._filled is not None:
            try:
                self._filled.result()
            except Exception:  # a bug in filling: stop these requests, never the engine
                logger.exception("filling grammar masks failed; stopping %d requests", len(self.constrained))
                for _, request, _ in self.constrained:
                    request.structured_output.failed = True
                self.bitmask.fill_(-1)
        apply_bitmask(logits, self.bitmask, torch.tensor(self.rows, device=logits.device))


def apply_grammar_masks(logits: torch.Tensor, groups: Sequence[tuple[int, Request, Sequence[int]]]) -> None:
    """Fill and apply at once (see GrammarMasks)."""
    GrammarMasks(groups, logits.shape[-1]).apply(logits)
