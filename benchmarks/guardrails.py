"""Guardrails' cost: TTFT and ITL with guardrails off, with regex + PII rules, and with a
classifier guard model, side by side in one run, at concurrency 1 and 16.

Three `pagoda serve` processes on the benchmark model (10M random Llama), identical but for
`--guardrails`:
  off:        no guardrails file;
  regex+pii:  PII redaction (email, phone, card, API key) on input and output, a blocklist
              and a regex rule (flag) on both stages: the output filter sees every delta;
  classifier: a guard model of the benchmark model's shape (random weights, its LM head
              reduced to two label tokens, so the verdict is a fixed function of the text)
              labels the input and every 256-character output window; action `flag`, so a
              verdict never changes the text and all three servers stream the same tokens.
Each server gets the same `chat` requests (64-token prompts, 64 output tokens, ignore_eos)
from `pagoda bench compare`, back to back. Then the guard model alone labels windows in
process, for its cost per window token.

    .venv/bin/python benchmarks/guardrails.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    META_KEYS,
    REPO,
    RESULTS,
    bench,
    build_bench_model,
    load_results,
    metadata,
    pagoda_server,
    write_summary,
)

NAME = "guardrails"
SAFE_LABEL, UNSAFE_LABEL = "True", "False"
WINDOW_CHARS = 256
TARGETS = ("off", "regex+pii", "classifier")


def build_guard_model(bench_model: Path, directory: Path) -> Path:
    """The benchmark model with its LM head cut to two label tokens (+v and -v): the greedy
    first token is one of the labels, chosen by the sign of the last hidden state along v."""
    import torch
    from safetensors.torch import load_file, save_file

    from tokenizers import Tokenizer

    if (directory / "model.safetensors").exists():
        return directory
    shutil.copytree(bench_model, directory, dirs_exist_ok=True)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    labels = [tokenizer.encode(label, add_special_tokens=False).ids for label in (SAFE_LABEL, UNSAFE_LABEL)]
    if any(len(ids) != 1 for ids in labels):
        raise SystemExit(f"labels must be single tokens of the benchmark tokenizer: {labels}")
    weights = load_file(str(directory / "model.safetensors"))
    head = weights["lm_head.weight"]
    direction = torch.Generator().manual_seed(1)
    v = torch.randn(head.shape[1], generator=direction)
    head.zero_()
    head[labels[0][0]] = v
    head[labels[1][0]] = -v
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def guardrails_files(out: Path, guard_dir: Path) -> dict[str, Path]:
    pii = [
        {"name": "pii", "kind": "pii", "action": "redact"},
        {"name": "words", "kind": "blocklist", "words": ["password", "secret key"], "action": "flag"},
        {"name": "tickets", "kind": "regex", "pattern": r"TICKET-\d{3,}", "action": "flag"},
    ]
    classifier = {
        "classifier_window_chars": WINDOW_CHARS,
        "fail_mode": "open",
        "models": {
            "guard": {
                "path": str(guard_dir),
                "safe_label": SAFE_LABEL,
                "unsafe_label": UNSAFE_LABEL,
                "max_tokens": 1,
                "chat_template": False,
            }
        },
        "rules": [{"name": "safety", "kind": "classifier", "model": "guard", "action": "flag"}],
    }
    files = {}
    for name, content in (("regex+pii", {"rules": pii}), ("classifier", classifier)):
        path = out / f"guardrails-{name.replace('+', '-')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2))
        files[name] = path
    return files


def window_cost(guard_dir: Path, windows: int = 16) -> dict[str, float]:
    """The guard model alone: seconds per 256-character window, and per token of window,
    one window per call and 16 per call. Each measurement labels windows the guard has not
    seen (its prefix cache would otherwise serve them); the template's shared prefix is
    cached, as it is in the server."""
    import torch

    from pagoda.guard.classifier import GuardModel

    torch.set_num_threads(1)
    model = GuardModel(
        "guard", str(guard_dir), safe_label=SAFE_LABEL, unsafe_label=UNSAFE_LABEL, max_tokens=1, use_chat_template=False
    )
    model.load()
    source = (REPO / "pagoda" / "serve" / "serving.py").read_text()
    texts = [source[i * WINDOW_CHARS : (i + 1) * WINDOW_CHARS] for i in range(2 * windows + 1)]
    single, batch = texts[1 : windows + 1], texts[windows + 1 :]
    tokenizer = model._llm.tokenizer
    window_tokens = statistics.mean(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts[1:])
    prompt_tokens = statistics.mean(len(tokenizer.encode(model.prompt(t, "Agent"))) for t in texts[:4])
    model.classify(texts[0], "Agent")  # warm-up
    started = time.perf_counter()
    for text in single:
        model.classify(text, "Agent")
    one = (time.perf_counter() - started) / len(single)
    started = time.perf_counter()
    model.classify_batch([(t, "Agent") for t in batch])
    batched = (time.perf_counter() - started) / len(batch)
    return {
        "window_chars": WINDOW_CHARS,
        "window_tokens_mean": window_tokens,
        "guard_prompt_tokens_mean": prompt_tokens,
        "seconds_per_window": one,
        "seconds_per_window_token": one / window_tokens,
        "seconds_per_window_batched_16": batched,
        "seconds_per_window_token_batched_16": batched / window_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    guard_dir = build_guard_model(model_dir, Path(args.model_dir).parent / "bench-guard-model")
    out = Path(args.out)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir).items() if k in META_KEYS}
    files = guardrails_files(out, guard_dir)
    engine = ["--num-threads", str(args.threads), "--max-num-seqs", "16", "--max-model-len", "1024"]
    rows: dict[str, dict[str, dict[str, float]]] = {}
    with (
        pagoda_server(model_dir, engine, out / "off.log") as off_url,
        pagoda_server(model_dir, engine + ["--guardrails", str(files["regex+pii"])], out / "regex-pii.log") as pii_url,
        pagoda_server(
            model_dir, engine + ["--guardrails", str(files["classifier"])], out / "classifier.log"
        ) as classifier_url,
    ):
        urls = dict(zip(TARGETS, (off_url, pii_url, classifier_url)))
        for concurrency in args.concurrency:
            run_out = out / f"c{concurrency}"
            num_requests = max(args.min_requests, concurrency * args.requests_per_client)
            rc = bench(
                [
                    "compare",
                    "--model",
                    str(model_dir),
                    "--mix",
                    "chat",
                    "--param",
                    "chat.prompt=64",
                    "--param",
                    "chat.output=64",
                    "--max-model-len",
                    "1024",
                    "--num-requests",
                    str(num_requests),
                    "--warmup",
                    "2",
                    "--concurrency",
                    str(concurrency),
                    "--seed",
                    "0",
                    "--no-progress",
                    "--out",
                    str(run_out),
                    *[f"--target=http:url={url},model=bench,label={name}" for name, url in urls.items()],
                ]
            )
            if rc:
                return rc
            for run in load_results(run_out / "results.json")["runs"]:
                overall = run["summary"]["overall"]
                rows.setdefault(f"c{concurrency}", {})[run["summary"]["target"]] = {
                    "ttft_p50_s": overall["ttft"]["p50"],
                    "ttft_p99_s": overall["ttft"]["p99"],
                    "itl_p50_s": overall["itl"]["p50"],
                    "itl_p99_s": overall["itl"]["p99"],
                    "tpot_p50_s": overall["tpot"]["p50"],
                    "e2e_p50_s": overall["e2e"]["p50"],
                    "e2e_p99_s": overall["e2e"]["p99"],
                    "output_tok_per_s": overall["output_throughput"],
                }
    for log in out.glob("*.log"):
        log.unlink()
    for concurrency, targets in rows.items():
        base = targets["off"]
        for name, row in targets.items():
            for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s", "e2e_p50_s", "e2e_p99_s"):
                row[key[:-2] + "_ratio"] = row[key] / base[key]
            print(
                f"{concurrency:>4s} {name:10s} TTFT p50 {row['ttft_p50_s'] * 1e3:7.1f} ms "
                f"({row['ttft_p50_ratio']:.3f}x) p99 {row['ttft_p99_s'] * 1e3:7.1f} ms "
                f"({row['ttft_p99_ratio']:.3f}x)  ITL p50 {row['itl_p50_s'] * 1e3:6.2f} ms "
                f"({row['itl_p50_ratio']:.3f}x) p99 {row['itl_p99_s'] * 1e3:6.2f} ms "
                f"({row['itl_p99_ratio']:.3f}x)  TPOT p50 {row['tpot_p50_s'] * 1e3:6.2f} ms "
                f"({row['tpot_p50_ratio']:.3f}x)  E2E p50 {row['e2e_p50_s']:.2f} s "
                f"({row['e2e_p50_ratio']:.3f}x)",
                flush=True,
            )
    cost = window_cost(guard_dir)
    print(
        f"classifier: {cost['seconds_per_window'] * 1e3:.1f} ms per {WINDOW_CHARS}-char window "
        f"({cost['window_tokens_mean']:.0f} tokens, {cost['guard_prompt_tokens_mean']:.0f} with "
        f"the template): {cost['seconds_per_window_token'] * 1e3:.2f} ms per window token one "
        f"window per call, {cost['seconds_per_window_token_batched_16'] * 1e3:.2f} ms 16 per "
        "call"
    )
    write_summary(
        out / "summary.json",
        {
            **meta,
            "workload": {
                "class": "chat",
                "prompt_tokens": 64,
                "output_tokens": 64,
                "ignore_eos": True,
                "concurrency": args.concurrency,
                "max_num_seqs": 16,
                "threads": args.threads,
            },
            "guardrails": {name: json.loads(path.read_text()) for name, path in files.items()},
            "results": rows,
            "classifier_window_cost": cost,
        },
    )
    print(f"wrote {out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
