"""lockgate route: one address in front of many lockgate replicas.

lockgate route --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000
lockgate route --discover lockgate-replicas.default.svc.cluster.local:8000
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lockgate.router.app import RouterSettings
from lockgate.router.hedge import HedgePolicy
from lockgate.router.model_control import ControlSettings
from lockgate.router.pool import Discovery, split_url
from lockgate.router.replica import HealthSettings

if TYPE_CHECKING:
    from lockgate.router.grpc_proxy import GrpcFrontSettings


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
        "--send-once",
        action="append",
        default=[],
        metavar="MODEL",
        help="a model whose v2 inference is never hedged nor retried once sent, as a language "
        "model's (repeatable): for generative models on replicas that are not lockgate, "
        "which do not mark their answers",
    )
    p.add_argument(
        "--full-ms",
        type=float,
        default=100.0,
        help="a replica that answered 503 counts as full this long; all full: shed at once",
    )
    p.add_argument("--max-body-mb", type=float, default=64.0)
    p.add_argument(
        "--grpc-port",
        type=int,
        help="serve KServe v2 gRPC here, passed through to the replicas' gRPC (default: off)",
    )
    p.add_argument(
        "--replica-grpc-port",
        default="+1",
        metavar="PORT|+N",
        help="where each replica serves gRPC: PORT on every replica, or +N for its HTTP port "
        "plus N (default +1: 8000 -> 8001); a --replica URL may name its own: "
        "http://host:8000?grpc=9001",
    )
    p.add_argument(
        "--grpc-max-concurrent-rpcs",
        type=int,
        default=1024,
        help="gRPC calls beyond this get RESOURCE_EXHAUSTED at once",
    )
    p.add_argument(
        "--grpc-max-stream-inflight",
        type=int,
        default=64,
        help="messages of one ModelStreamInfer stream sent to its replica and not yet answered; "
        "past it the router stops reading the stream",
    )
    p.add_argument(
        "--grpc-drain-timeout",
        type=float,
        default=30.0,
        help="seconds gRPC calls in progress may run on once the router stops",
    )
    p.add_argument(
        "--control-replay-timeout",
        type=float,
        default=600.0,
        help="seconds a replica that joins has to apply each model load or unload replayed "
        "to it (no answer: it joins at a later probe)",
    )
    p.add_argument(
        "--control-memory-mb",
        type=float,
        default=256.0,
        help="model load and unload requests (with the files a load sends) kept to replay to "
        "replicas that join; a request past it is not kept",
    )
    p.add_argument(
        "--control-state",
        type=Path,
        metavar="PATH",
        help="keep those requests, and what each replica was told, in this file across the "
        "router's restarts: written after each load, unload and replay, read at start "
        "(default: in memory only)",
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        default=0.0,
        help="seconds between a SIGTERM (readiness turns 503) and closing the port",
    )
    _rollout_arguments(p)


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
        _check_limits(args)
        grpc = _grpc_front(args)
        rollout = _rollout(args)
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
    settings = dataclasses.replace(
        rollout,
        max_body_bytes=int(args.max_body_mb * 2**20),
        retry_ratio=args.retry_budget,
        max_attempts=args.max_attempts,
        hedge=hedge,
        hedge_ratio=args.hedge_budget,
        send_once=tuple(args.send_once),
        control=ControlSettings(
            args.control_replay_timeout, int(args.control_memory_mb * 2**20), args.control_state
        ),
    )
    app = build(discovery, health, settings)
    return serve(app, args.host, args.port, args.drain_delay, grpc=grpc)


# flag -> (the least it may be, whether that bound is excluded, the most it may be)
_BOUNDS: dict[str, tuple[float, bool, float]] = {
    "probe_interval": (0.0, True, math.inf),  # 0 probed every replica without pause
    "resolve_interval": (0.0, True, math.inf),
    "eject_after": (1, False, math.inf),
    "eject_for": (0.0, False, math.inf),
    "full_ms": (0.0, False, math.inf),
    "retry_budget": (0.0, False, 1.0),
    "hedge_budget": (0.0, False, 1.0),
    "hedge_delay_ms": (0.0, False, math.inf),
    "max_body_mb": (0.0, True, math.inf),  # 0 answered every request 413
    "drain_delay": (0.0, False, math.inf),
    "control_replay_timeout": (0.0, True, math.inf),
    "control_memory_mb": (0.0, False, math.inf),
    "grpc_max_concurrent_rpcs": (1, False, math.inf),
    "grpc_max_stream_inflight": (1, False, math.inf),
    "grpc_drain_timeout": (0.0, False, math.inf),
}


def _check_limits(args: argparse.Namespace) -> None:
    """ValueError naming the first flag out of its range (a negative budget, a probe interval
    of 0, ... were taken as given)."""
    for name, (low, open_low, high) in _BOUNDS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        below = value <= low if open_low else value < low
        if below or value > high or value != value:
            flag = "--" + name.replace("_", "-")
            if math.isinf(high):
                want = f"> {low:g}" if open_low else f">= {low:g}"
            else:
                want = f"between {low:g} and {high:g}"
            raise ValueError(f"{flag} must be {want}, got {value:g}")


def _grpc_front(args: argparse.Namespace) -> GrpcFrontSettings | None:
    """The gRPC front's settings, or None without --grpc-port; ValueError names the flag."""
    from lockgate.router.grpc_proxy import GrpcFrontSettings, ReplicaGrpcPort

    if args.grpc_port is None:
        return None
    return GrpcFrontSettings(
        host=args.host,
        port=args.grpc_port,
        replica_port=ReplicaGrpcPort.parse(args.replica_grpc_port, args.replica),
        max_receive_bytes=int(args.max_body_mb * 2**20),
        max_concurrent_rpcs=args.grpc_max_concurrent_rpcs,
        max_stream_inflight=args.grpc_max_stream_inflight,
        drain_timeout=args.grpc_drain_timeout,
    )


