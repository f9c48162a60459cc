"""One replica as the router sees it: its load, its health and its recent answers. Pure
bookkeeping: the router tells it what happened and when."""

from __future__ import annotations

from dataclasses import dataclass, field

from lockgate.router.upstream import Upstream


@dataclass(frozen=True, slots=True)
class HealthSettings:
    probe_interval: float = 1.0  # seconds between readiness probes of each replica
    probe_timeout: float = 1.0
    eject_after: int = 5  # consecutive failures (no answer, or a 5xx other than 503)
    eject_for: float = 5.0  # seconds out of rotation after an ejection, doubled on a repeat
    eject_max: float = 60.0
    full_for: float = 0.1  # seconds a replica counts as full after it answered 503


@dataclass(slots=True)
class Ejection:
    """Consecutive failures along one way of reaching a replica, and the ejection they bring."""

    failures: int = 0  # consecutive
    until: float = 0.0  # out of rotation until then
    ejections: int = 0  # in a row, for the back-off

    def out(self, now: float) -> bool:
        return now < self.until

    def reset(self) -> None:
        self.failures = 0
        self.ejections = 0

    def failed(self, now: float, settings: HealthSettings) -> bool:
        """True when this failure ejected it."""
        self.failures += 1
        if self.failures < settings.eject_after:
            return False
        self.failures = 0
        self.ejections += 1
        back_off = settings.eject_for * 2 ** (self.ejections - 1)
        self.until = now + min(settings.eject_max, back_off)
        return True


@dataclass(slots=True)
class Replica:
    """`http` ejects a replica from all traffic (its HTTP port is the one probed and the one
    every route can take); `grpc` only from gRPC calls, so a replica whose gRPC port fails
    (a server started without one) keeps its HTTP traffic."""

    url: str  # http://host:port
    upstream: Upstream
    in_flight: int = 0  # this router's requests on it now
    reported: int = 0  # requests in progress it reported in its last answer or probe
    ready: bool = False  # its last readiness probe said 200
    http: Ejection = field(default_factory=Ejection)
    grpc: Ejection = field(default_factory=Ejection)
    full_until: float = 0.0  # it answered 503 (its admission refused) until about then
    answered: int = 0
    removed: bool = False  # gone from discovery: takes no new request
    # the model control requests (`ControlLog.seq`) it has been told up to, all in order; 0
    # when new or started again (its health answers report another boot id, or, from one
    # that reports none, a probe could not reach it): a probe that says 200 while it is
    # behind has them replayed to it first (`pool.py`)
    told: int = 0
    boot: bytes | None = None  # the boot id its last health answer reported (None: none yet)
    joining: bool = False  # being sent the model control requests it lacks: no traffic yet

    def usable(self, now: float) -> bool:
        return self.ready and not self.removed and not self.http.out(now)

    def full(self, now: float) -> bool:
        return now < self.full_until

    def open(self, now: float) -> bool:
        """Usable and not full: what balancing takes first."""
        return self.ready and not self.removed and now >= self.http.until and now >= self.full_until

    @property
    def ejected_until(self) -> float:
        return self.http.until

    @property
    def load(self) -> int:
        """What balancing compares: this router's requests, or what the replica reported if
        more (other routers' requests are in that)."""
        return max(self.in_flight, self.reported)

    def succeeded(self, reported: int | None, grpc: bool = False) -> None:
        ejection = self.grpc if grpc else self.http
        if ejection.failures or ejection.ejections:
            ejection.reset()
        self.answered += 1
        if reported is not None:
            self.reported = reported

    def refused(self, now: float, settings: HealthSettings) -> None:
        """It answered 503: full for a moment, not unhealthy."""
        self.http.failures = 0
        self.full_until = now + settings.full_for

    def failed(self, now: float, settings: HealthSettings, grpc: bool = False) -> bool:
        """No answer or a server error; True when this ejected it (from gRPC calls alone when
        `grpc`)."""
        return (self.grpc if grpc else self.http).failed(now, settings)
