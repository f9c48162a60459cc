from __future__ import annotations

import asyncio
import gc
import random
import threading
import time

import pytest
import torch

from lockgate.errors import BackendError, BadRequest, ConfigError
from lockgate.llm.async_engine import AsyncLLMEngine
from lockgate.llm.attention import AttentionMetadata, KVCache
from lockgate.llm.engine import LLMEngine, RequestOutput
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.loader import Checkpoint
from lockgate.llm.metrics import RequestTimings
from lockgate.llm.models import allocate_kv_cache as allocate_llama_kv_cache
from lockgate.llm.runner import CausalLM
from lockgate.llm.scheduler import QueueFull
from lockgate.llm.sequence import FinishReason, SamplingParams, TokenLogprobs
from lockgate.llm.tokenizer import ChatTokenizer, IncrementalDetokenizer
from tests.llm.conftest import smollm2_engine
from tests.llm.fake_model import VOCAB, FakeModel, LetterDecoder, allocate_kv_cache, next_token

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(
    blocks: int = 256, model: FakeModel | None = None, **overrides: object
) -> LLMEngine:
    settings: dict[str, object] = {
        "block_size": BS,
        "kv_cache_blocks": blocks,
        "max_model_len": 128,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 16,
    }
    settings.update(overrides)
    eos: tuple[int, ...] = settings.pop("eos", ())  # type: ignore[assignment]
    config = EngineConfig(**settings)  # type: ignore[arg-type]
    return LLMEngine(
        model or FakeModel(),
        allocate_kv_cache(blocks, BS),
        config,
        eos_token_ids=eos,
        seed=0,
    )


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    prompts = []
    for _ in range(n):
        head = rng.choice(shared) if rng.random() < 0.6 else []
        prompts.append(head + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))])
    return prompts


def run_all(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
        engine.check_invariants()
    return [tokens[i] for i in ids]


def test_single_request_matches_the_reference() -> None:
    engine = make_engine()
    assert engine.generate([[3, 1, 4, 1, 5]], GREEDY) == [reference([3, 1, 4, 1, 5], 12)]


@pytest.mark.parametrize("blocks", [256, 24])
def test_concurrent_requests_equal_each_run_alone(blocks: int) -> None:
    prompts = random_prompts(24, seed=blocks)
    rng = random.Random(1)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20), ignore_eos=True)
        for _ in prompts
    ]
    engine = make_engine(blocks=blocks, max_model_len=80)
    outputs = run_all(engine, prompts, params)
    for prompt, sp, out in zip(prompts, params, outputs, strict=True):
        assert out == reference(prompt, sp.max_tokens)
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    if blocks == 24:
        assert stats.num_preemptions > 0
    assert stats.num_free_blocks == blocks and stats.num_running == stats.num_waiting == 0
    assert stats.finished_by_reason == {"length": 24}
    engine.check_invariants()


def test_seeded_sampling_is_independent_of_batching_and_preemption() -> None:
    prompts = random_prompts(12, seed=7)
    params = [
        SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=10, ignore_eos=True)
        for i in range(len(prompts))
    ]
    together = run_all(make_engine(blocks=20, max_model_len=80), prompts, params)
    alone = [run_all(make_engine(), [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert together == alone
    assert together != [reference(p, 10) for p in prompts]  # really sampled


def test_static_batching_gives_the_same_outputs() -> None:
    prompts = random_prompts(10, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True) for i in range(10)]
    engine = make_engine(continuous_batching=False, max_num_seqs=4)
    assert run_all(engine, prompts, params) == [reference(p, 5 + i) for i, p in enumerate(prompts)]


def test_stops_on_eos_and_stop_tokens_unless_ignored() -> None:
    prompt = [3, 1, 4]
    ref = reference(prompt, 10)
    eos = ref[3]
    engine = make_engine(eos=(eos,))
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert out == ref[: ref.index(eos) + 1]
    ignored = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )
    assert ignored[0] == ref
    stop_tok = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=(ref[5],)
    )
    assert engine.generate([prompt], stop_tok)[0] == ref[: ref.index(ref[5]) + 1]
    assert engine.stats().finished_by_reason == {"stop": 2, "length": 1}


