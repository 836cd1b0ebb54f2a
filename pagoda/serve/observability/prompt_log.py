"""The prompt log (--log-prompts): prompts and outputs, kept apart from the request log.

The request log never holds what a body carried; with --log-prompts each request's prompts and
outputs (and its error message in full) go to this log instead: JSON lines in files that only the
server's user may read (0600, in a 0700 directory), with personal data redacted before anything
is written (every PII type the guardrails detect, plus the --guardrails file's pii rules and its
redacting regex / blocklist rules for the tenant). A line has the request log's keys (request_id,
endpoint, tenant, prompt, output_tokens, ...), so `pagoda gate record --from-log` and `pagoda
bench route-sim --trace` read these files as they read the request log.

- sampling (--prompt-log-sample RATE): each request is kept with probability RATE;
- retention (--prompt-log-retention DURATION): the current file is replaced by a new one every
  tenth of the retention (at most hourly) and a file is deleted once its first record is older
  than the retention, by a thread of the log's own and on every write, so no record outlives it;
- access: `GET /admin/prompt-log?tenant=...` (admin keys only) reads it, and every such access,
  refused ones included, is appended to the audit file beside it (who, when, what filter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.guard import GuardrailsConfig
    from pagoda.guard.rules import PatternRule
    from pagoda.serve.observability.request_log import RequestLogRecord

FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
AUDIT_FILE = "audit.jsonl"
# Without a retention the files still rotate, so that none grows without end.
DEFAULT_ROTATION_S = 24 * 3600.0
MAX_ROTATION_S = 3600.0
# The retention thread wakes at least this often (a rotation interval shorter than it wins).
MAX_CHECK_INTERVAL_S = 60.0
DEFAULT_READ_LIMIT = 100
MAX_READ_LIMIT = 10_000

_FILE_NAME = re.compile(r"prompts-(\d{8}T\d{6}\.\d{6})Z\.jsonl")
_STAMP_FORMAT = "%Y%m%dT%H%M%S.%f"
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d|w)?\s*")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as 30d, 12h, 90m, 45s, 500ms or a bare number of seconds;
    ValueError (naming the flag) for anything else or for a duration that is not positive."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(
            f"--prompt-log-retention: {text!r} is not a duration (a number with ms, s, m, h, d or w, e.g. 30d)"
        )
    seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]
    if seconds <= 0:
        raise ValueError(f"--prompt-log-retention must be > 0, got {text!r}")
    return seconds


def check_sample_rate(rate: float) -> None:
    if not 0.0 <= rate <= 1.0:  # also refuses NaN
        raise ValueError(f"--prompt-log-sample must be between 0 and 1, got {rate}")


def builtin_pii_rule() -> PatternRule:
    """Every PII type, whatever the --guardrails file says: the prompt log redacts without one.
    (Imported here: the guardrails' regex engine loads only for a server that logs prompts.)"""
    from pagoda.guard.pii import PII_TYPES
    from pagoda.guard.rules import PatternRule

    return PatternRule(
        name="prompt-log-pii",
        kind="pii",
        action="redact",
        stages=frozenset({"input", "output"}),
        tenants=None,
        pii_types=PII_TYPES,
    )


def redaction_rules(guardrails: GuardrailsConfig | None) -> list[PatternRule]:
    """The built-in PII rule, then the guardrails' pii rules (whatever their action: what a
    rule finds is personal data) and their redacting regex and blocklist rules."""
    from pagoda.guard.rules import PatternRule

    rules = [builtin_pii_rule()]
    for rule in guardrails.rules if guardrails is not None else []:
        if isinstance(rule, PatternRule) and (rule.kind == "pii" or rule.action == "redact"):
            rules.append(rule)
    return rules


def redact(text: str, rules: list[PatternRule], tenant: str | None) -> str:
    """`text` with every span a rule for `tenant` finds replaced (the earliest, longest wins)."""
    applicable = [r for r in rules if r.tenants is None or (tenant is not None and tenant in r.tenants)]
    found = sorted(
        ((rule, span) for rule in applicable for span in rule.find(text)),
        key=lambda pair: (pair[1].start, -pair[1].end),
    )
    pieces, position = [], 0
    for rule, span in found:
        if span.start < position:  # overlaps a span already replaced
            continue
        pieces.append(text[position : span.start])
        pieces.append(rule.replacement_for(span))
        position = span.end
    pieces.append(text[position:])
    return "".join(pieces)


def _open_private(path: Path) -> int:
    """An append-only descriptor of `path`, created owner-only; an existing file is narrowed
    to owner-only too (a file the operator made wider is not written to as it is)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return fd


def _utc_stamp(now: float) -> str:
    return datetime.fromtimestamp(now, timezone.utc).strftime(_STAMP_FORMAT)


def _iso(now: float) -> str:
    return datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="milliseconds")


def _file_start(path: Path) -> float | None:
    match = _FILE_NAME.fullmatch(path.name)
    if match is None:
        return None
    return datetime.strptime(match.group(1), _STAMP_FORMAT).replace(tzinfo=timezone.utc).timestamp()


@dataclass(frozen=True)
class PromptLogQuery:
    """What an admin asked of the prompt log: one tenant's records (None: every tenant's), the
    newest `limit` of them."""

    tenant: str | None = None
    limit: int = DEFAULT_READ_LIMIT


class PromptLog:
    """The prompt log's files in `directory`: redacted, sampled, rotated and deleted past the
    retention while the server runs. `close` stops the retention thread."""

    def __init__(
        self,
        directory: str | Path,
        *,
        sample_rate: float = 1.0,
        retention_s: float | None = None,
        rules: list[PatternRule] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_sample_rate(sample_rate)
        if retention_s is not None and not retention_s > 0:
            raise ValueError(f"--prompt-log-retention must be > 0, got {retention_s}")
        self.directory = Path(directory)
        self.sample_rate = sample_rate
        self.retention_s = retention_s
        self.rotation_s = min(retention_s / 10, MAX_ROTATION_S) if retention_s is not None else DEFAULT_ROTATION_S
        self.rules = rules if rules is not None else [builtin_pii_rule()]
        self._rng = rng or random.Random()
        self._clock = clock
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._fd_path: Path | None = None
        self._fd_started = 0.0
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, DIRECTORY_MODE)
        self._audit_fd = _open_private(self.directory / AUDIT_FILE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if retention_s is not None:
            self.enforce_retention()
            self._thread = threading.Thread(target=self._keep_retention, name="prompt-log-retention", daemon=True)
            self._thread.start()

    @classmethod
    def from_settings(
        cls, directory: str, sample_rate: float, retention_s: float | None, guardrails: GuardrailsConfig | None
    ) -> PromptLog:
        return cls(directory, sample_rate=sample_rate, retention_s=retention_s, rules=redaction_rules(guardrails))

    # ---- writing ----

    def record(self, record: RequestLogRecord) -> None:
        """Write `record`'s prompts, outputs and error, redacted, if the sample takes it."""
        if self.sample_rate < 1.0 and self._rng.random() >= self.sample_rate:
            return
        entry = self._entry(record)
        line = (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._current_fd(), line)

    def _entry(self, record: RequestLogRecord) -> dict[str, Any]:
        def clean(text: str) -> str:
            return redact(text, self.rules, record.tenant)

        fields = dataclasses.asdict(record)
        fields.update(fields.pop("extra"))
        prompt = record.prompt
        fields["prompt"] = (
            clean(prompt) if isinstance(prompt, str) else [clean(p) for p in prompt] if prompt is not None else None
        )
        fields["output"] = [clean(o) for o in record.output] if record.output is not None else None
        fields["error"] = clean(record.error) if record.error is not None else None
        return {"time": _iso(self._clock()), **{k: v for k, v in fields.items() if v is not None}}

    def _current_fd(self) -> int:
        """The file to append to now, opening a new one when the current one is due to rotate
        (called with the lock held)."""
        now = self._clock()
        if self._fd is None or now - self._fd_started >= self.rotation_s:
            if self._fd is not None:
                os.close(self._fd)
            self._fd_path = self.directory / f"prompts-{_utc_stamp(now)}Z.jsonl"
            self._fd = _open_private(self._fd_path)
            self._fd_started = now
            self._delete_expired(now)
        return self._fd

    # ---- retention ----

    def files(self) -> list[Path]:
        """The prompt log's files, oldest first."""
        return sorted(p for p in self.directory.iterdir() if _file_start(p) is not None)

    def enforce_retention(self) -> None:
        """Close a file that is due to rotate and delete the files past the retention."""
        with self._lock:
            now = self._clock()
            if self._fd is not None and now - self._fd_started >= self.rotation_s:
                os.close(self._fd)
                self._fd = None
            self._delete_expired(now)

    def _delete_expired(self, now: float) -> None:
        if self.retention_s is None:
            return
        for path in self.files():
            start = _file_start(path)
            if start is not None and now - start >= self.retention_s:
                if self._fd is not None and path == self._fd_path:
                    os.close(self._fd)
                    self._fd = None
                path.unlink(missing_ok=True)

    def _keep_retention(self) -> None:
        while not self._stop.wait(min(self.rotation_s, MAX_CHECK_INTERVAL_S)):
            try:
                self.enforce_retention()
            except OSError:  # a full or vanished disk: the next round tries again
                continue

    # ---- reading, audited ----

    def read(self, query: PromptLogQuery) -> list[dict[str, Any]]:
        """The newest `query.limit` records of `query.tenant` (every tenant's for None), oldest
        first."""
        found: list[dict[str, Any]] = []
        for path in reversed(self.files()):
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:  # deleted by the retention meanwhile
                continue
            for line in reversed(lines):
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if query.tenant is None or entry.get("tenant") == query.tenant:
                    found.append(entry)
                    if len(found) >= query.limit:
                        return found[::-1]
        return found[::-1]

    def audit(
        self,
        who: str | None,
        query: PromptLogQuery | None,
        status: int,
        returned: int = 0,
        filters: dict[str, str] | None = None,
    ) -> None:
        """Append one access to the audit file: who (the key's tenant; None: no valid key),
        when, the filter asked for, the answer's status and how many records it returned."""
        entry: dict[str, Any] = {
            "time": _iso(self._clock()),
            "who": who,
            "status": status,
            "filter": (dataclasses.asdict(query) if query is not None else filters or {}),
            "returned": returned,
        }
        line = (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._audit_fd, line)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._audit_fd >= 0:
                os.close(self._audit_fd)
                self._audit_fd = -1
