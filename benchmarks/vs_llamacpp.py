"""pagoda vs llama.cpp's `llama-server` on the same weights, side by side.

The benchmark model (safetensors, float32) is served by `pagoda serve`; its f32 GGUF conversion
(llama.cpp's `convert_hf_to_gguf.py`, f32 KV cache) by `llama-server`. Before any timing, both
answer the same token-id prompts greedily and the texts must agree up to near ties (token ids, not text
prompts: llama.cpp and `transformers` may split words differently). Then both get the same
closed-loop load (every client sends its next request when the previous one ends; prompts of
--prompt-len random token ids, --output-len tokens with ignore_eos, greedy) at each
concurrency, alternating which goes first, for --rounds rounds. Reported per target and
concurrency: output tok/s (completed output tokens / wall time) and median ITL, as medians over
rounds with their min-max spread, plus how many cores the server's processes kept busy.

llama-server is a dev-only peer, never needed by users or CI: give --llama-server (or put it on
PATH; build it from the llama.cpp sources vendored in the `llama-cpp-python` sdist, see
/work/shared/MEASURED.md "Peers"). Without it pagoda runs alone and the results say so.

    .venv/bin/python benchmarks/vs_llamacpp.py --llama-server PATH --llama-cpp DIR --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    META_KEYS,
    MODEL_SHAPE,
    MODEL_SHAPE_100M,
    PYTHON,
    REPO,
    RESULTS,
    build_bench_model,
    metadata,
    pagoda_server_process,
    write_summary,
)

NAME = "vs_llamacpp"
PAGODA, LLAMA = "pagoda", "llama-server"
SHAPES = {"10m": MODEL_SHAPE, "100m": MODEL_SHAPE_100M}

# Runs llama.cpp's converter. llama.cpp recognises a BPE pre-tokenizer by hashing the token ids
# of a probe text; the benchmark's own tokenizer is unknown to it but is GPT-2's byte-level
# pre-tokenizer (tokenizers' ByteLevel with its default regex), so an unknown hash means "gpt-2".
CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path.insert(0, root)
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre_tokenizer(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre_tokenizer
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert_to_gguf(model_dir: Path, llama_cpp: Path) -> Path:
    """The model's f32 GGUF next to it (reused when newer than the safetensors)."""
    out = model_dir.parent / f"{model_dir.name}.f32.gguf"
    if out.exists() and out.stat().st_mtime > (model_dir / "model.safetensors").stat().st_mtime:
        return out
    subprocess.run(
        [PYTHON, "-c", CONVERT, str(llama_cpp), str(model_dir), "--outtype", "f32", "--outfile", str(out)],
        check=True,
        capture_output=True,
    )
    return out


