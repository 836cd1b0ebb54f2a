"""Named request classes that mirror real traffic, mixed by weight into one seeded request list.

- chat: short prompt, short output.
- rag: one of a few shared documents plus a short question, short output (prefix-cache friendly).
- summarize: long prompt, long output.
- agent: multi-turn sessions; each turn resends the whole conversation so far plus a tool result.
  The assistant's earlier replies are synthetic text of the earlier turn's output length, so the
  request list does not depend on what the target generated and every target gets the same list.
- file:PATH.jsonl: one request per line, {"prompt": "..."} or {"messages": [...]} or {"prompt_len": N},
  with optional "output_len" and "class".
"""

from __future__ import annotations

import itertools
import json
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.bench.lengths import LengthDist, fixed, lognormal, parse_length, uniform
from pagoda.bench.prompts import PromptBuilder
from pagoda.bench.records import BenchRequest

# Lengths in tokens. Counts (docs, turns, sessions) are not scaled by --length-scale.
DEFAULT_PARAMS: dict[str, dict[str, LengthDist]] = {
    "chat": {"prompt": lognormal(200, 1000), "output": lognormal(150, 500)},
    "rag": {"docs": fixed(4), "doc": fixed(2000), "question": uniform(10, 40), "output": lognormal(100, 300)},
    "summarize": {"prompt": lognormal(3000, 6000), "output": lognormal(400, 900)},
    "agent": {
        "prompt": lognormal(800, 1500),
        "tool": uniform(50, 300),
        "output": lognormal(80, 200),
        "turns": uniform(3, 6),
        "sessions": fixed(4),
    },
    "file": {"output": lognormal(150, 500)},
}
COUNT_PARAMS = ("docs", "turns", "sessions")
RAG_QUESTION_MARK = "\n\nQuestion:"
AGENT_TASK = "You are an agent with tools. Task:"
AGENT_ASSISTANT_MARK = "\n\nAssistant:"
AGENT_TOOL_MARK = "\n\nTool result:"

PARAM_HELP = (
    "override a class's lengths, repeatable: CLASS.FIELD=LENGTH, e.g. chat.prompt=lognormal:200:1000, "
    "rag.doc=2000, rag.docs=4, agent.turns=uniform:3:6. Fields: "
    + "; ".join(
        f"{name}: {', '.join(f'{k}={v}' for k, v in fields.items())}" for name, fields in DEFAULT_PARAMS.items()
    )
)


@dataclass
class WorkloadSpec:
    """What to generate: class weights, per-class length overrides, and the length cap."""

    mix: dict[str, float]
    overrides: dict[str, dict[str, LengthDist]] = field(default_factory=dict)
    length_scale: float = 1.0
    max_model_len: int | None = None
    seed: int = 0

    def params(self, class_name: str) -> dict[str, LengthDist]:
        base = DEFAULT_PARAMS["file" if class_name.startswith("file:") else class_name]
        merged = dict(base)
        merged.update(self.overrides.get(class_name, {}))
        return {
            k: (v if k in COUNT_PARAMS or k in self.overrides.get(class_name, {}) else v.scaled(self.length_scale))
            for k, v in merged.items()
        }


def parse_mix(text: str) -> dict[str, float]:
    """'chat=0.6,rag=0.3,file:traffic.jsonl=0.1' -> weights. A class without '=' has weight 1."""
    mix: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, weight = item.rpartition("=") if "=" in item else (item, "", "1")
        if not sep:
            name = item
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"bad weight {weight!r} for class {name!r} in --mix") from None
        if value < 0:
            raise ValueError(f"--mix weight of {name!r} must be >= 0")
        if not name.startswith("file:") and name not in DEFAULT_PARAMS or name == "file":
            raise ValueError(f"unknown request class {name!r}; use chat, rag, summarize, agent or file:PATH.jsonl")
        mix[name] = value
    if not mix or sum(mix.values()) <= 0:
        raise ValueError("--mix needs at least one class with a positive weight")
    return mix


