"""`pagoda bench soak`: mixed traffic against a DP=2 server with tenants while a chaos thread
SIGKILLs a replica's engine on a schedule and fills the disk KV tier; then the invariants, each
with its verdict and evidence (JSON + Markdown), and a non-zero exit when one fails.

The invariants:
- no 5xx (nor a dropped connection, nor a stream's error event) except `engine_dead` inside a
  kill's window (from the kill until the replica served again, plus a grace), and no more of those
  than requests were in flight;
- every killed replica back (alive, status ok, a new pid) within the recovery bound;
- once traffic stops and the server drains: nothing running, waiting or swapped, no KV block in
  use on any replica, the router's accounts at zero (cached prefix copies in the host and disk
  tiers are evictable, not held: reported, not asserted);
- the server process's RSS grew less than the bound from after the warm-up to after the drain;
- /health p99 (measured from its own process, every 100 ms, throughout) under the bound;
- every refusal and error the clients saw counted in /metrics under its reason
  (`request_rejected_total{reason}`), client disconnects as aborts, and every finished sequence
  as a success.

By default it starts `pagoda serve` itself (the bundled model, `--data-parallel-size 2`, an
`--api-keys` file with three tenants, a host KV tier and a disk tier on a small tmpfs it mounts
when it may, else a plain directory filled up to the tier's size); `--url` soaks a running one.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagoda.bench.server_metrics import parse_labeled
from pagoda.bench.soak_chaos import ChaosPlan, ChaosThread, HealthProber, engines_of, rss_bytes
from pagoda.bench.soak_traffic import UNREAD_413, SoakTraffic, Tally, TrafficPlan
from pagoda.config import DEFAULT_MODEL_DIR, parse_bytes
from pagoda.http_client.server_process import free_port, start_server, stop_server
from pagoda.stats import percentile

TENANT_KEYS = {"alpha": "soak-key-alpha", "beta": "soak-key-beta"}
LIMITED_TENANT = ("gamma", "soak-key-gamma", 20)  # name, key, requests per minute
ENGINE_DEAD_GRACE_S = 10.0  # after a replica is back, streams it failed may still be reporting
DISK_FULL_WARNING = "no space left in"


@dataclass
class SoakOptions:
    """What to soak and the bounds each verdict holds to."""

    model: str | None = None  # model directory of the server started here (default: the bundled one)
    url: str | None = None  # soak this running server instead of starting one
    api_key: str | None = None  # with --url: the key to send (default: none)
    server_pid: int | None = None  # with --url: the server's pid, for its RSS
    disk_dir: str | None = None  # with --url: its disk tier's directory, to fill
    duration: float = 600.0
    kill_every: float = 120.0
    out: str | None = None
    seed: int = 0
    chat_streams: int = 4
    tmpfs_size: str = "16MiB"
    disk_size: str = "4MiB"
    max_request_bytes: int = 1 << 20
    serve_args: list[str] = field(default_factory=list)  # more `pagoda serve` flags
    health_p99_ms: float = 50.0
    rss_growth_mb: float = 200.0
    recovery_s: float = 30.0
    fill_at: float | None = None  # seconds into the soak the disk tier is filled (default: kill_every / 2)
    fill_for: float | None = None  # seconds it stays full (default: kill_every)
    drain_s: float = 60.0
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.duration <= 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration}")
        if self.kill_every <= 0:
            raise ValueError(f"--kill-every must be > 0 seconds, got {self.kill_every}")
        if self.kill_every >= self.duration:
            raise ValueError(
                f"--kill-every ({self.kill_every:g}s) must be shorter than --duration "
                f"({self.duration:g}s), or nothing is killed"
            )
        if self.url is None and (self.server_pid is not None or self.disk_dir is not None):
            raise ValueError("--server-pid and --disk-dir describe a server given by --url")


@dataclass
class Verdict:
    name: str
    passed: bool | None  # None: not evaluated (what it needs is missing), with the reason in evidence
    bound: str
    value: str
    evidence: str = ""


@dataclass
class ServerUnderTest:
    url: str
    process: subprocess.Popen | None
    pid: int | None
    headers: dict[str, str]
    keys: tuple[str, ...]
    limited_key: str | None
    disk_dir: str | None
    fill_limit_bytes: int | None
    disk_skip_reason: str | None
    log_path: Path | None
    mounted: Path | None = None
    tmpfs_problem: str | None = None  # why the disk tier is on a plain directory (filled to its size)


def _keys_file(directory: Path) -> Path:
    name, key, rpm = LIMITED_TENANT
    tenants: dict[str, dict[str, Any]] = {tenant: {"api_keys": [k]} for tenant, k in TENANT_KEYS.items()}
    tenants[name] = {"api_keys": [key], "requests_per_minute": rpm}
    path = directory / "tenants.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def _mount_tmpfs(directory: Path, size_bytes: int) -> str | None:
    """Mount a tmpfs of `size_bytes` on `directory`; the reason it failed, else None."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={max(1, size_bytes // 1024)}k", "tmpfs", str(directory)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"mount failed: {e}"
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip() or done.returncode}"


