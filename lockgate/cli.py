"""The `lockgate` command: serve, route, models, bench, profile, plan."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from lockgate import __version__
from lockgate.parent_death import follow_parent

if TYPE_CHECKING:
    from lockgate.cache.redis_tier import RedisSettings
    from lockgate.core.bare_model import BareModel


METRICS_COMPAT = frozenset({"triton", "vllm"})


def _metrics_compat(text: str) -> frozenset[str] | None:
    """The names of --metrics-compat; None when one is unknown."""
    names = frozenset(n.strip().lower() for n in text.split(",") if n.strip())
    if names == {"none"}:
        return frozenset()
    return names if names and names <= METRICS_COMPAT else None


def _env_keys(name: str) -> frozenset[str]:
    raw = os.environ.get(name, "")
    return frozenset(k.strip() for k in raw.split(",") if k.strip())


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve", help="serve a model repository or one model file (default: the bundled demo)"
    )
    p.add_argument(
        "repository",
        nargs="?",
        type=Path,
        help="model repository folder, or one model file (.onnx, .joblib, .pkl, .pt, .pt2), or "
        "a folder that holds one (as KServe's /mnt/models)",
    )
    p.add_argument(
        "--model-name",
        metavar="NAME",
        help="the name a single model file is served under (default: the file's stem, or the "
        "name of the folder that holds it); a repository's models keep their folders' names",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--grpc-port",
        type=_grpc_port,
        default=None,
        help="KServe v2 gRPC port; 0 or 'off' disables it (default: 8001 when free)",
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
        help="requests of one ModelStreamInfer stream read and not yet answered; past it the "
        "server stops reading the stream",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=64.0,
        help="request body limit (HTTP, gRPC; a gzip or deflate body counts inflated)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds to receive a request body in full; past it, 408 and the connection closes",
    )
    p.add_argument(
        "--compress-min-bytes",
        type=int,
        default=4096,
        help="answers of at least this many bytes go out gzip or deflate to a client that "
        "accepts it (Accept-Encoding; event streams never); 0: never compressed",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="responses of the OpenAI Responses API (/v1/responses) kept in this process's "
        "memory for GET /v1/responses/{id} (and its input_items) and previous_response_id, the "
        "least recently used dropped first; each is bounded by its model's context; 0: none "
        "kept (store is answered false)",
    )
    p.add_argument(
        "--shared-memory-regions",
        type=int,
        default=256,
        help="system shared memory regions clients on this host may register at once "
        "(Triton's extension); 0: the extension is off",
    )
    p.add_argument(
        "--allowed-origins",
        default="",
        metavar="ORIGINS",
        help="comma-separated origins (https://app.example.com) whose browser pages may call "
        "lockgate (CORS); '*': any origin; default: none",
    )
    p.add_argument(
        "--shared-memory-registry",
        default="",
        metavar="DIR",
        help="a directory where the replicas of one server share their system shared memory "
        "registrations, so a region registered through one is found by the others (set by "
        "--replicas for its replicas)",
    )
    p.add_argument(
        "--slow-body-secs",
        type=float,
        default=1.0,
        help="when every place (--limit-concurrency) is taken, a new request takes the place "
        "of one whose body has been arriving for longer than this (503, connection closed)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=int,
        default=75.0,
        help="idle seconds before a kept-alive HTTP connection closes",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=1024,
        help="requests in progress (complete heads) beyond this are answered 503 at once; "
        "health probes are never refused",
    )
    p.add_argument(
        "--max-loop-lag-ms",
        type=float,
        default=10.0,
        help="event-loop lag past which new requests get 503 before their body is read (0: off)",
    )
    p.add_argument(
        "--queue-target-ms",
        type=float,
        default=5.0,
        help="front-end delay (first byte to handler) that, when even the least delayed "
        "request of 50 ms waited longer, gets new requests 503 before their body (0: off)",
    )
    p.add_argument(
        "--refusal-pause-ms",
        type=float,
        default=100.0,
        help="when refusals pass --refusal-pause-ratio per admitted request, a refused "
        "connection is not read again for this long (0: never)",
    )
    p.add_argument(
        "--refusal-pause-ratio",
        type=float,
        default=0.3,
        help="refusals per admitted request, over the last second, past which refused "
        "connections are paused",
    )
    p.add_argument(
        "--refusal-pause-share",
        type=float,
        default=1.0,
        help="the most a refusal pause takes of the refused request's budget (its timeout or "
        "its model's SLO)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also answer /v2/health/live, /health and /v2/health/ready on this port, from a "
        "thread of its own, so probes are answered at once however busy the server is "
        "(0: any free port; default: off)",
    )
    p.add_argument(
        "--health-stale-s",
        type=float,
        default=10.0,
        help="on --health-port, liveness answers 503 once the event loop has made no "
        "progress for this long",
    )
    p.add_argument(
        "--head-timeout",
        type=float,
        default=10.0,
        help="seconds for a request line and headers to arrive in full; past it, the "
        "connection closes",
    )
    p.add_argument(
        "--max-connections", type=int, default=16384, help="open HTTP connections in all"
    )
    p.add_argument(
        "--accepts-per-turn",
        type=_int_at_least(0),
        default=0,
        help="> 0: a thread accepts new HTTP connections as they come and answers the "
        "kubelet's probes (Connection: close) itself, and the event loop opens this many per "
        "turn (probes on the main port stay fast under overload, but saturated throughput "
        "falls); 0: the loop accepts one per turn (probe through --health-port)",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=1024,
        help="open HTTP connections from one client address",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
    p.add_argument(
        "--hang-timeout", type=float, default=30.0, help="seconds before a stuck instance restarts"
    )
    p.add_argument(
        "--max-sequences",
        type=_int_at_least(1),
        default=1024,
        help="live sequences of a stateful model (sequence_batching) whose config sets no "
        "oldest.max_candidate_sequences; a new sequence past it gets 503 with Retry-After",
    )
    p.add_argument(
        "--model-control-mode",
        choices=("none", "explicit", "poll"),
        default="none",
        help="explicit: serve POST /v2/repository/models/{m}/load and /unload (as Triton); "
        "poll: watch the repository and load, reload or unload the models whose folders "
        "change (as Triton)",
    )
    p.add_argument(
        "--repository-poll-secs",
        type=float,
        default=15.0,
        help="with --model-control-mode poll: seconds between looks at the repository; a "
        "change is acted on once it has held for one more look",
    )
    p.add_argument(
        "--load-model",
        action="append",
        metavar="NAME",
        help="with --model-control-mode explicit: a model to load at start-up (repeat it; '*': "
        "all); without it, explicit mode loads none, as in Triton",
    )
    p.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without an API key even when LOCKGATE_API_KEYS is set",
    )
    p.add_argument(
        "--metrics-compat",
        default="triton,vllm",
        metavar="NAMES",
        help="other servers' metric names also on /metrics, comma-separated: 'triton' "
        "(nv_inference_* of the classic models, labelled model and version), 'vllm' (vllm:* "
        "of the language models, labelled model_name), or 'none' (default: triton,vllm)",
    )
    p.add_argument(
        "--access-log",
        action="store_true",
        help="log each request as one JSON line (request id, status, duration, bytes, model, "
        "refusal reason) on the lockgate.access logger",
    )
    p.add_argument(
        "--otel-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        help="trace inference requests (KServe v2 REST and gRPC, the OpenAI API, generate) with "
        "OpenTelemetry, sent over OTLP/HTTP to this "
        "base URL, e.g. http://127.0.0.1:4318 (default: $OTEL_EXPORTER_OTLP_ENDPOINT; none: "
        "no tracing); needs lockgate[otel]",
    )
    p.add_argument(
        "--trace-level",
        choices=("OFF", "TIMESTAMPS"),
        default="TIMESTAMPS",
        help="with --otel-endpoint: OFF traces no request until Triton's trace extension "
        "(/v2/trace/setting) turns it on; TIMESTAMPS traces them (default)",
    )
    p.add_argument(
        "--trace-rate",
        type=int,
        default=1,
        help="with --otel-endpoint: trace one request in every N (1 to 2^32 - 1; default 1: "
        "all); changed at run time through /v2/trace/setting",
    )
    p.add_argument(
        "--trace-count",
        type=int,
        default=-1,
        help="with --otel-endpoint: trace N requests, then none (-1: no limit, the default); "
        "changed at run time through /v2/trace/setting",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("LOCKGATE_REDIS_URL", ""),
        help="Redis for the response cache's shared tier, e.g. redis://127.0.0.1:6379/0 "
        "(default: $LOCKGATE_REDIS_URL; none: in-process cache only)",
    )
    p.add_argument("--redis-prefix", default="lockgate", help="key prefix in Redis")
    p.add_argument(
        "--redis-timeout-ms",
        type=float,
        default=50.0,
        help="bound on one Redis command; past it the lookup is a miss",
    )
    p.add_argument("--no-admission", action="store_true", help="turn off deadline-aware admission")
    p.add_argument("--strict-readiness", action="store_true", help="ready only when all models are")
    p.add_argument("--no-llm", action="store_true", help="do not start language models")
    p.add_argument(
        "--replicas",
        type=_replicas,
        default=1,
        help="server processes sharing --port and --grpc-port (see --balance), each loading "
        "every model: a number (default 1), or auto: one per usable core when every model is "
        "classic, 1 with a language model, a stateful model or explicit model control; the "
        "replicas end with this process, even when it is killed (each gets SIGTERM and drains)",
    )
    p.add_argument(
        "--balance",
        choices=("kernel", "router"),
        help="with --replicas > 1, kernel: every replica binds --port (and --grpc-port) with "
        "SO_REUSEPORT and the kernel spreads connections; router: lockgate's router on "
        "--port in front of them (retries, hedging; a model load or unload reaches every "
        "replica); default: kernel on Linux, else router, and router with "
        "--model-control-mode explicit",
    )
    p.add_argument(
        "--pin-replicas",
        choices=("auto", "on", "off"),
        default="auto",
        help="with --replicas > 1, on: replica i runs on core i (modulo the cores this "
        "process may use); off: each may run on any of them; auto (default): on when there "
        "are as many replicas as cores, else off. Each replica's OpenMP, OpenBLAS and MKL "
        "pools get the usable cores divided by the replicas, at least 1 (unless "
        "OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS is set)",
    )
    p.add_argument(
        "--control-state",
        metavar="PATH|off",
        help="with --replicas behind the router: the file where the router keeps the model "
        "loads and unloads it replays to a replica started again (see lockgate route "
        "--control-state), read back by a run after this one was killed; default: one per "
        "--port and repository in $XDG_RUNTIME_DIR/lockgate (else ~/.local/state/lockgate), "
        "removed when this command stops its replicas itself; off: in memory only",
    )
    p.add_argument(
        "--replica-base-port",
        type=int,
        help="replica i also serves HTTP on this port + i, its own (kernel: on --host, for "
        "its metrics and health; router: on 127.0.0.1, the router's way in) "
        "(default: --port + 1)",
    )
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind --port and --grpc-port with SO_REUSEPORT, shared with other processes; "
        "listen on --port once start-up is complete (set by --balance kernel)",
    )
    p.add_argument(
        "--private-port",
        type=int,
        help="also serve HTTP on this port of --host, for this process alone (set by "
        "--balance kernel)",
    )
    _add_openai_limits(p)
    p.add_argument("-v", "--verbose", action="store_true")


# the flags of OpenAILimits: what one OpenAI API request may ask for
_OPENAI_LIMITS = {
    "max_stop": "stop strings of one request (more: 400)",
    "max_stop_chars": "characters of one stop string (more: 400)",
    "max_stop_token_ids": "stop_token_ids of one request (more: 400)",
    "max_logit_bias": "logit_bias entries of one request (more: 400)",
    "max_bad_words": "bad_words of one request, each of at most --max-stop-chars characters "
    "(more: 400)",
    "max_request_id_chars": "characters of vLLM's request_id, which the response's id "
    "carries (more: 400)",
    "max_cache_salt_chars": "characters of vLLM's cache_salt (more: 400)",
    "max_prompt_chars": "characters of a prompt (more: 400 before tokenizing; 0: "
    "max_model_len x the longest token's characters)",
    "tokenize_threads": "prompts tokenized at once, off the event loop",
    "tokenize_waiting": "prompts waiting for a tokenizer thread (more: 503)",
    "max_embedding_inputs": "texts of one /v1/embeddings request (more: 400)",
    "max_embedding_chars": "characters of one text to embed (more: 400)",
    "max_n": "choices (n) and candidates (best_of) of one completion (more: 400)",
    "max_prompts": "prompts of one /v1/completions request, a list of them answered as one "
    "choice each (more: 400)",
    "max_grammar_chars": "characters of a response_format JSON schema, guided_json, "
    "guided_regex or guided_grammar (more: 400; 0: guided decoding refused)",
    "max_grammar_mask_ms": "CPU milliseconds of one token mask of a guided request's grammar "
    "(more: its output ends, finish_reason length; 0: no bound)",
    "max_tools": "function tools of one chat request (more: 400)",
    "max_tool_chars": "characters of one chat request's tools, as JSON (more: 400; 0: tools "
    "refused)",
    "max_payload_bytes": "bytes of one request body on the language-model routes (/v1/..., "
    "/tokenize, /detokenize, generate; more: 413, within --max-body-mb): the body is decoded "
    "whole on the event loop, 4 to 8 ms per MiB",
}


def _add_openai_limits(p: argparse.ArgumentParser) -> None:
    from lockgate.protocol.openai import OpenAILimits

    defaults = OpenAILimits()
    for field in fields(OpenAILimits):
        p.add_argument(
            "--" + field.name.replace("_", "-"),
            type=int,
            default=getattr(defaults, field.name),
            help=f"OpenAI API: {_OPENAI_LIMITS[field.name]}",
        )


def _redis(args: argparse.Namespace) -> RedisSettings | None:
    from lockgate.cache.redis_tier import RedisSettings

    if not args.redis_url:
        return None
    return RedisSettings(args.redis_url, args.redis_prefix, args.redis_timeout_ms / 1000.0)


def _tracing_installed() -> bool:
    """Whether the OpenTelemetry packages are there; if not, says which extra brings them."""
    from lockgate.extras import MissingExtra, import_for

    try:
        import_for("lockgate.frontend.otel", "otel", "tracing (--otel-endpoint)")
    except MissingExtra as exc:
        print(f"lockgate: {exc}", file=sys.stderr)
        return False
    return True


def _grpc_port(text: str) -> int:
    """A port number; 0 stands for 'off'."""
    if text.strip().lower() == "off":
        return 0
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number or 'off': {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0-65535")
    return port


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}")
        return value

    return parse


def _replicas(text: str) -> int | str:
    """A replica count of at least 1, or 'auto'."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'auto': {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return count