def _rollout_arguments(p: argparse.ArgumentParser) -> None:
    from lockgate.router.llm_routing import MODES

    g = p.add_argument_group("canaries, shadows, sessions, rate limits, language-model routing")
    g.add_argument(
        "--canary",
        action="append",
        default=[],
        metavar="MODEL:VERSION=PERCENT",
        help="send PERCENT of MODEL's inference requests that name no version (v2 and OpenAI) "
        "to VERSION; MODEL:#GROUP=PERCENT sends PERCENT of every request for MODEL (v2 and "
        "OpenAI) to the replicas given as URL#GROUP (repeatable)",
    )
    g.add_argument(
        "--shadow",
        action="append",
        default=[],
        metavar="MODEL=URL:PERCENT",
        help="copy PERCENT of MODEL's v2 inference requests to URL (or #GROUP) and compare the "
        "answers; the client's answer is never held up (repeatable)",
    )
    g.add_argument("--shadow-max-in-flight", type=int, default=16, help="copies under way")
    g.add_argument("--shadow-timeout", type=float, default=10.0, help="seconds per copy")
    g.add_argument(
        "--shadow-compare-max-mb", type=float, default=1.0, help="larger answers: not compared"
    )
    g.add_argument(
        "--shadow-tolerance", type=float, default=1e-5, help="relative and absolute, for numbers"
    )
    g.add_argument(
        "--sticky-header",
        metavar="NAME",
        help="requests with the same value of this header go to the same replica (default off)",
    )
    g.add_argument(
        "--sequence-table-size",
        type=int,
        default=65536,
        help="sequences of stateful models pinned to their replica (least recently used "
        "forgotten first; 0: none pinned, rendezvous hashing alone)",
    )
    g.add_argument(
        "--responses-table-size",
        type=int,
        default=65536,
        help="stored responses (OpenAI Responses API) whose replica the router remembers, for "
        "GET, DELETE and previous_response_id (least recently used forgotten first; an id not "
        "remembered is asked of every replica)",
    )
    g.add_argument(
        "--rate-limit-rps", type=float, default=0.0, help="requests/s per API key (0: none)"
    )
    g.add_argument(
        "--rate-limit-burst", type=float, default=0.0, help="requests at once (0: the rate, >= 1)"
    )
    g.add_argument(
        "--rate-limit-tpm",
        type=float,
        default=0.0,
        help="prompt + completion tokens/minute per API key, OpenAI routes (0: none)",
    )
    g.add_argument(
        "--rate-limits", type=Path, metavar="FILE", help="YAML: limits per key (see docs)"
    )
    g.add_argument(
        "--rate-limit-max-keys", type=int, default=10_000, help="API keys tracked at once"
    )
    g.add_argument(
        "--rate-limit-key-header",
        default="authorization",
        metavar="NAME",
        help="the header whose value is the API key (authorization: its Bearer key)",
    )
    g.add_argument(
        "--llm-routing",
        choices=MODES,
        default="least-load",
        help="completion requests: the least loaded replica, or the one the prompt prefers",
    )
    g.add_argument(
        "--prefix-chars", type=int, default=512, help="characters of the prompt that route it"
    )
    g.add_argument(
        "--prefix-load-margin",
        type=int,
        default=4,
        help="requests in progress a prefix's replica may have above the least loaded one",
    )
    g.add_argument(
        "--max-model-series",
        type=int,
        default=1000,
        help="models counted by name in lockgate_router_model_requests_total",
    )


