"""`lockgate serve --replicas`: how many replicas `auto` chooses (no process started for that),
each replica's arguments, gRPC through the router in front of them, and the replicas sharing
one port balanced by the kernel (`--balance kernel`): spread, restarted, drained; in both
modes no replica outlives a parent killed with SIGKILL, and their ports are free again."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from lockgate.backends.base import LLM_BACKEND
from lockgate.cli import _balance, _replica_count, _replicas
from lockgate.router.replicas import (
    THREAD_VARIABLES,
    Placement,
    _cgroup_cpus,
    auto_replicas,
    cannot_share,
    replica_argv,
    reuse_port_balances,
    shared_port_argv,
    usable_cores,
)
from lockgate.router.supervisor import Backoff
from tests.conftest import ROOT, RunningServer, free_port, start_server
from tests.router.test_router import repository

CLASSIC = """\
backend: python
max_batch_size: 4
inputs: [{name: x, datatype: FP32, dims: [2]}]
outputs: [{name: y, datatype: FP32, dims: [2]}]
"""


def model(repo: Path, name: str, config: str) -> None:
    (repo / name).mkdir(parents=True)
    (repo / name / "config.yaml").write_text(config)


@pytest.fixture
def classic(tmp_path: Path) -> Path:
    repo = tmp_path / "classic"
    model(repo, "a", CLASSIC)
    model(repo, "b", CLASSIC.replace("python", "onnxruntime"))
    return repo


@pytest.fixture
def with_llm(tmp_path: Path) -> Path:
    repo = tmp_path / "with-llm"
    model(repo, "a", CLASSIC)
    model(repo, "chat", f"backend: {LLM_BACKEND}\n")
    return repo


def test_auto_is_one_replica_per_core_for_classic_models(classic: Path) -> None:
    assert auto_replicas(classic, cores=6, llm_backend=LLM_BACKEND) == 6
    assert auto_replicas(classic, cores=1, llm_backend=LLM_BACKEND) == 1
    model(classic, "broken", "backend: [not, a, name]\n")  # the replicas report it
    model(classic, ".hidden", f"backend: {LLM_BACKEND}\n")  # not a model folder
    assert auto_replicas(classic, cores=6, llm_backend=LLM_BACKEND) == 6


def test_auto_is_one_replica_with_a_language_model(with_llm: Path) -> None:
    assert auto_replicas(with_llm, cores=6, llm_backend=LLM_BACKEND) == 1
    # --no-llm: the language model is not started, so one replica per core again
    assert auto_replicas(with_llm, cores=6, llm_backend=LLM_BACKEND, language_models=False) == 6


def test_auto_is_one_replica_with_a_stateful_model(classic: Path) -> None:
    """A sequence lives in the replica that started it: kernel-balanced replicas would send
    its requests to others."""
    model(classic, "acc", "backend: python\nsequence_batching: {}\n")
    assert auto_replicas(classic, cores=6, llm_backend=LLM_BACKEND) == 1


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=_replicas, default=1)
    parser.add_argument("--model-control-mode", default="none")
    parser.add_argument("--no-llm", action="store_true")
    parser.add_argument("--balance")
    return parser.parse_args(flags)


def test_the_replicas_flag(classic: Path, with_llm: Path) -> None:
    assert _replica_count(serve_args(), classic) == 1  # the default: one process
    assert _replica_count(serve_args("--replicas", "3"), with_llm) == 3  # as asked
    assert _replica_count(serve_args("--replicas", "auto"), classic) == usable_cores()
    assert _replica_count(serve_args("--replicas", "auto"), with_llm) == 1
    assert _replica_count(serve_args("--replicas", "auto", "--no-llm"), with_llm) == (
        usable_cores()
    )
    # models loaded and unloaded by API: every call must reach the one process
    explicit = serve_args("--replicas", "auto", "--model-control-mode", "explicit")
    assert _replica_count(explicit, classic) == 1
    for bad in ("0", "-2", "many"):
        with pytest.raises(argparse.ArgumentTypeError):
            _replicas(bad)


def test_explicit_model_control_balances_through_the_router() -> None:
    """Its loads and unloads must reach every replica: the router sends them to each, where
    the kernel's shared port would hand each to one."""
    explicit = ("--model-control-mode", "explicit")
    assert _balance(serve_args("--replicas", "2", *explicit)) == "router"
    assert _balance(serve_args("--replicas", "2", *explicit, "--balance", "kernel")) == "kernel"
    expected = "kernel" if reuse_port_balances() else "router"
    assert _balance(serve_args("--replicas", "2")) == expected


