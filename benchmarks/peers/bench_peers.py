"""lockgate against peer model servers, side by side on one machine, with one load generator.

Every server runs pinned to core 0 (`taskset -c 0`, children included); this process, the
load generator (lockgate bench's open-loop Poisson engine), moves itself to core 1. Each
server hosts one model at a time, in one serving process where the peer allows it.

Per server and model:
    1. a sweep of offered rates (Poisson, open loop, latency from the scheduled send time),
       stopped once the server falls behind: capacity = the best completed req/s;
       "max rate" = the highest offered rate whose p99 stayed under 50 ms;
    2. two longer runs at 50 % and 90 % of that server's own capacity: p50 and p99;
    3. the RSS of the server's process tree (peak while under load), from /proc.
The language model part runs the shared workload (token-id prompts, greedy, EOS ignored)
through lockgate's OpenAI API and llama.cpp's llama-server at concurrency 1, 8 and 32.

Run by run.sh, which installs the peers and sets the environment; see benchmarks/peers/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from lockgate.bench.arrivals import arrival_schedule
from lockgate.bench.loadgen import Level, connection_limit, run_level
from lockgate.bench.report import SLO, LevelReport, build_level_report
from lockgate.bench.workload import Payload, load_shared_workload, openai_payloads

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LOGS = HERE / ".logs"
VENVS = HERE / ".venvs"
SERVER_CORE, CLIENT_CORE = 0, 1
SLO_MS = 50.0
DELAY_MS = 2.0
MAX_BATCH = {"digits": 16, "minilm": 32}
SWEEP = (25, 50, 100, 150, 200, 300, 400, 600, 800, 1200, 1600, 2400, 3200)
WORKLOAD = Path("/work/shared/bench/llm_workload_64.json")

# -- payloads: the same rows and sentences for every server, in each server's format ------

_WORD_TEXT = (
    "the quick brown fox jumps over a lazy dog while river light and cold mountain air "
    "carry the smell of pine through a quiet morning garden near the old stone bridge where "
    "children play music and merchants sell yellow silver paper in the busy market"
)
_WORDS = tuple(_WORD_TEXT.split())


def digits_rows(count: int = 64) -> list[list[float]]:
    from sklearn.datasets import load_digits

    data = (load_digits().data[:count] / 16.0).astype(np.float32)  # [count, 64]
    return [[round(float(v), 4) for v in row] for row in data]


def sentences(count: int = 64, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 33, size=count)  # words per sentence
    return [" ".join(rng.choice(_WORDS, size=int(n))) for n in lengths]


def v2_body(model: str, item: list[float] | str) -> dict[str, Any]:
    if model == "digits":
        tensor = {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": item}
    else:
        tensor = {"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [item]}
    return {"inputs": [tensor]}


def json_body(model: str, item: list[float] | str, style: str) -> dict[str, Any]:
    """LitServe and Ray Serve take one item per request; BentoML batchable APIs take a list."""
    key = "input" if model == "digits" else "text"
    if style == "bentoml":
        return {"rows": [item]} if model == "digits" else {"texts": [item]}
    return {key: item}


def payloads(model: str, style: str) -> list[Payload]:
    items: list[Any] = digits_rows() if model == "digits" else sentences()
    make: Callable[[Any], dict[str, Any]]
    if style == "v2":
        make = lambda item: v2_body(model, item)  # noqa: E731
    else:
        make = lambda item: json_body(model, item, style)  # noqa: E731
    return [Payload(json.dumps(make(item)).encode()) for item in items]


# -- servers ------------------------------------------------------------------------------


@dataclass(slots=True)
class Server:
    name: str  # e.g. "mlserver"
    model: str  # "digits" | "minilm"
    command: list[str]
    port: int
    path: str  # POST path of one inference
    style: str  # "v2" | "litserve" | "bentoml" | "ray"
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    batching: str = ""  # how this server batches, for the table
    cores: str = str(SERVER_CORE)  # taskset CPU list
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    def start(self) -> None:
        LOGS.mkdir(exist_ok=True)
        log = (LOGS / f"{self.name}_{self.model}.log").open("wb")
        env = {**os.environ, **self.env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        command = ["taskset", "-c", self.cores, *self.command]
        self.process = subprocess.Popen(
            command, env=env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        for pid in tree(self.process.pid):  # daemons that left the group (ray)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process = None

    def wait_ready(self, probe: bytes, timeout: float = 300.0) -> bytes:
        """POST `probe` until the server answers 200; its body."""
        deadline = time.monotonic() + timeout
        error = ""
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {LOGS}/{self.name}_{self.model}.log")
            try:
                request = urllib.request.Request(
                    self.url, data=probe, headers={"content-type": "application/json"}
                )
                with urllib.request.urlopen(request, timeout=30) as response:
                    return bytes(response.read())
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                error = str(exc)
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {error}")


def tree(root: int) -> list[int]:
    """root and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def rss_mib(root: int) -> float:
    """VmRSS summed over the process tree, MiB (shared pages count once per process)."""
    total_kb = 0
    for pid in tree(root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


class RssSampler:
    """Peak RSS of a process tree, sampled every 0.5 s on a thread."""

    def __init__(self, root: int) -> None:
        self.root, self.peak, self._stop = root, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.root))
            self._stop.wait(0.5)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def venv_python(peer: str) -> str:
    return str(VENVS / peer / "bin" / "python")


