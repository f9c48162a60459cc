"""OpenTelemetry tracing of inference requests (`lockgate serve --otel-endpoint URL`, the
`lockgate[otel]` extra): KServe v2 over REST and gRPC (ModelInfer, and each request of
ModelStreamInfer), the OpenAI routes that compute (/v1/completions, /v1/chat/completions,
/v1/embeddings) and Triton's generate extension.

A traced request gets a server span, started when it arrived (its first byte on HTTP) and
parented on an incoming W3C `traceparent` (an HTTP header, or gRPC metadata), with the
request id as an attribute. When the answer has been sent, child spans are made from the
timestamps the request collected on its way (nothing below the frontend knows about
OpenTelemetry). A request to a classic model (v2, gRPC, embeddings):

    receive  arrival -> admission (body read, decoded, checked)
    queue    admission -> its batch formed
    batch    batch formed -> the model starting on it (inputs gathered, thread handoff)
    compute  the model's run
    respond  the model's end -> the response sent (outputs split and encoded)

(an embeddings request that runs in several model requests has a queue, batch and compute
span for each). A completion on a language model, from the engine's own record of it:

    receive   arrival -> the engine (body read, decoded, tokenized, checked)
    queue     the engine's queue, until the request is first scheduled
    generate  first scheduled -> the last token (prefill and decode, preemptions included)
    respond   the last token -> the answer sent (a stream: its last event)

with the time to first token as the span's `lockgate.ttft_s` attribute (from arrival) and a
`first_token` event. A phase the request never reached (a cache hit has no queue) has no
span. Spans leave in batches from the SDK's background thread, over OTLP/HTTP (protobuf),
never from the loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lockgate.core.request import InferRequest

if TYPE_CHECKING:
    from lockgate.llm.metrics import RequestTimings

TRACE_HEADERS = (b"traceparent", b"tracestate")
TRACE_KEYS = ("traceparent", "tracestate")  # the same, as gRPC metadata keys
TRACED_V1 = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})
TRACED_V2 = frozenset({"infer", "generate", "generate_stream"})
RPC_SERVICE = "inference.GRPCInferenceService"


@dataclass(frozen=True, slots=True)
class Phase:
    """A child span: one step of a request's way, in time.monotonic() seconds."""

    name: str
    start: float
    end: float


@dataclass(slots=True)
class RequestTrace:
    """One traced request: its server span, and what its child spans are made of."""

    span: trace.Span
    trace_id: str  # 32 hex digits when the span is sampled, else "": the metrics' exemplar
    received: float  # time.monotonic() of the request's arrival (its first byte on HTTP)
    model: str = ""  # set by the route once known (a /v1 body names it)
    # the requests made to a classic model, in order, set by the route as they are made
    requests: list[InferRequest] = field(default_factory=list)
    # a completion's record, kept by the engine (set by the completion pipeline)
    timings: RequestTimings | None = None

    def phases(self, at: float) -> list[Phase]:
        """The steps of the request, answered at `at`, that it reached."""
        if self.timings is not None:
            found = _generation_phases(self.received, self.timings, at)
        else:
            found = _inference_phases(self.received, self.requests, at)
        return [p for p in found if p.start and p.end >= p.start]


