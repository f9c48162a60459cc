"""The replicas behind the router: a static list or a DNS name (a Kubernetes headless
Service's records), each probed for readiness.

Every `probe_interval` seconds each replica's `/v2/health/ready` is asked; a replica takes
traffic only while its last probe said 200 and no ejection holds it out. A DNS name is
resolved again every `resolve_interval` seconds: new addresses join (once ready), vanished
ones take no new request and are closed when their requests have ended.

A replica that may lack model control requests the others were told (new, not told one, or
started again: its health answer reports a boot id other than the last one, or, from a
replica that reports none, its probe could not reach it) joins through the `Joiner` when a
probe finds it up (200, or 503 for a reason other than loading its start-up models or
draining: in explicit model control mode a replica with no model loaded says 503): the router
replays those requests to it (`model_control.py`), and only then is it ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lockgate.protocol import readiness
from lockgate.router.replica import HealthSettings, Replica
from lockgate.router.upstream import Upstream, UpstreamError

log = logging.getLogger("lockgate.router")


@dataclass(frozen=True, slots=True)
class Discovery:
    """Where the replicas are: fixed URLs, or `host:port` resolved through DNS."""

    urls: tuple[str, ...] = ()
    dns: str | None = None
    resolve_interval: float = 5.0


class Joiner(Protocol):
    """Brings a replica up to date with the model control requests before it takes traffic."""

    def behind(self, replica: Replica) -> bool: ...
    def told_before(self, replica: Replica, boot: bytes) -> int:
        """What the process that reports `boot` was told before this router started."""
        ...

    async def join(self, replica: Replica) -> bool:
        """False when it could not (the next probe tries again)."""
        ...


def split_url(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"replica {url!r}: give http://host:port")
    return parts.hostname, parts.port or 80


class ReplicaPool:
    def __init__(
        self,
        discovery: Discovery,
        health: HealthSettings,
        on_change: Callable[[Replica, str], None] | None = None,
    ) -> None:
        self.discovery = discovery
        self.health = health
        self.on_change = on_change or (lambda replica, event: None)
        self.replicas: list[Replica] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.joiner: Joiner | None = None  # set by the router's model control
        self.joins: set[asyncio.Task[None]] = set()
        for url in discovery.urls:
            self._add(url)

    def _add(self, url: str) -> Replica:
        host, port = split_url(url)
        replica = Replica(f"http://{_bracket(host)}:{port}", Upstream(host, port))
        self.replicas.append(replica)
        self.on_change(replica, "added")
        return replica

    def ready(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return any(r.usable(now) for r in self.replicas)

    def all_full(self, now: float) -> bool:
        """Every usable replica refused within the last moment: shed at once."""
        usable = False
        for r in self.replicas:
            if r.usable(now):
                if not r.full(now):
                    return False
                usable = True
        return usable

    async def start(self) -> None:
        if self.discovery.dns:
            await self.resolve()
            self.tasks.append(asyncio.create_task(self._resolve_loop()))
        await asyncio.gather(*(self.probe(r) for r in self.replicas))
        await asyncio.gather(*self.joins)
        self.tasks.append(asyncio.create_task(self._probe_loop()))

    async def stop(self) -> None:
        for task in [*self.tasks, *self.joins]:
            task.cancel()
        for task in [*self.tasks, *self.joins]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for replica in self.replicas:
            replica.upstream.close()

    # -- readiness probes ------------------------------------------------------------------
    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health.probe_interval)
            await asyncio.gather(*(self.probe(r) for r in list(self.replicas)))
            for replica in [r for r in self.replicas if r.removed and r.in_flight == 0]:
                self.replicas.remove(replica)
                replica.upstream.close()
                self.on_change(replica, "removed")

    async def probe(self, replica: Replica) -> None:
        if replica.joining:  # its join says when it is ready
            return
        was = replica.ready
        up = False  # it could be told model control requests now
        try:
            async with asyncio.timeout(self.health.probe_timeout):
                response = await replica.upstream.request("GET", "/v2/health/ready", [], b"")
                body = await response.read()
            ready = response.status == 200
            up = ready or (response.status == 503 and _reason(body) not in readiness.BUSY)
            # the load it reports, less this probe: refreshed here too, so a replica this
            # router stopped sending to (its last answer reported it busy) is seen idle again
            reported = response.header(b"x-lockgate-inflight")
            if reported is not None and reported.isdigit():
                replica.reported = max(0, int(reported) - 1)
            boot = response.header(readiness.BOOT_HEADER)
            if boot is not None and boot != replica.boot:
                self._booted(replica, boot)
        except UpstreamError:  # not there: stopped, or starting again without what it was told
            ready = False
            if replica.boot is None:  # no boot id tells whether it starts again: assume so
                replica.told = 0
        except TimeoutError:  # there, but slow: what it was told still holds
            ready = False
        if up and self.joiner is not None and self.joiner.behind(replica):
            ready = False
            if not replica.joining:  # (a DNS lookup probes a new replica beside the loop)
                replica.joining = True
                self.on_change(replica, "joining: sent the model loads and unloads it lacks")
                task = asyncio.create_task(self._join(replica, self.joiner))
                self.joins.add(task)
                task.add_done_callback(self.joins.discard)
        replica.ready = ready
        if ready != was:
            self.on_change(replica, "ready" if ready else "not ready")

    def _booted(self, replica: Replica, boot: bytes) -> None:
        """A health answer reported a boot id other than the last one: another process,
        told nothing yet (however soon after the last probe it started). The first one read
        may be a process the router before this one told requests (`--control-state`)."""
        if replica.boot is not None:
            self.on_change(replica, "started again (another boot id)")
            replica.told = 0
        elif self.joiner is not None:
            replica.told = max(replica.told, self.joiner.told_before(replica, boot))
        replica.boot = boot

    async def _join(self, replica: Replica, joiner: Joiner) -> None:
        try:
            joined = await joiner.join(replica)
        finally:
            replica.joining = False
        if joined and not replica.removed:
            await self.probe(replica)  # ready now, with what it was told?

    # -- DNS -------------------------------------------------------------------------------
    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discovery.resolve_interval)
            await self.resolve()

    async def resolve(self) -> None:
        assert self.discovery.dns is not None
        host, port = split_url(self.discovery.dns)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as exc:  # keep what we have: a DNS hiccup must not empty the pool
            log.warning("router: cannot resolve %s: %s", host, exc)
            return
        urls = {f"http://{_bracket(str(info[4][0]))}:{port}" for info in infos}
        known = {r.url for r in self.replicas if not r.removed}
        for url in sorted(urls - known):
            await self.probe(self._add(url))
        for replica in self.replicas:
            if replica.url not in urls and not replica.removed:
                replica.removed = True
                self.on_change(replica, "leaving")


def _reason(body: bytes) -> str | None:
    """The `error` of a readiness answer's body (`protocol/readiness.py`), None for none."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, str) else None


def _bracket(address: str) -> str:
    return f"[{address}]" if ":" in address else address
