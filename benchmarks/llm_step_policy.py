"""A burst of prompts behind running decodes, under each `step_policy`:
`python -m benchmarks.llm_step_policy`.

Loads the demo SmolLM2-135M twice the way the server does (`load_demo_service` of
`llm_step_profile`), one engine with `step_policy: decode_first` and one with `prefill_first`,
and drives each synchronous `LLMEngine` directly, in turns (`--rounds`):

1. `--decodes` sequences with `--context`-token prompts are prefilled and left decoding;
2. a burst of `--burst` prompts of `--prompt` tokens arrives at once;
3. steps run until every prompt of the burst has its first token: the time that took (the
   burst's last TTFT, counted from its arrival) and how many tokens the running sequences
   decoded meanwhile.

With short contexts, a decode row costs about what a prompt token does inside a prefill
chunk's matmuls, so the policies differ little; with long ones, each decode also reads its
whole KV cache, and prompts that go first wait for none of that. Not a suite of
`benchmarks.run` (it defines no `run`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.llm_step_profile import drain, load_demo_service, random_prompt
from lockgate.llm.engine import LLMEngine
from lockgate.llm.sequence import SamplingParams

POLICIES = ("decode_first", "prefill_first")


def load(policy: str, threads: int, max_num_seqs: int) -> LLMEngine:
    parameters = {
        "enable_prefix_caching": "false",
        "num_threads": str(threads),
        "step_policy": policy,
        "max_num_seqs": str(max_num_seqs),
    }
    service, _ = load_demo_service(parameters, tag=f"policy-{policy}")
    return service.engine.engine


def burst(engine: LLMEngine, rng: random.Random, args: argparse.Namespace) -> tuple[float, int]:
    """(seconds until the burst's last first token, tokens decoded meanwhile)."""
    running = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for _ in range(args.decodes):
        engine.add_request(random_prompt(rng, args.context), running)
    while any(s.is_prefill for s in engine.scheduler.sequences.values()):
        engine.step()
    decoders = list(engine.scheduler.sequences.values())
    before = sum(s.num_output_tokens for s in decoders)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = [engine.add_request(random_prompt(rng, args.prompt), first) for _ in range(args.burst)]
    start = time.perf_counter()
    while any(i in engine.scheduler.sequences for i in ids):
        engine.step()
    seconds = time.perf_counter() - start
    decoded = sum(s.num_output_tokens for s in decoders) - before
    drain(engine)
    return seconds, decoded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llm_step_policy")
    parser.add_argument("--decodes", type=int, default=32, help="sequences decoding")
    parser.add_argument("--context", type=int, default=1000, help="their prompt tokens")
    parser.add_argument("--burst", type=int, default=16, help="prompts arriving at once")
    parser.add_argument("--prompt", type=int, default=250, help="tokens per burst prompt")
    parser.add_argument("--rounds", type=int, default=3, help="turns the engines take")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    engines = {p: load(p, args.threads, args.decodes + args.burst) for p in POLICIES}
    results: dict[str, list[tuple[float, int]]] = {p: [] for p in POLICIES}
    rng = random.Random(0)
    for r in range(args.rounds):
        for policy, engine in engines.items():
            results[policy].append(burst(engine, rng, args))
            seconds, decoded = results[policy][-1]
            print(
                f"round {r + 1}/{args.rounds} {policy}: burst's last first token after "
                f"{seconds * 1e3:.0f} ms, {decoded} tokens decoded meanwhile",
                flush=True,
            )
    print(
        f"{args.decodes} sequences decoding at ~{args.context} tokens of context, a burst of "
        f"{args.burst} prompts of {args.prompt} tokens; medians of {args.rounds} rounds:"
    )
    for policy, runs in results.items():
        last_ttft = statistics.median(s for s, _ in runs)
        tokens = statistics.median(float(d) for _, d in runs)
        print(f"  {policy:<14} last TTFT {last_ttft * 1e3:7.0f} ms, {tokens:5.0f} tokens decoded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