def _rollout(args: argparse.Namespace) -> RouterSettings:
    """The settings of canaries, shadows, sticky sessions, rate limits and language-model
    routing; ValueError names the flag."""
    import re

    from lockgate.router.canary import Canary, CanaryRule
    from lockgate.router.groups import label_of
    from lockgate.router.llm_routing import LLMRoutingSettings
    from lockgate.router.rate_limits import Limit, load_limits
    from lockgate.router.shadow import ShadowRule, ShadowSettings

    labels = [label_of(url) for url in args.replica]
    if labels and all(labels) and not args.discover:
        raise ValueError("give at least one --replica without a #group: they take the traffic")
    canary = tuple(CanaryRule.parse(text) for text in args.canary)
    Canary(canary)  # the shares of each model add up to at most 100%
    shadow = ShadowSettings(
        tuple(ShadowRule.parse(text) for text in args.shadow),
        max_in_flight=args.shadow_max_in_flight,
        timeout=args.shadow_timeout,
        compare_max_bytes=int(args.shadow_compare_max_mb * 2**20),
        tolerance=args.shadow_tolerance,
    )
    for group in [r.group for r in canary] + [r.group for r in shadow.rules]:
        if group is not None and group not in labels:
            raise ValueError(f"#{group} names no replica: give --replica URL#{group}")
    if args.sticky_header and not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", args.sticky_header):
        raise ValueError(f"--sticky-header {args.sticky_header!r} is not a header name")
    default = Limit(args.rate_limit_rps, args.rate_limit_burst, args.rate_limit_tpm)
    limits = load_limits(
        args.rate_limits, default, args.rate_limit_max_keys, args.rate_limit_key_header
    )
    if args.max_model_series < 1:
        raise ValueError("--max-model-series must be at least 1")
    if args.sequence_table_size < 0:
        raise ValueError("--sequence-table-size must be 0 or more")
    if args.responses_table_size < 0:
        raise ValueError("--responses-table-size must be 0 or more")
    return RouterSettings(
        canary=canary,
        shadow=shadow,
        sticky_header=args.sticky_header or None,
        sequence_table_size=args.sequence_table_size,
        responses_table_size=args.responses_table_size,
        rate_limits=limits,
        llm_routing=LLMRoutingSettings(
            args.llm_routing, args.prefix_chars, args.prefix_load_margin
        ),
        max_model_series=args.max_model_series,
    )
