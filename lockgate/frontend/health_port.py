"""Liveness and readiness on a port of their own (`--health-port`), answered from a thread.

On the main port a probe that closes its connection (the kubelet's) is answered the same way
by the thread that accepts connections (`acceptor.py`), but its connection waits in the same
kernel accept queue as every client's, and one kept alive is answered by the event loop,
after the turn in progress. Here a thread owns its own listening socket and answers `GET` or
`HEAD` of `/v2/health/live`, `/health` and `/v2/health/ready` with the same JSON as the main
port, whatever the loop is doing: it needs only the interpreter lock, which the loop's thread
yields within the switch interval (5 ms).

What it answers is still the loop's state, so a wedged loop is not reported healthy:
- live: the loop's sentinel timer (every 5 ms) fired within `stale_s` seconds; past that
  the loop has stopped making progress and liveness answers 503;
- ready: the main port's readiness (draining, loading, no model ready), as the loop last
  computed it, at most `READY_EVERY_S` ago.

Connections are answered one at a time and closed; a client that has not sent its request
line and headers within `READ_TIMEOUT_S` is closed, so a slow client delays the next probe
by at most that.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from lockgate.protocol import readiness

log = logging.getLogger("lockgate.health")

READY_EVERY_S = 0.1  # how often the loop recomputes readiness for the thread
READ_TIMEOUT_S = 0.5  # for a probe's request head
MAX_HEAD_BYTES = 8192
LIVE_PATHS = frozenset({"/v2/health/live", "/health"})
READY_PATH = "/v2/health/ready"


@dataclass(slots=True)
class HealthState:
    """Written on the loop (`refresh`), read by the health thread. Pure bookkeeping."""

    stale_s: float = 10.0  # seconds without a sentinel firing after which the loop is wedged
    beat: float = 0.0  # time.monotonic() of the loop's last sentinel firing; 0: not yet
    checked: float = 0.0  # when readiness was last computed
    not_ready: str | None = readiness.LOADING  # None: ready

    def refresh(self, now: float, not_ready: Callable[[], str | None]) -> None:
        """On the loop, from the sentinel: a heartbeat, and readiness every READY_EVERY_S."""
        self.beat = now
        if now - self.checked >= READY_EVERY_S:
            self.not_ready = not_ready()
            self.checked = now

    def live(self, now: float) -> str | None:
        """None when the loop is making progress, else why not."""
        if not self.beat:
            return "event loop not started"
        if now - self.beat > self.stale_s:
            return f"event loop stalled for {now - self.beat:.1f} s"
        return None

    def answer(self, method: str, path: str, now: float) -> tuple[int, bytes]:
        """The status and JSON body for a probe."""
        if path not in LIVE_PATHS and path != READY_PATH:
            return 404, _error(f"no route for {path[:200]} on the health port")
        if method not in ("GET", "HEAD"):
            return 405, _error(f"{method[:20]} is not allowed on {path}")
        stalled = self.live(now)
        if path in LIVE_PATHS:
            if stalled is None:
                return 200, b'{"live":true}'
            return 503, json.dumps({"live": False, "error": stalled}).encode()
        reason = stalled or self.not_ready
        if reason is None:
            return 200, b'{"ready":true}'
        return 503, json.dumps({"ready": False, "error": reason}).encode()


def _error(text: str) -> bytes:
    return json.dumps({"error": text}).encode()


_REASONS = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed", 503: b"Service Unavailable"}


class HealthPort:
    """The listening socket and the thread that answers on it."""

    def __init__(self, host: str, port: int, state: HealthState) -> None:
        self.state = state
        self.sock = socket.create_server((host, port), backlog=64)
        self.port = self.sock.getsockname()[1]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="lockgate-health", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept
        self.sock.close()
        self.thread.join(timeout=2.0)

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self.stopping.is_set():
                    return
                continue
            with conn:
                try:
                    self._answer(conn)
                except OSError:
                    pass  # the prober went away
                except Exception:  # never let one probe end the thread
                    log.exception("health probe failed")

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(READ_TIMEOUT_S)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                return
            head += chunk
            if len(head) > MAX_HEAD_BYTES:
                self._send(conn, 431, _error("request head too large"), "GET")
                return
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self._send(conn, 400, _error("invalid HTTP request"), "GET")
            return
        method = parts[0].decode("latin-1")
        path = parts[1].partition(b"?")[0].decode("latin-1")
        status, body = self.state.answer(method, path, time.monotonic())
        self._send(conn, status, body, method)

    @staticmethod
    def _send(conn: socket.socket, status: int, body: bytes, method: str) -> None:
        conn.sendall(response_bytes(status, body, method))


def response_bytes(status: int, body: bytes, method: str, extra: bytes = b"") -> bytes:
    """A probe's whole answer, closing its connection (no body for HEAD); `extra`: header
    lines to add, each ending in CRLF."""
    reason = _REASONS.get(status, b"Bad Request" if status == 400 else b"Error")
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n" % (status, reason)
    head += b"content-length: %d\r\nconnection: close\r\n" % len(body)
    if status == 405:
        head += b"allow: GET, HEAD\r\n"
    head += extra
    return head + b"\r\n" + (b"" if method == "HEAD" else body)
