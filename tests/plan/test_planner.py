import dataclasses
import math

import numpy as np
import pytest

from lockgate.errors import BadRequest
from lockgate.plan.planner import PlanInputs, plan
from lockgate.plan.profile import ReplicaProfile
from lockgate.service_time import fit_service_time


def test_worked_example_9_replicas_12_with_headroom() -> None:
    # 5,000 QPS, 5 ms service, 50 ms p99, 1,143/s per accelerator:
    # 4.6 * 5 / (1 - rho) <= 50 => rho <= 0.54; 5000 / (1143 * 0.54) = 8.1 -> 9; * 1.3 -> 12
    result = plan(
        PlanInputs(
            rate=5000,
            slo_p99_s=0.050,
            service_time_s=0.005,
            capacity_per_replica=1143,
            headroom=0.3,
            cost_per_hour=3.6,
        )
    )
    assert round(result.max_utilization["mm1"], 2) == 0.54
    assert result.replicas_slo == 9
    assert result.replicas_with_headroom == 12
    assert result.replicas == 12 and result.binding == "slo"
    assert result.replicas_throughput == 5
    assert result.utilization == pytest.approx(5000 / (12 * 1143))
    assert result.utilization_after_failure == pytest.approx(5000 / (11 * 1143))
    assert result.slo_met_after_failure
    assert result.cost_per_million == pytest.approx(12 * 3.6 / (5000 * 3600) * 1e6)
    # less pessimistic models need fewer replicas
    assert result.replicas_by_model["md1"] <= 9 and result.replicas_by_model["mmc"] <= 9


def test_loose_slo_is_throughput_bound() -> None:
    result = plan(
        PlanInputs(rate=1000, slo_p99_s=10.0, service_time_s=0.01, headroom=0.0, redundancy=0)
    )
    assert result.replicas_throughput == 11  # 1000 / 100 = 10 is utilization 1: one more
    assert result.replicas == 11 and result.binding == "throughput"


def test_spares_beyond_headroom_are_redundancy_bound() -> None:
    result = plan(
        PlanInputs(rate=100, slo_p99_s=0.5, service_time_s=0.01, headroom=0.0, redundancy=2)
    )
    assert result.binding == "redundancy"
    assert result.replicas == result.replicas_slo + 2


def test_failure_that_breaks_the_slo_is_reported() -> None:
    result = plan(
        PlanInputs(rate=95, slo_p99_s=0.1, service_time_s=0.01, headroom=0.0, redundancy=0)
    )
    assert result.replicas == 2
    assert result.utilization_after_failure == pytest.approx(0.95)
    assert not result.slo_met_after_failure and result.notes
    assert result.to_json()["p99_after_failure_s"] is not None


def test_profile_chooses_a_batch_that_saves_replicas() -> None:
    profile = fit_service_time(
        "m", (1, 2, 4, 8, 16), tuple(0.004 + 0.001 * b for b in (1, 2, 4, 8, 16))
    )
    result = plan(PlanInputs(rate=2000, slo_p99_s=0.1, profile=ReplicaProfile(profile)))
    single = plan(PlanInputs(rate=2000, slo_p99_s=0.1, service_time_s=0.005))
    assert result.batch_size > 1
    assert result.replicas < single.replicas
    assert result.capacity_per_replica == pytest.approx(
        result.batch_size / (0.004 + 0.001 * result.batch_size)
    )
    assert result.batch_latency_s <= 0.1
    assert result.max_batch_within_slo >= 1


def test_impossible_slo_is_a_clear_error() -> None:
    with pytest.raises(BadRequest, match="cannot be met"):
        plan(PlanInputs(rate=10, slo_p99_s=0.004, service_time_s=0.005))
    with pytest.raises(BadRequest, match="service time"):
        PlanInputs(rate=10, slo_p99_s=0.1)
    assert math.isfinite(plan(PlanInputs(rate=10, slo_p99_s=0.1, service_time_s=0.005)).p99_s)


def test_front_end_cpu_joins_the_service_time() -> None:
    """A CPU-bound model shares its core with the front end: S = T(1) + front end, and the
    front end leaves the fixed overhead."""
    service = fit_service_time("m", (1,), (0.004,), overhead_s=0.0015)
    profile = ReplicaProfile(service, 0.2, cpu_per_request_s=0.005, compute_per_request_s=0.004)
    assert profile.frontend_s == pytest.approx(0.001)
    inputs = PlanInputs(rate=100, slo_p99_s=0.5, profile=profile, queue_model="mg1")
    result = plan(inputs)
    assert result.service_time_s == pytest.approx(0.005)
    assert result.capacity_per_replica == pytest.approx(200)
    assert result.overhead_s == pytest.approx(0.0005)
    assert result.frontend_s == pytest.approx(0.001) and result.service_cv == 0.2
    # a model that waits rather than computes (CPU under its compute time) keeps S = T(1)
    sleeper = ReplicaProfile(service, 0.0, cpu_per_request_s=0.0003, compute_per_request_s=0.004)
    assert sleeper.frontend_s == 0.0
    assert plan(PlanInputs(rate=100, slo_p99_s=0.5, profile=sleeper)).service_time_s == 0.004


