"""The router's bookkeeping: budgets, balancing, ejection and hedge delays."""

from __future__ import annotations

import argparse

import pytest

from lockgate.router.balancer import Balancer
from lockgate.router.budget import Budget
from lockgate.router.cli import add_arguments, run
from lockgate.router.hedge import HedgePolicy
from lockgate.router.replica import HealthSettings, Replica
from lockgate.router.upstream import Upstream


def replica(n: int, load: int = 0) -> Replica:
    r = Replica(f"http://127.0.0.1:{9000 + n}", Upstream("127.0.0.1", 9000 + n))
    r.ready, r.in_flight = True, load
    return r


def test_retry_budget_is_a_share_of_recent_requests() -> None:
    budget = Budget(ratio=0.1, floor=2, window=10.0)
    for i in range(100):
        budget.request(i * 0.01)
    granted = sum(budget.try_spend(1.0) for _ in range(50))
    assert granted == 12  # 10% of 100, plus the floor of 2
    assert not budget.try_spend(1.0)
    assert budget.try_spend(20.0)  # the window moved on: old spending is forgotten


def test_power_of_two_choices_prefers_the_less_loaded() -> None:
    idle, busy = replica(1, load=0), replica(2, load=10)
    balancer = Balancer(seed=1)
    assert all(balancer.pick([idle, busy], 0.0) is idle for _ in range(50))
    assert balancer.pick([idle, busy], 0.0, exclude=[idle]) is busy


def test_full_replicas_are_a_last_resort_and_ejected_ones_are_skipped() -> None:
    settings = HealthSettings(eject_after=3, eject_for=5.0, full_for=0.1)
    a, b, c = replica(1), replica(2), replica(3)
    a.refused(0.0, settings)
    assert all(Balancer(seed=s).pick([a, b], 0.05) is b for s in range(20))
    assert Balancer().pick([a], 0.05) is a  # full, but the only one left
    assert Balancer().pick([a, b], 0.2) is not None and not a.full(0.2)
    assert not c.failed(1.0, settings) and not c.failed(1.0, settings)
    assert c.failed(1.0, settings)  # the third failure in a row ejects it
    assert Balancer().pick([c], 2.0) is None
    assert Balancer().pick([c], 6.1) is c  # back after the cool-down
    for _ in range(3):
        c.failed(7.0, settings)
    assert not c.usable(16.9) and c.usable(17.1)  # a second ejection lasts twice as long


def test_grpc_failures_eject_a_replica_from_grpc_calls_alone() -> None:
    """A replica whose gRPC port fails (a server started without one) keeps its HTTP traffic;
    its gRPC calls go elsewhere until the cool-down ends."""
    settings = HealthSettings(eject_after=2, eject_for=5.0)
    a = replica(1)
    assert not a.failed(1.0, settings, grpc=True)
    assert a.failed(1.0, settings, grpc=True)
    assert a.usable(2.0) and a.grpc.out(2.0) and not a.http.out(2.0)
    assert not a.grpc.out(6.1)
    a.succeeded(None, grpc=True)
    assert a.grpc.failures == 0 and a.grpc.ejections == 0


def test_hedge_delay_follows_the_models_latency() -> None:
    policy = HedgePolicy(quantile=0.95, min_delay=0.001)
    assert policy.delay("m") is None  # nothing seen yet: no hedge
    for i in range(100):
        policy.observe("m", 0.010 if i % 20 else 0.200)
    delay = policy.delay("m")
    assert delay is not None and 0.009 <= delay <= 0.2
    assert HedgePolicy(enabled=False).delay("m") is None
    assert HedgePolicy(fixed_delay=0.05).delay("x") == 0.05


def test_a_budget_never_spent_still_forgets_old_requests() -> None:
    budget = Budget(window=10.0)
    for i in range(3000):  # 30 s at 100 requests per second, no retry at all
        budget.request(i * 0.01)
    assert len(budget.requests) <= 1001


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--probe-interval", "0"], "--probe-interval must be > 0"),
        (["--max-body-mb", "0"], "--max-body-mb must be > 0"),
        (["--hedge-budget", "5"], "--hedge-budget must be between 0 and 1"),
        (["--retry-budget", "-0.5"], "--retry-budget must be between 0 and 1"),
        (["--eject-after", "0"], "--eject-after must be >= 1"),
        (["--hedge-delay-ms", "-5"], "--hedge-delay-ms must be >= 0"),
        (["--drain-delay", "-1"], "--drain-delay must be >= 0"),
        (["--grpc-max-concurrent-rpcs", "0"], "--grpc-max-concurrent-rpcs must be >= 1"),
    ],
)
def test_route_refuses_a_limit_out_of_range(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--replica", "http://127.0.0.1:1", *flags])
    assert run(args) == 2
    assert message in capsys.readouterr().err
