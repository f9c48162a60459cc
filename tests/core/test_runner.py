"""Model instances: one thread each, hang detection, restart by reload."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from lockgate.backends.base import Arrays
from lockgate.config import ModelConfig, TensorSpec
from lockgate.core.admission import AdmissionSettings
from lockgate.core.batcher import Batcher
from lockgate.core.metrics import Registry
from lockgate.core.request import InferRequest
from lockgate.core.runner import Instance
from lockgate.core.serving_metrics import ServingMetrics
from lockgate.core.slo import ServiceProfile
from lockgate.errors import Unavailable


class Hanging:
    """Doubles `x`, but blocks (until released) on a batch holding 99."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: set[str] = set()
        self.closed = False

    def infer(self, inputs: Arrays) -> Arrays:
        self.threads.add(threading.current_thread().name)
        if np.any(inputs["x"] == 99):
            self.release.wait(10)
        return {"y": inputs["x"] * 2}

    def close(self) -> None:
        self.closed = True
        self.release.set()


def one(value: float) -> Arrays:
    return {"x": np.full((1, 2), value, dtype=np.float32)}


def test_infer_runs_on_the_instance_thread() -> None:
    backend = Hanging()
    instance = Instance("m-1-0", backend)

    async def body() -> None:
        out = await instance.infer(one(3.0))
        assert float(out["y"][0, 0]) == 6.0

    asyncio.run(body())
    instance.close()
    assert backend.threads == {"lockgate-m-1-0_0"}
    assert backend.closed


def test_hung_instance_is_restarted_and_serves_again() -> None:
    stuck, fresh = Hanging(), Hanging()
    replaced: list[Instance] = []
    instance = Instance(
        "m-1-0", stuck, hang_timeout=0.5, reload=lambda: fresh, on_replaced=replaced.append
    )

    async def body() -> None:
        start = time.monotonic()
        with pytest.raises(Unavailable, match=r"did not answer within 0\.5 s") as hung:
            await instance.infer(one(99.0))
        assert 0.5 <= time.monotonic() - start < 5.0  # the upper bound only catches a hang
        assert hung.value.status == 503 and not instance.healthy
        for _ in range(500):
            if replaced:
                break
            await asyncio.sleep(0.01)
        assert replaced == [instance] and instance.healthy and instance.restarts == 1
        assert instance.backend is fresh
        out = await instance.infer(one(4.0))
        assert float(out["y"][0, 0]) == 8.0

    asyncio.run(body())
    stuck.release.set()
    instance.close()


def test_failed_reload_is_retried_with_backoff_until_it_succeeds() -> None:
    """The instance stays out of service while reloads fail, and serves again once one works;
    the delays between attempts double."""
    attempts: list[float] = []
    fresh = Hanging()

    def reload() -> Hanging:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise RuntimeError("weights are gone")
        return fresh

    instance = Instance("m-1-0", Hanging(), hang_timeout=0.1, reload=reload)
    instance.restart_backoff = 0.1

    async def body() -> None:
        with pytest.raises(Unavailable):
            await instance.infer(one(99.0))
        await asyncio.sleep(0.05)
        assert not instance.healthy and instance.restarts == 0
        for _ in range(500):
            if instance.healthy:
                break
            await asyncio.sleep(0.01)
        assert instance.healthy and instance.restarts == 1 and len(attempts) == 3
        assert attempts[2] - attempts[1] >= 1.5 * (attempts[1] - attempts[0]) * 0.9
        out = await instance.infer(one(4.0))
        assert float(out["y"][0, 0]) == 8.0

    asyncio.run(body())
    instance.close()


def test_closing_stops_the_retries() -> None:
    def reload() -> Hanging:
        raise RuntimeError("weights are gone")

    instance = Instance("m-1-0", Hanging(), hang_timeout=0.1, reload=reload)
    instance.restart_backoff = 0.05

    async def body() -> None:
        with pytest.raises(Unavailable):
            await instance.infer(one(99.0))
        await asyncio.sleep(0.2)
        instance.close()
        await asyncio.sleep(0.1)
        assert instance._restarting is not None and instance._restarting.done()

    asyncio.run(body())


def test_batcher_answers_the_hung_batch_and_serves_later_requests() -> None:
    stuck, fresh = Hanging(), Hanging()
    config = ModelConfig(
        name="m",
        backend="python",
        max_batch_size=4,
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),),
    )
    instance = Instance("m-1-0", stuck, hang_timeout=0.5, reload=lambda: fresh)
    batcher = Batcher(
        config,
        1,
        [instance],
        ServingMetrics.create(Registry()),
        ServiceProfile(4),
        AdmissionSettings(),
    )
    instance.on_replaced = batcher.instance_ready

    def request(value: float) -> InferRequest:
        return InferRequest(model="m", inputs=one(value))

    async def body() -> None:
        batcher.start()
        with pytest.raises(Unavailable, match="restarted"):
            await batcher.submit(request(99.0))
        # queued while the instance restarts, served once it is back
        results = await asyncio.wait_for(
            asyncio.gather(*(batcher.submit(request(float(v))) for v in range(5))), 5
        )
        assert [float(r["y"][0, 0]) for r in results] == [0.0, 2.0, 4.0, 6.0, 8.0]
        assert instance.restarts == 1 and batcher.free == type(batcher.free)([instance])
        await batcher.close()

    asyncio.run(body())
    stuck.release.set()


def test_a_version_whose_instances_all_restart_is_not_serving() -> None:
    from pathlib import Path

    from lockgate.core.manager import ModelState, ServedModel, ServedVersion

    config = ModelConfig(
        name="m",
        backend="python",
        max_batch_size=4,
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),),
    )
    instance = Instance("m-1-0", Hanging())
    batcher = Batcher(
        config,
        1,
        [instance],
        ServingMetrics.create(Registry()),
        ServiceProfile(4),
        AdmissionSettings(),
    )
    served = ServedVersion(config, 1, Path("1"), Path("."), state=ModelState.READY, batcher=batcher)
    model = ServedModel("m", Path("."), config, {1: served})
    assert served.serving and model.latest_ready() is served
    instance.healthy = False  # a hang: restarting
    assert not served.serving and model.latest_ready() is None
    instance.healthy = True
    assert model.latest_ready() is served
    instance.close()
