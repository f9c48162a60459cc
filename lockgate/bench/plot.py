"""A PNG of latency (p50, p99) and goodput against offered load, for a sweep."""

from __future__ import annotations

from pathlib import Path

from lockgate.bench.report import BenchReport
from lockgate.errors import BadRequest


def plot_sweep(report: BenchReport, path: str | Path) -> None:
    """Needs matplotlib (the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BadRequest("--plot needs matplotlib: pip install matplotlib") from exc
    open_loop = all(level.offered_rate is not None for level in report.levels)
    xs = [(lv.offered_rate if open_loop else lv.concurrency) or 0 for lv in report.levels]
    llm = bool(report.levels) and report.levels[0].llm is not None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for name in ("p50", "p99"):
        if llm:
            ys = [getattr(lv.llm.ttft_ms, name) if lv.llm else 0.0 for lv in report.levels]
            label = f"TTFT {name}"
        else:
            ys = [getattr(lv.latency_ms, name) for lv in report.levels]
            label = f"latency {name}"
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("offered load (req/s)" if open_loop else "concurrency")
    ax.set_ylabel("ms")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if any(lv.goodput is not None for lv in report.levels):
        right = ax.twinx()
        goodput = [lv.goodput or 0.0 for lv in report.levels]
        throughput = [lv.throughput for lv in report.levels]
        right.plot(xs, throughput, color="gray", linestyle=":", marker=".", label="throughput")
        right.plot(xs, goodput, color="green", linestyle="--", marker="s", label="goodput")
        right.set_ylabel("req/s")
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, loc="upper left")
    ax.set_title(f"lockgate bench: {report.model} ({report.endpoint})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
