"""The service-time profile, the SLO batch cap and window, and the arrival-rate meter."""

from __future__ import annotations

import math

import pytest

from lockgate.core.slo import RateMeter, ServiceProfile

A, B = 0.001, 0.0005  # T(B) = 1 ms + 0.5 ms·B


def linear_profile(
    max_batch_size: int, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
) -> ServiceProfile:
    profile = ServiceProfile(max_batch_size)
    for size in sizes:
        if size <= max_batch_size:
            profile.observe(size, A + B * size)
    return profile


def test_fit_recovers_a_and_b() -> None:
    profile = linear_profile(32, sizes=(1, 4, 16, 32))
    assert profile.fit_a == pytest.approx(A, rel=1e-6)
    assert profile.fit_b == pytest.approx(B, rel=1e-6)
    assert profile.service_time(10) == pytest.approx(A + 10 * B)  # between measured sizes
    assert profile.throughput(10) == pytest.approx(10 / (A + 10 * B))


def test_fit_with_one_size_is_a_constant_and_never_negative() -> None:
    profile = ServiceProfile(8)
    profile.observe(4, 0.01)
    assert (profile.fit_a, profile.fit_b) == (0.01, 0.0)
    falling = ServiceProfile(8)
    falling.observe(1, 0.01)
    falling.observe(8, 0.002)  # noise can make larger batches look faster
    assert falling.fit_b == 0.0 and falling.fit_a >= 0.0


def test_observations_are_an_exponential_average() -> None:
    profile = ServiceProfile(4, alpha=0.5)
    profile.observe(2, 0.010, now=0.0)
    profile.observe(2, 0.011, now=0.1)  # within the band: the shape learns, the scale holds
    assert profile.scale == 1.0
    assert profile.times[2] == pytest.approx(0.0105)


def test_one_stall_does_not_move_the_scale() -> None:
    profile = linear_profile(8)
    now = 0.0
    for _ in range(20):
        now += 0.05
        profile.observe(4, A + 4 * B, now=now)
    profile.observe(4, 10 * (A + 4 * B), now=now + 0.05)  # a preempted thread
    assert profile.scale == pytest.approx(1.0)
    assert profile.service_time(4) == pytest.approx(A + 4 * B, rel=0.15)  # the slow average


@pytest.mark.parametrize("factor", [3.0, 0.5])
def test_a_lasting_change_is_followed_within_a_second(factor: float) -> None:
    """The core slows down threefold (a process beside it) or speeds up twofold: batches
    every 50 ms of simulated time; within a second T(B) is within 10% of the new value at
    every size, not only the one observed."""
    profile = linear_profile(8)
    now = 0.0
    while now < 1.0:
        now += 0.05
        profile.observe(4, factor * (A + 4 * B), now=now)
    for size in (1, 4, 8):
        assert profile.service_time(size) == pytest.approx(factor * (A + B * size), rel=0.1)


def test_cap_is_the_largest_batch_with_two_service_times_within_the_slo() -> None:
    profile = linear_profile(32)
    slo = 0.020
    cap = profile.batch_cap(slo)
    assert 2 * profile.service_time(cap) <= slo
    assert 2 * profile.service_time(cap + 1) > slo
    assert cap in (17, 18)  # 2·(1 + 0.5·B) ms ≤ 20 ms ⇔ B ≤ 18, less float rounding
    assert linear_profile(8).batch_cap(slo) == 8  # bounded by max_batch_size
    assert linear_profile(32).batch_cap(0.001) == 1  # at least 1, even when nothing fits


def test_window_is_zero_when_batch_one_keeps_up() -> None:
    profile = linear_profile(8)  # T(1) = 1.5 ms
    slo = 0.020
    assert profile.window(slo, 0.0) == 0.0
    assert profile.window(slo, 100.0) == 0.0  # λ·T(1) = 0.15
    assert profile.window(slo, 1 / profile.service_time(1) * 0.99) == 0.0


@pytest.mark.parametrize("rate", [700.0, 1000.0, 2000.0, 10000.0])
@pytest.mark.parametrize("slo", [0.012, 0.020, 0.050])
def test_window_above_the_knee_is_bounded_by_slo_budget_and_rate(rate: float, slo: float) -> None:
    profile = linear_profile(8)
    t1 = profile.service_time(1)
    assert rate * t1 >= 1
    budget = slo - 2 * profile.service_time(profile.batch_cap(slo))
    window = profile.window(slo, rate)
    assert 0 < window <= min(budget, math.sqrt(t1 / rate)) + 1e-12
    assert window == pytest.approx(min(budget, math.sqrt(t1 / rate)))


