"""The connection gate's bookkeeping (frontend/gate.py): the loop lag and the tables."""

from __future__ import annotations

import pytest

from lockgate.frontend.gate import EXEMPT_PATHS, Gate, GateSettings, LoopCost, LoopLag


def fire_every(lag: LoopLag, start: float, gap: float, count: int) -> float:
    now = start
    for _ in range(count):
        now += gap
        lag.fired(now)
    return now


def test_lag_is_zero_while_the_sentinel_fires_on_time() -> None:
    lag = LoopLag(interval=0.005, weight=0.1)
    now = fire_every(lag, 0.0, 0.005, 100)
    assert lag.current(now) == pytest.approx(0.0, abs=1e-12)


def test_one_stall_is_not_saturation_but_a_lasting_lag_is() -> None:
    settings = GateSettings(max_lag=0.010)
    lag = LoopLag(settings.interval, settings.weight)
    now = fire_every(lag, 0.0, 0.005, 10)
    now += 0.005 + 0.080  # one 80 ms stall (a large body decoded on the loop)
    lag.fired(now)
    now = fire_every(lag, now, 0.005, 1)
    assert lag.current(now) < settings.max_lag
    now = fire_every(lag, now, 0.005 + 0.030, 30)  # the loop is 30 ms behind at every firing
    assert lag.current(now) > settings.max_lag


def test_an_overdue_sentinel_counts_before_it_fires() -> None:
    lag = LoopLag(interval=0.005, weight=0.1)
    now = fire_every(lag, 0.0, 0.005, 10)
    assert lag.current(now + 0.005 + 0.080) == pytest.approx(0.020)  # in an 85 ms iteration
    assert lag.current(now + 0.005 + 0.030) < 0.010  # one preemption of 30 ms: not yet


def test_time_kept_off_the_core_is_not_the_loops_lag() -> None:
    """A firing late because the loop waited for its core (a neighbour's slice) is not lag;
    lateness beyond that wait is."""
    lag = LoopLag(interval=0.005, weight=1.0)
    lag.fired(0.0, waited=1.0)
    lag.fired(0.005 + 0.008, waited=1.008)  # 8 ms late, all of it waiting for the core
    assert lag.current(0.013) == pytest.approx(0.0)
    lag.fired(0.018 + 0.008, waited=1.010)  # 8 ms late, 2 ms of it waiting
    assert lag.current(0.026) == pytest.approx(0.006)


def test_gate_refuses_on_lag_and_on_requests_in_progress_but_never_probes() -> None:
    gate = Gate(GateSettings(max_lag=0.010, max_requests=4))
    now = fire_every(gate.lag, 0.0, 0.005, 10)
    assert gate.admit("/v2/models/m/infer", 3, now) is None
    assert gate.admit("/v2/models/m/infer", 4, now) == "requests"
    assert gate.admit("/v2/models/m/infer", 1, now + 0.1) == "loop_lag"  # sentinel overdue
    assert gate.admit("/v2/models/m/infer", 0, now + 0.1) is None  # alone: nothing to free
    assert gate.admit("/v2/models/m/infer", 1, now + 0.1, loading=True) is None  # a load's lag
    assert gate.admit("/v2/models/m/infer", 4, now, loading=True) == "requests"
    for path in EXEMPT_PATHS:
        assert gate.admit(path, 10_000, now + 0.1) is None
    assert gate.retry_after(now) == 1


def test_connection_caps_per_client_and_in_all() -> None:
    gate = Gate(GateSettings(max_connections=5, max_connections_per_client=3))
    assert [gate.connect("a") for _ in range(4)] == [None, None, None, "client_connections"]
    assert gate.connect("b") is None and gate.connect("b") is None
    assert gate.connect("c") == "connections"  # 5 open in all
    gate.disconnect("a")
    assert gate.connect("c") is None
    for address in ("a", "a", "b", "b", "c"):
        gate.disconnect(address)
    assert gate.open_connections == 0 and not gate.connections


def test_a_full_gate_takes_back_the_oldest_slow_body_of_the_client_holding_most() -> None:
    gate = Gate(GateSettings(max_requests=4, slow_body=1.0))
    evicted: list[str] = []
    for key, address, since in (("a1", "a", 0.1), ("b1", "b", 0.2), ("b2", "b", 0.3)):
        gate.bodies.start(address, key, since, lambda key=key: evicted.append(key))
    assert gate.admit("/v2/models/m/infer", 4, 1.05) == "requests"  # none past 1 s yet
    assert gate.admit("/v2/models/m/infer", 4, 1.15) is None  # a1, the one past 1 s
    assert gate.admit("/v2/models/m/infer", 4, 1.35) is None  # b holds the most past it: b1
    assert evicted == ["a1", "b1"]
    gate.bodies.end("b", "b2")  # its body came
    assert gate.admit("/v2/models/m/infer", 4, 5.0) == "requests" and not gate.bodies.by_client
    assert gate.admit("/v2/models/m/infer", 3, 5.0) is None  # a free place: nothing taken


