"""PNG plots of a run: latency CDFs, TTFT and ITL over time, sweeps, and side-by-side bars."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagoda.bench.records import RequestRecord

MAX_SCATTER_POINTS = 20_000


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_axis(ax: Any, which: str = "x", ticks: list[float] | None = None) -> None:
    """A log axis labelled in plain numbers (1, 4, 8 — not 2⁰, 2², 2³), major ticks only so the
    labels never overlap; `ticks` pins the labels to the measured points (e.g. concurrencies)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    axis = ax.xaxis if which == "x" else ax.yaxis
    low, high = ax.dataLim.intervalx if which == "x" else ax.dataLim.intervaly
    if not high > 0:  # nothing positive to put on a log axis (e.g. every gap was 0): stay linear
        return
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    if ticks:
        axis.set_major_locator(FixedLocator(sorted(set(ticks))))
    else:
        axis.set_major_locator(LogLocator(base=10, numticks=6))
    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}" if x >= 1 else f"{x:.3g}"))
    axis.set_minor_formatter(NullFormatter())


def _by_class(records: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.ok:
            groups.setdefault(r.class_name, []).append(r)
    if len(groups) > 1:
        groups = {"all": [r for r in records if r.ok], **groups}
    return groups


def _cdf(ax: Any, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(v * 1000 for v in values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_latency_cdfs(records: list[RequestRecord], path: Path, title: str = "") -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, group in _by_class(records).items():
        _cdf(axes[0], [r.ttft for r in group if r.ttft is not None], name)
        _cdf(axes[1], [g for r in group for g in r.itls], name)
        _cdf(axes[2], [r.e2e for r in group if r.e2e is not None], name)
    for ax, label in zip(axes, ("TTFT", "inter-token latency", "end-to-end latency")):
        if not ax.has_data():
            ax.text(
                0.5,
                0.5,
                "no per-token timings\nfrom this target",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="gray",
            )
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_xlabel(f"{label} (ms)")
            continue
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests" if label != "inter-token latency" else "fraction of gaps")
        _log_axis(ax)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_over_time(records: list[RequestRecord], path: Path, title: str = "") -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for name, group in _by_class(records).items():
        if name == "all":
            continue
        ttfts = [(r.start, r.ttft) for r in group if r.ttft is not None]
        axes[0].scatter([start for start, _ in ttfts], [ttft * 1000 for _, ttft in ttfts], s=8, label=name)
        times, gaps = [], []
        for r in group:
            if r.ttft is None:
                continue
            t = r.start + r.ttft
            for gap in r.itls:
                t += gap
                times.append(t)
                gaps.append(gap * 1000)
        step = max(1, len(times) // MAX_SCATTER_POINTS)
        axes[1].scatter(times[::step], gaps[::step], s=3, alpha=0.5, label=name)
    axes[0].set_ylabel("TTFT (ms)")
    axes[1].set_ylabel("inter-token latency (ms)")
    axes[1].set_xlabel("time since start (s): TTFT at the send time, ITL at the token's arrival")
    for ax in axes:
        _log_axis(ax, "y")
        ax.grid(True, which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8, markerscale=2)
    fig.suptitle(title or "latency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(points: list[dict[str, float]], path: Path, title: str = "") -> None:
    """points: dicts with concurrency, output_throughput and p99 latencies in seconds."""
    plt = _pyplot()
    xs = [p["concurrency"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    axes[0].plot(xs, [p["output_throughput"] for p in points], marker="o")
    axes[0].set_ylabel("output tokens / s")
    for key, label in (("ttft_p99", "TTFT p99"), ("itl_p99", "ITL p99"), ("e2e_p99", "end-to-end p99")):
        ys = [p.get(key) for p in points]
        if any(y is not None for y in ys):
            axes[1].plot(xs, [None if y is None else y * 1000 for y in ys], marker="o", label=label)
    axes[1].set_ylabel("latency (ms)")
    _log_axis(axes[1], "y")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("concurrency")
        _log_axis(ax, "x", ticks=xs)
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(title or "throughput and p99 latency vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


METRIC_LABELS = {"ttft": "TTFT", "itl": "inter-token latency", "e2e": "end-to-end latency"}


def plot_target_cdfs(
    runs: dict[str, list[RequestRecord]], path: Path, title: str = "", metrics: tuple[str, ...] = ("ttft", "e2e")
) -> None:
    """CDFs of the given metrics (ttft, itl, e2e), one line per target, on shared axes."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.2), squeeze=False)
    for label, records in runs.items():
        ok = [r for r in records if r.ok]
        for ax, metric in zip(axes[0], metrics):
            values = (
                [g for r in ok for g in r.itls]
                if metric == "itl"
                else [getattr(r, metric) for r in ok if getattr(r, metric) is not None]
            )
            _cdf(ax, values, label)
    for ax, metric in zip(axes[0], metrics):
        ax.set_xlabel(f"{METRIC_LABELS[metric]} (ms)")
        ax.set_ylabel("fraction of gaps" if metric == "itl" else "fraction of requests")
        _log_axis(ax)
        ax.grid(True, which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(title or "latency CDFs by target")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(groups: dict[str, dict[str, float]], path: Path, title: str = "") -> None:
    """One panel per metric, one bar per target: groups = {metric label: {target: value}}.
    Labels should say which way is better, e.g. "output tokens / s (higher is better)"."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4.2), squeeze=False)
    for ax, (metric, values) in zip(axes[0], groups.items()):
        names = list(values)
        bars = ax.bar(range(len(names)), [values[n] for n in names], color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, labels=[_short(values[n]) for n in names], fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
        ax.set_title(metric, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
