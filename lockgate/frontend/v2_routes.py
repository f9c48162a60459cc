"""KServe v2 over REST: the HTTP adapter of `frontend/v2_service.py`. Each handler decodes
the wire, calls the service once, and encodes what it returns."""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import asdict
from typing import TYPE_CHECKING

from lockgate.core.manager import ServedVersion
from lockgate.errors import Forbidden, NotFound, ServingError
from lockgate.frontend.http import (
    JSON,
    HttpRequest,
    Reply,
    cancel_on_disconnect,
    check_method,
    respond,
    respond_json,
    respond_reply,
)
from lockgate.frontend.v2_service import SERVER_METADATA, Deadline, V2Service, timeout_header
from lockgate.protocol import v2_codec, v2_metadata
from lockgate.protocol.log_settings import decode_settings
from lockgate.protocol.shared_memory import SharedMemory, decode_register
from lockgate.protocol.trace_settings import json_change, json_document

if TYPE_CHECKING:
    from lockgate.frontend.otel import RequestTrace

SERVER_METADATA_JSON = v2_metadata.encode(SERVER_METADATA)


async def infer(
    request: HttpRequest,
    service: V2Service,
    name: str,
    version_text: str | None,
    priority_granted: bool = True,
) -> None:
    served = service.served(name, version_text)  # 404 before the body is read
    service.check_coupled(served)  # and 400 for a model that answers only on a stream
    body = await request.body()
    async with cancel_on_disconnect(request):
        reply = await infer_reply(
            service,
            served,
            name,
            body,
            request.header(b"inference-header-content-length"),
            request.header(b"request-timeout"),
            request.received,
            priority_granted,
            request.trace,
        )
    await respond_reply(request.send, reply)


async def infer_reply(
    service: V2Service,
    served: ServedVersion,
    name: str,
    body: bytes,
    header_length: bytes | None,
    timeout: bytes | None,
    received: float,
    priority_granted: bool = True,
    traced: RequestTrace | None = None,
) -> Reply:
    """Decode, run and encode one v2 inference request whose body is in: the answer of both
    the ASGI route above and the protocol's lane (`frontend/lane.py`). `header_length` and
    `timeout` are the raw `Inference-Header-Content-Length` and `Request-Timeout` headers."""
    try:
        decoded = v2_codec.decode_infer_request(
            body,
            None if header_length is None else header_length.decode("latin-1"),
            check=functools.partial(service.check_declared, served),  # before data is decoded
            shared_memory=service.shared_memory,
        )
    except ServingError as error:
        service.refused(served, error)
        raise
    seconds = timeout_header(None if timeout is None else timeout.decode("latin-1"))
    deadline = Deadline(received, header_seconds=seconds)
    trace_id = traced.trace_id if traced else ""
    result = await service.infer(name, served, decoded, deadline, priority_granted, trace_id)
    if traced is not None and result.request is not None:
        traced.requests.append(result.request)
    payload, json_length = v2_codec.encode_infer_response(
        model_name=name,
        model_version=str(result.served.version),
        request_id=decoded.id,
        outputs=result.outputs,
        requested=decoded.outputs or None,
        binary_default=decoded.binary_default,
        batched=result.batched,
        datatypes=result.output_datatypes,
        parameters=result.parameters,
        shared_memory=service.shared_memory,
        labels=result.output_labels,
    )
    if json_length is None:
        return Reply(200, payload, JSON, result.headers)
    headers = [(b"inference-header-content-length", b"%d" % json_length), *result.headers]
    return Reply(200, payload, b"application/octet-stream", headers)


async def model_ready(
    request: HttpRequest, service: V2Service, name: str, version_text: str | None
) -> None:
    """200 when ready; otherwise 503 with the reason (404 for an unknown model)."""
    reason = service.model_ready(name, version_text)
    if reason is None:
        await respond_json(request.send, 200, {"name": name, "ready": True})
    else:
        await respond_json(request.send, 503, {"name": name, "ready": False, "error": reason})


async def document(request: HttpRequest, doc: v2_metadata.Document) -> None:
    await respond(request.send, 200, v2_metadata.encode(doc))


async def repository_index(request: HttpRequest, service: V2Service) -> None:
    index = [asdict(entry) for entry in service.repository_index()]
    await respond_json(request.send, 200, index)


async def shared_memory(request: HttpRequest, regions: SharedMemory, rest: list[str]) -> None:
    """Triton's system shared memory routes, under /v2/systemsharedmemory: `status`,
    `unregister`, and `region/{name}/` + `status`, `register`, `unregister`."""
    name: str | None = None
    if len(rest) == 3 and rest[0] == "region":
        name, rest = rest[1], rest[2:]
    action = rest[0] if len(rest) == 1 else ""
    if action == "status":
        check_method(request.method, request.path, ("GET", "HEAD"))
        await respond_json(request.send, 200, regions.status(name))
        return
    if action not in ("register", "unregister") or (action == "register" and name is None):
        raise NotFound(f"no route for {request.method} {request.path[:200]}")
    check_method(request.method, request.path, ("POST",))
    _on_this_host(request)
    if action == "unregister":
        regions.unregister(name)
    else:
        assert name is not None
        ask = decode_register(await request.body())
        regions.register(name, ask.key, ask.offset, ask.byte_size)
    await respond_json(request.send, 200, {})


def _on_this_host(request: HttpRequest) -> None:
    """Regions are registered by clients on this host only: a remote one cannot share its
    memory, and must not map this host's."""
    client = request.scope.get("client")
    host = client[0] if client else ""
    try:
        local = not host or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if not local:
        raise Forbidden("system shared memory is for clients on this host")


SETTINGS_METHODS = ("GET", "HEAD", "POST")  # GET reads the settings, POST changes them


async def log_settings(request: HttpRequest, service: V2Service) -> None:
    """Triton's logging extension: GET or POST /v2/logging."""
    check_method(request.method, request.path, SETTINGS_METHODS)
    change = decode_settings(await request.body()) if request.method == "POST" else {}
    await respond_json(request.send, 200, service.log_settings(change).document())


async def trace_settings(request: HttpRequest, service: V2Service, model: str = "") -> None:
    """Triton's trace extension: GET or POST /v2/trace/setting and
    /v2/models/{model}/trace/setting."""
    check_method(request.method, request.path, SETTINGS_METHODS)
    change: dict[str, list[str] | None] = {}
    if request.method == "POST":
        change = json_change(decode_settings(await request.body()))
    document = service.trace_settings(model, change)
    await respond_json(request.send, 200, json_document(document))
