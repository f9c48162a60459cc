"""OpenTelemetry tracing: a real server (a classic model, an embedding model and SmolLM2, over
REST and gRPC) sends its spans over OTLP/HTTP to a tiny receiver (`otlp_receiver.py`), which
decodes them; the request-latency histograms point at the trace."""

from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import ONE_THREAD, RunningServer, free_port, smollm2_repository, start_server

pytest.importorskip("opentelemetry.sdk", reason="needs lockgate[otel]")
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.frontend.otlp_receiver import Receiver, receiving

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
PHASES = ["receive", "queue", "batch", "compute", "respond"]
LLM_PHASES = ["receive", "queue", "generate", "respond"]
RPC = "inference.GRPCInferenceService/"
BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with receiving() as server:
        yield server


@pytest.fixture(scope="module")
def traced(
    test_repo: Path,
    demo_repo: Path,
    tmp_path_factory: pytest.TempPathFactory,
    receiver: Receiver,
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("traced-repo")
    for name in ("echo", "minilm"):
        shutil.copytree(test_repo / name, repo / name)
    small = {
        "kv_cache_gib": "0.02",
        "max_model_len": "256",
        "dtype": "float32",
        "quantization": "none",
        **ONE_THREAD,
    }
    smollm2_repository(demo_repo, repo, small)
    running = start_server(
        repo,
        tmp_path_factory.mktemp("traced"),
        "--otel-endpoint",
        receiver.url,
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},  # ms between exports, 5 s by default
        grpc_port=free_port(),
        ready_timeout=600,
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


def children_of(root: Span, spans: list[tuple[str, Span]]) -> list[Span]:
    """The root's child spans, in the order they started; each inside the root, one after
    the other."""
    children = sorted(
        (s for _, s in spans if s.parent_span_id == root.span_id),
        key=lambda s: s.start_time_unix_nano,
    )
    edges = [root.start_time_unix_nano]
    for span in children:
        assert span.start_time_unix_nano >= edges[-1] - 1000  # ns of rounding
        assert span.end_time_unix_nano >= span.start_time_unix_nano
        edges.append(span.end_time_unix_nano)
    assert root.end_time_unix_nano >= edges[-1] - 1000
    return children


def attributes_of(span: Span) -> dict[str, object]:
    values = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        value = getattr(a.value, kind)
        values[a.key] = list(value.values) if kind == "array_value" else value
    return values


def test_grpc_model_infer_follows_the_callers_trace(
    traced: RunningServer, receiver: Receiver
) -> None:
    import tritonclient.grpc as grpcclient

    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    tensor = grpcclient.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.array([[1, 2, 3, 4]], dtype=np.float32))
    with grpcclient.InferenceServerClient(traced.grpc_address) as client:
        result = client.infer(
            "echo",
            [tensor],
            request_id="grpc-traced",
            headers={"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"},
        )
    assert result.as_numpy("y").tolist() == [[2, 4, 6, 8]]
    spans = receiver.of_trace(trace_id, 1 + len(PHASES))
    (root,) = [s for _, s in spans if s.name == RPC + "ModelInfer"]
    assert root.parent_span_id.hex() == CALLER_SPAN and root.kind == Span.SPAN_KIND_SERVER
    attributes = attributes_of(root)
    assert attributes["rpc.system"] == "grpc" and attributes["rpc.method"] == "ModelInfer"
    assert attributes["rpc.grpc.status_code"] == 0
    assert attributes["lockgate.request_id"] == "grpc-traced"
    assert attributes["lockgate.model"] == "echo"
    assert [s.name for s in children_of(root, spans)] == PHASES


def test_grpc_stream_requests_each_get_a_span(traced: RunningServer, receiver: Receiver) -> None:
    import tritonclient.grpc as grpcclient

    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    answers: queue.Queue[object] = queue.Queue()
    with grpcclient.InferenceServerClient(traced.grpc_address) as client:
        client.start_stream(
            lambda result, error: answers.put(error or result),
            headers={"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"},
        )
        for i, name in enumerate(("echo", "no_such_model")):
            tensor = grpcclient.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.full((1, 4), i, dtype=np.float32))
            client.async_stream_infer(name, [tensor], request_id=f"stream-{i}")
        got = [answers.get(timeout=30) for _ in range(2)]
        client.stop_stream()
    assert sum(isinstance(a, grpcclient.InferResult) for a in got) == 1, got
    spans = receiver.of_trace(trace_id, 2 + len(PHASES))
    roots = {
        attributes_of(s)["lockgate.request_id"]: s
        for _, s in spans
        if s.name == RPC + "ModelStreamInfer"
    }
    assert set(roots) == {"stream-0", "stream-1"}
    assert all(r.parent_span_id.hex() == CALLER_SPAN for r in roots.values())
    assert [s.name for s in children_of(roots["stream-0"], spans)] == PHASES
    assert children_of(roots["stream-1"], spans) == []  # refused before it was admitted
    assert attributes_of(roots["stream-1"])["rpc.grpc.status_code"] == 5  # NOT_FOUND


