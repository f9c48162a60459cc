"""Capacity planner: from a request rate, a p99 SLO and a replica's speed to a replica count.

Time scaling. A replica is described by two numbers: the service time S a request sees once
its batch runs, and the capacity in requests per second (B / S). Utilization is
load / capacity. The queueing models then run in units of S at that utilization: with no
batching, capacity = 1 / S and the models are exact; with batching, mm1, md1, mg1 and mmc
treat a batch as one service of length S, while the batch model simulates the batcher
itself (batching.BatchQueue). So M/M/1 gives p99 = ln(100) S / (1 - rho), about
4.6 S / (1 - rho).

The service time. A batch of B rows takes the model T(B) = a + b B. When the model computes
on the CPU it shares one core with the front end (HTTP, JSON, the batcher), whose CPU per
request f the profile measures: then S(B) = T(B) + f B, for the two take turns on the core.
Part of f is paid once per batch (the loop's turn, the batch's dispatch): the profile measures
it from the CPU per row one at a time and with requests queued, and a batch of B pays it once.
mg1 and batch also use how much S varies (the profile's cv of T(1)).

Worked example: 5,000 req/s, S = 5 ms, p99 SLO 50 ms, 1,143 req/s per replica.
4.6 * 5 ms / (1 - rho) <= 50 ms  =>  rho <= 0.54;  5000 / (1143 * 0.54) = 8.1  =>  9 replicas;
30% headroom on those: ceil(9 * 1.3) = 12.

Fixed overhead. Part of a request's latency occupies no replica: the network, the client,
waiting on the event loop. `lockgate profile` through a server measures the round trip minus
the model's compute time, d; the front end's CPU f moves from it into S, leaving d - f. It is
added to every predicted p99 (p99 = overhead + the queue's p99), and the queue must meet what
the SLO leaves: SLO - overhead.

Idle start. A request that finds the replica idle costs more than one that follows another:
the profile times one-row requests after idle gaps, and mg1 (at batch 1) and batch take S(1)
plus how much longer each took than one back to back (in the server, by its statistics) as
the service of such a request, mixed over the idle times of Poisson arrivals at the
replica's rate (`queueing.IdleStart`). At low utilization
most requests find the replica idle, so this is what sets the p99 there; at high utilization
few do. `idle_start=False` (`--no-idle-start`) plans without it.

The recommendation is the largest of: the SLO count with headroom, the SLO count plus k spare
replicas (N + k), and the throughput count (utilization < 1). `binding` says which one won.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from lockgate.errors import BadRequest
from lockgate.plan.batching import (
    BatchQueue,
    batch_latency,
    batch_window,
    max_batch_within_slo,
)
from lockgate.plan.profile import ReplicaProfile, batch_sizes_up_to
from lockgate.plan.queueing import (
    MD1,
    MG1,
    P99,
    EmpiricalDistribution,
    IdleStart,
    MMc,
    ServiceDistribution,
    max_utilization,
    mm1_max_utilization,
)

QUEUE_MODELS = ("mm1", "md1", "mg1", "mmc", "batch")
ANALYTIC_MODELS = ("mm1", "md1", "mg1", "mmc")  # cheap enough to report beside any choice


@dataclass(frozen=True, slots=True)
class PlanInputs:
    rate: float  # requests per second, all replicas together
    slo_p99_s: float
    service_time_s: float | None = None  # T(B) of the batch a request rides in
    capacity_per_replica: float | None = None  # req/s; default batch / service_time
    profile: ReplicaProfile | None = None  # T(B) = a + b B; chooses the batch size
    max_batch_size: int | None = None  # with a profile; default the profile's largest
    headroom: float = 0.3
    redundancy: int = 1  # N + k: k spare replicas
    cost_per_hour: float | None = None  # per replica
    queue_model: str = "mm1"
    overhead_s: float | None = None  # latency outside the replica; default the profile's
    service_cv: float | None = None  # sd / mean of the service time; default the profile's
    frontend_s: float | None = None  # CPU per request on the model's core; default the profile's
    frontend_batch_s: float | None = None  # of it, paid once per batch; default the profile's
    batch_window_s: float | None = None  # batch model; default the SLO batcher's rule
    idle_start: bool = True  # mg1, batch: the profile's services after idle, where it has them

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
        for name in (
            "overhead_s",
            "service_cv",
            "frontend_s",
            "frontend_batch_s",
            "batch_window_s",
        ):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise BadRequest(f"{name} must be a finite number >= 0, got {value}")
        if self.queue_model not in QUEUE_MODELS:
            raise BadRequest(f"queue model must be one of {QUEUE_MODELS}, got {self.queue_model}")

    @property
    def cv(self) -> float:
        if self.service_cv is not None:
            return self.service_cv
        return self.profile.service_cv if self.profile else 0.0

    @property
    def frontend(self) -> float:
        if self.frontend_s is not None:
            return self.frontend_s
        return self.profile.frontend_s if self.profile else 0.0

    @property
    def frontend_batch(self) -> float:
        """At most the whole front end of a one-row request."""
        if self.frontend_batch_s is not None:
            share = self.frontend_batch_s
        else:
            share = self.profile.frontend_per_batch_s if self.profile else 0.0
        return min(share, self.frontend)


@dataclass(slots=True)
class Plan:
    rate: float
    slo_p99_s: float
    queue_model: str
    batch_size: int
    service_time_s: float  # S: one batch, front end included
    capacity_per_replica: float
    max_utilization: dict[str, float]  # per queue model (mmc, batch: at its replica count)
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
    frontend_s: float = 0.0  # CPU per request that queues with the model (in S)
    frontend_batch_s: float = 0.0  # the part of it paid once per batch
    service_cv: float = 0.0  # of S: mg1 and batch
    first_service_s: float | None = None  # mean service after idle at the plan's rate
    cost_per_million: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        for key in ("p99_after_failure_s",):
            if math.isinf(out[key]):
                out[key] = None
        return out


@dataclass(frozen=True, slots=True)
class ReplicaQueue:
    """One replica as its queue model sees it, at one batch size.

    The model takes T(B) = a + b B for a batch of B rows. When the front end's CPU per request
    shares the model's core, it queues with the model, so a batch occupies the replica for
    S(B) = a + (b + frontend) B, less what a batch pays once for all its rows (the loop's turn,
    the batch's own dispatch: frontend_batch) on each of its rows but one:
    S(B) = a + frontend_batch + (b + frontend - frontend_batch) B. `capacity` is in requests
    per second (B / S(B) unless given).
    """

    batch_size: int
    a_s: float
    b_s: float
    capacity: float
    frontend_s: float = 0.0
    cv: float = 0.0
    window_s: float | None = None  # batch model; None: the SLO batcher's rule
    slo_s: float = math.inf  # for that rule
    idle_start: IdleStart | None = None  # mg1 at batch 1, batch: services after idle
    frontend_batch_s: float = 0.0  # of frontend_s, the part paid once per batch

    @property
    def base_s(self) -> float:
        return self.a_s + self.frontend_batch_s

    @property
    def per_row_s(self) -> float:
        return self.b_s + self.frontend_s - self.frontend_batch_s

    @property
    def service_time_s(self) -> float:
        """S at the batch size."""
        return self.base_s + self.per_row_s * self.batch_size

    def model_time(self, batch: int) -> float:
        return self.a_s + self.b_s * batch

    def window(self, arrival_rate: float) -> float:
        """How long an idle replica holds a partial batch at this per-replica rate."""
        if self.window_s is not None:
            return self.window_s
        t_cap = self.model_time(self.batch_size)
        return batch_window(self.model_time(1), t_cap, arrival_rate, self.slo_s)

    def first_service(self, model: str, arrival_rate: float) -> EmpiricalDistribution | None:
        """The service of a request that finds the replica idle, where `model` has one."""
        usable = model == "batch" or (model == "mg1" and self.batch_size == 1)
        if self.idle_start is None or not usable:
            return None
        return self.idle_start.at(arrival_rate)

    def p99(self, model: str, rho: float, replicas: int = 1) -> float:
        """p99 response time of one replica (mm1, md1, mg1, batch) or of the pooled replicas
        (mmc) at utilization rho; inf at rho >= 1."""
        if rho >= 1:
            return math.inf
        s = self.service_time_s
        if model == "mm1":
            return -math.log1p(-P99) * s / (1 - rho)
        if model == "md1":
            return MD1(rho / s, s).response_quantile(P99)
        if model == "mg1":
            first = self.first_service(model, rho / s)
            return MG1(rho / s, ServiceDistribution(s, self.cv), first).response_quantile(P99)
        if model == "batch":
            rate = rho * self.capacity
            first = self.first_service(model, rate)
            if rate == 0:
                alone = first or ServiceDistribution(self.base_s + self.per_row_s, self.cv)
                return alone.quantile(P99)
            queue = BatchQueue(
                rate,
                self.base_s,
                self.per_row_s,
                self.batch_size,
                self.cv,
                self.window(rate),
                first,
            )
            return queue.response_quantile(P99)
        mu = 1.0 / s
        return MMc(rho * replicas * mu, mu, replicas).response_quantile(P99)

    def meets(self, model: str, rho: float, slo: float) -> bool:
        if model == "md1":  # one CDF evaluation with at most slo / S terms
            s = self.service_time_s
            if rho == 0:
                return s <= slo
            return MD1(rho / s, s).wait_cdf(slo - s) >= P99
        return self.p99(model, rho) <= slo


def p99_at(model: str, rho: float, service_time: float, replicas: int) -> float:
    """p99 of a replica whose batch (or request) takes a fixed `service_time`, at rho."""
    return ReplicaQueue(1, 0.0, service_time, 1.0 / service_time).p99(model, rho, replicas)


def replicas_for(model: str, load: float, queue: ReplicaQueue, slo: float) -> tuple[int, float]:
    """Fewest replicas for the SLO with `load` = rate / capacity, and rho_max for that model
    (mmc and batch: the utilization at that count)."""
    if model in ("mmc", "batch"):
        return _pooled_replicas(model, load, queue, slo)
    if model == "mm1":
        rho_max = mm1_max_utilization(queue.service_time_s, slo)
    else:
        rho_max = max_utilization(lambda rho: queue.meets(model, rho, slo))
    if rho_max <= 0:
        raise BadRequest(
            f"the p99 SLO {slo * 1e3:g} ms cannot be met with a service time of "
            f"{queue.service_time_s * 1e3:g} ms under the {model} model, at any load"
        )
    return math.ceil(load / rho_max - 1e-9), rho_max


def _pooled_replicas(model: str, load: float, queue: ReplicaQueue, slo: float) -> tuple[int, float]:
    """The fewest n with p99 <= slo, by doubling and then bisection (p99 falls as n grows)."""
    low = math.floor(load)  # too few: utilization >= 1
    high = low + 1
    while queue.p99(model, load / high, high) > slo:
        if high > 100 * (load + 1):
            raise BadRequest(f"the SLO {slo * 1e3:g} ms cannot be met by adding replicas")
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if queue.p99(model, load / mid, mid) <= slo else (mid, high)
    return high, load / high


def plan(inputs: PlanInputs) -> Plan:
    """Choose the batch size (with a profile), then the replica count."""
    overhead, queue_budget = _split_slo(inputs)
    queue = _operating_point(inputs, queue_budget, overhead)
    load = inputs.rate / queue.capacity  # replicas' worth of work at utilization 1
    by_model: dict[str, int] = {}
    rho_max: dict[str, float] = {}
    models = ANALYTIC_MODELS + (("batch",) if inputs.queue_model == "batch" else ())
    for model in models:
        by_model[model], rho_max[model] = replicas_for(model, load, queue, queue_budget)
    n_slo = by_model[inputs.queue_model]
    n_throughput = math.floor(load) + 1
    with_headroom = math.ceil(n_slo * (1 + inputs.headroom) - 1e-9)
    with_redundancy = n_slo + inputs.redundancy
    replicas = max(with_headroom, with_redundancy, n_throughput)
    binding = _binding(n_slo, n_throughput, with_headroom, with_redundancy)
    survivors = max(replicas - 1, 0)
    rho_fail = load / survivors if survivors else math.inf
    p99_fail = overhead + queue.p99(inputs.queue_model, rho_fail, survivors)
    per_replica_rate = inputs.rate / replicas
    result = Plan(
        rate=inputs.rate,
        slo_p99_s=inputs.slo_p99_s,
        queue_model=inputs.queue_model,
        batch_size=queue.batch_size,
        service_time_s=queue.service_time_s,
        capacity_per_replica=queue.capacity,
        max_utilization=rho_max,
        replicas_by_model=by_model,
        replicas_throughput=n_throughput,
        replicas_slo=n_slo,
        replicas_with_headroom=with_headroom,
        replicas_with_redundancy=with_redundancy,
        replicas=replicas,
        binding=binding,
        utilization=load / replicas,
        p99_s=overhead + queue.p99(inputs.queue_model, load / replicas, replicas),
        utilization_after_failure=rho_fail,
        p99_after_failure_s=p99_fail,
        slo_met_after_failure=p99_fail <= inputs.slo_p99_s,
        batch_latency_s=batch_latency(queue.batch_size, per_replica_rate, queue.model_time),
        batch_window_s=queue.window(per_replica_rate),
        max_batch_within_slo=max_batch_within_slo(
            queue.model_time,
            per_replica_rate,
            queue_budget,
            inputs.max_batch_size or queue.batch_size,
        ),
        overhead_s=overhead,
        frontend_s=inputs.frontend,
        frontend_batch_s=queue.frontend_batch_s,
        service_cv=queue.cv,
    )
    first = queue.first_service(inputs.queue_model, per_replica_rate)
    if first is not None:
        result.first_service_s = first.mean
    if inputs.cost_per_hour is not None:
        result.cost_per_million = replicas * inputs.cost_per_hour / (inputs.rate * 3600) * 1e6
    if not result.slo_met_after_failure:
        result.notes.append("one replica failing breaks the p99 SLO: raise redundancy")
    return result


def _binding(n_slo: int, n_throughput: int, with_headroom: int, with_redundancy: int) -> str:
    """Which count the recommendation is: the throughput count only when it exceeds the SLO
    count with its headroom and with its spares (a load of 0.1 replica, 1 by throughput, with
    2 for headroom was called throughput-bound)."""
    if n_throughput >= max(with_headroom, with_redundancy) and n_slo <= n_throughput:
        return "throughput"  # (a loose SLO's count is the throughput count itself)
    return "redundancy" if with_redundancy > with_headroom else "slo"


def _split_slo(inputs: PlanInputs) -> tuple[float, float]:
    """(fixed overhead, what the SLO leaves for the queue and the service).

    A profile's overhead is its one-row round trip less the compute time; the part of it that
    is front-end CPU on the model's core moves into the service time, so it leaves here."""
    overhead = inputs.overhead_s
    if overhead is None:
        profiled = inputs.profile.service.overhead_s if inputs.profile else 0.0
        overhead = max(0.0, profiled - inputs.frontend)
    budget = inputs.slo_p99_s - overhead
    if budget <= 0:
        raise BadRequest(
            f"the p99 SLO {inputs.slo_p99_s * 1e3:g} ms is not above the fixed overhead "
            f"{overhead * 1e3:.3g} ms that every request pays outside the model"
        )
    return overhead, budget


def _operating_point(inputs: PlanInputs, budget: float, overhead: float) -> ReplicaQueue:
    if inputs.profile is None:
        assert inputs.service_time_s is not None
        service = inputs.service_time_s
        capacity = inputs.capacity_per_replica or 1.0 / (service + inputs.frontend)
        return ReplicaQueue(
            1, 0.0, service, capacity, inputs.frontend, inputs.cv, inputs.batch_window_s, budget,
            None, inputs.frontend_batch,
        )  # fmt: skip
    return choose_batch(inputs.profile, inputs, budget, overhead)


def _queue_at(
    profile: ReplicaProfile, inputs: PlanInputs, batch: int, slo: float, overhead: float
) -> ReplicaQueue:
    """The replica at batch size `batch`: S(B) = a + f_batch + (b + f - f_batch) B."""
    t = profile.service
    f, f_batch = inputs.frontend, inputs.frontend_batch
    occupied = t.a_s + f_batch + (t.b_s + f - f_batch) * batch
    capacity = inputs.capacity_per_replica or batch / occupied
    idle = profile.idle_start(t.a_s + t.b_s + f) if inputs.idle_start else None
    return ReplicaQueue(
        batch, t.a_s, t.b_s, capacity, f, inputs.cv, inputs.batch_window_s, slo, idle, f_batch
    )


def choose_batch(
    profile: ReplicaProfile, inputs: PlanInputs, budget: float | None = None, overhead: float = 0.0
) -> ReplicaQueue:
    """The batch size of the operating point.

    batch: the cap itself (`max_batch_size`, default the profile's largest), since the batcher
    takes what is queued up to it. The other models treat a batch as one service: the cap,
    among 1, 2, 4, ... and the largest, that needs the fewest replicas while L(B) fits the
    SLO; ties go to the smaller B. `budget` is the part of the SLO left after the fixed
    `overhead` (default: all of it)."""
    budget = inputs.slo_p99_s if budget is None else budget
    largest = inputs.max_batch_size or profile.service.max_batch_size
    if inputs.queue_model == "batch":
        return _queue_at(profile, inputs, largest, budget, overhead)
    best: tuple[int, ReplicaQueue] | None = None
    for batch in batch_sizes_up_to(largest):
        queue = _queue_at(profile, inputs, batch, budget, overhead)
        if queue.service_time_s <= 0:
            continue
        try:
            n, _ = replicas_for(inputs.queue_model, inputs.rate / queue.capacity, queue, budget)
        except BadRequest:
            continue
        fill = batch_latency(batch, inputs.rate / n, queue.model_time)
        if fill <= budget and (best is None or n < best[0]):
            best = (n, queue)
    if best is None:
        raise BadRequest(
            f"no batch size meets the p99 SLO {inputs.slo_p99_s * 1e3:g} ms with this profile "
            f"(T(1) = {profile.service.service_time(1) * 1e3:.3g} ms)"
        )
    return best[1]
