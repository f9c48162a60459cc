"""Language models under overload, through a real server and the `openai` client: with a TTFT
SLO, a burst of three times the streams the SLO allows is split into requests that get their
first token inside it and requests refused at once with 503.

Admission plans at the prefill rate it has measured. On a machine shared with other work the
server can be stalled after that measurement (a first burst after start waited 4.7 s for a
first token planned inside 2 s), and every first token is then as much later: the TTFT bounds
allow what a control thread in the test measured the machine took from every process in the
same burst (`Stalls`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from lockgate.demo.smollm2 import SERVED_NAME
from lockgate.llm.admission import TTFTAdmission
from tests.conftest import ONE_THREAD, RunningServer, smollm2_repository, start_server

TTFT_SLO_S = 2.0
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "the",
    "server",
    "keeps",
    "its",
    "promise",
]


def start_slo_llm_server(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> RunningServer:
    repo = smollm2_repository(
        demo_repo,
        tmp_path_factory.mktemp("slo-llm-repo"),
        {
            "kv_cache_gib": "0.05",
            "max_model_len": "512",
            "max_num_batched_tokens": "128",
            "ttft_slo_ms": str(int(TTFT_SLO_S * 1000)),
            **ONE_THREAD,
        },
    )
    return start_server(repo, tmp_path_factory.mktemp("slo-llm"), ready_timeout=600)


class SloServer:
    """The module's SLO server, and whether a test has sent it anything yet: the first test to
    run takes it fresh from start-up, as the burst test needs a server (`fresh`)."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.used = False

    def take(self) -> RunningServer:
        self.used = True
        return self.server

    @contextlib.contextmanager
    def fresh(
        self, demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[RunningServer]:
        """A server that has served nothing since it started: this one if no test has used it
        yet, else one of its own, stopped after."""
        if not self.used:
            yield self.take()
            return
        server = start_slo_llm_server(demo_repo, tmp_path_factory)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def slo_server(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SloServer]:
    shared = SloServer(start_slo_llm_server(demo_repo, tmp_path_factory))
    yield shared
    shared.server.stop()


@pytest.fixture
def slo_llm_server(slo_server: SloServer) -> RunningServer:
    return slo_server.take()


@dataclass(slots=True)
class Stream:
    status: int  # 200, or the refusal's status
    ttft: float  # seconds to the first token, or to the refusal
    reason: str = ""  # the refusal's message


async def one_stream(client: openai.AsyncOpenAI, prompt: str) -> Stream:
    started = time.monotonic()
    try:
        stream = await client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=4, stream=True, temperature=0.0
        )
        async for _ in stream:
            return_ttft = time.monotonic() - started
            async for _ in stream:  # drain the rest
                pass
            return Stream(200, return_ttft)
    except openai.APIStatusError as exc:
        return Stream(exc.status_code, time.monotonic() - started, exc.response.text)
    return Stream(200, time.monotonic() - started)


def prompt_of(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(n_words))


class Stalls:
    """A control: a thread of this process that sleeps 10 ms at a time and keeps how much
    longer than that its longest sleep took, while the block runs. Another process on the
    machine, or the machine itself paused, stalls every process this much (the server's
    own work does not show here: this thread needs a sliver of a core)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            time.sleep(0.01)
            self.longest = max(self.longest, time.monotonic() - started - 0.01)

    def __enter__(self) -> Stalls:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


def test_a_burst_as_the_first_traffic_after_start_is_admitted_up_to_the_slo(
    slo_server: SloServer, demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Warmup measures the prefill rate on a warm full-budget prefill, so the first burst a
    fresh server sees is admitted as far as its TTFT SLO allows, not refused almost whole.
    (First in the module: the module's server, before any other test has used it.)"""
    with slo_server.fresh(demo_repo, tmp_path_factory) as server:
        client = openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60
        )

        async def run() -> list[Stream]:
            # prompts of their own from the first token: none leaves a cached prefix for
            # the test that takes this server next
            prompts = [f"burst {i}: " + prompt_of(150, i) for i in range(12)]
            burst = await asyncio.gather(*(one_stream(client, p) for p in prompts))
            await client.close()
            return list(burst)

        with Stalls() as stalls:
            burst = asyncio.run(run())
    admitted = [s for s in burst if s.status == 200]
    report = (
        f"machine stalled {stalls.longest:.2f} s at most; "
        f"statuses {[s.status for s in burst]}, TTFT {[round(s.ttft, 2) for s in burst]}, "
        f"reasons {sorted({s.reason for s in burst if s.reason})}"
    )
    print(report)
    assert {s.status for s in burst} <= {200, 503}, report
    assert admitted, report
    # as many as fit: the prompts are alike, so the first admitted one's TTFT is what one
    # prefill takes on this machine now, and admission plans within `slack` of the SLO (one
    # less for the steps they share); a rate measured too low at warmup would admit fewer
    fit = int(TTFTAdmission().slack * TTFT_SLO_S / min(s.ttft for s in admitted))
    assert len(admitted) >= min(4, fit - 1), f"{fit} fit; {report}"
    assert max(s.ttft for s in admitted) <= TTFT_SLO_S * 1.25 + stalls.longest, report


def test_streams_past_the_ttft_slo_are_refused_at_once_and_the_rest_meet_it(
    slo_llm_server: RunningServer,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=slo_llm_server.url + "/v1", api_key="none", max_retries=0, timeout=60
    )

    async def run(stalls: Stalls) -> tuple[list[Stream], float]:
        warm = [await one_stream(client, prompt_of(150, i)) for i in range(3)]  # measure prefill
        assert all(s.status == 200 for s in warm), warm
        start = time.monotonic()
        prompts = [prompt_of(150, i) for i in range(30)]
        with stalls:
            burst = await asyncio.gather(*(one_stream(client, p) for p in prompts))
        await client.close()
        return list(burst), time.monotonic() - start

    stalls = Stalls()
    burst, elapsed = asyncio.run(run(stalls))
    admitted = [s for s in burst if s.status == 200]
    refused = [s for s in burst if s.status != 200]
    report = (
        f"machine stalled {stalls.longest:.2f} s at most; "
        f"{len(admitted)} admitted, TTFT {sorted(round(s.ttft, 2) for s in admitted)}; "
        f"{len(refused)} refused {sorted({s.status for s in refused})} within "
        f"{max((s.ttft for s in refused), default=0):.2f} s; burst took {elapsed:.1f} s; "
        f"reasons {sorted({s.reason for s in refused})}"
    )
    print(report)
    assert len(admitted) + len(refused) == 30, report  # nothing lost
    assert admitted and len(refused) >= 10, report  # three times what the SLO allows
    assert {s.status for s in refused} == {503}, report
    assert max(s.ttft for s in refused) < 1.0, report  # refused at once
    # the SLO, plus what the machine took from every process meanwhile (the control)
    assert max(s.ttft for s in admitted) <= TTFT_SLO_S + stalls.longest, report
    metrics = slo_llm_server.log()
    assert "Traceback" not in metrics
