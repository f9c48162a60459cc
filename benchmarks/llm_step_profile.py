"""Where an LLM engine step spends its time: `python -m benchmarks.llm_step_profile`.

Loads the demo SmolLM2-135M the way the server does (`build_smollm2` writes the model folder,
`load_service` reads it), then drives the synchronous `LLMEngine` directly and prints
medians of:

- a fresh prefill of 250 tokens (one sequence), step time and model forward;
- decode steps at batch 1, 8 and 32 with contexts of about 300 tokens;
- a torch.profiler breakdown of a prefill and of decode steps into linears, the KV write,
  the attention gather, SDPA, RoPE, norms, the MLP activation, sampling, input preparation
  and the rest (Python glue), in milliseconds per step;
- or, with `--first-wave N`, the first N requests of the shared workload (`--workload`; random
  prompts of its shape where the file is missing) added at once, as a closed loop at c=N
  starts: the time until every one has its first token (the TTFT p99 of that loop is about
  this), wall and CPU (every thread of the process), and its steps.

Not a suite of `benchmarks.run` (it defines no `run`); options: `--batches 1,8,32`,
`--steps N`, `--threads N`, `--no-breakdown`, `--first-wave N` (that alone, `--rounds`
times), `--workload FILE`, `--dtype float32|bfloat16`,
`--quantization auto|none|int8|int4`, `--decode-attention auto|kernel|sdpa`,
`--prefill-attention auto|kernel|sdpa` and `--activation-quantization none|int8` (several,
comma-separated: each combination loaded and measured in turn, decode steps interleaved
between them, medians over all rounds).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.llm_engine import SHARED_WORKLOAD, synthetic_requests
from lockgate.bench.workload import load_shared_workload
from lockgate.core.config_files import load_model_config
from lockgate.demo.smollm2 import build_smollm2
from lockgate.llm import quantized_linear, runner
from lockgate.llm.engine import LLMEngine
from lockgate.llm.models import llama, packing
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.service import LLMService
from lockgate.llm.startup import load_service

PREFILL_LEN = 250
CONTEXT_LEN = 300
VOCAB_LOW, VOCAB_HIGH = 100, 40_000  # ordinary token ids, no special tokens


@dataclass(slots=True)
class StepTimes:
    step_ms: float  # median wall time of LLMEngine.step
    forward_ms: float  # median model forward + logits (RunnerOutput.forward_time)

    @classmethod
    def median_of(cls, times: list[tuple[float, float]]) -> StepTimes:
        """From (step seconds, forward seconds) pairs."""
        return cls(
            1e3 * statistics.median(t[0] for t in times),
            1e3 * statistics.median(t[1] for t in times),
        )


def load_demo_service(parameters: dict[str, str], tag: str = "profile") -> tuple[LLMService, float]:
    """The demo model folder with its config's `parameters` updated, loaded by
    `load_service`, and the seconds that took; its async stepping thread stopped."""
    with tempfile.TemporaryDirectory(prefix=f"lockgate-{tag}-") as tmp:
        folder = Path(tmp) / "smollm2"
        folder.mkdir()
        build_smollm2(folder, lambda message: print(f"  build: {message}"))
        config_file = folder / "config.yaml"
        raw = yaml.safe_load(config_file.read_text(encoding="utf-8"))
        raw["parameters"].update(parameters)
        config_file.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
        start = time.perf_counter()
        service = load_service(load_model_config(folder), folder / "1")
        load_seconds = time.perf_counter() - start
    service.close()
    return service, load_seconds


def load_engine(
    dtype: str | None,
    threads: int | None,
    quantization: str | None = None,
    decode_attention: str | None = None,
    activation_quantization: str | None = None,
    prefill_attention: str | None = None,
) -> tuple[LLMEngine, float]:
    """The demo model's engine, every prompt computed in full (no prefix cache)."""
    parameters = {"enable_prefix_caching": "false"}
    if activation_quantization is not None:
        parameters["activation_quantization"] = activation_quantization
    if decode_attention is not None:
        parameters["decode_attention"] = decode_attention
    if prefill_attention is not None:
        parameters["prefill_attention"] = prefill_attention
    if dtype is not None:
        parameters["dtype"] = dtype
    if threads is not None:
        parameters["num_threads"] = str(threads)
    if quantization is not None:
        parameters["quantization"] = quantization
    service, load_seconds = load_demo_service(parameters)
    if threads is not None:  # the engine set them on its own thread; this one steps it
        torch.set_num_threads(threads)
    return service.engine.engine, load_seconds


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


def timed_step(engine: LLMEngine) -> tuple[float, float]:
    """(step seconds, forward seconds) of one engine step."""
    before = engine.counters.forward_time
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start, engine.counters.forward_time - before


