"""The event loop thread's two clocks: the CPU time it has run, and the time it has waited
for a CPU while it had work (another process or thread was running on its core).

Both come from one read of Linux's `/proc/thread-self/schedstat` (opened on the thread it
measures: its first two fields, in nanoseconds, are the time run and the time waited on a run
queue), about a microsecond. The gate tells the loop's own lateness from the time it was kept
off its core by a neighbour: refusing requests frees the loop of its own work, never of a
neighbour's. Where the file cannot be read, the CPU time is `time.thread_time()` and no wait
is known, so every lateness counts as the loop's own.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

SCHEDSTAT = "/proc/thread-self/schedstat"


@dataclass(frozen=True, slots=True)
class ThreadTimes:
    cpu: float  # seconds the thread has run
    waited: float  # seconds it has waited for a CPU while runnable


class ThreadClock:
    """Reads the times of the thread that made it."""

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self.fd: int | None = None
        with contextlib.suppress(OSError):
            self.fd = os.open(path, os.O_RDONLY)
        if self.fd is not None and self._schedstat() is None:
            self.close()

    def read(self) -> ThreadTimes:
        times = self._schedstat() if self.fd is not None else None
        if times is None:
            return ThreadTimes(time.thread_time(), 0.0)
        return times

    def _schedstat(self) -> ThreadTimes | None:
        assert self.fd is not None
        try:
            ran, waited = os.pread(self.fd, 128, 0).split()[:2]
            return ThreadTimes(int(ran) * 1e-9, int(waited) * 1e-9)
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
