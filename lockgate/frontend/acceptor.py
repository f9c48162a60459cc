"""The listening socket: every connection waiting in its accept queue, up to `per_turn`, is
accepted on each turn of the event loop.

uvloop's own servers accept one connection per turn of the loop (libuv 1.45 and later accepts
once each time the listening socket polls readable, and leaves the rest to the next turns).
Under overload a turn of lockgate's loop is long: every connection with bytes waiting is read
and judged in it, and the tasks made in it run in the next. An open-loop client opening 500
connections at once against digits_onnx had them accepted at one per turn, for 8.7 s; a
liveness probe, which opens a new connection every time, waited behind them as long, while
the loop's sentinel timer never lagged past 0.2 s. Here the listening socket is polled by
the loop and drained in one turn: a new connection waits for at most the turn in progress,
whatever is queued ahead of it.

`per_turn` bounds the turn that accepts: a connection costs the loop about 50 µs to accept
and set up, so 128 take about 6 ms, and a flood of new connections is taken in slices
between the other connections' work. (asyncio's own loop accepts up to its backlog, 100 by
default, per turn.)
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("lockgate.server")

RETRY_S = 1.0  # out of file descriptors or memory: accept again after this


class Acceptor:
    """Accepts the connections of one listening socket for the loop, up to `per_turn` a turn,
    each served by a protocol from `factory`."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        per_turn: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        if per_turn < 1:
            raise ValueError(f"per_turn must be >= 1, not {per_turn!r}")
        self.sock = sock
        self.factory = factory
        self.per_turn = per_turn
        self.loop = loop
        self.opening: set[asyncio.Task[object]] = set()  # connections handed to the loop
        self.retry: asyncio.TimerHandle | None = None
        self.closed = False

    def start(self, backlog: int) -> None:
        self.sock.listen(backlog)
        self.sock.setblocking(False)
        self.loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close the socket; connections accepted stay open."""
        if self.closed:
            return
        self.closed = True
        if self.retry is not None:
            self.retry.cancel()
        else:
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def _accept(self) -> None:
        for _ in range(self.per_turn):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # the queue is empty
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: the queue waits
                self._pause(exc)
                return
            self._open(conn)

    def _open(self, conn: socket.socket) -> None:
        """Hand an accepted connection to the loop: its transport and protocol are made at
        once, its `connection_made` runs in the loop's next turn."""
        conn.setblocking(False)
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

    def _pause(self, exc: OSError) -> None:
        """Out of a resource: leave the queue to the kernel for RETRY_S, as asyncio does."""
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        log.warning("cannot accept connections (%s): retrying in %g s", name, RETRY_S)
        self.loop.remove_reader(self.sock.fileno())
        self.retry = self.loop.call_later(RETRY_S, self._resume)

    def _resume(self) -> None:
        self.retry = None
        if not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._accept)