def test_window_is_zero_when_the_slo_leaves_no_budget() -> None:
    profile = ServiceProfile(1)
    profile.observe(1, 0.010)
    assert profile.window(0.020, 1000.0) == 0.0  # 2·T(1) uses the whole SLO


def test_rate_meter_converges_to_a_constant_rate() -> None:
    meter = RateMeter(tau=1.0, last=0.0)
    now = 0.0
    for _ in range(500):  # 100 arrivals per second for 5 s
        now += 0.01
        meter.add(1, now)
    assert meter.current(now) == pytest.approx(100.0, rel=0.03)
    assert meter.current(now + 5.0) < 1.0  # decays once arrivals stop


def test_rate_meter_counts_rows() -> None:
    meter = RateMeter(tau=0.5, last=0.0)
    now = 0.0
    for _ in range(400):  # 8 rows every 20 ms: 400 rows per second
        now += 0.02
        meter.add(8, now)
    assert meter.current(now) == pytest.approx(400.0, rel=0.05)


def warm_then_sealed() -> ServiceProfile:
    """Warmup measured short synthetic inputs: 1 ms + 0.1 ms a row at 1, 2, 4, ... 32."""
    profile = ServiceProfile(32)
    for size in (1, 2, 4, 8, 16, 32):
        profile.observe(size, 0.001 + 0.0001 * size, now=0.0)
    profile.seal()
    profile.observe(1, 0.5, now=0.0)  # traffic's first batch, cold: not counted
    return profile


def test_traffic_replaces_warmups_shape_and_extrapolates_per_row() -> None:
    """A text encoder: warmup's few words cost 1.1 ms at B = 1 and 4.2 ms at B = 32, real
    sentences 27 ms a row. Once traffic has measured B = 1, no larger batch is predicted
    cheaper than 27 ms a row, so the cap for a 500 ms SLO is 9 (2·9·27 ms ≤ 500 ms), not 32."""
    profile = warm_then_sealed()
    assert profile.batch_cap(0.5) == 32  # warmup alone: every size looks cheap
    for i in range(3):
        profile.observe(1, 0.027, now=0.1 * i)
    assert profile.scale == 1.0  # the gap from warmup was the shape, not the load
    assert profile.service_time(1) == pytest.approx(0.027)
    assert profile.service_time(8) == pytest.approx(8 * 0.027)
    assert profile.batch_cap(0.5) == 9
    profile.observe(8, 0.160, now=1.0)  # traffic measures 8 rows: 20 ms a row
    assert profile.service_time(8) == pytest.approx(0.160)
    assert profile.service_time(4) == pytest.approx(0.027 + 3 / 7 * (0.160 - 0.027))
    assert profile.service_time(12) == pytest.approx(12 * 0.020)
    assert profile.batch_cap(0.5) == 12


def test_traffics_first_batches_at_a_size_settle_on_their_median() -> None:
    profile = warm_then_sealed()
    profile.observe(2, 0.050, now=0.0)
    profile.observe(2, 0.500, now=0.1)  # a stall among the first: the median holds
    profile.observe(2, 0.052, now=0.2)
    assert profile.service_time(2) == pytest.approx(0.052)
    assert 2 not in profile.first  # settled: from now on the running average
    profile.observe(2, 0.053, now=0.3)
    assert profile.service_time(2) == pytest.approx(0.052 + 0.1 * (0.053 - 0.052))


def test_traffics_first_batch_is_not_counted() -> None:
    """A fresh server's first batch runs cold (4.6 ms for one row whose batches then took 1 to
    2 ms, as measured): taken per row for every larger size, it would refuse a closed loop of
    16 clients against a 50 ms SLO."""
    profile = ServiceProfile(32)
    for size in (1, 2, 4, 8, 16, 32):
        profile.observe(size, 0.00025, now=0.0)
    profile.seal()
    profile.observe(1, 0.0046, now=0.1)
    assert not profile.traffic
    assert profile.service_time(8) == pytest.approx(0.00025)
    profile.observe(5, 0.0015, now=0.2)
    assert profile.traffic == {5}
    assert profile.service_time(16) == pytest.approx(16 * 0.0015 / 5)


