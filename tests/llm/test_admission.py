"""TTFT admission (llm/admission.py) and the scheduler's priorities and shedding."""

from __future__ import annotations

import pytest

from lockgate.core.metrics import Registry
from lockgate.errors import Unavailable
from lockgate.llm.admission import (
    LoadAhead,
    QueuedPrefill,
    StepInFlight,
    TTFTAdmission,
    slot_wait_steps,
)
from lockgate.llm.engine import LLMEngine
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.loader import Checkpoint
from lockgate.llm.metrics import RequestTimings
from lockgate.llm.models import allocate_kv_cache as allocate_llama_kv_cache
from lockgate.llm.runner import CausalLM
from lockgate.llm.scheduler import QueueFull
from lockgate.llm.sequence import FinishReason, SamplingParams, Sequence
from lockgate.llm.service import LLMRequestMetrics
from lockgate.llm.step_model import DecodeStep, PrefillRate, StepModel
from lockgate.llm.tokenizer import ChatTokenizer
from tests.llm.test_engine import make_engine
from tests.llm.test_scheduler import make_scheduler, run_step


def seq(seq_id: str, prompt_len: int, priority: int = 1) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=2)
    return Sequence.from_prompt(seq_id, [1] * prompt_len, params, 0.0, None, priority)


def test_prefill_rate_follows_the_steps_within_a_second() -> None:
    rate = PrefillRate()
    rate.observe(100, 0.1, 0.0)
    assert rate.rate == pytest.approx(1000.0)
    now = 0.0
    while now < 1.0:  # the machine slows to 250 tokens/s
        now += 0.1
        rate.observe(25, 0.1, now)
    assert rate.rate == pytest.approx(250.0, rel=0.15)
    rate.observe(0, 0.1, now + 0.1)  # a step without prefill tells nothing
    assert rate.rate == pytest.approx(250.0, rel=0.15)


def test_decode_step_fits_overhead_and_per_sequence_cost_then_follows_a_slowdown() -> None:
    decode, now = DecodeStep(), 0.0
    for n in [1, 2, 4, 8, 16, 12, 6, 3]:  # 20 ms + 2 ms per sequence
        now += 0.05
        decode.observe(n, 0.020 + 0.002 * n, now)
    assert decode.overhead == pytest.approx(0.020, rel=0.05)
    assert decode.per_seq == pytest.approx(0.002, rel=0.05)
    while now < 2.0:  # the machine is twice as slow, and the batch stays at 16
        now += 0.1
        decode.observe(16, 2 * (0.020 + 0.002 * 16), now)
    assert decode.seconds(16) == pytest.approx(0.104, rel=0.05)
    assert 0 <= decode.per_seq * 16 <= decode.seconds(16)  # between flat and proportional
    decode.observe(0, 1.0, now + 0.1)  # a step that decoded nothing tells nothing
    assert decode.seconds(16) == pytest.approx(0.104, rel=0.05)


def load(
    prompt: int, ahead: int = 0, running: list[int] | None = None, waiting: list[int] | None = None
) -> LoadAhead:
    queued = [QueuedPrefill(ahead, None)] if ahead else []
    return LoadAhead(prompt, queued, running or [], waiting or [])


def admission_at(
    rate: float, step_s: float, max_num_batched_tokens: int = 512, **kwargs: object
) -> TTFTAdmission:
    """Admission that has measured `rate` prompt tokens/s and decode steps of `step_s`."""
    steps = StepModel(max_num_batched_tokens)
    admission = TTFTAdmission(steps=steps, **kwargs)  # type: ignore[arg-type]
    steps.observe(0, 4, step_s, 0.0)
    steps.observe(int(rate), 0, 1.0 + step_s, 0.0)  # 1 s of prefill plus the overhead
    return admission


