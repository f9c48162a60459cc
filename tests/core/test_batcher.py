"""The dynamic batcher in-process, with a backend whose service time is T(B) = a + b·B."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from lockgate.backends.base import Arrays
from lockgate.config import DynamicBatching, ModelConfig, TensorSpec
from lockgate.core.admission import AdmissionSettings
from lockgate.core.batcher import Batcher, NextTurn, signature
from lockgate.core.metrics import Registry
from lockgate.core.request import InferRequest
from lockgate.core.runner import Instance
from lockgate.core.serving_metrics import ServingMetrics
from lockgate.core.slo import ServiceProfile
from lockgate.errors import BackendError, DeadlineExceeded, Unavailable


@dataclass
class TimedBackend:
    """Doubles `x`; sleeps a + b·rows per batch; records every batch's `x`; can be held shut."""

    a: float = 0.002
    b: float = 0.0005
    fail_on: float | None = None  # raise when a batch holds this value
    batches: list[np.ndarray] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.gate.set()

    def infer(self, inputs: Arrays) -> Arrays:
        self.gate.wait(10)
        x = inputs["x"]  # [rows, width]
        self.batches.append(x.copy())
        time.sleep(self.a + self.b * len(x))
        if self.fail_on is not None and np.any(x == self.fail_on):
            raise RuntimeError(f"cannot take {self.fail_on}")
        return {"y": x * 2}

    def close(self) -> None:
        self.gate.set()

    def seen(self) -> set[float]:
        return {float(v) for batch in self.batches for v in batch[:, 0]}


def make_config(
    max_batch_size: int = 4,
    width: int = 2,
    queue: int = 64,
    levels: int = 1,
    slo_ms: float | None = None,
) -> ModelConfig:
    return ModelConfig(
        name="m",
        backend="python",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec("x", "FP32", (width,)),),
        outputs=(TensorSpec("y", "FP32", (width,)),),
        dynamic_batching=DynamicBatching(max_queue_size=queue, priority_levels=levels),
        latency_slo_ms=slo_ms,
    )


def make_batcher(
    backend: TimedBackend,
    config: ModelConfig,
    profile: ServiceProfile | None = None,
    admission: bool = True,
) -> Batcher:
    instance = Instance("m-1-0", backend)
    return Batcher(
        config,
        1,
        [instance],
        ServingMetrics.create(Registry()),
        profile or ServiceProfile(max(1, config.max_batch_size)),
        AdmissionSettings(deadline_aware=admission),
    )


def request(value: float, rows: int = 1, width: int = 2, **kwargs: object) -> InferRequest:
    x = np.full((rows, width), value, dtype=np.float32)  # [rows, width]
    return InferRequest(model="m", inputs={"x": x}, rows=rows, **kwargs)  # type: ignore[arg-type]


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))


async def settle(batcher: Batcher) -> None:
    """Let the batcher hand its queue to the (blocked) instance."""
    for _ in range(5):
        await asyncio.sleep(0.01)


async def closing(batcher: Batcher, body: Callable[[], Awaitable[None]]) -> None:
    batcher.start()
    try:
        await body()
    finally:
        for instance in batcher.instances:
            instance.backend.close()
        await batcher.close()


def test_batches_respect_the_cap_and_outputs_go_back_to_their_requests() -> None:
    backend = TimedBackend()
    batcher = make_batcher(backend, make_config(max_batch_size=4))

    async def body() -> None:
        rows = [1 + i % 3 for i in range(30)]  # requests of 1, 2 and 3 rows
        results = await asyncio.gather(
            *(batcher.submit(request(float(i), rows=r)) for i, r in enumerate(rows))
        )
        for i, (r, result) in enumerate(zip(rows, results, strict=True)):
            assert result["y"].shape == (r, 2)
            assert np.all(result["y"] == 2.0 * i), f"request {i} got another request's rows"
        sizes = [len(b) for b in backend.batches]
        assert max(sizes) <= 4
        assert sum(sizes) == sum(rows)  # a request of k rows counts as k
        assert max(sizes) == 4  # batches grew while the instance was busy
        assert batcher.queued_rows == 0 and batcher._inflight == 0

    run(lambda: closing(batcher, body))


