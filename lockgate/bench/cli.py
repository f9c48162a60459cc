"""`lockgate bench`: open- or closed-loop load against a KServe v2 or OpenAI endpoint."""

from __future__ import annotations

import argparse
import sys

from lockgate.bench.arrivals import ARRIVALS
from lockgate.bench.report import SLO, render_level, write_requests_csv
from lockgate.bench.runner import BenchConfig, run_bench_sync
from lockgate.bench.workload import ENDPOINTS
from lockgate.errors import BadRequest, ServingError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="server base URL")
    add("--endpoint", choices=ENDPOINTS, default="v2")
    add("--model", default="", help="model name (OpenAI: default the first of /v1/models)")
    add("--model-version", help="KServe v2 model version")
    add("--input-file", help="JSONL of request bodies, or a workload .json of prompt_ids")
    add("--batch-size", type=int, default=1, help="v2 synthetic: rows per request")
    add("--num-payloads", type=int, default=64, help="distinct synthetic request bodies")
    add("--max-tokens", type=int, help="LLM: output tokens per request (default 128)")
    add("--ignore-eos", action="store_true", help="LLM: generate exactly max tokens")
    add("--prompt-words", default="8,256", help="LLM synthetic prompt length range, MIN,MAX")
    add("--rate", help="open loop: requests/s, or a sweep such as 50,100,200")
    add("--concurrency", help="closed loop: workers, or a sweep such as 1,8,32")
    add("--arrival", choices=ARRIVALS, default="poisson")
    add("--duration", type=float, help="measured seconds per level")
    add("--num-requests", type=int, help="measured requests per level")
    add("--warmup", type=float, default=0.0, help="seconds of unmeasured load before each level")
    add("--timeout", type=float, default=60.0, help="seconds per request")
    add("--seed", type=int, default=0)
    add("--slo-ms", type=float, help="goodput: end-to-end latency SLO")
    add("--ttft-slo-ms", type=float, help="LLM goodput: TTFT SLO")
    add("--tpot-slo-ms", type=float, help="LLM goodput: TPOT SLO")
    add("--max-connections", type=int, help="connection pool size (default: sized for the load)")
    add(
        "--no-keep-alive",
        action="store_true",
        help="a new connection per request (for servers that close a connection after a "
        "streamed answer, where reusing it races the close)",
    )
    add("--quiet", action="store_true", help="no progress line")
    add("--output-json", help="write the report as JSON")
    add("--output-csv", help="write one CSV row per level")
    add("--output-requests-csv", help="write one CSV row per request")
    add("--plot", help="write a PNG of latency and goodput against load")


def _numbers(text: str | None, kind: type, name: str) -> tuple:  # type: ignore[type-arg]
    if not text:
        return ()
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise BadRequest(f"{name}: expected comma-separated numbers, got {text!r}") from exc


def _check_counts(args: argparse.Namespace) -> None:
    """400-style refusals of runs that cannot measure anything (they ran and printed nan)."""
    positive = {"--duration": args.duration, "--timeout": args.timeout}
    at_least_one = {
        "--num-requests": args.num_requests,
        "--batch-size": args.batch_size,
        "--num-payloads": args.num_payloads,
        "--max-connections": args.max_connections,
        "--max-tokens": args.max_tokens,
    }
    for flag, value in positive.items():
        if value is not None and not value > 0:
            raise BadRequest(f"{flag} must be > 0, got {value:g}")
    for flag, value in at_least_one.items():
        if value is not None and value < 1:
            raise BadRequest(f"{flag} must be at least 1, got {value}")
    if args.warmup < 0:
        raise BadRequest(f"--warmup must be >= 0, got {args.warmup:g}")
    for flag, text in (("--rate", args.rate), ("--concurrency", args.concurrency)):
        if text and any(not part.strip() for part in text.split(",")):
            raise BadRequest(f"{flag}: an empty value in {text!r}")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    _check_counts(args)
    words = _numbers(args.prompt_words, int, "--prompt-words")
    if len(words) != 2 or not 1 <= words[0] <= words[1]:
        raise BadRequest("--prompt-words takes MIN,MAX with 1 <= MIN <= MAX")
    return BenchConfig(
        url=args.url.rstrip("/"),
        endpoint=args.endpoint,
        model=args.model,
        model_version=args.model_version,
        input_file=args.input_file,
        batch_size=args.batch_size,
        num_payloads=args.num_payloads,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        prompt_words=(words[0], words[1]),
        rates=_numbers(args.rate, float, "--rate"),
        concurrencies=_numbers(args.concurrency, int, "--concurrency"),
        arrival=args.arrival,
        duration=args.duration,
        num_requests=args.num_requests,
        warmup=args.warmup,
        timeout=args.timeout,
        seed=args.seed,
        slo=SLO(args.slo_ms, args.ttft_slo_ms, args.tpot_slo_ms),
        max_connections=args.max_connections,
        keep_alive=not args.no_keep_alive,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        report, results = run_bench_sync(config, progress=None if args.quiet else sys.stderr)
        for level in report.levels:
            print(render_level(level))
        if args.output_json:
            report.write_json(args.output_json)
        if args.output_csv:
            report.write_csv(args.output_csv)
        if args.output_requests_csv:
            write_requests_csv(args.output_requests_csv, results)
        if args.plot:
            from lockgate.bench.plot import plot_sweep

            plot_sweep(report, args.plot)
        if report.levels and all(level.completed == 0 for level in report.levels):
            print("lockgate bench: no request succeeded", file=sys.stderr)
            return 1
    except ServingError as exc:
        print(f"lockgate bench: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"lockgate bench: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lockgate bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
