"""KServe v2 over REST: the HTTP adapter of `frontend/v2_service.py`. Each handler decodes
the wire, calls the service once, and encodes what it returns."""

from __future__ import annotations

import functools
from dataclasses import asdict

from lockgate.frontend.http import HttpRequest, cancel_on_disconnect, respond, respond_json
from lockgate.frontend.v2_service import SERVER_METADATA, Deadline, V2Service, timeout_header
from lockgate.protocol import v2_codec, v2_metadata

SERVER_METADATA_JSON = v2_metadata.encode(SERVER_METADATA)


async def infer(
    request: HttpRequest,
    service: V2Service,
    name: str,
    version_text: str | None,
    priority_granted: bool = True,
) -> None:
    served = service.served(name, version_text)  # 404 before the body is read
    body = await request.body()
    decoded = v2_codec.decode_infer_request(
        body,
        request.header_str(b"inference-header-content-length"),
        check=functools.partial(service.check_declared, served),  # before any data is decoded
    )
    deadline = Deadline(
        request.received, header_seconds=timeout_header(request.header_str(b"request-timeout"))
    )
    traced = request.trace
    async with cancel_on_disconnect(request):
        result = await service.infer(
            name, served, decoded, deadline, priority_granted, traced.trace_id if traced else ""
        )
    if traced is not None and result.request is not None:
        traced.requests.append(result.request)
    payload, header_length = v2_codec.encode_infer_response(
        model_name=name,
        model_version=str(result.served.version),
        request_id=decoded.id,
        outputs=result.outputs,
        requested=decoded.outputs or None,
        binary_default=decoded.binary_default,
        datatypes=result.output_datatypes,
        parameters=result.parameters,
    )
    if header_length is None:
        await respond(request.send, 200, payload, headers=result.headers)
        return
    headers = [(b"inference-header-content-length", str(header_length).encode())]
    await respond(request.send, 200, payload, b"application/octet-stream", headers + result.headers)


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