def parse_params(items: list[str]) -> dict[str, dict[str, LengthDist]]:
    """['chat.prompt=lognormal:200:1000', 'rag.docs=4'] -> {'chat': {'prompt': ...}, 'rag': {'docs': ...}}."""
    out: dict[str, dict[str, LengthDist]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        class_name, dot, field_name = key.rpartition(".")
        if not sep or not dot:
            raise ValueError(f"bad --param {item!r}; expected CLASS.FIELD=LENGTH, e.g. chat.prompt=200")
        base = DEFAULT_PARAMS.get("file" if class_name.startswith("file:") else class_name)
        if base is None or field_name not in base:
            fields = ", ".join(base) if base else "none (unknown class)"
            raise ValueError(f"--param {item!r}: class {class_name!r} has fields {fields}")
        out.setdefault(class_name, {})[field_name] = parse_length(value)
    return out


def _load_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"workload file {path} does not exist")
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not JSON: {e}") from None
        if not isinstance(row, dict) or not ({"prompt", "messages", "prompt_len"} & row.keys()):
            raise ValueError(f"{path}:{line_no}: needs 'prompt', 'messages' or 'prompt_len'")
        rows.append(row)
    if not rows:
        raise ValueError(f"workload file {path} has no requests")
    return rows


@dataclass
class _AgentSession:
    session_id: int
    prompt: str
    messages: list[dict[str, str]]
    turns_left: int
    last_index: int
    last_output_len: int