def test_cgroup_quota_caps_the_cores(tmp_path: Path) -> None:
    limit = tmp_path / "cpu.max"
    limit.write_text("150000 100000\n")  # 1.5 CPUs: two replicas
    assert _cgroup_cpus(limit) == 2
    limit.write_text("max 100000\n")
    assert _cgroup_cpus(limit) is None
    assert _cgroup_cpus(tmp_path / "absent") is None
    assert usable_cores() >= 1


def test_auto_pins_a_replica_to_each_core_only_when_there_are_as_many() -> None:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    pinned = Placement.choose("auto", len(cores))
    assert pinned.pinned and pinned.threads == 1
    assert [pinned.core(i) for i in range(len(cores))] == list(cores)
    more = Placement.choose("auto", len(cores) + 1)  # two would share a core: none pinned
    assert not more.pinned and more.core(0) is None and more.preexec(0) is None
    assert more.threads == max(1, usable_cores() // (len(cores) + 1))
    forced = Placement.choose("on", len(cores) + 1)
    assert forced.core(len(cores)) == cores[0]  # modulo the cores
    free = Placement.choose("off", len(cores))
    assert not free.pinned and free.threads == max(1, usable_cores() // len(cores))
    with pytest.raises(ValueError, match="--pin-replicas"):
        Placement.choose("sometimes", 2)


def test_the_replicas_thread_pools_are_sized_unless_the_environment_sizes_them() -> None:
    placement = Placement.choose("on", 2)
    env = placement.env({"PATH": "/bin", "MKL_NUM_THREADS": "3"})
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "1"
    assert env["MKL_NUM_THREADS"] == "3" and env["PATH"] == "/bin"


def test_the_pin_flag_is_the_parents_alone() -> None:
    argv = ["serve", "repo", "--replicas", "2", "--pin-replicas", "on", "--port", "9000"]
    assert "--pin-replicas" not in shared_port_argv(argv, 9001)
    assert "--pin-replicas" not in replica_argv(argv, 9001)


def affinity(pid: int) -> set[int]:
    """The cores process `pid` may run on, as /proc says."""
    status = Path(f"/proc/{pid}/status").read_text()
    (listed,) = [
        line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")
    ]
    cores: set[int] = set()
    for part in listed.split(","):
        low, _, high = part.partition("-")
        cores |= set(range(int(low), int(high or low) + 1))
    return cores


def environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if b"=" in item)


def test_each_replica_gets_its_own_address_and_one_process() -> None:
    argv = ["serve", "models", "--replicas", "auto", "--port=8000", "--grpc-port", "8001"]
    argv += ["--replica-base-port", "9000", "--no-llm"]
    assert replica_argv(argv, 9001, 9003) == [
        "serve",
        "models",
        "--no-llm",
        "--host",
        "127.0.0.1",
        "--port",
        "9001",
        "--grpc-port",
        "9003",
        "--replicas",
        "1",  # a replica never starts replicas of its own
    ]
    assert replica_argv(["serve"], 9001)[-3:] == ["off", "--replicas", "1"]


def test_kernel_balanced_replicas_keep_the_address_and_get_a_private_port() -> None:
    argv = ["serve", "models", "--host", "0.0.0.0", "--port=8000", "--grpc-port", "8001"]
    argv += ["--replicas", "2", "--balance", "kernel", "--replica-base-port", "9000"]
    assert shared_port_argv([*argv, "--reuse-port", "--private-port", "7"], 9001) == [
        "serve",
        "models",
        "--host",
        "0.0.0.0",
        "--port=8000",
        "--grpc-port",
        "8001",
        "--replicas",
        "1",
        "--reuse-port",
        "--private-port",
        "9001",
    ]


def test_a_port_held_without_reuse_port_cannot_be_shared() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        why = cannot_share("127.0.0.1", held.getsockname()[1])
        assert why is not None and "cannot share 127.0.0.1:" in why
    with socket.socket() as shared:  # one that shares it: another may join
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        shared.bind(("127.0.0.1", 0))
        shared.listen()
        assert cannot_share("127.0.0.1", shared.getsockname()[1]) is None


def test_restart_backoff_doubles_on_quick_exits_and_resets_after_a_steady_run() -> None:
    backoff = Backoff(first=1.0, longest=5.0, steady=60.0)
    waits = [0.0]
    for _ in range(5):  # each replica died within a second of its start
        waits.append(backoff.after(waits[-1], ran=1.0))
    assert waits[1:] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff.after(5.0, ran=60.0) == 1.0  # it ran long enough: a fresh start
    for bad in ({"first": 0.0}, {"first": 2.0, "longest": 1.0}, {"steady": 0.0}):
        with pytest.raises(ValueError, match="backoff"):
            Backoff(**bad)


def _free_run(count: int) -> int:
    """A port whose next `count - 1` ports are free too."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


def replicas_of(server: RunningServer) -> list[dict[str, Any]]:
    replicas: list[dict[str, Any]] = httpx.get(server.url + "/router/replicas").json()["replicas"]
    return replicas


def test_serve_with_replicas_serves_grpc_through_the_router(tmp_path: Path) -> None:
    base = _free_run(4)  # two replicas: HTTP on base and base+1, gRPC on base+2 and base+3
    server = start_server(
        repository(tmp_path, 0),
        tmp_path,
        "--replicas",
        "2",
        "--balance",
        "router",
        "--replica-base-port",
        str(base),
        "--pin-replicas",
        "off",
        grpc_port=free_port(),
    )
    try:
        deadline = time.monotonic() + 60
        while not all(r["usable"] for r in replicas_of(server)):  # the router is ready on one
            assert time.monotonic() < deadline, replicas_of(server)
            time.sleep(0.1)
        children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children")
        replicas = [int(pid) for pid in children.read_text().split()]
        assert len(replicas) == 2
        for pid in replicas:  # unpinned: each may run where the router may, its pools sized
            assert affinity(pid) == os.sched_getaffinity(0)
            threads = str(max(1, usable_cores() // 2))
            assert {environment(pid).get(v) for v in THREAD_VARIABLES} == {threads}
        client = grpcclient.InferenceServerClient(server.grpc_address)
        x = grpcclient.InferInput("x", [1, 2], "FP32")
        x.set_data_from_numpy(np.array([[1000.0, 1.0]], dtype=np.float32))
        for _ in range(40):
            result = client.infer("who", [x], client_timeout=30)
            np.testing.assert_array_equal(result.as_numpy("y"), [[1000.0, 1.0]])
        listed = replicas_of(server)
        assert [r["url"] for r in listed] == [f"http://127.0.0.1:{base + i}" for i in range(2)]
        assert all(r["answered"] > 0 for r in listed), listed  # both took gRPC calls
    finally:
        assert server.stop() == 0, server.log()[-2000:]


# -- kernel balancing: the replicas share the port -----------------------------------------

PID_MODEL = """
import os
import time

import numpy as np


class Model:
    \"\"\"pid = the answering process's id; a value v >= 1000 sleeps v - 1000 seconds first.\"\"\"

    def load(self, config, version_dir):
        pass

    def infer(self, inputs):
        v = float(inputs["x"].flat[0])
        if v >= 1000:
            time.sleep(v - 1000)
        return {"pid": np.full((inputs["x"].shape[0], 1), os.getpid(), dtype=np.int64)}
"""

PID_CONFIG = """\
backend: python
max_batch_size: 8
inputs: [{name: x, datatype: FP32, dims: [1]}]
outputs: [{name: pid, datatype: INT64, dims: [1]}]
"""


def pid_repository(root: Path) -> Path:
    repo = root / "pid-repo"
    (repo / "pid" / "1").mkdir(parents=True)
    (repo / "pid" / "1" / "model.py").write_text(textwrap.dedent(PID_MODEL))
    (repo / "pid" / "config.yaml").write_text(PID_CONFIG)
    return repo


def pid_of(url: str, sleep: float = 0.0) -> int:
    """The pid of the process that answered, over a fresh connection."""
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [sleep]}]}
    response = httpx.post(url + "/v2/models/pid/infer", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return int(response.json()["outputs"][0]["data"][0])


def grpc_pid_of(address: str) -> int:
    """The pid that answered a gRPC call on a new channel (a new connection)."""
    client = grpcclient.InferenceServerClient(address)
    try:
        x = grpcclient.InferInput("x", [1, 1], "FP32")
        x.set_data_from_numpy(np.zeros((1, 1), dtype=np.float32))
        return int(client.infer("pid", [x], client_timeout=30).as_numpy("pid")[0, 0])
    finally:
        client.close()


def answered(url: str) -> float:
    """Successful inference requests counted on one replica's private /metrics."""
    text = httpx.get(url + "/metrics").text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("lockgate_requests_total{") and 'outcome="success"' in line
    )


