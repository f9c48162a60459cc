"""T(B), a model's service time per batch size: the line a + b·B fitted to measured times.

The one form of T(B) that the server's live profile (`core/slo.py`), `lockgate profile` and
`lockgate plan` share: the live profile fits its averages with `fit_line`, and a measured
profile is a `ServiceTime`, saved as JSON and read back by the planner.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from lockgate.errors import BadRequest


@dataclass(frozen=True, slots=True)
class ServiceTime:
    """Median service time per batch size, the least-squares line T(B) = a + b B, and the
    fixed overhead outside the model instance."""

    model: str
    batch_sizes: tuple[int, ...]
    median_s: tuple[float, ...]
    a_s: float
    b_s: float
    r2: float
    overhead_s: float = 0.0  # round trip minus compute: paid by every request, queues nowhere

    def service_time(self, batch: int) -> float:
        return self.a_s + self.b_s * batch

    @property
    def max_batch_size(self) -> int:
        return max(self.batch_sizes)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object], source: str = "profile") -> ServiceTime:
        try:
            sizes = tuple(int(b) for b in data["batch_sizes"])  # type: ignore[attr-defined]
            medians = tuple(float(t) for t in data["median_s"])  # type: ignore[attr-defined]
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"{source}: needs 'batch_sizes' and 'median_s' lists: {exc}") from exc
        try:
            overhead = float(data.get("overhead_s", 0.0))  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"{source}: 'overhead_s' must be a number: {exc}") from exc
        return fit_service_time(str(data.get("model", "")), sizes, medians, overhead)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ServiceTime:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BadRequest(f"cannot read profile {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise BadRequest(f"{path}: a profile is a JSON object")
        return cls.from_json(data, str(path))


def fit_service_time(
    model: str, batch_sizes: tuple[int, ...], median_s: tuple[float, ...], overhead_s: float = 0.0
) -> ServiceTime:
    """Least-squares fit of T(B) = a + b B with a, b >= 0, and R^2 (1.0 when the line is exact).

    A service time neither starts below zero nor falls as the batch grows; a noisy profile
    whose unconstrained line does either gets the best line on the boundary instead.
    """
    if len(batch_sizes) != len(median_s) or not batch_sizes:
        raise BadRequest("a profile needs one median time per batch size, and at least one")
    if min(batch_sizes) < 1 or min(median_s) <= 0:
        raise BadRequest("batch sizes must be >= 1 and times > 0")
    if not 0 <= overhead_s < float("inf"):
        raise BadRequest(f"overhead must be a finite time >= 0, got {overhead_s}")
    x = np.asarray(batch_sizes, dtype=np.float64)  # [n]
    y = np.asarray(median_s, dtype=np.float64)  # [n]
    a, b = fit_line(x.tolist(), y.tolist())
    residual = float(np.sum((y - (a + b * x)) ** 2))
    spread = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - residual / spread if spread > 0 else 1.0
    return ServiceTime(
        model, tuple(batch_sizes), tuple(median_s), float(a), float(b), r2, overhead_s
    )


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(a, b) minimizing sum (y - a - b x)^2 subject to a, b >= 0; xs, ys: [n], x >= 1.

    In closed form, in Python floats: the live profile refits its few points every 64
    batches and for each of traffic's first batches at a size, on the event loop, where
    numpy's `lstsq` on arrays made for it took about 110 µs a refit, and this about 3 µs."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    flat = (mean_y, 0.0)  # the best line with b = 0
    spread_x = sum((u - mean_x) ** 2 for u in xs)
    if spread_x == 0:  # one size: no slope to fit
        return flat
    b = sum((u - mean_x) * (v - mean_y) for u, v in zip(xs, ys, strict=True)) / spread_x
    a = mean_y - b * mean_x
    if a >= 0 and b >= 0:
        return a, b
    through_origin = (0.0, sum(u * v for u, v in zip(xs, ys, strict=True)) / sum(u * u for u in xs))

    def squared_error(ab: tuple[float, float]) -> float:
        return sum((v - ab[0] - ab[1] * u) ** 2 for u, v in zip(xs, ys, strict=True))

    return min(flat, through_origin, key=squared_error)  # the best line with a = 0
