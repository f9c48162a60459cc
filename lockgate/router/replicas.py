"""`lockgate serve --replicas N`: N server processes on this machine, each `lockgate serve` with
the same arguments, placed as `--pin-replicas` says (`Placement`), balanced one of two ways:

- by the kernel (`--balance kernel`, `shared_port_argv`): every replica binds the public
  address (and gRPC port) with SO_REUSEPORT and serves HTTP on a private port of its own
  too; the parent process only supervises them (`supervisor.py`);
- by the router (`--balance router`, `replica_argv`, `Replicas`): each replica on its own
  port on 127.0.0.1 (the router's port plus 1 to N unless `--replica-base-port` says
  otherwise; gRPC, when the router serves it, on the N ports after those), the router on the
  address asked for. A signal to the router drains it; the replicas then get SIGTERM and
  drain in turn; when the router dies, however it dies, they get SIGTERM too
  (`parent_death.py`). A replica that exits on its own is started again after a second. The
  default with `--model-control-mode explicit`: the router sends each load and unload to
  every replica, and to one started again before it takes traffic (`model_control.py`). The
  router keeps those in a file (`control_state_path`, or `--control-state`) that a run after
  this one reads back when this one was killed: the replicas it starts are then caught up
  as before. A run that stops its replicas itself removes the default file, so the next run
  starts as its command line says, as one process does.

`Placement`: with `--pin-replicas auto` (the default) replica i runs on core i of the cores this
process may use when there are as many replicas as cores, and anywhere among them otherwise
(`on`: pinned whatever the count, replica i on core i modulo the cores; `off`: never). Each
replica's native thread pools (OpenMP, OpenBLAS, MKL: torch, numpy, scikit-learn) get the
usable cores divided by N, at least 1, so that N replicas do not start N times the machine's
threads; a variable already set in the environment is kept.

`--replicas auto` (`auto_replicas`) is one replica per usable core when the repository holds
classic models only, and one when it holds a language model that will be served: a language
model's engine already spreads over the cores, and each replica would hold its own weights
and KV cache. A stateful model (`sequence_batching`) also makes it one: a sequence lives in
the replica that started it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from lockgate.config import ModelConfig
from lockgate.parent_death import child_env

log = logging.getLogger("lockgate.router")

# options of `lockgate serve` that each replica gets its own value for (with their values)
_BALANCING = {
    "--replicas",
    "--replica-base-port",
    "--balance",
    "--private-port",
    "--control-state",
    "--pin-replicas",
}
_OWN = {"--host", "--port", "--grpc-port", *_BALANCING}
_FLAGS = {"--reuse-port"}  # the same, without a value


def reuse_port_balances() -> bool:
    """Whether the kernel spreads a port's connections over the sockets that share it
    (Linux's SO_REUSEPORT; elsewhere the option exists but one socket takes them all)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def cannot_share(host: str, port: int) -> str | None:
    """Why `host`:`port` cannot be shared through SO_REUSEPORT (another process holds it
    without the option, or as another user), or None when it can."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            probe.bind(address)
    except OSError as exc:
        return f"cannot share {host}:{port}: {exc}"
    return None


def control_state_path(port: int, repository: Path) -> Path | None:
    """Where the router of `serve --replicas` keeps its model control state by default: a
    directory of this user's ($XDG_RUNTIME_DIR/lockgate, which a reboot empties, else
    $XDG_STATE_HOME/lockgate or ~/.local/state/lockgate), one file per router port and
    repository; None when this user has no home to put it in."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    try:
        base = Path(runtime or os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state")
    except RuntimeError:  # no $HOME, and no home in the password database
        return None
    digest = hashlib.sha256(str(repository.resolve()).encode()).hexdigest()[:12]
    return base / "lockgate" / f"router-{port}-{digest}.state"


PIN_MODES = ("auto", "on", "off")
# the variables that size the native thread pools a model's libraries start
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the replicas run (`cores`, one each when `pinned`) and how many threads each
    one's native pools may start."""

    cores: tuple[int, ...]  # the cores this process may use
    pinned: bool
    threads: int

    @classmethod
    def choose(cls, mode: str, replicas: int) -> Placement:
        """`--pin-replicas` `mode` for `replicas` replicas on the cores this process may use."""
        if mode not in PIN_MODES:
            raise ValueError(f"--pin-replicas: {mode!r} is not one of {', '.join(PIN_MODES)}")
        cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
        pinned = bool(cores) and (mode == "on" or (mode == "auto" and replicas == len(cores)))
        threads = 1 if pinned else max(1, usable_cores() // max(1, replicas))
        return cls(cores, pinned, threads)

    def __str__(self) -> str:
        where = "each on a core of its own" if self.pinned else "on any of the cores"
        return f"{where}, {self.threads} thread(s) per native pool"

    def core(self, i: int) -> int | None:
        """Replica `i`'s core; None when it may run on any."""
        return self.cores[i % len(self.cores)] if self.pinned else None

    def preexec(self, i: int) -> Callable[[], None] | None:
        """For `preexec_fn`: put replica `i` on its core (None: nothing to do)."""
        core = self.core(i)
        if core is None:
            return None
        return partial(os.sched_setaffinity, 0, {core})

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` with the thread pools sized, where it does not size them itself."""
        return {**{name: str(self.threads) for name in THREAD_VARIABLES}, **base}


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, fewer when a cgroup (v2) CPU quota
    allows less (a container's CPU limit)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_cpus(Path("/sys/fs/cgroup/cpu.max"))
    return max(1, min(cores or 1, quota or cores or 1))


def _cgroup_cpus(path: Path) -> int | None:
    """`cpu.max` ("QUOTA PERIOD", or "max PERIOD") as whole CPUs, rounded up; None: no limit."""
    try:
        quota, period = path.read_text().split()[:2]
        return math.ceil(int(quota) / int(period))
    except (OSError, ValueError, ZeroDivisionError):
        return None  # no such file, or "max": no quota


def auto_replicas(
    repository: Path, *, cores: int, llm_backend: str, language_models: bool = True
) -> int:
    """`--replicas auto`: `cores` replicas when `repository` holds classic models only; one
    when it holds a model of `llm_backend` that will be served (`language_models`, that is
    without --no-llm), or a stateful model. A model whose config cannot be read counts as
    classic: the replica reports its error."""
    configs = _configs(repository)
    if language_models and any(config.backend == llm_backend for config in configs):
        return 1
    if any(config.sequence_batching is not None for config in configs):
        return 1
    return max(1, cores)


def _configs(repository: Path) -> list[ModelConfig]:
    """The model configs of a repository (unreadable ones left out)."""
    from lockgate.core.config_files import load_model_config

    found = []
    for folder in repository.iterdir() if repository.is_dir() else ():
        if folder.is_dir() and not folder.name.startswith("."):
            try:
                found.append(load_model_config(folder))
            except Exception:  # unreadable: the replicas report it, as they start
                continue
    return found


def replica_argv(argv: Sequence[str], port: int, grpc_port: int | None = None) -> list[str]:
    """The `lockgate serve` arguments of one replica behind the router: `argv` without the
    options above, on 127.0.0.1:`port`, and gRPC on `grpc_port` (None: off)."""
    grpc = "off" if grpc_port is None else str(grpc_port)
    own = ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", grpc, "--replicas", "1"]
    return [*_without(argv, _OWN), *own]


def shared_port_argv(argv: Sequence[str], private_port: int) -> list[str]:
    """The `lockgate serve` arguments of one replica balanced by the kernel: `argv`'s address
    and gRPC port, shared (`--reuse-port`), and its own HTTP port `private_port`."""
    own = ["--replicas", "1", "--reuse-port", "--private-port", str(private_port)]
    return [*_without(argv, _BALANCING), *own]


def _without(argv: Sequence[str], options: set[str]) -> list[str]:
    """`argv` less `options` (with their values) and the flags of `_FLAGS`."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name, eq, _ = arg.partition("=")
        if name in options:
            skip = not eq
        elif name not in _FLAGS:
            out.append(arg)
    return out


@dataclass(slots=True)
class Replicas:
    """The replica processes, restarted when they exit unasked."""

    argv: list[str]  # `lockgate serve ...` arguments, without the program
    ports: list[int]
    placement: Placement
    grpc_ports: list[int] | None = None  # one per replica; None: the replicas serve no gRPC
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    stopping: bool = False

    def start(self) -> None:
        for i in range(len(self.ports)):
            self._spawn(i)
        threading.Thread(target=self._watch, name="lockgate-replicas", daemon=True).start()

    def _spawn(self, i: int) -> None:
        grpc = None if self.grpc_ports is None else self.grpc_ports[i]
        command = [
            sys.executable,
            "-m",
            "lockgate.cli",
            *replica_argv(self.argv, self.ports[i], grpc),
        ]
        self.processes[i] = subprocess.Popen(
            command, preexec_fn=self.placement.preexec(i), env=self.placement.env(child_env())
        )
        log.info("replica %d on port %d: pid %d", i, self.ports[i], self.processes[i].pid)

    def _watch(self) -> None:
        """Start again a replica that exits unasked. It runs until every replica has exited
        after the stop: a replica started here is sent SIGTERM when this thread ends, as when
        its parent dies (`parent_death.py`), and a second SIGTERM would cut its drain short."""
        while not self.stopping or any(p.poll() is None for p in list(self.processes.values())):
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
