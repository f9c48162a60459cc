"""Run the server: uvicorn (uvloop, httptools) in front of the app, models loading behind it.

The HTTP port opens at once so liveness answers while models load; readiness turns true when
the repository has been loaded and warmed up. SIGTERM or SIGINT starts the drain: the port
stays open, readiness answers 503 and new inference requests get 503, while admitted
requests finish within `drain_timeout`; then the port closes and the process exits with 0.
A second signal ends the drain at once. With `reuse_port` the port is shared with other
processes (SO_REUSEPORT) and listened on only once start-up is complete, so the kernel gives
no connection to a process still loading; `private_port`, this process's alone, opens at once.

The gRPC server (KServe v2 / Triton's GRPCInferenceService, `grpc_port`, 8001 by default)
runs on the same loop and shares the app; on the drain it refuses new RPCs at once and
lets those in flight finish within `drain_timeout`.

The request head (request line and headers) is bounded by `max_head_bytes`: past it the
client gets 431 and the connection closes, so a header flood cannot grow memory. Requests
the HTTP parser rejects get a JSON 400 like every other error.

With `--accepts-per-turn` > 0, connections are accepted on a thread of their own
(`frontend/acceptor.py`), which answers the kubelet's health probes there and hands the rest to
the loop; by default the loop accepts them itself (one a turn). A probe is answered by the
protocol in the read that brings it (`frontend/probe.py`).

A POST whose head arrives whole is judged on arrival, from its raw bytes, by the connection
gate and its model's admission (`_Protocol.data_received`): a refusal is a split of the head
(`frontend/arrival.py`; a connection sending the same head again reuses its last) and a canned
503, with no parser callback, no scope and no task, and the body is dropped as it arrives.
Under overload most requests are refusals, and they take CPU from the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httptools
import msgspec
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lockgate.core.bare_model import BareModel
from lockgate.core.heap import freeze_heap
from lockgate.core.manager import ModelManager, ServingSettings
from lockgate.core.metrics import Counter, Registry, Tally
from lockgate.errors import BadRequest, ServingError, Unavailable
from lockgate.frontend.acceptor import Acceptor
from lockgate.frontend.access_log import new_request_id, request_id
from lockgate.frontend.app import App, ServerSettings
from lockgate.frontend.arrival import HeadCache, LastHead, PostHead, request_timeout
from lockgate.frontend.cors import origin_of
from lockgate.frontend.gate import Gate, GateSettings
from lockgate.frontend.health_port import HealthPort, HealthState, response_bytes
from lockgate.frontend.http import Disconnect, compressed
from lockgate.frontend.lane import BodiesArriving, Lane, LaneRequest, lane_target, reply_bytes
from lockgate.frontend.probe import Probe, probe_of
from lockgate.frontend.thread_clock import ThreadClock
from lockgate.protocol import readiness
from lockgate.protocol.openai import error_body, openai_path
from lockgate.protocol.v2_codec import encode_error

log = logging.getLogger("lockgate.server")

Extension = Callable[[App], Awaitable[None]]


@dataclass(slots=True)
class ServeOptions:
    repository: Path | None
    bare: BareModel | None = None  # `repository` names one model file, not a repository
    host: str = "127.0.0.1"
    port: int = 8000
    drain_timeout: float = 30.0
    backlog: int = 2048
    # > 0: connections accepted on a thread (frontend/acceptor.py), this many opened by the
    # loop per turn; 0: the loop accepts them itself, one a turn
    accept_per_turn: int = 0
    max_head_bytes: int = 64 * 1024  # request line and headers, as nginx's 4 x 8 KiB and more
    # idle seconds before a kept-alive connection closes: longer than the idle timeout of the
    # proxies in front (60 s on AWS ALB and nginx), so they never reuse a connection this end
    # is closing, which the client would see as a reset
    keep_alive_timeout: int = 75
    http: ServerSettings = field(default_factory=ServerSettings)
    gate: GateSettings = field(default_factory=GateSettings)  # connection and saturation limits
    serving: ServingSettings = field(default_factory=ServingSettings)
    extensions: list[Extension] = field(default_factory=list)  # e.g. the LLM engine
    grpc_port: int | None = 8001  # None: no gRPC server
    grpc_port_required: bool = False  # True: a port that cannot be bound stops start-up
    grpc_max_concurrent_rpcs: int | None = 1024
    grpc_max_stream_inflight: int = 64  # requests of one stream read and not yet answered
    # share `port` (and the gRPC port) with other processes through SO_REUSEPORT: the kernel
    # spreads new connections over those listening; this one listens once started
    reuse_port: bool = False
    private_port: int | None = None  # also serve HTTP here, on `host`, for this process alone
    health_port: int | None = None  # probes answered from a thread of their own (health_port.py)
    health_stale_s: float = 10.0  # the loop silent this long: liveness on health_port says 503


class HeadTooLarge(httptools.HttpParserCallbackError):
    """The request line and headers are over the limit."""


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol behind lockgate's connection gate (`frontend/gate.py`):
    a bounded request head that must arrive within a time limit, connection caps, refusal
    before the body is read when the loop is saturated, and JSON parser errors.

    Each request's scope carries `lockgate.received`: the `time.monotonic()` at which its
    first bytes were parsed, so deadlines count the time spent in front of the app."""

    max_head_bytes = 64 * 1024
    gate: Gate
    refusals: _RefusalCount
    lockgate_app: App
    lane_bodies = BodiesArriving()  # the server's lane requests whose body is still to come
    heads = HeadCache()  # the POST heads split lately, by the server's connections

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # the gate counts requests in progress, not connections
        self.head_bytes = 0
        self.head_too_large = False
        self.address = ""
        self.counted = False  # this connection is in the gate's table
        self.head_timer: asyncio.TimerHandle | None = None
        self.received = 0.0
        self.arrived = 0.0  # when the next request is taken to have arrived; 0: when read
        self.penalized = False  # what arrives is held, not parsed, until a pause ends
        self.held = b""  # bytes that arrived during the pause, or before their replay
        self.held_at = 0.0  # when the first of them arrived
        self.replaying = False  # the pause ended: the held bytes are parsed at the next turn
        self.resumed = 0.0  # when the last pause ended: the front end's queue starts there
        self.pause_timer: asyncio.TimerHandle | None = None
        self.refusing = False  # a refused request's body is being skipped
        self.in_head = False  # part of a request head has arrived, not all of it
        self.between = True  # the parser is between messages: a new head may be read here
        self.skip = 0  # body bytes of a request refused on arrival still to be dropped
        self.vetted = False  # the head being parsed was already let through on arrival
        self.last_head = LastHead(self.heads)  # the last POST head split on arrival
        self.disconnect = Disconnect()  # tells the handlers on this connection it closed
        self.lane = Lane()  # the inference request answered below ASGI (`frontend/lane.py`)
        self.body_arriving = False  # an ASGI request let through, its body not yet all in
        self.idle_since = 0.0  # when the connection last fell idle (`_keep_alive`); 0: busy
        self.idle_timer: asyncio.TimerHandle | None = None

    # -- connections -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.address = self.client[0] if self.client else ""
        why = self.gate.connect(self.address)
        if why is not None:
            self.refusals.inc(why)
            transport.abort()
            return
        self.counted = True
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disconnect.close()
        if self.lane.task is not None:
            self.lane.task.cancel("client disconnected")
        self._lane_body_ended()
        self._asgi_body_ended()
        if self.counted:
            self.counted = False
            self.gate.disconnect(self.address)
        self._cancel_head_timer()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self.head_timer is None:
            timeout = self.gate.settings.head_timeout
            self.head_timer = self.loop.call_later(timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        self.refusals.inc("head_timeout")
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined head stalled behind a running request
            return
        if self.in_head:
            text = f"request head not received within {self.gate.settings.head_timeout:g} s"
            self._write_error(408, text, close=True)
        self.transport.close()

    # -- requests refused on arrival -------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        """Bytes from the client. A POST whose head is all in, at a message boundary, is
        judged here from the raw bytes (`_arrival`), before the HTTP parser sees any of it: a
        refused one costs a split of its head and a canned answer, and its body is dropped
        as it arrives. Everything else goes to the parser."""
        if self.penalized or self.replaying:
            self._hold(data)
            return
        if self.lane.task is not None:  # answers leave in order: this waits for the lane's
            self.lane.held += data
            self.flow.pause_reading()
            return
        if self.lane.waiting is not None:  # the body of the lane's next request
            self._lane_body(data)
            return
        if self.skip:
            dropped = min(self.skip, len(data))
            self.skip -= dropped
            data = data[dropped:]
            if not self.skip:
                self._cancel_head_timer()
                self._keep_alive()
            if not data:
                return
        while self.between and not self.transport.is_closing():
            if data[:5] == b"POST ":
                used = self._arrival(data)
            elif data[:4] in (b"GET ", b"HEAD"):
                used = self._probe(data)
            else:
                break
            if used == 0:
                break
            data = data[used:]
            if not data or self.skip:
                return
        super().data_received(data)

    def _arrival(self, data: bytes) -> int:
        """Judge the request head at the start of `data`: the bytes it and its body took
        when it was refused, or the lane took it (all of `data` when the body is still to
        come), or 0 when it goes to the parser (let through, or anything this reading does
        not handle: a head not yet complete, or one `arrival.split_head` leaves to it)."""
        end = data.find(b"\r\n\r\n", 0, self.max_head_bytes)
        if end < 0 or (self.cycle is not None and not self.cycle.response_complete):
            return 0
        head = self.last_head.of(data, end)
        if head is None:
            return 0
        now = time.monotonic()
        received = self.arrived or now
        app = self.lockgate_app
        why = self.gate.admit(head.path, self._in_progress(), now, app.models.loading > 0)
        if why is not None:
            body, retry = _saturated(head.path), self.gate.retry_after(now)
            return self._refuse_arrival(head, data, why, body, retry, received, now)
        if head.target is not None and head.timed:
            wait = self.gate.loop_cost.wait(self._loop_work_ahead())
            error = app.early_refusal(head.target, head.timeout, received, now, wait)
            if error is not None:
                body, retry = _ADMISSION_REFUSAL.of(error)
                why = "model_admission"
                return self._refuse_arrival(head, data, why, body, retry, received, now)
        target = head.target if self._lane_open(head.headers) else None
        if target is not None and head.length <= app.settings.max_body_bytes:
            request = LaneRequest(*target, head.path, head.headers, b"", received, not head.close)
            self._take_lane(request, head.length, data[head.size :], now)
            return len(data)
        self.vetted = True  # the parser reads the same head next, in this same call
        self.arrived = received
        return 0

    def _refuse_arrival(
        self,
        head: PostHead,
        data: bytes,
        why: str,
        body: bytes,
        retry: int,
        received: float,
        now: float,
    ) -> int:
        """Answer the head at the start of `data` 503 with `body` and Retry-After `retry`,
        before its body: the bytes it and its body took (all of `data` when the body is still
        to come, to be dropped as it arrives)."""
        self.refusals.inc(why)
        self._cancel_head_timer()
        self.arrived = 0.0
        close = head.close or head.length > DISCARD_BYTES
        rid = head.request_id or new_request_id()
        self._write_refusal(body, retry, rid, close)
        access = self.lockgate_app.access
        if access.enabled:
            access.refused(rid, b"POST", head.path, received, self.address, why)
        pause = self.gate.refused(now, self._arrival_budget, received < self.resumed)
        if close:
            return len(data)
        size = head.size + head.length
        if size > len(data):  # the body is still to come, within the head timeout
            self.skip = size - len(data)
            self._arm_head_timer()
            return len(data)
        if pause > 0:
            self._penalize(pause)  # (the keep-alive timer waits for the resume)
        else:
            self._keep_alive(now)
        return size

    def _arrival_budget(self) -> float | None:
        """The time budget of the head refused on arrival a moment ago (the connection's last
        head), asked by the gate when it pauses the connection."""
        head = self.last_head.head
        if head is None or not head.timed:
            return None
        return self.lockgate_app.budget(head.target, head.timeout)

    def _probe(self, data: bytes) -> int:
        """Answer the health probe at the start of `data` here (`frontend/probe.py`): the
        bytes it took (all of `data` when the connection closes after it), or 0 when it
        goes to the parser."""
        if self.cycle is not None and not self.cycle.response_complete:
            return 0  # behind a request in progress: answers leave in order
        probe = probe_of(data, self.max_head_bytes, self.arrived or time.monotonic())
        reply = None if probe is None else self.lockgate_app.probe_reply(probe)
        if probe is None or reply is None:
            return 0
        whole = reply_bytes(reply, self.server_state.default_headers, probe.keep_alive)
        self.transport.write(whole[: len(whole) - len(reply.body)] if probe.head else whole)
        self.server_state.total_requests += 1
        self._cancel_head_timer()
        self.arrived = 0.0
        if not probe.keep_alive:
            self.transport.close()
            return len(data)
        self._keep_alive()
        return probe.size

    def _lane_open(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether this request may be answered from the lane: not one from a browser page
        of another origin when CORS is on (its answer carries headers only the app adds)."""
        app = self.lockgate_app
        return app.lane_open and (app.cors is None or origin_of(headers) is None)

    def _in_progress(self) -> int:
        """Requests let through and not yet answered: ASGI and lane tasks, and lane requests
        whose body is still arriving."""
        return len(self.tasks) + self.lane_bodies.count

    def _loop_work_ahead(self) -> int:
        """Requests in progress whose handlers the event loop runs before one let through
        now: not those still waiting for their body, the ASGI tasks waiting for theirs (a lane
        request waiting for its body has no task yet)."""
        return len(self.tasks) - self.lane_bodies.asgi

    def _asgi_body_ended(self) -> None:
        if self.body_arriving:
            self.body_arriving = False
            self.lane_bodies.asgi -= 1
            self.gate.bodies.end(self.address, self)

    def _body_evicted(self) -> None:
        """Every place is taken, a new request needs one, and this connection's request has
        been sending its body for longer than the gate's `slow_body`: its place is taken back
        (`BodyWaits`). It is answered 503 with Retry-After, and the connection closes with the
        rest of its body unread (an ASGI handler waiting on it sees the client gone)."""
        self.refusals.inc("slow_body")
        waiting = self.lane.waiting
        if waiting is not None:
            method, path, headers, received = (
                b"POST",
                waiting.path,
                waiting.headers,
                waiting.received,
            )
            self._lane_body_ended()
            self.lane.waiting = None
        else:
            self._asgi_body_ended()
            if self.cycle is None or self.cycle.response_started:  # answered without its body
                self.transport.close()
                return
            method, path = self.parser.get_method(), self.url.partition(b"?")[0].decode("latin-1")
            headers, received = self.headers, self.received
        rid = request_id(headers)
        self._write_refusal(_SATURATED, self.gate.retry_after(time.monotonic()), rid, close=True)
        access = self.lockgate_app.access
        if access.enabled:
            access.refused(rid, method, path, received, self.address, "slow_body")

    # -- the lane ------------------------------------------------------------------------
    def _take_lane(self, request: LaneRequest, length: int, after_head: bytes, now: float) -> None:
        """Answer `request` from this protocol (`frontend/lane.py`): at once when its body is
        in `after_head`, else once the rest of it has arrived."""
        self.gate.let_through(now)
        front_delay = self.lockgate_app.front_delay
        if front_delay is not None:  # (a pause's wait is the gate's own, not a queue)
            front_delay(now - max(request.received, self.resumed), now)
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        self.arrived = 0.0
        if len(after_head) >= length:  # the body came with its head (the common case)
            request.body = after_head[:length]
            self._start_lane(request, after_head[length:])
            return
        self.lane.wait_for_body(request, length, after_head)
        self.lane_bodies.count += 1
        self.gate.bodies.start(self.address, self, now, self._body_evicted)
        timeout = self.lockgate_app.settings.body_timeout_s
        self.lane.body_timer = self.loop.call_later(timeout, self._lane_body_timed_out)

    def _lane_body(self, data: bytes) -> None:
        whole, rest = self.lane.feed(data)
        if whole is not None:
            self._lane_body_ended()
            self._start_lane(whole, rest)

    def _start_lane(self, request: LaneRequest, rest: bytes) -> None:
        if rest:  # pipelined: read once this one is answered
            self.lane.held += rest
            self.flow.pause_reading()
        self._run_lane(request)

    def _lane_body_ended(self) -> None:
        if self.lane.body_timer is not None:  # it was waited for
            self.lane.body_timer.cancel()
            self.lane.body_timer = None
            self.lane_bodies.count -= 1
            self.gate.bodies.end(self.address, self)

    def _lane_body_timed_out(self) -> None:
        self.lane.body_timer = None
        self.lane.waiting = None
        self.lane_bodies.count -= 1
        self.gate.bodies.end(self.address, self)
        if not self.transport.is_closing():
            timeout = self.lockgate_app.settings.body_timeout_s
            self._write_error(408, f"request body not received within {timeout:g} s", True)

    def _run_lane(self, request: LaneRequest) -> None:
        """Run `request` in a task of its own, counted with the ASGI ones (the gate's
        requests in progress, the graceful shutdown)."""
        arriving = self.lockgate_app.models.arriving
        arriving.add(request.name)
        task = self.loop.create_task(self._lane(request))
        task.add_done_callback(functools.partial(self._lane_done, request))
        self.tasks.add(task)
        self.lane.task = task

    def _lane_done(self, request: LaneRequest, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not request.started:  # cancelled before its first step
            self.lockgate_app.models.arriving.started(request.name)

    async def _lane(self, request: LaneRequest) -> None:
        request.started = True
        self.lockgate_app.models.arriving.started(request.name)
        app = self.lockgate_app
        try:
            reply = await app.infer_lane(request)
            coding = app.response_coding(request.headers)
            if coding is not None:
                reply = await compressed(reply, coding, app.compressing)
        finally:
            self.lane.task = None
        if self.transport.is_closing():
            return
        keep = request.keep_alive and not self.lane.closing
        self.transport.write(reply_bytes(reply, self.server_state.default_headers, keep))
        self.server_state.total_requests += 1
        if not keep:
            self.transport.close()
            return
        held = self.lane.take_held()
        self.flow.resume_reading()
        if held:
            self.data_received(held)
        else:
            self._keep_alive()

    def shutdown(self) -> None:
        """The server is stopping: a connection whose request is on the lane (its body
        arriving, or running) closes once it is answered; others as uvicorn closes them."""
        if self.lane.task is not None or self.lane.waiting is not None:
            self.lane.closing = True
            return
        super().shutdown()

    def _keep_alive(self, now: float | None = None) -> None:
        """An idle keep-alive connection closes after uvicorn's keep-alive timeout. Its timer
        outlives the connection's requests: an answer marks when the idleness began, a request
        clears the mark (`_unset_keepalive_if_required`), and the timer, when it fires, closes
        the connection if it has been idle for the whole timeout, or waits for what is left of
        it. (A timer made and cancelled for every request cost more than the mark.)"""
        if self.timeout_keep_alive_task is not None:  # uvicorn's own, armed by an ASGI answer
            super()._unset_keepalive_if_required()
        self.idle_since = time.monotonic() if now is None else now
        if self.idle_timer is None:
            self.idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_timed_out)

    def _unset_keepalive_if_required(self) -> None:
        self.idle_since = 0.0
        super()._unset_keepalive_if_required()

    def _idle_timed_out(self) -> None:
        self.idle_timer = None
        if not self.idle_since:  # a request since: the next answer arms the timer again
            return
        left = self.idle_since + self.timeout_keep_alive - time.monotonic()
        if left > 0:
            self.idle_timer = self.loop.call_later(left, self._idle_timed_out)
            return
        self.timeout_keep_alive_handler()

    # -- request heads -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.between = False
        super().on_message_begin()
        self.received = self.arrived or time.monotonic()
        self.arrived = 0.0
        self.scope["lockgate.received"] = self.received  # type: ignore[typeddict-unknown-key]
        if self.resumed > self.received:  # the front end's queue starts at the pause's end
            self.scope["lockgate.queued"] = self.resumed  # type: ignore[typeddict-unknown-key]
        self.scope["lockgate.disconnect"] = self.disconnect  # type: ignore[typeddict-unknown-key]
        self.head_bytes = 0
        self.in_head = True
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self.in_head = False
        if self.vetted:  # let through on arrival, a moment ago
            self.vetted = False
            self.gate.let_through(time.monotonic())
        elif self.cycle is None or self.cycle.response_complete:  # not behind a pipelined one
            now = time.monotonic()
            path = self.url.partition(b"?")[0].decode("latin-1")
            target = lane_target(path)
            try:
                timeout = request_timeout(self.headers)
            except BadRequest:  # the route answers it (400) with its message
                target, timeout = None, None
            loading = self.lockgate_app.models.loading > 0
            why = self.gate.admit(path, self._in_progress(), now, loading)
            if why is not None:
                budget = functools.partial(self.lockgate_app.budget, target, timeout)
                self._refuse(_saturated(path), self.gate.retry_after(now), why, path, budget, now)
                return
            if target is not None and self.parser.get_method() == b"POST":
                wait = self.gate.loop_cost.wait(self._loop_work_ahead())
                app = self.lockgate_app
                error = app.early_refusal(target, timeout, self.received, now, wait)
                if error is not None:
                    body, retry = _ADMISSION_REFUSAL.of(error)
                    budget = functools.partial(app.budget, target, timeout)
                    self._refuse(body, retry, "model_admission", path, budget, now)
                    return
            self.gate.let_through(now)
        starts = self.cycle is None or self.cycle.response_complete  # its task, now
        super().on_headers_complete()
        if starts and not self.body_arriving:  # until on_message_complete, or connection_lost
            self.body_arriving = True
            self.lane_bodies.asgi += 1
            self.gate.bodies.start(self.address, self, time.monotonic(), self._body_evicted)

    def _refuse(
        self,
        body: bytes,
        retry: int,
        reason: str,
        path: str,
        budget: Callable[[], float | None],
        now: float,
    ) -> None:
        """Answer 503 now, before the body. A small declared body is then skipped as it
        arrives, unparsed, and the connection stays open: closing it would make a client
        that sends again pay a new connection, and the server accept it, at the worst time.
        A large, unknown (chunked) or unwanted body closes the connection."""
        self.refusals.inc(reason)
        declared = None
        for name, value in self.headers:
            if name == b"content-length":
                declared = int(value) if value.isdigit() and len(value) <= 18 else None
        keep = self.parser.should_keep_alive() and declared is not None
        keep = keep and declared is not None and declared <= DISCARD_BYTES
        rid = request_id(self.headers)
        self._write_refusal(body, retry, rid, close=not keep)
        self.refusing = True  # the body's bytes are dropped until the message ends
        access = self.lockgate_app.access
        if access.enabled:
            access.refused(rid, self.parser.get_method(), path, self.received, self.address, reason)
        pause = self.gate.refused(now, budget, self.received < self.resumed)
        if keep:
            self._arm_head_timer()  # and must arrive within the head timeout
            if pause > 0:
                self._penalize(pause)

    def _penalize(self, pause: float) -> None:
        """A client resending at once: what its connection sends is held, not parsed, for up
        to `pause` seconds, or until an answer frees room for it (`Gate.hold`). A request
        sent meanwhile is taken to have arrived when its bytes did: its deadline and its
        admission count the wait it had.

        The bytes are read as they come and held (past `DISCARD_BYTES`, the kernel holds the
        rest): stopping the reads and asking the kernel when the unread bytes arrived (a
        receive stamp, peeked at the end) cost about 9 µs a refusal more: two changes to the
        loop's poll and a peek that takes a socket object, where a refusal costs about 12."""
        if self.penalized:
            return
        self.penalized = True
        self.pause_timer = self.loop.call_later(pause, self._resume_after_penalty)
        self.gate.hold(self._resume_after_penalty)

    def _hold(self, data: bytes) -> None:
        """Bytes that arrived while the connection is paused: held for the pause's end."""
        if not self.held:
            self.held_at = time.monotonic()
        self.held += data
        if len(self.held) > DISCARD_BYTES:  # the kernel holds the rest
            self.flow.pause_reading()

    def _resume_after_penalty(self) -> bool:
        """End the pause: what was held is parsed at the loop's next turn (an answer that
        resumes the connection runs in another request's task); False when there was nothing
        to resume (it was resumed already, by an answer or by its timer, or it closed)."""
        if not self.penalized:
            return False
        self.penalized = False
        if self.pause_timer is not None:
            self.pause_timer.cancel()
            self.pause_timer = None
        if self.transport.is_closing():
            return False
        self.resumed = time.monotonic()
        self.replaying = True
        self.loop.call_soon(self._replay)
        return True

    def _replay(self) -> None:
        """Parse what arrived during the pause, taken to have arrived when it did; with
        nothing, the connection is idle from now on."""
        self.replaying = False
        held, self.held = self.held, b""
        if len(held) > DISCARD_BYTES:  # (`_hold` left the rest to the kernel)
            self.flow.resume_reading()
        if self.transport.is_closing():
            return
        if not held:
            self._keep_alive()
            return
        self.arrived = self.held_at
        self.data_received(held)

    def on_body(self, body: bytes) -> None:
        if not self.refusing:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self.between = True
        self._asgi_body_ended()
        # the body is all in: reading it needs no timer (`HttpRequest.body`)
        self.scope["lockgate.body_complete"] = True  # type: ignore[typeddict-unknown-key]
        if self.refusing:  # the refused request's body is all skipped: the next may come
            self.refusing = False
            self._cancel_head_timer()
            if not self.transport.is_closing():
                self._keep_alive()
            return
        super().on_message_complete()

    def _count(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > self.max_head_bytes:
            self.head_too_large = True
            raise HeadTooLarge(f"request head is over {self.max_head_bytes} bytes")

    # -- canned answers ------------------------------------------------------------------
    def _write_refusal(self, body: bytes, retry: int, rid: bytes, close: bool) -> None:
        head = _REFUSAL_HEAD.of(self.server_state.default_headers)
        self.transport.write(
            b"%scontent-length: %d\r\nretry-after: %d\r\nx-request-id: %s\r\n%s\r\n%s"
            % (head, len(body), retry, rid, _CLOSE if close else b"", body)
        )
        if close:
            self.transport.close()

    def _write_error(self, status: int, text: str, close: bool) -> None:
        body = encode_error(text)
        head = [b"HTTP/1.1 %d %s" % (status, _REASONS[status])]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json", b"content-length: %d" % len(body)]
        if close:
            head.append(b"connection: close")
        self.transport.write(b"\r\n".join([*head, b"", body]))
        if close:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.refusals.inc("head_too_large" if self.head_too_large else "invalid_http")
        if self.head_too_large:
            self._write_error(
                431, f"request line and headers are over {self.max_head_bytes} bytes", True
            )
        else:
            self._write_error(400, "invalid HTTP request", close=True)

    def _unsupported_upgrade_warning(self) -> None:
        """An `Upgrade` request (WebSocket, h2c) is served as plain HTTP: lockgate has no
        route to upgrade, and one log line a request would let any client fill the log."""


class _ParserErrorFilter(logging.Filter):
    """uvicorn logs a warning for every request its parser refuses: a client sending garbage
    in a loop would write a line each time. They are counted instead
    (`lockgate_http_refused_total{reason="invalid_http"}`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "Invalid HTTP request received."


def _quiet_parser_errors() -> None:
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _ParserErrorFilter) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(_ParserErrorFilter())


class _RefusalCount:
    """`lockgate_http_refused_total` by reason, counted on tallies (`core.metrics.Tally`: the
    protocol runs on the loop's thread), each found by its reason alone: under overload most
    requests are refusals."""

    __slots__ = ("counter", "tallies")

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.tallies: dict[str, Tally] = {}

    def inc(self, reason: str) -> None:
        tally = self.tallies.get(reason)
        if tally is None:
            tally = self.tallies[reason] = self.counter.tally((reason,))
        tally.count += 1


class _CannedHead:
    """A 503's head up to its content type, rebuilt only when the server's default headers
    change (uvicorn replaces their list once a second, for the date): a refusal then costs
    one formatting of its own few headers."""

    __slots__ = ("head", "headers")

    def __init__(self) -> None:
        self.headers: object = None  # the default headers' list the head was built from
        self.head = b""

    def of(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        if headers is not self.headers:
            lines = [b"HTTP/1.1 503 Service Unavailable"]
            lines += [name + b": " + value for name, value in headers]
            lines.append(b"content-type: application/json")
            self.head = b"\r\n".join(lines) + b"\r\n"
            self.headers = headers
        return self.head


class _CannedRefusal:
    """The JSON body and Retry-After of the last admission refusal: a model's admission
    gives the same refusal again while its queue is unchanged (`Batcher.early_refusal`), and
    a refusal then costs no encoding."""

    __slots__ = ("body", "error", "retry")

    def __init__(self) -> None:
        self.error: object = None  # the refusal the body was encoded from
        self.body = b""
        self.retry = 1

    def of(self, error: ServingError) -> tuple[bytes, int]:
        """(body, Retry-After seconds) of `error`."""
        if error is not self.error:
            self.body = encode_error(error.message)
            self.retry = max(1, math.ceil(error.retry_after or 1))
            self.error = error
        return self.body, self.retry


_REFUSAL_HEAD = _CannedHead()
_ADMISSION_REFUSAL = _CannedRefusal()
_CLOSE = b"connection: close\r\n"
_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
}
_SATURATED_TEXT = "server is saturated: retry later"
_SATURATED = encode_error(_SATURATED_TEXT)
_SATURATED_OPENAI = msgspec.json.encode(error_body(_SATURATED_TEXT, Unavailable.kind, 503))


def _saturated(path: str) -> bytes:
    """The gate's refusal, in the error shape of the API the path belongs to."""
    return _SATURATED_OPENAI if openai_path(path) else _SATURATED


DISCARD_BYTES = 64 * 1024  # a refused request's body up to this is skipped, not read


def _protocol_class(
    max_head_bytes: int, gate: Gate, refusals: Counter, app: App
) -> type[_Protocol]:
    attributes = {
        "max_head_bytes": max_head_bytes,
        "gate": gate,
        "refusals": _RefusalCount(refusals),
        "lockgate_app": app,
        "lane_bodies": BodiesArriving(),
        "heads": HeadCache(),
    }
    return type("LockgateHttpProtocol", (_Protocol,), attributes)


def _gate_gauges(app: App, gate: Gate) -> None:
    """The connection gate's measures of the event loop, read at each scrape."""
    registry = app.models.registry
    registry.gauge(
        "lockgate_event_loop_lag_seconds",
        "The event loop's own lag as the connection gate reads it (recent average, or a "
        "quarter of how overdue its sentinel is), the time its thread waited for a CPU taken "
        "off; over --max-loop-lag-ms, new requests are refused before their body.",
    ).set_function((), lambda: gate.lag.current(time.monotonic()))
    registry.gauge(
        "lockgate_event_loop_cpu_per_request_seconds",
        "The event loop's CPU seconds per answered request (a refusal counting as a tenth), "
        "over 100 ms windows: with the requests in progress, the loop's wait that admission "
        "predicts for a request let through.",
    ).set_function((), lambda: gate.loop_cost.per_request)
    registry.gauge(
        "lockgate_event_loop_core_share",
        "The event loop's share of its core while it had work (its CPU time over that and "
        "the time it waited for a CPU): below 1 when another process or thread shares it.",
    ).set_function((), lambda: gate.loop_cost.share)


class _Sentinel:
    """Fires every `interval` on the loop and feeds the gate's lag."""

    def __init__(
        self, gate: Gate, loop: asyncio.AbstractEventLoop, beat: Callable[[float], None]
    ) -> None:
        self.lag = gate.lag
        self.cost = gate.loop_cost
        self.loop = loop
        self.beat = beat  # told of each firing (the health port's heartbeat)
        self.handle: asyncio.TimerHandle | None = None
        self.clock: ThreadClock | None = None

    def start(self) -> None:
        self.clock = ThreadClock()  # on the loop's thread: the loop's times
        self._fire()

    def _fire(self) -> None:
        now = time.monotonic()
        assert self.clock is not None
        times = self.clock.read()
        self.cost.sample(now, times.cpu, times.waited)
        self.beat(now)
        delay = self.lag.fired(now, times.waited)
        self.handle = self.loop.call_later(delay, self._fire)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
        if self.clock is not None:
            self.clock.close()


class _Server(uvicorn.Server):
    """uvicorn's server, draining the models before it closes the port on a signal."""

    def __init__(
        self,
        config: uvicorn.Config,
        app: App,
        drain_timeout: float,
        grpc_server: Any = None,
        accept_per_turn: int = 0,
        health: HealthState | None = None,
    ) -> None:
        super().__init__(config)
        self.lockgate_app = app
        self.accept_per_turn = accept_per_turn
        self.health = health or HealthState()  # what probes answered off the loop say
        self.acceptors: list[Acceptor] = []
        self.drain_timeout = drain_timeout
        self.grpc_server = grpc_server  # grpc.aio.Server, or None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drainer: asyncio.Task[None] | None = None
        self.shared: socket.socket | None = None  # bound with SO_REUSEPORT, listened on once
        self.loading: asyncio.Task[None] | None = None  # `shared` waits for this start-up
        self.joining: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.accept_per_turn:  # the loop accepts, as uvloop does: one a turn
            await super().startup(sockets)
        else:
            await super().startup([])  # uvicorn listens on nothing: the acceptors do
            for sock in sockets or []:
                self._listen(sock)
        if self.shared is not None and self.loading is not None:
            self.joining = asyncio.get_running_loop().create_task(self._join(self.loading))

    def _protocols(self) -> Callable[[], asyncio.Protocol]:
        """A connection's protocol, made as uvicorn's own start-up makes them."""
        return functools.partial(
            self.config.http_protocol_class,  # type: ignore[call-arg]
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )

    def _listen(self, sock: socket.socket) -> None:
        """Accept `sock`'s connections on a thread (`frontend/acceptor.py`)."""
        loop = asyncio.get_running_loop()
        answer = functools.partial(_probe_answer, self.lockgate_app, self.health, loop)
        acceptor = Acceptor(sock, self._protocols(), self.accept_per_turn, loop, answer)
        acceptor.start(self.config.backlog)
        self.acceptors.append(acceptor)

    async def _join(self, loading: asyncio.Task[None]) -> None:
        """Listen on the shared port once start-up is complete: until then the kernel gives
        its new connections to the processes already serving it."""
        await asyncio.wait([loading])
        if self.shared is None or self.should_exit or self.lockgate_app.draining:
            return
        if self.accept_per_turn:
            self._listen(self.shared)  # closed with the others on shutdown
        else:
            loop = asyncio.get_running_loop()
            listener = await loop.create_server(
                self._protocols(), sock=self.shared, backlog=self.config.backlog
            )
            self.servers.append(listener)  # closed with the others on shutdown
        log.info("listening on the shared port %d too", self.shared.getsockname()[1])

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for acceptor in self.acceptors:  # no new connection, before uvicorn closes the others
            acceptor.close()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Handle SIGINT and SIGTERM as a drain; unlike uvicorn, do not re-raise them after."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: it re-raises the signal after shutdown (exit status -15).
        app = self.lockgate_app
        if app.draining:  # a second signal: stop waiting for requests, close now
            self.should_exit = self.force_exit = True
            return
        log.info("signal %d: draining (readiness 503, no new requests), then exiting", sig)
        app.draining = True
        for model in app.models.models.values():
            for served in model.versions.values():
                if served.batcher is not None:
                    served.batcher.accepting = False
        if self.loop is None:
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self.loop is not None
        self.drainer = self.loop.create_task(self._drain())

    async def _drain(self) -> None:
        start = time.monotonic()
        drains = [self.lockgate_app.models.drain(self.drain_timeout)]
        if self.grpc_server is not None:  # refuses new RPCs at once, waits for the others
            drains.append(self.grpc_server.stop(self.drain_timeout))
        drained, *_ = await asyncio.gather(*drains)
        if not drained:
            log.warning(
                "drain timed out after %.1f s; closing with requests unanswered", self.drain_timeout
            )
        left = self.drain_timeout - (time.monotonic() - start)
        self.config.timeout_graceful_shutdown = max(1, int(left))  # for responses being written
        self.should_exit = True


def _probe_answer(
    app: App, health: HealthState, loop: asyncio.AbstractEventLoop, probe: Probe
) -> bytes | None:
    """On the accepting thread: a probe's answer as the health port gives it (the loop's
    heartbeat, its last readiness), or None when the loop must answer it (`App.probe_open`).
    The latency histogram counts it, on the loop."""
    if not app.probe_open(probe):
        return None
    method = "HEAD" if probe.head else "GET"
    status, body = health.answer(method, probe.path, time.monotonic())
    elapsed = time.monotonic() - probe.received
    loop.call_soon_threadsafe(app.http_latency.observe, ("health", str(status)), elapsed)
    boot = b"%s: %s\r\n" % (readiness.BOOT_HEADER, app.boot)  # as the routes' answers
    return response_bytes(status, body, method, boot)


def build_app(options: ServeOptions) -> App:
    registry = Registry()
    models = ModelManager(registry, options.serving)
    options.http.repository = None if options.bare else options.repository
    app = App(models, options.http)
    try:
        from lockgate.frontend.generate_routes import GenerateRoutes
        from lockgate.frontend.llm_infer import LanguageInfer
        from lockgate.frontend.openai_routes import OpenAIRoutes
        from lockgate.frontend.responses_routes import ResponsesRoutes
    except ImportError as exc:  # the language-model libraries are not installed
        log.info("OpenAI API off: %s", exc)
    else:
        app.openai = openai = OpenAIRoutes(app)
        app.generate = GenerateRoutes(openai)
        app.v2.language = LanguageInfer(openai.pipeline)
        app.responses = ResponsesRoutes(openai, options.http.responses_store_size)
    return app


async def load(app: App, options: ServeOptions) -> None:
    start = time.monotonic()
    try:
        if options.repository is not None:
            await app.models.load_repository(options.repository, options.bare)
            if options.serving.repository_poll_s is not None:
                _start_polling(app, options, options.serving.repository_poll_s)
        for extension in options.extensions:
            await extension(app)
    except Exception:
        log.exception("start-up failed")
    freeze_heap()
    app.started = True
    log.info("start-up complete in %.2f s", time.monotonic() - start)


def _start_polling(app: App, options: ServeOptions, interval: float) -> None:
    """Poll mode: watch the repository (or the bare model's file) for changes until the
    server stops."""
    from lockgate.core.repository_poll import bare_polling, polling

    assert options.repository is not None
    if options.bare is None:
        poller = polling(app.models, options.repository, interval)
        watched = f"the repository {options.repository}"
    else:
        poller = bare_polling(app.models, options.bare, interval)
        watched = f"the model file {options.bare.file}"
    app.background.append(asyncio.get_running_loop().create_task(poller.run()))
    log.info("polling %s every %g s for changes", watched, interval)


async def serve(options: ServeOptions) -> int:
    app = build_app(options)
    app.v2.log.install()  # the process's log handlers, changed through /v2/logging
    gate = Gate(options.gate)
    refusals = app.models.registry.counter(
        "lockgate_http_refused_total",
        "HTTP connections closed or requests refused by the connection gate, before any "
        "body was read, by reason (loop_lag, queue_delay, requests, model_admission, "
        "connections, client_connections, head_timeout, invalid_http, head_too_large, "
        "slow_body: a place taken back from a request whose body did not come).",
        ("reason",),
    )
    try:
        shared = _bind(options.host, options.port, reuse_port=True) if options.reuse_port else None
        sockets = _sockets_now(options)
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        return 1
    health = HealthState(stale_s=options.health_stale_s)
    health_port = None
    if options.health_port is not None:
        try:
            health_port = HealthPort(options.host, options.health_port, health)
        except OSError as exc:
            log.error("cannot listen on the health port: %s", exc)
            return 1
        health_port.start()
        log.info("health probes on http://%s:%d", options.host, health_port.port)
    sentinel = _Sentinel(
        gate, asyncio.get_running_loop(), lambda now: health.refresh(now, app.not_ready)
    )
    sentinel.start()
    _gate_gauges(app, gate)
    app.front_delay = gate.queue.observe
    app.answered = gate.answered
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        loop="none",
        lifespan="off",
        ws="none",  # no WebSocket route: an Upgrade request is answered as plain HTTP
        http=_protocol_class(options.max_head_bytes, gate, refusals, app),
        access_log=False,
        log_level="warning",
        limit_concurrency=None,  # the gate counts requests in progress (frontend/gate.py)
        backlog=options.backlog,
        timeout_graceful_shutdown=int(options.drain_timeout),
        timeout_keep_alive=options.keep_alive_timeout,
    )
    _quiet_parser_errors()  # after uvicorn.Config, which configures uvicorn's loggers
    try:
        grpc_server = await _start_grpc(app, options)
    except OSError as exc:
        log.error("%s", exc)
        return 1
    server = _Server(
        config, app, options.drain_timeout, grpc_server, options.accept_per_turn, health
    )
    loader = asyncio.get_running_loop().create_task(load(app, options))
    server.shared, server.loading = shared, loader
    log.info("lockgate listening on http://%s:%d", options.host, options.port)
    try:
        await server.serve(sockets)
    except SystemExit:  # uvicorn's own start-up failed (it logged why): stop what started
        log.error("lockgate could not start serving HTTP")
        server.started = False
    sentinel.stop()
    if health_port is not None:
        health_port.stop()
    loader.cancel()
    for task in app.background:  # before the models close: a poll loads no model after it
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if shared is not None:
        shared.close()  # when never listened on
    if grpc_server is not None:
        await grpc_server.stop(0)  # cancels RPCs still running after a second signal
    await _cancel_requests(server)
    await app.models.close()
    for closer in app.closers:
        await closer()
    log.info("lockgate stopped")
    return 0 if server.started else 1


async def _start_grpc(app: App, options: ServeOptions) -> Any:
    if options.grpc_port is None:
        return None
    from lockgate.frontend.grpc_server import GrpcSettings, start_grpc

    settings = GrpcSettings(
        host=options.host,
        port=options.grpc_port,
        max_receive_bytes=options.http.max_body_bytes,
        max_concurrent_rpcs=options.grpc_max_concurrent_rpcs,
        max_stream_inflight=options.grpc_max_stream_inflight,
        required=options.grpc_port_required,
        reuse_port=options.reuse_port,
    )
    return await start_grpc(app, settings)


def _sockets_now(options: ServeOptions) -> list[socket.socket]:
    """The sockets uvicorn serves from the start, bound here before anything else starts, so
    a port in use fails start-up at once with exit status 1 (left to uvicorn, the bind failed
    after the gRPC server and the models' threads had started, and the process hung). With
    `reuse_port` the shared port is not among them: it is listened on once started."""
    now = [] if options.reuse_port else [_bind(options.host, options.port)]
    if options.private_port is not None:
        now.append(_bind(options.host, options.private_port))
    return now


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to host:port, not listening yet. With `reuse_port` (SO_REUSEPORT)
    other processes of this user may bind the port too, and the kernel spreads new
    connections over those that listen."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


async def _cancel_requests(server: uvicorn.Server) -> None:
    """Requests still running after a second signal are cancelled: closing the models would
    otherwise wait for them."""
    tasks = list(server.server_state.tasks)
    for task in tasks:
        task.cancel("server is stopping")
    if tasks:
        await asyncio.wait(tasks, timeout=1.0)


def run(options: ServeOptions) -> int:
    _raise_open_file_limit()
    try:
        import uvloop

        code = uvloop.run(serve(options))
    except ImportError:
        code = asyncio.run(serve(options))
    _exit_past_busy_threads(code)
    return code


def _raise_open_file_limit() -> None:
    """Connections are file descriptors: take the hard limit, so the gate's caps bind first."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError) as exc:
        log.warning("could not raise the open file limit: %s", exc)


def _exit_past_busy_threads(code: int, grace: float = 1.0) -> None:
    """Leave now if a model call outlived the drain: its worker thread would hold the exit
    (Python joins executor threads at exit) for as long as the call runs."""
    deadline = time.monotonic() + grace
    busy = []
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            busy.append(thread.name)
    if busy:
        log.warning("exiting past %d busy thread(s): %s", len(busy), ", ".join(busy))
        logging.shutdown()
        os._exit(code)