def _replica_count(args: argparse.Namespace, repository: Path) -> int:
    if args.replicas != "auto":
        return int(args.replicas)
    from lockgate.backends.base import LLM_BACKEND
    from lockgate.router.replicas import auto_replicas, usable_cores

    if args.model_control_mode == "explicit":  # one process, as asked of none; a number of
        return 1  # them run behind the router, which sends each load and unload to all
    cores = usable_cores()
    return auto_replicas(
        repository, cores=cores, llm_backend=LLM_BACKEND, language_models=not args.no_llm
    )


def _balance(args: argparse.Namespace) -> str:
    """--balance, or its default: the kernel where it spreads a shared port's connections,
    but the router with explicit model control, whose loads and unloads it sends to every
    replica (through the kernel's shared port, one replica would get each)."""
    from lockgate.router.replicas import reuse_port_balances

    if args.balance is None and args.model_control_mode == "explicit":
        return "router"
    return str(args.balance or ("kernel" if reuse_port_balances() else "router"))


def _replica_serve_argv(args: argparse.Namespace, repository: Path, registry: str) -> list[str]:
    """This command's arguments for its replicas: the demo is built once, not in each, and
    the replicas share their shared memory registrations in `registry`."""
    argv = list(args.argv)
    if args.repository is None:
        argv.insert(argv.index("serve") + 1, str(repository))
    if not args.shared_memory_registry:
        argv += ["--shared-memory-registry", registry]
    return argv


