"""Service-time profile T(B): measure a model at batch sizes 1, 2, 4, ... and fit a + b B.

Two ways to measure: in-process through a callable `infer(batch_size)`, or through a running
server by sending one KServe v2 request of B rows at a time, sequentially. Each batch size is
timed `repeats` times after `warmup` untimed calls, and the median is kept.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lockgate.errors import BadRequest


@dataclass(frozen=True, slots=True)
class ServiceProfile:
    """Median service time per batch size and the least-squares line T(B) = a + b B."""

    model: str
    batch_sizes: tuple[int, ...]
    median_s: tuple[float, ...]
    a_s: float
    b_s: float
    r2: float

    def service_time(self, batch: int) -> float:
        return self.a_s + self.b_s * batch

    @property
    def max_batch_size(self) -> int:
        return max(self.batch_sizes)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object], source: str = "profile") -> ServiceProfile:
        try:
            sizes = tuple(int(b) for b in data["batch_sizes"])  # type: ignore[attr-defined]
            medians = tuple(float(t) for t in data["median_s"])  # type: ignore[attr-defined]
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"{source}: needs 'batch_sizes' and 'median_s' lists: {exc}") from exc
        return fit_profile(str(data.get("model", "")), sizes, medians)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ServiceProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BadRequest(f"cannot read profile {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise BadRequest(f"{path}: a profile is a JSON object")
        return cls.from_json(data, str(path))


def fit_profile(
    model: str, batch_sizes: tuple[int, ...], median_s: tuple[float, ...]
) -> ServiceProfile:
    """Least-squares fit of T(B) = a + b B, with R^2 (1.0 when the line is exact)."""
    if len(batch_sizes) != len(median_s) or not batch_sizes:
        raise BadRequest("a profile needs one median time per batch size, and at least one")
    if min(batch_sizes) < 1 or min(median_s) <= 0:
        raise BadRequest("batch sizes must be >= 1 and times > 0")
    x = np.asarray(batch_sizes, dtype=np.float64)  # [n]
    y = np.asarray(median_s, dtype=np.float64)  # [n]
    if len(set(batch_sizes)) == 1:
        a, b = float(y.mean()), 0.0
    else:
        design = np.stack([np.ones_like(x), x], axis=1)  # [n, 2]
        (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = float(np.sum((y - (a + b * x)) ** 2))
    spread = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - residual / spread if spread > 0 else 1.0
    return ServiceProfile(model, tuple(batch_sizes), tuple(median_s), float(a), float(b), r2)


def batch_sizes_up_to(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_batch_size, which is always included."""
    if max_batch_size < 1:
        raise BadRequest(f"max batch size must be >= 1, got {max_batch_size}")
    sizes = [1]
    while sizes[-1] * 2 <= max_batch_size:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return tuple(sizes)


def profile_callable(
    infer: Callable[[int], None],
    max_batch_size: int,
    *,
    repeats: int = 5,
    warmup: int = 1,
    model: str = "",
) -> ServiceProfile:
    """Time `infer(B)` in-process for each batch size; median of `repeats` runs."""
    medians = []
    for batch in batch_sizes_up_to(max_batch_size):
        for _ in range(warmup):
            infer(batch)
        samples = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            infer(batch)
            samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples))
    return fit_profile(model, batch_sizes_up_to(max_batch_size), tuple(medians))


def profile_server(
    url: str,
    model: str,
    max_batch_size: int,
    *,
    version: str | None = None,
    repeats: int = 5,
    warmup: int = 1,
    timeout_s: float = 60.0,
    seed: int = 0,
) -> ServiceProfile:
    """Time one B-row v2 request at a time against a running server, for each batch size."""
    return asyncio.run(
        _profile_server(url, model, max_batch_size, version, repeats, warmup, timeout_s, seed)
    )


async def _profile_server(
    url: str,
    model: str,
    max_batch_size: int,
    version: str | None,
    repeats: int,
    warmup: int,
    timeout_s: float,
    seed: int,
) -> ServiceProfile:
    import aiohttp

    from lockgate.bench.workload import V2Target, fetch_v2_metadata, synthesize_v2_body

    target = V2Target(url, model, version)
    rng = np.random.default_rng(seed)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    medians = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        metadata = await fetch_v2_metadata(session, target)
        for batch in batch_sizes_up_to(max_batch_size):
            body = synthesize_v2_body(metadata, batch, rng)
            for _ in range(warmup):
                await _post_once(session, target.infer_url, body)
            samples = []
            for _ in range(max(1, repeats)):
                start = time.perf_counter()
                await _post_once(session, target.infer_url, body)
                samples.append(time.perf_counter() - start)
            medians.append(statistics.median(samples))
    return fit_profile(model, batch_sizes_up_to(max_batch_size), tuple(medians))


async def _post_once(session: object, url: str, body: bytes) -> None:
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    headers = {"content-type": "application/json"}
    try:
        async with session.post(url, data=body, headers=headers) as response:
            payload = await response.read()
            if response.status != 200:
                text = payload.decode(errors="replace")[:200]
                raise BadRequest(f"{url} answered {response.status}: {text}")
    except aiohttp.ClientError as exc:
        raise BadRequest(f"cannot reach {url}: {exc}") from exc
