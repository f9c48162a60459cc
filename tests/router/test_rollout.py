"""Canaries, shadows, sticky sessions, rate limits and prefix routing, through `lockgate route`
in front of three real lockgate replicas on 127.0.0.1 (and the session's SmolLM2 server for
token quotas)."""

from __future__ import annotations

import concurrent.futures
import math
import socket
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, launch_server, start_servers
from tests.router.test_router import CONFIG, WHO, body, start_router

Route = Callable[..., RunningServer]  # the `route` fixture: a router with these arguments


def versioned_repository(root: Path, replica: int) -> Path:
    """`who` (y = x, and which replica answered) at versions 1 and 2, both served."""
    repo = root / f"replica-{replica}"
    folder = repo / "who"
    for version in (1, 2):
        (folder / str(version)).mkdir(parents=True)
        (folder / str(version) / "model.py").write_text(WHO)
    text = CONFIG + f"parameters: {{replica: '{replica}'}}\nversion_policy: {{all: {{}}}}\n"
    (folder / "config.yaml").write_text(textwrap.dedent(text))
    return repo


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningServer]]:
    root = tmp_path_factory.mktemp("rollout-replicas")
    servers = start_servers(*(launch_server(versioned_repository(root, i), root) for i in range(3)))
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def route(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Route]:
    """`route(*args)`: a router with those arguments, stopped after the test."""
    started: list[RunningServer] = []

    def start(*args: str) -> RunningServer:
        started.append(start_router(tmp_path_factory.mktemp("rollout"), "--no-hedge", *args))
        return started[-1]

    yield start
    for router in started:
        router.stop()


def answer(client: httpx.Client, url: str, path: str = "/v2/models/who/infer") -> tuple[str, int]:
    """The version and the replica that answered."""
    r = client.post(url + path, json=body(), timeout=30)
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert outputs["y"] == [1000.0, 1.0]
    return r.json()["model_version"], int(outputs["replica"][0])


