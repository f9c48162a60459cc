"""router_prefix: prefix-aware routing against least-load, on a workload of shared system prompts.

`python -m benchmarks.run --suite router_prefix [--quick]`

Two replicas of the demo's SmolLM2 (bf16), each `lockgate serve` pinned to a core of its own
(cores 0 and 1 when pinning is available), and two routers in front of both: one with
`--llm-routing least-load`, one with `--llm-routing prefix` (`--prefix-chars 512`, margin 4).
Each replica's KV cache is kept small on purpose (`kv_cache_blocks: 96`, 1,536 tokens): it holds
about four of the eight system prompts beside the running sequences, as a real cache holds a
fraction of a real service's prompts. With least-load each replica sees all eight prompts and
its cache turns over; with prefix routing each replica sees about half of them.

Workload, per policy and repetition (fresh prompts each time, so no run inherits another's
cache): 8 system prompts of about 300 tokens (measured: the `usage` of the answers), each shared
by 64 chat requests (16 with `--quick`) whose user message is a unique question of about 20
words. The requests are shuffled and sent by 4 clients in a closed loop, streamed, 8 tokens each
(`ignore_eos`, temperature 0). The share of prompt tokens in the shared system prompt is
reported.

The replicas run with their front-end overload gates off (`--max-loop-lag-ms 0
--queue-target-ms 0`): four clients cannot overload them, and on a busy machine the gates'
refusals would turn the comparison into one of refusals.

Reported per policy: the prefix-cache hit rate (hit tokens / looked-up tokens, from the
replicas' `lockgate_llm_prefix_cache_{hits,queries}_total`, summed over both), and the TTFT p50
and p99 (send to the first streamed token, at the client), with prefix/least-load ratios from
the same run. The policies alternate in order between repetitions. The router, the clients and
the replicas share the machine's cores, so the TTFT figures are noisy.

Target: prefix-aware routing gives a higher hit rate and a lower TTFT p50 than least-load.
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
    median,
    percentile,
    pin_command,
    pinning_available,
    running,
    scrape_metrics,
    start_server,
)

SUITE = "router_prefix"
MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("least-load", "prefix")
SYSTEMS = 8
PER_SYSTEM, QUICK_PER_SYSTEM = 64, 16
SYSTEM_WORDS = 230  # about 300 tokens with SmolLM2's tokenizer (the run measures it)
QUESTION_WORDS = 20
CONCURRENCY = 4
MAX_TOKENS = 8
KV_CACHE_BLOCKS = 96  # of 16 tokens: about four system prompts and the running sequences
TEXT = (
    "you are a careful assistant for the support team of a company that sells garden tools "
    "answer every customer question politely and briefly cite the manual when you can never "
    "promise refunds without checking the order history first and always ask for the order "
    "number when it is missing keep a friendly tone avoid jargon explain each step in plain "
    "words offer to escalate to a human agent if the customer is unhappy or the problem is "
    "about safety mention the warranty period of two years for motors and five years for blades"
)
VOCABULARY = TEXT.split()


@dataclass(slots=True)
class Outcome:
    status: int  # 0: transport failure
    ttft: float = math.nan  # seconds from sending to the first streamed token
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class Run:
    policy: str
    outcomes: list[Outcome] = field(default_factory=list)
    hits: float = 0.0  # prefix-cache tokens found, over both replicas
    queries: float = 0.0  # prefix-cache tokens looked up
    seconds: float = 0.0
    routed: dict[str, float] = field(default_factory=dict)  # the router's own counters

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else math.nan

    def ttfts(self) -> list[float]:
        return [o.ttft for o in self.outcomes if o.status == 200 and not math.isnan(o.ttft)]

    @property
    def failed(self) -> int:
        return sum(1 for o in self.outcomes if o.status != 200 or math.isnan(o.ttft))

    def statuses(self) -> dict[str, int]:
        return dict(Counter(str(o.status) for o in self.outcomes))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


def workload(seed: int, per_system: int) -> tuple[list[str], list[dict]]:
    """The system prompts and the shuffled chat requests that share them."""
    rng = random.Random(seed)
    systems = [f"Policy {seed}-{i}. " + _words(rng, SYSTEM_WORDS) + "." for i in range(SYSTEMS)]
    requests = []
    for i, system in enumerate(systems):
        for j in range(per_system):
            question = f"Question {i}-{j}: " + _words(rng, QUESTION_WORDS) + "?"
            requests.append(
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
    rng.shuffle(requests)
    return systems, requests


async def _ask(session: aiohttp.ClientSession, url: str, request: dict) -> Outcome:
    outcome = Outcome(0)
    started = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=request) as response:
            outcome.status = response.status
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and math.isnan(outcome.ttft):
                    outcome.ttft = time.perf_counter() - started
                usage = chunk.get("usage")
                if usage:
                    outcome.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    outcome.cached_tokens = details.get("cached_tokens", 0)
    except (aiohttp.ClientError, TimeoutError):
        outcome.status = 0
    return outcome


async def closed_loop(url: str, requests: list[dict], concurrency: int) -> list[Outcome]:
    queue = list(reversed(requests))
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            while queue:
                outcomes.append(await _ask(session, url, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def _cache_totals(replicas: list[Server]) -> tuple[float, float]:
    hits = queries = 0.0
    for replica in replicas:
        for key, value in scrape_metrics(replica.url).items():
            name = key.split("{")[0]
            if name == "lockgate_llm_prefix_cache_hits_total":
                hits += value
            elif name == "lockgate_llm_prefix_cache_queries_total":
                queries += value
    return hits, queries


def _routed(router: Server) -> dict[str, float]:
    wanted = ("lockgate_router_attempts_total", "lockgate_router_llm_routing_total")
    return {k: v for k, v in scrape_metrics(router.url).items() if k.split("{")[0] in wanted}


def measure(policy: str, router: Server, replicas: list[Server], requests: list[dict]) -> Run:
    run = Run(policy)
    hits, queries = _cache_totals(replicas)
    routed = _routed(router)
    started = time.perf_counter()
    run.outcomes = asyncio.run(closed_loop(router.url, requests, CONCURRENCY))
    run.seconds = time.perf_counter() - started
    after_hits, after_queries = _cache_totals(replicas)
    run.hits, run.queries = after_hits - hits, after_queries - queries
    run.routed = {k: v - routed.get(k, 0.0) for k, v in _routed(router).items()}
    return run


def describe(run: Run) -> str:
    ttft = run.ttfts()
    return (
        f"{run.policy}: hit rate {run.hit_rate:.1%}, TTFT p50/p99 "
        f"{percentile(ttft, 50) * 1e3:.0f}/{percentile(ttft, 99) * 1e3:.0f} ms, "
        f"{len(run.outcomes) / run.seconds:.2f} requests/s, statuses {run.statuses()}"
    )


def write_repository(work: Path) -> Path:
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository

    llm = [m for m in DEMO_MODELS if m.name == "smollm2"]
    repo = build_demo_repository(work / "repo", models=llm)
    path = repo / "smollm2" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["parameters"].pop("kv_cache_gib", None)
    config["parameters"].update({"kv_cache_blocks": str(KV_CACHE_BLOCKS), "max_model_len": "1024"})
    path.unlink()  # the build may hard-link it: write a file of its own
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return repo


def start_replica(repo: Path, work: Path, core: int) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repo), "--port", str(port)]
    # the replicas' front-end gates (loop lag, queue delay) are off: 4 clients in a closed loop
    # cannot overload two replicas, and on a busy machine the gates' refusals would make the
    # comparison one of refusals rather than of routing
    command += ["--grpc-port", "off", "--max-loop-lag-ms", "0", "--queue-target-ms", "0"]
    command = pin_command(command, core)
    return start_server(f"replica{core}", command, port, work, timeout=600, pinned=False)


def start_router(replicas: list[Server], work: Path, policy: str) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "route", "--port", str(port), "--no-hedge"]
    command += [a for r in replicas for a in ("--replica", r.url)]
    command += ["--llm-routing", policy]
    return start_server(f"router-{policy}", command, port, work, pinned=False)


def system_tokens(replica: Server, system: str) -> int:
    """Tokens of a system prompt alone, as the replica counts them."""
    import urllib.request

    body = {"model": MODEL, "prompt": system, "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(
        replica.url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(json.loads(response.read())["usage"]["prompt_tokens"])


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    repo = write_repository(ctx.work)
    per_system = QUICK_PER_SYSTEM if ctx.quick else PER_SYSTEM
    replicas = [start_replica(repo, ctx.work, core) for core in (0, 1)]
    with running(*replicas):
        routers = {policy: start_router(replicas, ctx.work, policy) for policy in POLICIES}
        with running(*routers.values()):
            _, warm = workload(seed=999, per_system=2)
            asyncio.run(closed_loop(routers["least-load"].url, warm, CONCURRENCY))
            runs: dict[str, list[Run]] = {policy: [] for policy in POLICIES}
            shared: list[float] = []
            for rep in range(ctx.repetitions):
                order = POLICIES if rep % 2 == 0 else tuple(reversed(POLICIES))
                for policy in order:
                    systems, requests = workload(100 * rep + POLICIES.index(policy), per_system)
                    result = measure(policy, routers[policy], replicas, requests)
                    runs[policy].append(result)
                    ctx.say(SUITE, f"repetition {rep + 1}: {describe(result)}")
                    prompts = [o.prompt_tokens for o in result.outcomes if o.prompt_tokens]
                    if prompts:
                        tokens = system_tokens(replicas[0], systems[0])
                        shared.append(tokens / (sum(prompts) / len(prompts)))
    return report(ctx, runs, shared, per_system, time.perf_counter() - started)


def _routing(routed: dict[str, float]) -> str:
    """Attempts per replica and how replicas were chosen, from the router's counters."""
    replicas: Counter[str] = Counter()
    choices: Counter[str] = Counter()
    for key, value in routed.items():
        labels = dict(p.split("=", 1) for p in key.partition("{")[2].rstrip("}").split(","))
        if key.startswith("lockgate_router_attempts_total"):
            replicas[labels["replica"].strip('"').rsplit(":", 1)[1]] += int(value)
        else:
            choices[labels["choice"].strip('"')] += int(value)
    per_replica = ", ".join(f"port {port}: {n}" for port, n in sorted(replicas.items()))
    chosen = ", ".join(f"{choice} {n}" for choice, n in sorted(choices.items()))
    return f"attempts by replica ({per_replica}); choices ({chosen})"


