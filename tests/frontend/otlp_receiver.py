"""A tiny OTLP/HTTP collector for tests: it accepts protobuf exports and keeps the spans."""

from __future__ import annotations

import contextlib
import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


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

    def request_ids(self) -> set[str]:
        """The `lockgate.request_id` of every server span received so far."""
        with self.lock:
            spans = [span for _, span in self.spans if span.kind == Span.SPAN_KIND_SERVER]
        return {
            a.value.string_value
            for span in spans
            for a in span.attributes
            if a.key == "lockgate.request_id"
        }


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


@contextlib.contextmanager
def receiving() -> Iterator[Receiver]:
    """A receiver serving on a thread of its own, shut down on exit."""
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