def peer_servers(model: str, port: int) -> list[Server]:
    env = {
        "PEER_MODEL": model,
        "PEER_PORT": str(port),
        f"PEER_{model.upper()}_MAX_BATCH": str(MAX_BATCH[model]),
        "PEER_MAX_DELAY_MS": str(DELAY_MS),
        "PYTHONPATH": str(HERE),
        **model_files(),
    }
    batch = f"adaptive {MAX_BATCH[model]} / {DELAY_MS:g} ms"
    mlserver_dir = LOGS / f"mlserver_{model}"
    servers = [
        Server(
            "mlserver", model,
            [str(VENVS / "mlserver" / "bin" / "mlserver"), "start", str(mlserver_dir)],
            port, f"/v2/models/{model}/infer", "v2", env, batching=batch,
        ),
        Server(
            "kserve", model, [venv_python("kserve"), str(HERE / "serve_kserve.py")],
            port, f"/v2/models/{model}/infer", "v2", env, batching="none (no in-process batcher)",
        ),
        Server(
            "litserve", model, [venv_python("litserve"), str(HERE / "serve_litserve.py")],
            port, "/predict", "litserve", env, batching=batch,
        ),
        Server(
            "bentoml", model,
            [str(VENVS / "bentoml" / "bin" / "bentoml"), "serve", "serve_bentoml:Service",
             "--port", str(port), "--host", "127.0.0.1"],
            port, "/predict", "bentoml", env, cwd=HERE,
            batching=f"adaptive {MAX_BATCH[model]}, max_latency_ms 10000",
        ),
        Server(
            "ray", model, [venv_python("ray"), str(HERE / "serve_ray.py")],
            port, "/", "ray", env, batching=batch,
        ),
    ]  # fmt: skip
    write_mlserver_settings(mlserver_dir, model, port)
    return [s for s in servers if (VENVS / s.name / ".installed").exists()]


def model_files() -> dict[str, str]:
    """Where the peers read the model files: the same files lockgate serves."""
    from lockgate.demo.build import MINILM_ONNX_PACKAGE, MINILM_TOKENIZER_PACKAGE, package_folder

    return {
        "PEER_DIGITS_ONNX": str(HERE / ".build" / "demo" / "digits_onnx" / "1" / "model.onnx"),
        "PEER_MINILM_ONNX": str(package_folder(MINILM_ONNX_PACKAGE) / "model.onnx"),
        "PEER_MINILM_TOKENIZER": str(
            package_folder(MINILM_TOKENIZER_PACKAGE) / "model" / "tokenizer.json"
        ),
    }


