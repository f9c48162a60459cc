"""Queueing models for capacity planning: pure math, no I/O.

Times are in seconds and rates in requests per second throughout.

- Little's law: L = lambda * W.
- M/M/1: the response time is exponential with rate mu - lambda, so its p-quantile is
  -ln(1 - p) / (mu - lambda); for p = 0.99 that is ln(100) * S / (1 - rho) ~= 4.6 S / (1 - rho).
- M/D/1: the mean wait is Pollaczek-Khinchine's rho * S / (2 (1 - rho)). Quantiles use the
  exact waiting-time distribution of Erlang (1909), also known as Crommelin's formula:
      P(W <= t) = (1 - rho) sum_{k=0}^{floor(t/S)} (lambda (k S - t))^k / k! e^{-lambda (k S - t)}
  The alternating terms grow like e^{lambda t}, so the sum runs in decimal arithmetic with
  enough digits to cancel exactly. The response time is W + S (service is deterministic).
- M/M/c: Erlang C gives P(wait); the wait is 0 with probability 1 - C, else exponential with
  rate c mu - lambda. The response time adds an independent Exp(mu) service, whose tail has
  a closed form (a hypoexponential mix), so its quantile is found by bisection, no
  approximation beyond the model itself.
- M/G/1 (`MG1`): any service distribution, a parametric one (`ServiceDistribution`) or the
  measured one (`EmpiricalDistribution`), and an exceptional first service for a request that
  finds the server idle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, localcontext

import numpy as np

from lockgate.errors import BadRequest

P99 = 0.99
EXACT_SPAN = 50  # M/D/1: service times over which the exact waiting-time sum is used


def _check_rates(arrival_rate: float, service_rate: float, servers: int = 1) -> None:
    if not (arrival_rate >= 0 and math.isfinite(arrival_rate)):
        raise BadRequest(f"arrival rate must be a finite number >= 0, got {arrival_rate}")
    if not (service_rate > 0 and math.isfinite(service_rate)):
        raise BadRequest(f"service rate must be a finite number > 0, got {service_rate}")
    if servers < 1:
        raise BadRequest(f"the number of servers must be >= 1, got {servers}")
    if arrival_rate >= servers * service_rate:
        raise BadRequest(
            f"unstable queue: arrival rate {arrival_rate:g}/s >= capacity "
            f"{servers * service_rate:g}/s (utilization must stay below 1)"
        )


def _check_quantile(p: float) -> None:
    if not 0 < p < 1:
        raise BadRequest(f"quantile must be in (0, 1), got {p}")


def littles_law(arrival_rate: float, time_in_system: float) -> float:
    """L = lambda * W: the mean number in the system."""
    return arrival_rate * time_in_system


def bisect_increasing(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """The x in [lo, hi] where the increasing function f reaches target (hi grows if needed)."""
    for _ in range(200):
        if f(hi) >= target:
            break
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if f(mid) >= target:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(hi, 1e-12):
            break
    return hi


@dataclass(frozen=True, slots=True)
class MM1:
    """Poisson arrivals, exponential service, one server."""

    arrival_rate: float
    service_rate: float

    def __post_init__(self) -> None:
        _check_rates(self.arrival_rate, self.service_rate)

    @property
    def utilization(self) -> float:
        return self.arrival_rate / self.service_rate

    @property
    def mean_wait(self) -> float:
        return self.utilization / (self.service_rate - self.arrival_rate)

    @property
    def mean_response(self) -> float:
        return 1.0 / (self.service_rate - self.arrival_rate)

    def response_quantile(self, p: float = P99) -> float:
        _check_quantile(p)
        return -math.log1p(-p) / (self.service_rate - self.arrival_rate)

    def wait_quantile(self, p: float = P99) -> float:
        """P(Wq > t) = rho e^{-(mu - lambda) t}."""
        _check_quantile(p)
        rho = self.utilization
        if rho <= 1 - p:
            return 0.0
        return math.log(rho / (1 - p)) / (self.service_rate - self.arrival_rate)


@dataclass(frozen=True, slots=True)
class MD1:
    """Poisson arrivals, deterministic service time S, one server."""

    arrival_rate: float
    service_time: float

    def __post_init__(self) -> None:
        if not self.service_time > 0:
            raise BadRequest(f"service time must be > 0, got {self.service_time}")
        _check_rates(self.arrival_rate, 1.0 / self.service_time)

    @property
    def utilization(self) -> float:
        return self.arrival_rate * self.service_time

    @property
    def mean_wait(self) -> float:
        """Pollaczek-Khinchine: rho / (2 mu (1 - rho))."""
        rho = self.utilization
        return rho * self.service_time / (2 * (1 - rho))

    @property
    def mean_response(self) -> float:
        return self.mean_wait + self.service_time

    def wait_cdf(self, t: float) -> float:
        """P(W <= t): Erlang's exact sum up to 50 service times, the exponential tail beyond.

        The tail 1 - C e^{-theta t} has met the exact distribution to about six digits by
        5 service times, and the exact sum would need ever more digits past 50.
        """
        if t < 0:
            return 0.0
        if self.arrival_rate == 0:
            return 1.0
        if t > EXACT_SPAN * self.service_time:
            theta, c = self.tail_decay_rate(), self._tail_constant()
            return 1.0 - c * math.exp(-theta * t)
        return self._exact_wait_cdf(t)

    def _exact_wait_cdf(self, t: float) -> float:
        lam, s = self.arrival_rate, self.service_time
        n = math.floor(t / s)
        with localcontext() as ctx:
            ctx.prec = 30 + math.ceil(lam * t / math.log(10))
            lam_d, s_d, t_d = Decimal(lam), Decimal(s), Decimal(t)
            growth = (lam_d * t_d).exp()  # e^{lambda t}
            shrink = (-lam_d * s_d).exp()  # e^{-lambda S}
            total, factorial, scale = Decimal(1) * growth, Decimal(1), growth  # k = 0 term
            for k in range(1, n + 1):
                factorial *= k
                scale *= shrink  # e^{lambda (t - k S)}
                total += (lam_d * (k * s_d - t_d)) ** k / factorial * scale
            value = float(total * Decimal(1 - self.utilization))
        return min(1.0, max(0.0, value))

    def _tail_constant(self) -> float:
        rho = self.utilization
        return (1 - rho) / (rho * math.exp(self.tail_decay_rate() * self.service_time) - 1)

    def wait_quantile(self, p: float = P99) -> float:
        _check_quantile(p)
        if self.wait_cdf(0.0) >= p:
            return 0.0
        tail = self.tail_quantile(p)
        if tail > EXACT_SPAN * self.service_time:
            return tail
        return bisect_increasing(self.wait_cdf, p, 0.0, max(2 * tail, self.service_time))

    def response_quantile(self, p: float = P99) -> float:
        return self.wait_quantile(p) + self.service_time

    def tail_quantile(self, p: float = P99) -> float:
        """The quantile of the asymptotic tail P(W > t) ~ C e^{-theta t},
        C = (1 - rho) / (rho e^{theta S} - 1) (Cramer-Lundberg for M/G/1)."""
        theta = self.tail_decay_rate()
        return max(0.0, math.log(self._tail_constant() / (1 - p)) / theta)

    def tail_decay_rate(self) -> float:
        """theta with lambda (e^{theta S} - 1) = theta: P(W > t) ~ C e^{-theta t} for large t."""
        lam, s = self.arrival_rate, self.service_time
        if lam == 0:
            return math.inf

        def g(theta: float) -> float:
            return theta - lam * math.expm1(theta * s)  # > 0 between 0 and the root

        lo, hi = 1e-12 / s, 1.0 / s
        while g(hi) > 0:
            lo, hi = hi, hi * 2
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if g(mid) > 0 else (lo, mid)
        return (lo + hi) / 2


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in M/M/c with c servers and a = lambda/mu Erlangs."""
    if servers < 1:
        raise BadRequest(f"the number of servers must be >= 1, got {servers}")
    if not 0 <= offered_load < servers:
        raise BadRequest(f"offered load must be in [0, {servers}), got {offered_load}")
    erlang_b = 1.0
    for k in range(1, servers + 1):
        erlang_b = offered_load * erlang_b / (k + offered_load * erlang_b)
    return servers * erlang_b / (servers - offered_load * (1 - erlang_b))


