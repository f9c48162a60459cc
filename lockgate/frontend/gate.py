"""The connection gate: what the HTTP protocol decides before a request reaches the app.

These decisions are made per connection or request head, each before any body is read:

- **Saturation (refuse before the parse).** The signal is event-loop lag: a sentinel timer is
  due every `interval` seconds, and the lag is how late it fires. While the loop keeps up, the
  lag stays near zero whatever the model does on its own threads; when the loop itself falls
  behind (more request bytes arrive than it can parse, route and answer), requests wait in
  socket buffers where no queue can see them, and the lag grows with that wait. Past
  `max_lag` a new request head is answered 503 with Retry-After at once, from a canned
  response, with no ASGI task and no body read. The lag is read two ways: the average of the
  sentinel's recent lags (each firing has weight `weight`, so one stall, say a large body
  decoded on the loop, does not refuse the requests after it, and a lasting lag does within a
  few firings), and how overdue the sentinel is right now, over four (the loop may be inside a
  long iteration that has not let it fire: requests read late in that iteration have waited).
  The lag and the queue below refuse only while other requests are in progress: with none,
  the lag comes from elsewhere (another process on the core, a model run inline), and
  refusing the one request there frees nothing. Nor do they refuse while a model loads or
  warms up: its threads hold the interpreter for seconds, the loop lags for that, and a
  reload must not refuse the requests it is meant to serve without a gap (the models'
  own admission still refuses what they cannot finish in time).
  Event-loop lag was chosen over an adaptive concurrency limit because it measures the one
  resource the gate protects (the loop) directly, needs no latency baseline to learn, and
  reacts within one loop iteration; the batcher's own admission already refuses what the
  model's queue cannot finish in time.
- **Front-end queueing (CoDel).** A request's delay from its first byte to the start of its
  handler is the time it queued inside the process (behind other requests' parsing, routing
  and inline work). For a request sent while its connection was paused (below), it counts
  from the pause's end: the pause is the gate's own doing, not a queue, and counted it made
  one (under overload the requests let through came from paused connections, their least
  delay was a pause, and new requests were refused as queued: beside a process burning its
  core, digits_onnx refused thousands a second so, and none with pauses off). When even the
  least delayed request of an `interval` (50 ms) waited more than `queue_target` (5 ms), the
  queue is standing, not a burst: new heads are refused until an interval passes with a
  request under the target. With no new evidence for two intervals, the verdict lapses, so
  requests are let in to measure again. Loop lag alone misses this queue: each iteration can
  stay short while a request needs several of them.
- **Requests in progress.** At most `max_requests` requests with a complete head run at once
  (the rest: 503). Connections still sending a head do not count, so idle or slow
  connections cannot take the places that probes and complete requests need.
- **Bodies that do not come.** A request let through holds its place while its body
  arrives, up to the body timeout (30 s). A client that sends complete heads and then
  trickles or stalls the bodies could so hold every place, and every other client would be
  refused. When every place is taken and a new request head arrives, the place of a request
  whose body has been arriving for more than `slow_body` seconds is taken back: the oldest of
  the client address holding the most requests still receiving their body (among those whose
  oldest is past `slow_body`). That request is answered 503
  with Retry-After and its connection closes (the rest of its body is not read), and the new
  request goes on in its place. Requests whose bodies arrive within `slow_body` are never
  touched, nor are any while places are free; a client sending large bodies over a slow link
  loses its place only to complete requests, and only when the server is full.
- **Connections.** At most `max_connections_per_client` open connections per client address
  and `max_connections` in all; past either, a new connection is closed at once. A request
  head must arrive in full within `head_timeout` of the connection opening or of the request's
  first byte; past it, the connection is closed.
- **Clients that resend at once.** A refusal costs CPU; a client that resends the moment it
  is refused, on many connections, turns that into all of it, and the model starves. When
  refusals pass 0.3 per admitted request (`penalty_ratio`) over the last second, a connection
  that was just refused is not read again for `penalty_pause` seconds, or the refused
  request's budget (its timeout or its model's SLO; `pause_share` of it) if less: its refusal
  is sent at once, its next request waits. An answer resumes the connection paused last
  (`hold`, `answered`), so room freed by an answer goes to the request that has waited least
  and the first paused wait out their pause; but only when the last request judged was let
  through. While requests are being refused as they arrive, those arrivals take the room an
  answer frees (in a storm, the answered client's own next request), and a connection resumed
  into it is refused again: one refusal per answer, for nothing. digits_onnx pinned to one
  core, in a storm of 256 connections that resend at once, served 4,186 to 6,160 requests per
  second inside the SLO (median 5,512) in six runs this way, against 2,898 to 4,375 (median
  3,796) in six, interleaved, resuming on every answer. A paused connection is still read, and
  what it sends is held unparsed until the pause ends, so a request sent during the pause is
  taken to have arrived when it did (its deadline and its admission count the wait it had).
  (Its reads were stopped instead, and the kernel's receive stamp of the unread bytes peeked
  at the end: 47 against 38 µs a refusal (medians) in a storm of 256
  connections on a model kept busy, six three-second rounds each.) A request
  that waited out a whole pause has spent its budget, and is refused when read, but its
  refusal does not pause the connection again: its client did not resend at once, the pause
  held it. Paused again, a connection of a client with requests queued (an open-loop client,
  whose pool sends each request on the connection freed last) had every request refused for
  the wait the pause before it caused, and stayed so while refusals outnumbered answers:
  beside a process burning its core, digits_onnx went on refusing nearly all of 3,000
  requests a second, which it serves, after a burst of 10,000 a second had started the
  pauses. So a connection is paused at most once for every request refused fresh.
  Why a ratio of 1 and the whole budget: under load a refusal costs the loop about half what
  an answer does (45 to 105 µs against 92 to 123 µs, fitted over a digits_onnx storm), so at
  ten refusals per answer, the old default, refusals took five sixths of the core, and a
  pause of a quarter of digits_onnx's 50 ms SLO let 256 connections send 20,000 refusals a
  second. digits_onnx pinned to one core, in a storm of 256 connections that resend at once,
  served 2,280 to 5,004 requests per second inside the SLO in fourteen runs with these
  defaults, against 249 to 803 in eight with the old ones (10 and a quarter), admitted p99
  29 to 45 ms in all but one (58 ms). The cost: a refused request of a paused client is
  answered up to a pause later (refusal p99 about 70 ms there, against 25 ms), and an
  open-loop client whose connections are paused queues in its own pool: at 10,000 requests
  per second two seconds after a storm, admitted client p99 went past the 50 ms SLO in five
  of ten runs (62 to 173 ms; 53 ms in one of four with the old defaults), though not in the
  overload suite, whose levels climb from 0.5x. Overload with fewer refusals than answers
  over the last second does not pause. minilm's 500 ms SLO leaves its pause at
  `penalty_pause`.

Health probes (`/v2/health/live`, `/v2/health/ready`, `/health`) and `/metrics` are never
refused by the gate, so an orchestrator never restarts a server because it is busy.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

REFUSAL_SHARE = 0.1  # a refusal's loop CPU against an answer's (refusal_cost: 36 / 421 µs)
MAX_REFUSED_SHARE = 0.5  # of a loop-cost window's answers' worth, the most its refusals make
OVERDUE_FACTOR = 4.0  # an overdue sentinel counts as this much less lag than it shows
HELD_MAX = 4096  # paused connections an answer may resume; past it, the oldest wait out their pause
EXEMPT_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/health", "/metrics"})


@dataclass(frozen=True, slots=True)
class GateSettings:
    max_lag: float = 0.010  # seconds of event-loop lag past which new requests are refused; 0: off
    interval: float = 0.005  # seconds between sentinel timers
    weight: float = 0.1  # weight of the newest firing in the average lag
    max_requests: int | None = 1024  # requests in progress (complete heads); None: no limit
    max_connections: int = 16384  # open connections in all
    max_connections_per_client: int = 1024  # open connections from one client address
    slow_body: float = 1.0  # seconds of body arriving after which a full server takes the place
    head_timeout: float = 10.0  # seconds for a request head to arrive in full
    queue_target: float = 0.005  # seconds of front-end delay that, standing, refuses; 0: off
    queue_interval: float = 0.050  # seconds over which the least delay is taken
    penalty_ratio: float = 0.3  # refusals per admitted request that pause refused connections
    penalty_pause: float = 0.1  # seconds a refused connection is not read; 0: never
    pause_share: float = 1.0  # of a refused request's budget: the most a pause takes of it

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], not {self.weight!r}")
        names = (
            "max_lag",
            "interval",
            "head_timeout",
            "queue_target",
            "queue_interval",
            "slow_body",
        )
        for name in (*names, "penalty_ratio", "penalty_pause", "pause_share"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
        if self.pause_share > 1:
            raise ValueError(f"pause_share must be at most 1, not {self.pause_share!r}")
        if self.interval <= 0 or self.head_timeout <= 0:
            raise ValueError("interval and head_timeout must be > 0")
        if self.max_connections < 1 or self.max_connections_per_client < 1:
            raise ValueError("max_connections and max_connections_per_client must be >= 1")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("max_requests must be >= 1 or None")


@dataclass(slots=True)
class LoopLag:
    """Event-loop lag from a sentinel timer. Pure bookkeeping: the caller gives the clock and
    the loop thread's time waited for a CPU (`thread_clock.py`).

    A firing's lag is the loop's own lateness: how late it came less the time the loop waited
    for its core since the timer was set. A loop behind on its own work is late by that work;
    one that only waited for a neighbour's slice to end is not, and refusing requests would
    free it of nothing. Counted whole, those slices (several milliseconds each, beside a
    process that burns the core) made digits_onnx's loop look saturated at any load: at
    10,000 requests a second it refused all but 30 to 130 a second, where it could serve a
    couple of thousand. Beside such a neighbour a loop behind on its work runs half the time,
    so its own lateness is about half the wall's: the limit is reached at about twice the
    lag, and the models' admission holds the deadlines."""

    interval: float
    weight: float
    due: float = 0.0  # when the sentinel should fire next; 0: not started
    average: float = 0.0  # weighted average of the lags at recent firings
    waited: float = 0.0  # the loop thread's time waited for a CPU at the last firing

    def fired(self, now: float, waited: float = 0.0) -> float:
        """The sentinel fired at `now`, the loop thread having waited `waited` seconds for a
        CPU in all; returns the delay before the next one."""
        if self.due:
            lag = max(0.0, now - self.due - max(0.0, waited - self.waited))
            self.average += self.weight * (lag - self.average)
        self.due, self.waited = now + self.interval, waited
        return self.interval

    def current(self, now: float) -> float:
        """The lag now: the recent average, or a quarter of how overdue the sentinel is, if
        more (one preemption by the OS must not refuse; an iteration that has run for four
        times the limit already has)."""
        overdue = now - self.due if self.due else 0.0
        return max(overdue / OVERDUE_FACTOR, self.average)