def _serve_shared_port(args: argparse.Namespace, repository: Path, count: int) -> int:
    """`count` server processes sharing --port and --grpc-port (SO_REUSEPORT), replica i with
    HTTP of its own on --replica-base-port + i; this process only supervises them."""
    from lockgate.router.replicas import (
        Placement,
        cannot_share,
        reuse_port_balances,
        shared_port_argv,
    )
    from lockgate.router.supervisor import Supervisor

    if not reuse_port_balances():
        print("lockgate: --balance kernel needs Linux's SO_REUSEPORT", file=sys.stderr)
        return 2
    why = cannot_share(args.host, args.port)
    if why is not None:
        print(f"lockgate: {why}", file=sys.stderr)
        return 1
    base = args.replica_base_port or args.port + 1
    private = range(base, base + count)
    if private.stop - 1 > 65535 or args.port in private or args.grpc_port in private:
        print(
            f"lockgate: the replicas' ports {base}-{private.stop - 1} must be free port "
            "numbers other than --port and --grpc-port",
            file=sys.stderr,
        )
        return 2
    placement = Placement.choose(args.pin_replicas, count)
    logging.getLogger("lockgate").info(
        "serving with %d replicas sharing port %d (kernel balancing), %s",
        count,
        args.port,
        placement,
    )
    with tempfile.TemporaryDirectory(prefix="lockgate-shm-") as registry:
        argv = _replica_serve_argv(args, repository, registry)
        argvs = [shared_port_argv(argv, port) for port in private]
        return Supervisor.of(argvs, args.drain_timeout, placement).run()


