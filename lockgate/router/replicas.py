"""`lockgate serve --replicas N`: N server processes on this machine and the router in front.

Each replica is `lockgate serve` with the same arguments, on its own port on 127.0.0.1 (the
router's port plus 1 to N unless `--replica-base-port` says otherwise), without gRPC, pinned
to one core (replica i on core i modulo the cores this process may use). The router listens
on the address asked for. A signal to the router drains it; the replicas then get SIGTERM
and drain in turn. A replica that exits on its own is started again after a second.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("lockgate.router")

# options of `lockgate serve` that each replica gets its own value for (with their values)
_OWN = {"--host", "--port", "--grpc-port", "--replicas", "--replica-base-port"}


def replica_argv(argv: Sequence[str], port: int) -> list[str]:
    """The `lockgate serve` arguments of one replica: `argv` without the options above."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = arg.partition("=")
        if name in _OWN:
            skip = not eq
            continue
        out.append(arg)
    return [*out, "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "off"]


@dataclass(slots=True)
class Replicas:
    """The replica processes, restarted when they exit unasked."""

    argv: list[str]  # `lockgate serve ...` arguments, without the program
    ports: list[int]
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    stopping: bool = False

    def start(self) -> None:
        for i in range(len(self.ports)):
            self._spawn(i)
        threading.Thread(target=self._watch, name="lockgate-replicas", daemon=True).start()

    def _spawn(self, i: int) -> None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        command = [sys.executable, "-m", "lockgate.cli", *replica_argv(self.argv, self.ports[i])]

        def pin() -> None:
            if cores:
                os.sched_setaffinity(0, {cores[i % len(cores)]})

        self.processes[i] = subprocess.Popen(command, preexec_fn=pin)
        log.info("replica %d on port %d: pid %d", i, self.ports[i], self.processes[i].pid)

    def _watch(self) -> None:
        while not self.stopping:
            time.sleep(1.0)
            for i, process in list(self.processes.items()):
                if process.poll() is not None and not self.stopping:
                    log.warning(
                        "replica %d exited with %s: starting it again", i, process.returncode
                    )
                    self._spawn(i)

    def stop(self, timeout: float) -> None:
        """SIGTERM to every replica (each drains), then wait up to `timeout` s; kill the rest."""
        self.stopping = True
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