def test_slo_is_the_default_deadline() -> None:
    """Without a deadline of its own, a request that waits past the SLO gets 504, not a late
    answer, and never reaches the model."""
    backend = TimedBackend(a=0.001, b=0.0005)
    profile = ServiceProfile(8)
    profile.observe(1, 0.0015)
    batcher = make_batcher(backend, make_config(max_batch_size=8, slo_ms=50.0), profile)

    async def body() -> None:
        backend.gate.clear()
        first = asyncio.ensure_future(batcher.submit(request(1.0)))
        await settle(batcher)
        second = asyncio.ensure_future(batcher.submit(request(2.0)))
        await asyncio.sleep(0.1)  # past the SLO while the instance is stuck
        assert second.done()
        with pytest.raises(DeadlineExceeded):
            second.result()
        backend.gate.set()
        await first
        assert 2.0 not in backend.seen()

    run(lambda: closing(batcher, body))


def test_request_larger_than_free_space_waits_for_the_next_batch() -> None:
    backend = TimedBackend()
    backend.gate.clear()
    batcher = make_batcher(backend, make_config(max_batch_size=4))

    async def body() -> None:
        first = asyncio.ensure_future(batcher.submit(request(0.0)))
        await settle(batcher)  # the instance holds request 0
        rest = [asyncio.ensure_future(batcher.submit(request(v, rows=3))) for v in (1.0, 2.0)]
        await settle(batcher)
        backend.gate.set()
        await asyncio.gather(first, *rest)
        assert [len(b) for b in backend.batches] == [1, 3, 3]

    run(lambda: closing(batcher, body))


def test_only_same_shape_requests_share_a_batch() -> None:
    backend = TimedBackend()
    backend.gate.clear()
    config = make_config(max_batch_size=8, width=-1)
    batcher = make_batcher(backend, config)

    async def body() -> None:
        hold = asyncio.ensure_future(batcher.submit(request(0.0)))
        await settle(batcher)
        widths = [2, 3, 2, 3, 2, 5]
        pending = [
            asyncio.ensure_future(batcher.submit(request(float(i + 1), width=w)))
            for i, w in enumerate(widths)
        ]
        await settle(batcher)
        backend.gate.set()
        results = await asyncio.gather(hold, *pending)
        for i, w in enumerate(widths):
            assert results[i + 1]["y"].shape == (1, w)
        shapes = sorted(b.shape for b in backend.batches[1:])
        assert shapes == [(1, 5), (2, 3), (3, 2)]

    run(lambda: closing(batcher, body))


def test_ragged_inputs_leave_their_shapes_out_of_a_signature() -> None:
    """For a model that takes each request on its own, an input with `allow_ragged_batch` may
    differ in shape within a batch; its datatype, and every other input's shape, may not."""
    narrow, wide = request(1.0, width=2), request(2.0, width=5)
    assert signature(narrow, True) != signature(wide, True)
    assert signature(narrow, True, frozenset({"x"})) == signature(wide, True, frozenset({"x"}))
    assert signature(narrow, True, frozenset({"other"})) != signature(wide, True)
    ints = InferRequest(model="m", inputs={"x": np.zeros((1, 2), dtype=np.int32)})
    assert signature(ints, True, frozenset({"x"})) != signature(narrow, True, frozenset({"x"}))


def test_higher_priority_runs_first() -> None:
    backend = TimedBackend()
    backend.gate.clear()
    batcher = make_batcher(backend, make_config(max_batch_size=1, levels=3))

    async def body() -> None:
        hold = asyncio.ensure_future(batcher.submit(request(0.0, priority=1)))
        await settle(batcher)
        order = [(1.0, 3), (2.0, 2), (3.0, 1), (4.0, 3), (5.0, 1)]
        pending = [asyncio.ensure_future(batcher.submit(request(v, priority=p))) for v, p in order]
        await asyncio.sleep(0)
        backend.gate.set()
        await asyncio.gather(hold, *pending)
        served = [float(b[0, 0]) for b in backend.batches[1:]]
        assert served == [3.0, 5.0, 2.0, 1.0, 4.0]

    run(lambda: closing(batcher, body))


