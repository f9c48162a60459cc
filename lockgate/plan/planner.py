"""Capacity planner: from a request rate, a p99 SLO and a replica's speed to a replica count.

Time scaling. A replica is described by two numbers: the service time S a request sees once
its batch runs (T(B)), and the capacity in requests per second (B / T(B)). Utilization is
load / capacity. The queueing models then run in units of S at that utilization: with no
batching, capacity = 1 / S and the models are exact; with batching, a batch behaves like one
service of length S. So M/M/1 gives p99 = ln(100) S / (1 - rho), about 4.6 S / (1 - rho).

Worked example: 5,000 req/s, S = 5 ms, p99 SLO 50 ms, 1,143 req/s per replica.
4.6 * 5 ms / (1 - rho) <= 50 ms  =>  rho <= 0.54;  5000 / (1143 * 0.54) = 8.1  =>  9 replicas;
30% headroom on those: ceil(9 * 1.3) = 12.

Fixed overhead. Part of a request's latency occupies no replica: the HTTP round trip, parsing,
the network, the client. `lockgate profile` through a server measures it as the round trip
minus the model's compute time. It is added to every predicted p99 (p99 = overhead + the
queue's p99), and the queue must meet what the SLO leaves: SLO - overhead.

The recommendation is the largest of: the SLO count with headroom, the SLO count plus k spare
replicas (N + k), and the throughput count (utilization < 1). `binding` says which one won.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from lockgate.errors import BadRequest
from lockgate.plan.batching import batch_latency, batch_window, max_batch_within_slo
from lockgate.plan.queueing import MD1, P99, MMc, max_utilization, mm1_max_utilization
from lockgate.service_time import ServiceTime

QUEUE_MODELS = ("mm1", "md1", "mmc")


@dataclass(frozen=True, slots=True)
class PlanInputs:
    rate: float  # requests per second, all replicas together
    slo_p99_s: float
    service_time_s: float | None = None  # T(B) of the batch a request rides in
    capacity_per_replica: float | None = None  # req/s; default batch / service_time
    profile: ServiceTime | None = None  # T(B) = a + b B; chooses the batch size
    max_batch_size: int | None = None  # with a profile; default the profile's largest
    headroom: float = 0.3
    redundancy: int = 1  # N + k: k spare replicas
    cost_per_hour: float | None = None  # per replica
    queue_model: str = "mm1"
    overhead_s: float | None = None  # latency outside the replica; default the profile's

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise BadRequest(f"rate must be > 0 req/s, got {self.rate}")
        if not self.slo_p99_s > 0:
            raise BadRequest(f"p99 SLO must be > 0, got {self.slo_p99_s}")
        if self.profile is None and not (self.service_time_s or 0) > 0:
            raise BadRequest("give a service time > 0 or a service-time profile")
        if self.capacity_per_replica is not None and not self.capacity_per_replica > 0:
            raise BadRequest(f"capacity per replica must be > 0, got {self.capacity_per_replica}")
        if self.headroom < 0 or self.redundancy < 0:
            raise BadRequest("headroom and redundancy must be >= 0")
        if self.overhead_s is not None and not 0 <= self.overhead_s < math.inf:
            raise BadRequest(f"overhead must be a finite time >= 0, got {self.overhead_s}")
        if self.queue_model not in QUEUE_MODELS:
            raise BadRequest(f"queue model must be one of {QUEUE_MODELS}, got {self.queue_model}")


@dataclass(slots=True)
class Plan:
    rate: float
    slo_p99_s: float
    queue_model: str
    batch_size: int
    service_time_s: float
    capacity_per_replica: float
    max_utilization: dict[str, float]  # per queue model (mmc: at its replica count)
    replicas_by_model: dict[str, int]  # to meet the SLO, before headroom and spares
    replicas_throughput: int  # the fewest with utilization < 1
    replicas_slo: int  # by queue_model
    replicas_with_headroom: int
    replicas_with_redundancy: int
    replicas: int  # the recommendation
    binding: str  # "slo" | "throughput" | "redundancy"
    utilization: float
    p99_s: float
    utilization_after_failure: float
    p99_after_failure_s: float
    slo_met_after_failure: bool
    batch_latency_s: float  # L(B) at the per-replica rate
    batch_window_s: float
    max_batch_within_slo: int
    overhead_s: float = 0.0  # added to every p99; the queue gets slo_p99_s - overhead_s
    cost_per_million: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        for key in ("p99_after_failure_s",):
            if math.isinf(out[key]):
                out[key] = None
        return out


def p99_at(model: str, rho: float, service_time: float, replicas: int) -> float:
    """p99 response time of one replica (mm1, md1) or of the pooled replicas (mmc) at rho."""
    if rho >= 1:
        return math.inf
    if model == "mm1":
        return -math.log1p(-P99) * service_time / (1 - rho)
    if model == "md1":
        return MD1(rho / service_time, service_time).response_quantile(P99)
    mu = 1.0 / service_time
    return MMc(rho * replicas * mu, mu, replicas).response_quantile(P99)


def md1_meets(rho: float, service_time: float, slo: float) -> bool:
    """P(W + S <= slo) >= 0.99: one CDF evaluation with at most slo / S terms."""
    if rho == 0:
        return service_time <= slo
    return MD1(rho / service_time, service_time).wait_cdf(slo - service_time) >= P99


def replicas_for(model: str, load: float, service_time: float, slo: float) -> tuple[int, float]:
    """Fewest replicas for the SLO with `load` = rate / capacity, and rho_max for that model."""
    if model == "mm1":
        rho_max = mm1_max_utilization(service_time, slo)
    elif model == "md1":
        rho_max = max_utilization(lambda rho: md1_meets(rho, service_time, slo))
    else:
        n = math.floor(load) + 1
        while p99_at("mmc", load / n, service_time, n) > slo:
            if n > 100 * (load + 1):
                raise BadRequest(f"the SLO {slo * 1e3:g} ms cannot be met by adding replicas")
            n += 1
        return n, load / n
    if rho_max <= 0:
        raise BadRequest(
            f"the p99 SLO {slo * 1e3:g} ms cannot be met with a service time of "
            f"{service_time * 1e3:g} ms under the {model} model, at any load"
        )
    return math.ceil(load / rho_max - 1e-9), rho_max


def plan(inputs: PlanInputs) -> Plan:
    """Choose the batch size (with a profile), then the replica count."""
    overhead, queue_budget = _split_slo(inputs)
    batch, service_time, capacity = _operating_point(inputs, queue_budget)
    load = inputs.rate / capacity  # replicas' worth of work at utilization 1
    by_model: dict[str, int] = {}
    rho_max: dict[str, float] = {}
    for model in QUEUE_MODELS:
        by_model[model], rho_max[model] = replicas_for(model, load, service_time, queue_budget)
    n_slo = by_model[inputs.queue_model]
    n_throughput = math.floor(load) + 1
    with_headroom = math.ceil(n_slo * (1 + inputs.headroom) - 1e-9)
    with_redundancy = n_slo + inputs.redundancy
    replicas = max(with_headroom, with_redundancy, n_throughput)
    binding = _binding(n_slo, n_throughput, with_headroom, with_redundancy)
    survivors = max(replicas - 1, 0)
    rho_fail = load / survivors if survivors else math.inf
    p99_fail = overhead + p99_at(inputs.queue_model, rho_fail, service_time, survivors)
    per_replica_rate = inputs.rate / replicas
    t_of_b = inputs.profile.service_time if inputs.profile else (lambda _b: service_time)
    result = Plan(
        rate=inputs.rate,
        slo_p99_s=inputs.slo_p99_s,
        queue_model=inputs.queue_model,
        batch_size=batch,
        service_time_s=service_time,
        capacity_per_replica=capacity,
        max_utilization=rho_max,
        replicas_by_model=by_model,
        replicas_throughput=n_throughput,
        replicas_slo=n_slo,
        replicas_with_headroom=with_headroom,
        replicas_with_redundancy=with_redundancy,
        replicas=replicas,
        binding=binding,
        utilization=load / replicas,
        p99_s=overhead + p99_at(inputs.queue_model, load / replicas, service_time, replicas),
        utilization_after_failure=rho_fail,
        p99_after_failure_s=p99_fail,
        slo_met_after_failure=p99_fail <= inputs.slo_p99_s,
        batch_latency_s=batch_latency(batch, per_replica_rate, t_of_b),
        batch_window_s=batch_window(service_time, per_replica_rate, queue_budget),
        max_batch_within_slo=max_batch_within_slo(
            t_of_b, per_replica_rate, queue_budget, inputs.max_batch_size or batch
        ),
        overhead_s=overhead,
    )
    if inputs.cost_per_hour is not None:
        result.cost_per_million = replicas * inputs.cost_per_hour / (inputs.rate * 3600) * 1e6
    if not result.slo_met_after_failure:
        result.notes.append("one replica failing breaks the p99 SLO: raise redundancy")
    return result


def _binding(n_slo: int, n_throughput: int, with_headroom: int, with_redundancy: int) -> str:
    if with_redundancy > with_headroom:
        return "redundancy"
    return "slo" if n_slo > n_throughput else "throughput"


def _split_slo(inputs: PlanInputs) -> tuple[float, float]:
    """(fixed overhead, what the SLO leaves for the queue and the service)."""
    overhead = inputs.overhead_s
    if overhead is None:
        overhead = inputs.profile.overhead_s if inputs.profile else 0.0
    budget = inputs.slo_p99_s - overhead
    if budget <= 0:
        raise BadRequest(
            f"the p99 SLO {inputs.slo_p99_s * 1e3:g} ms is not above the fixed overhead "
            f"{overhead * 1e3:.3g} ms that every request pays outside the model"
        )
    return overhead, budget


def _operating_point(inputs: PlanInputs, budget: float) -> tuple[int, float, float]:
    """(batch size, service time, capacity per replica)."""
    if inputs.profile is None:
        assert inputs.service_time_s is not None
        capacity = inputs.capacity_per_replica or 1.0 / inputs.service_time_s
        return 1, inputs.service_time_s, capacity
    return choose_batch(inputs.profile, inputs, budget)


def choose_batch(
    profile: ServiceTime, inputs: PlanInputs, budget: float | None = None
) -> tuple[int, float, float]:
    """The batch cap needing the fewest replicas whose L(B) fits the SLO; ties go to smaller B.

    `budget` is the part of the SLO left after the fixed overhead (default: all of it)."""
    budget = inputs.slo_p99_s if budget is None else budget
    best: tuple[int, int, float, float] | None = None  # (replicas, B, T(B), capacity)
    for batch in range(1, (inputs.max_batch_size or profile.max_batch_size) + 1):
        service_time = profile.service_time(batch)
        if service_time <= 0:
            continue
        capacity = batch / service_time
        try:
            n, _ = replicas_for(inputs.queue_model, inputs.rate / capacity, service_time, budget)
        except BadRequest:
            continue
        fill = batch_latency(batch, inputs.rate / n, profile.service_time)
        if fill <= budget and (best is None or n < best[0]):
            best = (n, batch, service_time, capacity)
    if best is None:
        raise BadRequest(
            f"no batch size meets the p99 SLO {inputs.slo_p99_s * 1e3:g} ms with this profile "
            f"(T(1) = {profile.service_time(1) * 1e3:.3g} ms)"
        )
    return best[1], best[2], best[3]
