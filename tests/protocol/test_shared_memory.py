"""The registry of system shared memory regions (`protocol/shared_memory.py`), on files of a
temporary folder standing for /dev/shm."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockgate.errors import BadRequest
from lockgate.protocol.shared_memory import SharedMemory, SharedSlice, slice_of


def test_regions_read_and_write_within_their_bounds(tmp_path: Path) -> None:
    (tmp_path / "obj").write_bytes(bytes(range(64)))
    regions = SharedMemory(max_regions=2, directory=str(tmp_path))
    regions.register("r", "/obj", offset=16, byte_size=32)
    assert regions.read(SharedSlice("r", 4, 4)) == bytes([20, 21, 22, 23])
    regions.write(SharedSlice("r", 0, 8), b"abc", "output 'y'")
    assert (tmp_path / "obj").read_bytes()[16:19] == b"abc"  # the object itself changed
    with pytest.raises(BadRequest, match="do not fit"):
        regions.read(SharedSlice("r", 30, 4))
    with pytest.raises(BadRequest, match="needs 9 bytes"):
        regions.write(SharedSlice("r", 0, 8), b"x" * 9, "output 'y'")
    regions.register("s", "obj", offset=0, byte_size=64)
    with pytest.raises(BadRequest, match="at most 2 shared memory regions"):
        regions.register("t", "obj", offset=0, byte_size=1)
    regions.close()
    assert regions.status() == []


def test_off_and_misuse(tmp_path: Path) -> None:
    (tmp_path / "obj").write_bytes(b"\0" * 8)
    with pytest.raises(BadRequest, match="off"):
        SharedMemory(max_regions=0, directory=str(tmp_path)).register("r", "obj", 0, 8)
    regions = SharedMemory(directory=str(tmp_path))
    for key in ("../obj", "a/b", "", "/"):
        with pytest.raises(BadRequest, match="not the name"):
            regions.register("r", key, 0, 8)
    with pytest.raises(BadRequest, match="fewer than offset"):
        regions.register("r", "obj", 4, 8)
    assert slice_of("input 'x'", {}) is None
    with pytest.raises(BadRequest, match="shared_memory_byte_size"):
        slice_of("input 'x'", {"shared_memory_region": "r", "shared_memory_byte_size": -1})


def test_sibling_replicas_share_their_registrations(tmp_path: Path) -> None:
    """Two replicas of one server, sharing a registry folder: a region registered through
    one is read through the other; unregistered or registered again through one, the other
    follows at its next request; a name is registered once across them."""
    shm, registry = tmp_path / "shm", tmp_path / "registry"
    shm.mkdir()
    registry.mkdir()
    (shm / "a").write_bytes(bytes(range(32)))
    (shm / "b").write_bytes(bytes(range(100, 132)))
    one, two = (SharedMemory(2, str(shm), str(registry)) for _ in range(2))
    one.register("r", "a", offset=8, byte_size=8)
    assert two.read(SharedSlice("r", 0, 2)) == bytes([8, 9])  # mapped there on first use
    assert (
        two.status("r")
        == one.status("r")
        == [{"name": "r", "key": "a", "offset": 8, "byte_size": 8}]
    )
    with pytest.raises(BadRequest, match="already registered"):
        two.register("r", "b", 0, 8)
    two.register("s", "b", 0, 4)
    with pytest.raises(BadRequest, match="at most 2"):  # counted across the replicas
        one.register("t", "a", 0, 4)
    two.unregister("r")
    with pytest.raises(BadRequest, match="no shared memory region 'r'"):
        one.read(SharedSlice("r", 0, 2))  # its own mapping dropped: the registration is gone
    one.register("r", "b", offset=0, byte_size=8)
    assert two.read(SharedSlice("r", 0, 2)) == bytes([100, 101])  # the new registration
    one.close()  # a replica stopping leaves the registrations to the others
    assert {r["name"] for r in two.status()} == {"r", "s"}
    two.unregister()
    assert one.status() == two.status() == [] and not list(registry.iterdir())