def test_context_limit_finishes_with_length() -> None:
    engine = make_engine(max_model_len=16)
    rid = engine.add_request(list(range(10)), SamplingParams(temperature=0.0, max_tokens=100))
    outputs = [o for _ in range(20) for o in engine.step()]
    last = outputs[-1]
    assert last.request_id == rid and last.finished and last.finish_reason is FinishReason.LENGTH
    assert last.num_prompt_tokens + last.num_output_tokens == 16


def test_stop_strings_cut_the_text_before_the_stop() -> None:
    prompt = [2, 7, 1, 8]
    ref = reference(prompt, 20)
    letters = "".join(chr(97 + t % 26) for t in ref)
    stop = letters[6:8]
    engine = make_engine()
    engine.decoder_factory = lambda _prompt, _skip: LetterDecoder()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20, stop=(stop,)))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished:
        outputs += engine.step()
    text = "".join(o.text for o in outputs)
    assert text == letters[: letters.index(stop)]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert sum(len(o.new_token_ids) for o in outputs) == letters.index(stop) + len(stop)


def test_abort_and_deadline_free_blocks() -> None:
    engine = make_engine()
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    a = engine.add_request(list(range(20)), long)
    engine.add_request(list(range(5)), long, request_id="b", deadline=time.monotonic() + 0.05)
    engine.step()
    assert engine.abort(a) and not engine.abort(a)
    engine.check_invariants()
    time.sleep(0.06)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("b", FinishReason.DEADLINE)]
    assert not engine.has_unfinished
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.finished_by_reason == {"abort": 1, "deadline": 1}


class Recorder:
    """A request observer that keeps what it is told."""

    def __init__(self) -> None:
        self.tokens = 0
        self.done: list[RequestTimings] = []

    def token(self, timings: RequestTimings) -> None:
        self.tokens += 1

    def finished(self, timings: RequestTimings) -> None:
        self.done.append(timings)


