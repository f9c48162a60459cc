"""TTFT admission (llm/admission.py) and the scheduler's priorities and shedding."""

from __future__ import annotations

import pytest

from lockgate.errors import Unavailable
from lockgate.llm.admission import PrefillRate, TTFTAdmission
from lockgate.llm.scheduler import QueueFull
from lockgate.llm.sequence import FinishReason, SamplingParams, Sequence
from tests.llm.test_scheduler import make_scheduler, run_step


def seq(seq_id: str, prompt_len: int, priority: int = 1) -> Sequence:
    params = SamplingParams(temperature=0.0, max_tokens=2)
    return Sequence.from_prompt(seq_id, [1] * prompt_len, params, 0.0, None, priority)


def test_prefill_rate_follows_the_steps_within_a_second_or_two() -> None:
    rate = PrefillRate()
    rate.observe(100, 0.1, 0.0)
    assert rate.rate == pytest.approx(1000.0)
    now = 0.0
    while now < 1.5:  # the machine slows to 250 tokens/s
        now += 0.1
        rate.observe(25, 0.1, now)
    assert rate.rate == pytest.approx(250.0, rel=0.15)
    rate.observe(0, 0.1, now + 0.1)  # a step without prefill tells nothing
    assert rate.rate == pytest.approx(250.0, rel=0.15)


def test_ttft_prediction_and_refusal() -> None:
    admission = TTFTAdmission(ttft_slo=1.0, slack=0.8, prefill=PrefillRate(rate=1000.0, at=0.0))
    assert admission.predicted_ttft(300, 100) == pytest.approx(0.4)
    assert admission.check(300, 100, None, 0.0) is None
    refusal = admission.check(900, 100, None, 0.0)  # 1.0 s > 0.8 s
    assert isinstance(refusal, Unavailable) and refusal.retry_after == pytest.approx(1.0)
    assert "900 prompt tokens queued ahead" in refusal.message
    assert admission.check(100, 100, 0.1, 0.0) is not None  # the deadline is tighter
    assert admission.check(0, 5000, None, 0.0) is None  # alone: the SLO cannot refuse it
    assert admission.check(0, 5000, 1.0, 0.0) is not None  # its own deadline can
    unknown = TTFTAdmission(ttft_slo=0.001)
    assert unknown.check(10_000, 100, None, 0.0) is None  # no prefill measured yet
    assert TTFTAdmission().check(10**6, 100, None, 0.0) is None  # no SLO and no deadline


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
    sched.admission.prefill = PrefillRate(rate=100.0, at=0.0)  # 100 prompt tokens per second
    sched.add(seq("first", 4))  # 40 ms
    with pytest.raises(Unavailable):
        sched.add(seq("second", 8))  # 4 ahead + 8 = 120 ms > 80 ms
    sched.add(seq("urgent-but-short", 2))  # 60 ms
    run_step(sched)
    assert sched.has_unfinished
