"""`pagoda audit`: run the side-channel probes against one deployment and, when the audit
launched pagoda itself (`pagoda:ARGS`), re-run each probe that found something with pagoda's
mitigation applied to show its effect."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from pagoda.ops.probes import BudgetExceeded, Finding, Session, cache_probe, length_probe, queue_probe, stream_probe
from pagoda.ops.target import Target, TargetError, launch_pagoda

PROBES = ("cache", "length", "queue", "stream")
AUDIT_KEYS = {"a": "pagoda-audit-key-a", "b": "pagoda-audit-key-b"}


@dataclass
class AuditOptions:
    key_a: str | None = None
    key_b: str | None = None
    model: str | None = None
    probes: tuple[str, ...] = PROBES
    trials: int = 24
    budget: int = 600
    rerun: bool = True
    seed: int = 0
    timeout: float = 120.0
    launch_timeout: float = 300.0
    progress: bool = True
    prompt_words: int = 96  # A's secret in the cache probe: several KV blocks
    burst: int = 4

    def __post_init__(self) -> None:
        unknown = set(self.probes) - set(PROBES)
        if unknown or not self.probes:
            raise ValueError(
                f"--probes takes a comma-separated subset of {','.join(PROBES)}, "
                f"got {','.join(self.probes) or 'nothing'}"
            )
        if self.trials < 4:
            raise ValueError(f"--trials must be >= 4, got {self.trials}")
        if self.budget < 1:
            raise ValueError(f"--budget must be >= 1, got {self.budget}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AuditOptions:
        return cls(
            args.key_a,
            args.key_b,
            args.model,
            tuple(p.strip() for p in args.probes.split(",") if p.strip()),
            args.trials,
            args.budget,
            not args.no_rerun,
            args.seed,
            args.timeout,
            args.launch_timeout,
            not args.no_progress,
        )


async def _tenant_check(session: Session) -> list[str]:
    """Whether A and B are really two tenants: an open server ignores keys altogether."""
    notes = []
    response = await session.client.get(
        session.target.url("/v1/models"), headers=session.target.headers("pagoda-audit-no-such-key")
    )
    session.sent += 1
    if response.status_code == 200:
        notes.append(
            "the server accepts any API key (open access): A and B are one tenant and "
            "share everything, including the prefix cache"
        )
    elif session.keys["a"] == session.keys["b"]:
        notes.append("--key-a and --key-b are the same key: one tenant")
    return notes


async def _run_probe(session: Session, name: str, options: AuditOptions, max_model_len: int | None) -> Finding:
    trials = options.trials
    if name == "cache":
        words = options.prompt_words
        if max_model_len:  # leave room for B's tail on small-context models
            words = min(words, max(16, max_model_len // 4))
        return await cache_probe(session, trials, words, options.seed)
    if name == "length":
        long_words = min(400, max(32, (max_model_len or 1024) // 3))
        return await length_probe(session, trials, long_words, options.seed)
    if name == "queue":
        return await queue_probe(session, trials, options.burst, options.seed)
    return await stream_probe(session)


async def _probe_all(
    target: Target, options: AuditOptions, names: tuple[str, ...], keys: dict[str, str | None]
) -> tuple[list[Finding], list[str], int]:
    timeout = httpx.Timeout(options.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        session = Session(client, target, keys["a"], keys["b"], options.budget, options.seed)
        models = await client.get(target.url("/v1/models"), headers=target.headers(keys["a"]))
        session.sent += 1
        max_model_len = None
        if models.status_code == 200 and models.json().get("data"):
            card = models.json()["data"][0]
            target.model = target.model or card.get("id")
            max_model_len = card.get("max_model_len")
        elif models.status_code in (401, 403):
            raise TargetError(f"the server refused tenant A's key ({models.status_code})")
        notes = await _tenant_check(session)
        findings = []
        for name in tqdm(names, desc="audit", unit="probe", leave=False, disable=not options.progress):
            try:
                findings.append(await _run_probe(session, name, options, max_model_len))
            except BudgetExceeded as exc:
                notes.append(f"probe {name} skipped: {exc}")
        return findings, notes, session.sent


# ---- mitigations on a launched pagoda ---------------------------------------------------------


def _keys_file_tenants(args: list[str]) -> tuple[dict[str, Any] | None, int | None]:
    """The launch's --api-keys file content (as a {name: spec} mapping) and its arg index."""
    for i, arg in enumerate(args):
        if arg == "--api-keys" and i + 1 < len(args):
            import yaml

            data = yaml.safe_load(Path(args[i + 1]).read_text())
            entries = data["tenants"]
            if isinstance(entries, list):
                entries = {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in entries}
            return {name: dict(spec or {}) for name, spec in entries.items()}, i
    return None, None