class Tracing:
    """The tracer of one server, with a provider of its own (never the global one)."""

    def __init__(self, endpoint: str) -> None:
        name = os.environ.get("OTEL_SERVICE_NAME") or "lockgate"
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("lockgate")
        self.propagator = TraceContextTextMapPropagator()

    def start_http(
        self, headers: list[tuple[bytes, bytes]], request_id: str, method: str, path: str, at: float
    ) -> RequestTrace | None:
        """The trace of an HTTP request that arrived at `at`; None for a route not traced."""
        route = http_route(path)
        if route is None:
            return None
        carrier = {k.decode(): v.decode("latin-1") for k, v in headers if k in TRACE_HEADERS}
        attributes = {
            "http.request.method": method,
            "http.route": route,
            "url.path": path[:512],
            "lockgate.request_id": request_id,
        }
        traced = self._start(f"{method} {route}", carrier, attributes, at)
        if route.startswith("/v2/"):
            traced.model = path.split("/")[3]  # "", "v2", "models", name, ...
        return traced

    def start_rpc(
        self,
        metadata: Iterable[tuple[str, str | bytes]],
        method: str,
        model: str,
        request_id: str,
        at: float,
    ) -> RequestTrace:
        """The trace of one gRPC inference request (`method` ModelInfer or ModelStreamInfer)
        that arrived at `at`; `metadata` is the call's, which may carry a traceparent."""
        carrier = {k: v for k, v in metadata if k in TRACE_KEYS and isinstance(v, str)}
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": RPC_SERVICE,
            "rpc.method": method,
            "lockgate.request_id": request_id[:128],
        }
        traced = self._start(f"{RPC_SERVICE}/{method}", carrier, attributes, at)
        traced.model = model
        return traced

    def _start(
        self, name: str, carrier: dict[str, str], attributes: dict[str, str], at: float
    ) -> RequestTrace:
        span = self.tracer.start_span(
            name,
            context=self.propagator.extract(carrier),
            kind=trace.SpanKind.SERVER,
            start_time=_epoch_ns(at, _offset_ns()),
            attributes=attributes,
        )
        context = span.get_span_context()
        trace_id = trace.format_trace_id(context.trace_id) if context.trace_flags.sampled else ""
        return RequestTrace(span, trace_id, at)

    def finish_http(self, traced: RequestTrace, status: int, at: float) -> None:
        """End an HTTP request's span at `at`, when its answer (`status`, 0 for none) was
        sent, after the spans of its phases."""
        if status:  # else the client left before an answer
            traced.span.set_attribute("http.response.status_code", status)
        self._finish(traced, status >= 500, at)

    def finish_rpc(self, traced: RequestTrace, code: int, error: bool, at: float) -> None:
        """End a gRPC request's span at `at`, answered with status `code` (0: OK)."""
        traced.span.set_attribute("rpc.grpc.status_code", code)
        self._finish(traced, error, at)

    def _finish(self, traced: RequestTrace, error: bool, at: float) -> None:
        span, offset = traced.span, _offset_ns()
        if error:
            span.set_status(trace.StatusCode.ERROR)
        if span.is_recording():
            _describe(traced, offset)
            parent = trace.set_span_in_context(span)
            for phase in traced.phases(at):
                child = self.tracer.start_span(
                    phase.name, parent, start_time=_epoch_ns(phase.start, offset)
                )
                child.end(end_time=_epoch_ns(phase.end, offset))
        span.end(end_time=_epoch_ns(at, offset))

    def shutdown(self) -> None:
        """Send the spans still buffered (blocks up to the exporter's timeout)."""
        self.provider.shutdown()


def http_route(path: str) -> str | None:
    """The route template of a traced HTTP path, e.g. /v2/models/{model}/infer; else None."""
    if path in TRACED_V1:
        return path
    parts = path.split("/")  # "", "v2", "models", name, ["versions", v,] action
    if parts[1:3] != ["v2", "models"] or parts[-1] not in TRACED_V2:
        return None
    if len(parts) == 5:
        return "/v2/models/{model}/" + parts[-1]
    if len(parts) == 7 and parts[4] == "versions":
        return "/v2/models/{model}/versions/{version}/" + parts[-1]
    return None


def _describe(traced: RequestTrace, offset: int) -> None:
    """The attributes a request learned on its way: model, version, batch, tokens, TTFT."""
    span = traced.span
    if traced.model:
        span.set_attribute("lockgate.model", traced.model)
    if traced.requests:
        last = traced.requests[-1]
        span.set_attribute("lockgate.model_version", str(last.version or ""))
        span.set_attribute("lockgate.batch_rows", last.batch_rows)
    timings = traced.timings
    if timings is None:
        return
    span.set_attribute("gen_ai.usage.input_tokens", timings.num_prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", timings.num_generation_tokens)
    span.set_attribute("lockgate.cached_tokens", timings.num_cached_tokens)
    span.set_attribute("lockgate.preemptions", timings.num_preemptions)
    if timings.first_token is not None:
        span.set_attribute("lockgate.ttft_s", timings.first_token - traced.received)
        span.add_event("first_token", timestamp=_epoch_ns(timings.first_token, offset))
    if timings.tpot is not None:
        span.set_attribute("lockgate.tpot_s", timings.tpot)
    if timings.finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", (timings.finish_reason,))


def _inference_phases(received: float, requests: list[InferRequest], at: float) -> list[Phase]:
    if not requests:
        return []
    phases = [Phase("receive", received, requests[0].admitted)]
    for r in requests:
        computing = r.computed - r.compute_seconds if r.computed else 0.0
        phases += [
            Phase("queue", r.admitted, r.batched),
            Phase("batch", r.batched, computing),
            Phase("compute", computing, r.computed),
        ]
    phases.append(Phase("respond", requests[-1].computed, at))
    return phases


def _generation_phases(received: float, timings: RequestTimings, at: float) -> list[Phase]:
    scheduled = timings.first_scheduled or 0.0
    ended = timings.last_token or timings.finished or 0.0
    return [
        Phase("receive", received, timings.arrival),
        Phase("queue", timings.arrival, scheduled),
        Phase("generate", scheduled, ended),
        Phase("respond", ended, at),
    ]


def traces_url(endpoint: str) -> str:
    """As OTEL_EXPORTER_OTLP_ENDPOINT: a base URL, to which OTLP/HTTP adds /v1/traces."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def _offset_ns() -> int:
    """Epoch minus monotonic time, now, in ns."""
    return time.time_ns() - time.monotonic_ns()


def _epoch_ns(monotonic: float, offset: int) -> int:
    return int(monotonic * 1e9) + offset
