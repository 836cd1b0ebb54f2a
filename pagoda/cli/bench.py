"""`pagoda bench serve | offline | compare`: flags, turned into the bench/options.py dataclasses.

Heavy imports (transformers, torch, matplotlib, httpx) happen inside the run functions so that
`pagoda --help` stays fast.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from pagoda.bench.lengths import LENGTH_SPEC_HELP
from pagoda.bench.options import (
    DEFAULT_NUM_REQUESTS,
    CompareBenchOptions,
    OfflineBenchOptions,
    ReportOptions,
    ServeBenchOptions,
    WorkloadOptions,
    parse_json_arg,
)
from pagoda.cli.options import options_from_args
from pagoda.config import EngineConfig

MIX_HELP = (
    "request classes and weights, e.g. chat=0.6,rag=0.3,summarize=0.1. Classes: chat (short in, short "
    "out), rag (a few shared documents + a question: prefix-cache friendly), summarize (long in, long "
    "out), agent (multi-turn sessions resending the conversation + a tool result), file:PATH.jsonl "
    "(lines with prompt, messages or prompt_len, and optional output_len, class). Default: chat"
)


def add_workload_args(parser: argparse.ArgumentParser, *, with_engine_flags: bool = False) -> None:
    """Workload flags; with_engine_flags: --tokenizer, --max-model-len and --seed come from EngineConfig."""
    group = parser.add_argument_group("workload")
    if not with_engine_flags:
        group.add_argument(
            "--tokenizer",
            default=None,
            help="local tokenizer directory; lengths are exact token counts for it"
            + (
                " (default: the served model's directory, from /v1/models)"
                if parser.prog.endswith("serve")
                else " (default: --model)"
            ),
        )
    group.add_argument("--mix", default="chat", help=MIX_HELP)
    group.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="CLASS.FIELD=LENGTH",
        help=f"override a class's lengths (repeatable); LENGTH is {LENGTH_SPEC_HELP}. "
        "Fields: chat/summarize: prompt, output; rag: doc, docs, question, output; "
        "agent: prompt, tool, output, turns, sessions",
    )
    group.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiply every default token length (e.g. 0.1 for a tiny model)",
    )
    group.add_argument("--num-requests", type=int, default=None, help="requests to send (default 100)")
    if not with_engine_flags:
        group.add_argument(
            "--max-model-len", type=int, default=None, help="cap prompt + output to the target's context length"
        )
        group.add_argument("--seed", type=int, default=0, help="seed of every length, prompt and arrival draw")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmark a server, the engine, or several targets",
        description="Benchmarks with request classes that mirror real traffic.",
    )
    sub = bench.add_subparsers(
        dest="bench_command",
        metavar="{serve,offline,compare,route-sim,oom-lab,shootout,soak,canary-drill}",
        required=True,
    )

    serve = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server over HTTP (streaming)",
        description="Drive any OpenAI-compatible server (pagoda, vLLM, llama-server) with "
        "streaming requests; report TTFT, ITL, TPOT, latency, throughput, "
        "goodput and the server's own counters.",
    )
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (with or without /v1)")
    serve.add_argument("--model", required=True, help="model name to send in each request")
    serve.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    add_workload_args(serve)
    arrivals = serve.add_argument_group("arrivals")
    arrivals.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="open loop: mean requests per second (default inf: all at once, or closed "
        "loop when --concurrency is given)",
    )
    arrivals.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier",
    )
    arrivals.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: this many clients; with --request-rate: the most in flight",
    )
    arrivals.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    arrivals.add_argument(
        "--sweep-concurrency",
        default=None,
        metavar="1,4,16,64",
        help="closed-loop runs at each concurrency; plots throughput and p99 vs concurrency",
    )
    serve.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (exact output lengths)")
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    serve.add_argument("--api-key", default=None, help="sent as a Bearer token")
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    serve.add_argument("--warmup", type=int, default=0, help="requests sent (and not measured) before the run")
    add_output_args(serve)
    serve.set_defaults(func=run_serve)

    offline = sub.add_parser(
        "offline",
        help="benchmark the engine in-process (pagoda.LLM), no HTTP",
        description="Every request arrives at once; the engine runs them to completion.",
    )
    add_workload_args(offline, with_engine_flags=True)
    offline.add_argument(
        "--static-batch",
        type=int,
        default=None,
        metavar="B",
        help="emulate static batching: run B requests at a time, each group to completion",
    )
    offline.add_argument("--warmup", type=int, default=2, help="requests run (and not measured) first")
    add_output_args(offline)
    EngineConfig.add_cli_args(offline)
    offline.set_defaults(func=run_offline)

    compare = sub.add_parser(
        "compare",
        help="run several targets on the same request list and print ratios",
        description="Targets run back to back on one request list; ratios are to the first.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_compare_epilog(),
    )
    compare.add_argument("--model", required=True, help="model directory for the in-process targets")
    compare.add_argument("--target", action="append", required=True, metavar="SPEC", help="repeatable; see below")
    add_workload_args(compare)
    compare.add_argument("--num-threads", type=int, default=None, help="torch threads for in-process targets")
    compare.add_argument("--concurrency", type=int, default=None, help="HTTP targets: closed-loop clients")
    compare.add_argument("--request-rate", type=float, default=math.inf, help="HTTP targets: open-loop rate")
    compare.add_argument("--warmup", type=int, default=2, help="requests run (and not measured) per target")
    add_output_args(compare)
    compare.set_defaults(func=run_compare)
    _add_route_sim_parser(sub)
    _add_oom_lab_parser(sub)
    _add_shootout_parser(sub)
    _add_soak_parser(sub)
    _add_canary_drill_parser(sub)


def _add_route_sim_parser(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser(
        "route-sim",
        help="simulate the replica router at fleet scale (N = 2..64 replicas)",
        description="Replay a trace against N simulated replicas (continuous batching, an LRU prefix "
        "cache, step times from a cost model fitted to the real engine) once per router "
        "policy; report prefix hit rate, load imbalance (max/mean outstanding tokens) and "
        "TTFT. The router is the server's own (--router).",
    )
    sim.add_argument(
        "--trace",
        default="chat",
        help="chat (multi-tenant, shared system prompts, multi-turn), rag (per-tenant "
        "documents), or a JSON-lines file: generated traces, or the server's request "
        "log taken with --log-prompts (default: chat)",
    )
    sim.add_argument("--replicas", default="2,8,32,64", help="fleet sizes (default: 2,8,32,64)")
    sim.add_argument(
        "--policies",
        default="round_robin,least_load,cache_aware",
        help="router policies to compare (default: all three)",
    )
    sim.add_argument(
        "--requests-per-replica",
        type=int,
        default=150,
        help="generated traces: requests per replica (they scale with the fleet; default 150)",
    )
    sim.add_argument(
        "--rate-per-replica", type=float, default=2.0, help="mean arrivals per second per replica (Poisson; default 2)"
    )
    sim.add_argument(
        "--tenants-per-replica",
        type=int,
        default=None,
        help="generated traces: tenants per replica (default: 8 for chat, 2 for rag)",
    )
    sim.add_argument(
        "--cache-blocks",
        type=int,
        default=2048,
        help="prefix cache of each simulated replica, in blocks (default 2048)",
    )
    sim.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    sim.add_argument("--max-num-seqs", type=int, default=64, help="requests a replica runs at once (default 64)")
    sim.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget of a replica's step (default 2048)"
    )
    sim.add_argument(
        "--calibrate",
        default=None,
        metavar="MODEL",
        help="fit the step cost model to this model's engine on this machine first "
        "(default: the built-in fit for pagoda-coder on a 2-core CPU)",
    )
    sim.add_argument("--num-threads", type=int, default=1, help="torch threads while calibrating (default 1)")
    sim.add_argument("--tokenizer", default=None, help="tokenizer for a trace file's text prompts")
    sim.add_argument("--seed", type=int, default=0, help="seed of generated traces (default 0)")
    sim.add_argument("--out", default=None, help="directory for results.json")
    sim.set_defaults(func=run_route_sim)


def _int_list(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_oom_lab_parser(sub: argparse._SubParsersAction) -> None:
    lab = sub.add_parser(
        "oom-lab",
        help="step prompt x output x concurrency until preemption and refusal; compare with plan",
        description="Against a running pagoda server: for each prompt/output length, send 1, 2, ... "
        "concurrent requests until the server preempts, then until it refuses or times out, "
        "and report where, beside `pagoda plan`'s prediction for the same model and KV pool.",
    )
    lab.add_argument("url", help="the server's base URL")
    lab.add_argument("--model-dir", required=True, help="the served model's directory (plan reads config.json)")
    pool = lab.add_mutually_exclusive_group(required=True)
    pool.add_argument("--num-kv-blocks", type=int, default=None, help="the server's --num-kv-blocks")
    pool.add_argument("--kv-cache-memory", default=None, help="the server's --kv-cache-memory, e.g. 256KiB")
    lab.add_argument("--block-size", type=int, default=16, help="the server's --block-size (default 16)")
    lab.add_argument("--kv-dtype", default=None, help="KV dtype as plan names it (default: the config's)")
    lab.add_argument("--prompt-lens", type=_int_list, default=[256, 1024], help="comma-separated tokens")
    lab.add_argument("--output-lens", type=_int_list, default=[128], help="comma-separated tokens")
    lab.add_argument("--max-concurrency", type=int, default=32, help="highest concurrency stepped to")
    lab.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    lab.add_argument("--api-key", default=None)
    lab.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    lab.add_argument("--out", default=None, help="directory for oom_lab.json/.md/.png")
    lab.set_defaults(func=run_oom_lab_cli)


def run_oom_lab_cli(args: argparse.Namespace) -> int:
    from pagoda.ops.oom_lab import OomLabOptions, render_lab, run_oom_lab

    try:
        report = run_oom_lab(
            OomLabOptions(
                url=args.url,
                model_dir=args.model_dir,
                prompt_lens=args.prompt_lens,
                output_lens=args.output_lens,
                max_concurrency=args.max_concurrency,
                num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory=args.kv_cache_memory,
                block_size=args.block_size,
                kv_dtype=args.kv_dtype,
                model=args.model,
                api_key=args.api_key,
                timeout_s=args.timeout,
                out=args.out,
            )
        )
    except (ValueError, OSError) as e:
        return _fail("oom-lab", e)
    print(render_lab(report))
    return 0 if all(p.agrees is not False for p in report.points) else 1


def _add_shootout_parser(sub: argparse._SubParsersAction) -> None:
    shoot = sub.add_parser(
        "shootout",
        help="the same workload classes against several servers, side by side",
        description="Chat, RAG, summarisation and agent requests against several OpenAI-compatible servers "
        "(pagoda, vLLM, llama-server, SGLang) in rounds that alternate their order: TTFT/ITL/E2E "
        "percentiles, throughput, goodput under --slo, error rate, and greedy output agreement.",
    )
    shoot.add_argument("targets", nargs="+", metavar="[LABEL=]URL", help="the servers' base URLs")
    shoot.add_argument(
        "--model",
        action="append",
        default=[],
        help="model name per target, in order (repeatable; default: the first of each /v1/models)",
    )
    shoot.add_argument(
        "--tokenizer", default=None, help="local tokenizer directory (default: the first target's model directory)"
    )
    shoot.add_argument("--classes", default="chat,rag,summarize,agent", help="comma-separated classes")
    shoot.add_argument("--rounds", type=int, default=2, help="rounds, alternating the target order (default 2)")
    shoot.add_argument("--requests-per-class", type=int, default=8, help="per target, class and round")
    shoot.add_argument("--concurrency", type=int, default=4, help="closed-loop clients (default 4)")
    shoot.add_argument(
        "--length-scale",
        type=float,
        default=0.1,
        help="multiply the classes' default lengths (default 0.1, for small models)",
    )
    shoot.add_argument("--max-model-len", type=int, default=None, help="cap prompt + output")
    shoot.add_argument("--slo", default=None, help="goodput targets, e.g. ttft=0.5,itl=50ms")
    shoot.add_argument("--greedy-prompts", type=int, default=8, help="prompts compared at temperature 0")
    shoot.add_argument("--api-key", default=None)
    shoot.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    shoot.add_argument("--out", default=None, help="directory for shootout.json/.md and plots")
    shoot.set_defaults(func=run_shootout_cli)


def run_shootout_cli(args: argparse.Namespace) -> int:
    from pagoda.bench.report import parse_slo
    from pagoda.bench.shootout import ShootoutOptions, render_text, run_shootout

    try:
        options = ShootoutOptions(
            targets=args.targets,
            tokenizer=args.tokenizer,
            classes=[c.strip() for c in args.classes.split(",") if c.strip()],
            rounds=args.rounds,
            requests_per_class=args.requests_per_class,
            concurrency=args.concurrency,
            length_scale=args.length_scale,
            max_model_len=args.max_model_len,
            slo=parse_slo(args.slo),
            greedy_prompts=args.greedy_prompts,
            models=args.model,
            api_key=args.api_key,
            timeout_s=args.timeout,
            out=args.out,
        )
        report = run_shootout(options)
    except (ValueError, OSError) as e:
        return _fail("shootout", e)
    print(render_text(report))
    return 0


def _add_soak_parser(sub: argparse._SubParsersAction) -> None:
    soak = sub.add_parser(
        "soak",
        help="mixed traffic against a DP=2 server while replicas are killed and the disk tier fills",
        description="Starts `pagoda serve` (DP=2, three tenants, host and disk KV tiers; the disk tier on a "
        "small tmpfs when it can mount one) or soaks --url, sends chat streams, long prompts, n > 1, "
        "structured requests, disconnect storms, oversized bodies, /tokenize floods and refused "
        "requests while a chaos thread SIGKILLs a replica every --kill-every seconds and fills the "
        "disk tier. Checks: no 5xx but engine_dead on killed replicas, every replica back in time, "
        "no KV block held when idle, server RSS growth, /health p99, every error counted in "
        "/metrics under its reason. Writes soak.json and soak.md; exit 1 when a check fails.",
    )
    soak.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    soak.add_argument(
        "--kill-every", type=float, default=120.0, help="seconds between SIGKILLs of a replica's engine (default 120)"
    )
    soak.add_argument("--out", default=None, help="directory for soak.json, soak.md and server.log")
    soak.add_argument("--model", default=None, help="model directory to serve (default: the bundled model)")
    soak.add_argument(
        "--serve-args",
        default=None,
        metavar="FLAGS",
        help='more `pagoda serve` flags, one quoted string (e.g. "--max-model-len 512")',
    )
    soak.add_argument("--url", default=None, help="soak this running server instead of starting one")
    soak.add_argument("--api-key", default=None, help="with --url: the key to send")
    soak.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid (for its RSS)")
    soak.add_argument("--disk-dir", default=None, help="with --url: its disk tier's directory (to fill)")
    soak.add_argument(
        "--disk-size",
        default="4MiB",
        help="--kv-offload-disk-size of the server started here; without a tmpfs, the filler's size (default 4MiB)",
    )
    soak.add_argument(
        "--fill-at",
        type=float,
        default=None,
        help="seconds into the soak the disk tier is filled (default: half of --kill-every)",
    )
    soak.add_argument(
        "--fill-for", type=float, default=None, help="seconds the disk tier stays full (default: --kill-every)"
    )
    soak.add_argument("--tmpfs-size", default="16MiB", help="size of the disk tier's tmpfs (default 16MiB)")
    soak.add_argument("--chat-streams", type=int, default=4, help="concurrent chat streams (default 4)")
    soak.add_argument("--health-p99-ms", type=float, default=50.0, help="bound on /health p99 (default 50)")
    soak.add_argument("--rss-growth-mb", type=float, default=200.0, help="bound on server RSS growth (default 200)")
    soak.add_argument("--recovery-s", type=float, default=30.0, help="bound on a killed replica's return (default 30)")
    soak.add_argument("--seed", type=int, default=0)
    soak.set_defaults(func=run_soak_cli)


def run_soak_cli(args: argparse.Namespace) -> int:
    from pagoda.bench.soak import SoakOptions, parse_serve_args, soak_main
    from pagoda.http_client.server_process import ServerStartError

    try:
        options = SoakOptions(
            model=args.model,
            url=args.url,
            api_key=args.api_key,
            server_pid=args.server_pid,
            disk_dir=args.disk_dir,
            duration=args.duration,
            kill_every=args.kill_every,
            out=args.out,
            seed=args.seed,
            chat_streams=args.chat_streams,
            tmpfs_size=args.tmpfs_size,
            disk_size=args.disk_size,
            serve_args=parse_serve_args(args.serve_args),
            health_p99_ms=args.health_p99_ms,
            rss_growth_mb=args.rss_growth_mb,
            recovery_s=args.recovery_s,
            fill_at=args.fill_at,
            fill_for=args.fill_for,
        )
        return soak_main(options)
    except (ValueError, OSError, ServerStartError) as e:
        return _fail("soak", e)


def _add_canary_drill_parser(sub: argparse._SubParsersAction) -> None:
    drill = sub.add_parser(
        "canary-drill",
        help="a live canary of a deliberately regressed candidate: time to rollback, client errors",
        description="Serves a model as the stable side of a live canary and the same weights with a changed "
        "chat template as its candidate, sends chat traffic, and reports the time from the "
        "regression to the automatic rollback and the client-visible errors (target: 30 s, 0). "
        "Writes a JSON result; exit 1 when the target is missed.",
    )
    drill.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    drill.add_argument("--duration", type=float, default=90.0, help="the most seconds of traffic (default 90)")
    drill.add_argument("--concurrency", type=int, default=4, help="concurrent clients (default 4)")
    drill.add_argument("--weight", type=float, default=0.2, help="the canary's share of traffic (default 0.2)")
    drill.add_argument(
        "--shadow-sample",
        type=float,
        default=0.5,
        help="share of stable requests replayed to both models (default 0.5)",
    )
    drill.add_argument("--out", default="benchmarks/results/canary_drill.json", help="the JSON result")
    drill.set_defaults(func=run_canary_drill_cli)


def run_canary_drill_cli(args: argparse.Namespace) -> int:
    from pagoda.bench.canary_drill import DrillOptions, drill_main
    from pagoda.http_client.server_process import ServerStartError

    if not 0 <= args.weight <= 1 or not 0 <= args.shadow_sample <= 1 or args.concurrency < 1:
        return _fail("canary-drill", ValueError("--weight and --shadow-sample are 0..1, --concurrency at least 1"))
    try:
        return drill_main(
            DrillOptions(
                model=args.model,
                duration=args.duration,
                concurrency=args.concurrency,
                weight=args.weight,
                shadow_sample=args.shadow_sample,
                out=args.out,
            )
        )
    except (ValueError, OSError, ServerStartError) as e:
        return _fail("canary-drill", e)


def _compare_epilog() -> str:
    from pagoda.bench.targets import TARGET_HELP

    return TARGET_HELP


def add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument(
        "--slo",
        default=None,
        help="latency targets for goodput, e.g. ttft=0.5,itl=0.05 (seconds or ms suffix; keys ttft, itl, tpot, e2e)",
    )
    group.add_argument("--out", default=None, help="directory for results.json (every request) and PNG plots")
    group.add_argument("--label", default=None, help="name of the target in the report")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---- from flags to options ----------------------------------------------------------------


def _report_options(args: argparse.Namespace) -> ReportOptions:
    return options_from_args(ReportOptions, args)


def run_serve(args: argparse.Namespace) -> int:
    from pagoda.bench.loadgen import LoadConfig
    from pagoda.bench.serve_run import serve_benchmark

    try:
        # Without a count or a duration, send the default number of requests.
        num_requests = args.num_requests
        if num_requests is None and args.duration is None:
            num_requests = DEFAULT_NUM_REQUESTS
        load = options_from_args(
            LoadConfig, args, num_requests=num_requests, extra_body=parse_json_arg(args.extra_body, "--extra-body")
        )
    except ValueError as e:
        return _fail("serve", e)
    options = ServeBenchOptions(
        load=load,
        sweep_concurrency=args.sweep_concurrency,
        workload=options_from_args(WorkloadOptions, args),
        report=_report_options(args),
    )
    return _run("serve", serve_benchmark, options)


def run_offline(args: argparse.Namespace) -> int:
    from pagoda.bench.offline import offline_benchmark

    try:
        engine = EngineConfig.from_cli_args(args)
    except ValueError as e:
        return _fail("offline", e)
    # The workload's tokenizer, length cap and seed are the engine's; lengths never exceed the
    # model's context (the bundled model's is 1,024 tokens, less than the default classes ask).
    max_model_len = engine.max_model_len
    if max_model_len is None:
        from pagoda.model.loader import load_model_config

        max_model_len = load_model_config(engine.model).max_position_embeddings
        print(f"lengths capped at the model's context: {max_model_len} tokens", file=sys.stderr)
    workload = options_from_args(
        WorkloadOptions, args, tokenizer=engine.tokenizer, max_model_len=max_model_len, seed=engine.seed
    )
    options = options_from_args(
        OfflineBenchOptions, args, engine=engine, workload=workload, report=_report_options(args)
    )
    return _run("offline", offline_benchmark, options)


def run_compare(args: argparse.Namespace) -> int:
    from pagoda.bench.compare import compare_benchmark

    options = options_from_args(
        CompareBenchOptions,
        args,
        targets=args.target,
        workload=options_from_args(WorkloadOptions, args),
        report=_report_options(args),
    )
    return _run("compare", compare_benchmark, options)


def run_route_sim(args: argparse.Namespace) -> int:
    from pagoda.bench.route_sim import ReplicaModel, RouteSimOptions, render_table, route_sim
    from pagoda.bench.step_cost import DEFAULT_STEP_COST, calibrate
    from pagoda.config import resolve_model_path

    try:
        replicas = [int(n) for n in args.replicas.split(",")]
        if not replicas or min(replicas) < 1:
            raise ValueError(f"--replicas must be positive counts, got {args.replicas!r}")
        cost = DEFAULT_STEP_COST
        if args.calibrate:
            cost = calibrate(resolve_model_path(args.calibrate), num_threads=args.num_threads)
            print(f"step cost: {cost}", file=sys.stderr)
        model = ReplicaModel(
            block_size=args.block_size,
            cache_blocks=args.cache_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            cost=cost,
        )
        options = RouteSimOptions(
            trace=args.trace,
            replicas=replicas,
            policies=[p.strip() for p in args.policies.split(",")],
            requests_per_replica=args.requests_per_replica,
            rate_per_replica=args.rate_per_replica,
            tenants_per_replica=args.tenants_per_replica,
            model=model,
            tokenizer=args.tokenizer,
            seed=args.seed,
            out=args.out,
        )
        report = route_sim(options)
    except (ValueError, OSError) as e:
        return _fail("route-sim", e)
    print(render_table(report))
    return 0


def _run(command: str, benchmark: Callable[[Any], int], options: Any) -> int:
    try:
        return benchmark(options)
    except ValueError as e:
        return _fail(command, e)


def _fail(command: str, error: Exception) -> int:
    print(f"pagoda bench {command}: error: {error}", file=sys.stderr)
    return 2
