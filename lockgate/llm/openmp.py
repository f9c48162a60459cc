"""torch's OpenMP runtime: a thread that goes idle hands back its team of worker threads.

OpenMP (libgomp in torch's Linux wheels) keeps a team of worker threads for each thread that
has run parallel work. While it manages more threads than there are CPUs, every team's
workers sleep between parallel regions instead of spinning, and each of the thousands of ops
in a decode step then waits for them to wake: on two cores, a SmolLM2 decode step took 1.8
times as long with one idle team beside the working one. A process serving several language
models has a team per engine thread, so an engine that runs out of work releases its team
(`omp_pause_resource_all`, OpenMP 5.0), and only the teams of engines at work count; its next
op makes a new team, which costs tens of microseconds.

Where torch's OpenMP runtime cannot be found (another build of torch), this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings
LIBRARIES = ("libgomp.so.1", "libgomp.so", "libomp.so", "libiomp5.so")


def release_workers() -> bool:
    """Free the calling thread's OpenMP workers; True if the runtime did."""
    pause = _pause_function()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


@functools.cache
def _pause_function() -> Callable[[int], int] | None:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "lib"
    for name in LIBRARIES:
        path = folder / name
        if not path.exists():
            continue
        try:
            library = ctypes.CDLL(str(path))  # the copy torch loaded: same path, same handle
            pause = library.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        return pause  # type: ignore[no-any-return]
    return None