def test_prediction_counts_prefill_decode_share_and_slot_wait() -> None:
    admission = admission_at(1000.0, 0.010, max_num_seqs=4, max_num_batched_tokens=104)
    assert admission.steps.prefill.rate == pytest.approx(1000.0)
    alone = admission.predict(load(100, 0), 0.0)
    assert alone is not None and not alone.waits
    assert alone.seconds == pytest.approx(0.010 + 0.1)  # one step, 100 tokens
    # two running sequences decode in each step: 300 tokens take 3 steps of 102, not 2 of 104
    busy = admission.predict(load(100, 200, [50, 50], []), 0.0)
    assert busy is not None and busy.waits and busy.slot_wait_steps == 0
    assert (busy.steps, busy.decodes) == (3, 2)
    assert busy.seconds == pytest.approx(3 * 0.010 + 0.3)
    # every slot taken: it waits 40 decode steps for the first to free, then prefills
    full = admission.predict(load(100, 0, [40, 200, 300, 400], []), 0.0)
    assert full is not None and full.waits and full.slot_wait_steps == 40
    assert full.seconds == pytest.approx(41 * 0.010 + 0.1)
    # the one waiting ahead takes that slot (for 30 steps): the next frees at 70
    assert slot_wait_steps([40, 200, 300, 400], [30], 4) == 70
    assert slot_wait_steps([40, 200], [30, 30], 4) == 30
    assert slot_wait_steps([], [], 4) == 0


def test_it_waits_for_the_step_in_flight_and_may_not_delay_those_admitted_before() -> None:
    admission = admission_at(1000.0, 0.010, ttft_slo=1.0, max_num_seqs=8)
    flight = StepInFlight(prefill_tokens=300, decodes=2, started=0.0)  # 0.31 s long
    alone = admission.predict(LoadAhead(100, [], [20, 20], [], flight), 0.1)
    assert alone is not None and alone.waits and alone.tokens_ahead == 300
    assert alone.in_flight_seconds == pytest.approx(0.21)
    assert alone.seconds == pytest.approx(0.21 + 0.010 + 0.1)
    # one admitted before it, first token due at 0.5 s, prefills 200 tokens in the next step:
    # joining that step would make it end at 0.1 + 0.21 + 0.01 + 0.3 = 0.62 s
    ahead = [QueuedPrefill(200, due=0.5)]
    shared = admission.predict(LoadAhead(100, ahead, [20, 20], [], flight), 0.1)
    assert shared is not None and shared.due_sharing == 0.5
    refusal = admission.refusal(shared, None, 0.1)
    assert refusal is not None and "requests admitted before it" in refusal.message
    later = [QueuedPrefill(200, due=1.0)]
    assert (
        admission.refusal(admission.predict(LoadAhead(100, later, [], []), 0.1), None, 0.1) is None
    )
    # a request whose prefill ends a whole step earlier does not wait for the new one
    apart = admission.predict(
        LoadAhead(100, [QueuedPrefill(100, 0.2), QueuedPrefill(500, None)], [], []), 0.0
    )
    assert apart is not None and apart.due_sharing is None
    assert admission.due(apart, None, 0.0) == pytest.approx(0.8)  # its own budget, promised


def test_ttft_refusal_against_the_slo_and_the_deadline() -> None:
    admission = admission_at(1000.0, 0.0, ttft_slo=1.0, slack=0.8)
    fits = admission.predict(load(100, 300), 0.0)
    assert fits is not None and fits.seconds == pytest.approx(0.4)
    assert admission.refusal(fits, None, 0.0) is None
    late = admission.predict(load(100, 900), 0.0)  # 1.0 s > 0.8 s
    refusal = admission.refusal(late, None, 0.0)
    assert isinstance(refusal, Unavailable) and refusal.retry_after == pytest.approx(1.0)
    assert "900 prompt tokens queued ahead" in refusal.message
    assert admission.refusal(admission.predict(load(100, 100), 0.0), 0.1, 0.0)
    alone = admission.predict(load(5000, 0), 0.0)
    assert admission.refusal(alone, None, 0.0) is None  # waits for nobody: the SLO cannot refuse
    assert admission.refusal(alone, 1.0, 0.0) is not None  # its own deadline can
    unknown = TTFTAdmission(ttft_slo=0.001)
    assert unknown.predict(load(100, 10_000), 0.0) is None  # no prefill measured yet
    assert unknown.refusal(None, 0.5, 0.0) is None
    no_budget = admission_at(1000.0, 0.0)
    assert no_budget.refusal(no_budget.predict(load(100, 10**6), 0.0), None, 0.0) is None


