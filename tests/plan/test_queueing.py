import math

import numpy as np
import pytest

from lockgate.errors import BadRequest
from lockgate.plan.queueing import (
    MD1,
    MG1,
    MM1,
    EmpiricalDistribution,
    IdleStart,
    MMc,
    ServiceDistribution,
    erlang_c,
    littles_law,
    max_utilization,
    mm1_max_utilization,
)


@pytest.mark.parametrize("rho", [0.1, 0.5, 0.54, 0.9])
def test_mm1_p99_is_4_6_service_times_over_idle_fraction(rho: float) -> None:
    service = 0.005
    queue = MM1(rho / service, 1 / service)
    assert queue.response_quantile(0.99) == pytest.approx(math.log(100) * service / (1 - rho))
    assert queue.response_quantile(0.99) == pytest.approx(4.6 * service / (1 - rho), rel=2e-3)
    assert queue.mean_response == pytest.approx(service / (1 - rho))
    assert queue.mean_wait == pytest.approx(rho * service / (1 - rho))


def test_littles_law_holds_for_mm1() -> None:
    queue = MM1(8.0, 10.0)
    rho = queue.utilization
    assert littles_law(8.0, queue.mean_response) == pytest.approx(rho / (1 - rho))
    assert littles_law(8.0, queue.mean_wait) == pytest.approx(rho**2 / (1 - rho))


def test_erlang_c_textbook_values() -> None:
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # c = 2, lambda = mu = 1
    assert erlang_c(1, 0.7) == pytest.approx(0.7)  # one server: P(wait) = rho
    assert erlang_c(10, 8.0) == pytest.approx(0.409, abs=1e-3)  # tables: C(10, 8) = 0.4092
    queue = MMc(1.0, 1.0, 2)
    assert queue.mean_wait == pytest.approx((1 / 3) / (2 - 1))


def test_mmc_with_one_server_is_mm1() -> None:
    one, mm1 = MMc(7.0, 10.0, 1), MM1(7.0, 10.0)
    assert one.response_quantile(0.99) == pytest.approx(mm1.response_quantile(0.99), rel=1e-6)
    assert one.wait_quantile(0.99) == pytest.approx(mm1.wait_quantile(0.99))
    assert one.mean_response == pytest.approx(mm1.mean_response)


def test_mmc_response_tail_matches_simulation() -> None:
    rng = np.random.default_rng(0)
    queue = MMc(3.2, 1.0, 4)
    # W: 0 with probability 1 - C, else Exp(c mu - lambda); plus Exp(mu) service
    n = 400_000
    waits = np.where(rng.random(n) < queue.prob_wait, rng.exponential(1 / 0.8, n), 0.0)
    response = waits + rng.exponential(1.0, n)
    assert queue.response_quantile(0.99) == pytest.approx(np.quantile(response, 0.99), rel=0.03)
    assert queue.response_quantile(0.9) == pytest.approx(np.quantile(response, 0.9), rel=0.03)


def test_md1_mean_wait_is_pollaczek_khinchine() -> None:
    queue = MD1(0.8, 1.0)  # rho = 0.8, mu = 1
    assert queue.mean_wait == pytest.approx(0.8 / (2 * 1 * (1 - 0.8)))
    # the exact distribution integrates to the same mean wait
    ts = np.linspace(0, 80, 1601)
    tail = [1 - queue.wait_cdf(t) for t in ts]
    assert float(np.trapezoid(tail, ts)) == pytest.approx(queue.mean_wait, rel=1e-3)
    assert queue.wait_cdf(0.0) == pytest.approx(0.2)  # P(no wait) = 1 - rho


def test_md1_quantile_matches_a_lindley_simulation() -> None:
    rng = np.random.default_rng(1)
    lam, service = 0.7, 1.0
    gaps = rng.exponential(1 / lam, 300_000)
    waits = np.empty_like(gaps)
    w = 0.0
    for i, gap in enumerate(gaps.tolist()):
        waits[i] = w
        w = max(0.0, w + service - gap)  # Lindley's recursion
    queue = MD1(lam, service)
    assert queue.response_quantile(0.99) == pytest.approx(
        np.quantile(waits, 0.99) + service, rel=0.04
    )
    # M/D/1 waits less than M/M/1 at the same load
    assert queue.response_quantile(0.99) < MM1(lam, 1 / service).response_quantile(0.99)


