"""The loop thread's clocks (frontend/thread_clock.py), read from the kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lockgate.frontend.thread_clock import ThreadClock

ROOT = Path(__file__).resolve().parents[2]

# a thread spinning on a core beside a process spinning there too: it waits for the core about
# as long as it runs
BESIDE_A_HOG = """
import json, os, subprocess, sys, time
from lockgate.frontend.thread_clock import ThreadClock
core = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {core})
spin = f"import os; os.sched_setaffinity(0, {{{core}}})\\nwhile True: pass"
hog = subprocess.Popen([sys.executable, "-c", spin])
time.sleep(0.3)
clock = ThreadClock()
before, started = clock.read(), time.monotonic()
while time.monotonic() - started < 0.6:
    pass
after, wall = clock.read(), time.monotonic() - started
hog.kill()
seen = {"cpu": after.cpu - before.cpu, "waited": after.waited - before.waited, "wall": wall}
print(json.dumps(seen))
"""


def test_a_thread_beside_a_process_on_its_core_is_seen_waiting() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BESIDE_A_HOG], capture_output=True, check=True, cwd=ROOT
    )
    seen = json.loads(out.stdout)
    assert seen["cpu"] + seen["waited"] == pytest.approx(seen["wall"], rel=0.2), seen
    assert 0.2 * seen["wall"] < seen["waited"] < 0.9 * seen["wall"], seen  # about half each


def test_the_clock_counts_cpu_and_no_wait_on_an_idle_core() -> None:
    clock = ThreadClock()
    before = clock.read()
    total = sum(i * i for i in range(200_000))  # some CPU
    after = clock.read()
    clock.close()
    assert total > 0 and after.cpu > before.cpu
    assert after.waited >= before.waited


def test_without_schedstat_the_cpu_is_the_threads_and_no_wait_is_known(tmp_path: Path) -> None:
    clock = ThreadClock(str(tmp_path / "absent"))
    assert clock.fd is None
    first = clock.read()
    sum(i * i for i in range(200_000))
    second = clock.read()
    assert second.cpu > first.cpu and first.waited == second.waited == 0.0
    (tmp_path / "garbage").write_text("not numbers\n")
    assert ThreadClock(str(tmp_path / "garbage")).fd is None