@dataclass(slots=True)
class QueueDelay:
    """CoDel's test for a standing queue, on front-end delays. Pure: the caller gives times."""

    target: float
    interval: float
    started: float = 0.0  # the current interval's start
    least: float = math.inf  # the least delay seen in it
    standing: bool = False  # the last full interval's least delay was over the target
    decided: float = 0.0  # when `standing` was last decided

    def observe(self, delay: float, now: float) -> None:
        if now - self.started >= self.interval:
            if self.least != math.inf:
                self.standing, self.decided = self.least > self.target, now
            self.started, self.least = now, delay
        else:
            self.least = min(self.least, delay)

    def standing_at(self, now: float) -> bool:
        return self.standing and now - self.decided < 2 * self.interval


@dataclass(slots=True)
class LoopCost:
    """The event loop's CPU seconds per answered request, over windows of `window` seconds with
    at least `least` answers (an exponential average across windows, newest weight
    `weight`). Pure: the caller gives the clock and the loop thread's CPU time.

    The first window of all is not counted. A server's first answers cost tens of times the
    rest (connections opened, code paths run for the first time: 15 answers for 129 ms of
    CPU, where the next windows took 100 ms for 300 to 900 answers); counted, they made
    every arrival for the next second look tens of milliseconds late, and a closed loop of 32
    clients on a model answering in 3 ms was refused a fifth of its requests.

    Requests let through on arrival wait for the loop's work already taken on: their
    handlers run after those of the requests in progress. Admission on arrival multiplies
    this cost by the requests in progress to predict that wait (not counting those still
    waiting for their body: their handlers wait on their clients, not on the loop). The
    loop's CPU also pays for refusals, so each refusal counts as `REFUSAL_SHARE` of an
    answer (what a refusal costs against a served request, measured by the refusal_cost
    benchmark): counted as nothing, a storm of refusals would make every answer look costly,
    refuse more, and feed on itself. That share is a quiet machine's, though: on a core shared
    with another process a refusal measured up to half an answer, and counted at a tenth, a
    window of 300 answers and 9,700 refusals put an answer at 480 µs of loop CPU where it
    costs under 100; the wait predicted for 30 requests in progress filled digits_onnx's 50 ms
    SLO, every request was refused, and the windows left had ever fewer answers. So a window
    counts only when refusals make at most `MAX_REFUSED_SHARE` of its answers' worth; in a
    storm the cost measured before it holds.

    Each window also measures the loop's share of its core while it had work (its CPU time
    over that and the time it waited for a CPU, `thread_clock.py`), reported, not used: the
    wait predicted from the CPU ahead over that share refused a fresh server's closed loop of
    32 clients on digits_onnx (a fifth of its requests) on a busy machine, where without it
    none are. A loop kept off its core waits a neighbour's slice at each wake-up, whatever its
    work ahead, so the share understates what its work gets once it runs."""

    window: float = 0.1
    least: int = 8
    weight: float = 0.3
    per_request: float = 0.0  # seconds; 0 until a window has been measured
    started: float | None = None  # when the current window began
    cpu_at_start: float = 0.0
    waited_at_start: float = 0.0
    answered: float = 0.0  # answers, and refusals at REFUSAL_SHARE each
    refused: float = 0.0  # of `answered`, the refusals' worth
    warm: bool = False  # the first window with enough answers is over (and not counted)
    share: float = 1.0  # of the core the loop had while it had work

    def answer(self) -> None:
        self.answered += 1

    def refuse(self) -> None:
        self.answered += REFUSAL_SHARE
        self.refused += REFUSAL_SHARE

    def sample(self, now: float, cpu: float, waited: float = 0.0) -> None:
        """At `now`, the loop thread has run `cpu` seconds and waited `waited` for a CPU."""
        if self.started is not None and now - self.started < self.window:
            return
        if self.started is not None and self.answered >= self.least:
            if self.warm:
                ran = cpu - self.cpu_at_start
                if self.refused <= MAX_REFUSED_SHARE * self.answered:
                    cost = ran / self.answered
                    old = self.per_request
                    self.per_request = cost if not old else old + self.weight * (cost - old)
                if ran > 0:
                    share = ran / (ran + max(0.0, waited - self.waited_at_start))
                    self.share += self.weight * (share - self.share)
            self.warm = True
        if (
            self.started is None
            or self.answered >= self.least
            or now - self.started > 10 * self.window
        ):
            self.started, self.answered, self.refused = now, 0.0, 0.0
            self.cpu_at_start, self.waited_at_start = cpu, waited

    def wait(self, in_progress: int) -> float:
        """Seconds of loop work ahead of a request let through now."""
        return in_progress * self.per_request


