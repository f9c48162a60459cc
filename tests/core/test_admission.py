"""Deadline-aware admission: the finish-time prediction and the refusal it leads to."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lockgate.core.admission import Admission, AdmissionSettings, Calibration, QueueState
from lockgate.core.request import InferRequest
from lockgate.core.slo import ServiceProfile
from lockgate.errors import Unavailable

T = 0.020  # every batch takes 20 ms
NOW = 100.0


def constant_profile(max_batch_size: int = 4) -> ServiceProfile:
    profile = ServiceProfile(max_batch_size)
    profile.observe(1, T)
    profile.observe(max_batch_size, T)
    return profile


def request(rows: int = 1, budget: float | None = None) -> InferRequest:
    x = np.zeros((rows, 2), dtype=np.float32)
    deadline = None if budget is None else NOW + budget
    return InferRequest(model="m", inputs={"x": x}, rows=rows, deadline=deadline)


def state(ahead: int, free_at: tuple[float, ...] = (NOW,), cap: int = 4) -> QueueState:
    return QueueState(ahead, cap, free_at, capacity=len(free_at) * cap / T)


def test_prediction_counts_batches_ahead_on_one_instance() -> None:
    admission = Admission(AdmissionSettings(), constant_profile())
    finish = admission.predicted_finish
    assert finish(request(), NOW, state(0)) == pytest.approx(NOW + T)
    assert finish(request(), NOW, state(3)) == pytest.approx(NOW + T)  # rides in batch 1
    assert finish(request(), NOW, state(4)) == pytest.approx(NOW + 2 * T)  # batch 2
    assert finish(request(), NOW, state(9, (NOW + 0.005,))) == pytest.approx(NOW + 0.005 + 3 * T)


def test_prediction_spreads_batches_over_instances() -> None:
    admission = Admission(AdmissionSettings(), constant_profile())
    two = (NOW, NOW + 0.010)
    finish = admission.predicted_finish
    assert finish(request(), NOW, state(0, two)) == pytest.approx(NOW + T)
    assert finish(request(), NOW, state(4, two)) == pytest.approx(NOW + 0.010 + T)
    assert finish(request(), NOW, state(8, two)) == pytest.approx(NOW + 2 * T)
    assert finish(request(rows=3), NOW, state(13, two)) == pytest.approx(NOW + 0.010 + 2 * T)


def test_slow_batches_are_planned_and_diluted_over_a_long_queue() -> None:
    """With tail 1.5 a lone batch is planned at 1.5·T; behind nine full batches the excess is
    0.5·T·√10 (independent batches add in quadrature), not 0.5·10·T."""
    profile = constant_profile()
    profile.tail = 1.5
    finish = Admission(AdmissionSettings(), profile).predicted_finish
    assert finish(request(), NOW, state(0)) == pytest.approx(NOW + 1.5 * T)
    assert finish(request(), NOW, state(36)) == pytest.approx(NOW + 10 * T + 0.5 * T * 10**0.5)
    running = (NOW + 0.010,)  # the rest of the running batch counts as one more
    expected = NOW + 0.010 + T + 0.5 * (0.010**2 + T**2) ** 0.5
    assert finish(request(), NOW, state(0, running)) == pytest.approx(expected)


def test_a_request_that_waits_plans_its_batch_full() -> None:
    """T(B) = 5 ms a row, cap 4. Alone on an idle instance a one-row request is one row's
    time; behind a busy instance requests admitted after it fill its batch before it leaves,
    so its batch is planned at the cap."""
    profile = ServiceProfile(4)
    for size in (1, 2, 4):
        profile.observe(size, 0.005 * size)
    finish = Admission(AdmissionSettings(), profile).predicted_finish
    assert finish(request(), NOW, state(0)) == pytest.approx(NOW + 0.005)
    busy = (NOW + 0.010,)
    assert finish(request(), NOW, state(0, busy)) == pytest.approx(NOW + 0.010 + 0.020)
    assert finish(request(), NOW, state(5)) == pytest.approx(NOW + 0.020 + 0.020)


def test_a_batch_held_for_its_window_leaves_when_the_window_is_spent() -> None:
    """T(B) = 5 ms a row, cap 4. Three rows wait on an idle instance, which holds them until
    the oldest one's window ends 15 ms from now: a request joining them leaves then, and its
    batch is planned full. A request behind a full batch does not wait for any window."""
    profile = ServiceProfile(4)
    for size in (1, 2, 4):
        profile.observe(size, 0.005 * size)
    finish = Admission(AdmissionSettings(), profile).predicted_finish
    held = QueueState(2, 4, (NOW,), capacity=800.0, opens=NOW + 0.015)
    assert finish(request(), NOW, held) == pytest.approx(NOW + 0.015 + 0.020)
    full = QueueState(4, 4, (NOW,), capacity=800.0, opens=NOW + 0.015)
    assert finish(request(), NOW, full) == pytest.approx(NOW + 0.020 + 0.020)
    spent = QueueState(2, 4, (NOW,), capacity=800.0, opens=NOW - 0.001)
    assert finish(request(), NOW, spent) == pytest.approx(NOW + 0.015)


def test_refuses_what_would_miss_and_admits_what_fits() -> None:
    admission = Admission(AdmissionSettings(), constant_profile())
    assert admission.check(request(budget=0.05), NOW, state(4)) is None  # 40 ms ≤ 0.9·50 ms
    refusal = admission.check(request(budget=0.05), NOW, state(8))  # 60 ms > 50 ms
    assert isinstance(refusal, Unavailable) and refusal.status == 503
    assert "predicted 60.0 ms" in refusal.message and "budget 50.0 ms" in refusal.message
    assert refusal.retry_after is not None and refusal.retry_after >= 1
    assert admission.check(request(budget=None), NOW, state(1000)) is None  # no deadline


def test_slack_widens_the_budget() -> None:
    lenient = Admission(AdmissionSettings(slack=1.5), constant_profile())
    strict = Admission(AdmissionSettings(slack=0.5), constant_profile())
    assert strict.check(request(budget=0.05), NOW, state(4)) is not None  # 40 ms > 0.5·50 ms
    assert lenient.check(request(budget=0.05), NOW, state(8)) is None  # 60 ms ≤ 75 ms


def test_off_unknown_profile_or_no_instance_admits() -> None:
    off = Admission(AdmissionSettings(deadline_aware=False), constant_profile())
    assert off.check(request(budget=0.001), NOW, state(100)) is None
    unknown = Admission(AdmissionSettings(), ServiceProfile(4))
    assert unknown.check(request(budget=0.001), NOW, state(100)) is None
    restarting = Admission(AdmissionSettings(), constant_profile())
    assert restarting.check(request(budget=0.001), NOW, state(100, free_at=())) is None


def test_retry_after_is_the_time_to_drain_the_queue() -> None:
    assert Admission.retry_after(400, 100.0) == pytest.approx(4.0)
    assert Admission.retry_after(10, 100.0) == 1.0  # at least a second
    assert Admission.retry_after(10, 0.0) == 1.0
    assert Admission.retry_after(10, float("inf")) == 1.0


def test_calibration_is_a_high_quantile_of_the_error_and_never_negative() -> None:
    calibration = Calibration(window=100, quantile=0.9, horizon=2.0)
    assert calibration.current(NOW) == 0.0
    for i in range(100):  # 0 .. 99 ms later than predicted
        calibration.observe(0.1, 0.1 + i / 1000, NOW)
    assert calibration.current(NOW) == pytest.approx(0.090, abs=0.01)
    for _ in range(100):  # the window moves on: predictions came true early
        calibration.observe(0.1, 0.05, NOW)
    assert calibration.current(NOW) == 0.0


def test_calibration_forgets_errors_past_its_horizon() -> None:
    calibration = Calibration(window=100, quantile=0.9, horizon=2.0)
    for _ in range(50):  # a transient: requests took 400 ms longer than predicted
        calibration.observe(0.1, 0.5, NOW)
    assert calibration.current(NOW + 1.0) == pytest.approx(0.4)
    assert calibration.current(NOW + 2.5) == 0.0  # nothing observed since: forgotten


def test_calibration_margin_is_the_quantile_of_the_errors_it_holds() -> None:
    """As errors come and go (the window, the horizon), the margin is the quantile of the
    sorted errors it still holds, refreshed every few requests."""
    calibration = Calibration(window=64, quantile=0.9, horizon=2.0)
    rng = random.Random(7)
    for i in range(500):
        now = NOW + i * 0.01
        calibration.observe(0.0, rng.uniform(-0.01, 0.03), now)
        held = sorted(error for _, error in calibration.errors)
        assert calibration.ordered == held
        if calibration._since == 0:  # just refreshed
            expected = held[min(len(held) - 1, int(0.9 * len(held)))]
            assert calibration.margin == max(0.0, expected)
    calibration.current(NOW + 500 * 0.01 + 1.5)  # the older errors pass the horizon
    assert calibration.ordered == sorted(error for _, error in calibration.errors)
    assert len(calibration.errors) < 64


def test_admission_learns_from_requests_that_took_longer_than_predicted() -> None:
    """Requests that take 40 ms longer than predicted make admission add 40 ms."""
    admission = Admission(AdmissionSettings(), constant_profile())
    assert admission.check(request(budget=0.05), NOW, state(4)) is None  # 40 ms predicted
    for _ in range(64):
        r = request(budget=1.0)
        r.admitted = NOW
        assert admission.check(r, NOW, state(4)) is None
        admission.answered(r, NOW + 0.080)  # the profile said 40 ms: it took 80
    assert admission.calibration.current(NOW + 0.080) == pytest.approx(0.040)
    refusal = admission.check(request(budget=0.05), NOW, state(4))  # now 80 ms predicted
    assert refusal is not None and "predicted 80.0 ms" in refusal.message


def test_a_reshaped_profile_voids_the_calibration() -> None:
    """Errors of predictions made with warmup's figures say nothing of predictions made with
    traffic's: when traffic reshapes the profile, the margin starts again, and requests
    admitted before the reshape are not compared when they are answered."""
    profile = constant_profile()
    profile.seal()
    profile.observe(1, T, now=NOW)  # traffic's first batch: cold, not counted
    admission = Admission(AdmissionSettings(), profile)
    before = request(budget=1.0)
    before.admitted = NOW
    assert admission.check(before, NOW, state(4)) is None
    for _ in range(32):  # warmup's figures were far off: requests took 150 ms longer
        admission.calibration.observe(0.040, 0.190, NOW)
    assert admission.calibration.current(NOW) == pytest.approx(0.150)
    profile.observe(4, 0.100, now=NOW + 0.1)  # traffic: 100 ms where warmup said 20
    assert admission.check(request(budget=1.0), NOW + 0.1, state(0)) is None
    assert admission.calibration.current(NOW + 0.1) == 0.0
    admission.answered(before, NOW + 0.3)  # predicted with the old figures: not compared
    assert not admission.calibration.errors


def test_a_burst_that_joins_a_first_batch_is_not_the_predictions_error() -> None:
    """A request that found the instance free planned to leave alone; a burst arrived in the
    same turn and rode with it, a batch of 4 rows. Its error is measured against the batch it
    rode in (here none), not against the batch of one it planned."""
    profile = ServiceProfile(4)
    for size in (1, 2, 4):
        profile.observe(size, 0.010 * size)
    admission = Admission(AdmissionSettings(), profile)
    alone = request(budget=1.0)
    alone.admitted = NOW
    assert admission.check(alone, NOW, state(0)) is None
    assert alone.planned_rows == 1 and alone.predicted == pytest.approx(0.010)
    alone.batch_rows = 4
    admission.answered(alone, NOW + 0.040)
    assert [error for _, error in admission.calibration.errors] == [pytest.approx(0.0)]
    waiting = request(budget=1.0)  # behind a running batch: planned full at the cap
    waiting.admitted = NOW
    assert admission.check(waiting, NOW, state(0, (NOW + 0.040,))) is None
    assert waiting.planned_rows == 4