def test_full_queue_sheds_lower_priority_then_refuses_with_retry_after() -> None:
    backend = TimedBackend()
    backend.gate.clear()
    batcher = make_batcher(backend, make_config(max_batch_size=1, queue=2, levels=2))

    async def body() -> None:
        hold = asyncio.ensure_future(batcher.submit(request(0.0)))
        await settle(batcher)
        low = [asyncio.ensure_future(batcher.submit(request(v, priority=2))) for v in (1.0, 2.0)]
        await asyncio.sleep(0)
        high = asyncio.ensure_future(batcher.submit(request(3.0, priority=1)))
        await asyncio.wait([low[1]], timeout=1)
        assert low[1].done()  # the newest low-priority request made room
        with pytest.raises(Unavailable, match="shed"):
            low[1].result()
        with pytest.raises(Unavailable, match="full") as full:
            await batcher.submit(request(4.0, priority=2))  # nothing lower to shed
        assert full.value.retry_after is not None and full.value.retry_after >= 1
        assert full.value.status == 503 and "retry-after" in full.value.headers()
        backend.gate.set()
        await asyncio.gather(hold, low[0], high)
        assert backend.seen() == {0.0, 1.0, 3.0}
        assert [float(b[0, 0]) for b in backend.batches] == [0.0, 3.0, 1.0]

    run(lambda: closing(batcher, body))


def test_deadline_answers_504_at_the_deadline_and_never_runs() -> None:
    backend = TimedBackend()
    backend.gate.clear()
    batcher = make_batcher(backend, make_config(max_batch_size=1))

    async def body() -> None:
        hold = asyncio.ensure_future(batcher.submit(request(0.0)))
        await settle(batcher)
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded) as expired:
            await batcher.submit(request(7.0, deadline=start + 0.05))
        late = time.monotonic() - start - 0.05
        assert 0 <= late < 0.03, f"answered {late * 1000:.1f} ms after the deadline"
        assert expired.value.status == 504
        assert batcher.queued_rows == 0
        backend.gate.set()
        await hold
        await batcher.submit(request(8.0))
        assert 7.0 not in backend.seen()

    run(lambda: closing(batcher, body))


def test_cancelled_request_leaves_the_queue_and_frees_its_slot() -> None:
    backend = TimedBackend()
    backend.gate.clear()
    batcher = make_batcher(backend, make_config(max_batch_size=1, queue=1))

    async def body() -> None:
        hold = asyncio.ensure_future(batcher.submit(request(0.0)))
        await settle(batcher)
        queued = asyncio.ensure_future(batcher.submit(request(5.0)))
        await asyncio.sleep(0)
        assert batcher.queued_rows == 1
        with pytest.raises(Unavailable):
            await batcher.submit(request(6.0))  # the one slot is taken
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert batcher.queued_rows == 0 and batcher._inflight == 1
        replacement = asyncio.ensure_future(batcher.submit(request(6.0)))
        await asyncio.sleep(0)
        backend.gate.set()
        await asyncio.gather(hold, replacement)
        assert backend.seen() == {0.0, 6.0}
        assert batcher._inflight == 0

    run(lambda: closing(batcher, body))


def test_backend_exception_fails_only_its_batch() -> None:
    backend = TimedBackend(fail_on=13.0)
    batcher = make_batcher(backend, make_config(max_batch_size=1))

    async def body() -> None:
        values = [float(v) for v in range(10, 17)]
        results = await asyncio.gather(
            *(batcher.submit(request(v)) for v in values), return_exceptions=True
        )
        for value, result in zip(values, results, strict=True):
            if value == 13.0:
                assert isinstance(result, BackendError) and result.status == 500
                assert "cannot take 13" in result.message
            else:
                assert isinstance(result, dict) and float(result["y"][0, 0]) == 2 * value
        assert await batcher.submit(request(20.0))  # the model serves on

    run(lambda: closing(batcher, body))


def test_wrong_output_rows_is_a_clear_backend_error() -> None:
    class Truncating(TimedBackend):
        def infer(self, inputs: Arrays) -> Arrays:
            return {"y": super().infer(inputs)["y"][:1]}

    backend = Truncating()
    backend.gate.clear()
    batcher = make_batcher(backend, make_config(max_batch_size=4))

    async def body() -> None:
        hold = asyncio.ensure_future(batcher.submit(request(0.0)))
        await settle(batcher)
        pair = [asyncio.ensure_future(batcher.submit(request(v))) for v in (1.0, 2.0)]
        await asyncio.sleep(0)
        backend.gate.set()
        await hold
        for future in pair:
            with pytest.raises(BackendError, match="batch dimension first"):
                await future

    run(lambda: closing(batcher, body))


