"""KServe v2 / Open Inference Protocol over REST, with Triton's config, statistics and
repository extensions. Each handler turns wire bytes into a core request and back."""

from __future__ import annotations

import time

from lockgate import __version__
from lockgate.core.manager import ModelManager, ServedVersion
from lockgate.core.request import InferRequest
from lockgate.core.validate import validate_inputs, validate_outputs
from lockgate.errors import BadRequest, Forbidden, NotFound
from lockgate.frontend.http import HttpRequest, cancel_on_disconnect, respond, respond_json
from lockgate.protocol import v2
from lockgate.protocol.v2 import Duration, ModelStats

EXTENSIONS = (
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "statistics",
    "model_repository",
    "schedule_policy",
)
SERVER_METADATA = v2.server_metadata(name="lockgate", version=__version__, extensions=EXTENSIONS)


def parse_version(text: str | None) -> int | None:
    if text is None or text == "":
        return None
    if not text.isdigit() or len(text) > 18:
        raise NotFound(f"unknown version '{text[:40]}'")
    return int(text)


def deadline_of(
    request: HttpRequest, parameters: dict[str, object], served: ServedVersion
) -> float | None:
    """Deadline from the `timeout` parameter (µs), a Request-Timeout header (s), or the model,
    counted from the request's arrival: time spent reading and parsing it counts."""
    now = request.received
    timeout_us = timeout_parameter(parameters)
    if timeout_us is not None:
        return now + timeout_us / 1e6
    header = request.header(b"request-timeout")
    if header is not None:
        try:
            seconds = float(header)
        except ValueError:
            raise BadRequest("Request-Timeout header must be a number of seconds") from None
        if not 0 < seconds < 1e7:
            raise BadRequest("Request-Timeout header must be a positive number of seconds")
        return now + seconds
    default_us = served.config.batcher.default_timeout_us
    return now + default_us / 1e6 if default_us > 0 else None


MAX_TIMEOUT_US = 10**13  # about 116 days: any longer is a client mistake


def timeout_parameter(parameters: dict[str, object]) -> int | None:
    """The `timeout` parameter in µs: None when absent or not positive; 400 when absurd."""
    timeout_us = parameters.get("timeout")
    if not isinstance(timeout_us, int) or isinstance(timeout_us, bool) or timeout_us <= 0:
        return None
    if timeout_us > MAX_TIMEOUT_US:
        raise BadRequest(f"parameter 'timeout' must be at most {MAX_TIMEOUT_US} µs")
    return timeout_us


def priority_of(parameters: dict[str, object]) -> int:
    priority = parameters.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
        raise BadRequest("parameter 'priority' must be a non-negative integer")
    return priority


def core_request(
    name: str,
    served: ServedVersion,
    decoded: v2.V2InferRequest,
    deadline: float | None,
    arrival: float | None = None,
    priority_granted: bool = True,
) -> InferRequest:
    """A decoded v2 request (REST or gRPC), checked against the model's config. A priority
    above the model's default needs `priority_granted` (a key that grants it)."""
    rows = validate_inputs(served.config, decoded.inputs, decoded.input_datatypes)
    priority = priority_of(decoded.parameters)
    if priority and not priority_granted:
        batching = served.config.batcher
        default = batching.default_priority_level or max(1, batching.priority_levels)
        if priority < default:
            raise Forbidden(
                f"priority {priority} is above the model's default ({default}): "
                "it needs a key that grants it"
            )
    if decoded.outputs:
        validate_outputs(served.config, [o.name for o in decoded.outputs])
    return InferRequest(
        model=name,
        inputs=decoded.inputs,
        version=served.version,
        outputs=tuple(o.name for o in decoded.outputs) or None,
        deadline=deadline,
        priority=priority,
        id=decoded.id,
        rows=rows,
        arrival=time.monotonic() if arrival is None else arrival,
    )


