"""The classifier guard: a second, local causal LM that pagoda loads and prompts with a
guard template (Llama Guard's style by default) to label a text safe or unsafe.

The model runs on pagoda's own offline engine in the server process. Calls are serialised
(one engine, one lock) and run on a worker thread so the event loop keeps serving; the
verdict is the first line of a short greedy generation: `unsafe_label` (optionally followed
by categories on the next line, as Llama Guard writes them) or `safe_label`.
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
    engine_args: dict[str, Any] = field(default_factory=dict)
    _llm: Any = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def load(self) -> None:
        """Load the weights (raises with the cause when the model cannot be loaded)."""
        from pagoda.engine.llm import LLM

        args = {"num_kv_blocks": 256, "max_num_seqs": 8, "num_threads": 1,
                **self.engine_args}
        self._llm = LLM(model=self.path, **args)

    def prompt(self, text: str, role: str) -> str | list[int]:
        body = self.template.format(role=role, text=text)
        tokenizer = self._llm.tokenizer
        if self.use_chat_template and getattr(tokenizer, "has_chat_template", False):
            return tokenizer.encode_chat([{"role": "user", "content": body}],
                                         add_generation_prompt=True)
        return body

    def classify(self, text: str, role: str = "User") -> Verdict:
        """Blocking: the model's verdict on `text`. Raises GuardModelError on any failure."""
        from pagoda.sampling_params import SamplingParams

        if self._llm is None:
            raise GuardModelError(f"guard model {self.name!r} is not loaded")
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens)
        try:
            with self._lock:
                [output] = self._llm.generate([self.prompt(text, role)], params)
        except Exception as exc:  # the guard must never take the server down
            raise GuardModelError(f"guard model {self.name!r} failed: {exc!r}") from exc
        return self.parse(output.outputs[0].text)

    async def classify_async(self, text: str, role: str = "User") -> Verdict:
        return await asyncio.to_thread(self.classify, text, role)

    def parse(self, answer: str) -> Verdict:
        lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
        first = lines[0].lower() if lines else ""
        # The longer label first, so one that is a prefix of the other cannot shadow it.
        labels = sorted([(self.unsafe_label, True), (self.safe_label, False)],
                        key=lambda pair: len(pair[0]), reverse=True)
        for label, unsafe in labels:
            if first.startswith(label.lower()):
                return Verdict(unsafe, lines[1] if unsafe and len(lines) > 1 else None)
        raise GuardModelError(f"guard model {self.name!r} answered {answer[:40]!r}, neither "
                              f"{self.safe_label!r} nor {self.unsafe_label!r}")