def prefill_times(engine: LLMEngine, rng: random.Random, repeats: int) -> list[tuple[float, float]]:
    times = []
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(repeats):
        engine.add_request(random_prompt(rng, PREFILL_LEN), params)
        times.append(timed_step(engine))
        drain(engine)
    return times


def drain(engine: LLMEngine) -> None:
    for seq_id in list(engine.scheduler.sequences):
        engine.abort(seq_id)
    while engine.has_unfinished:
        engine.step()


def start_decodes(engine: LLMEngine, rng: random.Random, batch: int) -> None:
    """`batch` sequences with CONTEXT_LEN-token prompts, prefilled, now decoding."""
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(random_prompt(rng, CONTEXT_LEN), params)
    while any(seq.is_prefill for seq in engine.scheduler.sequences.values()):
        engine.step()


def decode_times(
    engine: LLMEngine, rng: random.Random, batch: int, steps: int
) -> list[tuple[float, float]]:
    start_decodes(engine, rng, batch)
    times = [timed_step(engine) for _ in range(steps)]
    drain(engine)
    return times


def wave_requests(path: Path, count: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) of the workload's first `count` requests; where the file is
    missing, of llm_engine's synthetic workload of its shape (64 to 253 tokens, 32 to 128
    new)."""
    if path.is_file():
        prompts, max_new = load_shared_workload(path)
        return list(zip(prompts, max_new, strict=True))[:count]
    requests = synthetic_requests()
    return [(r["prompt_ids"], r["max_new_tokens"]) for r in requests][:count]


@dataclass(slots=True)
class Wave:
    wall_s: float  # until every request of the wave had its first token
    cpu_s: float  # CPU time of the process meanwhile (all its threads)
    steps: int


def first_wave(engine: LLMEngine, requests: list[tuple[list[int], int]]) -> Wave:
    """The requests added at once, stepped until each has a first token, then dropped."""
    ids = {
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for prompt, n in requests
    }
    started: set[str] = set()
    cpu, start, steps = time.process_time(), time.perf_counter(), 0
    while started != ids:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
        steps += 1
    wave = Wave(time.perf_counter() - start, time.process_time() - cpu, steps)
    drain(engine)
    return wave


def measure_waves(
    engines: dict[str, LLMEngine], requests: list[tuple[list[int], int]], rounds: int
) -> None:
    """Each engine's first wave, the engines taking turns in each round; prints each wave and
    the medians."""
    waves: dict[str, list[Wave]] = {label: [] for label in engines}
    for _ in range(rounds):
        for label, engine in engines.items():
            wave = first_wave(engine, requests)
            waves[label].append(wave)
            print(f"{label}: first wave of {len(requests)}: {1e3 * wave.wall_s:.0f} ms, "
                  f"CPU {1e3 * wave.cpu_s:.0f} ms, {wave.steps} steps")  # fmt: skip
    tokens = sum(len(prompt) for prompt, _ in requests)
    for label, done in waves.items():
        wall = statistics.median(w.wall_s for w in done)
        cpu = statistics.median(w.cpu_s for w in done)
        print(f"{label}: first wave of {len(requests)} ({tokens} prompt tokens), medians of "
              f"{len(done)}: {1e3 * wall:.0f} ms ({tokens / wall:.0f} prompt tokens/s), "
              f"CPU {1e3 * cpu:.0f} ms")  # fmt: skip


# breakdown ------------------------------------------------------------------------------------

# (range label, module or class, attribute): each callable runs inside a profiler range
PATCHES: list[tuple[str, Any, str]] = [
    ("linear (incl. logits head)", nn.Linear, "forward"),
    ("linear (incl. logits head)", packing.PackedLinear, "forward"),
    ("linear (incl. logits head)", quantized_linear.QuantizedLinear, "forward"),
    ("rmsnorm", llama.RMSNorm, "forward"),
    ("rope", llama, "apply_rope"),
    ("kv write", llama, "write_kv"),
    ("attention plan", llama, "plan_attention"),
    ("attention", llama, "paged_attention"),
    ("mlp activation", llama.F, "silu"),
    ("sampling", runner.Sampler, "__call__"),
    ("prepare inputs", runner.ModelRunner, "prepare"),
]
SDPA_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product")


def _ranged(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(f"lg::{label}"):
            return fn(*args, **kwargs)

    return wrapper


@contextmanager
def labelled_ranges() -> Iterator[None]:
    saved = [(owner, name, getattr(owner, name)) for _, owner, name in PATCHES]
    try:
        for label, owner, name in PATCHES:
            setattr(owner, name, _ranged(label, getattr(owner, name)))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def breakdown(engine: LLMEngine, rng: random.Random, batch: int, steps: int) -> dict[str, float]:
    """Milliseconds per decode step (batch > 0) or per fresh prefill of PREFILL_LEN tokens
    (batch 0) in each labelled range, plus attention's SDPA share."""
    if batch:
        start_decodes(engine, rng, batch)
    else:
        steps = 1
        engine.add_request(random_prompt(rng, PREFILL_LEN), SamplingParams(max_tokens=1))
    with labelled_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
    drain(engine)
    per_step: dict[str, float] = {}
    sdpa = 0.0
    for event in prof.key_averages():
        if event.key.startswith("lg::"):
            per_step[event.key[4:]] = event.cpu_time_total / 1e3 / steps
        elif event.key.startswith(SDPA_OPS) and event.key.endswith("attention"):
            sdpa = max(sdpa, event.cpu_time_total / 1e3 / steps)
    if "attention" in per_step:
        per_step["attention: SDPA"] = sdpa
        per_step["attention: kernels, gather, masks, copies"] = per_step.pop("attention") - sdpa
    per_step["other (python glue)"] = 1e3 * wall / steps - sum(per_step.values())
    per_step["step (profiled)"] = 1e3 * wall / steps
    return per_step


