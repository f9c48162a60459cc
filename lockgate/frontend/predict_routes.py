"""KServe v1's and TensorFlow Serving's routes (`protocol/predict.py`):
- `POST /v1/models/{m}[/versions/{v}]:predict`, served by the same inference path as KServe
  v2: admission, batching, the response cache and fallbacks;
- `GET /v1/models/{m}[/versions/{v}]`, the model's status, for a model of the repository that
  is not a language model (the OpenAI API answers that path for those).
"""

from __future__ import annotations

from lockgate.errors import ServingError
from lockgate.frontend.http import (
    JSON,
    HttpRequest,
    cancel_on_disconnect,
    check_method,
    respond,
    respond_json,
)
from lockgate.frontend.v2_service import Deadline, V2Service, timeout_header
from lockgate.protocol import predict
from lockgate.protocol.v2_codec import V2InferRequest

SUFFIX = ":predict"


def predict_target(parts: list[str]) -> tuple[str, str | None] | None:
    """The model and version a path's parts name for predict, or None for another path."""
    if len(parts) not in (3, 5) or parts[:2] != ["v1", "models"] or not parts[-1].endswith(SUFFIX):
        return None
    if len(parts) == 3:
        return parts[2].removesuffix(SUFFIX), None
    if parts[3] != "versions":
        return None
    return parts[2], parts[4].removesuffix(SUFFIX)


def status_target(method: str, parts: list[str]) -> tuple[str, str | None] | None:
    """The model and version a status request names (`GET /v1/models/{m}[/versions/{v}]`),
    or None for another request."""
    if method != "GET" or parts[:2] != ["v1", "models"]:
        return None
    if len(parts) == 3:
        return parts[2], None
    if len(parts) == 5 and parts[3] == "versions":
        return parts[2], parts[4]
    return None


async def status_route(
    request: HttpRequest, service: V2Service, name: str, version_text: str | None
) -> None:
    """A model's status, 200 whether or not it is ready (KServe's `ready` says), 404 for a
    model or version the repository does not hold."""
    versions, reason = service.version_states(name, version_text)
    ready = any(v.state == "READY" for v in versions)
    await respond_json(request.send, 200, predict.model_status(name, versions, ready, reason))


async def predict_route(
    request: HttpRequest,
    service: V2Service,
    name: str,
    version_text: str | None,
    priority_granted: bool = True,
) -> None:
    check_method(request.method, request.path, ("POST",))
    served = service.served(name, version_text)  # 404 before the body is read
    body = await request.body()
    try:
        decoded = predict.decode_predict(body, served.config)
    except ServingError as error:
        service.refused(served, error)
        raise
    v2_request = V2InferRequest(
        id="",
        inputs=decoded.inputs,
        input_datatypes={n: decoded.datatypes[n] for n in decoded.inputs},
        parameters={},
        outputs=[],
        binary_default=False,
    )
    timeout = request.header_str(b"request-timeout")
    deadline = Deadline(request.received, header_seconds=timeout_header(timeout))
    async with cancel_on_disconnect(request):
        result = await service.infer(name, served, v2_request, deadline, priority_granted)
    payload = predict.encode_predict(result.outputs, served.config, decoded.columnar)
    await respond(request.send, 200, payload, JSON, result.headers)