def write_mlserver_settings(folder: Path, model: str, port: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        "http_port": port,
        "grpc_port": port + 1,
        "metrics_port": port + 2,
        "parallel_workers": 0,  # inference in the serving process, as ANCHORS measured
        "debug": False,
    }
    (folder / "settings.json").write_text(json.dumps(settings))
    model_settings = {
        "name": model,
        "implementation": "serve_mlserver.PeerModel",
        "max_batch_size": MAX_BATCH[model],
        "max_batch_time": DELAY_MS / 1e3,
        "parameters": {"extra": {"model": model}},
    }
    (folder / "model-settings.json").write_text(json.dumps(model_settings))


def build_demo(dest: Path, name: str) -> None:
    from lockgate.demo.build import DEMO_MODELS, build_demo_repository

    build_demo_repository(dest, models=[m for m in DEMO_MODELS if m.name == name])


def lockgate_repo(model: str, variant: str) -> Path:
    """A one-model repository: `same` = max batch and max delay as the peers, no SLO;
    `slo` = the demo's own config (its latency_slo_ms), with the same max batch."""

    demo = HERE / ".build" / "demo"
    name = "digits_onnx" if model == "digits" else "minilm"
    if not (demo / name / "config.yaml").exists():
        build_demo(demo, name)
    repo = HERE / ".build" / f"repo_{model}_{variant}"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(demo / name, repo / model)
    config_path = repo / model / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["name"] = model
    config["max_batch_size"] = MAX_BATCH[model]
    config["warmup"] = [w for w in config.get("warmup", []) if w["batch_size"] <= MAX_BATCH[model]]
    if variant == "same":
        config["dynamic_batching"] = {"max_queue_delay_us": int(DELAY_MS * 1000)}
        config.pop("latency_slo_ms", None)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return repo


def lockgate_server(model: str, port: int, variant: str) -> Server:
    repo = lockgate_repo(model, variant)
    config = yaml.safe_load((repo / model / "config.yaml").read_text())
    delay = config["dynamic_batching"].get("max_queue_delay_us", 0) / 1000
    batching = f"dynamic {MAX_BATCH[model]} / {delay:g} ms"
    if config.get("latency_slo_ms"):
        batching += f", latency_slo_ms {config['latency_slo_ms']:g}"
    lockgate = str(ROOT / ".venv" / "bin" / "lockgate")
    command = [lockgate, "serve", str(repo), "--port", str(port), "--no-llm"]
    name = "lockgate" if variant == "same" else "lockgate-slo"
    return Server(name, model, command, port, f"/v2/models/{model}/infer", "v2", batching=batching)


# -- checks -------------------------------------------------------------------------------


def check_answer(server: Server, body: bytes, reference: np.ndarray) -> str:
    """Compare a server's answer to the first payload with the reference output."""
    answer = json.loads(body)
    if server.style == "v2":
        outputs = {o["name"]: o for o in answer["outputs"]}
        key = "label" if server.model == "digits" else "embedding"
        value = np.asarray(outputs[key]["data"], dtype=np.float64).reshape(-1)
    else:
        key = "label" if server.model == "digits" else "embedding"
        item = answer[0] if isinstance(answer, list) else answer  # BentoML: one per row
        raw = item[key]
        value = np.asarray(raw, dtype=np.float64).reshape(-1)
    if server.model == "digits":
        return "ok" if int(value[0]) == int(reference[0]) else f"label {value[0]} != {reference}"
    cosine = float(value @ reference / (np.linalg.norm(value) * np.linalg.norm(reference)))
    return "ok" if cosine > 0.999 else f"cosine {cosine:.4f} to the reference"


def reference(model: str) -> np.ndarray:
    sys.path.insert(0, str(HERE))
    import peer_models

    if model == "digits":
        onnx = HERE / ".build" / "demo" / "digits_onnx" / "1" / "model.onnx"
        label, _ = peer_models.Digits(str(onnx))(np.asarray([digits_rows()[0]]))
        return label
    files = model_files()
    minilm = peer_models.MiniLM(files["PEER_MINILM_ONNX"], files["PEER_MINILM_TOKENIZER"])
    return minilm([sentences()[0]])[0]  # the first payload of the 64


# -- load ---------------------------------------------------------------------------------


