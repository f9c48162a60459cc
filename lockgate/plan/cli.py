"""`lockgate plan`: replicas, batch cap, window and cost for a rate and a p99 SLO."""

from __future__ import annotations

import argparse
import json
import math
import sys

from lockgate.errors import ServingError
from lockgate.plan.planner import QUEUE_MODELS, Plan, PlanInputs, plan
from lockgate.plan.profile import ReplicaProfile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=float, required=True, help="requests per second in total")
    parser.add_argument("--slo-ms", type=float, required=True, help="p99 latency SLO (ms)")
    parser.add_argument("--service-ms", type=float, help="service time per request or batch (ms)")
    parser.add_argument("--capacity", type=float, help="req/s one replica sustains (default 1/S)")
    parser.add_argument("--profile", help="a profile JSON from `lockgate profile` (sets T(B))")
    parser.add_argument("--max-batch-size", type=int, help="largest batch to consider")
    parser.add_argument("--headroom", type=float, default=0.3, help="extra fraction (0.3 = 30%%)")
    parser.add_argument("--redundancy", type=int, default=1, help="k spare replicas (N+k)")
    parser.add_argument("--cost-per-hour", type=float, help="cost of one replica per hour")
    parser.add_argument(
        "--overhead-ms", type=float, help="latency outside the model (default: the profile's)"
    )
    parser.add_argument(
        "--service-cv", type=float, help="sd / mean of the service time (default: the profile's)"
    )
    parser.add_argument(
        "--frontend-ms",
        type=float,
        help="CPU per request outside the model on the model's core (default: the profile's)",
    )
    parser.add_argument(
        "--frontend-batch-ms",
        type=float,
        help="of the front end's CPU, the part paid once per batch (default: the profile's)",
    )
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        help="batch model: the batcher's window (default: the SLO batcher's rule)",
    )
    parser.add_argument(
        "--no-idle-start",
        action="store_true",
        help="mg1, batch: ignore the profile's timings of requests that found the server idle",
    )
    parser.add_argument("--queue-model", choices=QUEUE_MODELS, default="mm1")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        profile = ReplicaProfile.load(args.profile) if args.profile else None
        inputs = PlanInputs(
            rate=args.rate,
            slo_p99_s=args.slo_ms / 1e3,
            service_time_s=args.service_ms / 1e3 if args.service_ms else None,
            capacity_per_replica=args.capacity,
            profile=profile,
            max_batch_size=args.max_batch_size,
            headroom=args.headroom,
            redundancy=args.redundancy,
            cost_per_hour=args.cost_per_hour,
            queue_model=args.queue_model,
            overhead_s=_seconds(args.overhead_ms),
            service_cv=args.service_cv,
            frontend_s=_seconds(args.frontend_ms),
            frontend_batch_s=_seconds(args.frontend_batch_ms),
            batch_window_s=_seconds(args.batch_window_ms),
            idle_start=not args.no_idle_start,
        )
        result = plan(inputs)
    except ServingError as exc:
        print(f"lockgate plan: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=2) if args.json else render(result))
    return 0


def _seconds(ms: float | None) -> float | None:
    return ms / 1e3 if ms is not None else None


def _ms(seconds: float) -> str:
    return "unbounded" if math.isinf(seconds) else f"{seconds * 1e3:.2f} ms"


def render(result: Plan) -> str:
    """The plan as a short readable report."""
    lines = [
        f"load {result.rate:g} req/s, p99 SLO {_ms(result.slo_p99_s)}, "
        f"queue model {result.queue_model}",
        f"operating point: batch {result.batch_size}, service time {_ms(result.service_time_s)}, "
        f"capacity {result.capacity_per_replica:.1f} req/s per replica, "
        f"fixed overhead {_ms(result.overhead_s)}",
        f"service: front end on the model's core {_ms(result.frontend_s)} per request "
        f"({_ms(result.frontend_batch_s)} of it per batch), "
        f"cv {result.service_cv:.2f}"
        + (
            ""
            if result.first_service_s is None
            else f", after idle {_ms(result.first_service_s)} (mean at this rate)"
        ),
        f"batching: window {_ms(result.batch_window_s)}, L(B) {_ms(result.batch_latency_s)}, "
        f"largest batch cap within SLO {result.max_batch_within_slo}",
        "max safe utilization: "
        + ", ".join(f"{m} {rho:.3f}" for m, rho in result.max_utilization.items()),
        "replicas for the SLO: "
        + ", ".join(f"{m} {n}" for m, n in result.replicas_by_model.items())
        + f"; throughput alone {result.replicas_throughput}",
        f"with headroom {result.replicas_with_headroom}, "
        f"with N+k {result.replicas_with_redundancy}",
        f"RECOMMENDED: {result.replicas} replicas ({result.binding}-bound), utilization "
        f"{result.utilization:.3f}, p99 {_ms(result.p99_s)}",
        f"after one failure: utilization {result.utilization_after_failure:.3f}, "
        f"p99 {_ms(result.p99_after_failure_s)}, SLO "
        + ("met" if result.slo_met_after_failure else "MISSED"),
    ]
    if result.cost_per_million is not None:
        lines.append(f"cost per million inferences: {result.cost_per_million:.4f}")
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