def sample(url: str, name: str, **labels: str) -> float:
    """The sum of the series of `name` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        found = dict(p.split("=", 1) for p in series.partition("{")[2].rstrip("}").split(",") if p)
        if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
            total += float(value)
    return total


def within(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_canary_weights_send_shares_to_a_version_and_to_a_group(
    replicas: list[RunningServer], route: Route
) -> None:
    r0, r1, r2 = (r.url for r in replicas)
    router = route(
        *("--replica", r0, "--replica", r1, "--replica", r2 + "#canary"),
        *("--canary", "who:1=25", "--canary", "who:#canary=10"),
    )
    n = 400
    with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: answer(client, router.url), range(n)))
        pinned = [answer(client, router.url, "/v2/models/who/versions/2/infer") for _ in range(40)]
    by = Counter(answers)
    version_1 = sum(c for (v, _), c in by.items() if v == "1")
    canary = sum(c for (_, r), c in by.items() if r == 2)
    assert within(version_1, n, 0.25), by  # 25% +- 4 sigma (34.6)
    assert within(canary, n, 0.10), by  # 10% +- 4 sigma (24)
    assert all(r in (0, 1) for (v, r) in by if v == "1")  # a version canary stays on main
    assert all(v == "2" for (v, r) in by if r == 2)  # the group gets the unversioned path
    assert all(v == "2" for v, _ in pinned)  # a path that names a version keeps it
    counted = "lockgate_router_model_requests_total"
    assert sample(router.url, counted, version="1", group="main", status="200") == version_1
    assert sample(router.url, counted, version="latest", group="canary") == canary
    groups = {
        r["url"]: r["group"] for r in httpx.get(router.url + "/router/replicas").json()["replicas"]
    }
    assert groups == {r0: "main", r1: "main", r2: "canary"}


def test_shadow_copies_requests_without_changing_the_answers(
    replicas: list[RunningServer], route: Route
) -> None:
    r0, r1, r2 = (r.url for r in replicas)
    router = route(
        *("--replica", r0, "--replica", r1, "--replica", r2 + "#candidate"),
        *("--shadow", "who=#candidate:100"),
    )
    same = route("--replica", r0, "--shadow", f"who={r0}:100")
    candidate_before = sample(r2, "lockgate_requests_total", model="who", outcome="success")
    with httpx.Client() as client:
        for url in (router.url, same.url):
            answered = [answer(client, url) for _ in range(30)]
            assert all(r in (0, 1) for _, r in answered)  # never the candidate's answer
    outcomes = "lockgate_router_shadow_requests_total"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sample(router.url, outcomes, outcome="disagree") < 30:
        time.sleep(0.05)
    # the candidate (replica 2) answers `replica: 2`: every copy disagrees
    assert sample(router.url, outcomes, model="who", outcome="disagree") == 30
    assert sample(router.url, outcomes, outcome="agree") == 0
    for side in ("primary", "shadow"):
        count = "lockgate_router_shadow_duration_seconds_count"
        assert sample(router.url, count, model="who", side=side) == 30
    while time.monotonic() < deadline and sample(same.url, outcomes, outcome="agree") < 30:
        time.sleep(0.05)
    assert sample(same.url, outcomes, outcome="agree") == 30  # a replica agrees with itself
    # the candidate answered the copies
    served = "lockgate_requests_total"
    assert sample(r2, served, model="who", outcome="success") - candidate_before >= 30


def test_shadow_copies_are_bounded_and_never_hold_up_the_client(
    replicas: list[RunningServer], route: Route
) -> None:
    with socket.socket() as silent:  # accepts connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        router = route(
            *("--replica", replicas[0].url),
            *("--shadow", f"who=http://127.0.0.1:{port}:100"),
            *("--shadow-max-in-flight", "2", "--shadow-timeout", "60"),
        )
        with httpx.Client() as client:
            # a copy that held the client up would take the shadow timeout (60 s): past 10 s
            # the client gives up and the test fails
            for _ in range(5):
                r = client.post(router.url + "/v2/models/who/infer", json=body(), timeout=10)
                assert r.status_code == 200
        outcomes = "lockgate_router_shadow_requests_total"
        assert sample(router.url, outcomes, model="who", outcome="dropped") == 3
        assert sample(router.url, "lockgate_router_shadow_in_flight") == 2


def test_a_sticky_header_pins_sessions_to_replicas(
    replicas: list[RunningServer], route: Route
) -> None:
    router = route(
        *[a for r in replicas for a in ("--replica", r.url)], "--sticky-header", "X-Session"
    )
    homes = {}
    with httpx.Client() as client:
        for session in range(16):
            seen = set()
            for _ in range(6):
                r = client.post(
                    router.url + "/v2/models/who/infer",
                    json=body(),
                    headers={"x-session": f"user-{session}"},
                )
                assert r.status_code == 200
                seen.add(r.json()["outputs"][1]["data"][0])
            assert len(seen) == 1, (session, seen)
            homes[session] = seen.pop()
        free = {answer(client, router.url)[1] for _ in range(60)}
    assert len(set(homes.values())) >= 2, homes  # sessions spread over the replicas
    assert len(free) >= 2  # without the header: balanced as usual


def test_rate_limits_answer_429_with_retry_after_and_recover(
    replicas: list[RunningServer], route: Route, tmp_path: Path
) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text("keys:\n  gold: {requests_per_second: 1000, burst: 1000}\n")
    router = route(
        *("--replica", replicas[0].url, "--rate-limits", str(limits)),
        *("--rate-limit-rps", "1", "--rate-limit-burst", "3"),
    )
    url = router.url + "/v2/models/who/infer"

    def burst(key: str | None, n: int = 8) -> list[httpx.Response]:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        with httpx.Client() as client:
            return [client.post(url, json=body(), headers=headers) for _ in range(n)]

    started = time.monotonic()
    alice = burst("alice")
    elapsed = time.monotonic() - started
    ok = sum(r.status_code == 200 for r in alice)
    assert 3 <= ok <= 3 + math.ceil(elapsed), [r.status_code for r in alice]
    refused = [r for r in alice if r.status_code == 429]
    assert refused and len(refused) == len(alice) - ok
    assert all(1 <= int(r.headers["retry-after"]) <= 1 for r in refused)
    assert "rate limit" in refused[-1].json()["error"]
    assert all(r.status_code == 200 for r in burst("bob", 3))  # a key of its own
    assert all(r.status_code == 200 for r in burst("gold", 20))  # its own limit, from the file
    anonymous = burst(None)  # clients without a key share one bucket
    assert sum(r.status_code == 429 for r in anonymous) >= 1
    time.sleep(int(refused[-1].headers["retry-after"]))
    assert burst("alice", 1)[0].status_code == 200  # the bucket has room again
    assert sample(router.url, "lockgate_router_rate_limited_total", limit="requests") >= 2
    assert sample(router.url, "lockgate_router_rate_limit_clients") == 4


def test_prefix_routing_sends_equal_prefixes_to_one_replica(
    replicas: list[RunningServer], route: Route
) -> None:
    """The replicas serve no language model (they answer 404), which is enough to see where
    each request went: the router counts its attempts per replica."""
    router = route(*[a for r in replicas for a in ("--replica", r.url)], "--llm-routing", "prefix")
    attempts = "lockgate_router_attempts_total{"

    def where() -> Counter[str]:
        text = httpx.get(router.url + "/metrics").text
        found: Counter[str] = Counter()
        for line in text.splitlines():
            if line.startswith(attempts):
                found[line.split('replica="')[1].split('"')[0]] += float(line.rsplit(" ", 1)[1])
        return found

    def one_replica(path: str, bodies: list[dict]) -> str:
        """Where `bodies` went, all to one replica."""
        before = where()
        for request in bodies:
            assert client.post(router.url + path, json=request).status_code == 404
        moved = where() - before
        assert list(moved.values()) == [len(bodies)], moved
        return next(iter(moved))

    homes = set()
    with httpx.Client() as client:
        for i in range(10):
            system = f"You are assistant number {i}. " + "Answer briefly and politely. " * 20
            prompts = [system + f"Question {j}: what is {j} + {i}?" for j in range(4)]
            completions = [{"model": "m", "prompt": p, "max_tokens": 4} for p in prompts]
            homes.add(one_replica("/v1/completions", completions))
            chats = [
                {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"q{j}"},
                    ],
                }
                for j in range(4)
            ]
            homes.add(one_replica("/v1/chat/completions", chats))
    assert len(homes) >= 2  # different prefixes spread over the replicas
    assert sample(router.url, "lockgate_router_llm_routing_total", choice="prefix") == 80


def test_a_token_quota_is_charged_settled_and_refunded(
    llm_server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    router = start_router(
        tmp_path_factory.mktemp("quota"), "--replica", llm_server.url, "--rate-limit-tpm", "60"
    )
    url = router.url + "/v1/completions"
    ask = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "temperature": 0}
    try:
        with httpx.Client(timeout=60) as client:
            # refused by the replica (no such model): the 50 tokens charged are given back
            missing = client.post(url, json={**ask, "model": "nope", "max_tokens": 50})
            assert missing.status_code == 404
            # 40 tokens streamed (one chunk each) and the prompt's 4: 44 of the 60 a minute
            # are spent (the router asked for the usage chunk; the client does not see it)
            stream = {**ask, "max_tokens": 40, "ignore_eos": True, "stream": True}
            with client.stream("POST", url, json=stream) as r:
                assert r.status_code == 200
                chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            assert len(chunks) == 40
            late = client.post(url, json={**ask, "max_tokens": 50})
        assert late.status_code == 429, late.text
        # 50 wanted, about 16 left: about 34 s at one token a second
        assert 24 <= int(late.headers["retry-after"]) <= 35, late.headers
        assert "token quota" in late.json()["error"]["message"]  # in the OpenAI shape
        assert sample(router.url, "lockgate_router_rate_limited_total", limit="tokens") == 1
    finally:
        router.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--canary", "who:#blue=10"], "#blue names no replica"),
        (["--canary", "who:1=60", "--canary", "who:2=50"], "add up to 110%"),
        (["--shadow", "who=#blue"], "--shadow 'who=#blue'"),
        (["--rate-limit-rps", "-1"], "requests_per_second"),
        (["--sticky-header", "bad header"], "--sticky-header"),
        (["--prefix-chars", "0"], "--prefix-chars"),
    ],
)
def test_bad_rollout_flags_stop_the_router_naming_the_flag(
    args: list[str], message: str, tmp_path: Path
) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    command = [sys.executable, "-m", "lockgate.cli", "route", "--replica", "http://127.0.0.1:9"]
    done = subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
