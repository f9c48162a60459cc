"""`parent_death.py` with real processes: a child that follows its parent gets SIGTERM once when
the parent is killed (SIGKILL), through the kernel on Linux and through the polling fallback;
one whose parent died before it asked gets it at once; the variable is not passed on."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lockgate.parent_death import ENV, child_env
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# the child: tells its pid once it follows its parent, then each SIGTERM while it drains (0.5 s)
CHILD = """
import os, signal, sys, time
from lockgate.parent_death import ENV, follow_parent, watch

stopping = []

def stop(sig, frame):
    print("SIGTERM", flush=True)
    stopping.append(sig)

signal.signal(signal.SIGTERM, stop)
{follow}
print(os.getpid(), "following", ENV in os.environ, flush=True)
end = time.monotonic() + 30  # not left running by a failed test
while not stopping and time.monotonic() < end:
    time.sleep(0.01)
time.sleep(0.5)
"""

# the parent: threads busy (the kernel signals a child again as each exits), then the child
# started with `child_env`; it waits to be killed
PARENT = """
import subprocess, sys, threading, time
from lockgate.parent_death import child_env

for _ in range(4):
    threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(int, 1)], daemon=True).start()
subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=child_env())
time.sleep(60)
"""


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"  # ended, not yet reaped by its new parent


@pytest.mark.parametrize(
    "follow",
    ["follow_parent()", "watch(int(os.environ.pop(ENV)), interval=0.05)"],
    ids=["kernel", "polling"],
)
def test_a_child_gets_sigterm_when_its_parent_is_killed(follow: str) -> None:
    child_code = textwrap.dedent(CHILD).format(follow=follow)
    command = [sys.executable, "-c", textwrap.dedent(PARENT), child_code]
    parent = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert parent.stdout is not None
        pid, following, passed_on = parent.stdout.readline().split()
        assert following == "following" and passed_on == "False"  # not passed on to its children
        child = int(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while not gone(child):
            assert time.monotonic() < deadline, f"child {child} outlived its parent"
            time.sleep(0.02)
        assert parent.stdout.read() == "SIGTERM\n"  # once: its drain is not cut short
    finally:
        parent.kill()
        parent.wait()


def test_a_child_whose_parent_died_before_it_asked_ends_at_once() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    child_code = textwrap.dedent(CHILD).format(follow="follow_parent()")
    done = subprocess.run(
        [sys.executable, "-c", child_code],
        env={**child_env(), ENV: str(dead.pid)},  # its parent is this process, not `dead`
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert done.stdout.splitlines()[0] == "SIGTERM", done.stderr  # within the call: at once
