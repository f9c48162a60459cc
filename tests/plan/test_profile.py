import json
import time

import numpy as np
import pytest

from lockgate.errors import BadRequest
from lockgate.plan.profile import (
    ReplicaProfile,
    batch_sizes_up_to,
    profile_callable,
    profile_server,
    variation,
)
from lockgate.service_time import ServiceTime, fit_service_time
from tests.bench.fake_server import Behaviour, serve


def test_batch_sizes() -> None:
    assert batch_sizes_up_to(1) == (1,)
    assert batch_sizes_up_to(8) == (1, 2, 4, 8)
    assert batch_sizes_up_to(12) == (1, 2, 4, 8, 12)
    with pytest.raises(BadRequest):
        batch_sizes_up_to(0)


def test_fit_is_exact_on_a_line_and_round_trips(tmp_path) -> None:
    profile = fit_service_time("m", (1, 2, 4, 8), (0.003, 0.004, 0.006, 0.010))
    assert profile.a_s == pytest.approx(0.002) and profile.b_s == pytest.approx(0.001)
    assert profile.r2 == pytest.approx(1.0)
    noisy = fit_service_time("m", (1, 2, 4, 8), (0.003, 0.005, 0.006, 0.010))
    assert 0.8 < noisy.r2 < 1.0
    profile.save(tmp_path / "p.json")
    assert ServiceTime.load(tmp_path / "p.json") == profile
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(BadRequest):
        ServiceTime.load(tmp_path / "bad.json")


def test_in_process_profile_recovers_the_slope() -> None:
    def infer(batch: int) -> None:
        time.sleep(0.002 + 0.001 * batch)

    profile = profile_callable(infer, 8, repeats=3)
    assert profile.batch_sizes == (1, 2, 4, 8)
    assert all(m >= 0.002 + 0.001 * b for b, m in zip((1, 2, 4, 8), profile.median_s, strict=True))
    assert profile.b_s == pytest.approx(0.001, rel=0.5)


def test_profile_through_a_server() -> None:
    behaviour = Behaviour(rows_sleep=lambda rows: 0.002 + 0.002 * rows)
    said: list[str] = []
    with serve(behaviour) as (url, _):
        replica = profile_server(url, "toy", 8, repeats=3, idle_requests=5, say=said.append)
    assert said[0] == "round 1 of 4: batch sizes 1"  # progress, as it goes
    assert said[-3:] == [
        "round 4 of 4: batch sizes 2, 4, 8",
        "measuring the server's CPU per request for 2 s",
        "timing 5 one-row requests after idle gaps",
    ]
    profile = replica.service
    assert profile.batch_sizes == (1, 2, 4, 8)
    assert profile.median_s[-1] >= 0.018
    assert profile.b_s == pytest.approx(0.002, rel=0.5)
    assert replica.service_cv >= 0
    assert replica.cpu_per_request_s is None and replica.frontend_s == 0.0  # no /metrics there


def test_profile_times_requests_after_idle_gaps() -> None:
    """A server that takes 2 ms, and 8 ms more when it was idle for over 20 ms: the profile's
    requests after long gaps show it, and the replica's idle start at a low rate carries it."""
    free = [0.0]

    def wake(rows: int) -> float:
        now = time.perf_counter()
        seconds = 0.002 + (0.008 if now - free[0] > 0.020 else 0.0)
        free[0] = now + seconds
        return seconds

    with serve(Behaviour(rows_sleep=wake)) as (url, _):
        replica = profile_server(
            url, "toy", 1, repeats=3, cpu_seconds=0, idle_requests=60, idle_longest_s=0.1
        )
    gaps, extra = np.array(replica.idle_gaps_s), np.array(replica.idle_extra_s)
    assert len(gaps) == 60 and gaps.min() >= 1e-4 and gaps.max() < 0.15
    assert np.median(extra[gaps > 0.03]) > 0.006 > 0.002 > abs(np.median(extra[gaps < 0.01]))
    idle = replica.idle_start(0.002)  # the fake server has no statistics: round trips
    assert idle is not None
    assert idle.at(5.0).mean > 0.009  # mostly idle for 200 ms: woken from cold
    assert idle.at(2000.0).mean < 0.006  # idle for 0.5 ms: still warm
    with pytest.raises(BadRequest, match="longest idle gap"):
        profile_server(url, "toy", 1, idle_longest_s=0.0)


def test_variation_counts_a_stall_as_three_medians() -> None:
    assert variation([0.01]) == 0.0
    assert variation([0.01] * 10) == 0.0
    steady = [0.009, 0.010, 0.011] * 10
    assert variation(steady) == pytest.approx(0.0830, rel=0.01)  # sample sd 0.00083 / 0.01
    stalled = [*steady[:-1], 1.0]  # one request of thirty preempted for a second
    assert variation(stalled) == pytest.approx(variation([*steady[:-1], 0.030]))
    assert variation(stalled) < 0.5


def test_replica_profile_round_trips_and_reads_a_plain_service_time(tmp_path) -> None:
    service = fit_service_time("m", (1, 2), (0.004, 0.006), overhead_s=0.001)
    replica = ReplicaProfile(service, 0.3, 0.005, 0.004, (0.001, 0.05), (-0.0001, 0.004))
    replica.save(tmp_path / "r.json")
    assert ReplicaProfile.load(tmp_path / "r.json") == replica
    idle = replica.idle_start(0.005)
    assert idle is not None and idle.services == pytest.approx((0.0049, 0.009))
    assert ReplicaProfile(service).idle_start(0.005) is None
    broken = {**replica.to_json(), "idle_extra_s": [0.005]}
    (tmp_path / "bad.json").write_text(json.dumps(broken))
    with pytest.raises(BadRequest, match="differ in length"):
        ReplicaProfile.load(tmp_path / "bad.json")
    assert ServiceTime.load(tmp_path / "r.json") == service  # older readers see T(B)
    service.save(tmp_path / "s.json")
    plain = ReplicaProfile.load(tmp_path / "s.json")  # a profile from before these fields
    assert plain == ReplicaProfile(service) and plain.frontend_s == 0.0


def test_idle_start_counts_a_stalled_request_as_three_medians() -> None:
    service = fit_service_time("m", (1,), (0.004,), overhead_s=0.001)
    gaps = tuple(0.001 * (i + 1) for i in range(30))
    extra = [0.001] * 30
    extra[12] = 1.0  # preempted for a second
    replica = ReplicaProfile(service, idle_gaps_s=gaps, idle_extra_s=tuple(extra))
    idle = replica.idle_start(0.004)
    assert idle is not None and max(idle.services) == pytest.approx(3 * 0.005)
    assert sorted(idle.services)[:29] == pytest.approx([0.005] * 29)