def measure(
    engines: dict[str, LLMEngine], batches: list[int], steps: int, rounds: int
) -> dict[str, dict[int, StepTimes]]:
    """Per engine: batch (0: a prefill of PREFILL_LEN) -> medians. The engines take turns
    in each round, so a slow spell of a shared machine falls on all of them."""
    rng = random.Random(0)
    raw: dict[str, dict[int, list[tuple[float, float]]]] = {
        label: {b: [] for b in [0, *batches]} for label in engines
    }
    for _ in range(rounds):
        for label, engine in engines.items():
            raw[label][0] += prefill_times(engine, rng, repeats=max(2, 6 // rounds))
            for batch in batches:
                raw[label][batch] += decode_times(engine, rng, batch, max(1, steps // rounds))
    return {
        label: {b: StepTimes.median_of(times) for b, times in per_batch.items()}
        for label, per_batch in raw.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llm_step_profile")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    parser.add_argument("--rounds", type=int, default=1, help="turns the engines take")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"))
    parser.add_argument("--quantization", help="auto, none, int8, int4; comma-separated")
    parser.add_argument("--decode-attention", help="auto, kernel, sdpa; comma-separated")
    parser.add_argument("--prefill-attention", help="auto, kernel, sdpa; comma-separated")
    parser.add_argument("--activation-quantization", help="none, int8; comma-separated")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument(
        "--first-wave", type=int, default=0, help="N: the first N workload requests at once"
    )
    parser.add_argument("--workload", type=Path, default=SHARED_WORKLOAD)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    engines: dict[str, LLMEngine] = {}
    quantizations = args.quantization.split(",") if args.quantization else [None]
    attentions = args.decode_attention.split(",") if args.decode_attention else [None]
    prefills = args.prefill_attention.split(",") if args.prefill_attention else [None]
    activations = (
        args.activation_quantization.split(",") if args.activation_quantization else [None]
    )
    for quantization, attention, prefill, activation in itertools.product(
        quantizations, attentions, prefills, activations
    ):
        engine, load_seconds = load_engine(
            args.dtype, args.threads, quantization, attention, activation, prefill
        )
        parts = (
            quantization,
            attention,
            prefill and f"prefill {prefill}",
            activation and f"activations {activation}",
        )
        label = "/".join(x for x in parts if x) or "default"
        engines[label] = engine
        print(f"{label}: loaded in {load_seconds:.2f} s; dtype {engine.config.dtype}, "
              f"{torch.get_num_threads()} threads")  # fmt: skip
    if args.first_wave:
        requests = wave_requests(args.workload, args.first_wave)
        measure_waves(engines, requests, args.rounds)
        return 0
    results = measure(engines, batches, args.steps, args.rounds)
    for label, per_batch in results.items():
        prefill = per_batch[0]
        print(f"{label}: prefill {PREFILL_LEN} tokens: step {prefill.step_ms:.1f} ms, "
              f"forward {prefill.forward_ms:.1f} ms")  # fmt: skip
        for batch in batches:
            t = per_batch[batch]
            print(f"{label}: decode batch {batch:>2} (ctx ~{CONTEXT_LEN}): step {t.step_ms:.1f} "
                  f"ms, forward {t.forward_ms:.1f} ms, {1e3 * batch / t.step_ms:.0f} tok/s, "
                  f"overhead {1 - t.forward_ms / t.step_ms:.0%}")  # fmt: skip
    if not args.no_breakdown:
        rng = random.Random(1)
        for label, engine in engines.items():
            for batch in [0, *batches]:
                what = f"decode batch {batch}" if batch else f"prefill {PREFILL_LEN}"
                print(f"{label}: breakdown, {what} (ms per step, profiler on):")
                for name, ms in breakdown(engine, rng, batch, max(3, args.steps // 4)).items():
                    print(f"  {name:<34} {ms:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
