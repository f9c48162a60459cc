"""The file where the router keeps its model control requests across its own restarts
(`--control-state`): the requests the log holds (`control_log.py`), and for each replica the
boot id it last reported with the number of the last request that process was told.

A router that starts with the file reads it back. The requests are replayed, as before, to a
replica that lacks them; a replica that reports the boot id the file names for it is the same
process, told what the file says, and is not sent those again; one that reports another boot
id (or none) is a process that was told nothing. The file is written whole after each change
to a temporary file beside it, which is then renamed over it (a reader finds the old file or
the new one, never a part of one), readable by its owner alone: it holds the requests' headers
(an API key among them) and bodies (a model's files among them). A file that cannot be read or
is not such a state is logged, and the router starts with nothing kept; its next change
replaces the file.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from lockgate.router.control_log import ACTIONS, Control, ControlLog, Entry

log = logging.getLogger("lockgate.router")
FORMAT = 1  # the layout of `Saved`; a file of another is not read


class SavedEntry(msgspec.Struct, array_like=True, frozen=True):
    model: str
    action: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    seq: int


class SavedReplica(msgspec.Struct, array_like=True, frozen=True):
    url: str
    boot: bytes
    told: int


class Saved(msgspec.Struct, frozen=True):
    """The file's content (msgpack): the log, oldest first, and the replicas' processes."""

    format: int
    seq: int  # the log's: the number of the last request recorded
    entries: list[SavedEntry]
    replicas: list[SavedReplica]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Saved).decode


@dataclass(frozen=True, slots=True)
class Known:
    """A replica's process as a router last saw it: its boot id and what it was told."""

    boot: bytes
    told: int


@dataclass(slots=True)
class ControlState:
    log: ControlLog
    replicas: dict[str, Known] = field(default_factory=dict)  # by URL


def saved(control_log: ControlLog, replicas: dict[str, Known]) -> Saved:
    """What the file is to hold now (taken on the event loop; written by `write` elsewhere)."""
    entries = [
        SavedEntry(e.control.model, e.control.action, list(e.headers), e.body, e.seq)
        for e in control_log.entries.values()
    ]
    known = [SavedReplica(url, k.boot, k.told) for url, k in replicas.items()]
    return Saved(FORMAT, control_log.seq, entries, known)


def write(path: Path, state: Saved) -> None:
    """Replace the file at `path` with `state` at once; OSError when it cannot be written."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(_encode(state))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def read(path: Path, max_bytes: int) -> ControlState:
    """The state the file at `path` holds, its requests kept within `max_bytes` (oldest
    first); nothing kept when there is no file, or (logged) when it cannot be read."""
    empty = ControlState(ControlLog(max_bytes))
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        log.info("router: no model control state in %s yet", path)
        return empty
    except OSError as exc:
        log.warning(
            "router: cannot read the model control state %s (%s): starting with no model "
            "load or unload kept",
            path,
            exc,
        )
        return empty
    try:
        state = _decode(data)
        _check(state)
    except (msgspec.DecodeError, ValueError) as exc:
        log.warning(
            "router: %s is not a model control state (%s): starting with no model load or "
            "unload kept; the file is replaced at the next one",
            path,
            exc,
        )
        return empty
    return _restored(state, max_bytes, path)


def _check(state: Saved) -> None:
    """ValueError naming what is wrong with a decoded state."""
    if state.format != FORMAT:
        raise ValueError(f"format {state.format}, not {FORMAT}")
    last = 0
    models = set()
    for e in state.entries:
        if not e.model or e.action not in ACTIONS:
            raise ValueError(f"an entry for {e.action} of model {e.model!r}")
        if e.model in models or not last < e.seq <= state.seq:
            raise ValueError(f"entry {e.seq} of model {e.model!r} out of order")
        models.add(e.model)
        last = e.seq
    for r in state.replicas:
        if not 0 <= r.told <= state.seq:
            raise ValueError(f"replica {r.url} told {r.told} of {state.seq} requests")


def _restored(state: Saved, max_bytes: int, path: Path) -> ControlState:
    control_log = ControlLog(max_bytes, seq=state.seq)
    dropped = []
    for e in state.entries:
        headers = tuple((name, value) for name, value in e.headers)
        if not control_log.restore(Entry(Control(e.model, e.action), headers, e.body, e.seq)):
            dropped.append(e.model)
    if dropped:
        log.warning(
            "router: the model loads and unloads of %s in %s pass --control-memory-mb: not "
            "kept (a replica that joins keeps those models as its start-up leaves them)",
            ", ".join(repr(m) for m in dropped),
            path,
        )
    log.info(
        "router: %d model loads and unloads, and what %d replicas were told, read from %s",
        len(control_log.entries),
        len(state.replicas),
        path,
    )
    replicas = {r.url: Known(r.boot, r.told) for r in state.replicas}
    return ControlState(control_log, replicas)
