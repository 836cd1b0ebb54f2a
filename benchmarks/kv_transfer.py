"""KV handoff cost: milliseconds per 1k tokens of context for each transport (tcp on localhost,
shm), between two processes, with the benchmark model's KV block layout (10 layers, 4 KV
heads of 32, block 16), float32 and int8 KV (int8 travels as stored: values + per-vector scales).

A sender process (standing for the prefill engine) gathers a request's blocks out of its
cache tensors (the export copy) and ships them with send_handoff (over shm with a pool of
reused segments, as an engine does; `shm-unpooled`: a fresh segment per handoff); this process (the decode
engine) receives them into freshly chosen blocks of its own cache tensors (scatter). The time
per handoff is the sender's wall time from the gather to the receiver's acknowledgement, so it
covers both copies and the wire. Rounds interleave transports and context lengths; the
medians over rounds are reported.

The machine may be shared: absolute numbers are noisy; ratios between transports measured in
one run are what counts.

    .venv/bin/python benchmarks/kv_transfer.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODEL_SHAPE, REPO, RESULTS, git_commit, write_summary  # noqa: E402

NAME = "kv_transfer"
BLOCK = 16
SECRET = "bench-" * 8  # the KV transfer secret both sides sign with


def cache_layout(kv_cache_dtype: str) -> tuple[str, list[int]]:
    """(storage dtype, one block's shape) of one layer's key (or value) cache, as the engine
    allocates it (pagoda.quant.kv_cache_dtype: int8 entries carry a 4-byte float32 scale)."""
    head_dim = MODEL_SHAPE["hidden_size"] // MODEL_SHAPE["num_attention_heads"]
    heads = MODEL_SHAPE["num_key_value_heads"]
    if kv_cache_dtype == "int8":
        return "uint8", [BLOCK, heads, head_dim + 4]
    return "float32", [BLOCK, heads, head_dim]


def make_caches(kv_cache_dtype: str, num_blocks: int):
    import torch

    dtype_name, shape = cache_layout(kv_cache_dtype)
    dtype = getattr(torch, dtype_name)
    caches = []
    for _ in range(2 * MODEL_SHAPE["num_hidden_layers"]):
        values = torch.randn((num_blocks, *shape))
        caches.append((values * 40).to(dtype) if dtype == torch.uint8 else values)
    return caches


def sender(conn, num_pool_blocks: int) -> None:
    """The prefill side: on each (transport, address, context, kv dtype) message, export and send."""
    import torch

    from pagoda.kv_transfer.block_transfer import gather_blocks
    from pagoda.kv_transfer.handoff import HandoffAuth, HandoffHeader, KVHandoff, layout_of, send_handoff
    from pagoda.kv_transfer.shm_segments import ShmSegments

    torch.set_num_threads(1)
    pools = {name: make_caches(name, num_pool_blocks) for name in ("float32", "int8")}
    segments = ShmSegments()  # as a prefill engine's handoff threads keep them
    while True:
        message = conn.recv()
        if message is None:
            segments.close()
            return
        variant, address, context, kv_dtype = message
        transport = variant.split("-")[0]
        caches = pools[kv_dtype]
        num_blocks = -(-context // BLOCK)
        block_ids = list(range(num_pool_blocks - num_blocks, num_pool_blocks))[::-1]  # scattered, not 0..n
        started = time.perf_counter()
        blocks = [t.cpu() for t in gather_blocks(caches, block_ids)]
        header = HandoffHeader(
            request_id="bench",
            prompt_token_ids=list(range(context)),
            output_token_ids=[1],
            sampling_params={},
            cache_salt=None,
            lora_name=None,
            block_size=BLOCK,
            block_hashes=[f"{i:032x}" for i in range(context // BLOCK)],
            num_blocks=num_blocks,
            layout=layout_of(caches),
            fingerprint="bench",
        )
        handoff = KVHandoff(header, blocks)
        send_handoff(
            handoff,
            transport,
            address,
            timeout=60,
            auth=HandoffAuth(SECRET),
            segments=segments if variant == "shm" else None,
        )  # shm-unpooled: a segment per handoff
        conn.send((time.perf_counter() - started, handoff.nbytes))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args(argv)

    import torch

    from pagoda.bench.report import machine_info
    from pagoda.kv_transfer.block_transfer import scatter_blocks
    from pagoda.kv_transfer.handoff import HandoffAuth, KVListener

    torch.set_num_threads(1)
    load_at_start = os.getloadavg()
    num_pool_blocks = 2 * -(-max(args.contexts) // BLOCK)
    receivers = {name: make_caches(name, num_pool_blocks) for name in ("float32", "int8")}
    context_mp = multiprocessing.get_context("spawn")
    parent, child = context_mp.Pipe()
    process = context_mp.Process(target=sender, args=(child, num_pool_blocks))
    process.start()
    auth = HandoffAuth(SECRET)  # frames are signed as in a deployment
    listeners = {
        "tcp": KVListener("tcp", auth),
        "shm": KVListener("shm", auth),
        "shm-unpooled": KVListener("shm", auth),
    }
    timings: dict[str, list[float]] = {}
    nbytes: dict[str, int] = {}
    try:
        for round_index in range(args.rounds + 1):  # round 0 warms both sides up, not counted
            for context in args.contexts:
                for kv_dtype in ("float32", "int8"):
                    for transport, listener in listeners.items():
                        parent.send((transport, listener.address, context, kv_dtype))
                        incoming = listener.accept(timeout=60)
                        caches = receivers[kv_dtype]
                        for indices, data in incoming.receive(skip=0):
                            scatter_blocks(caches, indices, data)
                        incoming.close()
                        seconds, size = parent.recv()
                        if round_index:
                            key = f"{transport} {kv_dtype} {context}"
                            timings.setdefault(key, []).append(seconds)
                            nbytes[key] = size
    finally:
        parent.send(None)
        process.join(30)
        for listener in listeners.values():
            listener.close()

    rows = []
    for key, values in timings.items():
        transport, kv_dtype, context = key.split()
        median = statistics.median(values)
        rows.append(
            {
                "transport": transport,
                "kv_cache_dtype": kv_dtype,
                "context_tokens": int(context),
                "bytes": nbytes[key],
                "median_ms": round(median * 1e3, 3),
                "ms_per_1k_tokens": round(median * 1e3 * 1000 / int(context), 3),
                "gib_per_s": round(nbytes[key] / median / 2**30, 3),
                "rounds_ms": [round(v * 1e3, 3) for v in values],
            }
        )
    for row in rows:
        print(
            f"{row['transport']:>4} {row['kv_cache_dtype']:>7} {row['context_tokens']:>5} tokens: "
            f"{row['median_ms']:8.2f} ms ({row['ms_per_1k_tokens']:.2f} ms / 1k tokens, "
            f"{row['bytes'] / 2**20:.1f} MiB, {row['gib_per_s']:.2f} GiB/s)"
        )
    payload = {
        "command": " ".join([".venv/bin/python", f"benchmarks/{NAME}.py", *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "model_kv": {
            "layers": MODEL_SHAPE["num_hidden_layers"],
            "kv_heads": MODEL_SHAPE["num_key_value_heads"],
            "head_dim": MODEL_SHAPE["hidden_size"] // MODEL_SHAPE["num_attention_heads"],
            "block_size": BLOCK,
        },
        "rounds": args.rounds,
        "results": rows,
    }
    write_summary(Path(args.out) / f"{NAME}.json", payload)
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    raise SystemExit(main())