@dataclass(frozen=True, slots=True)
class MMc:
    """Poisson arrivals, exponential service at rate mu per server, c servers, one queue."""

    arrival_rate: float
    service_rate: float
    servers: int

    def __post_init__(self) -> None:
        _check_rates(self.arrival_rate, self.service_rate, self.servers)

    @property
    def utilization(self) -> float:
        return self.arrival_rate / (self.servers * self.service_rate)

    @property
    def prob_wait(self) -> float:
        return erlang_c(self.servers, self.arrival_rate / self.service_rate)

    @property
    def _drain_rate(self) -> float:
        return self.servers * self.service_rate - self.arrival_rate

    @property
    def mean_wait(self) -> float:
        return self.prob_wait / self._drain_rate

    @property
    def mean_response(self) -> float:
        return self.mean_wait + 1.0 / self.service_rate

    def wait_tail(self, t: float) -> float:
        """P(W > t) = C e^{-(c mu - lambda) t}."""
        return self.prob_wait * math.exp(-self._drain_rate * t)

    def wait_quantile(self, p: float = P99) -> float:
        _check_quantile(p)
        c = self.prob_wait
        if c <= 1 - p:
            return 0.0
        return math.log(c / (1 - p)) / self._drain_rate

    def response_tail(self, t: float) -> float:
        """P(W + S > t) with W as above and S ~ Exp(mu) independent of W."""
        mu, gamma, c = self.service_rate, self._drain_rate, self.prob_wait
        if abs(gamma - mu) < 1e-12 * mu:
            both = (1 + mu * t) * math.exp(-mu * t)
        else:
            both = (gamma * math.exp(-mu * t) - mu * math.exp(-gamma * t)) / (gamma - mu)
        return (1 - c) * math.exp(-mu * t) + c * both

    def response_quantile(self, p: float = P99) -> float:
        _check_quantile(p)
        return bisect_increasing(
            lambda t: 1 - self.response_tail(t), p, 0.0, 1.0 / self.service_rate
        )