def test_each_queued_request_answers_504_at_its_own_deadline() -> None:
    """Deadlines that come in any order: each request expires at its own, a later one is not
    expired with an earlier one, and one answered before its deadline never expires."""
    backend = TimedBackend()
    backend.gate.clear()
    batcher = make_batcher(backend, make_config(max_batch_size=1), admission=False)

    async def body() -> None:
        hold = asyncio.ensure_future(batcher.submit(request(0.0)))
        await settle(batcher)
        start = time.monotonic()
        offsets = {1.0: 0.15, 2.0: 0.05, 3.0: 0.10}
        waits = {
            v: asyncio.ensure_future(batcher.submit(request(v, deadline=start + d)))
            for v, d in offsets.items()
        }
        answered: dict[float, float] = {}
        for value, task in waits.items():
            task.add_done_callback(lambda _, v=value: answered.setdefault(v, time.monotonic()))
        with pytest.raises(DeadlineExceeded):
            await waits[1.0]
        for value, offset in offsets.items():
            assert isinstance(waits[value].exception(), DeadlineExceeded)
            late = answered[value] - start - offset
            assert 0 <= late < 0.03, f"{value}: answered {late * 1000:.1f} ms after its deadline"
        assert batcher.queued_rows == 0
        backend.gate.set()
        await hold
        far = time.monotonic() + 60
        for value in range(200):  # answered well before their deadline: none kept watched
            await batcher.submit(request(float(value), deadline=far))
        assert len(batcher._deadlines) <= 2 * batcher._inflight + 65

    run(lambda: closing(batcher, body))


def test_unmeetable_deadline_is_refused_at_admission() -> None:
    backend = TimedBackend(a=0.02, b=0.0)
    backend.gate.clear()
    profile = ServiceProfile(1)
    profile.observe(1, 0.02)
    batcher = make_batcher(backend, make_config(max_batch_size=1), profile)

    async def body() -> None:
        hold = asyncio.ensure_future(batcher.submit(request(0.0)))
        await settle(batcher)
        queued = [asyncio.ensure_future(batcher.submit(request(float(v)))) for v in (1, 2, 3)]
        await asyncio.sleep(0)
        start = time.monotonic()
        with pytest.raises(Unavailable, match="would miss its deadline") as refused:
            # three 20 ms batches wait ahead of it: 50 ms cannot be met
            await batcher.submit(request(9.0, deadline=start + 0.05))
        assert time.monotonic() - start < 0.005  # refused at once, not at the deadline
        assert refused.value.retry_after is not None
        ok = asyncio.ensure_future(batcher.submit(request(8.0, deadline=start + 5.0)))
        backend.gate.set()
        await asyncio.gather(hold, ok, *queued)
        assert 9.0 not in backend.seen()

    run(lambda: closing(batcher, body))


def test_request_that_would_end_past_its_deadline_is_not_run() -> None:
    backend = TimedBackend(a=0.05, b=0.0)
    backend.gate.clear()
    profile = ServiceProfile(1)
    profile.observe(1, 0.05)
    batcher = make_batcher(backend, make_config(max_batch_size=1), profile)

    async def body() -> None:
        hold = asyncio.ensure_future(batcher.submit(request(0.0)))
        await settle(batcher)
        start = time.monotonic()
        late = asyncio.ensure_future(batcher.submit(request(1.0, deadline=start + 0.25)))
        await asyncio.sleep(0.17)  # admitted; the held batch ends at ~0.22 s, 30 ms before
        backend.gate.set()  # the deadline: too little for a 50 ms batch
        with pytest.raises(DeadlineExceeded, match="would end after its deadline"):
            await late
        assert time.monotonic() - start < 0.25  # told before the deadline, not after
        await hold
        assert 1.0 not in backend.seen()

    run(lambda: closing(batcher, body))


def test_without_admission_a_late_request_still_runs() -> None:
    backend = TimedBackend(a=0.02, b=0.0)
    profile = ServiceProfile(1)
    profile.observe(1, 0.02)
    batcher = make_batcher(backend, make_config(max_batch_size=1), profile, admission=False)

    async def body() -> None:
        result = await batcher.submit(request(1.0, deadline=time.monotonic() + 0.015))
        assert float(result["y"][0, 0]) == 2.0  # ran: the deadline passed during compute

    run(lambda: closing(batcher, body))


