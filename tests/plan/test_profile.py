import time

import pytest

from lockgate.errors import BadRequest
from lockgate.plan.profile import batch_sizes_up_to, profile_callable, profile_server
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
    with serve(behaviour) as (url, _):
        profile = profile_server(url, "toy", 8, repeats=3)
    assert profile.batch_sizes == (1, 2, 4, 8)
    assert profile.median_s[-1] >= 0.018
    assert profile.b_s == pytest.approx(0.002, rel=0.5)