class Workload:
    """Generates the request list: deterministic for a given spec, tokenizer and seed."""

    def __init__(self, spec: WorkloadSpec, builder: PromptBuilder) -> None:
        self.spec = spec
        self.builder = builder
        self.params = {name: spec.params(name) for name in spec.mix}
        self._files = {name: _load_jsonl(Path(name[len("file:") :])) for name in spec.mix if name.startswith("file:")}
        self._rngs = {name: random.Random(spec.seed * 1_000_003 + zlib.crc32(name.encode())) for name in spec.mix}
        self._docs: list[str] = []
        self._sessions: list[_AgentSession] = []
        self._next_session = 0
        self._file_pos = dict.fromkeys(self._files, 0)

    # -- helpers ---------------------------------------------------------------------------

    def _fit(self, prompt_len: int, output_len: int) -> tuple[int, int]:
        """Clamp lengths into the context window, shortening the output first."""
        limit = self.spec.max_model_len
        if limit is None or prompt_len + output_len <= limit:
            return prompt_len, output_len
        output_len = max(1, min(output_len, limit - prompt_len))
        return min(prompt_len, limit - output_len), output_len

    def _text(self, n_tokens: int, rng: random.Random) -> str:
        return self.builder.extend_to("", max(n_tokens, self.builder.num_special + 1), rng)

    # -- classes ---------------------------------------------------------------------------

    def _chat_like(self, index: int, name: str) -> BenchRequest:
        rng, params = self._rngs[name], self.params[name]
        prompt_len, output_len = self._fit(params["prompt"].sample(rng), params["output"].sample(rng))
        prompt = self._text(prompt_len, rng)
        return BenchRequest(
            index, name, prompt, [{"role": "user", "content": prompt}], self.builder.count(prompt), output_len
        )

    def _rag(self, index: int) -> BenchRequest:
        rng, params = self._rngs["rag"], self.params["rag"]
        if not self._docs:
            num_docs = max(1, params["docs"].sample(rng))
            doc_rng = random.Random(rng.random())
            for _ in range(num_docs):
                doc_len, _ = self._fit(params["doc"].sample(doc_rng), 1 + params["question"].sample(doc_rng))
                self._docs.append(self._text(doc_len, doc_rng) + RAG_QUESTION_MARK)
        prefix = rng.choice(self._docs)
        base = self.builder.count(prefix)
        question_len, output_len = params["question"].sample(rng), params["output"].sample(rng)
        total, output_len = self._fit(base + max(1, question_len), output_len)
        prompt = self.builder.extend_to(prefix, max(total, base + 1), rng)
        return BenchRequest(
            index, "rag", prompt, [{"role": "user", "content": prompt}], self.builder.count(prompt), output_len
        )

    def _agent(self, index: int) -> BenchRequest:
        rng, params = self._rngs["agent"], self.params["agent"]
        num_sessions = max(1, params["sessions"].sample(rng))
        if len(self._sessions) < num_sessions:
            return self._agent_new_session(index, rng, params)
        session = rng.choice(self._sessions)
        assistant = self.builder.extend_to("", session.last_output_len, rng, content_only=True)
        head = session.prompt + AGENT_ASSISTANT_MARK + assistant + AGENT_TOOL_MARK
        tool_len, output_len = params["tool"].sample(rng), params["output"].sample(rng)
        base = self.builder.count(head)
        limit = self.spec.max_model_len
        if limit is not None and base + tool_len + output_len > limit:
            self._sessions.remove(session)  # the conversation no longer fits: the session ends
            return self._agent(index)
        prompt = self.builder.extend_to(head, base + tool_len, rng)
        tool_text = prompt[len(head) :]
        messages = session.messages + [
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": AGENT_TOOL_MARK.strip() + tool_text},
        ]
        request = BenchRequest(
            index,
            "agent",
            prompt,
            messages,
            self.builder.count(prompt),
            output_len,
            session=session.session_id,
            turn=len(messages) // 2,
            depends_on=session.last_index,
        )
        session.prompt, session.messages, session.last_index = prompt, messages, index
        session.last_output_len = output_len
        session.turns_left -= 1
        if session.turns_left <= 0:
            self._sessions.remove(session)
        return request

    def _agent_new_session(self, index: int, rng: random.Random, params: dict[str, LengthDist]) -> BenchRequest:
        prompt_len, output_len = self._fit(params["prompt"].sample(rng), params["output"].sample(rng))
        prompt = self.builder.extend_to(AGENT_TASK, max(prompt_len, self.builder.count(AGENT_TASK) + 1), rng)
        messages = [{"role": "user", "content": prompt}]
        session = _AgentSession(
            self._next_session, prompt, messages, max(1, params["turns"].sample(rng)) - 1, index, output_len
        )
        self._next_session += 1
        if session.turns_left > 0:
            self._sessions.append(session)
        return BenchRequest(
            index, "agent", prompt, messages, self.builder.count(prompt), output_len, session=session.session_id, turn=0
        )

    def _from_file(self, index: int, name: str) -> BenchRequest:
        rows, rng = self._files[name], self._rngs[name]
        row = rows[self._file_pos[name] % len(rows)]
        self._file_pos[name] += 1
        class_name = str(row.get("class", Path(name[len("file:") :]).stem))
        output_len = int(row["output_len"]) if "output_len" in row else self.params[name]["output"].sample(rng)
        if "messages" in row:
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]
            prompt = "\n\n".join(m["content"] for m in messages)
        else:
            if "prompt" in row:
                prompt = str(row["prompt"])
            else:
                prompt_len, output_len = self._fit(int(row["prompt_len"]), output_len)
                prompt = self._text(prompt_len, rng)
            messages = [{"role": "user", "content": prompt}]
        prompt_len = self.builder.count(prompt)
        if self.spec.max_model_len is not None and prompt_len >= self.spec.max_model_len:
            raise ValueError(
                f"{name}: a prompt of {prompt_len} tokens does not fit max_model_len {self.spec.max_model_len}"
            )
        _, output_len = self._fit(prompt_len, output_len)
        return BenchRequest(index, class_name, prompt, messages, prompt_len, output_len)

    # -- the stream --------------------------------------------------------------------------

    def make(self, index: int, class_name: str) -> BenchRequest:
        if class_name in ("chat", "summarize"):
            return self._chat_like(index, class_name)
        if class_name == "rag":
            return self._rag(index)
        if class_name == "agent":
            return self._agent(index)
        return self._from_file(index, class_name)

    def __iter__(self) -> Iterator[BenchRequest]:
        chooser = random.Random(self.spec.seed)
        names = list(self.spec.mix)
        weights = [self.spec.mix[n] for n in names]
        for index in itertools.count():
            yield self.make(index, chooser.choices(names, weights)[0])

    def build(self, num_requests: int) -> list[BenchRequest]:
        return list(itertools.islice(iter(self), num_requests))


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a local directory (never the network)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ValueError(f"tokenizer directory {path} does not exist")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def make_workload(spec: WorkloadSpec, tokenizer_dir: str) -> Workload:
    return Workload(spec, PromptBuilder.from_tokenizer(load_tokenizer(tokenizer_dir)))