def test_md1_tail_approximation_agrees_with_exact_far_out() -> None:
    queue = MD1(0.9, 1.0)
    theta = queue.tail_decay_rate()
    assert 0.9 * math.expm1(theta) == pytest.approx(theta)
    assert queue.tail_quantile(0.99) == pytest.approx(queue.wait_quantile(0.99), rel=1e-6)
    heavy = MD1(0.995, 1.0)  # beyond 50 service times the tail formula is used
    assert heavy.response_quantile(0.99) > 400


def test_max_utilization_for_a_p99_slo() -> None:
    assert mm1_max_utilization(0.005, 0.050) == pytest.approx(1 - math.log(100) / 10)
    assert round(mm1_max_utilization(0.005, 0.050), 2) == 0.54
    bisected = max_utilization(lambda rho: math.log(100) * 0.005 / (1 - rho) <= 0.05)
    assert bisected == pytest.approx(mm1_max_utilization(0.005, 0.05), abs=1e-6)
    assert mm1_max_utilization(0.05, 0.05) == 0.0


def test_unstable_or_bad_inputs_are_refused() -> None:
    with pytest.raises(BadRequest, match="unstable"):
        MM1(10.0, 10.0)
    with pytest.raises(BadRequest, match="unstable"):
        MMc(5.0, 1.0, 5)
    with pytest.raises(BadRequest):
        MD1(1.0, 0.0)
    with pytest.raises(BadRequest):
        MM1(1.0, 2.0).response_quantile(1.0)


