"""`benchmarks.llm_step_profile --first-wave`: a burst of requests stepped until each has its
first token, through a real engine (the fake model of the engine tests)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.llm_step_profile import first_wave, wave_requests
from tests.llm.test_engine import make_engine


def test_the_wave_ends_when_every_request_has_its_first_token() -> None:
    engine = make_engine(max_num_batched_tokens=32)
    requests = [([1 + (i * 7 + j) % 90 for j in range(20)], 50) for i in range(5)]
    wave = first_wave(engine, requests)
    # 100 prompt tokens at 32 a step (less the decodes of those already started): 4 steps at
    # least, and no more than their last prompt needs
    assert 4 <= wave.steps <= 5
    assert wave.wall_s > 0 and wave.cpu_s >= 0
    assert not engine.has_unfinished  # the wave's requests are dropped after it
    assert engine.counters.prompt_tokens == 100


def test_a_missing_workload_gives_random_prompts_of_its_shape(tmp_path: Path) -> None:
    requests = wave_requests(tmp_path / "missing.json", 32)
    assert len(requests) == 32
    assert all(64 <= len(prompt) <= 253 and 32 <= n <= 128 for prompt, n in requests)
    assert requests == wave_requests(tmp_path / "missing.json", 32)  # seeded