def report(
    ctx: Context, runs: dict[str, list[Run]], shared: list[float], per_system: int, seconds: float
) -> SuiteResult:
    hit = {p: median([r.hit_rate for r in runs[p]]) for p in POLICIES}
    p50 = {p: median([percentile(r.ttfts(), 50) for r in runs[p]]) for p in POLICIES}
    p99 = {p: median([percentile(r.ttfts(), 99) for r in runs[p]]) for p in POLICIES}
    failed = sum(r.failed for p in POLICIES for r in runs[p])
    met = hit["prefix"] > hit["least-load"] and p50["prefix"] < p50["least-load"] and not failed
    result = SuiteResult(
        suite=SUITE,
        title="Prefix-aware routing against least-load: 2 SmolLM2 replicas, shared system prompts",
        target="prefix routing: higher prefix-cache hit rate and lower TTFT p50 than least-load",
        met=met,
        environment=environment(),
    )
    base = "least-load (same run)"
    result.add(
        "prefix: cache hit rate",
        hit["prefix"] * 100,
        "%",
        baseline_label=base,
        baseline=hit["least-load"] * 100,
        note="hit tokens / looked-up tokens, from the replicas' metrics",
    )
    for name, q in (("p50", p50), ("p99", p99)):
        result.add(
            f"prefix: TTFT {name}",
            q["prefix"] * 1e3,
            "ms",
            baseline_label=base,
            baseline=q["least-load"] * 1e3,
            note="send to the first streamed token, at the client",
        )
    last = runs["prefix"][-1].routed
    result.notes += [
        f"Workload: {SYSTEMS} system prompts x {per_system} chat requests each "
        f"({SYSTEMS * per_system} per policy and repetition), {CONCURRENCY} clients in a closed "
        f"loop, {MAX_TOKENS} streamed tokens each; {ctx.repetitions} repetition(s), medians.",
        f"Shared: the system prompt is {median(shared):.0%} of each request's prompt tokens "
        "(system prompt alone / mean prompt tokens of the chat requests).",
        f"KV cache {KV_CACHE_BLOCKS} blocks of 16 tokens per replica; replicas pinned "
        f"{'to cores 0 and 1' if pinning_available() else '(no pinning here)'}; routers and "
        "clients share those cores: noisy figures.",
        f"Prefix router, last repetition: {_routing(last)}.",
        f"Failed requests: {failed}.",
    ]
    result.raw = {
        policy: [
            {
                "hit_rate": r.hit_rate,
                "ttft_p50_s": percentile(r.ttfts(), 50),
                "ttft_p99_s": percentile(r.ttfts(), 99),
                "requests_per_s": len(r.outcomes) / r.seconds,
                "client_cached_share": sum(o.cached_tokens for o in r.outcomes)
                / max(1, sum(o.prompt_tokens for o in r.outcomes)),
                "failed": r.failed,
                "statuses": r.statuses(),
                "routed": r.routed,
            }
            for r in runs[policy]
        ]
        for policy in POLICIES
    }
    result.seconds = seconds
    return result