def test_an_unsealed_profile_keeps_its_fit() -> None:
    """Without `seal` (tests, the compute profile) new sizes join the fit as before."""
    profile = linear_profile(32, sizes=(1, 32))
    profile.observe(4, A + 4 * B)
    assert not profile.traffic
    assert profile.service_time(10) == pytest.approx(A + 10 * B)


def test_tail_is_the_spread_of_recent_batches() -> None:
    """Batches whose inputs vary (sentences of 30 to 90 words): one in five runs 1.5 times the
    typical. The cap plans with the slow ones."""
    profile = linear_profile(32)
    assert profile.tail == 1.0
    cap_before = profile.batch_cap(0.020)
    now = 0.0
    for i in range(64):
        now += 0.05
        profile.observe(4, (1.5 if i % 5 == 0 else 1.0) * (A + 4 * B), now=now)
    assert 1.3 <= profile.tail <= 1.6
    assert 2 * profile.service_time(profile.batch_cap(0.020)) * profile.tail <= 0.020
    assert profile.batch_cap(0.020) < cap_before


def test_the_jitter_of_tiny_batches_does_not_make_a_tail() -> None:
    """One batch in four is one row, a tenth of the time of a full one, and runs three times
    its prediction (a loop turn's work in the cycle); full batches are steady. Counted one
    batch each, a quarter of them would be three times slow; weighed by time, the tail stays
    that of the full batches."""
    profile = linear_profile(32)
    now = 0.0
    for i in range(64):
        now += 0.05
        size, factor = (1, 3.0) if i % 4 == 0 else (32, 1.0)
        profile.observe(size, factor * (A + B * size), now=now)
    assert profile.tail < 1.2


def test_sizes_below_traffics_smallest_fall_as_warmups_did() -> None:
    """Traffic's first batches were 11 rows of sentences at 267 ms (as measured on minilm).
    One row is not 267 ms: it costs that less as much as warmup's one row cost less than its 11
    rows, and never less than 11 rows' time per row. Taken as the whole 267 ms, every smaller
    batch looked as slow, and the cap for a 500 ms SLO fell to 1."""
    profile = warm_then_sealed()  # warmup: 1 ms + 0.1 ms a row
    profile.observe(11, 0.267, now=0.1)
    warm = {b: 0.001 + 0.0001 * b for b in (1, 4)}
    for size in (1, 4):
        share = max(size / 11, warm[size] / (0.001 + 0.0011))
        assert profile.service_time(size) == pytest.approx(0.267 * share)
    assert profile.service_time(1) == pytest.approx(0.267 * 0.0011 / 0.0021)
    assert profile.batch_cap(0.5) == 9  # 2·T(9) = 2·9/11·267 ms ≤ 500 ms < 2·T(10)


def test_per_row_bounds_sizes_below_traffics_smallest() -> None:
    """Warmup's batches all cost the same (a fixed cost alone): below traffic's smallest size
    the same time holds; when warmup's cost grew faster than its rows, the time per row does."""
    flat = ServiceProfile(32)
    for size in (1, 8, 32):
        flat.observe(size, 0.002, now=0.0)
    flat.seal()
    flat.observe(1, 0.5, now=0.0)  # cold: not counted
    flat.observe(8, 0.080, now=0.1)
    assert flat.service_time(2) == pytest.approx(0.080)
    steep = ServiceProfile(32)
    for size in (1, 8, 32):
        steep.observe(size, 0.00001 * size * size, now=0.0)
    steep.seal()
    steep.observe(1, 0.5, now=0.0)
    steep.observe(8, 0.080, now=0.1)
    assert steep.service_time(2) == pytest.approx(0.080 * 2 / 8)


def test_a_figure_that_moves_past_the_band_reshapes_the_profile() -> None:
    profile = warm_then_sealed()
    profile.observe(1, 0.027, now=0.1)  # 27 ms against warmup's 1.1: reshaped
    assert profile.reshaped == 0.1
    profile.observe(1, 0.028, now=0.2)  # the median moves within the band: not
    profile.observe(2, 2 * 0.027 * 1.1, now=0.3)  # as the profile predicted it, within 20%
    assert profile.reshaped == 0.1
    profile.observe(4, 0.300, now=0.4)  # 300 ms against 108 predicted
    assert profile.reshaped == 0.4
