"""OpenTelemetry tracing: a real server sends its spans over OTLP/HTTP to a tiny receiver
here, which decodes them; the request-latency histogram points at the trace."""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, start_server

pytest.importorskip("opentelemetry.sdk", reason="needs lockgate[otel]")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
PHASES = ["receive", "queue", "batch", "compute", "respond"]
BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


class Receiver(ThreadingHTTPServer):
    """Accepts OTLP/HTTP protobuf exports and keeps the spans and their service names."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[tuple[str, Span]] = []  # (service.name, span)
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def of_trace(self, trace_id: str, count: int, timeout: float = 10.0) -> list[tuple[str, Span]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [(s, span) for s, span in self.spans if span.trace_id.hex() == trace_id]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{len(found)} spans of trace {trace_id} within {timeout} s")


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource_spans in export.resource_spans:
                attributes = {
                    a.key: a.value.string_value for a in resource_spans.resource.attributes
                }
                for scope_spans in resource_spans.scope_spans:
                    self.server.spans += [
                        (attributes["service.name"], s) for s in scope_spans.spans
                    ]
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def traced(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory, receiver: Receiver
) -> Iterator[RunningServer]:
    running = start_server(
        test_repo,
        tmp_path_factory.mktemp("traced"),
        "--no-llm",
        "--otel-endpoint",
        receiver.url,
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},  # ms between exports, 5 s by default
    )
    yield running
    assert running.stop() == 0, running.log()[-2000:]  # buffered spans sent, then a clean exit


def test_request_spans_follow_the_callers_trace(traced: RunningServer, receiver: Receiver) -> None:
    headers = {"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01", "x-request-id": "traced-1"}
    answer = httpx.post(traced.url + "/v2/models/echo/infer", json=BODY, headers=headers)
    assert answer.status_code == 200, answer.text
    spans = receiver.of_trace(TRACE_ID, 1 + len(PHASES))
    assert {service for service, _ in spans} == {"lockgate"}
    (root,) = [s for _, s in spans if s.name == "POST /v2/models/{model}/infer"]
    assert root.parent_span_id.hex() == CALLER_SPAN and root.kind == Span.SPAN_KIND_SERVER
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["lockgate.request_id"].string_value == "traced-1"
    assert attributes["lockgate.model"].string_value == "echo"
    assert attributes["http.response.status_code"].int_value == 200
    children = sorted(
        (s for _, s in spans if s.parent_span_id == root.span_id),
        key=lambda s: s.start_time_unix_nano,
    )
    assert [s.name for s in children] == PHASES
    edges = [root.start_time_unix_nano]
    for span in children:  # one after the other, inside the request's span
        assert span.start_time_unix_nano >= edges[-1] - 1000  # ns of rounding
        assert span.end_time_unix_nano >= span.start_time_unix_nano
        edges.append(span.end_time_unix_nano)
    assert root.end_time_unix_nano >= edges[-1] - 1000


def test_request_latency_exemplar_points_at_the_trace(
    traced: RunningServer, receiver: Receiver
) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    assert httpx.post(traced.url + "/v2/models/echo/infer", json=BODY, headers=headers).is_success
    accept = {"accept": "application/openmetrics-text; version=1.0.0"}
    scrape = httpx.get(traced.url + "/metrics", headers=accept)
    assert scrape.headers["content-type"].startswith("application/openmetrics-text")
    exemplars = [
        line
        for line in scrape.text.splitlines()
        if line.startswith("lockgate_request_duration_seconds_bucket{")
        and 'model="echo"' in line
        and f'# {{trace_id="{trace_id}"}}' in line
    ]
    assert len(exemplars) == 1, scrape.text[-3000:]
    assert "trace_id" not in httpx.get(traced.url + "/metrics").text  # text 0.0.4: none


def test_a_request_without_traceparent_starts_a_trace(
    traced: RunningServer, receiver: Receiver
) -> None:
    with receiver.lock:
        known = {span.trace_id for _, span in receiver.spans}
    assert httpx.post(traced.url + "/v2/models/echo/infer", json=BODY).is_success
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with receiver.lock:
            roots = [
                span
                for _, span in receiver.spans
                if span.trace_id not in known and span.kind == Span.SPAN_KIND_SERVER
            ]
        if roots:
            break
        time.sleep(0.05)
    (root,) = roots
    assert root.parent_span_id == b""
    receiver.of_trace(root.trace_id.hex(), 1 + len(PHASES))


def test_tracing_without_the_extra_names_it(tmp_path: Path) -> None:
    hidden = "import sys; sys.modules['opentelemetry'] = None"  # as if not installed
    serve = "from lockgate.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["serve", str(tmp_path), "--otel-endpoint", "http://127.0.0.1:4318"]
    done = subprocess.run(
        [sys.executable, "-c", f"{hidden}; {serve}", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "pip install 'lockgate[otel]'" in done.stderr, done.stderr
