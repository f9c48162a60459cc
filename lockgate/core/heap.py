"""The garbage collector's view of a server's heap after start-up."""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Move every object alive after start-up (modules, models, their weights' wrappers) out
    of the garbage collector's reach: a full collection otherwise walks them all with the
    event loop stopped (about 250,000 objects and 110 ms with lockgate's imports on a 2-core
    machine), and under load full collections come every few seconds. Objects made later
    are collected as usual."""
    gc.collect()
    gc.freeze()
