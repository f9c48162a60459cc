"""OpenTelemetry tracing of inference requests (`lockgate serve --otel-endpoint URL`, the
`lockgate[otel]` extra): KServe v2 over REST and gRPC (ModelInfer, and each request of
ModelStreamInfer), the OpenAI routes that compute (/v1/completions, /v1/chat/completions,
/v1/embeddings) and Triton's generate extension.

Which requests are traced is Triton's trace extension's to say (`protocol/trace_settings.py`,
`/v2[/models/{m}]/trace/setting`): the setting of the request's model (its level, one in
`trace_rate` requests, `trace_count` more), decided when the model is known (a v2 path or
gRPC message at once, a /v1 body once it is read). A request that carries a caller's
traceparent is traced whenever the level is TIMESTAMPS, as the caller's sampling says.

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
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lockgate.core.request import InferRequest
from lockgate.protocol.trace_settings import TraceSettings

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
    """One request a route may trace: whether it is traced is decided once its model is
    known (`bind`), by that model's trace settings; then its server span starts, dated from
    the request's arrival, and child spans are made at its end from the times it collected."""

    tracing: Tracing
    name: str  # the server span's
    parent: Context  # the caller's trace, from its traceparent (empty without one)
    attributes: dict[str, str]
    received: float  # time.monotonic() of the request's arrival (its first byte on HTTP)
    model: str = ""  # the model named (a /v1 body names it), once bound
    bound: bool = False
    span: trace.Span | None = None  # once bound, when the request is traced
    trace_id: str = ""  # 32 hex digits when the span is sampled, else "": the metrics' exemplar
    # the requests made to a classic model, in order, set by the route as they are made
    requests: list[InferRequest] = field(default_factory=list)
    # a completion's record, kept by the engine (set by the completion pipeline)
    timings: RequestTimings | None = None

    def bind(self, model: str, repository_name: str = "") -> None:
        """Name the request's model; the first time, the trace settings of the model (by its
        `repository_name` when the request names it otherwise, as a language model's served
        name) decide whether the request is traced."""
        self.model = model
        if not self.bound:
            self.bound = True
            self.tracing.sample(self, repository_name or model)

    def phases(self, at: float) -> list[Phase]:
        """The steps of the request, answered at `at`, that it reached."""
        if self.timings is not None:
            found = _generation_phases(self.received, self.timings, at)
        else:
            found = _inference_phases(self.received, self.requests, at)
        return [p for p in found if p.start and p.end >= p.start]


class Tracing:
    """The tracer of one server, with a provider of its own (never the global one), sampling
    requests by the trace settings (`protocol/trace_settings.py`)."""

    def __init__(self, endpoint: str, settings: TraceSettings) -> None:
        name = os.environ.get("OTEL_SERVICE_NAME") or "lockgate"
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("lockgate")
        self.propagator = TraceContextTextMapPropagator()
        self.settings = settings

    def start_http(
        self, headers: list[tuple[bytes, bytes]], request_id: str, method: str, path: str, at: float
    ) -> RequestTrace | None:
        """The trace of an HTTP request that arrived at `at`; None for a route not traced.
        A v2 path names its model, which decides now; a /v1 route binds it from the body."""
        route = http_route(path)
        if route is None or not self.settings.tracing:
            return None
        carrier = {k.decode(): v.decode("latin-1") for k, v in headers if k in TRACE_HEADERS}
        attributes = {
            "http.request.method": method,
            "http.route": route,
            "url.path": path[:512],
            "lockgate.request_id": request_id,
        }
        parent = self.propagator.extract(carrier)
        traced = RequestTrace(self, f"{method} {route}", parent, attributes, at)
        if route.startswith("/v2/"):
            traced.bind(path.split("/")[3])  # "", "v2", "models", name, ...
        return traced

    def start_rpc(
        self,
        metadata: Iterable[tuple[str, str | bytes]],
        method: str,
        model: str,
        request_id: str,
        at: float,
    ) -> RequestTrace | None:
        """The trace of one gRPC inference request (`method` ModelInfer or ModelStreamInfer)
        that arrived at `at`; `metadata` is the call's, which may carry a traceparent."""
        if not self.settings.tracing:
            return None
        carrier = {k: v for k, v in metadata if k in TRACE_KEYS and isinstance(v, str)}
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": RPC_SERVICE,
            "rpc.method": method,
            "lockgate.request_id": request_id[:128],
        }
        parent = self.propagator.extract(carrier)
        traced = RequestTrace(self, f"{RPC_SERVICE}/{method}", parent, attributes, at)
        traced.bind(model)
        return traced

    def sample(self, traced: RequestTrace, model: str) -> None:
        """Start the request's span when its model's trace settings sample it (a caller's
        sampled traceparent is followed whenever tracing is on)."""
        parented = trace.get_current_span(traced.parent).get_span_context().is_valid
        if not self.settings.of(model).sample(parented):
            return
        span = self.tracer.start_span(
            traced.name,
            context=traced.parent,
            kind=trace.SpanKind.SERVER,
            start_time=_epoch_ns(traced.received, _offset_ns()),
            attributes=traced.attributes,
        )
        context = span.get_span_context()
        traced.span = span
        traced.trace_id = (
            trace.format_trace_id(context.trace_id) if context.trace_flags.sampled else ""
        )

    def finish_http(self, traced: RequestTrace, status: int, at: float) -> None:
        """End an HTTP request's span at `at`, when its answer (`status`, 0 for none) was
        sent, after the spans of its phases."""
        traced.bind(traced.model)  # a request refused before its body named a model
        if traced.span is None:
            return
        if status:  # else the client left before an answer
            traced.span.set_attribute("http.response.status_code", status)
        self._finish(traced, traced.span, status >= 500, at)

    def finish_rpc(self, traced: RequestTrace, code: int, error: bool, at: float) -> None:
        """End a gRPC request's span at `at`, answered with status `code` (0: OK)."""
        if traced.span is None:
            return
        traced.span.set_attribute("rpc.grpc.status_code", code)
        self._finish(traced, traced.span, error, at)

    def _finish(self, traced: RequestTrace, span: trace.Span, error: bool, at: float) -> None:
        offset = _offset_ns()
        if error:
            span.set_status(trace.StatusCode.ERROR)
        if span.is_recording():
            _describe(traced, span, offset)
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


def _describe(traced: RequestTrace, span: trace.Span, offset: int) -> None:
    """The attributes a request learned on its way: model, version, batch, tokens, TTFT."""
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
