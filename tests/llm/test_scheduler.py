from __future__ import annotations

import zlib

import pytest

from lockgate.config import ModelConfig
from lockgate.errors import BadRequest, ConfigError
from lockgate.llm.admission import LoadAhead
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.kv_cache import BlockManager
from lockgate.llm.scheduler import QueueFull, Scheduler, SchedulerOutput
from lockgate.llm.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from lockgate.llm.startup import engine_config_from


def make_scheduler(blocks: int = 64, **overrides: object) -> Scheduler:
    settings: dict[str, object] = {
        "block_size": 4,
        "kv_cache_blocks": blocks,
        "max_model_len": 256,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 8,
    }
    settings.update(overrides)
    config = EngineConfig(**settings)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(blocks, config.block_size, config.enable_prefix_caching))


def make_seq(
    seq_id: str, prompt_len: int, max_tokens: int = 4, deadline: float | None = None
) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tokens = [(zlib.crc32(seq_id.encode()) + i) % 50 for i in range(prompt_len)]
    return Sequence.from_prompt(seq_id, tokens, params, arrival=0.0, deadline=deadline)


def run_step(sched: Scheduler, now: float = 0.0) -> SchedulerOutput:
    """One engine step without a model: every sequence that needs logits gets token 1."""
    out = sched.schedule(now)
    sched.update(out)
    for s in out.scheduled:
        if s.needs_logits:
            s.seq.append_token(1)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                sched.finish(s.seq, FinishReason.LENGTH)
    sched.block_manager.check_invariants(sched.sequences.values())
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished:
        outs.append(run_step(sched))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def test_token_budget_and_seq_limit_are_respected() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    seqs = [make_seq(f"r{i}", 10, max_tokens=5) for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    for out in run_to_completion(sched):
        assert out.num_batched_tokens <= 16
        assert len(out.scheduled) <= 3
    assert all(s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == 5 for s in seqs)
    assert sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_splits_a_long_prompt_while_decodes_continue() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    short = make_seq("short", 4, max_tokens=20)
    sched.add(short)
    run_step(sched)  # short: prefill done, first token out
    long = make_seq("long", 50, max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 50:
        out = run_step(sched)
        by_id = {s.seq.seq_id: s for s in out.scheduled}
        assert by_id["short"].num_tokens == 1  # decode kept running
        chunks.append(by_id["long"].num_tokens)
        assert by_id["long"].needs_logits == (long.num_computed_tokens == 50)
    assert chunks == [15, 15, 15, 5]
    assert long.num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make_scheduler(
        blocks=128, max_num_batched_tokens=256, max_model_len=256, enable_chunked_prefill=False
    )
    a, b = make_seq("a", 200, max_tokens=3), make_seq("b", 100, max_tokens=3)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq.seq_id, s.num_tokens) for s in out.scheduled] == [("a", 200)]
    out = run_step(sched)
    assert [(s.seq.seq_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 100)]


