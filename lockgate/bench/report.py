"""Bench reports: per-level statistics, goodput, client-overhead warnings, JSON and CSV."""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lockgate.bench.client import RequestRecord
from lockgate.bench.loadgen import LevelResult
from lockgate.bench.stats import Summary

SEND_LAG_WARN_MS = 1.0
CLIENT_CPU_WARN = 0.9  # of one core


@dataclass(frozen=True, slots=True)
class SLO:
    latency_ms: float | None = None  # classic requests: end-to-end
    ttft_ms: float | None = None  # LLM: time to first token
    tpot_ms: float | None = None  # LLM: time per output token

    def met(self, record: RequestRecord, llm: bool) -> bool:
        if not record.ok:
            return False
        if not llm:
            return self.latency_ms is None or record.latency * 1e3 <= self.latency_ms
        ttft, tpot = record.ttft, record.tpot
        ttft_ok = self.ttft_ms is None or (ttft is not None and ttft * 1e3 <= self.ttft_ms)
        tpot_ok = self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms
        return ttft_ok and tpot_ok

    def given(self, llm: bool) -> bool:
        if llm:
            return self.ttft_ms is not None or self.tpot_ms is not None
        return self.latency_ms is not None


@dataclass(slots=True)
class LLMStats:
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    output_tokens_per_s: float
    total_output_tokens: int
    total_prompt_tokens: int
    total_tokens: int
    goodput_output_tokens_per_s: float | None


@dataclass(slots=True)
class LevelReport:
    mode: str  # "open" | "closed"
    offered_rate: float | None
    concurrency: int | None
    duration_s: float  # measured window: first measured send to last measured answer
    requests: int  # measured, sent
    completed: int  # measured, answered successfully
    errors: dict[str, int]
    sent_rate: float  # measured requests over the span of their send times
    throughput: float  # completed per second
    latency_ms: Summary
    goodput: float | None  # requests per second meeting the SLO
    goodput_fraction: float | None  # of the measured requests
    send_lag_ms: Summary
    loop_lag_ms: Summary
    client_cpu_ms_per_request: float
    client_cpu_util: float  # cores
    llm: LLMStats | None = None
    warnings: list[str] = field(default_factory=list)


def build_level_report(result: LevelResult, slo: SLO, llm: bool) -> LevelReport:
    measured = [r for r in result.records if not r.warmup]
    ok = [r for r in measured if r.ok]
    window = _window(measured)
    good = [r for r in measured if slo.met(r, llm)]
    per_request = result.client_cpu_s / max(1, len(result.records))
    report = LevelReport(
        mode="open" if result.level.rate is not None else "closed",
        offered_rate=result.level.rate,
        concurrency=result.level.concurrency,
        duration_s=window,
        requests=len(measured),
        completed=len(ok),
        errors=dict(Counter(r.error for r in measured if r.error is not None)),
        sent_rate=_sent_rate(measured, result.level.rate),
        throughput=len(ok) / window if window > 0 else 0.0,
        latency_ms=Summary.of([r.latency for r in ok], 1e3),
        goodput=len(good) / window if slo.given(llm) and window > 0 else None,
        goodput_fraction=len(good) / len(measured) if slo.given(llm) and measured else None,
        send_lag_ms=Summary.of([r.send_lag for r in measured], 1e3),
        loop_lag_ms=Summary.of(result.loop_lag, 1e3),
        client_cpu_ms_per_request=per_request * 1e3,
        client_cpu_util=result.client_cpu_s / result.wall_s if result.wall_s > 0 else 0.0,
        llm=_llm_stats(ok, good, window) if llm else None,
    )
    report.warnings = _warnings(report)
    return report


def _window(measured: list[RequestRecord]) -> float:
    if not measured:
        return 0.0
    return max(r.finished for r in measured) - min(r.scheduled for r in measured)


def _sent_rate(measured: list[RequestRecord], rate: float | None) -> float:
    """Requests per second as actually scheduled (a Poisson sample differs from the rate)."""
    if not measured:
        return 0.0
    span = max(r.scheduled for r in measured) - min(r.scheduled for r in measured)
    span += 1.0 / rate if rate else 0.0  # the last request's own interval
    return len(measured) / span if span > 0 else 0.0


def _llm_stats(ok: list[RequestRecord], good: list[RequestRecord], window: float) -> LLMStats:
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    per_s = 1.0 / window if window > 0 else 0.0
    return LLMStats(
        ttft_ms=Summary.of([t for r in ok if (t := r.ttft) is not None], 1e3),
        tpot_ms=Summary.of([t for r in ok if (t := r.tpot) is not None], 1e3),
        itl_ms=Summary.of([gap for r in ok for gap in r.itls()], 1e3),
        output_tokens_per_s=out_tokens * per_s,
        total_output_tokens=out_tokens,
        total_prompt_tokens=prompt_tokens,
        total_tokens=out_tokens + prompt_tokens,
        goodput_output_tokens_per_s=sum(r.output_tokens for r in good) * per_s,
    )


