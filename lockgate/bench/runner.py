"""The bench as a library: a config in, a report out. The CLI is a thin layer over this."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import TextIO

import aiohttp

from lockgate.bench.arrivals import arrival_schedule
from lockgate.bench.loadgen import Level, LevelResult, connection_limit, run_level
from lockgate.bench.report import SLO, BenchReport, build_level_report
from lockgate.bench.workload import (
    ENDPOINTS,
    Payload,
    V2Target,
    fetch_v2_metadata,
    first_openai_model,
    is_shared_workload,
    load_shared_workload,
    openai_file_payloads,
    openai_payloads,
    openai_url,
    synthetic_prompts,
    v2_file_payloads,
    v2_payloads,
)
from lockgate.errors import BadRequest


@dataclass(frozen=True, slots=True)
class BenchConfig:
    url: str
    endpoint: str = "v2"
    model: str = ""
    model_version: str | None = None
    input_file: str | None = None
    batch_size: int = 1  # v2: rows per request
    num_payloads: int = 64  # distinct synthetic bodies
    max_tokens: int | None = None  # LLM; default 128, or the workload file's
    ignore_eos: bool = False
    prompt_words: tuple[int, int] = (8, 256)
    rates: tuple[float, ...] = ()
    concurrencies: tuple[int, ...] = ()
    arrival: str = "poisson"
    duration: float | None = None
    num_requests: int | None = None
    warmup: float = 0.0
    timeout: float = 60.0
    seed: int = 0
    slo: SLO = field(default_factory=SLO)
    max_connections: int | None = None
    keep_alive: bool = True  # False: a new connection per request

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise BadRequest(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if bool(self.rates) == bool(self.concurrencies):
            raise BadRequest("give exactly one of --rate and --concurrency")
        if (self.duration is None) == (self.num_requests is None):
            raise BadRequest("give exactly one of --duration and --num-requests")
        if any(r <= 0 for r in self.rates) or any(c < 1 for c in self.concurrencies):
            raise BadRequest("rates must be > 0 and concurrencies >= 1")
        if self.endpoint == "v2" and not self.model:
            raise BadRequest("--endpoint v2 needs --model")

    @property
    def llm(self) -> bool:
        return self.endpoint != "v2"

    def levels(self) -> list[Level]:
        common = {
            "duration": self.duration,
            "num_requests": self.num_requests,
            "warmup": self.warmup,
        }
        if self.rates:
            return [Level(rate=r, **common) for r in self.rates]  # type: ignore[arg-type]
        return [Level(concurrency=c, **common) for c in self.concurrencies]  # type: ignore[arg-type]


async def run_bench(
    config: BenchConfig, progress: TextIO | None = sys.stderr
) -> tuple[BenchReport, list[LevelResult]]:
    """Run every level in turn over one session and report each."""
    levels = config.levels()
    limit = config.max_connections or max(connection_limit(level) for level in levels)
    connector = aiohttp.TCPConnector(
        limit=limit, limit_per_host=limit, force_close=not config.keep_alive
    )
    timeout = aiohttp.ClientTimeout(total=config.timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model, url, payloads = await prepare(session, config)
        report = BenchReport(
            endpoint=config.endpoint,
            url=config.url,
            model=model,
            arrival=config.arrival if config.rates else None,
            seed=config.seed,
            slo=config.slo,
        )
        results = []
        for index, level in enumerate(levels):
            schedule = None
            if level.rate is not None:
                schedule = arrival_schedule(
                    level.rate,
                    config.arrival,
                    duration=level.duration,
                    num_requests=level.num_requests,
                    warmup=level.warmup,
                    seed=config.seed + index,
                )
            result = await run_level(
                session,
                url,
                payloads,
                level,
                schedule=schedule,
                stream=config.llm,
                progress=progress,
            )
            results.append(result)
            report.levels.append(build_level_report(result, config.slo, config.llm))
    return report, results


async def prepare(
    session: aiohttp.ClientSession, config: BenchConfig
) -> tuple[str, str, list[Payload]]:
    """(model name, POST URL, encoded bodies)."""
    if not config.llm:
        target = V2Target(config.url, config.model, config.model_version)
        if config.input_file:
            return config.model, target.infer_url, v2_file_payloads(config.input_file)
        metadata = await fetch_v2_metadata(session, target)
        bodies = v2_payloads(metadata, config.num_payloads, config.seed, config.batch_size)
        return config.model, target.infer_url, bodies
    model = config.model or await first_openai_model(session, config.url)
    url = openai_url(config.url, config.endpoint)
    if config.input_file and is_shared_workload(config.input_file):
        prompts, max_new = load_shared_workload(config.input_file)
        if config.max_tokens is not None:
            max_new = [config.max_tokens] * len(prompts)
        return (
            model,
            url,
            openai_payloads(config.endpoint, model, prompts, max_new, config.ignore_eos),
        )
    if config.input_file:
        return model, url, openai_file_payloads(config.input_file, model, config.ignore_eos)
    texts = synthetic_prompts(config.num_payloads, config.seed, *config.prompt_words)
    tokens = [config.max_tokens or 128] * len(texts)
    return model, url, openai_payloads(config.endpoint, model, texts, tokens, config.ignore_eos)


def run_bench_sync(
    config: BenchConfig, progress: TextIO | None = sys.stderr
) -> tuple[BenchReport, list[LevelResult]]:
    """run_bench on a fresh event loop (uvloop when installed)."""
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(run_bench(config, progress))
    except ImportError:
        return asyncio.run(run_bench(config, progress))