def _serve_replicas(args: argparse.Namespace, repository: Path, count: int) -> int:
    """The router on --port (and its gRPC front on --grpc-port), and `count` server
    processes behind it."""
    from lockgate.router.replicas import control_state_path

    if args.control_state is None:
        state = control_state_path(args.port, repository)
    else:
        state = None if args.control_state == "off" else Path(args.control_state)
    with tempfile.TemporaryDirectory(prefix="lockgate-shm-") as registry:
        argv = _replica_serve_argv(args, repository, registry)
        code = _serve_behind_router(args, argv, count, state)
    if code == 0 and args.control_state is None and state is not None:
        state.unlink(missing_ok=True)  # drained, its replicas with it: the next run starts anew
    return code


def _serve_behind_router(
    args: argparse.Namespace, argv: list[str], count: int, state: Path | None
) -> int:
    from lockgate.router.app import RouterSettings
    from lockgate.router.grpc_proxy import GrpcFrontSettings, ReplicaGrpcPort
    from lockgate.router.model_control import ControlSettings
    from lockgate.router.pool import Discovery
    from lockgate.router.replica import HealthSettings
    from lockgate.router.replicas import Placement, Replicas
    from lockgate.router.server import build, run

    base = args.replica_base_port or args.port + 1
    ports = [base + i for i in range(count)]
    grpc = None
    if args.grpc_port != 0:  # replica i's gRPC on the port `count` above its HTTP port
        try:
            grpc = GrpcFrontSettings(
                host=args.host,
                port=args.grpc_port or 8001,
                required=args.grpc_port is not None,
                replica_port=ReplicaGrpcPort(offset=count),
                max_receive_bytes=int(args.max_body_mb * 2**20),
                max_concurrent_rpcs=args.grpc_max_concurrent_rpcs,
                max_stream_inflight=args.grpc_max_stream_inflight,
                drain_timeout=args.drain_timeout,
            )
        except ValueError as exc:
            print(f"lockgate: {exc}", file=sys.stderr)
            return 2
    placement = Placement.choose(args.pin_replicas, count)
    logging.getLogger("lockgate").info(
        "serving with %d replicas behind a router, %s", count, placement
    )
    grpc_ports = None if grpc is None else [p + count for p in ports]
    replicas = Replicas(argv, ports, placement, grpc_ports)
    replicas.start()
    try:
        urls = tuple(f"http://127.0.0.1:{port}" for port in ports)
        control = ControlSettings(state=state)
        app = build(Discovery(urls), HealthSettings(), RouterSettings(control=control))
        return run(app, args.host, args.port, grpc=grpc)
    finally:
        replicas.stop(args.drain_timeout + 5)