def test_prediction_adapts_when_the_measured_rate_changes() -> None:
    admission = admission_at(1000.0, 0.010, ttft_slo=1.0, max_num_seqs=8)
    work = load(100, 500, [20, 20])
    before = admission.predict(work, 0.0)
    assert before is not None and admission.refusal(before, None, 0.0) is None
    now = 0.0
    while now < 1.0:  # the server gets busy: prefill and decode both take three times longer
        now += 0.1
        admission.steps.observe(0, 2, 0.030, now)
        admission.steps.observe(100, 2, 0.030 + 0.3, now)
    after = admission.predict(work, now)
    assert after is not None and after.seconds == pytest.approx(3 * before.seconds, rel=0.2)
    assert admission.refusal(after, None, now) is not None


def first_token(modelled: float | None, arrival: float, ttft: float) -> RequestTimings:
    timings = RequestTimings(arrival=arrival, modelled_ttft=modelled)
    timings.record_token(arrival + ttft)
    return timings


def test_calibration_scales_predictions_by_how_late_recent_first_tokens_came() -> None:
    admission = admission_at(1000.0, 0.0, ttft_slo=1.0)
    work = load(100, 500)
    calibrated = admission.predict(work, 0.0)
    assert calibrated is not None and calibrated.seconds == pytest.approx(0.6)
    for i in range(20):  # first tokens came 1.5 times later than modelled
        admission.observe_first_token(first_token(0.4, i * 0.1, 0.6), i * 0.1 + 0.6)
        admission.observe_first_token(first_token(None, i * 0.1, 5.0), i * 0.1 + 5.0)  # alone
    late = admission.predict(work, 2.0)
    assert late is not None and late.calibration == pytest.approx(1.5)
    assert late.modelled == pytest.approx(0.6) and late.seconds == pytest.approx(0.9)
    assert admission.refusal(late, None, 2.0) is not None  # 0.9 s > 0.8 s
    admission.observe_first_token(first_token(0.4, 20.0, 0.2), 20.2)  # the rest is 10 s old
    assert admission.calibration.factor == 1.0  # too few left: the model alone


def test_waiting_sequences_go_in_priority_order() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for name, priority in [("low-a", 3), ("high", 1), ("mid", 2), ("low-b", 3), ("high-b", 1)]:
        sched.add(seq(name, 4, priority))
    assert [s.seq_id for s in sched.waiting] == ["high", "high-b", "mid", "low-a", "low-b"]
    assert (
        sched.tokens_ahead(1) == 8 and sched.tokens_ahead(2) == 12 and sched.tokens_ahead(3) == 20
    )


def test_full_queue_sheds_the_newest_lowest_priority_for_a_higher_one() -> None:
    sched = make_scheduler(max_waiting=3)
    for name, priority in [("a", 2), ("b", 2), ("c", 1)]:
        sched.add(seq(name, 4, priority))
    with pytest.raises(QueueFull):
        sched.add(seq("d", 4, 2))  # nothing below priority 2 to shed
    sched.add(seq("e", 4, 1))
    shed = sched.take_shed()
    assert [s.seq_id for s in shed] == ["b"] and shed[0].finish_reason is FinishReason.SHED
    assert [s.seq_id for s in sched.waiting] == ["c", "e", "a"]
    assert sched.take_shed() == []
    sched.block_manager.check_invariants(sched.sequences.values())


def test_scheduler_refuses_what_would_miss_the_ttft_slo() -> None:
    sched = make_scheduler(max_num_seqs=1, ttft_slo_ms=100.0)
    sched.steps.prefill = PrefillRate(tokens=100.0, seconds=1.0, at=0.0)  # 100 tokens/s
    sched.add(seq("first", 4))  # 40 ms
    with pytest.raises(Unavailable):
        sched.add(seq("second", 8))  # 4 ahead + 8 = 120 ms > 80 ms
    sched.add(seq("urgent-but-short", 2))  # 60 ms
    run_step(sched)
    assert sched.has_unfinished