def test_the_cap_and_window_follow_every_change_of_the_profile() -> None:
    """The cap, the capacity and the window's terms are derived once per profile version:
    a batch that changes the profile changes them at once, as if derived afresh."""
    profile = ServiceProfile(32)
    for size in (1, 2, 4, 8, 16, 32):
        profile.observe(size, 0.0001 + 0.00005 * size)
    batcher = make_batcher(TimedBackend(), make_config(max_batch_size=32, slo_ms=20.0), profile)
    budget = 0.020 * AdmissionSettings().slack
    now = time.monotonic()
    assert batcher.cap_and_window(now)[0] == 32
    for _ in range(40):  # batches of 32 now take 20 ms: the scale follows, the cap falls
        now += 0.05
        profile.observe(32, 0.020, now)
        cap = batcher.cap_and_window(now)[0]
        assert cap == profile.batch_cap(budget)
        assert batcher.queue_state(1, now).capacity == pytest.approx(profile.throughput(cap))
    assert cap < 32
    batcher.rate.add(100_000, now)  # arrivals T(1) cannot keep up with: a window opens
    window = profile.window(budget, batcher.rate.current(now), profile.batch_cap(budget))
    assert batcher.cap_and_window(now)[1] == window > 0


def test_slo_mode_caps_batches_at_the_profile_cap() -> None:
    backend = TimedBackend(a=0.001, b=0.0005)
    profile = ServiceProfile(32)
    for size in (1, 2, 4, 8, 16, 32):
        profile.observe(size, 0.001 + 0.0005 * size)
    batcher = make_batcher(backend, make_config(max_batch_size=32, slo_ms=20.0), profile)
    cap, _ = batcher.cap_and_window(time.monotonic())
    # a full batch behind a full batch is still within admission's share of the SLO
    assert cap == profile.batch_cap(0.020 * AdmissionSettings().slack) < 32
    assert 2 * profile.service_time(cap) <= 0.8 * 0.020 < 2 * profile.service_time(cap + 1)
    wider = replace(make_config(max_batch_size=32, slo_ms=20.0), admission_slack=1.0)
    loose = make_batcher(backend, wider, profile)  # the model's own share
    assert loose.admission.settings.slack == 1.0
    assert loose.cap_and_window(time.monotonic())[0] == profile.batch_cap(0.020) > cap

    async def body() -> None:
        backend.gate.clear()
        late = time.monotonic() + 60  # a deadline of their own: the SLO default would expire them
        pending = [
            asyncio.ensure_future(batcher.submit(request(float(i), deadline=late)))
            for i in range(60)
        ]
        await settle(batcher)
        backend.gate.set()
        await asyncio.gather(*pending)
        assert max(len(b) for b in backend.batches) == cap

    run(lambda: closing(batcher, body))


@dataclass
class CheapBackend:
    """Native-looking (inline_safe) and cheap: records on which thread each batch ran."""

    inline_safe = True
    threads: list[str] = field(default_factory=list)

    def infer(self, inputs: Arrays) -> Arrays:
        self.threads.append(threading.current_thread().name)
        return {"y": inputs["x"] * 2}

    def close(self) -> None:
        pass


def test_only_inputs_no_bigger_than_timed_ones_run_on_the_loop() -> None:
    """A cheap model runs small batches inline once one of that size was timed on its thread;
    a one-row request with a far bigger dynamic dimension goes back to the thread."""
    backend = CheapBackend()
    config = make_config(max_batch_size=4, width=-1)
    batcher = Batcher(
        config,
        1,
        [Instance("m-1-0", backend)],
        ServingMetrics.create(Registry()),
        ServiceProfile(4),
        AdmissionSettings(),
    )
    loop_thread = threading.current_thread().name

    async def body() -> None:
        for _ in range(3):
            await batcher.submit(request(1.0, width=8))
        await batcher.submit(request(1.0, width=100_000))  # one row, 400 kB
        await batcher.submit(request(1.0, width=8))

    run(lambda: closing(batcher, body))
    assert backend.threads[0] != loop_thread  # first of its size: timed on the thread
    assert backend.threads[1] == loop_thread and backend.threads[2] == loop_thread
    assert backend.threads[3] != loop_thread  # the big one
    assert backend.threads[4] == loop_thread


def test_an_early_refusal_is_reused_only_until_a_batch_starts_or_ends() -> None:
    backend = TimedBackend(a=0.05, b=0.0)
    backend.gate.clear()
    profile = ServiceProfile(1)
    profile.observe(1, 0.05)
    batcher = make_batcher(backend, make_config(max_batch_size=1, slo_ms=20), profile)

    async def body() -> None:
        far = time.monotonic() + 10
        held = [asyncio.ensure_future(batcher.submit(request(v, deadline=far))) for v in (0, 1)]
        await settle(batcher)
        t0 = time.monotonic()
        first = batcher.early_refusal(t0, None, t0)
        assert first is not None and "would miss its deadline" in first.message
        assert batcher.early_refusal(t0, None, t0 + 0.0005) is first  # reused within 1 ms
        assert batcher.early_refusal(t0, None, t0 + 0.0011) is not first  # predicted anew
        assert batcher.early_refusal(t0, 5.0, t0 + 0.0001) is None  # another budget: its own
        again = batcher.early_refusal(t0, None, t0 + 0.0012)
        assert again is not None
        backend.gate.set()
        await held[0]  # a batch ended and the queued one started: the refusal is not reused
        assert batcher.early_refusal(t0, None, t0 + 0.0013) is not again
        await held[1]

    run(lambda: closing(batcher, body))