@dataclass(slots=True)
class Rate:
    """Events per second, decaying with time constant `tau` seconds. Pure."""

    tau: float = 1.0
    value: float = 0.0
    at: float = 0.0

    def add(self, now: float) -> None:
        decayed = self.value * math.exp(-max(0.0, now - self.at) / self.tau)  # `current`, inline
        self.value = decayed + 1.0 / self.tau
        self.at = now

    def current(self, now: float) -> float:
        return self.value * math.exp(-max(0.0, now - self.at) / self.tau)


@dataclass(slots=True)
class BodyWait:
    """A request let through whose body is still arriving: since when, and how to take its
    place back (answer it 503 and close its connection)."""

    since: float
    evict: Callable[[], None]


@dataclass(slots=True)
class BodyWaits:
    """The requests of each client address whose body is still arriving, oldest first. Pure
    bookkeeping: the caller gives the clock; a connection waits for one body at a time and is
    its own key."""

    by_client: dict[str, dict[object, BodyWait]] = field(default_factory=dict)

    def start(self, address: str, key: object, since: float, evict: Callable[[], None]) -> None:
        self.by_client.setdefault(address, {})[key] = BodyWait(since, evict)

    def end(self, address: str, key: object) -> None:
        waits = self.by_client.get(address)
        if waits is not None and waits.pop(key, None) is not None and not waits:
            del self.by_client[address]

    def evict(self, now: float, slow: float) -> bool:
        """Take back the place of the oldest request of the client holding the most requests
        whose body is arriving, among those whose oldest has been at it for over `slow`
        seconds; False when there is none. (A client's requests are in the order they
        started: its oldest is its first.)"""
        chosen: str | None = None
        most = 0
        for address, waits in self.by_client.items():
            if len(waits) > most and now - next(iter(waits.values())).since > slow:
                chosen, most = address, len(waits)
        if chosen is None:
            return False
        key, wait = next(iter(self.by_client[chosen].items()))
        self.end(chosen, key)
        wait.evict()
        return True