# the real engine on the demo model (SmolLM2-135M GGUF), when its package is installed


def slo_engine(checkpoint: Checkpoint, model: CausalLM, max_num_seqs: int) -> LLMEngine:
    config = EngineConfig(
        block_size=4,
        kv_cache_blocks=160,
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=max_num_seqs,
        ttft_slo_ms=500.0,
    )
    return LLMEngine(model, allocate_llama_kv_cache(checkpoint.config, 160, 4, "float32"), config)


@pytest.mark.usefixtures("one_thread")
def test_a_request_is_refused_while_every_slot_holds_a_long_output(
    checkpoint: Checkpoint, model: CausalLM, tokenizer: ChatTokenizer
) -> None:
    engine = slo_engine(checkpoint, model, max_num_seqs=2)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    prompt = tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    first = engine.add_request(prompt, long)
    engine.add_request(prompt[:-1], long)
    for _ in range(4):  # prefill both, then decode: both step times are measured
        engine.step()
    short = SamplingParams(temperature=0.0, max_tokens=1)
    question = tokenizer.encode("The capital of France is")
    # nothing to prefill ahead, but both slots are held for 196 more decode steps
    with pytest.raises(Unavailable, match="196 of them until a sequence slot frees"):
        engine.add_request(question, short)
    engine.abort(first)  # a slot is free: it waits for nobody, and is admitted
    engine.add_request(question, short)
    assert engine.scheduler.waiting[0].timings.predicted_ttft is not None
    engine.check_invariants()


def test_predicted_and_observed_ttft_are_exported_per_model() -> None:
    registry = Registry()
    engine = make_engine()
    engine.observer = LLMRequestMetrics(registry).observer("fake")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.generate([[1, 2, 3, 4]], params)  # measures the step times: no prediction for it
    engine.generate([[5, 6, 7, 8], [9, 10, 11]], params)
    text = registry.exposition()[0].decode()
    assert 'lockgate_llm_ttft_prediction_ratio_count{model_name="fake"} 2.0' in text
    assert 'lockgate_llm_predicted_time_to_first_token_seconds_count{model_name="fake"} 2.0' in text
    assert 'lockgate_llm_time_to_first_token_seconds_count{model_name="fake"} 3.0' in text


def test_prefill_first_predicts_prompts_in_whole_steps_and_the_stall_bound_decodes() -> None:
    first = TTFTAdmission(max_num_seqs=32, steps=StepModel(120))
    prompts = TTFTAdmission(
        max_num_seqs=32, steps=StepModel(120), prefill_first=True, max_decode_stall=1.0
    )
    for admission in (first, prompts):
        admission.steps.observe(0, 2, 0.010, 0.0)  # decode steps: 6 ms + 2 ms per sequence
        admission.steps.observe(0, 20, 0.046, 0.0)
        admission.steps.observe(1000, 0, 1.0 + 0.006, 0.0)  # 1,000 prompt tokens/s
    busy = load(100, 900, [50] * 20)  # 1,000 prompt tokens to prefill, 20 decoding
    decode_first = first.predict(busy, 0.0)
    assert decode_first is not None and (decode_first.steps, decode_first.decodes) == (10, 20)
    assert decode_first.seconds == pytest.approx(10 * 0.046 + 1.0, rel=0.01)
    ahead = prompts.predict(busy, 0.0)
    assert ahead is not None and (ahead.steps, ahead.decodes) == (9, 0)  # whole steps of 120
    # 9 steps' overhead, the prefill, and one decode step of all 20 at the 1 s stall bound
    assert ahead.seconds == pytest.approx(9 * 0.006 + 1.0 + 0.046, rel=0.01)
    # with every slot taken it waits for decodes either way
    full = load(100, 0, [40] * 32)
    assert prompts.predict(full, 0.0).slot_wait_steps == 40  # type: ignore[union-attr]
