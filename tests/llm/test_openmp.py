from __future__ import annotations

import ctypes
import os
import threading

import torch

from lockgate.llm.openmp import release_workers

NAME = b"lg-omp-test"
PR_SET_NAME = 15


def _named_threads() -> int:
    """Threads of this process named NAME: the test's thread and the threads it started
    (a new thread takes its creator's name)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", "rb") as f:
                count += f.read().strip() == NAME
        except FileNotFoundError:  # ended meanwhile
            pass
    return count


def test_an_idle_thread_hands_back_its_openmp_workers() -> None:
    """A thread that ran parallel work keeps a team of OpenMP workers; releasing them ends
    those threads, and the next parallel op makes a team again."""
    seen: dict[str, int] = {}

    def work() -> None:
        ctypes.CDLL(None).prctl(PR_SET_NAME, NAME, 0, 0, 0)
        torch.set_num_threads(2)  # this thread's team: itself and one worker
        x = torch.randn(512, 512)
        for _ in range(20):
            x @ x  # parallel: starts the worker
        seen["working"] = _named_threads()
        seen["released"] = int(release_workers())
        seen["idle"] = _named_threads()
        for _ in range(20):
            x @ x
        seen["again"] = _named_threads()
        release_workers()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["released"] == 1
    assert seen["idle"] == seen["working"] - 1  # its one worker ended
    assert seen["again"] == seen["working"]
