from __future__ import annotations

import torch

from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.kv_cache import BlockManager
from lockgate.llm.runner import ModelRunner
from lockgate.llm.sampling import Sampler
from lockgate.llm.scheduler import Scheduler
from lockgate.llm.sequence import SamplingParams, Sequence
from tests.llm.fake_model import FakeModel, allocate_kv_cache, next_token

BS = 4


def setup(num_blocks: int = 32, budget: int = 16) -> tuple[Scheduler, ModelRunner]:
    config = EngineConfig(
        block_size=BS,
        kv_cache_blocks=num_blocks,
        max_model_len=64,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
    )
    sched = Scheduler(config, BlockManager(num_blocks, BS))
    runner = ModelRunner(FakeModel(), allocate_kv_cache(num_blocks, BS), BS, Sampler(seed=0))
    return sched, runner


def greedy_seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence.from_prompt(seq_id, tokens, SamplingParams(temperature=0.0), arrival=0.0)


def test_prepare_lays_tokens_end_to_end_with_their_slots() -> None:
    sched, runner = setup(budget=16)
    a, b = greedy_seq("a", list(range(10, 16))), greedy_seq("b", list(range(20, 33)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule(0.0)  # a whole (6), b chunk (10 of 13)
    inp = runner.prepare(out)
    meta = inp.meta
    assert inp.input_ids.tolist() == list(range(10, 16)) + list(range(20, 30))
    assert inp.positions.tolist() == list(range(6)) + list(range(10))
    expected_slots = [a.block_table[p // BS] * BS + p % BS for p in range(6)]
    expected_slots += [b.block_table[p // BS] * BS + p % BS for p in range(10)]
    assert meta.slot_mapping.tolist() == expected_slots
    assert meta.query_start_loc.tolist() == [0, 6, 16]
    assert meta.seq_lens.tolist() == [6, 10] and meta.seq_lens_list == [6, 10]
    assert meta.query_lens_list == [6, 10] and meta.max_query_len == 10
    assert meta.logits_indices.tolist() == [5]  # b's prompt is not finished
    assert meta.block_tables.shape == (2, 4)
    assert meta.block_tables[0].tolist() == [*a.block_table, 0, 0]
    assert all(t.dtype == torch.int64 for t in (inp.input_ids, inp.positions, meta.slot_mapping))


def test_run_samples_from_the_context_in_the_cache() -> None:
    sched, runner = setup(budget=8)
    seq = greedy_seq("a", [5, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])  # 11 tokens: two chunks
    sched.add(seq)
    first = sched.schedule(0.0)
    assert runner.run(first).sampled.token_ids == []  # mid-prompt: no logits
    sched.update(first)
    second = sched.schedule(0.0)
    result = runner.run(second)
    assert result.sampled.token_ids == [next_token(seq.token_ids)]
    assert result.forward_time > 0 and result.prepare_time > 0