def max_utilization(meets_slo: Callable[[float], bool]) -> float:
    """The largest utilization rho in [0, 1) for which `meets_slo(rho)` holds.

    `meets_slo` must be true up to some rho and false beyond it. Returns 0.0 when even an idle
    server misses the SLO.
    """
    if not meets_slo(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-7:
        mid = (lo + hi) / 2
        if meets_slo(mid):
            lo = mid
        else:
            hi = mid
    return lo


def mm1_max_utilization(service_time: float, slo: float, p: float = P99) -> float:
    """Closed form: -ln(1-p) S / (1 - rho) <= slo  =>  rho <= 1 + ln(1-p) S / slo."""
    _check_quantile(p)
    return max(0.0, 1.0 + math.log1p(-p) * service_time / slo)


@dataclass(frozen=True, slots=True)
class ServiceDistribution:
    """A service time with a given mean and coefficient of variation cv = sd / mean.

    cv <= 1: a shifted exponential, a fixed part mean (1 - cv) plus an exponential stall of mean
    mean * cv (cv = 0 is deterministic, cv = 1 exponential): the shape of CPU work that is
    sometimes interrupted. cv > 1: a two-phase hyperexponential with balanced means.
    """

    mean: float
    cv: float = 0.0

    def __post_init__(self) -> None:
        if not (self.mean > 0 and math.isfinite(self.mean)):
            raise BadRequest(f"mean service time must be a finite number > 0, got {self.mean}")
        if not (self.cv >= 0 and math.isfinite(self.cv)):
            raise BadRequest(
                f"coefficient of variation must be a finite number >= 0, got {self.cv}"
            )

    @property
    def _phases(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """cv > 1: ((p1, mu1), (p2, mu2)) with p1 / mu1 = p2 / mu2 = mean / 2."""
        p1 = 0.5 * (1 + math.sqrt((self.cv**2 - 1) / (self.cv**2 + 1)))
        return (p1, 2 * p1 / self.mean), (1 - p1, 2 * (1 - p1) / self.mean)

    @property
    def span(self) -> float:
        """A time by which the service has all but surely ended."""
        return self.mean * (1 + 30 * self.cv)

    def cdf(self, x: np.ndarray) -> np.ndarray:
        """P(S <= x), x: [n]."""
        if self.cv > 1:
            (p1, mu1), (p2, mu2) = self._phases
            return 1 - p1 * np.exp(-mu1 * x) - p2 * np.exp(-mu2 * x)
        fixed, stall = self.mean * (1 - self.cv), self.mean * self.cv
        if stall == 0:
            return (x >= fixed).astype(np.float64)
        return -np.expm1(-np.maximum(x - fixed, 0.0) / stall)

    def residual_cdf(self, x: np.ndarray) -> np.ndarray:
        """The equilibrium (residual life) distribution: (1 / mean) * integral_0^x P(S > u) du."""
        if self.cv > 1:
            (p1, mu1), (p2, mu2) = self._phases
            return -(p1 * np.expm1(-mu1 * x) / mu1 + p2 * np.expm1(-mu2 * x) / mu2) / self.mean
        fixed, stall = self.mean * (1 - self.cv), self.mean * self.cv
        beyond = np.maximum(x - fixed, 0.0)
        tail = stall * -np.expm1(-beyond / stall) if stall > 0 else np.zeros_like(x)
        return (np.minimum(x, fixed) + tail) / self.mean

    def mgf(self, theta: float) -> float:
        """E[e^{theta S}] (inf where it diverges)."""
        if self.cv > 1:
            total = 0.0
            for p, mu in self._phases:
                if theta >= mu:
                    return math.inf
                total += p * mu / (mu - theta)
            return total
        fixed, stall = self.mean * (1 - self.cv), self.mean * self.cv
        if theta * stall >= 1:
            return math.inf
        return math.exp(theta * fixed) / (1 - theta * stall)

    def quantile(self, p: float) -> float:
        _check_quantile(p)
        if self.cv > 1:
            return bisect_increasing(lambda x: float(self.cdf(np.array([x]))[0]), p, 0.0, self.mean)
        return self.mean * (1 - self.cv) - self.mean * self.cv * math.log1p(-p)

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` independent service times: [count]."""
        if self.cv > 1:
            (p1, mu1), (_, mu2) = self._phases
            rates = np.where(rng.random(count) < p1, mu1, mu2)
            return rng.exponential(1.0, count) / rates
        return self.mean * (1 - self.cv) + rng.exponential(self.mean * self.cv, count)


@dataclass(frozen=True, slots=True)
class EmpiricalDistribution:
    """A measured service time: `values` (seconds) with `weights` (any scale, normalised here).

    The same interface as `ServiceDistribution`, for the distribution `lockgate profile` saw
    rather than one with its mean and cv: its tail is the tail that was measured.
    """

    values: tuple[float, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values or len(self.values) != len(self.weights):
            raise BadRequest("an empirical distribution needs as many weights as values, >= 1")
        if not all(v > 0 and math.isfinite(v) for v in self.values):
            raise BadRequest("empirical service times must be finite numbers > 0")
        if not all(w >= 0 and math.isfinite(w) for w in self.weights) or sum(self.weights) <= 0:
            raise BadRequest("empirical weights must be finite, >= 0 and not all 0")

    @classmethod
    def of(cls, values: np.ndarray, weights: np.ndarray | None = None) -> EmpiricalDistribution:
        """From samples (equal weights unless given), sorted."""
        if weights is None:
            weights = np.ones(len(values))
        order = np.argsort(values, kind="stable")
        return cls(tuple(values[order].tolist()), tuple(weights[order].tolist()))

    @property
    def _points(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted values [m], probabilities [m])."""
        values, weights = np.asarray(self.values), np.asarray(self.weights)
        order = np.argsort(values, kind="stable")
        return values[order], weights[order] / weights.sum()

    @property
    def mean(self) -> float:
        values, probs = self._points
        return float(values @ probs)

    @property
    def cv(self) -> float:
        values, probs = self._points
        mean = float(values @ probs)
        return math.sqrt(max(0.0, float((values - mean) ** 2 @ probs))) / mean

    @property
    def span(self) -> float:
        return max(self.values)

    def cdf(self, x: np.ndarray) -> np.ndarray:
        """P(S <= x), x: [n]."""
        values, probs = self._points
        below = np.concatenate(([0.0], np.cumsum(probs)))  # [m + 1]
        return below[np.searchsorted(values, x, side="right")]

    def residual_cdf(self, x: np.ndarray) -> np.ndarray:
        """(1 / mean) * integral_0^x P(S > u) du = E[min(S, x)] / mean."""
        values, probs = self._points
        k = np.searchsorted(values, x, side="right")  # values[:k] <= x
        done = np.concatenate(([0.0], np.cumsum(values * probs)))  # [m + 1]
        left = 1.0 - np.concatenate(([0.0], np.cumsum(probs)))  # P(S > values[k - 1])
        return (done[k] + x * left[k]) / float(values @ probs)

    def mgf(self, theta: float) -> float:
        values, probs = self._points
        with np.errstate(over="ignore"):
            return float(np.exp(theta * values) @ probs)

    def quantile(self, p: float) -> float:
        _check_quantile(p)
        values, probs = self._points
        k = int(np.searchsorted(np.cumsum(probs), p - 1e-12))
        return float(values[min(k, len(values) - 1)])

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` independent draws: [count]."""
        values, probs = self._points
        return rng.choice(values, size=count, p=probs)


@dataclass(frozen=True, slots=True)
class IdleStart:
    """Measured services of requests that found the server idle: `services[i]` seconds after it
    had been idle for `gaps[i]` seconds.

    Waking an idle server costs more the longer it slept (its caches, its clock, its threads
    went cold), so the first service depends on the idle time. Under Poisson arrivals at
    rate lambda the idle time is Exp(lambda), whatever came before, so the first service's
    distribution at lambda is the samples' mixed by that law: each sample stands for the
    idle times nearer its gap than any other sample's (geometric midpoints), and weighs
    P(idle time in that span). Idle times beyond the longest gap take the longest gap's.
    """

    gaps: tuple[float, ...]
    services: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.gaps or len(self.gaps) != len(self.services):
            raise BadRequest("idle start needs as many gaps as services, >= 1")
        if not all(g >= 0 and math.isfinite(g) for g in self.gaps):
            raise BadRequest("idle gaps must be finite numbers >= 0")

    def at(self, arrival_rate: float) -> EmpiricalDistribution:
        """The first service's distribution under Poisson arrivals at `arrival_rate`."""
        order = np.argsort(self.gaps, kind="stable")
        gaps = np.maximum(np.asarray(self.gaps)[order], 1e-12)  # [m]
        services = np.asarray(self.services)[order]  # [m]
        if arrival_rate <= 0:  # never an arrival: the longest idle there is
            return EmpiricalDistribution.of(services[-1:])
        edges = np.concatenate(([0.0], np.sqrt(gaps[:-1] * gaps[1:])))  # [m]
        survive = np.append(np.exp(-arrival_rate * edges), 0.0)  # P(idle > edge): [m + 1]
        weights = survive[:-1] - survive[1:]  # [m]
        if not weights.sum() > 0:  # every span beyond where exp underflows: the shortest gap
            weights = np.eye(len(gaps))[0]
        return EmpiricalDistribution.of(services, weights)


Distribution = ServiceDistribution | EmpiricalDistribution


GRID_POINTS = 1 << 14  # M/G/1: points on the time grid that carries the distributions


@dataclass(frozen=True, slots=True)
class MG1:
    """Poisson arrivals, a general service time, one server, first come first served;
    optionally an exceptional first service for a request that finds the server idle (Welch,
    1964): waking an idle server can cost more than taking the next queued request.

    Without it, the waiting time is the Pollaczek-Khinchine compound geometric: with
    probability (1 - rho) rho^n it is the sum of n independent residual service times, so its
    transform is (1 - rho) / (1 - rho R(z)) with R that of the residual distribution. With it,
    an arrival finds the server idle with probability p0 = (1 - rho) / (1 - rho + rho0)
    (rho0 = lambda E[S0]) and then takes S0; otherwise it waits V, whose transform is
    p0 rho0 R0(z) / (1 - rho R(z)), and takes S. The distributions are put on a grid of 16,384
    points that reaches where P(W > t) ~ e^{-theta t} has fallen below 1e-12 (theta: the root
    of lambda (E[e^{theta S}] - 1) = theta), and the sums are taken by FFT.
    """

    arrival_rate: float
    service: Distribution
    first_service: Distribution | None = None  # S0; None: the same as `service`

    def __post_init__(self) -> None:
        _check_rates(self.arrival_rate, 1.0 / self.service.mean)

    @property
    def utilization(self) -> float:
        """lambda E[S]: what decides stability."""
        return self.arrival_rate * self.service.mean

    @property
    def _first(self) -> Distribution:
        return self.first_service or self.service

    @property
    def idle_probability(self) -> float:
        """p0: the share of arrivals (and of time) that find the server idle."""
        rho, rho0 = self.utilization, self.arrival_rate * self._first.mean
        return (1 - rho) / (1 - rho + rho0)

    @property
    def mean_wait(self) -> float:
        """Pollaczek-Khinchine, with the first service apart:
        p0 rho0 (E[R0] / (1 - rho) + rho E[R] / (1 - rho)^2), E[R] = E[S] (1 + cv^2) / 2."""
        rho, s, s0 = self.utilization, self.service, self._first
        residual, residual0 = s.mean * (1 + s.cv**2) / 2, s0.mean * (1 + s0.cv**2) / 2
        rho0 = self.arrival_rate * s0.mean
        return (
            self.idle_probability * rho0 * (residual0 / (1 - rho) + rho * residual / (1 - rho) ** 2)
        )

    @property
    def mean_response(self) -> float:
        p0 = self.idle_probability
        return p0 * self._first.mean + (1 - p0) * self.service.mean + self.mean_wait

    def tail_decay_rate(self) -> float:
        """theta > 0 with lambda (E[e^{theta S}] - 1) = theta: P(W > t) ~ C e^{-theta t}."""
        lam = self.arrival_rate
        if lam == 0:
            return math.inf

        def gap(theta: float) -> float:  # > 0 between 0 and the root
            return theta - lam * (self.service.mgf(theta) - 1)

        hi = 1.0 / self.service.mean
        while gap(hi) > 0:
            hi *= 2
        lo = 0.0
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if gap(mid) > 0 else (lo, mid)
        return (lo + hi) / 2

    def _grid(self) -> tuple[float, np.ndarray, np.ndarray]:
        """(step h, P(W <= (k + 1/2) h), P(response <= (k + 1/2) h)) for k < 2 GRID_POINTS."""
        s, s0 = self.service, self._first
        longest = max(s.span, s0.span)
        step = (longest + math.log(1e12) / self.tail_decay_rate()) / GRID_POINTS
        edges = (np.arange(GRID_POINTS + 1) - 0.5).clip(min=0) * step  # [n + 1]
        size = 2 * GRID_POINTS  # room for W + S without wrapping around

        def spectrum(cdf: np.ndarray) -> np.ndarray:  # mass rounded to the nearest point
            return np.fft.rfft(np.diff(cdf), size)

        residual, service = spectrum(s.residual_cdf(edges)), spectrum(s.cdf(edges))
        residual0, service0 = spectrum(s0.residual_cdf(edges)), spectrum(s0.cdf(edges))
        p0, rho = self.idle_probability, self.utilization
        busy_z = p0 * self.arrival_rate * s0.mean * residual0 / (1 - rho * residual)  # V > 0
        wait = np.fft.irfft(busy_z, size)  # [size]
        wait[0] += p0
        response = np.fft.irfft(p0 * service0 + busy_z * service, size)  # [size]
        return step, np.cumsum(wait), np.cumsum(response)

    def wait_quantile(self, p: float = P99) -> float:
        _check_quantile(p)
        if self.arrival_rate == 0 or self.idle_probability >= p:
            return 0.0
        step, wait, _ = self._grid()
        return _grid_quantile(wait, step, p)

    def response_quantile(self, p: float = P99) -> float:
        _check_quantile(p)
        if self.arrival_rate == 0:
            return self._first.quantile(p)
        step, _, response = self._grid()
        return _grid_quantile(response, step, p)


def _grid_quantile(cdf: np.ndarray, step: float, p: float) -> float:
    """The p-quantile of a distribution whose CDF at (k + 1/2) step is cdf[k], interpolated."""
    k = int(np.searchsorted(cdf, p))
    if k == 0:
        return 0.5 * step * p / max(cdf[0], 1e-300)
    below = float(cdf[k - 1])
    above = float(cdf[min(k, len(cdf) - 1)])
    fraction = (p - below) / (above - below) if above > below else 1.0
    return (k - 0.5 + fraction) * step