def _serve(args: argparse.Namespace) -> int:
    if args.otel_endpoint and not _tracing_installed():
        return 2
    repository = args.repository
    if repository is None:
        from lockgate.demo.build import build_demo_repository, default_demo_path

        repository = _build_demo(build_demo_repository, default_demo_path())
        if repository is None:
            return 2
    from lockgate.errors import ConfigError

    try:
        bare = _bare_model(args, Path(repository))
    except ConfigError as exc:
        print(f"lockgate: {exc.path}: {exc.problem}", file=sys.stderr)
        return 2
    count = _replica_count(args, Path(repository))
    if count > 1 and args.health_port is not None:
        print(
            "lockgate: --health-port serves one process; with --replicas, probe the port "
            "the replicas share",
            file=sys.stderr,
        )
        return 2
    if args.health_stale_s <= 0:
        print("lockgate: --health-stale-s must be > 0", file=sys.stderr)
        return 2
    if count > 1 and _balance(args) == "kernel":
        return _serve_shared_port(args, Path(repository), count)
    if count > 1:
        return _serve_replicas(args, Path(repository), count)
    from lockgate.core.admission import AdmissionSettings
    from lockgate.core.manager import ServingSettings
    from lockgate.frontend.app import ServerSettings
    from lockgate.frontend.gate import GateSettings
    from lockgate.frontend.server import ServeOptions, run
    from lockgate.protocol.openai import OpenAILimits
    from lockgate.protocol.trace_settings import TraceValues

    try:
        limits = OpenAILimits(**{f.name: getattr(args, f.name) for f in fields(OpenAILimits)})
    except ValueError as exc:
        print(f"lockgate: {exc}", file=sys.stderr)
        return 2
    try:
        trace = TraceValues(args.trace_level == "TIMESTAMPS", args.trace_rate, args.trace_count)
    except ValueError as exc:
        print(f"lockgate: {exc} (--trace-rate, --trace-count)", file=sys.stderr)
        return 2
    if not 0 < args.repository_poll_secs < 1e6:
        print("lockgate: --repository-poll-secs must be a positive number", file=sys.stderr)
        return 2
    if args.shared_memory_regions < 0:
        print("lockgate: --shared-memory-regions must be 0 (off) or more", file=sys.stderr)
        return 2
    if args.compress_min_bytes < 0:
        print("lockgate: --compress-min-bytes must be 0 (off) or more", file=sys.stderr)
        return 2
    metrics_compat = _metrics_compat(args.metrics_compat)
    if metrics_compat is None:
        print(
            "lockgate: --metrics-compat takes 'none' or names among triton, vllm "
            f"(comma-separated), not {args.metrics_compat!r}",
            file=sys.stderr,
        )
        return 2
    if args.responses_store_size < 0:
        print("lockgate: --responses-store-size must be 0 (off) or more", file=sys.stderr)
        return 2
    http = ServerSettings(
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        body_timeout_s=args.body_timeout,
        compress_min_bytes=args.compress_min_bytes,
        responses_store_size=args.responses_store_size,
        shared_memory_regions=args.shared_memory_regions,
        shared_memory_registry=args.shared_memory_registry,
        allowed_origins=args.allowed_origins,
        api_keys=_env_keys("LOCKGATE_API_KEYS"),
        admin_keys=_env_keys("LOCKGATE_ADMIN_KEYS"),
        priority_keys=_env_keys("LOCKGATE_PRIORITY_KEYS"),
        strict_readiness=args.strict_readiness,
        model_control=args.model_control_mode,
        metrics_public=args.metrics_public,
        metrics_compat=metrics_compat,
        access_log=args.access_log,
        redis=_redis(args),
        otel_endpoint=args.otel_endpoint,
        trace=trace,
        openai=limits,
    )
    if args.load_model and args.model_control_mode != "explicit":
        print("lockgate: --load-model needs --model-control-mode explicit", file=sys.stderr)
        return 2
    serving = ServingSettings(
        startup_models=_startup_models(args),
        repository_poll_s=args.repository_poll_secs if args.model_control_mode == "poll" else None,
        hang_timeout=args.hang_timeout,
        max_sequences=args.max_sequences,
        unload_drain_timeout=args.drain_timeout,
        admission=AdmissionSettings(deadline_aware=not args.no_admission),
        language_models=not args.no_llm,
    )
    try:
        gate = GateSettings(
            max_lag=args.max_loop_lag_ms / 1000.0,
            queue_target=args.queue_target_ms / 1000.0,
            penalty_pause=args.refusal_pause_ms / 1000.0,
            penalty_ratio=args.refusal_pause_ratio,
            pause_share=args.refusal_pause_share,
            max_requests=args.limit_concurrency,
            head_timeout=args.head_timeout,
            max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
            slow_body=args.slow_body_secs,
        )
    except ValueError as exc:
        print(f"lockgate: {exc}", file=sys.stderr)
        return 2
    options = ServeOptions(
        repository=Path(repository),
        bare=bare,
        host=args.host,
        port=args.port,
        drain_timeout=args.drain_timeout,
        gate=gate,
        keep_alive_timeout=args.keep_alive_timeout,
        http=http,
        serving=serving,
        grpc_port=8001 if args.grpc_port is None else (args.grpc_port or None),
        grpc_port_required=args.grpc_port is not None,
        grpc_max_concurrent_rpcs=args.grpc_max_concurrent_rpcs,
        grpc_max_stream_inflight=args.grpc_max_stream_inflight,
        reuse_port=args.reuse_port,
        private_port=args.private_port,
        health_port=args.health_port,
        health_stale_s=args.health_stale_s,
        accept_per_turn=args.accepts_per_turn,
    )
    return run(options)


