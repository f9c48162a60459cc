"""Requests of several sequences of one prompt (the `n` choices of an OpenAI request) in
`llm/async_engine.py`: one stream for all, admitted all or none, aborted together."""

from __future__ import annotations

import asyncio

import pytest

from lockgate.errors import Unavailable
from lockgate.llm.async_engine import AsyncLLMEngine
from lockgate.llm.engine import RequestOutput
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.step_model import PrefillRate
from tests.llm.test_engine import collect, make_engine

LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


def seeded(count: int, seed: int = 5) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=8, ignore_eos=True)
        for i in range(count)
    ]


def by_choice(stream: object, outputs: list[RequestOutput]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for out in outputs:
        tokens.setdefault(stream.index(out.request_id), []).extend(out.new_token_ids)  # type: ignore[attr-defined]
    return tokens


def test_choices_stream_together_and_finish_each() -> None:
    async def main() -> None:
        inner = make_engine()
        engine = AsyncLLMEngine(inner)
        try:
            prompt = list(range(10))
            stream = engine.generate_choices([prompt] * 3, seeded(3), ["r-0", "r-1", "r-2"])
            outputs = await collect(stream)
            again = await collect(engine.generate_choices([prompt] * 3, seeded(3), [None] * 3))
        finally:
            engine.close()
        tokens = by_choice(stream, outputs)
        assert sorted(tokens) == [0, 1, 2] and all(len(t) == 8 for t in tokens.values())
        assert len({tuple(t) for t in tokens.values()}) == 3  # distinct seeds, distinct draws
        assert sorted(tuple(o.new_token_ids) for o in again) == sorted(
            tuple(o.new_token_ids) for o in outputs
        )  # the same seeds draw the same tokens
        assert sum(o.finished for o in outputs) == 3
        stats = inner.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        inner.check_invariants()

    asyncio.run(main())


def test_admission_counts_every_choice_and_refuses_them_all_or_none() -> None:
    async def main() -> None:
        inner = make_engine(ttft_slo_ms=100.0, max_num_seqs=1)
        inner.scheduler.steps.prefill = PrefillRate(tokens=100.0, seconds=1.0, at=0.0)
        engine = AsyncLLMEngine(inner)
        prompt = [1, 2, 3]  # 30 ms of prefill at 100 tokens/s; the budget is 80 ms
        short = SamplingParams(temperature=0.0, max_tokens=1)
        try:
            # the third waits behind 6 prompt tokens of its own request: 90 ms
            with pytest.raises(Unavailable, match="time to first token"):
                engine.generate_choices([prompt] * 3, [short] * 3, ["a-0", "a-1", "a-2"])
            assert not inner.has_unfinished  # those admitted before it were withdrawn
            outputs = await collect(
                engine.generate_choices([prompt] * 2, [short] * 2, ["b-0", "b-1"])
            )
        finally:
            engine.close()
        assert sorted(o.request_id for o in outputs if o.finished) == ["b-0", "b-1"]
        assert inner.stats().finished_by_reason == {"abort": 2, "length": 2}
        inner.check_invariants()

    asyncio.run(main())


def test_closing_the_stream_aborts_every_choice() -> None:
    async def main() -> None:
        inner = make_engine()
        engine = AsyncLLMEngine(inner)
        try:
            stream = engine.generate_choices([list(range(10))] * 4, [LONG] * 4, [None] * 4)
            async for _ in stream:
                break  # the client went away after one token
            await stream.aclose()
            assert not inner.has_unfinished
            task = asyncio.create_task(
                collect(engine.generate_choices([list(range(10))] * 4, [LONG] * 4, [None] * 4))
            )
            await asyncio.sleep(0.02)
            task.cancel()  # a cancelled handler (disconnect) aborts them all too
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            engine.close()
        stats = inner.stats()
        assert stats.finished_by_reason == {"abort": 8}
        assert stats.num_free_blocks == stats.num_total_blocks
        inner.check_invariants()

    asyncio.run(main())


def test_one_choice_shed_ends_the_request_and_frees_the_others() -> None:
    async def main() -> None:
        inner = make_engine(max_num_seqs=1, max_waiting=3)
        engine = AsyncLLMEngine(inner)
        try:
            running = engine.generate([9, 9, 9], LONG, priority=1)
            await running.__anext__()  # the only slot is taken
            choices = engine.generate_choices([[1, 2, 3]] * 3, [LONG] * 3, [None] * 3, priority=2)
            urgent = engine.generate([4, 5, 6], LONG, priority=1)  # sheds the newest choice
            with pytest.raises(Unavailable, match="shed"):
                await collect(choices)
            await running.aclose()
            await urgent.aclose()
        finally:
            engine.close()
        assert not inner.has_unfinished
        assert inner.stats().finished_by_reason == {"shed": 1, "abort": 4}
        inner.check_invariants()

    asyncio.run(main())