def test_an_idle_model_refuses_early_only_for_the_loop_work_ahead() -> None:
    """Idle, a model admits a request under its SLO default whatever the prediction; with the
    event loop's work ahead of its handler (requests in progress), the wait counts."""
    profile = ServiceProfile(1)
    profile.observe(1, 0.002)
    batcher = make_batcher(CheapBackend(), make_config(max_batch_size=1, slo_ms=50), profile)
    now = time.monotonic()
    assert batcher.early_refusal(now, None, now) is None  # idle, nothing ahead
    assert batcher.early_refusal(now, None, now, loop_wait=0.010) is None  # fits 50 ms
    late = batcher.early_refusal(now, None, now, loop_wait=0.045)  # 45 + 2 ms > 80% of 50
    assert late is not None and "would miss its deadline" in late.message
    assert batcher.early_refusal(now, 1.0, now + 0.002, loop_wait=0.045) is None  # 1 s budget


def test_an_early_admission_with_room_is_not_given_to_a_request_that_waited() -> None:
    """An early admission predicted well inside its budget is reused for a millisecond, but
    not for a request whose time already spent (say, behind a paused connection) uses up the
    room: that one is predicted again, and refused; and that refusal is not given to the
    fresh request after it."""
    profile = ServiceProfile(1)
    profile.observe(1, 0.002)
    batcher = make_batcher(CheapBackend(), make_config(max_batch_size=1, slo_ms=50), profile)
    now = time.monotonic()
    assert batcher.early_refusal(now, None, now, loop_wait=0.010) is None  # 12 ms of 50
    assert batcher.early_refusal(now, None, now + 0.0002, loop_wait=0.012) is None
    waited = batcher.early_refusal(now - 0.040, None, now + 0.0003, loop_wait=0.010)
    assert waited is not None and "would miss its deadline" in waited.message
    assert batcher.early_refusal(now, None, now + 0.0004, loop_wait=0.010) is None  # fresh
    assert batcher.early_refusal(now - 0.041, None, now + 0.0005, loop_wait=0.010) is waited


@dataclass
class CountingCheapBackend(CheapBackend):
    """CheapBackend that also records each batch's rows."""

    sizes: list[int] = field(default_factory=list)

    def infer(self, inputs: Arrays) -> Arrays:
        self.sizes.append(len(inputs["x"]))
        return super().infer(inputs)


def cheap_batcher(backend: CountingCheapBackend) -> Batcher:
    """A batcher of up to 8 rows with a 50 ms SLO over a model profiled at 20 µs a row."""
    profile = ServiceProfile(8)
    for rows in (1, 2, 4, 8):
        profile.observe(rows, 0.00002 * rows)
    return Batcher(
        make_config(max_batch_size=8, slo_ms=50),
        1,
        [Instance("m-1-0", backend)],
        ServingMetrics.create(Registry()),
        profile,
        AdmissionSettings(),
    )


def test_requests_of_one_loop_turn_share_an_inline_batch_with_no_window() -> None:
    """With no window to wait for (an SLO at light load), a model cheap enough for the loop
    still batches: requests submitted in the same turn of the event loop form one batch on
    the next turn while turns gather company, and a request alone is not held for company:
    once a turn has gathered nobody, the next runs at once."""
    backend = CountingCheapBackend()
    batcher = cheap_batcher(backend)
    loop_thread = threading.current_thread().name

    async def body() -> None:
        for rows in range(1, 9):  # each size timed once on the thread: then it may run inline
            await batcher.submit(request(0.0, rows=rows))
        assert batcher.cap_and_window(time.monotonic())[1] == 0.0  # no window
        backend.sizes.clear()
        backend.threads.clear()
        started = time.monotonic()
        await batcher.submit(request(1.0))  # alone: runs on the next turn, not after a window
        assert time.monotonic() - started < 0.005
        assert backend.sizes == [1]
        assert batcher.next_turn.company < batcher.next_turn.least_company  # it found nobody
        batcher.next_turn.measured = time.monotonic()  # (a slow machine may take 50 ms here)
        await batcher.submit(request(1.0))  # so the next one alone runs at once
        assert backend.sizes == [1, 1]
        batcher.next_turn.company = 6.0  # turns gather company under load
        answers = await asyncio.gather(*(batcher.submit(request(float(v))) for v in range(6)))
        assert backend.sizes == [1, 1, 6]  # one batch for the six submitted in one turn
        assert [float(a["y"][0, 0]) for a in answers] == [2.0 * v for v in range(6)]
        assert set(backend.threads) == {loop_thread}

    run(lambda: closing(batcher, body))