@pytest.mark.parametrize(
    ("trace_id", "path", "body", "streamed"),
    [
        (
            "7bf92f3577b34da6a3ce929d0e0e4701",
            "/v1/completions",
            {"prompt": "The capital of France is", "stream": True},
            True,
        ),
        (
            "7bf92f3577b34da6a3ce929d0e0e4702",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}]},
            False,
        ),
        (
            "7bf92f3577b34da6a3ce929d0e0e4703",
            "/v2/models/smollm2/generate_stream",
            {"text_input": "Once upon a time"},
            True,
        ),
    ],
)
def test_completion_spans_end_at_the_last_event(
    traced: RunningServer,
    receiver: Receiver,
    trace_id: str,
    path: str,
    body: dict[str, object],
    streamed: bool,
) -> None:
    from lockgate.demo.smollm2 import SERVED_NAME

    headers = {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01", "x-request-id": "llm-traced"}
    if path.startswith("/v1/"):
        body = {**body, "model": SERVED_NAME, "max_tokens": 6, "temperature": 0}
    else:
        body = {**body, "parameters": {"max_tokens": 6, "temperature": 0}}
    with httpx.stream("POST", traced.url + path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    events = [line for line in text.splitlines() if line.startswith("data: {")]
    assert (len(events) > 1) == streamed
    spans = receiver.of_trace(trace_id, 1 + len(LLM_PHASES))
    route = path.replace("/smollm2/", "/{model}/")
    (root,) = [s for _, s in spans if s.name == "POST " + route]
    assert root.parent_span_id.hex() == CALLER_SPAN and root.kind == Span.SPAN_KIND_SERVER
    children = children_of(root, spans)
    assert [s.name for s in children] == LLM_PHASES
    generate, respond = children[2], children[3]
    # the request's span ends with its answer: after the last token, when the last event left
    assert respond.start_time_unix_nano == generate.end_time_unix_nano
    assert respond.end_time_unix_nano == root.end_time_unix_nano
    attributes = attributes_of(root)
    assert attributes["lockgate.request_id"] == "llm-traced"
    # the name the route was asked for: the served name on /v1, the repository's on /v2
    assert attributes["lockgate.model"] == (SERVED_NAME if path.startswith("/v1/") else "smollm2")
    assert attributes["http.response.status_code"] == 200
    tokens = attributes["gen_ai.usage.output_tokens"]
    assert isinstance(tokens, int) and 1 <= tokens <= 6
    assert attributes["gen_ai.usage.input_tokens"] > 0  # type: ignore[operator]
    (first,) = [e for e in root.events if e.name == "first_token"]
    assert generate.start_time_unix_nano <= first.time_unix_nano <= generate.end_time_unix_nano
    ttft = attributes["lockgate.ttft_s"]
    assert ttft == pytest.approx((first.time_unix_nano - root.start_time_unix_nano) / 1e9, abs=1e-5)


def test_embeddings_spans(traced: RunningServer, receiver: Receiver) -> None:
    trace_id = "8bf92f3577b34da6a3ce929d0e0e4740"
    headers = {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"}
    body = {"model": "minilm", "input": ["a traced sentence", "and another"]}
    answer = httpx.post(traced.url + "/v1/embeddings", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"]) == 2
    spans = receiver.of_trace(trace_id, 1 + len(PHASES))
    (root,) = [s for _, s in spans if s.name == "POST /v1/embeddings"]
    assert root.parent_span_id.hex() == CALLER_SPAN
    assert attributes_of(root)["lockgate.model"] == "minilm"
    assert [s.name for s in children_of(root, spans)] == PHASES


def test_untraced_routes_make_no_span(traced: RunningServer, receiver: Receiver) -> None:
    trace_id = "9bf92f3577b34da6a3ce929d0e0e4741"
    headers = {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"}
    assert httpx.get(traced.url + "/v1/models", headers=headers).status_code == 200
    assert httpx.get(traced.url + "/v2/health/ready", headers=headers).status_code == 200
    marker = "abf92f3577b34da6a3ce929d0e0e4742"  # a traced request after them, seen arriving
    headers = {"traceparent": f"00-{marker}-{CALLER_SPAN}-01"}
    assert httpx.post(traced.url + "/v2/models/echo/infer", json=BODY, headers=headers).is_success
    receiver.of_trace(marker, 1 + len(PHASES))
    with receiver.lock:
        assert not [s for _, s in receiver.spans if s.trace_id.hex() == trace_id]


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