def test_request_timings_and_step_stats_are_recorded() -> None:
    engine = make_engine()
    engine.observer = recorder = Recorder()
    engine.generate([[1, 2, 3]] * 2, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert recorder.tokens == 10 and len(recorder.done) == 2
    t = recorder.done[0]
    assert t.num_generation_tokens == 5 and t.num_prompt_tokens == 3
    assert t.ttft is not None and t.queue_time is not None and t.ttft >= t.queue_time >= 0
    assert len(t.inter_token_latencies) == 4 and t.e2e is not None
    stats = engine.stats()
    assert stats.generation_tokens == 10 and stats.prompt_tokens == 6
    assert stats.num_steps >= 5 and 0.0 <= stats.step_overhead_share <= 1.0


def test_bad_requests_are_refused_at_submit() -> None:
    engine = make_engine(max_model_len=16, max_waiting=1)
    with pytest.raises(BadRequest):
        engine.add_request([1] * 16, GREEDY)
    engine.add_request([1, 2], GREEDY)
    with pytest.raises(QueueFull):
        engine.add_request([1, 2], GREEDY)


# async engine


async def collect(stream: object) -> list[RequestOutput]:
    return [o async for o in stream]  # type: ignore[attr-defined]


def test_async_engine_streams_concurrent_requests() -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(make_engine(blocks=32))
        try:
            prompts = random_prompts(8, seed=11)
            streams = [engine.generate(p, GREEDY) for p in prompts]
            results = await asyncio.gather(*(collect(s) for s in streams))
        finally:
            engine.close()
        for prompt, outputs in zip(prompts, results, strict=True):
            assert [t for o in outputs for t in o.new_token_ids] == reference(prompt, 12)
            assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        engine.engine.check_invariants()

    asyncio.run(main())


def test_an_engine_built_on_its_thread_is_stepped_there_and_a_failed_build_raises() -> None:
    """One thread computes on the model: the one that built it (torch keeps an OpenMP team of
    workers per thread that has run parallel work, and a second team slows every step)."""
    stepped_on: set[int] = set()

    class Recording(FakeModel):
        def forward(self, *args: object) -> torch.Tensor:
            stepped_on.add(threading.get_ident())
            return super().forward(*args)  # type: ignore[arg-type]

    built_on: list[int] = []

    def build() -> LLMEngine:
        built_on.append(threading.get_ident())
        return make_engine(model=Recording())

    async def main() -> list[RequestOutput]:
        engine = AsyncLLMEngine.build(build)
        try:
            return await collect(engine.generate([5, 6, 7], GREEDY))
        finally:
            engine.close()

    outputs = asyncio.run(main())
    assert [t for o in outputs for t in o.new_token_ids] == reference([5, 6, 7], 12)
    assert stepped_on == set(built_on) and built_on[0] != threading.get_ident()

    def broken() -> LLMEngine:
        raise FileNotFoundError("no weights here")

    def engine_threads() -> set[threading.Thread]:  # other tests' threads may come and go
        return {t for t in threading.enumerate() if t.name == "lockgate-llm-engine"}

    before = engine_threads()
    with pytest.raises(FileNotFoundError, match="no weights here"):
        AsyncLLMEngine.build(broken)
    deadline = time.monotonic() + 5
    while engine_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine_threads() - before  # the engine thread ended with its build


def test_async_disconnect_aborts_and_frees_blocks() -> None:
    async def main() -> None:
        inner = make_engine()
        engine = AsyncLLMEngine(inner)
        long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        try:
            stream = engine.generate(list(range(10)), long)
            async for _ in stream:
                break  # the client went away after one token
            await stream.aclose()
            assert not inner.has_unfinished
            task = asyncio.create_task(collect(engine.generate(list(range(10)), long)))
            await asyncio.sleep(0.02)
            task.cancel()  # a cancelled handler (disconnect) aborts too
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            engine.close()
        assert not inner.has_unfinished
        assert inner.stats().finished_by_reason == {"abort": 2}
        assert inner.stats().num_free_blocks == 256
        inner.check_invariants()

    asyncio.run(main())


def test_async_dropped_stream_is_aborted() -> None:
    async def main() -> None:
        inner = make_engine()
        engine = AsyncLLMEngine(inner)
        long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        try:
            stream = engine.generate(list(range(10)), long)
            await stream.__anext__()
            del stream  # dropped without aclose: the finalizer hands the abort to the engine
            gc.collect()
            for _ in range(200):
                if not inner.has_unfinished:
                    break
                await asyncio.sleep(0.01)
        finally:
            engine.close()
        assert inner.stats().finished_by_reason == {"abort": 1}
        inner.check_invariants()

    asyncio.run(main())


def test_async_submit_raises_when_the_queue_is_full() -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(make_engine(max_waiting=1, max_num_seqs=1))
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        try:
            running = engine.generate([1, 2, 3], long)
            await running.__anext__()  # admitted: the only running slot is taken
            waiting = engine.generate([4, 5, 6], long)
            with pytest.raises(QueueFull):
                engine.generate([7, 8, 9], long)
            await running.aclose()
            await waiting.aclose()
        finally:
            engine.close()
        engine.engine.check_invariants()

    asyncio.run(main())


class ExplodingModel(FakeModel):
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCache,
    ) -> torch.Tensor:
        raise RuntimeError("boom")


def test_async_model_failure_fails_requests_and_keeps_serving() -> None:
    async def main() -> None:
        inner = make_engine(model=ExplodingModel())
        engine = AsyncLLMEngine(inner)
        try:
            with pytest.raises(BackendError, match="boom"):
                await collect(engine.generate([1, 2, 3], GREEDY))
            inner.runner.model = FakeModel()
            outputs = await collect(engine.generate([1, 2, 3], GREEDY))
        finally:
            engine.close()
        assert [t for o in outputs for t in o.new_token_ids] == reference([1, 2, 3], 12)
        inner.check_invariants()

    asyncio.run(main())


# the real model (SmolLM2-135M GGUF), when its package is installed


def real_engine(
    checkpoint: Checkpoint, model: CausalLM, tokenizer: ChatTokenizer, blocks: int
) -> LLMEngine:
    config = EngineConfig(
        block_size=4,
        kv_cache_blocks=blocks,
        max_model_len=48,
        max_num_batched_tokens=48,
        max_num_seqs=8,
    )
    return smollm2_engine(checkpoint, model, tokenizer, config)

    kv = allocate_llama_kv_cache(checkpoint.config, blocks, 4, "float32")
    return LLMEngine(
        model,
        kv,
        config,
        eos_token_ids=tokenizer.eos_token_ids,
        decoder_factory=lambda _prompt, skip: IncrementalDetokenizer(tokenizer, skip),
    )


REAL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Once upon a time, in a small village by the sea, there lived a young girl named",
]


