"""Triton's system shared memory extension: tensors passed through shared memory on this host.

A client creates a POSIX shared memory object (`shm_open`, `/dev/shm/<key>`; tritonclient's
`tritonclient.utils.shared_memory`), registers a region of it under a name
(`POST /v2/systemsharedmemory/region/{name}/register` with `key`, `offset`, `byte_size`, or
gRPC's `SystemSharedMemoryRegister`), and then names the region in an inference request: an
input's parameters `shared_memory_region`, `shared_memory_byte_size` (and
`shared_memory_offset`, within the region) stand for its data, read from the region; an
output's ask for it to be written there, and its answer carries the same parameters instead
of data.

The region is mapped once, at registration; reading an input copies its bytes out of the
mapping (the client may rewrite the region once it has the answer). Only clients on this host
may register regions (a remote one cannot share memory), a key names a shared memory object
by a plain name (no path), and `max_regions` bounds the mappings one server holds.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from lockgate.errors import BadRequest, NotFound

SHM_DIR = "/dev/shm"
MAX_REGIONS = 256
_KEY = re.compile(r"/?[A-Za-z0-9_.\-]{1,250}")


@dataclass(frozen=True, slots=True)
class SharedSlice:
    """Where a tensor's bytes are: `byte_size` bytes at `offset` in the region `region`."""

    region: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class Region:
    name: str
    key: str
    offset: int  # of the region in the shared memory object
    byte_size: int
    mapping: mmap.mmap  # the object from 0 to offset + byte_size

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class SharedMemory:
    """The system shared memory regions registered with this server, by name."""

    def __init__(self, max_regions: int = MAX_REGIONS, directory: str = SHM_DIR) -> None:
        self.max_regions = max_regions
        self.directory = directory
        self.regions: dict[str, Region] = {}
        self.lock = threading.Lock()  # the gRPC server and the event loop both register

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map `byte_size` bytes at `offset` of the shared memory object `key` as `name`."""
        if not name or len(name) > 256:
            raise BadRequest("a shared memory region needs a name of 1 to 256 characters")
        if not _KEY.fullmatch(key) or key.strip("/.") == "" or ".." in key:
            raise BadRequest(f"shared memory key {key[:100]!r} is not the name of an object")
        if not (_count(offset) and _count(byte_size)) or byte_size == 0:
            raise BadRequest("offset must be >= 0 and byte_size > 0, both integers")
        with self.lock:
            if name in self.regions:
                raise BadRequest(f"shared memory region '{name}' is already registered")
            if not self.max_regions:
                raise BadRequest("system shared memory is off (--shared-memory-regions 0)")
            if len(self.regions) >= self.max_regions:
                raise BadRequest(
                    f"at most {self.max_regions} shared memory regions may be registered "
                    "(--shared-memory-regions)"
                )
            self.regions[name] = Region(
                name, key, offset, byte_size, self._map(key, offset + byte_size)
            )

    def _map(self, key: str, length: int) -> mmap.mmap:
        path = os.path.join(self.directory, key.lstrip("/"))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise BadRequest(f"cannot open shared memory object {key!r}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < length:
                raise BadRequest(
                    f"shared memory object {key!r} has {size} bytes, fewer than offset + "
                    f"byte_size ({length})"
                )
            return mmap.mmap(fd, length)
        finally:
            os.close(fd)

    def unregister(self, name: str | None = None) -> None:
        """Unregister `name` (None: every region); an unknown name is no error, as in Triton."""
        with self.lock:
            names = list(self.regions) if name is None else [name]
            gone = [self.regions.pop(n) for n in names if n in self.regions]
        for region in gone:
            region.mapping.close()

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            if name is None:
                return [r.status() for r in self.regions.values()]
            region = self.regions.get(name)
            if region is None:
                raise NotFound(f"no shared memory region '{name}' is registered")
            return [region.status()]

    def read(self, where: SharedSlice) -> bytes:
        """A copy of the bytes `where` names."""
        with self.lock:
            region = self._within(where, where.byte_size)
            start = region.offset + where.offset
            return region.mapping[start : start + where.byte_size]

    def write(self, where: SharedSlice, data: bytes, what: str) -> None:
        """`data` written at `where`: 400 naming `what` when it does not fit its byte size."""
        if len(data) > where.byte_size:
            raise BadRequest(
                f"{what} needs {len(data)} bytes; its shared memory has {where.byte_size}"
            )
        with self.lock:
            region = self._within(where, len(data))
            start = region.offset + where.offset
            region.mapping[start : start + len(data)] = data

    def check(self, where: SharedSlice) -> None:
        """400 unless `where` lies inside a registered region."""
        with self.lock:
            self._within(where, where.byte_size)

    def _within(self, where: SharedSlice, size: int) -> Region:
        region = self.regions.get(where.region)
        if region is None:
            raise BadRequest(f"no shared memory region '{where.region}' is registered")
        if where.offset + size > region.byte_size:
            raise BadRequest(
                f"shared memory region '{where.region}' has {region.byte_size} bytes: "
                f"{size} at offset {where.offset} do not fit"
            )
        return region

    def close(self) -> None:
        self.unregister()


def slice_of(what: str, parameters: Mapping[str, Any]) -> SharedSlice | None:
    """The shared memory a tensor's parameters name (None: none), checked: 400 naming `what`
    (`input 'x'`, `output 'y'`) when a value is missing or of the wrong type."""
    region = parameters.get("shared_memory_region")
    if region is None:
        return None
    size = parameters.get("shared_memory_byte_size")
    offset = parameters.get("shared_memory_offset", 0)
    if not isinstance(region, str) or not region:
        raise BadRequest(f"{what}: shared_memory_region must be a region's name")
    if not isinstance(size, int) or not _count(size) or not _count(offset):
        raise BadRequest(
            f"{what}: shared_memory_byte_size (required) and shared_memory_offset must be "
            "non-negative integers"
        )
    return SharedSlice(region, offset, size)


class RegisterRequest(msgspec.Struct):
    """The body of a REST registration."""

    key: str
    byte_size: int
    offset: int = 0


def decode_register(body: bytes) -> RegisterRequest:
    try:
        return msgspec.json.decode(body, type=RegisterRequest)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(f"shared memory registration: {exc}") from None


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
