"""`lockgate profile`: measure T(B) through a running server and save the profile JSON."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from lockgate.errors import ServingError
from lockgate.plan.profile import ReplicaProfile, profile_server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--model", required=True, help="model name (KServe v2)")
    parser.add_argument("--model-version", help="model version (default: the server's choice)")
    parser.add_argument("--max-batch-size", type=int, required=True, help="largest B to time")
    parser.add_argument("--repeats", type=int, default=5, help="timed requests per batch size")
    parser.add_argument("--warmup", type=int, default=1, help="untimed requests per batch size")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument(
        "--cpu-seconds",
        type=float,
        default=2.0,
        help="seconds of one-row requests to measure the server's CPU per request (0: skip)",
    )
    parser.add_argument(
        "--cpu-concurrency",
        type=int,
        default=2,
        help="requests in flight for the second half of the CPU measurement (the first sends "
        "one at a time): how much of the front end's CPU a batch pays once",
    )
    parser.add_argument(
        "--idle-requests",
        type=int,
        default=200,
        help="one-row requests timed after idle gaps, for the cost of waking the server (0: skip)",
    )
    parser.add_argument(
        "--idle-longest-ms",
        type=float,
        default=100.0,
        help="the longest idle gap; gaps are drawn log-uniformly from 0.1 ms up to it",
    )
    parser.add_argument("--output", help="write the profile JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def _progress(line: str) -> None:
    print(f"lockgate profile: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        profile = profile_server(
            args.url.rstrip("/"),
            args.model,
            args.max_batch_size,
            version=args.model_version,
            repeats=args.repeats,
            warmup=args.warmup,
            timeout_s=args.timeout,
            cpu_seconds=args.cpu_seconds,
            cpu_concurrency=args.cpu_concurrency,
            idle_requests=args.idle_requests,
            idle_longest_s=args.idle_longest_ms / 1e3,
            say=None if args.quiet else _progress,
        )
    except ServingError as exc:
        print(f"lockgate profile: {exc.message}", file=sys.stderr)
        return 2
    print(render(profile))
    if args.output:
        profile.save(args.output)
    return 0


def render(replica: ReplicaProfile) -> str:
    profile = replica.service
    rows = [f"{'B':>6} {'median ms':>10} {'fit ms':>10}"]
    for batch, median in zip(profile.batch_sizes, profile.median_s, strict=True):
        rows.append(f"{batch:>6} {median * 1e3:>10.3f} {profile.service_time(batch) * 1e3:>10.3f}")
    rows.append(
        f"T(B) = {profile.a_s * 1e3:.3f} ms + {profile.b_s * 1e3:.4f} ms * B"
        f"   (R^2 {profile.r2:.4f})"
    )
    if profile.overhead_s:
        rows.append(f"fixed overhead outside the model: {profile.overhead_s * 1e3:.3f} ms")
    rows.append(f"variation of T(1): cv {replica.service_cv:.2f}")
    if replica.cpu_per_request_s is not None and replica.compute_per_request_s is not None:
        rows.append(
            f"server CPU per request: {replica.cpu_per_request_s * 1e3:.3f} ms "
            f"(compute {replica.compute_per_request_s * 1e3:.3f} ms, "
            f"front end on the model's core {replica.frontend_s * 1e3:.3f} ms, "
            f"{replica.frontend_per_batch_s * 1e3:.3f} ms of it once per batch)"
        )
    if replica.idle_gaps_s:
        rows.append(_idle_summary(replica))
    return "\n".join(rows)


def _idle_summary(replica: ReplicaProfile) -> str:
    """Median extra time after short and after long idle gaps (split at their median gap)."""
    gaps, extra = np.asarray(replica.idle_gaps_s), np.asarray(replica.idle_extra_s)
    split = float(np.median(gaps))
    short, long = extra[gaps <= split], extra[gaps > split]
    parts = [f"{np.median(t) * 1e3:+.3f} ms" if len(t) else "-" for t in (short, long)]
    return (
        f"a one-row request after idle takes (median) {parts[0]} after gaps up to "
        f"{split * 1e3:.2g} ms, {parts[1]} after longer ones ({len(gaps)} requests)"
    )
