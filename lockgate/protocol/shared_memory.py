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

The replicas of one `lockgate serve --replicas N` are one server to a client, which may
register a region through one replica and name it in a request another one answers. They
share their registrations through a `registry` directory their parent makes: a registration
is a file there, created exclusively (a name is registered once across the replicas), which
the others read and map when a request first names the region; an unregistration removes it,
and a replica finds the file gone (or replaced by another registration of the name) the next
time a request names the region. Status lists the files. A replica started again after a
crash thus finds every region still registered, as the client left them.
"""

from __future__ import annotations

import contextlib
import hashlib
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
    stamp: tuple[int, int] = (0, 0)  # its registry file's inode and change time; 0s: none

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class SharedMemory:
    """The system shared memory regions registered with this server, by name."""

    def __init__(
        self, max_regions: int = MAX_REGIONS, directory: str = SHM_DIR, registry: str = ""
    ) -> None:
        self.max_regions = max_regions
        self.directory = directory
        self.registry = registry  # shared with sibling replicas; "": this server's alone
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
            if not self.max_regions:
                raise BadRequest("system shared memory is off (--shared-memory-regions 0)")
            if self.registry:
                self._forget_stale(name)
            if name in self.regions or (self.registry and self._entry(name) is not None):
                raise BadRequest(f"shared memory region '{name}' is already registered")
            held = len(self._entries()) if self.registry else len(self.regions)
            if held >= self.max_regions:
                raise BadRequest(
                    f"at most {self.max_regions} shared memory regions may be registered "
                    "(--shared-memory-regions)"
                )
            region = Region(name, key, offset, byte_size, self._map(key, offset + byte_size))
            if self.registry:
                try:
                    region.stamp = self._publish(region)
                except BaseException:
                    region.mapping.close()
                    raise
            self.regions[name] = region

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
            if self.registry:
                entries = self._entries() if name is None else [name]
                for entry in entries:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._file(entry))
            names = list(self.regions) if name is None else [name]
            gone = [self.regions.pop(n) for n in names if n in self.regions]
        for region in gone:
            region.mapping.close()

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            if self.registry:
                found = [self._entry(n) for n in (self._entries() if name is None else [name])]
                listed = [entry for entry in found if entry is not None]
            else:
                names = list(self.regions) if name is None else [name]
                listed = [self.regions[n].status() for n in names if n in self.regions]
            if name is not None and not listed:
                raise NotFound(f"no shared memory region '{name}' is registered")
            return listed

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
        region = self._sibling(where.region) if self.registry else self.regions.get(where.region)
        if region is None:
            raise BadRequest(f"no shared memory region '{where.region}' is registered")
        if where.offset + size > region.byte_size:
            raise BadRequest(
                f"shared memory region '{where.region}' has {region.byte_size} bytes: "
                f"{size} at offset {where.offset} do not fit"
            )
        return region

    def close(self) -> None:
        """Unmap every region; with a registry, its registrations stay for the siblings."""
        with self.lock:
            gone, self.regions = list(self.regions.values()), {}
        for region in gone:
            region.mapping.close()

    # -- the registry shared by sibling replicas (lock held) ------------------------------
    def _file(self, name: str) -> str:
        return os.path.join(self.registry, hashlib.sha256(name.encode()).hexdigest())

    def _entries(self) -> list[str]:
        """The names registered across the siblings."""
        names = []
        for file in os.listdir(self.registry):
            if file.endswith(".new"):  # a registration being written
                continue
            entry = self._read(os.path.join(self.registry, file))
            if entry is not None:
                names.append(entry["name"])
        return names

    def _entry(self, name: str) -> dict[str, Any] | None:
        return self._read(self._file(name))

    @staticmethod
    def _read(path: str) -> dict[str, Any] | None:
        try:
            with open(path, "rb") as file:
                entry: dict[str, Any] = msgspec.json.decode(file.read())
        except (FileNotFoundError, msgspec.DecodeError):  # gone, or being written
            return None
        return entry

    def _publish(self, region: Region) -> tuple[int, int]:
        """Write the registration's file, exclusively; its stamp."""
        path = self._file(region.name)
        try:
            fd = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise BadRequest(f"shared memory region '{region.name}' is being registered") from None
        try:
            os.write(fd, msgspec.json.encode(region.status()))
        finally:
            os.close(fd)
        try:
            os.link(path + ".new", path)  # fails if a sibling registered the name meanwhile
        except FileExistsError:
            raise BadRequest(
                f"shared memory region '{region.name}' is already registered"
            ) from None
        finally:
            os.unlink(path + ".new")
        return _stamp(os.stat(path))

    def _forget_stale(self, name: str) -> None:
        """Drop the local mapping of `name` when its registration is gone or replaced."""
        region = self.regions.get(name)
        if region is None:
            return
        try:
            current = _stamp(os.stat(self._file(name)))
        except FileNotFoundError:
            current = (0, 0)
        if current != region.stamp:
            del self.regions[name]
            region.mapping.close()

    def _sibling(self, name: str) -> Region | None:
        """The region `name` as the registry has it now, mapped here on first use."""
        self._forget_stale(name)
        region = self.regions.get(name)
        if region is not None:
            return region
        path = self._file(name)
        try:
            stamp = _stamp(os.stat(path))
        except FileNotFoundError:
            return None
        entry = self._read(path)
        if entry is None or entry.get("name") != name:
            return None
        key, offset, byte_size = entry["key"], entry["offset"], entry["byte_size"]
        mapping = self._map(key, offset + byte_size)
        region = self.regions[name] = Region(name, key, offset, byte_size, mapping, stamp)
        return region


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


def _stamp(found: os.stat_result) -> tuple[int, int]:
    return found.st_ino, found.st_mtime_ns


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