def _bare_model(args: argparse.Namespace, path: Path) -> BareModel | None:
    """The one model file `path` names (None: `path` is a repository). ConfigError when it is
    neither, or when the model control mode has no meaning for one file."""
    from lockgate.core.bare_model import find_bare_model
    from lockgate.errors import ConfigError

    # an empty folder is a repository when models may be loaded into it later
    bare = find_bare_model(path, args.model_name, empty_ok=args.model_control_mode != "none")
    if bare is not None and args.model_control_mode == "explicit":
        problem = (
            "one model file is always loaded: --model-control-mode explicit loads and unloads "
            "a repository's models (poll reloads the file when it changes)"
        )
        raise ConfigError(str(path), "--model-control-mode", problem)
    if bare is None and args.model_name:
        logging.getLogger("lockgate").info(
            "--model-name %s names a single model file; %s is a repository, whose models keep "
            "their folders' names",
            args.model_name,
            path,
        )
    return bare


def _startup_models(args: argparse.Namespace) -> frozenset[str] | None:
    """The models loaded at start-up (None: all): in explicit mode, --load-model's, as in
    Triton."""
    if args.model_control_mode != "explicit":
        return None
    names = frozenset(args.load_model or ())
    return None if "*" in names else names


def _build_demo(build: Callable[..., Path], dest: Path) -> Path | None:
    """The demo repository, built if needed; None (and a message) when it cannot be."""
    from lockgate.demo.packages import DemoBuildError
    from lockgate.extras import MissingExtra

    try:
        return build(dest, progress=print)
    except (MissingExtra, DemoBuildError) as exc:
        print(f"lockgate: cannot build the demo repository: {exc}", file=sys.stderr)
        print("lockgate: give a model repository: lockgate serve <repository>", file=sys.stderr)
        return None