async def infer(
    request: HttpRequest,
    models: ModelManager,
    name: str,
    version_text: str | None,
    priority_granted: bool = True,
) -> None:
    served = models.get(name, parse_version(version_text))
    body = await request.body()
    decoded = v2.decode_infer_request(body, request.header_str(b"inference-header-content-length"))
    config = served.config
    deadline = deadline_of(request, decoded.parameters, served)
    core = core_request(name, served, decoded, deadline, request.received, priority_granted)
    async with cancel_on_disconnect(request.receive):
        outputs = await models.infer(core)
    payload, header_length = v2.encode_infer_response(
        model_name=name,
        model_version=str(served.version),
        request_id=decoded.id,
        outputs=outputs,
        requested=decoded.outputs or None,
        binary_default=decoded.binary_default,
        datatypes={s.name: s.datatype for s in config.outputs},
    )
    if header_length is None:
        await respond(request.send, 200, payload)
        return
    headers = [(b"inference-header-content-length", str(header_length).encode())]
    await respond(request.send, 200, payload, b"application/octet-stream", headers)


async def model_metadata(models: ModelManager, name: str, version_text: str | None) -> bytes:
    served = models.get(name, parse_version(version_text))
    model = models.models[name]
    versions = [v for v, s in model.versions.items() if s.state.name == "READY"]
    return v2.model_metadata(served.config, sorted(versions) or [served.version])


def model_ready(
    models: ModelManager, name: str, version_text: str | None
) -> tuple[int, dict[str, object]]:
    """200 when ready; otherwise 503 with the reason (404 for an unknown model)."""
    model = models.models.get(name)
    if model is None:
        raise NotFound(f"unknown model '{name}'")
    version = parse_version(version_text)
    try:
        models.get(name, version)
    except NotFound:
        raise
    except Exception as exc:
        return 503, {"name": name, "ready": False, "error": str(exc)}
    return 200, {"name": name, "ready": True}


def statistics(models: ModelManager, name: str | None, version_text: str | None) -> bytes:
    version = parse_version(version_text)
    if name is not None and name not in models.models:
        raise NotFound(f"unknown model '{name}'")
    stats = [
        _stats_of(models, served)
        for model in models.models.values()
        if name is None or model.name == name
        for served in model.versions.values()
        if version is None or served.version == version
    ]
    return v2.model_statistics_json(stats)


def _duration(count: int, seconds: float) -> Duration:
    return Duration(count=count, ns=int(seconds * 1e9))


def _stats_of(models: ModelManager, served: ServedVersion) -> ModelStats:
    m = models.metrics
    labels = (served.config.name, str(served.version))
    batcher = served.batcher
    e2e = m.request_latency.labels(labels)
    queue = m.queue_latency.labels(labels)
    compute = m.compute_latency.labels(labels)
    batch = m.batch_size.labels(labels)
    failures = sum(v for k, v in m.requests.values.items() if k[:2] == labels and k[2] != "success")
    return ModelStats(
        name=served.config.name,
        version=str(served.version),
        last_inference_ms=served.last_inference_ms,
        inference_count=int(batch.sum),
        execution_count=batch.count,
        success=_duration(e2e.count, e2e.sum),
        fail=_duration(int(failures), 0.0),
        queue=_duration(queue.count, queue.sum),
        compute_input=_duration(compute.count, batcher.input_seconds if batcher else 0.0),
        compute_infer=_duration(compute.count, compute.sum),
        compute_output=_duration(compute.count, batcher.output_seconds if batcher else 0.0),
        batch_stats=[],
    )


async def repository_index(request: HttpRequest, models: ModelManager) -> None:
    index = [
        {
            "name": model.name,
            "version": str(version),
            "state": served.state.value,
            "reason": served.error,
        }
        for model in models.models.values()
        for version, served in sorted(model.versions.items())
    ]
    index += [
        {"name": m.name, "version": "", "state": "UNAVAILABLE", "reason": m.error}
        for m in models.models.values()
        if not m.versions
    ]
    await respond_json(request.send, 200, index)