class KernelBalanced:
    """`serve --replicas 2 --balance kernel`: the shared URL and each replica's own."""

    def __init__(self, server: RunningServer, base: int) -> None:
        self.server = server
        self.private = [f"http://127.0.0.1:{base + i}" for i in range(2)]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until both replicas answer readiness on their private ports."""
        deadline = time.monotonic() + timeout
        for url in self.private:
            while not _ready(url):
                assert self.server.process.poll() is None, self.server.log()[-2000:]
                assert time.monotonic() < deadline, self.server.log()[-2000:]
                time.sleep(0.1)

    def pids(self) -> list[int]:
        """Replica i's pid, asked on its private port."""
        return [pid_of(url) for url in self.private]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def start_kernel_balanced(tmp: Path, grpc_port: int | None = None) -> KernelBalanced:
    base = _free_run(2)
    flags = ("--replicas", "2", "--balance", "kernel", "--replica-base-port", str(base))
    flags += ("--pin-replicas", "on")
    server = start_server(pid_repository(tmp), tmp, *flags, grpc_port=grpc_port)
    balanced = KernelBalanced(server, base)
    balanced.wait_ready()
    return balanced


@pytest.fixture(scope="module")
def kernel_balanced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelBalanced]:
    if not reuse_port_balances():
        pytest.skip("kernel balancing needs Linux's SO_REUSEPORT")
    balanced = start_kernel_balanced(tmp_path_factory.mktemp("kernel"), grpc_port=free_port())
    try:
        yield balanced
    finally:
        assert balanced.server.stop() == 0, balanced.server.log()[-2000:]