def _models(args: argparse.Namespace) -> int:
    from lockgate.core.bare_model import bare_entry, find_bare_model
    from lockgate.core.repository import scan_repository
    from lockgate.errors import ConfigError

    repository = args.repository
    if repository is None:
        from lockgate.demo.build import build_demo_repository, default_demo_path

        repository = _build_demo(build_demo_repository, default_demo_path())
        if repository is None:
            return 2
    try:
        bare = find_bare_model(Path(repository))
    except ConfigError as exc:
        print(f"lockgate: {exc.path}: {exc.problem}", file=sys.stderr)
        return 2
    entries = [bare_entry(bare)] if bare else scan_repository(Path(repository))
    bad = 0
    for entry in entries:
        if entry.error or entry.config is None:
            bad += 1
            print(f"{entry.name:24} ERROR  {entry.error}")
            continue
        c = entry.config
        versions = ",".join(str(v) for v in entry.versions) or "-"
        slo = f"slo={c.latency_slo_ms}ms" if c.latency_slo_ms else ""
        print(
            f"{entry.name:24} OK     backend={c.backend} versions={versions} "
            f"max_batch_size={c.max_batch_size} instances={c.instance_count} {slo}".rstrip()
        )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    follow_parent()  # a replica of `serve --replicas` ends with its parent, however it ends
    parser = argparse.ArgumentParser(prog="lockgate", description="lockgate inference server")
    parser.add_argument("--version", action="version", version=f"lockgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    p = sub.add_parser("models", help="list and check a model repository or model file")
    p.add_argument("repository", nargs="?", type=Path)
    from lockgate.router import cli as route

    p = sub.add_parser("route", help="one address in front of many lockgate replicas")
    route.add_arguments(p)
    p.set_defaults(handler=route.run)
    _add_tools(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    access = logging.getLogger("lockgate.access")  # JSON lines, as they are
    lines = logging.StreamHandler()
    lines.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(lines)
    access.propagate = False
    if args.command == "serve":
        return _serve(args)
    if args.command == "models":
        return _models(args)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.error(f"unknown command {args.command}")
    result: int = handler(args)
    return result


def _add_tools(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """bench, profile and plan register their own arguments. Without the `bench` extra they
    are listed still, and say what to install."""
    from lockgate.extras import MissingExtra, import_for

    for command, module in (
        ("bench", "lockgate.bench.cli"),
        ("profile", "lockgate.plan.profile_cli"),
        ("plan", "lockgate.plan.cli"),
    ):
        try:
            tool = import_for(module, "bench", f"lockgate {command}")
        except MissingExtra as exc:
            p = sub.add_parser(command, help=f"(needs: pip install 'lockgate[{exc.extra}]')")
            p.add_argument("args", nargs=argparse.REMAINDER)
            p.set_defaults(handler=_missing(exc))
            continue
        p = sub.add_parser(command, help=(tool.__doc__ or command).strip().splitlines()[0])
        tool.add_arguments(p)
        p.set_defaults(handler=tool.run)


def _missing(exc: ImportError) -> Callable[[argparse.Namespace], int]:
    def report(args: argparse.Namespace) -> int:
        print(f"lockgate: {exc}", file=sys.stderr)
        return 2

    return report


if __name__ == "__main__":
    sys.exit(main())