def mitigated_launch(
    args: list[str], probe: str, keys: dict[str, str | None], workdir: Path
) -> tuple[list[str], dict[str, str | None]] | None:
    """pagoda serve ARGS with the probe's mitigation applied, and the keys to use then;
    None when pagoda has no mitigation the audit can apply for this probe."""
    if probe == "stream":
        return None
    if probe == "length":
        return [a for a in _without_flag(args, "--max-num-batched-tokens")] + [
            "--max-num-batched-tokens",
            "32",
            "--enable-chunked-prefill",
        ], keys
    tenants, index = _keys_file_tenants(args)
    new_keys = dict(keys)
    if tenants is None:  # open server or one --api-key: give A and B tenants of their own
        args = _without_flag(args, "--api-key")
        new_keys = {"a": keys["a"] or AUDIT_KEYS["a"], "b": keys["b"] or AUDIT_KEYS["b"]}
        if new_keys["a"] == new_keys["b"]:
            new_keys = dict(AUDIT_KEYS)
        tenants = {"audit-a": {"api_keys": [new_keys["a"]]}, "audit-b": {"api_keys": [new_keys["b"]]}}
    else:
        args = _without_flag(args, "--api-keys")
    if probe == "cache":
        for spec in tenants.values():
            spec.pop("cache_scope", None)
    if probe == "queue":
        for spec in tenants.values():
            if new_keys["a"] in (spec.get("api_keys") or []) or spec.get("api_key") == new_keys["a"]:
                spec["max_concurrent_requests"] = 1
    path = workdir / f"tenants-{probe}.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return [*args, "--api-keys", str(path)], new_keys


def _redacted(tenants: dict[str, Any], keys: dict[str, str | None]) -> dict[str, Any]:
    """Tenants as the report shows them: API keys replaced by which seat they are."""
    names = {key: f"<key-{seat}>" for seat, key in keys.items() if key}
    result = {}
    for name, spec in tenants.items():
        spec = dict(spec)
        for field in ("api_keys", "api_key"):
            if field in spec:
                values = spec[field] if isinstance(spec[field], list) else [spec[field]]
                spec[field] = [names.get(v, "<other key>") for v in values]
        result[name] = spec
    return result


def _without_flag(args: list[str], flag: str) -> list[str]:
    result, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == flag:
            skip = True
            continue
        if arg.startswith(flag + "="):
            continue
        result.append(arg)
    return result


def run_audit(parsed: Target | list[str], options: AuditOptions) -> dict[str, Any]:
    """Audit a URL (Target) or a pagoda launched from ARGS; returns the report as JSON data."""
    start = time.monotonic()
    keys = {"a": options.key_a, "b": options.key_b}
    launched = None
    launch_args: list[str] = []
    if isinstance(parsed, Target):
        target = parsed
    else:
        launch_args = parsed
        launched = launch_pagoda(parsed, "audit", api_key=options.key_a, timeout=options.launch_timeout)
        target = launched.target
    target.model = options.model
    try:
        findings, notes, sent = asyncio.run(_probe_all(target, options, options.probes, keys))
    finally:
        if launched is not None:
            launched.stop()
    if launched is None:
        notes.append(
            "mitigations were not re-run: the audit can apply them only to a pagoda it launches itself (pagoda:ARGS)"
        )
    elif options.rerun:
        with tempfile.TemporaryDirectory(prefix="pagoda-audit-") as workdir:
            for finding in findings:
                if finding.severity == "none":
                    continue
                plan = mitigated_launch(list(launch_args), finding.probe, keys, Path(workdir))
                if plan is None:
                    continue
                args, new_keys = plan
                budget = max(0, options.budget - sent)
                rerun_options = AuditOptions(**{**options.__dict__, "budget": budget})
                server = launch_pagoda(args, "audit-mitigated", timeout=options.launch_timeout)
                server.target.model = options.model
                try:
                    again, rerun_notes, used = asyncio.run(
                        _probe_all(server.target, rerun_options, (finding.probe,), new_keys)
                    )
                finally:
                    server.stop()
                sent += used
                notes += [f"re-run of {finding.probe}: {n}" for n in rerun_notes]
                if again:
                    finding.rerun = {"launch": "pagoda serve " + shlex.join(args), **again[0].to_json()}
                    tenants = _keys_file_tenants(args)[0]
                    if tenants is not None:  # the temporary file goes; its content stays
                        finding.rerun["tenants"] = _redacted(tenants, new_keys)
                    finding.rerun.pop("rerun", None)
                    finding.rerun.pop("mitigation", None)
    return {
        "kind": "pagoda-audit-report",
        "version": 1,
        "target": target.describe()
        | ({"launched": "pagoda serve " + shlex.join(launch_args)} if launched is not None else {}),
        "requests_sent": sent,
        "duration_s": round(time.monotonic() - start, 2),
        "notes": notes,
        "findings": [f.to_json() for f in findings],
    }