@pytest.mark.parametrize(
    "bad",
    [
        {"max_lag": -1.0},
        {"max_lag": float("nan")},
        {"weight": 0.0},
        {"head_timeout": 0.0},
        {"max_connections": 0},
        {"max_connections_per_client": 0},
        {"max_requests": 0},
    ],
)
def test_settings_are_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GateSettings(**bad)  # type: ignore[arg-type]


def test_a_standing_front_end_queue_refuses_and_a_burst_does_not() -> None:
    from lockgate.frontend.gate import QueueDelay

    queue = QueueDelay(target=0.005, interval=0.100)
    now = 0.0
    for i in range(30):  # a burst: a few requests wait 20 ms, most wait 1 ms
        now += 0.01
        queue.observe(0.020 if i % 5 == 0 else 0.001, now)
    assert not queue.standing_at(now)
    for _ in range(30):  # every request waits 8 ms or more: a standing queue
        now += 0.01
        queue.observe(0.008, now)
    assert queue.standing_at(now)
    assert not queue.standing_at(now + 0.25)  # no new evidence for two intervals: lapses
    for _ in range(30):
        now += 0.01
        queue.observe(0.001, now)
    assert not queue.standing_at(now)


def test_gate_refuses_on_a_standing_queue() -> None:
    gate = Gate(GateSettings(max_lag=0.010, queue_target=0.005))
    now = fire_every(gate.lag, 0.0, 0.005, 10)
    for _ in range(30):
        now += 0.005
        gate.lag.fired(now)  # the loop keeps time: no lag
        gate.queue.observe(0.010, now)
    assert gate.admit("/v2/models/m/infer", 1, now) == "queue_delay"
    assert gate.admit("/v2/models/m/infer", 0, now) is None
    assert gate.admit("/v2/health/live", 1, now) is None


def test_refused_connections_pause_only_when_refusals_swamp_admissions() -> None:
    gate = Gate(GateSettings(penalty_pause=0.25, penalty_ratio=10.0, pause_share=0.25))
    now = 0.0
    for _ in range(100):  # ordinary overload: three refusals per admitted request
        now += 0.001
        gate.let_through(now)
        assert all(gate.refused(now) == 0.0 for _ in range(3))
    for _ in range(4000):  # two seconds of a storm: only refusals
        now += 0.0005
        pause = gate.refused(now)
    assert pause == 0.25
    assert gate.refused(now, budget=0.5) == pytest.approx(0.125)  # a quarter of the budget
    assert gate.refused(now, budget=5.0) == 0.25
    assert gate.refused(now, budget=lambda: 0.5) == pytest.approx(0.125)  # found when paused
    asked = []
    calm = Gate(GateSettings())
    assert calm.refused(now, budget=lambda: asked.append(1) or 0.5) == 0.0
    assert not asked  # no pause: the budget is never looked up
    assert Gate(GateSettings()).refused(now) == 0.0  # one refusal is no storm
    assert Gate(GateSettings(penalty_pause=0.0)).refused(now) == 0.0  # off


def test_by_default_a_refusal_per_three_answers_pauses_for_up_to_the_whole_budget() -> None:
    """In a storm of clients that resend at once, every refusal takes CPU from the answers:
    past 0.3 refusals per admitted request, refused connections are paused, for the refused
    request's budget if that is shorter than the pause."""
    gate = Gate(GateSettings())
    now = 0.0
    for _ in range(1000):  # a second at capacity
        now += 0.001
        gate.let_through(now)
    for i in range(2000):  # two seconds of ordinary overload: one refusal per five answers
        now += 0.001
        gate.let_through(now)
        if i % 5 == 0:
            assert gate.refused(now, budget=0.05) == 0.0
    for i in range(3000):  # then one refusal per two answers
        now += 0.001
        gate.let_through(now)
        if i % 2:
            pause = gate.refused(now, budget=0.05)
    assert pause == pytest.approx(0.05)  # digits_onnx's 50 ms SLO, all of it
    assert gate.refused(now, budget=0.5) == pytest.approx(0.1)  # minilm's: the pause


