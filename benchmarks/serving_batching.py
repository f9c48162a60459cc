"""serving_batching: does dynamic batching turn overload into throughput?

The minilm embedding model (python backend: tokenizer + int8 ONNX, 1 thread) under open-loop
Poisson load at about twice its batch-1 capacity, served three ways from one server:

- `minilm_off`:    max_batch_size 1 (no batching); the queue fills and refuses with 503
- `minilm_window`: max_batch_size 32, fixed window max_queue_delay_us 5000, no SLO
- `minilm_slo`:    max_batch_size 32, latency_slo_ms 200, no fixed window

Baselines from the same run, with this process pinned to the server's core:
- batch-1 capacity: `Model.infer` on one sentence in a loop (rows/s);
- offline ceiling: the best rows/s over batch sizes 1..32 of the same loop.

Every config gets the same `max_queue_size` so refusals compare. A 503 is a refusal, never
throughput; throughput counts 200s only. Mean batch size comes from lockgate's /metrics.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.common import (
    SERVER_CORE,
    Context,
    LoadResult,
    Server,
    SuiteResult,
    Target,
    environment,
    median,
    metric,
    open_loop,
    pinned,
    run_async,
    running,
    scrape_metrics,
    start_lockgate,
    v2_body,
)
from benchmarks.serving_overhead import demo_model

SUITE = "serving_batching"
TARGET_FRACTION = 0.85
QUEUE_ROWS = 128  # max_queue_size for every config
LOAD_FACTOR = 2.0  # offered rate / batch-1 capacity
BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)
CONFIGS: dict[str, dict[str, Any]] = {
    "minilm_off": {
        "max_batch_size": 1,
        "dynamic_batching": {"max_queue_delay_us": 0, "max_queue_size": QUEUE_ROWS},
    },
    "minilm_window": {
        "max_batch_size": 32,
        "dynamic_batching": {"max_queue_delay_us": 5000, "max_queue_size": QUEUE_ROWS},
    },
    "minilm_slo": {
        "max_batch_size": 32,
        "dynamic_batching": {"max_queue_size": QUEUE_ROWS},
        "latency_slo_ms": 200,
    },
}
WORDS = tuple(
    [
        "the",
        "a",
        "model",
        "server",
        "request",
        "batch",
        "queue",
        "latency",
        "answer",
        "fast",
        "slow",
        "small",
        "large",
        "text",
        "sentence",
        "embedding",
        "vector",
        "search",
        "query",
        "document",
        "river",
        "city",
        "market",
        "morning",
        "evening",
        "people",
        "read",
        "write",
        "build",
        "measure",
        "time",
        "every",
        "second",
        "under",
        "load",
        "with",
        "without",
        "before",
        "after",
        "during",
        "report",
        "number",
        "engineer",
        "machine",
        "core",
        "memory",
        "network",
        "cache",
        "window",
        "policy",
    ]
)


# -- inputs ------------------------------------------------------------------------------


def sentences(count: int = 64, seed: int = 0) -> list[str]:
    """`count` made-up sentences of 8 to 16 words (about 10 to 20 tokens each)."""
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(WORDS, size=int(rng.integers(8, 17)))).capitalize() + "."
        for _ in range(count)
    ]


def text_batch(pool: list[str], rows: int, rng: np.random.Generator) -> np.ndarray:
    picked = rng.choice(len(pool), size=rows)
    return np.array([[pool[i].encode()] for i in picked], dtype=object)  # [rows, 1] BYTES


# -- offline baselines -------------------------------------------------------------------


@dataclass(slots=True)
class Offline:
    """rows/s of `Model.infer` in this process at each batch size."""

    rates: dict[int, float] = field(default_factory=dict)

    @property
    def batch1(self) -> float:
        return self.rates[1]

    @property
    def best_size(self) -> int:
        return max(self.rates, key=lambda b: self.rates[b])

    @property
    def ceiling(self) -> float:
        return self.rates[self.best_size]


def load_model(folder: Path) -> Any:
    from lockgate.core.config_files import load_model_config
    from lockgate.demo.minilm_model import Model

    model = Model()
    with pinned(SERVER_CORE):  # onnxruntime's threads inherit the affinity
        model.load(load_model_config(folder), folder / "1")
    return model


def offline_rates(model: Any, pool: list[str], sizes: tuple[int, ...], seconds: float) -> Offline:
    """Loop `model.infer` on random batches of each size for `seconds`; rows per second."""
    rng = np.random.default_rng(1)
    offline = Offline()
    with pinned(SERVER_CORE):
        for rows in sizes:
            batches = [text_batch(pool, rows, rng) for _ in range(16)]
            model.infer({"text": batches[0]})  # first call at a new shape allocates
            done, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds or done < 3:
                model.infer({"text": batches[done % len(batches)]})
                done += 1
            offline.rates[rows] = done * rows / elapsed
    return offline


# -- server ------------------------------------------------------------------------------


def write_repository(source: Path, dest: Path) -> Path:
    """One copy of the built minilm folder per config, with config.yaml rewritten."""
    base = yaml.safe_load((source / "config.yaml").read_text())
    for name, changes in CONFIGS.items():
        shutil.copytree(source, dest / name)
        config = {k: v for k, v in base.items() if k not in ("dynamic_batching", "latency_slo_ms")}
        config.update(changes, name=name)
        config["warmup"] = [{"name": "text", "batch_size": 1, "count": 2}]
        (dest / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


@dataclass(slots=True)
class ConfigRuns:
    """Repetitions of one config: the load results and the ceiling measured next to each."""

    runs: list[LoadResult] = field(default_factory=list)
    ceilings: list[float] = field(default_factory=list)
    batch_sizes: list[float] = field(default_factory=list)

    def med(self, pick: Any) -> float:
        return median([float(pick(r)) for r in self.runs])

    @property
    def ratio(self) -> float:
        return median([r.throughput / c for r, c in zip(self.runs, self.ceilings, strict=True)])


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    source = demo_model(ctx, "minilm")
    pool = sentences()
    bodies = tuple(v2_body({"text": np.array([[s.encode()]], dtype=object)}) for s in pool)
    model = load_model(source)
    ctx.say(SUITE, f"offline sweep over batch sizes {list(BATCH_SIZES)}")
    passes = [offline_rates(model, pool, BATCH_SIZES, ctx.scale(1.0)) for _ in range(2)]
    offline = Offline({b: median([p.rates[b] for p in passes]) for b in BATCH_SIZES})
    rates = ", ".join(f"B={b}: {r:.0f}" for b, r in offline.rates.items())
    ctx.say(SUITE, f"offline rows/s {rates}")
    rate = LOAD_FACTOR * offline.batch1
    repository = write_repository(source, ctx.work / "batching-repo")
    ctx.say(SUITE, "starting lockgate with the three minilm configs on core 0")
    server = start_lockgate(repository, ctx.work)
    with running(server):
        results = measure(ctx, server, bodies, rate, model, pool, offline.best_size)
    result = report(results, offline, rate)
    result.seconds = time.perf_counter() - started
    return result


def measure(
    ctx: Context,
    server: Server,
    bodies: tuple[bytes, ...],
    rate: float,
    model: Any,
    pool: list[str],
    best: int,
) -> dict[str, ConfigRuns]:
    results = {name: ConfigRuns() for name in CONFIGS}
    seconds = ctx.scale(8.0)
    for rep in range(1, ctx.repetitions + 1):
        ceiling = offline_rates(model, pool, (best,), ctx.scale(1.0)).ceiling
        for name in CONFIGS:
            target = Target(f"{server.url}/v2/models/{name}/infer", bodies)
            before = scrape_metrics(server.url)
            load = run_async(open_loop(target, rate, seconds, seed=rep))
            after = scrape_metrics(server.url)
            runs = results[name]
            runs.runs.append(load)
            runs.ceilings.append(ceiling)
            runs.batch_sizes.append(mean_batch(before, after, name))
            ctx.say(
                SUITE,
                f"rep {rep}: {name:13} offered {load.offered_rate:.0f}/s served "
                f"{load.throughput:.0f}/s ({load.throughput / ceiling:.0%} of ceiling "
                f"{ceiling:.0f}), p50 {load.p(50) * 1e3:.0f} ms p99 {load.p(99) * 1e3:.0f} ms, "
                f"503s {load.refused}, errors {load.errors}, "
                f"mean batch {runs.batch_sizes[-1]:.1f}",
            )
    return results


def mean_batch(before: dict[str, float], after: dict[str, float], model: str) -> float:
    rows = metric(after, "lockgate_batch_size_sum", model) - metric(
        before, "lockgate_batch_size_sum", model
    )
    count = metric(after, "lockgate_batch_size_count", model) - metric(
        before, "lockgate_batch_size_count", model
    )
    return rows / count if count else float("nan")


# -- report ------------------------------------------------------------------------------


def report(results: dict[str, ConfigRuns], offline: Offline, rate: float) -> SuiteResult:
    attainable = min(1.0, rate / offline.ceiling)  # as a fraction of the ceiling
    slo = results["minilm_slo"]
    result = SuiteResult(
        suite=SUITE,
        title=f"Dynamic batching: minilm at {LOAD_FACTOR:g}x batch-1 capacity (open loop)",
        target=(
            f"with latency_slo_ms, throughput ≥ {TARGET_FRACTION:.0%} of the offline ceiling "
            "(or of the offered rate, when that is lower)"
        ),
        met=slo.ratio >= TARGET_FRACTION * attainable,
        environment=environment(),
    )
    result.add("batch-1 capacity (in-process)", offline.batch1, "rows/s")
    result.add(
        f"offline ceiling (in-process, best B={offline.best_size})",
        offline.ceiling,
        "rows/s",
        baseline_label="batch-1 capacity",
        baseline=offline.batch1,
    )
    result.add(
        "offered rate (Poisson)",
        rate,
        "req/s",
        baseline_label="offline ceiling",
        baseline=offline.ceiling,
    )
    for name, runs in results.items():
        served = runs.med(lambda r: r.throughput)
        ceiling = median(runs.ceilings)
        result.add(
            f"{name}: throughput",
            served,
            "req/s",
            baseline_label="offline ceiling",
            baseline=ceiling,
            note=f"ratio median per repetition {runs.ratio:.2f}",
        )
        result.add(f"{name}: p50", runs.med(lambda r: r.p(50)) * 1e3, "ms")
        result.add(f"{name}: p99", runs.med(lambda r: r.p(99)) * 1e3, "ms")
        result.add(
            f"{name}: refused (503) per run",
            runs.med(lambda r: r.refused),
            "req",
            note=f"of {runs.med(lambda r: sum(r.statuses.values())):.0f} sent",
        )
        result.add(f"{name}: errors per run", runs.med(lambda r: r.errors), "req")
        result.add(f"{name}: mean batch size", median(runs.batch_sizes), "rows")
    result.notes.append(
        f"max_queue_size {QUEUE_ROWS} rows in every config; latency counts from the "
        "scheduled send time and covers successful requests only."
    )
    result.raw = {
        "offline_rows_per_s": offline.rates,
        "offered_rate": rate,
        **{
            name: [
                run_json(r, c, b)
                for r, c, b in zip(runs.runs, runs.ceilings, runs.batch_sizes, strict=True)
            ]
            for name, runs in results.items()
        },
    }
    return result


def run_json(run: LoadResult, ceiling: float, batch: float) -> dict[str, Any]:
    return {
        "throughput": run.throughput,
        "offered": run.offered_rate,
        "ceiling": ceiling,
        "p50_s": run.p(50),
        "p99_s": run.p(99),
        "statuses": dict(run.statuses),
        "mean_batch": batch,
    }
