"""The classifier guard: a second, local causal LM that pagoda loads and prompts with a
guard template (Llama Guard's style by default) to label a text safe or unsafe.

The model runs on pagoda's own offline engine in the server process, on a worker thread so
the event loop keeps serving. Concurrent checks are batched: while one batch runs, new
requests queue, and the next batch takes up to `max_batch` of them in one engine call
(continuous batching inside the guard's engine). The verdict is the first line of a short
greedy generation: `unsafe_label` (optionally followed by categories on the next line, as
Llama Guard writes them) or `safe_label`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Llama Guard's task framing, shortened; {role} is "User" or "Agent", {text} the content.
DEFAULT_TEMPLATE = (
    "Task: Check if there is unsafe content in '{role}' messages in conversations according "
    "to our safety policy.\n\n<BEGIN CONVERSATION>\n\n{role}: {text}\n\n<END CONVERSATION>\n\n"
    "Provide your safety assessment for {role} in the above conversation:\n"
    "- First line must read 'safe' or 'unsafe'.\n"
    "- If unsafe, a second line must include a comma-separated list of violated categories."
)


class GuardModelError(RuntimeError):
    """The guard model failed or answered something that is neither label."""


@dataclass(frozen=True)
class Verdict:
    unsafe: bool
    categories: str | None = None  # the second line of an unsafe answer, if any


@dataclass
class GuardModel:
    """One loaded guard model, shared by every rule that names it."""

    name: str
    path: str
    template: str = DEFAULT_TEMPLATE
    use_chat_template: bool = True
    safe_label: str = "safe"
    unsafe_label: str = "unsafe"
    max_tokens: int = 10
    max_batch: int = 16
    engine_args: dict[str, Any] = field(default_factory=dict)
    _llm: Any = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    # Checks waiting for the next batch, and whether a batch is running (event loop only).
    _queue: list[tuple[str, str, asyncio.Future[Verdict]]] = field(default_factory=list, init=False, repr=False)
    _draining: bool = field(default=False, init=False, repr=False)

    def load(self) -> None:
        """Load the weights (raises with the cause when the model cannot be loaded)."""
        from pagoda.engine.llm import LLM

        args = {"num_kv_blocks": 512, "max_num_seqs": self.max_batch, "num_threads": 1, **self.engine_args}
        self._llm = LLM(model=self.path, **args)

    def prompt(self, text: str, role: str) -> str | list[int]:
        body = self.template.format(role=role, text=text)
        tokenizer = self._llm.tokenizer
        if self.use_chat_template and getattr(tokenizer, "has_chat_template", False):
            return tokenizer.encode_chat([{"role": "user", "content": body}], add_generation_prompt=True)
        return body

    def classify_batch(self, items: list[tuple[str, str]]) -> list[Verdict | GuardModelError]:
        """Blocking: a verdict (or the error that prevented one) for each (text, role)."""
        from pagoda.sampling_params import SamplingParams

        if self._llm is None:
            return [GuardModelError(f"guard model {self.name!r} is not loaded")] * len(items)
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens)
        try:
            with self._lock:
                outputs = self._llm.generate([self.prompt(text, role) for text, role in items], params)
        except Exception as exc:  # the guard must never take the server down
            error = GuardModelError(f"guard model {self.name!r} failed: {exc!r}")
            return [error] * len(items)
        verdicts: list[Verdict | GuardModelError] = []
        for output in outputs:
            try:
                verdicts.append(self.parse(output.outputs[0].text))
            except GuardModelError as exc:
                verdicts.append(exc)
        return verdicts

    def classify(self, text: str, role: str = "User") -> Verdict:
        """Blocking: the model's verdict on `text`. Raises GuardModelError on any failure."""
        [verdict] = self.classify_batch([(text, role)])
        if isinstance(verdict, GuardModelError):
            raise verdict
        return verdict

    async def classify_async(self, text: str, role: str = "User") -> Verdict:
        """The verdict on `text`, batched with the other checks waiting at the same time."""
        future: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._queue.append((text, role, future))
        if not self._draining:
            self._draining = True
            asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._queue[: self.max_batch]
                del self._queue[: self.max_batch]
                items = [(text, role) for text, role, _ in batch]
                try:
                    verdicts = await asyncio.to_thread(self.classify_batch, items)
                except Exception as exc:  # e.g. no thread could be started
                    verdicts = [GuardModelError(f"guard model {self.name!r} failed: {exc!r}")] * len(batch)
                for (_, _, future), verdict in zip(batch, verdicts):
                    if future.done():  # its request went away meanwhile
                        continue
                    if isinstance(verdict, GuardModelError):
                        future.set_exception(verdict)
                    else:
                        future.set_result(verdict)
        finally:
            self._draining = False

    def parse(self, answer: str) -> Verdict:
        lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
        first = lines[0].lower() if lines else ""
        # The longer label first, so one that is a prefix of the other cannot shadow it.
        labels = sorted(
            [(self.unsafe_label, True), (self.safe_label, False)], key=lambda pair: len(pair[0]), reverse=True
        )
        for label, unsafe in labels:
            if first.startswith(label.lower()):
                return Verdict(unsafe, lines[1] if unsafe and len(lines) > 1 else None)
        raise GuardModelError(
            f"guard model {self.name!r} answered {answer[:40]!r}, neither {self.safe_label!r} nor {self.unsafe_label!r}"
        )
