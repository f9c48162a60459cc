"""Model control through `lockgate route`: a load or unload (tritonclient, HTTP and gRPC)
reaches every replica, a failure names its replica, and a replica that joins later (or starts
again) is sent the loads it missed before it takes traffic. Real replicas in explicit model
control mode behind a real router, on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from lockgate.router import control_state
from tests.conftest import RunningServer, free_port, launch_server, start_server, start_servers
from tests.router.test_router import CONFIG, WHO, _free_pair, start_router, who

EXPLICIT = ("--no-llm", "--model-control-mode", "explicit")
SLOW_LOAD = 1.5  # seconds the model `slow_load` takes to load


def repository(root: Path, replica: int, *names: str) -> Path:
    """`names`, each the identity model that tells which replica answered (`slow_load`: one
    whose load takes SLOW_LOAD seconds)."""
    repo = root / f"replica-{replica}"
    for name in names:
        (repo / name / "1").mkdir(parents=True)
        source = WHO
        if name == "slow_load":
            source = WHO.replace(
                "self.calls = 0", f"self.calls = 0\n        time.sleep({SLOW_LOAD})"
            )
        (repo / name / "1" / "model.py").write_text(source)
        (repo / name / "config.yaml").write_text(CONFIG + f"parameters: {{replica: '{replica}'}}\n")
    return repo


def launch_replica(root: Path, replica: int, *extra: str, port: int | None = None) -> RunningServer:
    """Replica `replica` in explicit model control mode (`extra`: its other flags), its
    repository `who`, `extra` and `slow_load`, and for replica 0 `solo` too; not waited for."""
    names = ("who", "extra", "slow_load", *(("solo",) if replica == 0 else ()))
    repo = root / f"replica-{replica}"
    if not repo.exists():
        repository(root, replica, *names)
    return launch_server(repo, root, *EXPLICIT, *extra, grpc_port=free_port(), port=port)


def start_replica(
    root: Path, replica: int, *extra: str, port: int | None = None, wait_ready: bool = True
) -> RunningServer:
    """`launch_replica`, once ready (or without `wait_ready`, live)."""
    return launch_replica(root, replica, *extra, port=port).wait_ready(wait_ready=wait_ready)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningServer]]:
    root = tmp_path_factory.mktemp("control-replicas")
    servers = start_servers(*(launch_replica(root, i, "--load-model", "who") for i in range(2)))
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def router(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    urls = [f"{r.url}?grpc={r.grpc_port}" for r in replicas]
    grpc_port = free_port()
    args = [a for url in urls for a in ("--replica", url)]
    router = start_router(
        tmp_path_factory.mktemp("control-router"), *args, "--grpc-port", str(grpc_port)
    )
    router.grpc_port = grpc_port
    yield router
    router.stop()


def http_client(server: RunningServer) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.address)


def ready_on(replicas: list[RunningServer], model: str) -> list[bool]:
    """Whether each replica, asked directly, serves `model`."""
    return [http_client(r).is_model_ready(model) for r in replicas]


def test_a_load_and_an_unload_reach_every_replica(
    router: RunningServer, replicas: list[RunningServer]
) -> None:
    client = http_client(router)
    assert ready_on(replicas, "extra") == [False, False]
    client.load_model("extra")
    assert ready_on(replicas, "extra") == [True, True]
    assert client.is_model_ready("extra")
    with httpx.Client() as http:
        answered = Counter(who(http, router.url, "extra") for _ in range(40))
    assert set(answered) == {0, 1}, answered  # every request served, by both replicas
    client.unload_model("extra")
    assert ready_on(replicas, "extra") == [False, False]
    assert not client.is_model_ready("extra")
    sent = router.metric(
        "lockgate_router_model_control_total", 'action="load",outcome="ok",way="request"'
    )
    assert sent == 2


def test_grpc_loads_with_a_config_and_files_reach_every_replica(
    router: RunningServer, replicas: list[RunningServer]
) -> None:
    """tritonclient.grpc's load_model with a config override, and with the model's files sent
    (bytes over gRPC, base64 to each replica), then unload_model: each on every replica."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{router.grpc_port}")
    client.load_model("extra", config=json.dumps({"max_batch_size": 4}))
    for replica in replicas:
        assert http_client(replica).get_model_config("extra")["max_batch_size"] == 4
    config = http_client(replicas[0]).get_model_config("who")
    config["name"] = "sent"
    config["parameters"] = {"replica": {"string_value": "7"}}
    client.load_model("sent", config=json.dumps(config), files={"file:1/model.py": WHO.encode()})
    assert ready_on(replicas, "sent") == [True, True]
    with httpx.Client() as http:
        assert {who(http, router.url, "sent") for _ in range(10)} == {7}
    for model in ("extra", "sent"):
        client.unload_model(model)
        assert ready_on(replicas, model) == [False, False]