def _warnings(report: LevelReport) -> list[str]:
    warnings = []
    if report.mode == "open" and report.send_lag_ms.p99 > SEND_LAG_WARN_MS:
        warnings.append(
            f"client fell behind schedule: send lag p99 {report.send_lag_ms.p99:.2f} ms "
            f"(max {report.send_lag_ms.max:.1f} ms); latencies include it, but the client "
            "may be the bottleneck"
        )
    if report.client_cpu_util > CLIENT_CPU_WARN:
        warnings.append(
            f"client used {report.client_cpu_util:.2f} cores: the client, not the server, "
            "may be the bottleneck"
        )
    if report.mode == "open" and report.throughput < 0.9 * report.sent_rate:
        warnings.append(
            f"the server fell behind: {report.throughput:.1f}/s completed of "
            f"{report.sent_rate:.1f}/s sent"
        )
    return warnings


@dataclass(slots=True)
class BenchReport:
    endpoint: str
    url: str
    model: str
    arrival: str | None
    seed: int
    slo: SLO
    levels: list[LevelReport] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return _finite(asdict(self))

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def write_csv(self, path: str | Path) -> None:
        rows = [level_row(level) for level in self.levels]
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else [])
            writer.writeheader()
            writer.writerows(rows)


def level_row(level: LevelReport) -> dict[str, Any]:
    """One flat CSV row per level."""
    row: dict[str, Any] = {
        "mode": level.mode,
        "offered_rate": level.offered_rate,
        "concurrency": level.concurrency,
        "duration_s": level.duration_s,
        "requests": level.requests,
        "completed": level.completed,
        "errors": sum(level.errors.values()),
        "sent_rate": level.sent_rate,
        "throughput": level.throughput,
        "goodput": level.goodput,
        "goodput_fraction": level.goodput_fraction,
        "send_lag_p99_ms": level.send_lag_ms.p99,
        "client_cpu_util": level.client_cpu_util,
    }
    for name in ("p50", "p90", "p95", "p99", "max", "mean"):
        row[f"latency_{name}_ms"] = getattr(level.latency_ms, name)
    if level.llm is not None:
        for metric in ("ttft", "tpot", "itl"):
            summary: Summary = getattr(level.llm, f"{metric}_ms")
            row[f"{metric}_p50_ms"], row[f"{metric}_p99_ms"] = summary.p50, summary.p99
        row["output_tokens_per_s"] = level.llm.output_tokens_per_s
        row["total_tokens"] = level.llm.total_tokens
    return row


def write_requests_csv(path: str | Path, results: list[LevelResult]) -> None:
    """One row per request of every level, times in ms from the level's first send."""
    fields = [
        "level",
        "warmup",
        "scheduled_ms",
        "send_lag_ms",
        "latency_ms",
        "status",
        "error",
        "ttft_ms",
        "tpot_ms",
        "output_tokens",
    ]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(fields)
        for result in results:
            origin = min((r.scheduled for r in result.records), default=0.0)
            for r in result.records:
                ttft, tpot = r.ttft, r.tpot
                writer.writerow(
                    [
                        result.level.label,
                        r.warmup,
                        f"{(r.scheduled - origin) * 1e3:.3f}",
                        f"{r.send_lag * 1e3:.3f}",
                        f"{r.latency * 1e3:.3f}",
                        r.status,
                        r.error or "",
                        "" if ttft is None else f"{ttft * 1e3:.3f}",
                        "" if tpot is None else f"{tpot * 1e3:.3f}",
                        r.output_tokens,
                    ]
                )


def _finite(value: Any) -> Any:
    """NaN and infinity become null, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def render_level(level: LevelReport) -> str:
    """A few readable lines for the terminal."""
    load = f"rate {level.offered_rate:g}/s" if level.offered_rate else f"c={level.concurrency}"
    lat = level.latency_ms
    lines = [
        f"{load}: {level.completed}/{level.requests} ok in {level.duration_s:.1f}s, "
        f"{level.throughput:.1f} req/s",
        f"  latency ms  p50 {lat.p50:.2f}  p90 {lat.p90:.2f}  p95 {lat.p95:.2f}  "
        f"p99 {lat.p99:.2f}  max {lat.max:.2f}  mean {lat.mean:.2f}",
    ]
    if level.goodput is not None and level.goodput_fraction is not None:
        lines.append(f"  goodput {level.goodput:.1f}/s ({level.goodput_fraction:.1%})")
    if level.errors:
        lines.append("  errors " + ", ".join(f"{k} {v}" for k, v in sorted(level.errors.items())))
    if level.llm is not None:
        llm = level.llm
        lines.append(
            f"  TTFT ms p50 {llm.ttft_ms.p50:.1f} p99 {llm.ttft_ms.p99:.1f}  "
            f"TPOT ms p50 {llm.tpot_ms.p50:.2f} p99 {llm.tpot_ms.p99:.2f}  "
            f"ITL ms p50 {llm.itl_ms.p50:.2f} p99 {llm.itl_ms.p99:.2f}"
        )
        lines.append(
            f"  output {llm.output_tokens_per_s:.1f} tok/s, {llm.total_tokens} tokens in total"
        )
    lines.append(
        f"  client: send lag p99 {level.send_lag_ms.p99:.2f} ms, loop lag p99 "
        f"{level.loop_lag_ms.p99:.2f} ms, {level.client_cpu_ms_per_request:.3f} ms CPU/request, "
        f"{level.client_cpu_util:.2f} cores"
    )
    lines += [f"  WARNING: {w}" for w in level.warnings]
    return "\n".join(lines)