@contextlib.contextmanager
def llama_server(
    binary: Path, gguf: Path, slots: int, context_per_slot: int, threads: int, log_path: Path
) -> Iterator[tuple[str, int]]:
    """`llama-server` on a free loopback port with an f32 KV cache; yields (base URL, pid)."""
    from pagoda.http_client.server_process import free_port, running_server

    port = free_port()
    command = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * context_per_slot),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-ctk",
        "f32",
        "-ctv",
        "f32",
        "--alias",
        "bench",
    ]
    url = f"http://127.0.0.1:{port}"
    with running_server(command, url + "/health", timeout=120, log_path=log_path, name="llama-server") as proc:
        yield url, proc.pid


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (from /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            stats[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _) in stats.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(stats[p][1] for p in tree if p in stats)


def token_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token-id prompts, avoiding id 0 (the benchmark tokenizer's end-of-text)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(length)] for _ in range(count)]


# Two fp32 implementations sum in different orders, so logprobs differ slightly; where the top
# two tokens are closer than this (nats), greedy decoding may pick either. Measured on the
# random benchmark model (flat distributions): divergences after 16-54 identical tokens, at
# top-2 margins of 0.001-0.015 nats, pagoda always continuing with llama-server's runner-up
# (pagoda's own greedy output equals transformers' in tests/model/test_model_correctness.py).
NEAR_TIE = 5e-2


def greedy_completion(url: str, prompt: list[int], max_tokens: int, logprobs: int | None = None) -> dict[str, Any]:
    import httpx

    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if logprobs:
        body["logprobs"] = logprobs
    response = httpx.post(url + "/v1/completions", json=body, timeout=120.0, trust_env=False)
    response.raise_for_status()
    return response.json()["choices"][0]


def check_greedy_agreement(
    pagoda_url: str, llama_url: str, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """Greedy texts of both servers on the same token-id prompts. Where they differ, the first
    differing token must be a near tie in llama-server's own top-2 logprobs, with pagoda's
    text continuing with the runner-up; anything else is a real disagreement."""
    identical, near_ties, disagreements = 0, [], []
    for index, prompt in enumerate(prompts):
        ours = greedy_completion(pagoda_url, prompt, max_tokens)["text"]
        theirs = greedy_completion(llama_url, prompt, max_tokens, logprobs=2)
        if ours == theirs["text"]:
            identical += 1
            continue
        offset = 0
        for position, entry in enumerate(theirs["logprobs"]["content"]):  # noqa: B007 (read after the loop)
            if ours[offset : offset + len(entry["token"])] != entry["token"]:
                break
            offset += len(entry["token"])
        top = entry["top_logprobs"]
        margin = top[0]["logprob"] - top[1]["logprob"]
        case = {
            "prompt": index,
            "token_position": position,
            "top2_margin": margin,
            "llama_server": top[0]["token"],
            "runner_up": top[1]["token"],
            "pagoda": ours[offset : offset + 20],
            "llama_server_text": theirs["text"][offset : offset + 20],
        }
        if margin < NEAR_TIE and ours[offset:].startswith(top[1]["token"]):
            near_ties.append(case)
        else:
            disagreements.append(case)
    return {
        "prompts": len(prompts),
        "identical": identical,
        "near_tie_divergences": near_ties,
        "disagreements": disagreements,
    }


def warm(url: str, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        greedy_completion(url, prompt, 8)


def run_load(url: str, pid: int | None, prompts: list[list[int]], output_len: int, concurrency: int) -> dict[str, Any]:
    """One closed-loop run; output tok/s, ITL and TTFT medians, cores the server kept busy."""
    from pagoda.bench.loadgen import LoadConfig
    from pagoda.bench.loadgen import run_load as drive
    from pagoda.bench.records import BenchRequest

    requests = [BenchRequest(i, "bench", prompt, [], len(prompt), output_len) for i, prompt in enumerate(prompts)]
    config = LoadConfig(
        base_url=url,
        model="bench",
        concurrency=concurrency,
        num_requests=len(requests),
        ignore_eos=True,
        temperature=0.0,
    )
    cpu_before = process_tree_cpu_seconds(pid) if pid else None
    result = drive(config, requests, progress=False)
    cpu = process_tree_cpu_seconds(pid) - cpu_before if pid else None
    ok = [r for r in result.records if r.ok]
    failed = [r.error for r in result.records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed against {url}: {failed[0]}")
    itls = [gap for r in ok for gap in r.itls]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "seconds": result.duration,
        "requests": len(ok),
        "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / result.duration,
        "itl_p50_ms": 1000 * statistics.median(itls),
        "ttft_p50_ms": 1000 * statistics.median([r.ttft for r in ok if r.ttft is not None]),
        "cores_busy": None if cpu is None else cpu / result.duration,
    }


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(runs)}
    for key in ("output_tok_per_s", "itl_p50_ms", "ttft_p50_ms", "cores_busy"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def plot(summary: dict[str, dict[int, dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for target, by_concurrency in summary.items():
        xs = sorted(by_concurrency)
        for axis, key in ((left, "output_tok_per_s"), (right, "itl_p50_ms")):
            mid = [by_concurrency[c][key]["median"] for c in xs]
            low = [by_concurrency[c][key]["median"] - by_concurrency[c][key]["min"] for c in xs]
            high = [by_concurrency[c][key]["max"] - by_concurrency[c][key]["median"] for c in xs]
            axis.errorbar(xs, mid, yerr=[low, high], marker="o", capsize=3, label=target)
    left.set(xscale="log", xlabel="concurrency", ylabel="output tokens / s (higher is better)")
    right.set(xscale="log", xlabel="concurrency", ylabel="median ITL, ms (lower is better)")
    for axis in (left, right):
        axis.set_xticks(sorted(next(iter(summary.values()))))
        axis.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def find_llama_server(given: str | None) -> Path | None:
    found = given or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return Path(found) if found and Path(found).is_file() else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        choices=sorted(SHAPES),
        default="10m",
        help="benchmark model: random Llama, fp32 (10m: common.MODEL_SHAPE; 100m: hidden 768 x 12)",
    )
    parser.add_argument("--model-dir", help="where the model is built (default: tmp/bench-model[-100m])")
    parser.add_argument("--out", help="results directory (default: benchmarks/results/vs_llamacpp[_100m])")
    parser.add_argument("--llama-server", help="llama-server binary (default: $LLAMA_SERVER, then PATH)")
    parser.add_argument(
        "--llama-cpp",
        default=os.environ.get("LLAMA_CPP_DIR"),
        help="llama.cpp source directory with convert_hf_to_gguf.py (default: $LLAMA_CPP_DIR)",
    )
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--requests-per-client", type=int, default=2, help="requests per run = max(4, this x concurrency)"
    )
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server's -t")
    parser.add_argument(
        "--pagoda-flag",
        action="append",
        default=[],
        help="extra `pagoda serve` flag (repeatable, e.g. --pagoda-flag=--num-threads=2); "
        "default: pagoda's own thread policy",
    )
    parser.add_argument("--check-prompts", type=int, default=8, help="token-id prompts whose greedy outputs must agree")
    parser.add_argument("--check-tokens", type=int, default=64, help="greedy tokens compared per prompt")
    args = parser.parse_args(argv)

    # SIGTERM ends the run like Ctrl-C: the servers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    levels = sorted({int(c) for c in args.concurrency.split(",")})
    shape = SHAPES[args.model]
    model_dir = build_bench_model(
        Path(args.model_dir or REPO / "tmp" / ("bench-model" if args.model == "10m" else f"bench-model-{args.model}")),
        shape=shape,
    )
    out = Path(args.out or RESULTS / (NAME if args.model == "10m" else f"{NAME}_{args.model}"))
    out.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir, shape).items() if k in META_KEYS}
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    context = args.prompt_len + max(args.output_len, args.check_tokens) + 16

    binary = find_llama_server(args.llama_server)
    peer: dict[str, Any] = {"available": binary is not None}
    if binary is None:
        peer["reason"] = "no llama-server binary (--llama-server, $LLAMA_SERVER or PATH): pagoda ran alone"
    elif not args.llama_cpp or not (Path(args.llama_cpp) / "convert_hf_to_gguf.py").is_file():
        peer = {
            "available": False,
            "reason": "no --llama-cpp source directory with convert_hf_to_gguf.py: pagoda ran alone",
        }
        binary = None
    print(f"llama-server: {binary or peer['reason']}", flush=True)

    engine = ["--max-num-seqs", str(max(levels)), "--max-model-len", str(context), *args.pagoda_flag]
    with contextlib.ExitStack() as stack:
        url, process = stack.enter_context(pagoda_server_process(model_dir, engine, out / "pagoda.log"))
        servers: dict[str, tuple[str, int | None]] = {PAGODA: (url, process.pid)}
        if binary is not None:
            gguf = convert_to_gguf(model_dir, Path(args.llama_cpp))
            servers[LLAMA] = stack.enter_context(
                llama_server(binary, gguf, max(levels), context, args.llama_threads, out / "llama-server.log")
            )
            peer.update(
                binary=str(binary),
                gguf=gguf.name,
                flags=f"-np {max(levels)} -c {max(levels) * context} -t {args.llama_threads} "
                f"-tb {args.llama_threads} -ctk f32 -ctv f32",
            )

        agreement = None
        if LLAMA in servers:
            check = token_prompts(args.check_prompts, args.prompt_len, vocab_size, seed=1)
            agreement = check_greedy_agreement(servers[PAGODA][0], servers[LLAMA][0], check, args.check_tokens)
            print(
                f"greedy outputs: {agreement['identical']}/{len(check)} identical, "
                f"{len(agreement['near_tie_divergences'])} diverge at a near tie (top-2 margin < {NEAR_TIE})",
                flush=True,
            )
            if agreement["disagreements"]:
                write_summary(out / "greedy_disagreement.json", agreement)
                print("greedy outputs disagree: not timing different computations", file=sys.stderr)
                return 1
        for base, _ in servers.values():  # warm both: first-request allocations, caches
            warm(base, token_prompts(2, args.prompt_len, vocab_size, seed=2))

        runs: dict[str, dict[int, list[dict[str, Any]]]] = {name: {c: [] for c in levels} for name in servers}
        for round_index in range(args.rounds):
            order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
            for c in levels:
                prompts = token_prompts(
                    max(4, args.requests_per_client * c), args.prompt_len, vocab_size, seed=1000 * round_index + c
                )
                for name in order:
                    base, pid = servers[name]
                    run = run_load(base, pid, prompts, args.output_len, c)
                    runs[name][c].append(run)
                    print(
                        f"round {round_index + 1} c={c:<3} {name:<12} {run['output_tok_per_s']:8.1f} tok/s  "
                        f"ITL p50 {run['itl_p50_ms']:6.2f} ms  cores {run['cores_busy'] or 0:.2f}",
                        flush=True,
                    )

    summary = {name: {c: medians(by_c[c]) for c in levels} for name, by_c in runs.items()}
    ratios = {}
    if LLAMA in summary:
        ratios = {
            c: {
                "output_tok_per_s": summary[PAGODA][c]["output_tok_per_s"]["median"]
                / summary[LLAMA][c]["output_tok_per_s"]["median"],
                "itl_p50": summary[PAGODA][c]["itl_p50_ms"]["median"] / summary[LLAMA][c]["itl_p50_ms"]["median"],
            }
            for c in levels
        }
    write_summary(
        out / "summary.json",
        {
            **meta,
            "llama_server": peer,
            "greedy_agreement": agreement,
            "workload": {
                "prompt": f"{args.prompt_len} random token ids",
                "output": args.output_len,
                "ignore_eos": True,
                "greedy": True,
                "closed_loop": True,
                "requests_per_run": "max(4, 2 x concurrency)",
                "rounds": args.rounds,
                "order": "alternating",
                "pagoda_flags": engine,
            },
            "median_over_rounds": summary,
            "pagoda_over_llama_server": ratios,
            "runs": runs,
        },
    )
    title = (
        f"{meta['model']['params'] / 1e6:.1f}M Llama fp32, {args.prompt_len} in / {args.output_len} out, "
        f"medians of {args.rounds} rounds (bars: min-max); shared 2-core machine"
    )
    plot(summary, out / "vs_llamacpp.png", title)
    for c in levels:
        cells = [
            f"{name} {summary[name][c]['output_tok_per_s']['median']:.0f} tok/s, ITL "
            f"{summary[name][c]['itl_p50_ms']['median']:.2f} ms"
            for name in summary
        ]
        print(f"c={c:<3} " + " | ".join(cells) + (f" | ratio {ratios[c]['output_tok_per_s']:.2f}x" if ratios else ""))
    print(f"wrote {out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