def test_a_load_one_replica_refuses_names_it(
    router: RunningServer, replicas: list[RunningServer]
) -> None:
    """`solo` is in replica 0's repository alone: replica 1 answers 404, and the router's
    answer is that 404, naming replica 1 (and over gRPC, NOT_FOUND)."""
    r = httpx.post(router.url + "/v2/repository/models/solo/load", timeout=30)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert replicas[1].url in error and replicas[0].url not in error, error
    assert "failed on 1 of 2 replicas (applied on 1)" in error
    assert ready_on(replicas, "solo") == [True, False]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{router.grpc_port}")
    with pytest.raises(InferenceServerException) as refused:
        client.unload_model("solo")  # replica 1 has no such model: 404 there
    assert refused.value.status() == "StatusCode.NOT_FOUND"
    assert replicas[1].url in str(refused.value)
    assert ready_on(replicas, "solo") == [False, False]  # replica 0 unloaded it
    refusals = router.metric(
        "lockgate_router_model_control_total", 'action="load",outcome="refused",way="request"'
    )
    assert refusals >= 1


def test_bad_control_requests_are_refused_with_the_replicas_answer(router: RunningServer) -> None:
    r = httpx.post(
        router.url + "/v2/repository/models/extra/load",
        json={"parameters": {"colour": "blue"}},
        timeout=30,
    )
    assert r.status_code == 400 and "unknown load parameter 'colour'" in r.text, r.text
    r = httpx.post(
        router.url + "/v2/repository/models/extra/load",
        headers={"request-timeout": "soon"},
        timeout=30,
    )
    assert r.status_code == 400 and "request-timeout" in r.text, r.text
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{router.grpc_port}")
    with pytest.raises(InferenceServerException) as refused:
        client.load_model("a/b")
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_a_load_past_its_deadline_answers_504_naming_the_replicas(
    router: RunningServer, replicas: list[RunningServer]
) -> None:
    """The request's deadline bounds the wait for every replica: past it, 504 naming those
    that had not answered. They leave the rotation until a probe finds them up again."""
    started = time.monotonic()
    r = httpx.post(
        router.url + "/v2/repository/models/slow_load/load",
        headers={"request-timeout": "0.3"},
        timeout=30,
    )
    assert time.monotonic() - started < SLOW_LOAD
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert all(replica.url in error for replica in replicas), error
    assert "no answer within the request's deadline" in error
    for replica in replicas:
        wait_usable(router, replica.url)
    unreached = router.metric(
        "lockgate_router_model_control_total", 'action="load",outcome="unreached",way="request"'
    )
    assert unreached == 2


def test_a_load_reaches_the_replicas_of_every_group(
    replicas: list[RunningServer], tmp_path: Path
) -> None:
    """A canary's replicas (`URL#group`) take only their group's inference, but serve the same
    repository: a load and an unload reach them too."""
    canary = f"{replicas[1].url}#canary"
    router = start_router(tmp_path, "--replica", replicas[0].url, "--replica", canary)
    try:
        http_client(router).load_model("extra")
        assert ready_on(replicas, "extra") == [True, True]
        http_client(router).unload_model("extra")
        assert ready_on(replicas, "extra") == [False, False]
    finally:
        router.stop()


