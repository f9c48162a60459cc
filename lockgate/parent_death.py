"""A child process of lockgate that ends when its parent does, even when the parent is killed.

A parent that starts a lockgate process names itself in the child's environment
(`child_env`: `LOCKGATE_PARENT_PID`). The child calls `follow_parent` first thing in its entry
point: on Linux it asks the kernel for a signal when its parent dies (`prctl(PR_SET_PDEATHSIG)`),
then checks that its parent is still the one named: a parent that died before the request took
hold has already handed the child to another (init, or a subreaper), and the child gets
SIGTERM at once. Elsewhere a daemon thread polls `getppid()` every `POLL_S` s and sends the
process SIGTERM when it changes (on Windows, where a parent's death changes no child, nothing).

The kernel's signal is `PARENT_DIED` (SIGRTMIN), whose handler sends the process SIGTERM once
and then ignores it: the kernel sends it again each time the child passes from one exiting
thread of a killed parent to the next, and a second SIGTERM would end a server's drain at once.
SIGTERM, not SIGKILL: the child drains as on any SIGTERM, so a replica that clients reach
directly (kernel balancing) answers the requests it holds, within its drain timeout, before it
closes its ports; a replica with nothing in flight is gone at once. The variable is removed
from the child's environment, so the processes it starts in turn are not bound to it.

Linux signals the death of the thread that started the child, not of the process: a parent
starts its children from a thread that outlives them (its main thread, or one that waits for
them all).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from types import FrameType

ENV = "LOCKGATE_PARENT_PID"
POLL_S = 1.0  # the fallback's polling interval
PARENT_DIED: int | None = getattr(signal, "SIGRTMIN", None)  # Linux's; lockgate's alone
_PR_SET_PDEATHSIG = 1


def child_env() -> dict[str, str]:
    """The environment for a child of this process that must end when this process does."""
    return {**os.environ, ENV: str(os.getpid())}


def follow_parent() -> None:
    """End this process (SIGTERM) when the parent named by `LOCKGATE_PARENT_PID` dies; nothing
    when it names none. Call it before anything else in the child."""
    named = os.environ.pop(ENV, None)
    if named is None:
        return
    parent = int(named)
    if _set_death_signal():
        if os.getppid() != parent:  # the parent died before the request took hold
            os.kill(os.getpid(), signal.SIGTERM)
    elif sys.platform != "win32":
        watch(parent)


def watch(parent: int, interval: float = POLL_S) -> threading.Thread:
    """The fallback: a daemon thread that sends this process SIGTERM once its parent is no
    longer `parent` (it died, and the process was handed to another)."""

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=poll, name="lockgate-parent", daemon=True)
    thread.start()
    return thread


def _set_death_signal() -> bool:
    """Have the kernel send this process `PARENT_DIED` when its parent dies, relayed as one
    SIGTERM; False where it cannot (not Linux)."""
    if not sys.platform.startswith("linux") or PARENT_DIED is None:
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    signal.signal(PARENT_DIED, _relay_once)
    if int(prctl(_PR_SET_PDEATHSIG, PARENT_DIED)) != 0:
        signal.signal(PARENT_DIED, signal.SIG_DFL)
        return False
    return True


def _relay_once(sig: int, frame: FrameType | None) -> None:
    signal.signal(sig, signal.SIG_IGN)  # the same death, signalled again: nothing more
    os.kill(os.getpid(), signal.SIGTERM)
