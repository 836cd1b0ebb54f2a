"""Print the markdown table of benchmarks/README.md from the committed summary.json files.

.venv/bin/python benchmarks/table.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _times(before: float, after: float) -> str:
    """'4.2x lower' or '1.6x higher': how `after` compares with `before`."""
    return f"{before / after:.1f}x lower" if after <= before else f"{after / before:.1f}x higher"


def _load(name: str) -> dict | None:
    path = RESULTS / name / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 1 else f"{seconds:,.1f} s"


def rows() -> list[list[str]]:
    out = []
    batching = _load("batching")
    if batching:
        r = batching["results"]
        cont, static = r["pagoda continuous"], r["pagoda static"]
        out.append(
            [
                "continuous vs static batching (same engine, 16 slots, 64 mixed-length requests)",
                f"output {cont['output_tok_per_s']:.0f} vs {static['output_tok_per_s']:.0f} tok/s; "
                f"E2E p50 {_ms(cont['e2e_p50_s'])} vs {_ms(static['e2e_p50_s'])}; "
                f"p99 {_ms(cont['e2e_p99_s'])} vs {_ms(static['e2e_p99_s'])}",
                f"{cont['output_tok_per_s'] / static['output_tok_per_s']:.2f}x throughput, "
                f"{static['e2e_p50_s'] / cont['e2e_p50_s']:.1f}x lower E2E p50, "
                f"{static['e2e_p99_s'] / cont['e2e_p99_s']:.2f}x lower p99",
                "batching/",
            ]
        )
        if "transformers static" in r:
            hf = r["transformers static"]
            out.append(
                [
                    "pagoda vs transformers `generate` (offline, same requests)",
                    f"output {cont['output_tok_per_s']:.0f} vs {hf['output_tok_per_s']:.0f} tok/s; "
                    f"wall {cont['seconds']:.1f} s vs {hf['seconds']:.1f} s",
                    f"{cont['output_tok_per_s'] / hf['output_tok_per_s']:.2f}x throughput",
                    "batching/",
                ]
            )
    prefix = _load("prefix_caching")
    if prefix:
        on, off = prefix["results"]["prefix caching on"], prefix["results"]["prefix caching off"]
        out.append(
            [
                "prefix caching on vs off (`rag`: 4 shared 512-token documents, Poisson 1.5 req/s)",
                f"TTFT p50 {_ms(on['ttft_p50_s'])} vs {_ms(off['ttft_p50_s'])}; "
                f"p99 {_ms(on['ttft_p99_s'])} vs {_ms(off['ttft_p99_s'])}; "
                f"hit rate {on['prefix_cache_hit_rate']:.1%} vs {off['prefix_cache_hit_rate']:.0%}",
                f"{off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x lower TTFT p50, "
                f"{off['ttft_p99_s'] / on['ttft_p99_s']:.1f}x lower p99",
                "prefix_caching/",
            ]
        )
    chunked = _load("chunked_prefill")
    if chunked:
        r = chunked["results"]
        off = r["chunked prefill off (budget 2048)"]
        for label, on in r.items():
            if label == "chunked prefill off (budget 2048)":
                continue
            budget = label.split("budget ")[1].rstrip(")")
            out.append(
                [
                    f"chunked prefill (budget {budget}) vs off: chat decodes while 1024-token prompts arrive",
                    f"chat ITL p99 {_ms(on['chat_itl_p99_s'])} vs {_ms(off['chat_itl_p99_s'])}; "
                    f"max {_ms(on['chat_itl_max_s'])} vs {_ms(off['chat_itl_max_s'])}; "
                    f"chat TTFT p99 {_ms(on['chat_ttft_p99_s'])} vs {_ms(off['chat_ttft_p99_s'])}; "
                    f"long-prompt TTFT p50 {_ms(on['summarize_ttft_p50_s'])} vs "
                    f"{_ms(off['summarize_ttft_p50_s'])}",
                    f"ITL max {_times(off['chat_itl_max_s'], on['chat_itl_max_s'])}, "
                    f"ITL p99 {_times(off['chat_itl_p99_s'], on['chat_itl_p99_s'])}",
                    "chunked_prefill/",
                ]
            )
    return out


def main() -> int:
    print("| demonstration | measured (first vs second) | effect | results |")
    print("|---|---|---|---|")
    for row in rows():
        print(f"| {row[0]} | {row[1]} | {row[2]} | [{row[3]}](results/{row[3]}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