def test_requests_handed_over_in_one_turn_run_in_one_batch_sent_by_the_last() -> None:
    """While a loop busy with refusals makes the next turn too late to wait for, requests the
    front end handed over together (`Arriving`) still share one inline batch: each is
    queued until the last of them reaches the batcher, which runs it at once. Without that
    count each runs alone. A last request refused at admission sends the others' batch
    before its refusal returns; one that never reaches the batcher leaves them to the
    batcher's task on the next turn."""
    backend = CountingCheapBackend()
    batcher = cheap_batcher(backend)
    loop_thread = threading.current_thread().name
    arriving = batcher.arriving

    def busy_loop() -> None:  # turns measured long: the next one is not waited for
        batcher.next_turn.wait, batcher.next_turn.measured = 0.040, time.monotonic()

    async def handler(value: float, reaches: bool = True, **kwargs: object) -> object:
        arriving.started("m")  # as the lane's task does first
        if not reaches:
            return None
        return await batcher.submit(request(value, **kwargs))

    async def body() -> None:
        for rows in range(1, 9):  # each size timed once on the thread: then it may run inline
            await batcher.submit(request(0.0, rows=rows))
        backend.sizes.clear()
        backend.threads.clear()
        busy_loop()
        await asyncio.gather(*(batcher.submit(request(float(v))) for v in range(5)))
        assert backend.sizes == [1, 1, 1, 1, 1]  # not counted: one batch each
        backend.sizes.clear()
        busy_loop()
        for _ in range(5):
            arriving.add("m")
        answers = await asyncio.gather(*(handler(float(v)) for v in range(5)))
        assert backend.sizes == [5]
        assert [float(a["y"][0, 0]) for a in answers] == [2.0 * v for v in range(5)]  # type: ignore[index]
        assert set(backend.threads) == {loop_thread}
        assert not arriving.pending

        backend.sizes.clear()
        busy_loop()
        for _ in range(4):
            arriving.add("m")
        sizes_at_refusal: list[int] = []

        async def refused_last() -> None:
            try:
                await handler(9.0, deadline=time.monotonic() - 1.0)
            except DeadlineExceeded:
                sizes_at_refusal.extend(backend.sizes)

        results = await asyncio.gather(
            *(handler(float(v)) for v in range(3)), refused_last(), return_exceptions=True
        )
        assert sizes_at_refusal == [3]  # sent before the refusal returned
        assert not any(isinstance(r, BaseException) for r in results)

        backend.sizes.clear()
        busy_loop()
        for _ in range(3):
            arriving.add("m")
        await asyncio.gather(handler(1.0), handler(2.0), handler(0.0, reaches=False))
        assert backend.sizes == [2]  # by the batcher's task, a turn later
        assert not arriving.pending

    run(lambda: closing(batcher, body))


def test_sizes_warmup_timed_cheap_run_inline_and_bound_a_gathered_batch() -> None:
    """Sizes warmup timed cheap on the thread may run inline from the first request, with
    inputs no bigger than warmup's; a gathered turn runs as batches of at most the largest
    of them, one after another in the same turn; a model that is not inline-safe runs none
    on the loop."""
    backend = CountingCheapBackend()
    batcher = cheap_batcher(backend)  # profiled at 20 µs a row: sizes 1, 2, 4 and 8 are cheap
    batcher.compute.times[8] = 0.001  # but 8 rows were timed at 1 ms: not for the loop
    batcher.warmed({1: 8, 2: 16, 4: 32, 8: 64})
    assert batcher.inline_bytes == {1: 8, 2: 16, 4: 32}
    loop_thread = threading.current_thread().name
    arriving = batcher.arriving

    async def handler(value: float) -> object:
        arriving.started("m")
        return await batcher.submit(request(value))

    async def body() -> None:
        batcher.next_turn.wait, batcher.next_turn.measured = 0.040, time.monotonic()
        for _ in range(10):
            arriving.add("m")
        await asyncio.gather(*(handler(float(v)) for v in range(10)))
        assert backend.sizes == [4, 4, 2]
        assert set(backend.threads) == {loop_thread}

    run(lambda: closing(batcher, body))

    class NotInlineSafe(CountingCheapBackend):
        inline_safe = False

    other = cheap_batcher(NotInlineSafe())
    other.warmed({1: 8})
    assert other.inline_bytes == {}


