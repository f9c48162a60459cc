"""Shared fixtures: model repositories built on the fly and real servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
PERF_ANALYZER = ROOT / ".venv-perf" / "bin" / "perf_analyzer_wrapped"  # install-perf-analyzer.sh


def http_post(path: str, body: bytes, port: int) -> bytes:
    """A raw HTTP/1.1 POST of a JSON `body` to `path`, kept alive."""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_HANDED_OUT: set[int] = set()  # every port `free_port` returned in this session
_HANDING_OUT = threading.Lock()  # the servers started while tests are collected take theirs too


def free_port() -> int:
    """A port free now, and never one this session was given before: servers started side by
    side (`start_servers`) each take theirs before any of them binds it."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        with _HANDING_OUT:
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


@dataclass
class RunningServer:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    grpc_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def grpc_address(self) -> str:
        assert self.grpc_port is not None, "server started without gRPC"
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def openai_client(self) -> openai.OpenAI:
        """The official client on this server's /v1, with no retries: a refusal fails."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def metric(self, name: str, labels: str | None = None) -> float:
        """A metric's value from /metrics: the series with exactly `labels` (as written
        between the braces), or the sum of all its series."""
        text = httpx.get(self.url + "/metrics").text
        braces = rf"{{{re.escape(labels)}}}" if labels is not None else r"(?:{[^}]*})?"
        pattern = rf"^{re.escape(name)}{braces} (\S+)$"
        values = [float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE)]
        assert values, f"{name} {labels or ''} is not on /metrics"
        return sum(values)

    def wait_ready(self, ready_timeout: float = 180.0, wait_ready: bool = True) -> RunningServer:
        """This server, once its readiness (or, without `wait_ready`, its liveness) answers 200;
        stopped, and RuntimeError with its log, if it exits or is not ready in time."""
        deadline = time.monotonic() + ready_timeout
        path = "/v2/health/ready" if wait_ready else "/v2/health/live"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready in {ready_timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    repository: Path,
    tmp: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    ready_timeout: float = 180.0,
    wait_ready: bool = True,
    grpc_port: int | None = None,
    python: str | None = None,
    port: int | None = None,
) -> RunningServer:
    """A server on `port` (default: a free one); gRPC only on `grpc_port` (off by default: no
    clash on 8001). `python` runs the lockgate installed in another environment (from outside
    the checkout)."""
    server = launch_server(
        repository, tmp, *extra, env=env, grpc_port=grpc_port, python=python, port=port
    )
    return server.wait_ready(ready_timeout, wait_ready)


def start_servers(*launched: RunningServer, ready_timeout: float = 180.0) -> list[RunningServer]:
    """Servers launched side by side (`launch_server`), each once ready: their start-ups
    overlap (on two cores, mostly imports each on a core of its own). If one fails, all stop."""
    try:
        return [server.wait_ready(ready_timeout) for server in launched]
    except BaseException:
        for server in launched:
            server.stop()
        raise


def launch_server(
    repository: Path,
    tmp: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    grpc_port: int | None = None,
    python: str | None = None,
    port: int | None = None,
) -> RunningServer:
    """`start_server`'s process, started and not waited for: `RunningServer.wait_ready`, or
    `start_servers` for several."""
    port = port or free_port()
    log_path = tmp / f"server-{port}.log"
    cmd = [
        python or sys.executable,
        "-m",
        "lockgate.cli",
        "serve",
        str(repository),
        "--port",
        str(port),
    ]
    cmd += ["--grpc-port", str(grpc_port) if grpc_port is not None else "off"]
    # the test machine is shared by the servers, the clients and whatever else runs: wider
    # saturation bounds than the defaults keep functional tests from being refused as
    # saturated; the gate's own tests set theirs
    if "--max-loop-lag-ms" not in extra:
        cmd += ["--max-loop-lag-ms", "50"]
    if "--queue-target-ms" not in extra:
        cmd += ["--queue-target-ms", "50"]
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*cmd, *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=tmp if python else ROOT,
        )
    return RunningServer(process, port, log_path, grpc_port)


# -- repositories ----------------------------------------------------------------------

FAULTY_MODEL = '''
import time
import numpy as np

class Model:
    """Doubles its input. Raises on every `fail_every`-th batch of values >= 1000 (warmup and
    profiling send small values), and on any batch that holds -13; sleeps when asked."""

    def load(self, config, version_dir):
        self.fail_every = int(config.parameters.get("fail_every", "0"))
        self.batches = 0

    def infer(self, inputs):
        x = inputs["x"]
        if np.any(x == -13):
            raise ValueError("cannot take -13")
        if float(x.flat[0]) >= 1000:
            self.batches += 1
        if self.fail_every and x.flat[0] >= 1000 and self.batches % self.fail_every == 0:
            raise RuntimeError(f"injected failure on batch {self.batches}")
        delay = float(np.max(inputs["delay"])) if "delay" in inputs else 0.0
        if delay > 0:
            time.sleep(delay)
        return {"y": x * 2}
'''


def _write_python_model(repo: Path, name: str, parameters: dict[str, str], extra: str = "") -> None:
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(FAULTY_MODEL)
    params = "".join(f'\n  {k}: "{v}"' for k, v in parameters.items())
    (folder / "config.yaml").write_text(
        textwrap.dedent(
            """\
            backend: python
            max_batch_size: 8
            inputs:
              - {name: x, datatype: FP32, dims: [4]}
              - {name: delay, datatype: FP32, dims: [1], optional: true}
            outputs:
              - {name: y, datatype: FP32, dims: [4]}
            """
        )
        + (f"parameters:{params}\n" if parameters else "")
        + extra
    )


CLASSIC_DEMO_MODELS = ("digits_onnx", "digits_sklearn", "minilm")  # `demo_repo`'s


def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session builds its demo repositories: $LOCKGATE_CACHE_DIR, or a folder of
    its own (the one `_Prestart` built in, when it did)."""
    if _PRESTART is not None:
        return _PRESTART.cache
    return Path(os.environ.get("LOCKGATE_CACHE_DIR", tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled demo repository (classic models), built once per session."""
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository

    classic = [m for m in DEMO_MODELS if m.name in CLASSIC_DEMO_MODELS]
    # (a no-op where `_Prestart` built it: models already there are skipped)
    return build_demo_repository(demo_cache(tmp_path_factory) / "demo-test", models=classic)


@pytest.fixture(scope="session")
def test_repo(tmp_path_factory: pytest.TempPathFactory, demo_repo: Path) -> Path:
    """Demo models plus small python models that fail, hang or sleep on request."""
    if _PRESTART is not None:
        return _PRESTART.take_repo("test_repo")
    return build_test_repo(tmp_path_factory.mktemp("repo"), demo_repo)


def build_test_repo(repo: Path, demo_repo: Path) -> Path:
    """`repo`, made `test_repo`."""
    for model in CLASSIC_DEMO_MODELS:
        shutil.copytree(demo_repo / model, repo / model)
    _write_python_model(repo, "echo", {})
    _write_python_model(repo, "faulty", {"fail_every": "10"})
    _write_python_model(
        repo,
        "slow",
        {},
        "dynamic_batching: {max_queue_size: 4, priority_levels: 2, default_priority_level: 2}\n",
    )
    broken = repo / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    (broken / "config.yaml").write_text("backend: onnxruntime\nmax_batch_size: 4\n")
    return repo


def models_of(source: Path, target: Path, *models: str) -> Path:
    """`target`, made a repository of `source`'s `models` alone: a server that needs no other
    model starts in about a second (minilm's warmup and scikit-learn's import take seconds)."""
    for model in models:
        shutil.copytree(source / model, target / model)
    return target


def launch_test_repo_server(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> RunningServer:
    tmp = tmp_path_factory.mktemp("server")
    return launch_server(test_repo, tmp, "--no-llm", grpc_port=free_port())


def start_test_repo_server(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> RunningServer:
    """`test_repo` over HTTP and gRPC, without a language model."""
    return launch_test_repo_server(test_repo, tmp_path_factory).wait_ready()


@pytest.fixture(scope="session")
def server(test_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One `test_repo` server for the session: its tests load and unload nothing, unregister
    what they register, read counters as deltas and wait for their own requests. A module that
    floods it (overload, hostile input) starts one of its own with `start_test_repo_server`.
    It exits cleanly after all of it."""
    if _PRESTART is not None:
        running = _PRESTART.take("server")
    else:
        running = start_test_repo_server(test_repo, tmp_path_factory)
    yield running
    assert running.stop() == 0, running.log()[-2000:]


def smollm2_repository(
    demo_repo: Path,
    repo: Path,
    parameters: dict[str, str],
    extra: dict[str, object] | None = None,
    folder: str = "smollm2",
) -> Path:
    """`repo` with SmolLM2 from the demo build (built once per session, weights hard-linked)
    in model folder `folder`, its config's `parameters` updated and `extra` keys set."""
    import yaml

    from lockgate.demo.build import DEMO_MODELS, build_demo_repository

    llm = [m for m in DEMO_MODELS if m.name == "smollm2"]
    built = build_demo_repository(demo_repo.parent / "demo-llm-test", models=llm)
    target = repo / folder
    shutil.copytree(built / "smollm2", target, copy_function=os.link)
    config = yaml.safe_load((target / "config.yaml").read_text())
    config["parameters"].update(parameters)
    config.update(extra or {})
    (target / "config.yaml").unlink()  # hard-linked to the build: write a file of its own
    (target / "config.yaml").write_text(yaml.safe_dump(config))
    return repo


# the parameter that gives a test's language model one torch thread: on a 2-core machine
# shared with the tests' clients and other servers, two spinning threads make a decode step
# several times slower (as `tests/llm/conftest.py`'s `one_thread` says of the engine itself)
ONE_THREAD = {"num_threads": "1"}


def build_llm_repo(repo: Path, demo_repo: Path) -> Path:
    """`repo`, made `llm_server`'s repository."""
    shutil.copytree(demo_repo / "minilm", repo / "minilm")
    parameters = {
        "kv_cache_gib": "0.05",
        "max_model_len": "512",
        "max_waiting": "256",
        **ONE_THREAD,
    }
    smollm2_repository(demo_repo, repo, {**parameters, "dtype": "float32", "quantization": "none"})
    return repo


def launch_llm_server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    """`llm_server`'s process (`RunningServer.wait_ready`: ready_timeout=600)."""
    return launch_server(repo, tmp_path_factory.mktemp("llm-server"), grpc_port=free_port())


@pytest.fixture(scope="session")
def llm_server(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """One server for the whole session: SmolLM2 (small KV cache, 512-token context) and the
    minilm embedding model, over HTTP and gRPC."""
    if _PRESTART is not None:
        server = _PRESTART.take("llm_server")
    else:
        repo = build_llm_repo(tmp_path_factory.mktemp("llm-repo"), demo_repo)
        server = launch_llm_server(repo, tmp_path_factory).wait_ready(600)
    yield server
    assert server.stop() == 0, server.log()[-2000:]


# the served names of `llm_variants_server`'s models, and its model folders' names
CACHED_LLM, CACHED_FOLDER = "SmolLM2-cached", "smollm2_cached"
GREEDY_LLM, GREEDY_FOLDER = "SmolLM2-greedy", "smollm2_greedy"
SPECULATIVE_LLM = "SmolLM2-speculative"  # folder smollm2_speculative
BOS_FOLDER = "tiny"  # served as tests/bos_model.py's BOS_MODEL


@pytest.fixture(scope="session")
def llm_variants_repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The language models the tests need besides `llm_server`'s, each in a folder of its own
    and served under a name of its own, so that one process loads them all:

    - smollm2: SmolLM2 as `llm_server` serves it (a second replica of it);
    - smollm2_cached, CACHED_LLM: SmolLM2 with its response cache on;
    - smollm2_greedy, GREEDY_LLM: SmolLM2 with a generation_config.json of its own that asks
      for greedy sampling (SmolLM2's asks for temperature 0.2);
    - smollm2_speculative, SPECULATIVE_LLM: SmolLM2 as `llm_server` serves it, plus
      `speculative: ngram` with 5 drafts a step;
    - tiny, BOS_MODEL: a tiny model whose tokenizer adds BOS (`tests/bos_model.py`);

    and digits_onnx, a classic model."""
    if _PRESTART is not None:
        return _PRESTART.take_repo("llm_variants_repo")
    return build_llm_variants_repo(tmp_path_factory.mktemp("llm-variants-repo"), demo_repo)


def build_llm_variants_repo(repo: Path, demo_repo: Path) -> Path:
    """`repo`, made `llm_variants_repo`."""
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository
    from tests.bos_model import write_bos_model_folder

    shutil.copytree(demo_repo / "digits_onnx", repo / "digits_onnx")
    dense = {
        "kv_cache_gib": "0.05",
        "max_model_len": "512",
        "dtype": "float32",
        "quantization": "none",  # exact against `llm_server`'s
        **ONE_THREAD,
    }
    smollm2_repository(demo_repo, repo, {**dense, "max_waiting": "256"})
    cache = {"response_cache": {"enable": True, "ttl_s": 600}}
    cached = {**dense, "served_model_name": CACHED_LLM}
    smollm2_repository(demo_repo, repo, cached, cache, folder=CACHED_FOLDER)
    greedy = {**dense, "served_model_name": GREEDY_LLM}
    smollm2_repository(demo_repo, repo, greedy, folder=GREEDY_FOLDER)
    generation_config = repo / GREEDY_FOLDER / "1" / "generation_config.json"
    generation_config.unlink(missing_ok=True)  # hard-linked to the build: write one of its own
    generation_config.write_text(json.dumps({"temperature": 0, "top_k": 50, "eos_token_id": 2}))
    speculative = {**dense, "max_waiting": "256", "served_model_name": SPECULATIVE_LLM}
    speculative |= {"speculative": "ngram", "num_speculative_tokens": "5"}
    smollm2_repository(demo_repo, repo, speculative, folder="smollm2_speculative")
    llm = [m for m in DEMO_MODELS if m.name == "smollm2"]
    built = build_demo_repository(demo_repo.parent / "demo-llm-test", models=llm)
    write_bos_model_folder(built / "smollm2" / "1" / "model.gguf", repo / BOS_FOLDER)
    return repo


@pytest.fixture(scope="session")
def llm_variants_server(
    llm_variants_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """One server for `llm_variants_repo`'s models, over HTTP and gRPC; they load side by side.
    Its tests each ask a model of their own (the cache's tests prompts of their own), change
    no model's state and read counters as deltas over their own requests."""
    if _PRESTART is not None:
        running = _PRESTART.take("llm_variants_server")
    else:
        running = launch_llm_variants_server(llm_variants_repo, tmp_path_factory).wait_ready(600)
    yield running
    assert running.stop() == 0, running.log()[-2000:]


def launch_llm_variants_server(
    llm_variants_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> RunningServer:
    tmp = tmp_path_factory.mktemp("llm-variants")
    return launch_server(llm_variants_repo, tmp, grpc_port=free_port())


def digits_rows(n: int) -> np.ndarray:
    from sklearn.datasets import load_digits

    x = load_digits().data[:n] / 16.0
    return x.astype(np.float32)


# -- memory under hostile input ----------------------------------------------------------

# the servers a test may use, by fixture name: their memory is watched by `bounded_rss`
SERVER_FIXTURES = ("server", "impatient_server", "llm_server", "gated", "saturable", "embedder")
RSS_GROWTH_BOUND_MIB = 128  # peak RSS growth of a server during one hostile case (README)


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for process {pid}")


def _reset_peak(pid: int) -> bool:
    """Reset the process's peak RSS (VmHWM) to its RSS now; False where Linux does not let."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@pytest.fixture
def bounded_rss(request: pytest.FixtureRequest) -> Iterator[None]:
    """The peak RSS of every server the test uses grows by less than RSS_GROWTH_BOUND_MIB
    while it runs: hostile input costs the server bounded memory."""
    servers: list[RunningServer] = [
        request.getfixturevalue(name) for name in SERVER_FIXTURES if name in request.fixturenames
    ]
    before = {}
    for s in servers:
        pid = s.process.pid
        peak = "VmHWM" if _reset_peak(pid) else "VmRSS"  # VmRSS: the growth left at the end
        before[pid] = (peak, _status_mib(pid, "VmRSS"))
    yield
    for s in servers:
        pid = s.process.pid
        if s.process.poll() is not None:
            continue  # a test that stops its server says why
        peak, start = before[pid]
        grown = _status_mib(pid, peak) - start
        request.node.user_properties.append(("rss_growth_mib", round(grown, 1)))
        assert grown < RSS_GROWTH_BOUND_MIB, f"server RSS peaked {grown:.0f} MiB above its start"


# -- the session's servers, started while a full run collects its tests ---------------------


def build_session_repositories(
    cache: Path, test_repo: Path, llm_repo: Path, llm_variants_repo: Path
) -> None:
    """The demo repositories in `cache` (as `demo_repo` and `smollm2_repository` build them),
    and the repositories of `test_repo`, `llm_server` and `llm_variants_repo`."""
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository

    classic = [m for m in DEMO_MODELS if m.name in CLASSIC_DEMO_MODELS]
    demo = build_demo_repository(cache / "demo-test", models=classic)
    build_test_repo(test_repo, demo)
    build_llm_repo(llm_repo, demo)
    build_llm_variants_repo(llm_variants_repo, demo)


# `build_session_repositories` in a process of its own: a thread of this one would hold the
# interpreter's lock that collection needs (the tiny BOS model's GGUF alone takes seconds)
BUILD = """
import sys
from pathlib import Path
from tests.conftest import build_session_repositories
build_session_repositories(*map(Path, sys.argv[1:]))
"""

# the session-scoped servers `_Prestart` starts, by fixture name, in the order they start
PRESTARTED = ("llm_variants_server", "llm_server", "server")


class _Prestart:
    """`server`, `llm_server` and `llm_variants_server`, started on a thread while a full run
    (pytest on its testpaths, as `make test` runs it) collects its tests: collection keeps one
    core busy for tens of seconds, and the repositories' build (`BUILD`) and these servers'
    start-ups (model loads, warmups) take the other. Collection ends by waiting until each is
    ready, so no test runs beside a start-up; each fixture then takes its server as it would
    have started it."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.cache = Path(os.environ.get("LOCKGATE_CACHE_DIR", factory.mktemp("cache")))
        self.repos: dict[str, Path] = {}
        self.servers: dict[str, RunningServer] = {}
        self.ready: dict[str, BaseException | None] = {}  # by name: None, or why it failed
        self.error: BaseException | None = None  # why the rest were not started
        self.thread = threading.Thread(target=self._start, name="prestart", daemon=True)
        self.thread.start()

    def _start(self) -> None:
        try:
            names = ("test_repo", "llm-repo", "llm_variants_repo")
            folders = ("repo", "llm-repo", "llm-variants-repo")
            repos = {n: self.factory.mktemp(f) for n, f in zip(names, folders, strict=True)}
            build = [sys.executable, "-c", BUILD, str(self.cache), *map(str, repos.values())]
            built = subprocess.run(build, cwd=ROOT, capture_output=True, text=True)
            if built.returncode != 0:
                raise RuntimeError(f"the session's repositories failed:\n{built.stderr[-3000:]}")
            self.repos.update(repos)
            launch = {
                "llm_variants_server": lambda: launch_llm_variants_server(
                    repos["llm_variants_repo"], self.factory
                ),
                "llm_server": lambda: launch_llm_server(repos["llm-repo"], self.factory),
                "server": lambda: launch_test_repo_server(repos["test_repo"], self.factory),
            }
            for name in PRESTARTED:
                self.servers[name] = launch[name]()
        except BaseException as exc:  # the fixtures raise it
            self.error = exc

    def wait(self) -> None:
        """Until each server is ready, or has failed (its fixture raises why)."""
        self.thread.join()
        for name, server in self.servers.items():
            if name not in self.ready:
                try:
                    server.wait_ready(600)
                    self.ready[name] = None
                except Exception as exc:
                    self.ready[name] = exc

    def take(self, name: str) -> RunningServer:
        self.wait()
        if name not in self.servers:
            raise RuntimeError(f"the session's servers did not start: {self.error!r}")
        failed = self.ready[name]
        if failed is not None:
            raise RuntimeError(f"{name} did not start") from failed
        return self.servers[name]

    def take_repo(self, name: str) -> Path:
        self.thread.join()
        if name not in self.repos:
            raise RuntimeError(f"the session's repositories were not built: {self.error!r}")
        return self.repos[name]

    def stop(self) -> None:
        self.thread.join()
        for server in self.servers.values():
            server.stop()


_PRESTART: _Prestart | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _PRESTART
    config = session.config
    full_run = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    chosen = config.option.keyword or config.option.markexpr or config.option.collectonly
    if full_run and not chosen and os.environ.get("LOCKGATE_TEST_PRESTART", "1") != "0":
        _PRESTART = _Prestart(config._tmp_path_factory)  # type: ignore[attr-defined]


def pytest_collection_finish(session: pytest.Session) -> None:
    if _PRESTART is not None:
        _PRESTART.wait()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _PRESTART is not None:
        _PRESTART.stop()  # those a fixture did not take (it stops its own, and checks how)
