"""The listening socket: connections are accepted on a thread of its own, health probes that
close their connection are answered there, and the rest are handed to the event loop, up to
`per_turn` a turn.

uvloop's own servers accept one connection per turn of the loop (libuv 1.45 and later accepts
once each time the listening socket polls readable, and leaves the rest to the next turns).
Under overload a turn of lockgate's loop is long: every connection with bytes waiting is read
and judged in it, and the tasks made in it run in the next. An open-loop client opening 512
connections at once against digits_onnx had them accepted at one per turn, over 2.7 to 8.7 s;
a liveness probe, which opens a new connection every time, waited behind them as long, while
the loop's sentinel timer never lagged past 0.2 s. Accepted here, a connection waits for no
turn of the loop: the kernel's queue is drained as fast as connections come.

The thread watches each new connection until its first bytes come (at most `FIRST_BYTES_S`;
it hands a connection over the moment they do, so a client that sends at once waits for
nothing). A probe as an orchestrator sends it (Kubernetes' kubelet: a new connection, `GET`
or `HEAD` of `/v2/health/live`, `/health` or `/v2/health/ready`, `Connection: close`) is
answered on the thread, as the health port answers (`health_port.py`): from the loop's
heartbeat and its last readiness (at most 0.1 s old), needing only the interpreter lock,
which the loop's thread yields within the switch interval (5 ms). Even the loop's fastest
answer (`probe.py`) waits for the turn in progress and the next, and under a storm of 512
connections each turn took tens of milliseconds. Every other connection is handed to the
loop, which opens at most `per_turn` of them a turn (a connection costs it about 50 µs to
set up: 128 take about 6 ms), so a flood of new connections is taken in slices between the
other connections' work.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from lockgate.frontend.probe import Probe, probe_of

log = logging.getLogger("lockgate.server")

RETRY_S = 1.0  # out of file descriptors or memory: accept again after this
PEEK_BYTES = 8192  # a probe's head is read from at most this much
FIRST_BYTES_S = 0.05  # a new connection silent this long goes to the loop, which waits for it
ANSWER_TIMEOUT_S = 0.5  # for a probe's answer to be taken
ACCEPT_BATCH = 256  # connections accepted in a row before the thread looks at the others


class Acceptor:
    """Accepts the connections of one listening socket on a thread: answers a probe that
    closes its connection with `answer` (its bytes, or None to leave it to the loop), and
    hands every other connection to the loop, where a protocol from `factory` serves it."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        per_turn: int,
        loop: asyncio.AbstractEventLoop,
        answer: Callable[[Probe], bytes | None],
    ) -> None:
        if per_turn < 1:
            raise ValueError(f"per_turn must be >= 1, not {per_turn!r}")
        self.sock = sock
        self.factory = factory
        self.per_turn = per_turn
        self.loop = loop
        self.answer = answer
        self.lock = threading.Lock()
        self.waiting: collections.deque[socket.socket] = collections.deque()  # for the loop
        self.scheduled = False  # the loop is to open the waiting connections
        self.opening: set[asyncio.Task[object]] = set()  # connections being opened
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="lockgate-accept", daemon=True)

    def start(self, backlog: int) -> None:
        self.sock.listen(backlog)
        self.sock.setblocking(False)
        self.thread.start()

    def close(self) -> None:
        """Stop accepting (on the loop's thread); connections accepted stay open, those not
        yet handed to the loop close."""
        if self.closed.is_set():
            return
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's select
        self.thread.join(timeout=2.0)
        self.sock.close()
        with self.lock:
            left, self.waiting = list(self.waiting), collections.deque()
        for conn in left:
            conn.close()

    # -- the accepting thread ------------------------------------------------------------
    def _serve(self) -> None:
        """Accept, and watch each new connection until its first bytes come (at most
        FIRST_BYTES_S): a whole probe that closes its connection is answered here, anything
        else goes to the loop as it comes."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.sock, selectors.EVENT_READ)
            silent: dict[socket.socket, float] = {}  # accepted, nothing read yet: deadline
            while not self.closed.is_set():
                now = time.monotonic()
                timeout = min(silent.values()) - now if silent else None
                for key, _ in selector.select(None if timeout is None else max(0.0, timeout)):
                    if key.fileobj is self.sock:
                        self._accept(selector, silent)
                    else:
                        conn = key.fileobj
                        assert isinstance(conn, socket.socket)
                        selector.unregister(conn)
                        del silent[conn]
                        self._first_bytes(conn)
                now = time.monotonic()
                for conn in [c for c, deadline in silent.items() if deadline <= now]:
                    selector.unregister(conn)
                    del silent[conn]
                    self._hand_over(conn)  # silent so far: the loop waits for it
            for conn in silent:
                conn.close()

    def _accept(self, selector: selectors.BaseSelector, silent: dict[socket.socket, float]) -> None:
        """Every connection waiting, up to ACCEPT_BATCH: one whose first bytes are in is
        decided at once, the others are watched."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except (BlockingIOError, InterruptedError):
                return  # none left
            except OSError as exc:
                if not self.closed.is_set():
                    self._wait_out(exc)
                return
            conn.setblocking(False)
            try:
                sent = conn.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                selector.register(conn, selectors.EVENT_READ)
                silent[conn] = time.monotonic() + FIRST_BYTES_S
                continue
            except OSError:
                conn.close()
                continue
            if sent:
                self._first_bytes(conn)
            else:
                conn.close()  # closed before it sent anything

    def _first_bytes(self, conn: socket.socket) -> None:
        try:
            if self._answered(conn):
                return
        except OSError:
            conn.close()  # the client went away
            return
        except Exception:  # never let one connection end the thread
            log.exception("reading a new connection failed")
        self._hand_over(conn)

    def _answered(self, conn: socket.socket) -> bool:
        """Answer `conn` here when its bytes so far are a whole probe that closes it."""
        data = conn.recv(PEEK_BYTES, socket.MSG_PEEK)
        probe = probe_of(data, PEEK_BYTES, time.monotonic())
        if probe is None or probe.keep_alive:
            return False
        answer = self.answer(probe)
        if answer is None:
            return False
        with conn:
            conn.recv(probe.size)  # the request, read
            conn.setblocking(True)
            conn.settimeout(ANSWER_TIMEOUT_S)
            conn.sendall(answer)
        return True

    def _hand_over(self, conn: socket.socket) -> None:
        with self.lock:
            self.waiting.append(conn)
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._open_waiting)
        except RuntimeError:  # the loop has closed
            conn.close()

    def _wait_out(self, exc: OSError) -> None:
        """Out of a resource (EMFILE, ENFILE, ENOBUFS, ENOMEM): the queue waits RETRY_S."""
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        log.warning("cannot accept connections (%s): retrying in %g s", name, RETRY_S)
        self.closed.wait(RETRY_S)

    # -- on the loop -----------------------------------------------------------------------
    def _open_waiting(self) -> None:
        """Open up to `per_turn` of the connections handed over; the rest next turn."""
        with self.lock:
            count = min(self.per_turn, len(self.waiting))
            taken = [self.waiting.popleft() for _ in range(count)]
            more = bool(self.waiting)
            self.scheduled = more
        for conn in taken:
            self._open(conn)
        if more:
            self.loop.call_soon(self._open_waiting)

    def _open(self, conn: socket.socket) -> None:
        """Its transport and protocol are made at once, its `connection_made` runs in the
        loop's next turn."""
        if self.closed.is_set():
            conn.close()
            return
        opening = self.loop.create_task(self.loop.connect_accepted_socket(self.factory, conn))
        self.opening.add(opening)
        opening.add_done_callback(lambda task: self._opened(task, conn))

    def _opened(self, task: asyncio.Task[object], conn: socket.socket) -> None:
        self.opening.discard(task)
        if task.cancelled():
            conn.close()
        elif (exc := task.exception()) is not None:
            log.warning("could not open an accepted connection: %s", exc)
            conn.close()