def test_mg1_sits_between_md1_and_mm1() -> None:
    def p99(model: str, cv: float) -> float:
        inputs = PlanInputs(
            rate=70,
            slo_p99_s=10.0,
            service_time_s=0.01,
            service_cv=cv,
            queue_model=model,
            headroom=0,
            redundancy=0,
        )
        return plan(inputs).p99_s

    assert p99("md1", 0.5) < p99("mg1", 0.5) < p99("mm1", 0.5)
    assert p99("mg1", 0.0) == pytest.approx(p99("md1", 0.0), rel=1e-3)
    assert p99("mg1", 1.0) == pytest.approx(p99("mm1", 1.0), rel=1e-3)


def test_batch_model_plans_with_the_servers_cap() -> None:
    """T(B) = 4 ms + 1 ms B, cap 8: batches absorb a load one-row service could not carry."""
    service = fit_service_time("m", (1, 2, 4, 8), tuple(0.004 + 0.001 * b for b in (1, 2, 4, 8)))
    profile = ReplicaProfile(service, 0.1)
    inputs = PlanInputs(
        rate=300, slo_p99_s=0.1, profile=profile, queue_model="batch", headroom=0, redundancy=0
    )
    result = plan(inputs)
    assert result.batch_size == 8 and result.capacity_per_replica == pytest.approx(8 / 0.012)
    assert result.replicas == 1  # 300/s is 1.5 times one-row capacity (200/s)
    assert result.batch_window_s > 0  # lambda T(1) >= 1: the SLO batcher holds a window
    assert result.p99_s <= 0.1 and result.replicas_by_model["batch"] == 1
    one_row = plan(
        PlanInputs(
            rate=300,
            slo_p99_s=0.1,
            profile=ReplicaProfile(service, 0.1),
            max_batch_size=1,
            queue_model="batch",
        )
    )
    assert one_row.replicas_throughput == 2  # without batches 300/s needs two replicas


def test_headroom_over_a_tiny_load_is_not_throughput_bound() -> None:
    """0.1 replica of work: 1 replica by throughput, 2 with the SLO count's headroom."""
    result = plan(
        PlanInputs(rate=100, slo_p99_s=0.05, service_time_s=0.001, headroom=0.3, redundancy=0)
    )
    assert result.replicas_throughput == 1 and result.replicas == 2
    assert result.binding == "slo"


def test_idle_start_raises_the_p99_where_requests_find_the_replica_idle() -> None:
    """S = 5 ms back to back; after a gap of 10 ms or more a request takes 12 ms. At 20 req/s
    (rho 0.1) most requests come after long gaps, and the p99 is at least theirs; at 180 req/s
    (rho 0.9) most wait in the queue, and the idle start matters far less. The batch model at
    a cap of 1 is the same queue, simulated."""
    service = fit_service_time("m", (1,), (0.005,), overhead_s=0.001)
    gaps = tuple(float(g) for g in np.geomspace(1e-4, 0.1, 40))
    extra = tuple(0.007 if g >= 0.01 else 0.0 for g in gaps)
    profile = ReplicaProfile(service, 0.1, idle_gaps_s=gaps, idle_extra_s=extra)

    def p99(rate: float, model: str, idle: bool) -> float:
        inputs = PlanInputs(
            rate=rate, slo_p99_s=10.0, profile=profile, queue_model=model, max_batch_size=1,
            headroom=0, redundancy=0, idle_start=idle,
        )  # fmt: skip
        return plan(inputs).p99_s

    assert p99(20, "mg1", True) > 0.001 + 0.012 and p99(20, "mg1", False) < 0.012
    assert p99(20, "mg1", True) > p99(20, "mg1", False) + 0.004
    assert p99(180, "mg1", True) / p99(180, "mg1", False) < 1.15
    for rate in (20, 180):
        assert p99(rate, "batch", True) == pytest.approx(p99(rate, "mg1", True), rel=0.05)
    result = plan(PlanInputs(rate=20, slo_p99_s=10.0, profile=profile, queue_model="mg1"))
    assert result.first_service_s == pytest.approx(0.012, rel=0.1)
    assert plan(PlanInputs(rate=20, slo_p99_s=10.0, profile=profile)).first_service_s is None


def test_a_batch_pays_the_per_batch_front_end_once() -> None:
    """T(B) = 1 ms + 0.1 ms B; the front end 0.5 ms per one-row request, 0.2 ms of it once per
    batch: S(B) = 1.2 + 0.4 B ms, so a batch of 8 carries 8 rows in 4.4 ms, not 5.8."""
    service = fit_service_time("m", (1, 8), (0.0011, 0.0018))
    profile = ReplicaProfile(service, 0.0, 0.0016, 0.0011, frontend_per_batch_s=0.0002)
    assert profile.frontend_s == pytest.approx(0.0005)
    inputs = PlanInputs(
        rate=1000, slo_p99_s=1.0, profile=profile, queue_model="batch", max_batch_size=8,
        headroom=0, redundancy=0,
    )  # fmt: skip
    result = plan(inputs)
    assert result.service_time_s == pytest.approx(0.0044)
    assert result.capacity_per_replica == pytest.approx(8 / 0.0044)
    assert result.frontend_batch_s == pytest.approx(0.0002)
    one_row = plan(PlanInputs(rate=100, slo_p99_s=1.0, profile=profile, max_batch_size=1))
    assert one_row.service_time_s == pytest.approx(0.0016)  # T(1) + the whole front end
    plain = plan(dataclasses.replace(inputs, frontend_batch_s=0.0))
    assert plain.service_time_s == pytest.approx(0.0058)
    assert plain.p99_s > result.p99_s
