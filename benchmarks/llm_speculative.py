"""Speculative decoding by prompt lookup, on and off: `python -m benchmarks.llm_speculative`.

Loads the demo SmolLM2-135M the way the server does (`build_smollm2` writes the model folder,
`load_service` reads it, with `speculative: ngram` and prefix caching off), builds a second
engine over the same model and KV cache tensors with speculation off, and drives both
synchronous `LLMEngine`s directly at concurrency 1 with greedy decoding. Two workloads of chat
prompts:

- copy: the answer copies the prompt (repeat a paragraph, fix its spelling, rename a variable
  in a function), where prompt lookup finds the next tokens;
- free: open questions whose answers copy nothing.

For each quantization, workload and setting it prints the median over `--repeats` rounds
(interleaved: off, on, off, on, ...) of output tokens per second (all prompts of the workload
one after another, EOS ends an answer), and for speculation the acceptance rate (accepted over
drafted tokens) and the output tokens per decode step, how many answers are the same tokens
with speculation and without, and whether each setting gave the same answers in every round
(in bfloat16 a k + 1-token verification rounds differently from a 1-token decode, so a greedy
near-tie can go the other way; in float32 the answers are the same).

Not a suite of `benchmarks.run` (it defines no `run`); options: `--quantization auto,none`,
`--repeats N`, `--max-tokens N`, `--threads N`, `--num-speculative-tokens K`,
`--dtype bfloat16|float32` (float32 needs `--quantization none`), `--prompt-lookup MIN,MAX`.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass

from benchmarks.llm_step_profile import load_demo_service
from lockgate.llm.engine import LLMEngine
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.tokenizer import ChatTokenizer

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and polished the great lens, "
    "so that ships passing in the dark would know where the rocks were. When the storms came "
    "in from the west, he stayed awake until morning and wrote in his logbook the name of "
    "every vessel that went by."
)
TYPOS = PARAGRAPH.replace("cliff", "clif").replace("narrow", "narow").replace("every", "evry")
CODE = (
    "def total(items):\n    x = 0\n    for item in items:\n        if item.price > 0:\n"
    "            x += item.price * item.quantity\n    return x\n"
)
WORKLOADS = {
    "copy": [
        "Repeat this text exactly: " + PARAGRAPH,
        "Fix the spelling mistakes in this text and return the whole text: " + TYPOS,
        "Rename the variable x to running_total in this function and return the code:\n" + CODE,
    ],
    "free": [
        "Explain how photosynthesis works in plants.",
        "What are three tips for staying healthy?",
        "Write a short story about a dragon who learns to bake bread.",
    ],
}


@dataclass(slots=True)
class Round:
    tokens: int
    seconds: float
    decode_tokens: int  # after each prompt's first token (sampled by its prefill step)
    decode_steps: int
    drafts: int
    accepted: int
    outputs: list[list[int]]  # token ids of each answer


def load_engines(
    quantization: str, threads: int, k: int, dtype: str = "bfloat16", lookup: str = "2,4"
) -> tuple[LLMEngine, LLMEngine, ChatTokenizer]:
    """(without, with speculation): one model and KV cache, loaded by `load_service`."""
    low, high = lookup.split(",")
    parameters = {
        "quantization": quantization,
        "dtype": dtype,
        "num_threads": str(threads),
        "kv_cache_gib": "0.25",
        "enable_prefix_caching": "false",  # the two engines share the KV cache's tensors
        "speculative": "ngram",
        "num_speculative_tokens": str(k),
        "prompt_lookup_min": low,
        "prompt_lookup_max": high,
    }
    service, _ = load_demo_service(parameters, "speculative")
    spec = service.engine.engine
    plain_config = dataclasses.replace(spec.config, speculative="none")
    plain = LLMEngine(
        spec.runner.model,
        spec.runner.kv_caches,
        plain_config,
        eos_token_ids=spec.eos_token_ids,
    )
    return plain, spec, service.tokenizer


def run_round(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> Round:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    steps0, gen0 = engine.counters.num_steps, engine.counters.generation_tokens
    drafts0, accepted0 = engine.speculation.num_draft_tokens, engine.speculation.num_accepted_tokens
    seconds, outputs = 0.0, []
    for prompt in prompts:
        start = time.perf_counter()
        outputs += engine.generate([prompt], params)
        seconds += time.perf_counter() - start
    c, s = engine.counters, engine.speculation
    return Round(
        c.generation_tokens - gen0,
        seconds,
        c.generation_tokens - gen0 - len(prompts),
        c.num_steps - steps0 - len(prompts),  # one step prefills each prompt
        s.num_draft_tokens - drafts0,
        s.num_accepted_tokens - accepted0,
        outputs,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="auto,none")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prompt-lookup", default="2,4", help="min,max suffix tokens")
    args = parser.parse_args()
    for quantization in args.quantization.split(","):
        plain, spec, tokenizer = load_engines(
            quantization, args.threads, args.num_speculative_tokens, args.dtype, args.prompt_lookup
        )
        for name, texts in WORKLOADS.items():
            prompts = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
            rounds: dict[str, list[Round]] = {"off": [], "ngram": []}
            for _ in range(args.repeats):
                rounds["off"].append(run_round(plain, prompts, args.max_tokens))
                rounds["ngram"].append(run_round(spec, prompts, args.max_tokens))
            report(quantization, name, rounds)


def report(quantization: str, workload: str, rounds: dict[str, list[Round]]) -> None:
    rate = {k: statistics.median(r.tokens / r.seconds for r in v) for k, v in rounds.items()}
    on = rounds["ngram"]
    acceptance = statistics.median(r.accepted / r.drafts if r.drafts else 0.0 for r in on)
    per_step = statistics.median(r.decode_tokens / max(1, r.decode_steps) for r in on)
    off = rounds["off"]
    stable = all(r.outputs == v[0].outputs for v in (on, off) for r in v)
    same = sum(a == b for a, b in zip(off[0].outputs, on[0].outputs, strict=True))
    print(
        f"{quantization:>5} {workload:>5}: off {rate['off']:6.1f} tok/s, ngram {rate['ngram']:6.1f}"
        f" tok/s ({rate['ngram'] / rate['off']:.2f}x); acceptance {acceptance:.0%}, "
        f"{per_step:.2f} tokens per decode step; {on[0].tokens} output tokens; answers the same "
        f"with and without: {same} of {len(on[0].outputs)}; each setting the same in every "
        f"round: {'yes' if stable else 'no'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