def test_preemption_takes_the_newest_and_it_finishes_later() -> None:
    # 6 blocks of 4 tokens; three sequences of 7 tokens growing by 6 must collide
    sched = make_scheduler(blocks=6, max_num_batched_tokens=64)
    seqs = [make_seq(f"r{i}", 7, max_tokens=6) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    outs = run_to_completion(sched)
    preempted = [p for out in outs for p in out.preempted]
    assert preempted and preempted[0] == "r2"
    assert sched.num_preemptions == len(preempted)
    assert all(s.num_output_tokens == 6 for s in seqs)
    assert seqs[2].timings.num_preemptions >= 1
    assert sched.block_manager.num_free_blocks == 6


def test_preempted_sequence_returns_to_the_front_of_the_queue() -> None:
    sched = make_scheduler(blocks=4, max_num_batched_tokens=64, max_num_seqs=2)
    a, b, c = make_seq("a", 7, 8), make_seq("b", 7, 8), make_seq("c", 3, 1)
    for seq in (a, b, c):
        sched.add(seq)
    run_step(sched)  # prefill: 7 prompt tokens + 1 output fill two blocks each
    run_step(sched)
    out = run_step(sched)  # a and b both need a third block: b is preempted
    assert out.preempted == ["b"]
    assert list(sched.waiting) == [b, c]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0


def test_bounded_waiting_queue_refuses_with_queue_full() -> None:
    sched = make_scheduler(max_waiting=2)
    sched.add(make_seq("a", 4))
    sched.add(make_seq("b", 4))
    with pytest.raises(QueueFull) as err:
        sched.add(make_seq("c", 4))
    assert err.value.status == 429 and err.value.retry_after is not None


def test_bad_prompts_are_refused() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(BadRequest, match="max_model_len"):
        sched.add(make_seq("long", 16))
    with pytest.raises(BadRequest):
        sched.add(make_seq("empty", 0))
    sched.add(make_seq("a", 4))
    with pytest.raises(BadRequest, match="already in use"):
        sched.add(make_seq("a", 4))


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler()
    seq = make_seq("a", 20, max_tokens=50)
    sched.add(seq)
    run_step(sched)
    assert sched.block_manager.num_free_blocks < 64
    assert sched.abort("a") is seq
    assert seq.finish_reason is FinishReason.ABORT and seq.block_table == []
    assert sched.block_manager.num_free_blocks == 64
    assert sched.abort("a") is None
    assert not sched.has_unfinished


def test_deadline_expiry_finishes_and_frees() -> None:
    sched = make_scheduler()
    late = make_seq("late", 8, max_tokens=50, deadline=5.0)
    waiting = make_seq("waiting", 8, deadline=5.0)
    ok = make_seq("ok", 8, max_tokens=50)
    sched.add(late)
    sched.add(ok)
    run_step(sched, now=1.0)
    sched.add(waiting)
    out = run_step(sched, now=6.0)
    assert {s.seq_id for s in out.expired} == {"late", "waiting"}
    assert late.finish_reason is FinishReason.DEADLINE and late.block_table == []
    assert [s.seq.seq_id for s in out.scheduled] == ["ok"]


def test_static_batching_admits_only_when_the_batch_is_done() -> None:
    sched = make_scheduler(continuous_batching=False, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = make_seq("a", 5, 2), make_seq("b", 5, 6), make_seq("c", 5, 2)
    for seq in (a, b, c):
        sched.add(seq)
    out = run_step(sched)
    assert {s.seq.seq_id for s in out.scheduled} == {"a", "b"}
    while not b.is_finished:
        out = run_step(sched)
        assert "c" not in {s.seq.seq_id for s in out.scheduled}  # a's slot stays empty
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == ["c"]


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    a = make_seq("a", 20, max_tokens=1)
    sched.add(a)
    run_to_completion(sched)
    b = Sequence.from_prompt("b", a.prompt_token_ids, a.params, arrival=0.0)
    sched.add(b)
    out = run_step(sched)
    assert out.scheduled[0].start == 16 and out.scheduled[0].num_tokens == 4
    assert b.num_cached_tokens == 16


def _burst_after_decodes(sched: Scheduler) -> tuple[Sequence, Sequence]:
    """One sequence decoding, then a prompt of 50 tokens (over the budget of 16)."""
    short = make_seq("short", 4, max_tokens=40)
    sched.add(short)
    run_step(sched, now=0.0)  # short: prefilled, decoding from here
    long = make_seq("long", 50, max_tokens=2)
    sched.add(long, now=0.0)
    return short, long


def test_prefill_first_gives_queued_prompts_the_budget_and_decodes_wait() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, step_policy="prefill_first")
    _, long = _burst_after_decodes(sched)
    steps = []
    while long.num_output_tokens == 0:
        out = run_step(sched, now=0.01 * len(steps))
        steps.append({s.seq.seq_id: s.num_tokens for s in out.scheduled})
    # the prompt takes whole steps and the decode waits, then rides in what the last chunk
    # leaves
    assert steps == [{"long": 16}, {"long": 16}, {"long": 16}, {"long": 2, "short": 1}]
    assert sched.stalled_since is None
    # decode_first: the decode takes its token of every step first
    first = make_scheduler(max_num_batched_tokens=16)
    _burst_after_decodes(first)
    out = run_step(first)
    assert {s.seq.seq_id: s.num_tokens for s in out.scheduled} == {"short": 1, "long": 15}


def test_prefill_first_decodes_past_the_stall_bound() -> None:
    sched = make_scheduler(
        max_num_batched_tokens=16, step_policy="prefill_first", max_decode_stall_ms=25
    )
    _burst_after_decodes(sched)
    ids = [[s.seq.seq_id for s in run_step(sched, now=0.01 * i).scheduled] for i in range(4)]
    # stalled from 0.00: prompts first at 0.00, 0.01, 0.02; at 0.03 the stall is over 25 ms
    assert ids[:3] == [["long"], ["long"], ["long"]]
    assert ids[3][0] == "short"
    assert sched.stalled_since is None  # that step decoded every running sequence


def test_prefill_first_keeps_the_kv_block_a_decode_needs() -> None:
    # 6 blocks of 4: "short" has 9 tokens in 2 blocks, and its next step needs a 3rd; a
    # 16-token prompt wants the other 4. Prompts go first, yet they must not take the block
    # the decode needs (the decode would then preempt the prompt's sequence for it)
    sched = make_scheduler(blocks=6, max_num_batched_tokens=32, step_policy="prefill_first")
    short = make_seq("short", 4, max_tokens=10)
    sched.add(short)
    for i in range(5):
        run_step(sched, now=0.01 * i)  # prefill + 4 decodes
    assert short.num_tokens == 9 and len(short.block_table) == 2
    long = make_seq("long", 16, max_tokens=2)
    sched.add(long, now=0.05)
    out = run_step(sched, now=0.05)
    assert [s.seq.seq_id for s in out.scheduled] == ["short"]  # 3 blocks left: "long" waits
    assert not out.preempted and long.status is SequenceStatus.WAITING
    assert len(short.block_table) == 3


def test_step_policy_is_checked_and_read_from_parameters() -> None:
    with pytest.raises(ConfigError, match=r"'step_policy'.*'fastest_first' is not one of"):
        make_scheduler(step_policy="fastest_first")
    with pytest.raises(ConfigError, match="'max_decode_stall_ms': must be > 0"):
        make_scheduler(max_decode_stall_ms=0)
    default = engine_config_from(ModelConfig(name="m", backend="llm"))
    assert (default.step_policy, default.prefill_first) == ("decode_first", False)
    parameters = {"step_policy": "prefill_first", "max_decode_stall_ms": "250"}
    parameters["tpot_slo_ms"] = "90"
    config = engine_config_from(ModelConfig(name="m", backend="llm", parameters=parameters))
    assert config.prefill_first and config.max_decode_stall_ms == 250.0
    assert config.tpot_slo_ms == 90.0 and default.tpot_slo_ms is None
    with pytest.raises(ConfigError, match="'tpot_slo_ms': must be > 0"):
        make_scheduler(tpot_slo_ms=-1)
    with pytest.raises(ConfigError, match=r"parameters.max_decode_stall_ms.*not a float"):
        engine_config_from(
            ModelConfig(name="m", backend="llm", parameters={"max_decode_stall_ms": "soon"})
        )


def _measured(sched: Scheduler) -> None:
    """Step times as if measured: 1,000 prompt tokens/s; decode steps 10 ms + 1 ms/sequence."""
    steps = sched.steps
    steps.observe(0, 2, 0.012, 0.0)
    steps.observe(0, 10, 0.020, 0.0)
    steps.observe(100, 0, 0.1 + 0.010, 0.0)


def test_tpot_slo_cuts_prefill_chunks_to_what_fits_beside_the_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, block_size=4, tpot_slo_ms=40)
    _measured(sched)
    steps = sched.steps
    assert steps.decode.seconds(3) == pytest.approx(0.013)
    assert steps.prefill.rate == pytest.approx(1000.0)
    # 3 decoding: 40 ms - 13 ms leaves 27 ms, 27 prompt tokens; none decoding: the whole cap
    assert steps.step_budget(3) == 3 + 27
    assert steps.step_budget(0) == 64
    # the decodes alone take 32 ms of 40 ms: 8 prompt tokens; past the SLO: block_size (4)
    assert steps.step_budget(22) == 22 + 8
    assert steps.step_budget(35) == 35 + 4
    seqs = [make_seq(f"d{i}", 4, max_tokens=50) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)  # the three prompts, nothing decoding: one step
    sched.add(make_seq("long", 100, max_tokens=2), now=0.0)
    out = run_step(sched)
    tokens = {s.seq.seq_id: s.num_tokens for s in out.scheduled}
    assert tokens == {"d0": 1, "d1": 1, "d2": 1, "long": 27}  # not the 61 the cap leaves
    plain = make_scheduler(max_num_batched_tokens=64, block_size=4)
    _measured(plain)
    assert plain.steps.step_budget(3) == 64  # no SLO: the cap


def test_tpot_slo_predicts_the_smaller_chunks() -> None:
    with_slo = make_scheduler(max_num_batched_tokens=64, block_size=4, tpot_slo_ms=40)
    without = make_scheduler(max_num_batched_tokens=64, block_size=4)
    for sched in (with_slo, without):
        _measured(sched)
    load = LoadAhead(100, [], [50, 50, 50], [])
    cut = with_slo.admission.predict(load, 0.0)
    whole = without.admission.predict(load, 0.0)
    assert cut is not None and whole is not None
    assert (cut.steps, whole.steps) == (4, 2)  # 100 tokens at 27 per step, against 61
    assert cut.seconds > whole.seconds