def _start(options: SoakOptions, workdir: Path, out: Path) -> ServerUnderTest:
    if options.url is not None:
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        return ServerUnderTest(
            url=options.url.rstrip("/").removesuffix("/v1"),
            process=None,
            pid=options.server_pid,
            headers=headers,
            keys=(options.api_key,) if options.api_key else (),
            limited_key=None,
            disk_dir=options.disk_dir,
            fill_limit_bytes=parse_bytes(options.disk_size) if options.disk_dir else None,
            disk_skip_reason=None if options.disk_dir else "no --disk-dir given with --url",
            log_path=None,
        )
    disk = workdir / "disk-tier"
    mount_problem = _mount_tmpfs(disk, parse_bytes(options.tmpfs_size))
    if mount_problem is not None:
        print(
            f"pagoda bench soak: no tmpfs for the disk tier ({mount_problem}); it is filled up to "
            f"--disk-size instead, and ENOSPC is not guaranteed",
            file=sys.stderr,
        )
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "pagoda.cli",
        "serve",
        "--model",
        options.model or str(DEFAULT_MODEL_DIR),
        "--port",
        str(port),
        "--data-parallel-size",
        "2",
        "--api-keys",
        str(_keys_file(workdir)),
        "--max-request-bytes",
        str(options.max_request_bytes),
        "--num-threads",
        "1",
        "--num-kv-blocks",
        "160",
        "--max-num-seqs",
        "8",
        "--kv-offload-memory",
        "2MiB",
        "--kv-offload-disk",
        str(disk / "kv"),
        "--kv-offload-disk-size",
        options.disk_size,
        # Enough restarts for every kill of the run, so none stays down for want of budget.
        "--max-replica-restarts",
        str(int(options.duration // options.kill_every) + 2),
        *options.serve_args,
    ]
    log_path = out / "server.log"
    process = start_server(
        command,
        f"http://127.0.0.1:{port}/health",
        timeout=options.startup_timeout_s,
        log_path=log_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        name="pagoda serve",
    )
    first = next(iter(TENANT_KEYS.values()))
    return ServerUnderTest(
        url=f"http://127.0.0.1:{port}",
        process=process,
        pid=process.pid,
        headers={"Authorization": f"Bearer {first}"},
        keys=tuple(TENANT_KEYS.values()),
        limited_key=LIMITED_TENANT[1],
        disk_dir=str(disk),
        fill_limit_bytes=None if mount_problem is None else parse_bytes(options.disk_size),
        disk_skip_reason=None,
        log_path=log_path,
        mounted=None if mount_problem else disk,
        tmpfs_problem=mount_problem,
    )


def _long_prompt(client: httpx.Client, model: str, target_tokens: int) -> str:
    """Text of about `target_tokens` tokens (measured with the server's /tokenize)."""
    sample = " ".join(["river engine garden signal market"] * 20)
    response = client.post("/tokenize", json={"model": model, "prompt": sample})
    response.raise_for_status()
    per_copy = response.json()["count"] / 20
    copies = max(1, int(target_tokens / max(per_copy, 1e-6)))
    return " ".join(["river engine garden signal market"] * copies)


def _scrape(client: httpx.Client) -> dict[tuple[str, frozenset], float]:
    return parse_labeled(client.get("/metrics").text)


def _by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    """`name`'s samples summed by one label's values."""
    out: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def _per_replica(samples: dict, name: str) -> dict[str, float]:
    return _by_label(samples, name, "replica")


def _idle_state(client: httpx.Client) -> dict[str, Any]:
    samples = _scrape(client)
    health = client.get("/health").json()
    tiers: dict[str, dict[str, float]] = {}
    for (sample, labels), value in samples.items():
        if sample == "pagoda:kv_offload_usage_perc":
            label = dict(labels)
            tiers.setdefault(label.get("replica", ""), {})[label.get("tier", "")] = value
    return {
        "running": _per_replica(samples, "pagoda:num_requests_running"),
        "waiting": _per_replica(samples, "pagoda:num_requests_waiting"),
        "swapped": _per_replica(samples, "pagoda:num_requests_swapped"),
        "kv_cache_usage": _per_replica(samples, "pagoda:kv_cache_usage_perc"),
        "offload_usage": tiers,
        "router": {
            str(r["replica"]): {
                "requests": r.get("requests"),
                "outstanding_tokens": r.get("outstanding_tokens"),
                "alive": r.get("alive"),
            }
            for r in health.get("replicas") or []
        },
    }


def _is_idle(state: dict[str, Any]) -> bool:
    held = [v for key in ("running", "waiting", "swapped", "kv_cache_usage") for v in state[key].values()]
    router = state["router"].values()
    return (
        bool(state["running"])
        and not any(held)
        and all(r["alive"] and not r["requests"] and not r["outstanding_tokens"] for r in router)
    )


def _engine_rss(client: httpx.Client) -> dict[str, int | None]:
    replicas = engines_of(client.get("/health").json())
    return {
        f"replica {r['replica']} (pid {r.get('pid')})": rss_bytes(r["pid"]) if r.get("pid") else None for r in replicas
    }


def _warm_up(client: httpx.Client, model: str) -> None:
    for body in ({"prompt": "warm up", "max_tokens": 4}, {"prompt": "warm up again", "max_tokens": 4, "n": 2}):
        for _ in range(2):  # both replicas, whatever the router does
            client.post("/v1/completions", json={"model": model, **body}).raise_for_status()


def run_soak(options: SoakOptions) -> dict[str, Any]:
    """Run the soak; returns the report (also written under `options.out` when given)."""
    workdir = Path(tempfile.mkdtemp(prefix="pagoda-soak-"))
    out = Path(options.out) if options.out else workdir
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    server = None
    try:
        server = _start(options, workdir, out)
        report = _soak(options, server)
    finally:
        if server is not None and server.process is not None:
            stop_server(server.process)
        # Unmounted whether or not the server started (a failed start leaves its mount too).
        subprocess.run(["umount", str(workdir / "disk-tier")], capture_output=True, timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    report["machine"] = {
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        **report.get("machine", {}),
    }
    if server.log_path is not None and server.log_path.exists():
        log = server.log_path.read_text(errors="replace")
        report["server_log"] = {
            "disk_full_warnings": log.count(DISK_FULL_WARNING),
            "tracebacks": log.count("Traceback (most recent call last)"),
            "path": str(server.log_path),
        }
    report["verdicts"] = [asdict(v) for v in _verdicts(options, report)]
    report["passed"] = all(v["passed"] is not False for v in report["verdicts"])
    notes = report["outcomes_of_note"]  # the first ones are evidence enough for the file
    report["outcomes_of_note"], report["outcomes_of_note_total"] = notes[:200], len(notes)
    if options.out:
        (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "soak.md").write_text(render_markdown(report))
    return report


def _soak(options: SoakOptions, server: ServerUnderTest) -> dict[str, Any]:
    with httpx.Client(base_url=server.url, timeout=60.0, trust_env=False, headers=server.headers) as client:
        models = client.get("/v1/models")
        models.raise_for_status()
        card = models.json()["data"][0]
        model, max_model_len = card["id"], card.get("max_model_len") or 1024
        long_prompt = _long_prompt(client, model, int(max_model_len * 0.6))
        _warm_up(client, model)
        metrics_before = _scrape(client)
        server_rss_before = rss_bytes(server.pid) if server.pid else None
        engines_before = _engine_rss(client)

        # By default the disk fills halfway to the first kill and stays full over it.
        fill_at = options.fill_at if options.fill_at is not None else options.kill_every / 2
        fill_for = options.fill_for if options.fill_for is not None else options.kill_every
        prober = HealthProber(server.url)
        started = time.monotonic()
        chaos = ChaosThread(
            ChaosPlan(
                url=server.url,
                kill_every_s=options.kill_every,
                duration_s=options.duration,
                recovery_wait_s=max(60.0, 2 * options.recovery_s),
                disk_dir=server.disk_dir,
                fill_limit_bytes=server.fill_limit_bytes,
                fill_at_s=fill_at,
                fill_for_s=fill_for,
                headers=server.headers,
            ),
            started,
        )
        tally = Tally(started=started)
        plan = TrafficPlan(
            model=model,
            keys=server.keys,
            limited_key=server.limited_key,
            max_request_bytes=options.max_request_bytes,
            long_prompt=long_prompt,
            chat_streams=options.chat_streams,
            seed=options.seed,
        )
        chaos.start()
        try:
            asyncio.run(_drive(SoakTraffic(server.url, plan, tally), options.duration))
        except BaseException:
            chaos.finish()
            prober.stop()
            raise
        traffic_s = time.monotonic() - started
        chaos.finish()
        chaos.join(chaos.plan.recovery_wait_s + 10)

        drain_started = time.monotonic()
        state = _idle_state(client)
        while not _is_idle(state) and time.monotonic() - drain_started < options.drain_s:
            time.sleep(0.25)
            state = _idle_state(client)
        drain_s = time.monotonic() - drain_started
        health = prober.stop()
        disk_files = _disk_files(server.disk_dir)
        metrics_after = _scrape(client)
        server_rss_after = rss_bytes(server.pid) if server.pid else None
        engines_after = _engine_rss(client)

    latencies = [latency for _, latency, _ in health]
    return {
        "options": asdict(options),
        "model": model,
        "traffic_s": round(traffic_s, 1),
        "machine": {"load_average_samples": chaos.load_samples},
        "traffic": tally.by_class(),
        "finished_requests": tally.finished_requests,
        "outcomes_of_note": [asdict(o) for o in tally.outcomes if o.server_error],
        "kills": [asdict(k) for k in chaos.kills],
        "disk_fills": [asdict(f) for f in chaos.fills],
        "disk_fill_skipped": server.disk_skip_reason,
        "disk_tier": {
            "directory": server.disk_dir,
            "tmpfs": server.mounted is not None,
            "tmpfs_problem": server.tmpfs_problem,
            "files_when_idle": disk_files,
        },
        "served_during_fill": [
            sum(
                1
                for o in tally.outcomes
                if o.status == 200 and o.code is None and f.at_s <= o.at_s <= (f.freed_at_s or o.at_s)
            )
            for f in chaos.fills
        ],
        "chaos_errors": chaos.errors,
        "health": {
            "samples": len(health),
            "p50_ms": _ms(percentile(latencies, 50)),
            "p99_ms": _ms(percentile(latencies, 99)),
            "max_ms": _ms(max(latencies, default=None)),
            "statuses": _count(str(status) for _, _, status in health),
            "slowest": [
                {"at_s": t, "ms": _ms(lat), "status": s} for t, lat, s in sorted(health, key=lambda h: -h[1])[:5]
            ],
        },
        "rss": {
            "server_before": server_rss_before,
            "server_after": server_rss_after,
            "engines_before": engines_before,
            "engines_after": engines_after,
        },
        "idle": {"after_s": round(drain_s, 1), "idle": _is_idle(state), "state": state},
        "metrics_delta": _metrics_delta(metrics_before, metrics_after),
        "client_counts": _client_counts(tally),
    }


def _disk_files(directory: str | None) -> dict[str, int] | None:
    """Block files under the disk tier's directory, and their bytes."""
    if directory is None:
        return None
    files = [p for p in Path(directory).rglob("*.kv") if p.is_file()]
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


async def _drive(traffic: SoakTraffic, duration_s: float) -> None:
    stop = asyncio.Event()
    task = asyncio.ensure_future(traffic.run(stop))
    await asyncio.sleep(duration_s)
    stop.set()
    await task


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _count(items: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def _metrics_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    out = {}
    for name, label in (
        ("pagoda:request_rejected_total", "reason"),
        ("pagoda:request_success_total", "finished_reason"),
    ):
        b, a = _by_label(before, name, label), _by_label(after, name, label)
        out[name] = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in sorted(set(a) | set(b)) if a.get(k, 0.0) - b.get(k, 0.0)}
    b, a = _per_replica(before, "pagoda:replica_restarts_total"), _per_replica(after, "pagoda:replica_restarts_total")
    out["pagoda:replica_restarts_total"] = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in sorted(a)}
    return out


def _client_counts(tally: Tally) -> dict[str, int]:
    """What the clients saw, under the reasons /metrics counts them by."""
    return {
        "too_large": tally.count(413) + tally.count(0, UNREAD_413),
        "invalid_request": tally.count(400),
        "unauthorized": tally.count(401),
        "rate_limited": tally.count(429),
        "overloaded": tally.count(503, "overloaded"),
        "too_large_unread": tally.count(0, UNREAD_413),
        "engine_dead": tally.count(code="engine_dead"),
        "abort": tally.count(code="disconnect"),
        "finished": tally.finished_requests,
    }


def _verdicts(options: SoakOptions, report: dict[str, Any]) -> list[Verdict]:
    kills = report["kills"]
    machine = report["machine"]
    busy = max([load for _, load in machine.get("load_average_samples", [])] or [0.0])
    load_note = f"machine load average up to {busy:.1f} on {machine['cpus']} cores during the run"
    verdicts = []

    # 1. No 5xx but engine_dead inside a kill's window.
    windows = [
        (k["at_s"], k["at_s"] + (k["recovered_after_s"] or options.recovery_s) + ENGINE_DEAD_GRACE_S) for k in kills
    ]
    notes = report["outcomes_of_note"]
    excused = [o for o in notes if o["code"] == "engine_dead" and any(a <= o["at_s"] <= b for a, b in windows)]
    unexcused = [o for o in notes if o not in excused]
    verdicts.append(
        Verdict(
            "no 5xx except engine_dead on a killed replica",
            not unexcused,
            "0 outside kill windows",
            f"{len(unexcused)} ({len(excused)} engine_dead inside kill windows)",
            "; ".join(f"{o['traffic']} {o['status']} {o['code']} at {o['at_s']:.1f}s" for o in unexcused[:10]),
        )
    )

    # 2. Every replica back in time.
    late = [k for k in kills if k["recovered_after_s"] is None or k["recovered_after_s"] > options.recovery_s]
    expected_kills = sum(
        1
        for k in range(1, int(options.duration // options.kill_every) + 1)
        if k * options.kill_every < options.duration
    )
    recoveries = [k["recovered_after_s"] for k in kills]
    verdicts.append(
        Verdict(
            "every killed replica back",
            not late and len(kills) == expected_kills,
            f"{expected_kills} kills, each back < {options.recovery_s:g} s",
            f"{len(kills)} kills, back after {recoveries} s",
            "; ".join(
                [f"replica {k['replica']} pid {k['pid']} -> {k['new_pid']}" for k in kills] + report["chaos_errors"]
            ),
        )
    )

    # 3. Nothing held once idle.
    idle = report["idle"]
    verdicts.append(
        Verdict(
            "zero KV blocks held when idle",
            idle["idle"],
            "0 running/waiting/swapped, kv_cache_usage 0, router at 0",
            f"idle after {idle['after_s']} s" if idle["idle"] else f"not idle after {idle['after_s']} s",
            json.dumps({k: idle["state"][k] for k in ("running", "waiting", "swapped", "kv_cache_usage", "router")})
            + f"; tiers (cached copies, evictable): {json.dumps(idle['state']['offload_usage'])}",
        )
    )

    # 4. Server RSS.
    rss = report["rss"]
    if rss["server_before"] is None or rss["server_after"] is None:
        verdicts.append(
            Verdict(
                "server RSS growth",
                None,
                f"< {options.rss_growth_mb:g} MB",
                "n/a",
                "no server pid (give --server-pid with --url)",
            )
        )
    else:
        growth = (rss["server_after"] - rss["server_before"]) / 1e6
        verdicts.append(
            Verdict(
                "server RSS growth",
                growth < options.rss_growth_mb,
                f"< {options.rss_growth_mb:g} MB",
                f"{growth:+.1f} MB",
                f"{rss['server_before'] / 1e6:.1f} -> {rss['server_after'] / 1e6:.1f} MB; engines "
                f"{_mb(rss['engines_before'])} -> {_mb(rss['engines_after'])}",
            )
        )

    # 5. /health p99.
    health = report["health"]
    p99 = health["p99_ms"]
    statuses = health["statuses"]
    ok = p99 is not None and p99 < options.health_p99_ms and set(statuses) <= {"200"}
    verdicts.append(
        Verdict(
            "/health p99 throughout",
            ok,
            f"< {options.health_p99_ms:g} ms, always 200",
            f"p99 {p99} ms (p50 {health['p50_ms']}, max {health['max_ms']})",
            f"{health['samples']} probes, statuses {statuses}" + ("" if ok else f"; {load_note}"),
        )
    )

    # 6. Errors counted under the right reason.
    rejected = report["metrics_delta"]["pagoda:request_rejected_total"]
    success = report["metrics_delta"]["pagoda:request_success_total"]
    client = report["client_counts"]
    mismatches = [
        f"{reason}: clients {client[reason]}, /metrics {rejected.get(reason, 0):g}"
        for reason in ("too_large", "invalid_request", "unauthorized", "rate_limited", "overloaded", "engine_dead")
        if client[reason] != rejected.get(reason, 0)
    ]
    unknown = sorted(
        set(rejected) - {"too_large", "invalid_request", "unauthorized", "rate_limited", "overloaded", "engine_dead"}
    )
    mismatches += [f"{reason}: /metrics {rejected[reason]:g}, no client saw it" for reason in unknown]
    # A disconnect racing a kill may end as engine_dead instead of an abort.
    if abs(success.get("abort", 0) - client["abort"]) > len(kills):
        mismatches.append(f"abort: clients {client['abort']} disconnects, /metrics {success.get('abort', 0):g}")
    finished = sum(v for k, v in success.items() if k not in ("abort",))
    if finished != client["finished"]:
        mismatches.append(f"finished requests: clients {client['finished']}, /metrics {finished:g}")
    verdicts.append(
        Verdict(
            "every error counted in /metrics under its reason",
            not mismatches,
            "client counts == /metrics deltas",
            f"{len(mismatches)} mismatches",
            "; ".join(mismatches) or json.dumps({"rejected": rejected, "success": success}),
        )
    )

    # 7. The disk tier filled, and the server kept serving.
    fills = report["disk_fills"]
    if not fills:
        verdicts.append(
            Verdict(
                "disk tier filled, server kept serving",
                None,
                "filled, 200s meanwhile",
                "not filled",
                report.get("disk_fill_skipped") or "the run ended before the fill",
            )
        )
    else:
        fill = fills[-1]
        log = report.get("server_log", {})
        warnings = log.get("disk_full_warnings")
        # Two replicas, each warning once per full-disk condition.
        quiet = warnings is None or warnings <= 2 * len(fills)
        served = report["served_during_fill"][-1]
        verdicts.append(
            Verdict(
                "disk tier filled, server kept serving",
                fill["error"] is None and quiet and served > 0,
                "filler written, 200s while full, freed; <= 1 full-disk warning per replica",
                f"{fill['bytes_written'] / 1e6:.1f} MB filler, "
                f"ENOSPC {'reached' if fill['reached_enospc'] else 'not reached'}",
                f"filled at {fill['at_s']} s, freed at {fill['freed_at_s']} s, {served} requests served while full; "
                f"full-disk warnings in the log: {warnings}; block files left once idle: "
                f"{report['disk_tier']['files_when_idle']}" + (f"; {fill['error']}" if fill["error"] else ""),
            )
        )
    return verdicts


def _mb(by_engine: dict[str, int | None]) -> str:
    return "[" + ", ".join(f"{v / 1e6:.0f}" if v else "gone" for v in by_engine.values()) + "] MB"


def render_markdown(report: dict[str, Any]) -> str:
    options = report["options"]
    machine = report["machine"]
    lines = [
        f"# pagoda bench soak: {'PASS' if report['passed'] else 'FAIL'}",
        "",
        f"{options['duration']:g} s of mixed traffic against `{report['model']}` "
        f"({'--url ' + options['url'] if options['url'] else 'DP=2, three tenants, host + disk KV tiers'}), "
        f"a replica SIGKILLed every {options['kill_every']:g} s.",
        f"Machine: {machine['cpus']} cores; load average before {_loads(machine['load_average_before'])}, "
        f"after {_loads(machine['load_average_after'])}, highest 1-minute sample during the run "
        f"{max([x for _, x in machine.get('load_average_samples', [])] or [0]):.2f}.",
        "",
        "| invariant | verdict | bound | measured | evidence |",
        "|---|---|---|---|---|",
    ]
    for v in report["verdicts"]:
        verdict = {True: "pass", False: "**FAIL**", None: "not evaluated"}[v["passed"]]
        evidence = v["evidence"].replace("|", "\\|")
        lines.append(f"| {v['name']} | {verdict} | {v['bound']} | {v['value']} | {evidence} |")
    lines += ["", "## Traffic (status [code]: count)", "", "| class | outcomes |", "|---|---|"]
    lines += [
        f"| {name} | {', '.join(f'{k}: {n}' for k, n in counts.items())} |"
        for name, counts in report["traffic"].items()
    ]
    lines += [
        "",
        f"Finished requests (one per prompt, whatever its n): {report['finished_requests']}.",
        "",
        "## Kills",
        "",
        "| at (s) | replica | pid | back after (s) | new pid |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {k['at_s']:.1f} | {k['replica']} | {k['pid']} | {k['recovered_after_s']} | {k['new_pid']} |"
        for k in report["kills"]
    ]
    disk = report["disk_tier"]
    lines += [
        "",
        "## Disk tier",
        "",
        f"{'A tmpfs' if disk['tmpfs'] else 'A plain directory'} at {disk['directory']}"
        + (f" ({disk['tmpfs_problem']})" if disk["tmpfs_problem"] else "")
        + "; "
        + (
            "; ".join(
                f"filled at {f['at_s']} s with {f['bytes_written'] / 1e6:.1f} MB "
                f"({'ENOSPC' if f['reached_enospc'] else 'no ENOSPC'}), freed at {f['freed_at_s']} s"
                for f in report["disk_fills"]
            )
            or f"not filled: {report['disk_fill_skipped']}"
        )
        + f"; block files once idle: {disk['files_when_idle']}.",
    ]
    health = report["health"]
    lines += [
        "",
        "## /health",
        "",
        f"{health['samples']} probes: p50 {health['p50_ms']} ms, p99 {health['p99_ms']} ms, "
        f"max {health['max_ms']} ms; slowest: "
        + ", ".join(f"{s['ms']} ms at {s['at_s']:.1f} s" for s in health["slowest"]),
        "",
        "## /metrics deltas",
        "",
        "```",
        json.dumps(report["metrics_delta"], indent=1),
        "```",
        "",
    ]
    return "\n".join(lines)


def _loads(loads: Any) -> str:
    return "/".join(f"{x:.2f}" for x in loads)


def soak_main(options: SoakOptions) -> int:
    """Run, print the Markdown, exit 0 when every evaluated verdict passed, else 1."""
    report = run_soak(options)
    print(render_markdown(report))
    return 0 if report["passed"] else 1


def parse_serve_args(text: str | None) -> list[str]:
    return shlex.split(text) if text else []