def test_loop_cost_is_the_loop_cpu_per_answered_request() -> None:
    cost = LoopCost(window=0.1, least=4, weight=0.5)
    cost.sample(-0.2, 9.0)  # starts the first window: first-time costs, not counted
    for _ in range(4):
        cost.answer()
    cost.sample(0.0, 10.0)  # 1 s of CPU for 4 answers
    assert cost.per_request == 0.0
    for _ in range(10):
        cost.answer()
    cost.sample(0.05, 10.002)  # the window is not over: nothing yet
    assert cost.per_request == 0.0
    cost.sample(0.1, 10.004)  # 4 ms of loop CPU for 10 answers
    assert cost.per_request == pytest.approx(0.0004)
    for _ in range(2):
        cost.answer()
    cost.sample(0.2, 10.005)  # too few answers: the window goes on
    assert cost.per_request == pytest.approx(0.0004)
    for _ in range(8):
        cost.answer()
    cost.sample(0.3, 10.012)  # 8 ms for 10: 0.8 ms, half weight
    assert cost.per_request == pytest.approx(0.0006)
    assert cost.wait(5) == pytest.approx(0.003)


def test_the_loops_share_of_its_core_is_its_cpu_over_that_and_its_wait() -> None:
    """Beside a neighbour that takes half its core, the loop runs half the time it has work."""
    cost = LoopCost(window=0.1, least=4, weight=1.0)
    cost.warm = True
    cost.sample(0.0, 1.0, waited=5.0)
    for _ in range(10):
        cost.answer()
    cost.sample(0.1, 1.004, waited=5.004)  # 4 ms run, 4 ms waited for the core
    assert cost.per_request == pytest.approx(0.0004)
    assert cost.share == pytest.approx(0.5)
    for _ in range(10):
        cost.answer()
    cost.sample(0.2, 1.008, waited=5.004)  # the neighbour gone
    assert cost.share == pytest.approx(1.0)


def test_a_cold_servers_first_answers_are_not_counted() -> None:
    """A cold server's first answers (16 for 120 ms of loop CPU, as measured) do not make the
    next arrivals look late: the loop cost starts from the window after them."""
    cost = LoopCost(window=0.1, least=8, weight=0.3)
    cost.sample(0.0, 0.0)
    for _ in range(16):
        cost.answer()
    cost.sample(0.2, 0.120)  # the first window: not counted
    assert cost.per_request == 0.0
    for _ in range(320):
        cost.answer()
    cost.sample(0.31, 0.213)  # 93 ms for 320
    assert cost.per_request == pytest.approx(0.093 / 320)
    assert cost.wait(31) < 0.010  # 31 requests in progress: well inside a 50 ms SLO


def test_refusals_count_in_the_loop_cost_at_their_share() -> None:
    """A few refusals count at their share of an answer; a window mostly of refusals (a storm,
    whose refusals may cost more than their share) leaves the cost measured before it."""
    gate = Gate(GateSettings(penalty_pause=0.0))
    cost = gate.loop_cost
    cost.warm = True  # past the first window
    cost.sample(0.0, 0.0)
    for _ in range(40):
        cost.answer()
    for _ in range(100):
        gate.refused(0.05)
    cost.sample(0.1, 0.05)  # 50 ms of loop CPU: 40 answers and 100 refusals (10 answers' worth)
    assert cost.per_request == pytest.approx(0.001)
    for _ in range(10):
        cost.answer()
    for _ in range(400):
        gate.refused(0.15)
    cost.sample(0.2, 0.1)  # 50 ms: 10 answers and 400 refusals, each costing half an answer
    assert cost.per_request == pytest.approx(0.001)  # not 1.25 ms
    assert cost.wait(30) == pytest.approx(0.030)


def test_an_answer_resumes_the_connection_paused_last() -> None:
    """Paused connections come back as answers free room, newest first (its request, if it
    sent one, has waited least); each resume runs once, however it is reached; and none
    while the requests arriving are refused (they take the room)."""
    gate = Gate(GateSettings())
    resumed: list[str] = []
    for name in ("a", "b", "c"):
        gate.hold(lambda name=name: resumed.append(name) is None)  # type: ignore[misc]
    gate.answered()
    gate.answered()
    assert resumed == ["c", "b"]
    assert gate.loop_cost.answered == 2
    gate.answered()
    gate.answered()  # nothing held: only counted
    assert resumed == ["c", "b", "a"]
    gate.hold(lambda: False)  # resumed already, by its timer
    gate.hold(lambda: resumed.append("d") is None)
    gate.hold(lambda: False)
    gate.answered()  # skips the stale resume on top, resumes "d"
    assert resumed == ["c", "b", "a", "d"] and len(gate.held) == 1  # the stale one below
    gate.hold(lambda: resumed.append("e") is None)
    gate.refused(0.0)  # requests arriving are refused: they take the room answers free
    gate.answered()
    assert resumed == ["c", "b", "a", "d"] and gate.full
    gate.let_through(0.0)  # one was let through: the next answer's room is the paused one's
    gate.answered()
    assert resumed == ["c", "b", "a", "d", "e"] and not gate.full
    with pytest.raises(ValueError, match="pause_share"):
        GateSettings(pause_share=1.5)