@pytest.mark.usefixtures("one_thread")
def test_real_model_concurrent_greedy_equals_single(
    checkpoint: Checkpoint, model: CausalLM, tokenizer: ChatTokenizer
) -> None:
    prompts = [tokenizer.encode(p) for p in REAL_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine = real_engine(checkpoint, model, tokenizer, blocks=12)  # 48 slots: forces preemption
    together = run_all(engine, prompts, [params] * len(prompts))
    alone = [
        real_engine(checkpoint, model, tokenizer, 64).generate([p], params)[0] for p in prompts
    ]
    assert together == alone
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == 12


@pytest.mark.usefixtures("one_thread")
def test_real_model_streams_text(
    checkpoint: Checkpoint, model: CausalLM, tokenizer: ChatTokenizer
) -> None:
    engine = real_engine(checkpoint, model, tokenizer, blocks=32)
    prompt = tokenizer.encode("The capital of France is")
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished:
        outputs += engine.step()
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert "".join(o.text for o in outputs) == tokenizer.decode(tokens)
    assert "Paris" in "".join(o.text for o in outputs)


# configuration


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
        ({"enable_chunked_prefill": False, "max_model_len": 4096}, "max_num_batched_tokens"),
        ({"dtype": "float16"}, "dtype"),
        ({"kv_cache_gib": None}, "kv_cache_gib"),
        ({"max_waiting": 0}, "max_waiting"),
    ],
)
def test_engine_config_names_the_bad_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_kv_cache_size_from_memory_and_capacity_checks() -> None:
    config = EngineConfig(kv_cache_gib=0.5, block_size=16, max_model_len=1024)
    assert config.num_kv_blocks(bytes_per_block=2**20) == 512
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        config.num_kv_blocks(bytes_per_block=2**26)
    with pytest.raises(ConfigError, match="do not fit"):
        make_engine(blocks=8, max_model_len=64)


def fake_prompt_logprobs(prompt: list[int], top: int) -> list[TokenLogprobs | None]:
    """What the fake model gives each prompt token after the first, computed directly."""
    model = FakeModel()
    entries: list[TokenLogprobs | None] = [None]
    for p in range(1, len(prompt)):
        hidden = torch.tensor([[float(next_token(prompt[:p]))]])
        logprobs = model.compute_logits(hidden).log_softmax(dim=-1)[0]
        best = logprobs.topk(top)
        entries.append(
            TokenLogprobs(
                prompt[p], float(logprobs[prompt[p]]), best.indices.tolist(), best.values.tolist()
            )
        )
    return entries


@pytest.mark.parametrize("blocks", [256, 24])  # 24 blocks of 4: preempted and recomputed
def test_prompt_logprobs_cover_every_prompt_token_across_chunks_and_the_prefix_cache(
    blocks: int,
) -> None:
    engine = make_engine(blocks, enable_prefix_caching=True, max_model_len=64)
    prompts = [[(7 * i + 3 * j) % VOCAB for j in range(45)] for i in range(3)]  # 2 chunks each
    prompts.append(list(prompts[0]))  # the same prompt again: cached blocks are not read
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    ids = [engine.add_request(p, params) for p in prompts]
    firsts: dict[str, RequestOutput] = {}
    later: list[RequestOutput] = []
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id in firsts:
                later.append(out)
            else:
                firsts[out.request_id] = out
            tokens[out.request_id] += out.new_token_ids
        engine.check_invariants()
    for rid, prompt in zip(ids, prompts, strict=True):
        got = firsts[rid].prompt_logprobs
        want = fake_prompt_logprobs(prompt, 2)
        assert got is not None and len(got) == len(prompt) and got[0] is None
        for g, w in zip(got[1:], want[1:], strict=True):
            assert g is not None and w is not None
            assert g.token_id == w.token_id and g.top_token_ids == w.top_token_ids
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-5)
    assert all(out.prompt_logprobs is None for out in later)
    # the outputs themselves are unchanged by asking for the prompt's logprobs
    assert [tokens[i] for i in ids] == [reference(p, 8) for p in prompts]
    if blocks == 24:
        assert engine.stats().num_preemptions > 0


def test_a_one_token_prompt_has_one_prompt_logprob_of_none() -> None:
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    engine.add_request([5], params)
    (out,) = engine.step()
    assert out.prompt_logprobs == [None] and out.new_token_ids == [next_token([5])]
