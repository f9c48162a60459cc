"""Poll mode (`--model-control-mode poll`) through a real server: versions and models added to
the repository are loaded, a changed model reloads without a gap, a removed one is unloaded,
and a broken change leaves the loaded model serving."""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, _write_python_model, start_server

POLL_S = 0.2
BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("poll-repo")
    _write_python_model(root, "echo", {})
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("poll-server")
    mode = ("--model-control-mode", "poll", "--repository-poll-secs", str(POLL_S))
    running = start_server(repo, tmp, "--no-llm", *mode)
    yield running
    running.stop()


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the repository change was not acted on in time"
        time.sleep(0.05)


def ready(server: RunningServer, path: str) -> bool:
    return httpx.get(f"{server.url}/v2/models/{path}/ready").status_code == 200


class SteadyClient:
    """Sends echo one request at a time until stopped, counting the statuses."""

    def __init__(self, server: RunningServer) -> None:
        self.url = server.url + "/v2/models/echo/infer"
        self.statuses: Counter[int] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                self.statuses[client.post(self.url, json=BODY).status_code] += 1
                time.sleep(0.01)

    def __enter__(self) -> SteadyClient:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def test_poll_mode_follows_the_repository_without_a_gap(
    server: RunningServer, repo: Path, tmp_path: Path
) -> None:
    assert ready(server, "echo")
    with SteadyClient(server) as steady:
        # a new version, written beside the model and moved in whole
        shutil.copytree(repo / "echo" / "1", tmp_path / "2")
        shutil.move(tmp_path / "2", repo / "echo" / "2")
        wait_for(lambda: ready(server, "echo/versions/2"))
        wait_for(lambda: not ready(server, "echo/versions/1"))  # the policy serves the latest
        # a new model, and its removal
        shutil.copytree(repo / "echo", tmp_path / "echo_b")
        shutil.move(tmp_path / "echo_b", repo / "echo_b")
        wait_for(lambda: ready(server, "echo_b"))
        shutil.rmtree(repo / "echo_b")
        wait_for(lambda: httpx.get(f"{server.url}/v2/models/echo_b/ready").status_code == 404)
        # a broken config: the reload fails, the loaded version serves on
        (repo / "echo" / "config.yaml").write_text("backend: python\nmax_batch_size: [\n")
        time.sleep(6 * POLL_S)
        assert ready(server, "echo/versions/2")
    assert steady.statuses[200] > 20 and set(steady.statuses) == {200}, steady.statuses
    index = httpx.post(server.url + "/v2/repository/index").json()
    assert [m["name"] for m in index] == ["echo"]
    load = httpx.post(server.url + "/v2/repository/models/echo/load")
    assert load.status_code == 403 and "explicit" in load.json()["error"]  # as in none mode
