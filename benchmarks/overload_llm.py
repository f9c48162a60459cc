"""overload_llm: does the overload promise hold for a language model? SmolLM2 with a TTFT SLO.

`python -m benchmarks.run --suite overload_llm [--quick]`

The demo's SmolLM2 (bf16) with `ttft_slo_ms: 2000`, served by one lockgate pinned to the server
core (the client on the other). Each request streams a completion of 32 tokens
(`ignore_eos`) for a prompt of about 100 tokens through `/v1/completions`:

1. Warm-up at a light load, then at the saturating load (so that the engine has run the batch
   shapes and admission has measured the step times of a busy engine); both discarded.
2. Capacity: completions per second under an open-loop load far above what the engine serves
   (admission refuses what would miss the TTFT SLO), in the same run.
3. Levels: open-loop Poisson arrivals at 0.5, 1, 1.5, 3 and 10 times that capacity, with
   liveness probes every 50 ms from a process of their own.

Per level: completions per second, goodput (completions whose first token came inside the
SLO, per second, and as a share of capacity), TTFT p50/p99 of admitted requests from the
*scheduled* send time, refusals (503 before any token) and how fast they came, requests that
failed otherwise, requests lost (sent - answered), the liveness p99, and the p50/p99 of the
server's observed/predicted TTFT (`lockgate_llm_ttft_prediction_ratio`, to its bucket bounds:
how well admission predicted the engine-side TTFT of what it admitted).

Targets (at every level >= 1x): admitted TTFT p99 <= the SLO, goodput >= 90% of capacity,
nothing lost, no failure other than a refusal, liveness p99 <= 50 ms.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from benchmarks.common import (
    Context,
    Server,
    SuiteResult,
    environment,
    free_port,
    percentile,
    running,
    scrape_metrics,
    start_server,
)
from benchmarks.overload_real import (
    GOODPUT_TARGET,
    LEVELS,
    LIVENESS_TARGET_S,
    probes_of,
    start_prober,
)

SUITE = "overload_llm"
MODEL = "SmolLM2-135M-Instruct"
RATIO_METRIC = "lockgate_llm_ttft_prediction_ratio"
LEVEL_S, QUICK_LEVEL_S = 20.0, 8.0
WARM_SATURATED_S = 5.0
TTFT_SLO_S = 2.0
MAX_TOKENS = 32
CLIENT_TIMEOUT_S = 120.0
SATURATE_RATE = 20.0  # requests per second: far above what one core completes
WORDS = [
    "the",
    "engine",
    "batches",
    "the",
    "prompts",
    "of",
    "many",
    "clients",
    "and",
    "streams",
    "their",
    "tokens",
    "while",
    "a",
    "new",
    "request",
    "waits",
    "only",
    "as",
    "long",
    "as",
    "its",
    "first",
    "token",
    "allows",
    "under",
    "the",
    "service",
    "level",
    "objective",
]


def prompts(count: int = 64, words: int = 80, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


@dataclass(slots=True)
class Outcome:
    status: int  # 0: transport failure or timeout
    ttft: float = float("nan")  # s from the scheduled send to the first token
    answered: float = float("nan")  # s from the scheduled send to the answer's end


@dataclass(slots=True)
class Level:
    name: str
    factor: float
    seconds: float
    sent: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    health: list[float] = field(default_factory=list)
    ratio_p50: float = float("nan")  # observed / predicted TTFT, server side
    ratio_p99: float = float("nan")

    def ttfts(self) -> list[float]:
        return [o.ttft for o in self.outcomes if o.status == 200]

    def count(self, *statuses: int) -> int:
        return sum(1 for o in self.outcomes if o.status in statuses)

    @property
    def lost(self) -> int:
        return self.sent - len(self.outcomes)

    @property
    def completions(self) -> float:
        return self.count(200) / self.seconds

    @property
    def goodput(self) -> float:
        return sum(1 for t in self.ttfts() if t <= TTFT_SLO_S) / self.seconds


async def _stream(
    session: aiohttp.ClientSession, url: str, prompt: str, scheduled: float, level: Level
) -> None:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    outcome = Outcome(0)
    try:
        async with session.post(url, json=body) as response:
            outcome.status = response.status
            async for line in response.content:
                if line.startswith(b"data: {") and math.isnan(outcome.ttft):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        outcome.ttft = time.perf_counter() - scheduled
            outcome.answered = time.perf_counter() - scheduled
    except (aiohttp.ClientError, TimeoutError):
        outcome.status = 0
    if outcome.status == 200 and math.isnan(outcome.ttft):
        outcome.status = -1  # a 200 with no token: a failure
    level.outcomes.append(outcome)


async def open_loop(base: str, texts: list[str], rate: float, level: Level, seed: int) -> None:
    url = f"{base}/v1/completions"
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=1024)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        pending: set[asyncio.Task[None]] = set()
        start = time.perf_counter()
        offset = rng.expovariate(rate)
        while offset < level.seconds:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = texts[level.sent % len(texts)]
            task = asyncio.create_task(_stream(session, url, prompt, start + offset, level))
            pending.add(task)
            task.add_done_callback(pending.discard)
            level.sent += 1
            offset += rng.expovariate(rate)
        await asyncio.gather(*pending)


def ratio_buckets(url: str) -> dict[float, float]:
    """The cumulative buckets of the model's observed/predicted TTFT histogram, by bound."""
    label = f'model_name="{MODEL}"'
    return {
        float(key.split('le="')[1].split('"')[0]): value
        for key, value in scrape_metrics(url).items()
        if key.startswith(RATIO_METRIC + "_bucket{") and label in key
    }


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The bound of the bucket that holds the q-th percentile of what was observed between
    two scrapes; nan for nothing observed."""
    counts = sorted((le, n - before.get(le, 0.0)) for le, n in after.items())
    total = counts[-1][1] if counts else 0.0
    return next((le for le, n in counts if total > 0 and n >= q / 100 * total), float("nan"))


def measure(server: Server, level: Level, texts: list[str], rate: float, seed: int) -> Level:
    before = ratio_buckets(server.url)
    prober = start_prober(server.url, level.seconds)
    asyncio.run(open_loop(server.url, texts, rate, level, seed))
    level.health = probes_of(prober)
    after = ratio_buckets(server.url)
    level.ratio_p50 = bucket_quantile(before, after, 50)
    level.ratio_p99 = bucket_quantile(before, after, 99)
    return level


def describe(level: Level, capacity: float) -> str:
    ttft = level.ttfts()
    refused = [o.answered for o in level.outcomes if o.status == 503]
    return (
        f"{level.name}: offered {level.sent / level.seconds:.2f}/s, completed "
        f"{level.completions:.2f}/s, goodput {level.goodput:.2f}/s "
        f"({level.goodput / capacity if capacity else float('nan'):.0%}), TTFT p50/p99 "
        f"{percentile(ttft, 50) * 1e3:.0f}/{percentile(ttft, 99) * 1e3:.0f} ms, refused "
        f"{len(refused)} (p99 {percentile(refused, 99) * 1e3:.0f} ms), other failures "
        f"{sum(1 for o in level.outcomes if o.status not in (200, 503))}, lost {level.lost}, "
        f"liveness p99 {percentile(level.health, 99) * 1e3:.1f} ms, observed/predicted TTFT "
        f"p50/p99 <= {level.ratio_p50:g}/{level.ratio_p99:g}"
    )


def failures(level: Level, capacity: float) -> list[str]:
    checks = {
        "TTFT p99": percentile(level.ttfts(), 99) <= TTFT_SLO_S,
        "goodput": capacity > 0 and level.goodput >= GOODPUT_TARGET * capacity,
        "nothing lost": level.lost == 0,
        "no failures": all(o.status in (200, 503) for o in level.outcomes),
        "liveness": percentile(level.health, 99) <= LIVENESS_TARGET_S,
    }
    return [f"{level.name}: {name}" for name, ok in checks.items() if not ok]


def write_repository(work: Path) -> Path:
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository

    llm = [m for m in DEMO_MODELS if m.name == "smollm2"]
    repo = build_demo_repository(work / "repo", models=llm)
    path = repo / "smollm2" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["parameters"].update({"ttft_slo_ms": str(int(TTFT_SLO_S * 1000))})
    path.unlink()  # the build may hard-link it: write a file of its own
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return repo


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    repo = write_repository(ctx.work)
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repo), "--port", str(port)]
    command += ["--grpc-port", "off"]
    server = start_server("lockgate", command, port, ctx.work, timeout=600)
    texts = prompts()
    seconds = QUICK_LEVEL_S if ctx.quick else LEVEL_S
    levels: list[Level] = []
    with running(server):
        measure(server, Level("warm", 0, 5.0), texts, 0.5, 0)
        measure(server, Level("warm-saturated", 0, WARM_SATURATED_S), texts, SATURATE_RATE, 2)
        time.sleep(3.0)
        saturated = measure(server, Level("capacity", 0, seconds), texts, SATURATE_RATE, 1)
        capacity = saturated.completions
        ctx.say(SUITE, f"capacity {capacity:.2f} completions/s ({describe(saturated, capacity)})")
        for i, factor in enumerate(LEVELS):
            time.sleep(3.0)
            level = Level(f"{factor:g}x", factor, seconds)
            levels.append(measure(server, level, texts, factor * capacity, 10 + i))
            ctx.say(SUITE, describe(level, capacity))
    missed = [f for lv in levels if lv.factor >= 1 for f in failures(lv, capacity)]
    result = SuiteResult(
        suite=SUITE,
        title="Overload on a language model: SmolLM2 with a 2 s TTFT SLO, 0.5x to 10x",
        target=(
            "at every level >= 1x: admitted TTFT p99 <= 2 s, goodput >= "
            f"{GOODPUT_TARGET:.0%} of capacity, nothing lost, no failure but refusals, "
            f"liveness p99 <= {LIVENESS_TARGET_S * 1e3:g} ms"
        ),
        met=not missed,
        environment=environment(),
    )
    result.add("capacity", capacity, "completions/s", note=f"{MAX_TOKENS} tokens each")
    for level in levels:
        result.add(
            f"{level.name}: goodput",
            level.goodput,
            "completions/s",
            baseline_label="capacity",
            baseline=capacity,
            note=describe(level, capacity),
        )
    result.notes += [
        f"Server pinned to one core; {MAX_TOKENS}-token streamed completions of ~100-token "
        "prompts; TTFT from the scheduled send time.",
        "Missed: " + ("; ".join(missed) if missed else "nothing"),
    ]
    result.raw = {
        "capacity": capacity,
        "levels": [
            {
                "name": lv.name,
                "sent": lv.sent,
                "statuses": dict(Counter(o.status for o in lv.outcomes)),
                "goodput": lv.goodput,
                "ttft_p50_s": percentile(lv.ttfts(), 50),
                "ttft_p99_s": percentile(lv.ttfts(), 99),
                "liveness_p99_s": percentile(lv.health, 99),
                "ttft_ratio_p50_le": lv.ratio_p50,
                "ttft_ratio_p99_le": lv.ratio_p99,
            }
            for lv in levels
        ],
    }
    result.seconds = time.perf_counter() - started
    return result