def test_the_next_turn_is_taken_only_while_turns_are_short() -> None:
    """A turn that kept deferred requests waiting over a tenth of the SLO (a loop busy with a
    storm of refusals) sends the next cheap batch at once; a stale measure is taken again."""
    turn = NextTurn()
    assert not turn.worth_it(0.0, None)  # no SLO: at once, as max_queue_delay_us 0 asks
    assert turn.worth_it(0.0, 0.050)  # nothing measured yet: measure
    turn.deferred(10.0)
    turn.deferred(10.001)  # the oldest deferred request counts
    turn.formed(10.030, 4)  # it waited 30 ms for its batch
    assert turn.wait == pytest.approx(0.3 * 0.030)
    for start in (10.1, 10.2, 10.3):
        turn.deferred(start)
        turn.formed(start + 0.030, 4)
    assert not turn.worth_it(10.4, 0.050)  # about 23 ms on average: over 5 ms
    assert turn.worth_it(10.4, 0.500)  # a tenth of a 500 ms SLO allows it
    assert turn.worth_it(11.5, 0.050)  # over a second old: measured again
    turn.formed(11.6, 1)  # a batch formed with nothing deferred measures nothing
    assert turn.measured == pytest.approx(10.33)


def test_the_next_turn_is_taken_only_while_it_gathers_company() -> None:
    """A client sending one request at a time: the batch formed on the next turn holds its
    request alone, and waiting the turn only costs the loop two more turns; once the batches
    formed there hold nobody else, a cheap batch goes at once, until the measure is stale."""
    turn = NextTurn()
    assert turn.worth_it(10.0, 0.050)  # nothing measured yet: measure
    turn.deferred(10.0)
    turn.formed(10.0001, 1)  # alone
    assert not turn.worth_it(10.03, 0.050)
    assert turn.worth_it(10.06, 0.050)  # a lone batch is measured again after 50 ms
    turn.deferred(10.06)
    turn.formed(10.0601, 1)  # alone again
    assert not turn.worth_it(10.07, 0.050)
    assert turn.worth_it(11.3, 0.050)
    turn.deferred(11.3)
    turn.formed(11.3001, 11)  # 11 requests came in the next turn
    assert turn.company >= turn.least_company
    assert turn.worth_it(11.35, 0.050)


def test_the_queue_state_says_when_a_held_partial_batch_leaves() -> None:
    """Under load an idle instance holds a partial batch for its window: admission is told
    when the window of the oldest request ends, and that nothing is held once the batch is
    full."""
    backend = TimedBackend(a=0.010, b=0.001)
    profile = ServiceProfile(8)
    for size in (1, 2, 4, 8):
        profile.observe(size, 0.010 + 0.001 * size)
    batcher = make_batcher(backend, make_config(max_batch_size=8, slo_ms=200.0), profile)

    async def body() -> None:
        batcher.rate.add(200)  # an arrival rate that opens a window (about 7 ms)
        cap, window = batcher.cap_and_window(time.monotonic())
        assert window > 0.005 and cap >= 4
        first = asyncio.ensure_future(batcher.submit(request(1.0)))
        await asyncio.sleep(0)
        now = time.monotonic()
        state = batcher.queue_state(1, now)
        assert state.rows_ahead == 1 and state.free_at == (now,)
        assert state.opens == pytest.approx(batcher._oldest().arrival + window, abs=1e-3)
        assert now < state.opens
        rest = [asyncio.ensure_future(batcher.submit(request(2.0))) for _ in range(cap - 1)]
        await asyncio.sleep(0)
        assert batcher.queue_state(1, time.monotonic()).opens == 0.0 or batcher.queued_rows == 0
        await asyncio.gather(first, *rest)
        assert len(backend.batches[0]) == cap  # the held batch left full, before its window

    run(lambda: closing(batcher, body))