def test_a_replica_that_joins_later_is_sent_the_loads_it_missed(
    replicas: list[RunningServer], tmp_path: Path
) -> None:
    """A router over replica 0 and a port where no replica runs yet: the load answers 502
    naming the missing replica; once that replica starts (nothing loaded: it says not ready)
    it is sent the load, with its config, before it takes traffic."""
    late_port = free_port()
    late_url = f"http://127.0.0.1:{late_port}"
    router = start_router(tmp_path, "--replica", replicas[0].url, "--replica", late_url)
    late: RunningServer | None = None
    try:
        config = http_client(replicas[0]).get_model_config("who")
        config.update(name="extra", max_batch_size=2)
        r = httpx.post(
            router.url + "/v2/repository/models/extra/load",
            json={"parameters": {"config": json.dumps(config)}},
            timeout=30,
        )
        assert r.status_code == 502, r.text
        assert late_url in r.json()["error"] and "before it takes traffic" in r.text
        assert ready_on(replicas[:1], "extra") == [True]
        root = replicas[0].log_path.parent
        late = start_replica(root, 2, port=late_port, wait_ready=False)
        wait_usable(router, late_url)
        assert http_client(late).is_model_ready("extra")  # with the config the load gave
        assert http_client(late).get_model_config("extra")["max_batch_size"] == 2
        before = answered(router, late_url)
        with httpx.Client() as http:
            for _ in range(30):
                who(http, router.url, "extra")
        assert answered(router, late_url) > before  # it takes its share
        replays = router.metric(
            "lockgate_router_model_control_total", 'action="load",outcome="ok",way="replay"'
        )
        assert replays == 1
    finally:
        if late is not None:
            late.stop()
        http_client(replicas[0]).unload_model("extra")
        router.stop()


def answered(router: RunningServer, url: str) -> int:
    listed = httpx.get(router.url + "/router/replicas").json()["replicas"]
    return int(next(r["answered"] for r in listed if r["url"] == url))


def wait_usable(router: RunningServer, url: str, usable: bool = True) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = httpx.get(router.url + "/router/replicas").json()["replicas"]
        if any(r["url"] == url and r["usable"] == usable for r in listed):
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} not usable={usable}: {listed}\n{router.log()[-3000:]}")


def test_serve_with_replicas_sends_a_load_to_each_and_to_one_started_again(
    tmp_path: Path,
) -> None:
    """`lockgate serve --replicas 2 --model-control-mode explicit` runs its replicas behind the
    router (kernel balancing would hand a load to one): a load reaches both, and a replica
    killed and started again by the parent is sent it before it takes traffic."""
    base = _free_pair()
    repo = repository(tmp_path, 0, "who", "extra")
    runtime = tmp_path / "run"
    server = start_server(
        repo,
        tmp_path,
        *EXPLICIT,
        *("--load-model", "who", "--replicas", "2", "--replica-base-port", str(base)),
        env={"XDG_RUNTIME_DIR": str(runtime)},
    )
    ports = [base, base + 1]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url in urls:
            wait_usable(server, url)
        http_client(server).load_model("extra")
        direct = [httpclient.InferenceServerClient(f"127.0.0.1:{port}") for port in ports]
        assert [c.is_model_ready("extra") for c in direct] == [True, True]
        os.kill(replica_pid(server, base), signal.SIGKILL)
        wait_usable(server, urls[0], usable=False)
        wait_usable(server, urls[0])  # started again, and sent the load first
        assert [c.is_model_ready("extra") for c in direct] == [True, True]
        http_client(server).unload_model("extra")
        assert [c.is_model_ready("extra") for c in direct] == [False, False]
        # the router keeps what it was told in this user's runtime directory, for a run
        # after this one if this one is killed
        (state,) = (runtime / "lockgate").iterdir()
        assert state.name.startswith(f"router-{server.port}-")
        assert control_state.read(state, 2**20).log.seq == 2
    finally:
        assert server.stop() == 0, server.log()[-2000:]
    assert list((runtime / "lockgate").iterdir()) == []  # drained with its replicas: removed


def replica_pid(server: RunningServer, port: int) -> int:
    """The pid of the replica process that `server` started on `port`."""
    pid = server.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            return int(child)
    raise AssertionError(f"no replica on port {port} among {children}")