def test_kernel_balancing_spreads_fresh_connections_over_both_replicas(
    kernel_balanced: KernelBalanced,
) -> None:
    replicas = kernel_balanced.pids()
    assert len(set(replicas)) == 2
    before = [answered(url) for url in kernel_balanced.private]
    seen = [pid_of(kernel_balanced.server.url) for _ in range(40)]  # a connection each
    assert set(seen) == set(replicas), seen
    # each replica's private /metrics counts its own share, and the shares add up
    grown = [answered(url) - b for url, b in zip(kernel_balanced.private, before, strict=True)]
    assert grown == [seen.count(pid) for pid in replicas]
    # the gRPC port is shared the same way: one channel per call
    over_grpc = {grpc_pid_of(kernel_balanced.server.grpc_address) for _ in range(20)}
    assert over_grpc == set(replicas)


def test_pinned_replicas_run_each_on_its_core_with_one_thread_per_pool(
    kernel_balanced: KernelBalanced,
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    for i, pid in enumerate(kernel_balanced.pids()):
        assert affinity(pid) == {cores[i % len(cores)]}
        assert {environment(pid).get(v) for v in THREAD_VARIABLES} == {"1"}


def test_a_killed_replica_is_restarted_and_the_shared_port_answers_meanwhile(
    kernel_balanced: KernelBalanced,
) -> None:
    kernel_balanced.wait_ready()
    killed, survivor = kernel_balanced.pids()
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while _running(killed):  # gone (its sockets closed), or a zombie until reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    seen: list[int] = []  # every request on a fresh connection, each answered 200
    while set(seen) <= {survivor}:  # until the new replica 0 has joined the shared port
        assert time.monotonic() < deadline, kernel_balanced.server.log()[-3000:]
        seen.append(pid_of(kernel_balanced.server.url))
    (restarted,) = set(seen) - {survivor}
    after = [pid_of(kernel_balanced.server.url) for _ in range(20)]
    assert set(after) == {restarted, survivor}, after  # both take connections again
    assert kernel_balanced.pids() == [restarted, survivor]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_sigterm_drains_every_replica_and_the_parent_exits_0(tmp_path: Path) -> None:
    if not reuse_port_balances():
        pytest.skip("kernel balancing needs Linux's SO_REUSEPORT")
    balanced = start_kernel_balanced(tmp_path)
    pids = balanced.pids()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(pid_of, url, 1003.0) for url in balanced.private]  # 3 s each
        for url, future in zip(balanced.private, slow, strict=True):
            while _inflight(url) < 1:  # until the request is in progress
                assert not future.done(), "a slow request ended before the signal"
                time.sleep(0.02)
        balanced.server.process.send_signal(signal.SIGTERM)
        assert [future.result() for future in slow] == pids  # each drained its request
    assert balanced.server.process.wait(60) == 0, balanced.server.log()[-2000:]
    assert not any(_running(pid) for pid in pids)
    assert balanced.server.log().count("draining (readiness 503") == 2


