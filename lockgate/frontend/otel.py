"""OpenTelemetry tracing of KServe v2 inference requests (`lockgate serve --otel-endpoint URL`,
the `lockgate[otel]` extra).

A traced request gets a server span, started at its first byte and parented on an incoming
W3C `traceparent`, with the request id as an attribute. When the answer is sent, five child
spans are made from the timestamps the request collected on its way (nothing below the
frontend knows about OpenTelemetry):

    receive  first byte -> admission (body read, decoded, checked)
    queue    admission -> its batch formed
    batch    batch formed -> the model starting on it (inputs gathered, thread handoff)
    compute  the model's run
    respond  the model's end -> the response sent (outputs split and encoded)

A phase the request never reached (a cache hit has no queue) has no span. Spans leave in
batches from the SDK's background thread, over OTLP/HTTP (protobuf), never from the loop.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lockgate.core.request import InferRequest

TRACE_HEADERS = (b"traceparent", b"tracestate")


@dataclass(slots=True)
class RequestTrace:
    """One traced request: its server span, and what its child spans are made of."""

    span: trace.Span
    trace_id: str  # 32 hex digits when the span is sampled, else "": the metrics' exemplar
    received: float  # time.monotonic() of the first byte
    request: InferRequest | None = None  # set by the route once the model answered


class Tracing:
    """The tracer of one server, with a provider of its own (never the global one)."""

    def __init__(self, endpoint: str) -> None:
        name = os.environ.get("OTEL_SERVICE_NAME") or "lockgate"
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("lockgate")
        self.propagator = TraceContextTextMapPropagator()

    def start(
        self, headers: list[tuple[bytes, bytes]], request_id: str, method: str, path: str, at: float
    ) -> RequestTrace:
        carrier = {k.decode(): v.decode("latin-1") for k, v in headers if k in TRACE_HEADERS}
        parts = path.split("/")  # "", "v2", "models", name, ["versions", v,] "infer"
        versioned = len(parts) == 7
        route = "/v2/models/{model}" + ("/versions/{version}" if versioned else "") + "/infer"
        span = self.tracer.start_span(
            f"{method} {route}",
            context=self.propagator.extract(carrier),
            kind=trace.SpanKind.SERVER,
            start_time=_epoch_ns(at, _offset_ns()),
            attributes={
                "http.request.method": method,
                "url.path": path[:512],
                "lockgate.request_id": request_id,
                "lockgate.model": parts[3] if len(parts) > 3 else "",
            },
        )
        context = span.get_span_context()
        trace_id = trace.format_trace_id(context.trace_id) if context.trace_flags.sampled else ""
        return RequestTrace(span, trace_id, at)

    def finish(self, traced: RequestTrace, status: int, at: float) -> None:
        """End the request's span at `at`, when its answer (`status`, 0 for none) was sent,
        after the spans of its phases."""
        span, request, offset = traced.span, traced.request, _offset_ns()
        if status:  # else the client left before an answer
            span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(trace.StatusCode.ERROR)
        if request is not None and span.is_recording():
            span.set_attribute("lockgate.model_version", str(request.version or ""))
            span.set_attribute("lockgate.batch_rows", request.batch_rows)
            computing = request.computed - request.compute_seconds if request.computed else 0.0
            parent = trace.set_span_in_context(span)
            for name, start, end in (
                ("receive", traced.received, request.admitted),
                ("queue", request.admitted, request.batched),
                ("batch", request.batched, computing),
                ("compute", computing, request.computed),
                ("respond", request.computed, at),
            ):
                if start and end >= start:
                    child = self.tracer.start_span(
                        name, parent, start_time=_epoch_ns(start, offset)
                    )
                    child.end(end_time=_epoch_ns(end, offset))
        span.end(end_time=_epoch_ns(at, offset))

    def shutdown(self) -> None:
        """Send the spans still buffered (blocks up to the exporter's timeout)."""
        self.provider.shutdown()


def traces_url(endpoint: str) -> str:
    """As OTEL_EXPORTER_OTLP_ENDPOINT: a base URL, to which OTLP/HTTP adds /v1/traces."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def _offset_ns() -> int:
    """Epoch minus monotonic time, now, in ns."""
    return time.time_ns() - time.monotonic_ns()


def _epoch_ns(monotonic: float, offset: int) -> int:
    return int(monotonic * 1e9) + offset
