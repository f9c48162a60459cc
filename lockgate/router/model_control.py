"""Model control through the router: a load or unload (Triton's model repository extension)
goes to every replica, not to one, and a replica that joins later is sent what it missed.

- **Fan-out.** `apply` sends the request, its body and headers as they came, to every replica
  the pool knows (but those gone from discovery), of every group (a canary's or a shadow's
  replicas serve the same models), ready or not (one with no model loaded says not ready),
  concurrently, within the request's deadline. Its answer is 200 when every replica answered
  200; else the status of the first replica, in the pool's order, that did not (502 when it
  gave no answer, 504 when the deadline passed first), with a Triton-style `{"error": ...}`
  that names each replica that failed and why. A request that some replica applied is
  remembered (`control_log.py`).
- **Catching up.** A replica that was not told a request (it gave no answer, or the deadline
  passed first) leaves the rotation, and so does one that started again with its start-up's
  models (its health answer reports another boot id, or a probe could not reach one that
  reports none: `pool.py`). When a probe says 200 again the pool asks `join`: the remembered
  requests it lacks are replayed to it in order (all of them after it started again), and
  only then does it take traffic. A replayed request the
  replica refuses is logged and counted, and the replica joins without it; one that gets no
  answer within `replay_timeout` keeps it out until a later probe.
- One control request at a time: fan-outs and joins hold one lock, so every replica is told
  the requests in the same order.
- **Across restarts** (`--control-state`): the requests kept, and what each replica's process
  was told, are written to a file after each fan-out and join, before its answer
  (`control_state.py`), and read back when the router starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from lockgate.core.metrics import Registry
from lockgate.router import control_state
from lockgate.router.control_log import Control, ControlLog, Entry
from lockgate.router.control_state import ControlState, Known
from lockgate.router.pool import ReplicaPool
from lockgate.router.replica import Replica
from lockgate.router.whole_answer import DEADLINE, whole_answer

log = logging.getLogger("lockgate.router")
_encode = msgspec.json.Encoder().encode
_MAX_REASON = 500  # characters of one replica's error passed on
# the router's own, for each replica: its deadline then, and a plain answer it reads itself
_OWN_HEADERS = frozenset({b"request-timeout", b"accept-encoding"})


@dataclass(frozen=True, slots=True)
class ControlSettings:
    replay_timeout: float = 600.0  # seconds for a replica that joins to apply one request
    max_remembered_bytes: int = 256 * 2**20  # bodies and headers kept to replay
    state: Path | None = None  # the file they are kept in across restarts (None: none)

    def __post_init__(self) -> None:
        if not self.replay_timeout > 0:
            raise ValueError("--control-replay-timeout must be > 0")
        if self.max_remembered_bytes < 0:
            raise ValueError("--control-memory-mb must be >= 0")


@dataclass(frozen=True, slots=True)
class Told:
    """One replica's outcome of a control request: its status (0: no answer) and body, or
    why it gave none."""

    replica: Replica
    status: int
    body: bytes = b""
    why: str = ""

    @property
    def reason(self) -> str:
        if self.status == 0:
            return self.why
        try:
            message = json.loads(self.body).get("error")
        except (ValueError, AttributeError):
            message = None
        text = message if isinstance(message, str) else self.body.decode(errors="replace")
        return f"{self.status}: {text[:_MAX_REASON]}"


@dataclass(frozen=True, slots=True)
class ControlAnswer:
    status: int
    body: bytes  # JSON

    @property
    def message(self) -> str:
        """The error the body gives ('' for none)."""
        error = json.loads(self.body).get("error", "") if self.status != 200 else ""
        return str(error)

    @classmethod
    def of(cls, control: Control, told: Sequence[Told]) -> ControlAnswer:
        """200 when every replica answered 200; else the first other status, naming each
        replica that failed."""
        failed = [t for t in told if t.status != 200]
        if not failed:
            return cls(200, b"{}")
        first = failed[0]
        status = first.status or (504 if first.why == DEADLINE else 502)
        applied = len(told) - len(failed)
        where = "; ".join(f"{t.replica.url}: {t.reason}" for t in failed)
        message = (
            f"{control.action} of model '{control.model}' failed on {len(failed)} of "
            f"{len(told)} replicas (applied on {applied}): {where}"
        )
        if any(t.status == 0 for t in failed) and applied:
            message += " (a replica not reached is sent it before it takes traffic again)"
        return cls(status, _encode({"error": message}))


class ModelControl:
    def __init__(self, pool: ReplicaPool, settings: ControlSettings, registry: Registry) -> None:
        self.pool = pool
        self.settings = settings
        limit = settings.max_remembered_bytes
        state = ControlState(ControlLog(limit))
        if settings.state is not None:
            state = control_state.read(settings.state, limit)
        self.log = state.log
        # replicas' processes that the router before this one told requests, by URL, until
        # a probe reads a replica's boot id (`told_before`)
        self.known = state.replicas
        self.saved: tuple[int, dict[str, Known]] | None = None  # what the file holds
        self.lock = asyncio.Lock()
        pool.joiner = self
        self.sent = registry.counter(
            "lockgate_router_model_control_total",
            "Model loads and unloads sent to each replica, by action, way ('request': a "
            "client's, fanned out; 'replay': to a replica that joined) and outcome ('ok', "
            "'refused': an answer other than 200, 'unreached': none).",
            ("action", "way", "outcome"),
        )
        self.forgotten = registry.counter(
            "lockgate_router_model_control_forgotten_total",
            "Model control requests not kept to replay, past --control-memory-mb.",
        )
        held = registry.gauge(
            "lockgate_router_model_control_remembered_bytes",
            "Bytes of model control requests kept to replay to replicas that join.",
        )
        held.set_function((), lambda: float(self.log.size))
        self.unsaved = registry.counter(
            "lockgate_router_model_control_state_failures_total",
            "Writes of --control-state that failed (the file keeps what it held before).",
        )

    async def apply(
        self,
        control: Control,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        deadline: float | None,
    ) -> ControlAnswer:
        """Send a control request to every replica (`deadline`: on the monotonic clock, None
        for none), remember it when one applied it, and answer for all of them."""
        headers = [(k, v) for k, v in headers if k not in _OWN_HEADERS]
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                await self.lock.acquire()
        except TimeoutError:
            return ControlAnswer(504, _encode({"error": "deadline passed in the router"}))
        try:
            return await self._apply(control, headers, body, deadline)
        finally:
            self.lock.release()

    async def _apply(
        self,
        control: Control,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        deadline: float | None,
    ) -> ControlAnswer:
        targets = [r for r in self.pool.replicas if not r.removed]
        if not targets:
            return ControlAnswer(503, _encode({"error": "no replica is known"}))
        told = await asyncio.gather(
            *(self._tell(r, control, headers, body, deadline) for r in targets)
        )
        before = self.log.seq
        if any(t.status == 200 for t in told):
            self._remember(control, headers, body)
        for t in told:
            outcome = "ok" if t.status == 200 else "refused" if t.status else "unreached"
            self.sent.inc((control.action, "request", outcome))
            if t.status == 0:  # out of traffic until it is told (`join`)
                log.warning("router: %s was not told %s: %s", t.replica.url, control.path, t.why)
                t.replica.ready = False
            elif t.replica.told == before:  # it was up to date, and is still
                t.replica.told = self.log.seq
        await self._save()
        return ControlAnswer.of(control, told)

    def _remember(self, control: Control, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if not self.log.record(Entry(control, tuple(headers), body)):
            self.forgotten.inc()
            log.warning(
                "router: %s not kept to replay (past --control-memory-mb): a replica that "
                "joins keeps model '%s' as its start-up leaves it",
                control.path,
                control.model,
            )

    async def _tell(
        self,
        replica: Replica,
        control: Control,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        deadline: float | None,
    ) -> Told:
        """One replica's answer to the request, read whole."""
        answer = await whole_answer(replica, "POST", control.path, headers, body, deadline)
        return Told(replica, answer.status, answer.body, answer.why)

    async def _save(self) -> None:
        """Write the requests kept, and what each replica's process was told, to
        `--control-state` when they changed since the last write."""
        path = self.settings.state
        if path is None:
            return
        replicas = dict(self.known)  # not seen by this router yet: as the one before left them
        for r in self.pool.replicas:
            if r.boot is not None and not r.removed:
                replicas[r.url] = Known(r.boot, r.told)
        if self.saved == (self.log.seq, replicas):
            return
        try:
            await asyncio.to_thread(
                control_state.write, path, control_state.saved(self.log, replicas)
            )
        except OSError as exc:
            self.unsaved.inc()
            log.warning("router: cannot write the model control state %s: %s", path, exc)
            return
        self.saved = (self.log.seq, replicas)

    def behind(self, replica: Replica) -> bool:
        return replica.told < self.log.seq

    def told_before(self, replica: Replica, boot: bytes) -> int:
        """What the process of `replica` that reports `boot` was told before this router
        started, by the router before it (0: nothing known)."""
        known = self.known.pop(replica.url, None)
        return known.told if known is not None and known.boot == boot else 0

    async def join(self, replica: Replica) -> bool:
        """Replay the remembered control requests `replica` lacks to it; False when one got
        no answer (it stays out of traffic, and a later probe tries again)."""
        async with self.lock:
            joined = await self._replay(replica)
            await self._save()
            return joined

    async def _replay(self, replica: Replica) -> bool:
        for entry in self.log.since(replica.told):
            control = entry.control
            deadline = time.monotonic() + self.settings.replay_timeout
            told = await self._tell(replica, control, list(entry.headers), entry.body, deadline)
            outcome = "ok" if told.status == 200 else "refused" if told.status else "unreached"
            self.sent.inc((control.action, "replay", outcome))
            if told.status == 0:
                log.warning(
                    "router: %s joins later: %s got no answer (%s)",
                    replica.url,
                    control.path,
                    told.why,
                )
                return False
            if told.status != 200:
                log.warning(
                    "router: %s refused %s replayed to it (%s): it joins without it",
                    replica.url,
                    control.path,
                    told.reason,
                )
            replica.told = entry.seq
        replica.told = self.log.seq
        return True


def _loop_time(deadline: float | None) -> float | None:
    """A `time.monotonic()` deadline on the event loop's clock (the same clock in CPython's
    loops and uvloop, but not by contract)."""
    if deadline is None:
        return None
    loop = asyncio.get_running_loop()
    return loop.time() + (deadline - time.monotonic())