@pytest.mark.parametrize("rho", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_mg1_is_md1_and_mm1_at_the_ends(rho: float) -> None:
    """cv 0 is deterministic service (Erlang's exact M/D/1), cv 1 exponential (M/M/1)."""
    service = 0.01
    deterministic = MG1(rho / service, ServiceDistribution(service, 0.0))
    exact = MD1(rho / service, service)
    assert deterministic.response_quantile(0.99) == pytest.approx(
        exact.response_quantile(0.99), rel=1e-3
    )
    assert deterministic.wait_quantile(0.99) == pytest.approx(exact.wait_quantile(0.99), rel=1e-3)
    exponential = MG1(rho / service, ServiceDistribution(service, 1.0))
    mm1 = MM1(rho / service, 1 / service)
    assert exponential.response_quantile(0.99) == pytest.approx(
        mm1.response_quantile(0.99), rel=1e-4
    )
    assert exponential.wait_quantile(0.99) == pytest.approx(mm1.wait_quantile(0.99), rel=1e-4)


@pytest.mark.parametrize("cv", [0.3, 0.6, 2.0])
def test_mg1_matches_a_lindley_simulation(cv: float) -> None:
    rng = np.random.default_rng(2)
    lam, service = 0.6, ServiceDistribution(1.0, cv)
    n = 400_000
    gaps = rng.exponential(1 / lam, n)
    work = service.sample(rng, n)
    assert work.mean() == pytest.approx(1.0, rel=0.02)
    assert work.std() / work.mean() == pytest.approx(cv, rel=0.05)
    response = np.empty(n)
    wait = 0.0
    for i, (gap, s) in enumerate(zip(gaps.tolist(), work.tolist(), strict=True)):
        response[i] = wait + s
        wait = max(0.0, wait + s - gap)  # Lindley's recursion
    queue = MG1(lam, service)
    assert queue.response_quantile(0.99) == pytest.approx(np.quantile(response, 0.99), rel=0.05)
    assert queue.mean_response == pytest.approx(response.mean(), rel=0.03)  # Pollaczek-Khinchine


def test_service_distribution_moments_and_residual() -> None:
    x = np.linspace(0, 40, 40_001)
    for cv in (0.0, 0.5, 1.0, 1.5):
        law = ServiceDistribution(2.0, cv)
        survival = 1 - law.cdf(x)
        assert np.trapezoid(survival, x) == pytest.approx(2.0, rel=1e-3)  # the mean
        second = 2 * np.trapezoid(x * survival, x)  # E[S^2]
        assert math.sqrt(max(0.0, second - 4.0)) / 2.0 == pytest.approx(cv, abs=0.01)
        # the residual distribution's density is P(S > x) / mean (away from a jump of the CDF)
        residual = np.gradient(law.residual_cdf(x), x)
        smooth = np.abs(np.gradient(survival, x)) < 10
        assert np.max(np.abs(residual - survival / 2.0)[smooth]) < 1e-3
        assert law.quantile(0.99) == pytest.approx(x[np.searchsorted(law.cdf(x), 0.99)], abs=2e-3)
    with pytest.raises(BadRequest):
        ServiceDistribution(1.0, -0.1)


@pytest.mark.parametrize("rho", [0.3, 0.7])
def test_mg1_with_an_exceptional_first_service_matches_a_simulation(rho: float) -> None:
    """Waking an idle server costs 0.5 more than a queued request's service of 1 (cv 0.3)."""
    service = ServiceDistribution(1.0, 0.3)
    first = ServiceDistribution(1.5, 0.2)  # the same stall, a longer fixed part
    queue = MG1(rho, service, first)
    rng = np.random.default_rng(4)
    n = 300_000
    arrivals = np.cumsum(rng.exponential(1 / rho, n)).tolist()
    work = service.sample(rng, n).tolist()
    free, response = 0.0, np.empty(n)
    for i, (t, s) in enumerate(zip(arrivals, work, strict=True)):
        idle = t >= free
        free = (t if idle else free) + s + (0.5 if idle else 0.0)
        response[i] = free - t
    assert queue.response_quantile(0.99) == pytest.approx(np.quantile(response, 0.99), rel=0.04)
    assert queue.mean_response == pytest.approx(response.mean(), rel=0.02)
    idle_share = np.mean(np.asarray(arrivals[1:]) >= np.asarray(arrivals[:-1]) + response[:-1])
    assert queue.idle_probability == pytest.approx(idle_share, abs=0.01)
    plain = MG1(rho, service)
    assert plain.response_quantile(0.99) < queue.response_quantile(0.99)
    assert MG1(rho, service, service).response_quantile(0.99) == pytest.approx(
        plain.response_quantile(0.99), rel=1e-9
    )


def test_empirical_distribution_is_its_samples() -> None:
    law = EmpiricalDistribution.of(np.array([3.0, 1.0, 2.0, 2.0]))
    assert law.mean == pytest.approx(2.0) and law.cv == pytest.approx(math.sqrt(0.5) / 2)
    x = np.array([0.0, 1.0, 1.5, 2.0, 3.0, 9.0])
    assert law.cdf(x).tolist() == pytest.approx([0, 0.25, 0.25, 0.75, 1, 1])
    e_min = [np.mean(np.minimum([3.0, 1.0, 2.0, 2.0], t)) for t in x]  # E[min(S, x)]
    assert law.residual_cdf(x).tolist() == pytest.approx([v / 2.0 for v in e_min])
    assert law.quantile(0.5) == 2.0 and law.quantile(0.99) == 3.0 and law.span == 3.0
    assert law.mgf(0.5) == pytest.approx(np.mean(np.exp(0.5 * np.array([3.0, 1.0, 2.0, 2.0]))))
    weighted = EmpiricalDistribution.of(np.array([1.0, 5.0]), np.array([3.0, 1.0]))
    assert weighted.mean == pytest.approx(2.0) and weighted.quantile(0.8) == 5.0
    draws = weighted.sample(np.random.default_rng(0), 40_000)
    assert np.mean(draws == 5.0) == pytest.approx(0.25, abs=0.01)
    with pytest.raises(BadRequest):
        EmpiricalDistribution((1.0, -1.0), (1.0, 1.0))
    with pytest.raises(BadRequest):
        EmpiricalDistribution((1.0,), (0.0,))


@pytest.mark.parametrize("rho", [0.3, 0.7])
def test_mg1_on_measured_samples_is_mg1_on_their_law(rho: float) -> None:
    """One sample is deterministic service (M/D/1); many samples of a law are that law."""
    assert MG1(rho, EmpiricalDistribution.of(np.array([1.0]))).response_quantile() == (
        pytest.approx(MD1(rho, 1.0).response_quantile(), rel=1e-3)
    )
    law = ServiceDistribution(1.0, 0.5)
    samples = EmpiricalDistribution.of(law.sample(np.random.default_rng(1), 5_000))
    assert MG1(rho, samples).response_quantile() == pytest.approx(
        MG1(rho, law).response_quantile(), rel=0.03
    )


def test_idle_start_weighs_each_gap_by_the_idle_time_near_it() -> None:
    idle = IdleStart((0.001, 0.01, 0.1), (1.0, 2.0, 3.0))
    assert idle.at(0.0).mean == 3.0  # no arrivals: the longest idle
    assert idle.at(1e7).mean == 1.0  # back to back: the shortest
    rate = 30.0
    waits = np.random.default_rng(3).exponential(1 / rate, 200_000)  # Poisson idle times
    nearest = np.argmin(np.abs(np.log(waits[:, None]) - np.log([0.001, 0.01, 0.1])), axis=1)
    assert idle.at(rate).mean == pytest.approx(np.mean(np.array([1.0, 2.0, 3.0])[nearest]), 0.01)
    with pytest.raises(BadRequest):
        IdleStart((0.001,), (1.0, 2.0))


@pytest.mark.parametrize("rho", [0.3, 0.7])
def test_mg1_with_idle_start_matches_a_server_that_cools_down(rho: float) -> None:
    """A server whose first service after idling for t takes 1 + 1.5 (1 - e^{-t}) more (cv
    0.3 otherwise): measured after log-uniform gaps, mixed at the arrival rate, its M/G/1
    predicts the simulated p99."""
    service = ServiceDistribution(1.0, 0.3)
    rng = np.random.default_rng(5)

    def cold(idle: np.ndarray) -> np.ndarray:
        return service.sample(rng, len(idle)) + 1.5 * -np.expm1(-idle)

    gaps = np.exp(rng.uniform(math.log(1e-3), math.log(30.0), 400))
    idle = IdleStart(tuple(gaps.tolist()), tuple(cold(gaps).tolist()))
    queue = MG1(rho, service, idle.at(rho))
    n = 300_000
    arrivals = np.cumsum(rng.exponential(1 / rho, n)).tolist()
    work = service.sample(rng, n).tolist()
    extra = (1.5 * -np.expm1(-np.arange(0, 60, 1e-3))).tolist()  # by idle time, 1e-3 apart
    free, response = 0.0, np.empty(n)
    for i, (t, s) in enumerate(zip(arrivals, work, strict=True)):
        idle_for = t - free
        start = max(t, free)
        free = start + s + (extra[min(int(idle_for * 1e3), len(extra) - 1)] if idle_for > 0 else 0)
        response[i] = free - t
    assert queue.response_quantile(0.99) == pytest.approx(np.quantile(response, 0.99), rel=0.05)
    assert queue.mean_response == pytest.approx(response.mean(), rel=0.03)


def test_a_nearly_deterministic_service_has_a_cdf_without_overflow() -> None:
    """cv 1e-6: the stall is a nanosecond; far below the fixed part the CDF is 0, not an
    overflow (pytest turns the warning into an error)."""
    law = ServiceDistribution(0.01, 1e-6)
    assert law.cdf(np.array([0.0, 0.005, 0.02])).tolist() == pytest.approx([0.0, 0.0, 1.0])
    assert MG1(30.0, law).response_quantile() == pytest.approx(
        MD1(30.0, 0.01).response_quantile(), rel=1e-3
    )
