"""The parent of `lockgate serve --replicas N --balance kernel`: it supervises and serves nothing.

It starts the N replica processes (placed as `Placement` says; the kernel spreads the shared port's
connections over them) and starts again one that exits unasked, after a wait that doubles
with each exit that came soon after its start (`Backoff`); one that refuses its arguments
(status 2) stops them all, as it would one server. SIGTERM or SIGINT is passed on to
every replica, each of which drains; a second signal is passed on too (it ends their drains
at once), and replicas left `drain_timeout` + `KILL_GRACE` s after the first are killed. The
parent exits when every replica has: 0 when each exited cleanly after the signal, else 1. It
holds no socket: readiness, liveness and metrics are the replicas' own. A replica gets SIGTERM
when the parent dies, however it dies (`parent_death.py`), so none outlives it unsupervised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from dataclasses import dataclass, field

from lockgate.parent_death import child_env
from lockgate.router.replicas import Placement

log = logging.getLogger("lockgate.supervisor")

KILL_GRACE = 5.0  # seconds past the drain timeout before the replicas left are killed
USAGE_ERROR = 2  # `lockgate serve`'s status for bad arguments: another start would repeat it
# how a replica stopped by the signal may end: drained (0), or ended by the signal itself
# when it came before the replica had set up its handlers (it served nothing yet)
_CLEAN = frozenset({0, -signal.SIGTERM, -signal.SIGINT})


@dataclass(frozen=True, slots=True)
class Backoff:
    """Seconds before a replica that exited unasked starts again: `first`, doubled after each
    exit that came within `steady` seconds of its start, up to `longest`."""

    first: float = 1.0
    longest: float = 30.0
    steady: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.longest:
            raise ValueError(f"backoff: need 0 < first ({self.first}) <= longest ({self.longest})")
        if self.steady <= 0:
            raise ValueError(f"backoff: steady must be positive, not {self.steady}")

    def after(self, last: float, ran: float) -> float:
        """The wait after an exit `ran` s after its start; `last` is the wait before that
        start (0: none)."""
        if last <= 0 or ran >= self.steady:
            return self.first
        return min(self.longest, last * 2)


@dataclass(slots=True)
class Replica:
    """One replica: its `lockgate serve` arguments and the process running them now."""

    index: int
    argv: list[str]
    process: asyncio.subprocess.Process | None = None
    wait: float = 0.0  # the wait before its last start (0: none)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


@dataclass(slots=True)
class Supervisor:
    """Keeps the replicas running until a signal, then waits for them to drain."""

    replicas: list[Replica]
    drain_timeout: float
    placement: Placement
    backoff: Backoff = field(default_factory=Backoff)
    stopping: asyncio.Event | None = None  # set on the first signal

    @classmethod
    def of(cls, argvs: list[list[str]], drain_timeout: float, placement: Placement) -> Supervisor:
        return cls([Replica(i, argv) for i, argv in enumerate(argvs)], drain_timeout, placement)

    def run(self) -> int:
        """Supervise until a signal and every replica's exit: 0 when each exited cleanly."""
        return asyncio.run(self._run())

    async def _run(self) -> int:
        self.stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop, sig)
        codes = await asyncio.gather(*(self._keep(r, self.stopping) for r in self.replicas))
        unclean = {r.index: c for r, c in zip(self.replicas, codes, strict=True) if c not in _CLEAN}
        if unclean:
            log.warning("replicas that did not drain cleanly (index: status): %s", unclean)
        if USAGE_ERROR in unclean.values():
            return USAGE_ERROR
        return 1 if unclean else 0

    async def _keep(self, replica: Replica, stopping: asyncio.Event) -> int:
        """Run `replica` until the stop; its last exit status."""
        while True:
            started = time.monotonic()
            process = await self._start(replica, stopping)
            code = await process.wait()
            if stopping.is_set():
                return code
            if code == USAGE_ERROR:
                log.error("replica %d refused its arguments: stopping them all", replica.index)
                self._stop(signal.SIGTERM)
                return code
            replica.wait = self.backoff.after(replica.wait, time.monotonic() - started)
            log.warning(
                "replica %d (pid %d) exited with %s: starting it again in %.1f s",
                replica.index,
                process.pid,
                code,
                replica.wait,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), replica.wait)
                return code  # stopped while waiting

    async def _start(self, replica: Replica, stopping: asyncio.Event) -> asyncio.subprocess.Process:
        command = [sys.executable, "-m", "lockgate.cli", *replica.argv]
        process = await asyncio.create_subprocess_exec(
            *command,
            preexec_fn=self.placement.preexec(replica.index),
            env=self.placement.env(child_env()),  # it ends with this process (`parent_death.py`)
            process_group=0,  # a terminal's Ctrl-C reaches the parent alone, which passes it on
        )
        replica.process = process
        log.info("replica %d: pid %d", replica.index, process.pid)
        if stopping.is_set():  # the signal came while it was starting
            _signal(process, signal.SIGTERM)
        return process

    def _stop(self, sig: int) -> None:
        """Pass the signal on to every replica; kill those left after the drain."""
        assert self.stopping is not None
        if not self.stopping.is_set():
            log.info("signal %d: the replicas drain, then exit", sig)
            loop = asyncio.get_running_loop()
            loop.call_later(self.drain_timeout + KILL_GRACE, self._kill)
        self.stopping.set()
        for replica in self.replicas:
            if replica.process is not None and replica.running:
                _signal(replica.process, sig)

    def _kill(self) -> None:
        for replica in self.replicas:
            if replica.process is not None and replica.running:
                log.warning("replica %d still running after the drain: killed", replica.index)
                _signal(replica.process, signal.SIGKILL)


def _signal(process: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)
