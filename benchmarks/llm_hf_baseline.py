"""Baseline for the llm_engine suite: Hugging Face `generate` with static batching.

Run as a subprocess of the suite (`python -m benchmarks.llm_hf_baseline ...`), so that
transformers, its thread settings and its memory stay out of the suite's process. It loads
the demo GGUF with `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` (the whole
model is dequantized to dense weights), prints `loaded` and waits for one line on stdin
before it measures, so that the suite can overlap this load with the server's start-up.

Static batching, closed loop at concurrency C: the requests, in workload order, go in
batches of C; a batch is left-padded, decoded greedily for the longest `max_new_tokens` in
it (EOS ignored), and the next batch starts when it ends. A logits processor stamps the time
of every decode step, so each request's timings are counted as if streamed: its first token
when step 1 ends, its last requested token when step `max_new_tokens` ends. Throughput
counts only the tokens asked for, over the wall time of all batches.

The result is one JSON object on the last stdout line: {"levels": [...], ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PAD_ID = 0


@dataclass(slots=True)
class RequestTiming:
    """One request's times in seconds from its batch's start."""

    prompt_tokens: int
    output_tokens: int
    ttft: float
    tpot: float | None  # (last token - first token) / (output tokens - 1)
    e2e_streamed: float  # when its last requested token was produced
    e2e_batch: float  # when generate returned (what a non-streaming client sees)


@dataclass(slots=True)
class LevelTiming:
    concurrency: int
    requests: list[RequestTiming] = field(default_factory=list)
    seconds: float = 0.0  # wall time of every batch
    computed_tokens: int = 0  # batch size x decode steps, summed over batches

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["output_tokens"] = self.output_tokens
        data["output_tokens_per_s"] = self.output_tokens / self.seconds if self.seconds else 0.0
        return data


class StepClock:
    """A logits processor that records when each decode step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.perf_counter())
        return scores


def load_model(gguf: Path, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
    )
    linear = type(model.model.layers[0].self_attn.q_proj)
    if linear is not torch.nn.Linear:  # packed GGUF kernels would not be a dense baseline
        raise RuntimeError(f"expected dense nn.Linear layers, got {linear.__name__}")
    model.generation_config.eos_token_id = None  # ignore EOS: every request runs to its length
    model.generation_config.pad_token_id = PAD_ID
    return model.eval()


def left_pad(prompts: list[list[int]]) -> tuple[Any, Any]:
    """input_ids and attention_mask, [B, longest], padded on the left."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def run_batch(model: Any, prompts: list[list[int]], max_new: list[int]) -> list[RequestTiming]:
    import torch
    from transformers import LogitsProcessorList

    ids, mask = left_pad(prompts)
    clock = StepClock()
    steps = max(max_new)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=steps,
            logits_processor=LogitsProcessorList([clock]),
        )
    end = time.perf_counter()
    stamps = [t - start for t in clock.times]  # stamps[k]: token k+1 of every row is ready
    return [
        RequestTiming(
            prompt_tokens=len(prompt),
            output_tokens=n,
            ttft=stamps[0],
            tpot=(stamps[n - 1] - stamps[0]) / (n - 1) if n > 1 else None,
            e2e_streamed=stamps[n - 1],
            e2e_batch=end - start,
        )
        for prompt, n in zip(prompts, max_new, strict=True)
    ]


def measure_level(
    model: Any, prompts: list[list[int]], max_new: list[int], concurrency: int
) -> LevelTiming:
    """Static batches of `concurrency` requests, one after the other."""
    level = LevelTiming(concurrency)
    start = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        batch = slice(first, first + concurrency)
        level.requests += run_batch(model, prompts[batch], max_new[batch])
        level.computed_tokens += len(prompts[batch]) * max(max_new[batch])
    level.seconds = time.perf_counter() - start
    return level


def parse_levels(text: str) -> list[tuple[int, int]]:
    """ "1:16,8:64" -> [(concurrency 1, 16 requests), (concurrency 8, 64 requests)]."""
    levels = []
    for part in text.split(","):
        concurrency, _, count = part.partition(":")
        levels.append((int(concurrency), int(count)))
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llm_hf_baseline")
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--levels", required=True, help="CONCURRENCY:REQUESTS,...")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--wait", action="store_true", help="wait for a stdin line to start")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from lockgate.bench.workload import load_shared_workload

    prompts, max_new = load_shared_workload(args.workload)
    started = time.perf_counter()
    model = load_model(args.gguf, args.dtype)
    load_seconds = time.perf_counter() - started
    run_batch(model, [prompts[0][:16]], [4])  # first call allocates and warms kernels
    print("loaded", flush=True)
    if args.wait:
        sys.stdin.readline()
    levels = []
    for concurrency, count in parse_levels(args.levels):
        level = measure_level(model, prompts[:count], max_new[:count], concurrency)
        print(f"c={concurrency}: {level.output_tokens / level.seconds:.1f} tok/s", flush=True)
        levels.append(level.to_json())
    result = {
        "dtype": args.dtype,
        "threads": args.threads,
        "load_seconds": load_seconds,
        "attention": model.config._attn_implementation,
        "levels": levels,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
