"""The file where the router keeps its model control requests across restarts
(`control_state.py`): written whole and private, read back within the memory bound, and a
file that cannot be read leaves the router with nothing kept, never stopped."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest

from lockgate.router.control_log import ControlLog
from lockgate.router.control_state import (
    FORMAT,
    Known,
    Saved,
    SavedEntry,
    read,
    saved,
    write,
)
from tests.router.test_control_log import entry


def kept(log: ControlLog) -> list[tuple[str, str, bytes, int]]:
    return [(e.control.model, e.control.action, e.body, e.seq) for e in log.since(0)]


def test_what_is_written_is_read_back(tmp_path: Path) -> None:
    log = ControlLog(max_bytes=10_000)
    for model, action in [("a", "load"), ("b", "load"), ("a", "unload"), ("c", "load")]:
        log.record(entry(model, action, body=f'{{"{model}": 1}}'.encode()))
    log.forget("c")  # a request not kept still took its number
    replicas = {"http://127.0.0.1:9000": Known(b"0123456789abcdef", 3)}
    path = tmp_path / "state" / "router.state"  # its directory is made
    write(path, saved(log, replicas))
    assert path.stat().st_mode & 0o777 == 0o600  # headers (API keys) and bodies in it
    assert [p.name for p in path.parent.iterdir()] == ["router.state"]  # no temporary left
    state = read(path, 10_000)
    assert kept(state.log) == kept(log)
    assert state.log.seq == 4 and state.log.size == log.size
    assert state.log.since(0)[0].headers == ((b"authorization", b"Bearer k"),)
    assert state.replicas == replicas
    write(path, saved(ControlLog(10_000), {}))  # replaced whole
    assert read(path, 10_000).log.since(0) == []


def test_requests_past_the_memory_bound_are_not_read_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = ControlLog(max_bytes=10_000)
    for model in ("a", "b", "c"):
        log.record(entry(model, body=b"x" * 100))
    path = tmp_path / "router.state"
    write(path, saved(log, {}))
    with caplog.at_level(logging.WARNING, "lockgate.router"):
        state = read(path, 2 * entry("a", body=b"x" * 100).size)  # a lower --control-memory-mb
    assert [m for m, *_ in kept(state.log)] == ["a", "b"]
    assert state.log.seq == 3  # a replica told up to 2 is behind, with nothing to replay
    assert "'c'" in caplog.text and "--control-memory-mb" in caplog.text


def bad_files(tmp_path: Path) -> dict[str, Path]:
    def saved_as(state: Saved) -> Path:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.state"
        path.write_bytes(msgspec.msgpack.encode(state))
        return path

    garbage = tmp_path / "garbage.state"
    garbage.write_bytes(b"\x93not a state at all")
    later = SavedEntry("a", "load", [], b"", 2)
    earlier = SavedEntry("b", "load", [], b"", 1)
    return {
        "garbage": garbage,
        "a directory": tmp_path,
        "another format": saved_as(Saved(FORMAT + 1, 0, [], [])),
        "entries out of order": saved_as(Saved(FORMAT, 2, [later, earlier], [])),
        "an unknown action": saved_as(
            Saved(FORMAT, 1, [SavedEntry("a", "reload", [], b"", 1)], [])
        ),
    }


def test_a_file_that_cannot_be_read_leaves_nothing_kept_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for what, path in bad_files(tmp_path).items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, "lockgate.router"):
            state = read(path, 10_000)
        assert state.log.since(0) == [] and state.log.seq == 0 and state.replicas == {}, what
        assert str(path) in caplog.text and "no model load or unload kept" in caplog.text, what
    caplog.clear()
    with caplog.at_level(logging.WARNING, "lockgate.router"):
        assert read(tmp_path / "none yet.state", 10_000).log.seq == 0
    assert caplog.text == ""  # no file yet: nothing to warn of