def _inflight(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("lockgate_inflight_requests{")
    )


def test_replicas_that_refuse_their_arguments_stop_the_parent_with_2(tmp_path: Path) -> None:
    if not reuse_port_balances():
        pytest.skip("kernel balancing needs Linux's SO_REUSEPORT")
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(pid_repository(tmp_path))]
    command += ["--port", str(free_port()), "--replica-base-port", str(_free_run(2))]
    command += ["--replicas", "2", "--balance", "kernel", "--max-stop", "-1"]  # bad: < 0
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--max-stop must be an integer of at least 0" in done.stderr
    assert "refused its arguments: stopping them all" in done.stderr


# -- the parent killed: no replica outlives it ---------------------------------------------


def children_of(pid: int) -> set[int]:
    """The processes `pid` started (from any of its threads), read from /proc."""
    tasks = Path(f"/proc/{pid}/task")
    return {int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()}


def kill_and_wait_for(server: RunningServer, children: set[int]) -> None:
    """SIGKILL `server` (no drain of its own, no signal passed on), then wait a few seconds
    for every one of `children` to end."""
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    deadline = time.monotonic() + 10
    while left := {pid for pid in children if _running(pid)}:
        if time.monotonic() > deadline:
            for pid in left:  # not left behind by a failed test
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"replicas {left} outlived their parent")
        time.sleep(0.05)


def bindable(port: int) -> bool:
    """Whether a listening socket may bind 127.0.0.1:`port` without sharing it (SO_REUSEADDR
    alone, as a server restarting on it would: no socket of another process holds it)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen()
        except OSError:
            return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_router_takes_its_replicas_with_it(tmp_path: Path) -> None:
    base = _free_run(2)
    flags = ("--replicas", "2", "--balance", "router", "--replica-base-port", str(base))
    server = start_server(pid_repository(tmp_path), tmp_path, *flags, "--control-state", "off")
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while not all(r["usable"] for r in replicas_of(server)):
            assert time.monotonic() < deadline, replicas_of(server)
            time.sleep(0.1)
        children = children_of(server.process.pid)
        assert len(children) == 2 and pid_of(server.url) in children
    finally:
        kill_and_wait_for(server, children)
    ports = [server.port, base, base + 1]  # the router's and the replicas'
    assert all(bindable(port) for port in ports), ports


def test_a_killed_supervisor_takes_its_replicas_with_it(tmp_path: Path) -> None:
    if not reuse_port_balances():
        pytest.skip("kernel balancing needs Linux's SO_REUSEPORT")
    balanced = start_kernel_balanced(tmp_path)
    pids = balanced.pids()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        assert children_of(balanced.server.process.pid) == set(pids)
        slow = pool.submit(pid_of, balanced.private[0], 1002.0)  # 2 s in the model
        while _inflight(balanced.private[0]) < 1:  # until it is in progress
            assert not slow.done(), "the slow request ended before the kill"
            time.sleep(0.02)
    finally:
        kill_and_wait_for(balanced.server, set(pids))
        pool.shutdown()
    assert slow.result() == pids[0]  # SIGTERM, not SIGKILL: the replica drained it first
    ports = [balanced.server.port, *(int(url.rpartition(":")[2]) for url in balanced.private)]
    assert all(bindable(port) for port in ports), ports