def listed(router: RunningServer, url: str) -> dict[str, object]:
    replicas = httpx.get(router.url + "/router/replicas").json()["replicas"]
    return dict(next(r for r in replicas if r["url"] == url))


def test_a_replica_started_again_between_two_probes_is_caught_up_by_its_boot_id(
    tmp_path: Path,
) -> None:
    """A replica killed and started again on its port well within one probe interval is never
    seen down; its health answer's boot id has changed, so the next probe has it sent the load
    it lacks before it takes traffic again."""
    interval = 6.0
    replica = start_replica(tmp_path, 0, "--load-model", "who")
    router = start_router(tmp_path, "--replica", replica.url, "--probe-interval", str(interval))
    restarted: RunningServer | None = None
    try:
        http_client(router).load_model("extra")
        boot = listed(router, replica.url)["boot"]
        assert boot and http_client(replica).is_model_ready("extra")
        replica.process.kill()
        replica.process.wait()
        restarted = start_replica(tmp_path, 0, "--load-model", "who", port=replica.port)
        assert "not ready" not in router.log(), "a probe found it down: start it again faster"
        assert not http_client(restarted).is_model_ready("extra")  # its start-up's models
        assert listed(router, replica.url)["boot"] == boot  # no probe since
        deadline = time.monotonic() + 2 * interval
        while listed(router, replica.url)["boot"] == boot and time.monotonic() < deadline:
            time.sleep(0.1)
        wait_usable(router, replica.url)
        assert http_client(restarted).is_model_ready("extra"), router.log()[-2000:]
        replays = router.metric(
            "lockgate_router_model_control_total", 'action="load",outcome="ok",way="replay"'
        )
        assert replays == 1
    finally:
        for server in (restarted, replica, router):
            if server is not None:
                server.stop()


def test_a_router_started_again_with_its_state_file_catches_up_a_replica_started_again(
    replicas: list[RunningServer], tmp_path: Path
) -> None:
    """A load through a router with `--control-state`; that router stops and another starts
    with the same file over the same replicas. It knows them for the processes the first one
    told (nothing is replayed to them), and when one is killed and started again, the new
    router sends it the load before it takes traffic."""
    state = tmp_path / "state" / "control.state"
    again = start_replica(tmp_path, 5, "--load-model", "who")
    args = ["--replica", replicas[0].url, "--replica", again.url, "--control-state", str(state)]
    first = start_router(tmp_path, *args)
    restarted: RunningServer | None = None
    second: RunningServer | None = None
    try:
        http_client(first).load_model("extra")
        assert first.stop() == 0
        assert state.stat().st_mode & 0o777 == 0o600
        second = start_router(tmp_path, *args)
        for url in (replicas[0].url, again.url):
            assert listed(second, url)["told"] == 1 and listed(second, url)["usable"]
        boot = listed(second, again.url)["boot"]
        again.process.kill()
        again.process.wait()
        restarted = start_replica(tmp_path, 5, "--load-model", "who", port=again.port)
        deadline = time.monotonic() + 10
        while listed(second, again.url)["boot"] == boot and time.monotonic() < deadline:
            time.sleep(0.05)  # until a probe finds it started again
        wait_usable(second, again.url)
        assert http_client(restarted).is_model_ready("extra")
        replays = second.metric(
            "lockgate_router_model_control_total", 'action="load",outcome="ok",way="replay"'
        )
        assert replays == 1  # to the replica started again alone
    finally:
        for server in (restarted, again, second):
            if server is not None:
                server.stop()
        http_client(replicas[0]).unload_model("extra")


def test_a_state_file_that_cannot_be_read_is_logged_and_replaced(
    replicas: list[RunningServer], tmp_path: Path
) -> None:
    state = tmp_path / "control.state"
    state.write_bytes(b"\x00 not a state")
    router = start_router(tmp_path, "--replica", replicas[0].url, "--control-state", str(state))
    try:
        assert "is not a model control state" in router.log()  # and it serves all the same
        http_client(router).load_model("extra")
        kept = control_state.read(state, 2**20).log.since(0)
        assert [(e.control.model, e.control.action) for e in kept] == [("extra", "load")]
    finally:
        router.stop()
        http_client(replicas[0]).unload_model("extra")