def summarize(level: LevelReport) -> dict[str, Any]:
    lat = level.latency_ms
    return {
        "offered_rate": level.offered_rate,
        "sent_rate": round(level.sent_rate, 1),
        "throughput": round(level.throughput, 1),
        "completed": level.completed,
        "requests": level.requests,
        "errors": level.errors,
        "p50_ms": round(lat.p50, 2),
        "p90_ms": round(lat.p90, 2),
        "p99_ms": round(lat.p99, 2),
        "client_send_lag_p99_ms": round(level.send_lag_ms.p99, 2),
        "client_cpu_util": round(level.client_cpu_util, 2),
    }


async def open_level(
    session: aiohttp.ClientSession, url: str, bodies: list[Payload], rate: float, seconds: float
) -> dict[str, Any]:
    level = Level(rate=rate, duration=seconds, warmup=1.0)
    schedule = arrival_schedule(rate, "poisson", duration=seconds, warmup=1.0, seed=int(rate))
    result = await run_level(session, url, bodies, level, schedule=schedule, progress=None)
    return summarize(build_level_report(result, SLO(latency_ms=SLO_MS), llm=False))


async def measure(server: Server, bodies: list[Payload], quick: bool) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=4096, limit_per_host=4096)
    timeout = aiohttp.ClientTimeout(total=30)
    sweep_s, steady_s = (2.0, 4.0) if quick else (3.0, 8.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sweep = []
        for rate in SWEEP:
            row = await open_level(session, server.url, bodies, rate, sweep_s)
            sweep.append(row)
            print(f"  {server.name:12s} {server.model:6s} rate {rate:5d}: {brief(row)}")
            await asyncio.sleep(1.0)  # drain
            if row["throughput"] < 0.85 * row["sent_rate"] or row["p99_ms"] > 1000:
                break
        capacity = max(r["throughput"] for r in sweep)
        under = [r["offered_rate"] for r in sweep if r["p99_ms"] < SLO_MS and not r["errors"]]
        steady = {}
        for share in (0.5, 0.9):
            row = await open_level(session, server.url, bodies, share * capacity, steady_s)
            steady[f"{share:.0%}"] = row
            print(f"  {server.name:12s} {server.model:6s} {share:.0%} of capacity: {brief(row)}")
            await asyncio.sleep(1.0)
    return {
        "capacity_rps": capacity,
        "max_rate_p99_under_50ms": max(under) if under else None,
        "sweep": sweep,
        "at_50": steady["50%"],
        "at_90": steady["90%"],
    }


def brief(row: dict[str, Any]) -> str:
    errors = f" errors {row['errors']}" if row["errors"] else ""
    return (
        f"{row['throughput']:8.1f} req/s  p50 {row['p50_ms']:7.2f} ms  "
        f"p99 {row['p99_ms']:8.2f} ms{errors}"
    )


def run_server(server: Server, quick: bool, ref: np.ndarray) -> dict[str, Any]:
    bodies = payloads(server.model, server.style)
    print(f"[{server.name} / {server.model}] starting: {' '.join(server.command)}")
    started = time.monotonic()
    server.start()
    try:
        first = server.wait_ready(bodies[0].body)
        startup_s = time.monotonic() - started
        check = check_answer(server, first, ref)
        assert server.process is not None
        idle = rss_mib(server.process.pid)
        with RssSampler(server.process.pid) as sampler:
            result = asyncio.run(measure(server, bodies, quick))
        result.update(
            startup_s=round(startup_s, 1),
            answer_check=check,
            rss_idle_mib=round(idle, 1),
            rss_peak_mib=round(sampler.peak, 1),
            processes=len(tree(server.process.pid)),
        )
        return result
    except Exception as exc:  # a peer that fails is reported, not fatal
        print(f"[{server.name} / {server.model}] FAILED: {exc}")
        return {"error": str(exc)}
    finally:
        server.stop()
        time.sleep(1.0)


# -- language model -----------------------------------------------------------------------


def llm_payloads(model: str, extra: dict[str, Any]) -> list[Payload]:
    prompts, max_new = load_shared_workload(WORKLOAD)
    bodies = openai_payloads("openai-completions", model, prompts, max_new, ignore_eos=True)
    out = []
    for payload in bodies:
        body = {**json.loads(payload.body), **extra}
        out.append(Payload(json.dumps(body).encode(), payload.max_tokens))
    return out


async def llm_levels(
    url: str, bodies: list[Payload], levels: tuple[int, ...], keep_alive: bool = True
) -> list[Any]:
    """`keep_alive` False: a new connection per request (llama-server closes a connection after
    a streamed answer, and reusing it at once races that close: a `connection_error`)."""
    rows = []
    for concurrency in levels:
        level = Level(concurrency=concurrency, num_requests=len(bodies))
        limit = connection_limit(level)
        connector = aiohttp.TCPConnector(
            limit=limit, limit_per_host=limit, force_close=not keep_alive
        )
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            result = await run_level(session, url, bodies, level, stream=True, progress=None)
        report = build_level_report(result, SLO(), llm=True)
        assert report.llm is not None
        row = {
            "concurrency": concurrency,
            "completed": report.completed,
            "errors": report.errors,
            "output_tok_s": round(report.llm.output_tokens_per_s, 1),
            "output_tokens": report.llm.total_output_tokens,
            "ttft_p50_s": round(report.llm.ttft_ms.p50 / 1e3, 3),
            "ttft_p99_s": round(report.llm.ttft_ms.p99 / 1e3, 3),
            "tpot_p50_ms": round(report.llm.tpot_ms.p50, 1),
        }
        print(f"  c={concurrency}: {row}")
        rows.append(row)
    return rows


def llm_server(name: str, port: int) -> tuple[Server, str, dict[str, Any]]:
    """(server, model name in requests, extra body fields)."""

    repo = HERE / ".build" / "demo_llm"
    shutil.rmtree(repo, ignore_errors=True)  # follow the current demo config
    build_demo(repo, "smollm2")
    config_path = repo / "smollm2" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    # the same prompts come back at every level: no prefix cache on either side
    config.setdefault("parameters", {})["enable_prefix_caching"] = "false"
    config_path.write_text(yaml.safe_dump(config))
    if name == "lockgate":
        command = [
            str(ROOT / ".venv" / "bin" / "lockgate"),
            "serve",
            str(repo),
            "--port",
            str(port),
        ]
        server = Server(name, "smollm2", command, port, "/v1/completions", "openai")
        return server, str(config["parameters"].get("served_model_name", "smollm2")), {}
    binary = Path(os.environ.get("LOCKGATE_LLAMA_SERVER") or "llama-server (not built)")
    gguf = next((repo / "smollm2").glob("*/model.gguf"))
    command = [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1",
               "-t", "2", "--parallel", "32", "--cont-batching", "-c", "16384", "-nr"]  # fmt: skip
    server = Server("llama.cpp", "smollm2", command, port, "/v1/completions", "openai")
    return server, "smollm2", {"cache_prompt": False}


def run_llm(name: str, port: int, levels: tuple[int, ...]) -> dict[str, Any]:
    try:
        server, model, extra = llm_server(name, port)
    except Exception as exc:
        return {"error": f"setup: {exc}"}
    if name != "lockgate" and not Path(server.command[0]).exists():
        return {"error": f"{server.command[0]} was not built; see {LOGS}/build_llama.log"}
    server.cores = "0,1"  # the LLM servers use both cores (2 threads), as in ANCHORS.md
    bodies = llm_payloads(model, extra)
    probe = json.loads(bodies[0].body)
    probe.update(stream=False, max_tokens=2)
    probe.pop("stream_options", None)
    print(f"[{name} / smollm2] starting")
    server.start()
    try:
        server.wait_ready(json.dumps(probe).encode(), timeout=600)
        assert server.process is not None
        with RssSampler(server.process.pid) as sampler:
            rows = asyncio.run(llm_levels(server.url, bodies, levels, name == "lockgate"))
        return {"levels": rows, "rss_peak_mib": round(sampler.peak, 1)}
    except Exception as exc:
        print(f"[{name} / smollm2] FAILED: {exc}")
        return {"error": str(exc)}
    finally:
        server.stop()
        time.sleep(1.0)


# -- report -------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu}, {os.cpu_count()} CPUs, {platform.machine()}, {platform.system()}",
        "cpus": os.cpu_count(),
        "pinning": True,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    found = {}
    for peer in ("mlserver", "kserve", "litserve", "bentoml", "ray"):
        frozen = VENVS / peer / ".installed"
        if frozen.exists():
            for line in frozen.read_text().splitlines():
                if line.lower().startswith(f"{peer}=="):
                    found[peer] = line.split("==", 1)[1]
    return found


def ratio_rows(models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in benchmarks/run.py's schema: lockgate's value against each peer's."""
    rows = []
    for model, servers in models.items():
        ours = servers.get("lockgate", {})
        for name, peer in servers.items():
            if name.startswith("lockgate") or "error" in peer or "capacity_rps" not in ours:
                continue
            rows.append(_row(f"{model}: capacity vs {name}", ours["capacity_rps"],
                             peer["capacity_rps"], name, "req/s", "higher is better"))  # fmt: skip
            rows.append(_row(f"{model}: p99 at 90% load vs {name}", ours["at_90"]["p99_ms"],
                             peer["at_90"]["p99_ms"], name, "ms",
                             "each at 90% of its own capacity; lower is better"))  # fmt: skip
    return rows


def _row(label: str, value: float, base: float, name: str, unit: str, note: str) -> dict[str, Any]:
    return {
        "label": label, "value": value, "unit": unit, "baseline": base, "baseline_label": name,
        "ratio": round(value / base, 3) if base else None, "note": note,
    }  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        "# lockgate and peer servers, side by side\n",
        f"Run {env['date']} on {env['machine']}; load average {env['load_average_1m']} at the "
        f"end. Peer versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items())}.\n",
        "Server on core 0, load generator (lockgate bench, open-loop Poisson) on core 1. "
        "Capacity: best completed req/s over a rising-rate sweep. p50/p99 at 50 % and 90 % "
        "of each server's own capacity. Max rate: highest swept rate with p99 < 50 ms. "
        "RSS: peak over the run, whole process tree.\n",
    ]
    runs = result.get("runs", {})
    for model, servers in result["models"].items():
        lines += [
            f"## {model}\n",
            f"Measured {', '.join(sorted({r.get('measured', '?') for r in servers.values()}))}.\n",
            "| server | batching | capacity req/s | max rate p99<50ms | p50 @50% | p99 @50% "
            "| p50 @90% | p99 @90% | RSS MiB | procs | check |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for name, r in servers.items():
            if "error" in r:
                lines.append(f"| {name} | | failed: {r['error'][:80]} | | | | | | | | |")
                continue
            a, b = r["at_50"], r["at_90"]
            cells = [
                name, r["batching"], f"{r['capacity_rps']:.0f}",
                str(r["max_rate_p99_under_50ms"]), f"{a['p50_ms']:.2f}", f"{a['p99_ms']:.2f}",
                f"{b['p50_ms']:.2f}", f"{b['p99_ms']:.2f}", f"{r['rss_peak_mib']:.0f}",
                str(r["processes"]), r["answer_check"],
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if result["rows"]:
        lines += ["## lockgate / peer ratios\n", "| measure | lockgate | peer | ratio | note |",
                  "|---|---:|---:|---:|---|"]  # fmt: skip
        for row in result["rows"]:
            lines.append(
                f"| {row['label']} | {row['value']:.2f} {row['unit']} | {row['baseline']:.2f} "
                f"{row['unit']} | {row['ratio']:.2f}x | {row['note']} |"
            )
        lines.append("")
    if result.get("llm"):
        lines += [
            "## SmolLM2-135M-Instruct (shared workload, streaming, greedy, EOS ignored)\n",
            "| server | concurrency | output tok/s | TTFT p50 / p99 s | TPOT p50 ms | errors |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for name, r in result["llm"].items():
            if "error" in r:
                lines.append(f"| {name} | | failed: {r['error'][:100]} | | | |")
                continue
            for lv in r["levels"]:
                lines.append(
                    f"| {name} | {lv['concurrency']} | {lv['output_tok_s']:.1f} | "
                    f"{lv['ttft_p50_s']:.2f} / {lv['ttft_p99_s']:.2f} | {lv['tpot_p50_ms']:.1f} | "
                    f"{lv['errors'] or ''} |"
                )
        lines.append("")
        dates = [f"{n} {runs[f'llm:{n}']}" for n in result["llm"] if f"llm:{n}" in runs]
        lines += [f"Measured: {', '.join(dates)}.\n"] if dates else []
    lines += [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


NOTES = [
    "Same model files everywhere: the digits LogisticRegression as ONNX (onnxruntime, 1 "
    "intra-op thread; MLServer runs it through a custom runtime, not mlserver-sklearn) and "
    "the int8 all-MiniLM-L6-v2 ONNX with its tokenizer, mean pooling and L2 norm.",
    "lockgate and MLServer/KServe answer KServe v2 JSON; LitServe, BentoML and Ray Serve "
    "answer their own JSON (one item per request) sent by the same load generator.",
    "KServe's Python server has no in-process adaptive batcher (its batcher is a sidecar), "
    "so it runs unbatched. BentoML's adaptive batcher takes a latency bound, not a delay: "
    "max_latency_ms 10000, so that it never sheds load (at 50 ms it answered 503s).",
    "lockgate-slo is the demo config's own latency_slo_ms with the same max batch size.",
    "The machine is shared with other work; absolute numbers are noisy, ratios are from one run.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="lockgate,lockgate-slo,mlserver,kserve,litserve,"
                        "bentoml,ray")  # fmt: skip
    parser.add_argument("--models", default="digits,minilm", help="'' to skip")
    parser.add_argument("--llm", default="lockgate,llama.cpp", help="'' to skip")
    parser.add_argument("--llm-concurrency", default="1,8,32")
    parser.add_argument("--quick", action="store_true", help="short levels, for a smoke test")
    parser.add_argument("--port", type=int, default=18500)
    parser.add_argument("--output", default=str(RESULTS / "peers"))
    parser.add_argument("--render", help="only rewrite the .md of an existing .json")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the earlier results in --output for the servers and models not run now",
    )
    args = parser.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        saved["rows"], saved["notes"] = ratio_rows(saved["models"]), NOTES
        Path(args.render).write_text(json.dumps(saved, indent=2))
        Path(args.render).with_suffix(".md").write_text(table := markdown(saved))
        print(table)
        return 0
    os.sched_setaffinity(0, {CLIENT_CORE})
    wanted = args.servers.split(",")
    started = time.monotonic()
    models: dict[str, dict[str, Any]] = {}
    for model in filter(None, args.models.split(",")):
        lockgate_repo(model, "same")  # builds the demo models once
        ref = reference(model)
        servers = [lockgate_server(model, args.port, "same"), lockgate_server(model, args.port,
                   "slo"), *peer_servers(model, args.port)]  # fmt: skip
        models[model] = {}
        for server in servers:
            if server.name in wanted:
                result = run_server(server, args.quick, ref)
                models[model][server.name] = {
                    "batching": server.batching,
                    "measured": environment()["date"],
                    **result,
                }
    llm = {}
    for name in filter(None, args.llm.split(",")):
        levels = tuple(int(c) for c in args.llm_concurrency.split(","))
        llm[name] = run_llm(name, args.port, levels)
    runs = {f"llm:{n}": environment()["date"] for n in llm}
    output = Path(args.output)
    if args.merge and output.with_suffix(".json").exists():
        earlier = json.loads(output.with_suffix(".json").read_text())
        first = earlier["environment"]["date"]
        for servers in earlier["models"].values():
            for entry in servers.values():
                entry.setdefault("measured", first)
        runs = {**earlier.get("runs", {}), **runs}
        models = {
            name: {**earlier["models"].get(name, {}), **models.get(name, {})}
            for name in {**earlier["models"], **models}
        }
        llm = {**earlier.get("llm", {}), **llm}
    result = {
        "suite": "peers",
        "title": "lockgate against peer model servers (make bench-peers)",
        "target": "lockgate ahead of each peer on capacity and on p99 at 90% load",
        "met": None,
        "seconds": round(time.monotonic() - started, 1),
        "environment": environment(),
        "versions": versions(),
        "rows": ratio_rows(models),
        "notes": NOTES,
        "models": models,
        "llm": llm,
        "runs": runs,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    output.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