@dataclass(slots=True)
class Gate:
    """Shared by every connection of one server: settings, the lag and the connection table."""

    settings: GateSettings = field(default_factory=GateSettings)
    lag: LoopLag = field(init=False)
    queue: QueueDelay = field(init=False)
    loop_cost: LoopCost = field(default_factory=LoopCost)
    admitted: Rate = field(default_factory=Rate)  # heads let through, per second
    refusing: Rate = field(default_factory=Rate)  # heads refused, per second
    connections: Counter[str] = field(default_factory=Counter)  # open connections per address
    open_connections: int = 0
    bodies: BodyWaits = field(default_factory=BodyWaits)  # let through, body still arriving
    # resumes of paused connections, oldest first; each says whether it resumed one (not when
    # the connection was resumed already, by its timer, or closed)
    held: deque[Callable[[], bool]] = field(default_factory=lambda: deque(maxlen=HELD_MAX))
    full: bool = False  # the last request head judged was refused (`answered` resumes none)

    def __post_init__(self) -> None:
        self.lag = LoopLag(self.settings.interval, self.settings.weight)
        self.queue = QueueDelay(self.settings.queue_target, self.settings.queue_interval)

    def connect(self, address: str) -> str | None:
        """Count a new connection; returns why it must be closed, or None to keep it."""
        s = self.settings
        if self.open_connections >= s.max_connections:
            return "connections"
        if self.connections[address] >= s.max_connections_per_client:
            return "client_connections"
        self.connections[address] += 1
        self.open_connections += 1
        return None

    def disconnect(self, address: str) -> None:
        left = self.connections[address] - 1
        if left > 0:
            self.connections[address] = left
        else:
            del self.connections[address]
        self.open_connections -= 1

    def admit(self, path: str, in_progress: int, now: float, loading: bool = False) -> str | None:
        """Whether a complete request head may go on to the app: None, or the refusal reason.
        `loading`: a model is loading or warming up, whose threads lag the loop."""
        if path in EXEMPT_PATHS:
            return None
        s = self.settings
        full = s.max_requests is not None and in_progress >= s.max_requests
        if full and not self.bodies.evict(now, s.slow_body):  # else: in a slow body's place
            return "requests"
        if in_progress == 0 or loading:  # the lag is not the requests' doing
            return None
        if s.max_lag > 0 and self.lag.current(now) > s.max_lag:
            return "loop_lag"
        if s.queue_target > 0 and self.queue.standing_at(now):
            return "queue_delay"
        return None

    def let_through(self, now: float) -> None:
        self.admitted.add(now)
        self.full = False

    def refused(
        self,
        now: float,
        budget: float | Callable[[], float | None] | None = None,
        waited_pause: bool = False,
    ) -> float:
        """Count a refusal; returns how long to leave its connection unread (0: not at all).
        `budget`: the refused request's time budget (its timeout or its model's SLO), when
        known, or a function that finds it (called only when the connection is paused): the
        pause is at most `pause_share` of it (below 1, a request that waited the pause out
        keeps the rest of its budget to be admitted). `waited_pause`: the request was sent
        while its connection was paused, and read at the pause's end; its client did not
        resend at once, the pause held it, and pausing again for it would hold the
        connection's next request the same way, and the one after, for as long as refusals
        outnumber answers. Beside a process burning its core, digits_onnx at 10,000 requests
        a second so refused nearly everything (its model 3% busy) from connections that
        were never read but to refuse what they had sent a pause before."""
        self.refusing.add(now)
        self.loop_cost.refuse()
        self.full = True
        s = self.settings
        if s.penalty_pause <= 0 or waited_pause:
            return 0.0
        threshold = max(1.0, s.penalty_ratio * max(1.0, self.admitted.current(now)))
        if self.refusing.current(now) > threshold:  # (one refusal a second is no storm)
            known = budget() if callable(budget) else budget
            return s.penalty_pause if known is None else min(s.penalty_pause, known * s.pause_share)
        return 0.0

    def hold(self, resume: Callable[[], bool]) -> None:
        """A refused connection is paused: `resume` reads it again, at the latest when its
        pause ends (the caller's timer), sooner when an answer frees room (`answered`)."""
        self.held.append(resume)

    def answered(self) -> None:
        """A request was answered: its room goes to the connection paused last, whose
        request, if it sent one, has waited least (the first paused have waited longest, and
        would be refused again); unless the last request judged was refused: then the
        requests arriving take that room, and the resumed one would be refused."""
        self.loop_cost.answer()
        if self.full:
            return
        while self.held and not self.held.pop()():
            pass  # that one had resumed already: the room goes to the next

    def retry_after(self, now: float) -> int:
        """Whole seconds to suggest: at least 1."""
        return max(1, math.ceil(self.lag.current(now)))
