"""lockgate route: one address in front of many lockgate replicas.

lockgate route --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000
lockgate route --discover lockgate-replicas.default.svc.cluster.local:8000
"""

from __future__ import annotations

import argparse
import sys

from lockgate.router.app import RouterSettings
from lockgate.router.hedge import HedgePolicy
from lockgate.router.pool import Discovery, split_url
from lockgate.router.replica import HealthSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--replica", action="append", default=[], metavar="URL", help="a replica (repeatable)"
    )
    p.add_argument(
        "--discover",
        metavar="HOST:PORT",
        help="a DNS name whose A/AAAA records are the replicas (a headless Service)",
    )
    p.add_argument("--resolve-interval", type=float, default=5.0, help="seconds between lookups")
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between probes")
    p.add_argument(
        "--eject-after", type=int, default=5, help="consecutive failures that eject a replica"
    )
    p.add_argument(
        "--eject-for", type=float, default=5.0, help="seconds out (doubled on each repeat)"
    )
    p.add_argument(
        "--retry-budget",
        type=float,
        default=0.1,
        help="retries as a share of requests over 10 s (plus 10)",
    )
    p.add_argument("--max-attempts", type=int, default=3, help="tries per request")
    p.add_argument("--no-hedge", action="store_true", help="never send a second copy")
    p.add_argument(
        "--hedge-quantile",
        type=float,
        default=0.95,
        help="hedge after this quantile of the model's recent latency",
    )
    p.add_argument(
        "--hedge-delay-ms",
        type=float,
        help="hedge after this fixed delay instead of the quantile",
    )
    p.add_argument(
        "--hedge-budget", type=float, default=0.1, help="second copies as a share of requests"
    )
    p.add_argument(
        "--full-ms",
        type=float,
        default=100.0,
        help="a replica that answered 503 counts as full this long; all full: shed at once",
    )
    p.add_argument("--max-body-mb", type=float, default=64.0)
    p.add_argument(
        "--drain-delay",
        type=float,
        default=0.0,
        help="seconds between a SIGTERM (readiness turns 503) and closing the port",
    )


def run(args: argparse.Namespace) -> int:
    from lockgate.router.server import build
    from lockgate.router.server import run as serve

    if not args.replica and not args.discover:
        print(
            "lockgate route: give --replica URL (repeatable) or --discover HOST:PORT",
            file=sys.stderr,
        )
        return 2
    try:
        for url in [*args.replica, *([args.discover] if args.discover else [])]:
            split_url(url)
        hedge = HedgePolicy(
            enabled=not args.no_hedge,
            quantile=args.hedge_quantile,
            fixed_delay=None if args.hedge_delay_ms is None else args.hedge_delay_ms / 1000,
        )
        if not 0 < args.hedge_quantile < 1:
            raise ValueError("--hedge-quantile must be between 0 and 1")
        if args.max_attempts < 1:
            raise ValueError("--max-attempts must be at least 1")
    except ValueError as exc:
        print(f"lockgate route: {exc}", file=sys.stderr)
        return 2
    discovery = Discovery(tuple(args.replica), args.discover, args.resolve_interval)
    health = HealthSettings(
        probe_interval=args.probe_interval,
        eject_after=args.eject_after,
        eject_for=args.eject_for,
        full_for=args.full_ms / 1000,
    )
    settings = RouterSettings(
        max_body_bytes=int(args.max_body_mb * 2**20),
        retry_ratio=args.retry_budget,
        max_attempts=args.max_attempts,
        hedge=hedge,
        hedge_ratio=args.hedge_budget,
    )
    return serve(build(discovery, health, settings), args.host, args.port, args.drain_delay)
