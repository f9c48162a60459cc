"""overload_real's verdicts (benchmarks/overload_real.py), from levels made here."""

from __future__ import annotations

from benchmarks.overload_real import Curve, Level


def level(name: str, factor: float, served: int, slo: float = 0.05) -> Level:
    """A level of one second: `served` answers at 10 ms, all counted by the server."""
    found = Level(name, factor, 1.0, slo, sent=served, server_answers=served, server_p99=0.01)
    found.statuses, found.latencies = [200] * served, [0.01] * served
    found.health = found.health_port = [0.001]
    return found


def test_beside_a_hog_a_collapse_under_the_saturating_load_is_a_miss() -> None:
    """Levels taken from a collapsed capacity all meet half of it: the collapse itself is
    what misses."""
    curve = Curve("digits_onnx", True, 0.05, hog=True, capacity=323.0)
    curve.levels = [level("1x", 1.0, 323), level("10x", 10.0, 2741), level("storm", 0.0, 912)]
    assert curve.failures() == [
        "capacity: 323/s served under a saturating load, 2741/s inside the SLO at a lower one"
    ]


def test_beside_a_hog_a_capacity_that_holds_is_not_a_miss() -> None:
    curve = Curve("minilm", True, 0.5, hog=True, capacity=21.8)
    curve.levels = [level("1x", 1.0, 19, 0.5), level("10x", 10.0, 22, 0.5)]
    assert curve.failures() == []
    alone = Curve("digits_onnx", True, 0.05, capacity=323.0)  # not beside a hog: no such check
    alone.levels = [level("10x", 10.0, 2741)]
    assert alone.failures() == []
