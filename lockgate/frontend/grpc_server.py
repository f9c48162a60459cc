"""KServe v2 / Open Inference Protocol over gRPC, Triton's port 8001, beside the HTTP server.

The gRPC server (grpc.aio) runs on the event loop of the HTTP server (uvicorn on uvloop)
and shares its `App`: the same model manager, batchers, admission, metrics, API keys and
drain. A request reaches the batcher exactly as a REST one does; only the codec differs.

- Deadlines: the client's gRPC deadline and the `timeout` parameter (µs), whichever is
  sooner, become the request's deadline; the model's default timeout applies otherwise.
- Errors leave as gRPC status codes with the ServingError's message (see `STATUS_CODES`).
- A cancelled RPC (the client went away, or its deadline passed) cancels the handler,
  which removes the request from its queue, as a disconnect does on the REST path.
- ModelStreamInfer answers the requests of a stream concurrently, in completion order;
  the error of one request is a message on the stream, not the end of it. At most
  `max_stream_inflight` requests of one stream are read and not yet answered to the client:
  past that the server stops reading the stream (HTTP/2 flow control then holds the
  client's writes), so a client that writes and never reads costs bounded memory.
- A decoupled model's request is answered on the stream by each response it sends, with the
  request's id and, as in Triton, the parameter `triton_final_response` (true on the last);
  the final flag sent alone is a message only when the request asked for it
  (`triton_enable_empty_final_response`). At most `max_stream_inflight` such responses of a
  stream wait to be written; past that the request waits, and then the model's senders do.
  ModelInfer refuses a decoupled model, as Triton does.
- A language model takes and gives the tensors of Triton's vLLM backend (`frontend/llm_infer.py`):
  on the stream, a request with `stream` true is answered by a response per piece of text,
  as a decoupled model's; ModelInfer answers one with `stream` false with the whole text,
  with the trailing metadata `x-lockgate-model-kind: language` (the REST answer's header),
  by which a router knows never to hedge nor retry it once sent.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from grpc.aio import ServicerContext as Context

try:  # what grpcio raises on a write to a call the client has left
    from grpc._cython.cygrpc import ExecuteBatchError as _Gone
except ImportError:  # another grpcio: such a write raises its own error, and is logged
    _Gone = ConnectionError  # type: ignore[misc,assignment]

from lockgate.backends.response_stream import StreamedResponse
from lockgate.core.manager import ModelManager, ServedVersion
from lockgate.errors import Forbidden, NotFound, ServingError, Unauthorized
from lockgate.frontend.app import App
from lockgate.frontend.grpc_health import add_health_service
from lockgate.frontend.v2_service import (
    SERVER_METADATA,
    Deadline,
    declared_config,
    is_language_model,
)
from lockgate.protocol.grpc import codec
from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.protocol.grpc import inference_pb2_grpc as pb_grpc
from lockgate.protocol.grpc.status import STATUS_CODES, cancelled_code
from lockgate.protocol.llm_tensors import LANGUAGE_KIND, MODEL_KIND_HEADER
from lockgate.protocol.repository_control import load_request, unload_request
from lockgate.protocol.v2_codec import V2InferRequest

if TYPE_CHECKING:
    from lockgate.frontend.otel import RequestTrace

log = logging.getLogger("lockgate.grpc")

T = TypeVar("T")

PUBLIC_METHODS = frozenset({"ServerLive", "ServerReady"})  # as the REST health routes
MODEL_CONTROL_METHODS = frozenset({"RepositoryModelLoad", "RepositoryModelUnload"})
SETTINGS_METHODS = frozenset({"LogSettings", "TraceSetting"})  # keys by what they ask
FINAL_RESPONSE = "triton_final_response"  # on a decoupled model's responses: the last?
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"  # a request's: send it alone
_CONTROL_PATH = "/v2/repository/models/-/load"  # a model control route, for its keys
# the codes that mark a traced request's span as an error (as 5xx on HTTP)
ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.DATA_LOSS,
    }
)


@dataclass(frozen=True, slots=True)
class GrpcSettings:
    host: str = "127.0.0.1"
    port: int = 8001
    max_receive_bytes: int = 64 * 1024 * 1024  # a larger request gets RESOURCE_EXHAUSTED
    max_concurrent_rpcs: int | None = 1024  # RPCs beyond this get RESOURCE_EXHAUSTED at once
    required: bool = False  # True: a port that cannot be bound stops start-up
    max_stream_inflight: int = 64  # requests of one stream read and not yet answered
    reuse_port: bool = False  # True: share the port with other processes (SO_REUSEPORT)


def status_code(error: ServingError) -> grpc.StatusCode:
    return STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL)


# The status message travels in a trailer, percent-encoded, and a client drops a trailer over
# its metadata limit (8 KiB by default): past that the client would see RESOURCE_EXHAUSTED
# instead of the status, so a message that echoes a long name from the request is cut.
MAX_STATUS_MESSAGE_CHARS = 1024
_LANGUAGE_KIND = ((MODEL_KIND_HEADER.decode(), LANGUAGE_KIND.decode()),)  # trailing metadata


def status_message(message: str) -> str:
    if len(message) <= MAX_STATUS_MESSAGE_CHARS:
        return message
    cut = len(message) - MAX_STATUS_MESSAGE_CHARS
    return f"{message[:MAX_STATUS_MESSAGE_CHARS]}... ({cut} more characters)"


async def _abort(
    context: Context, code: grpc.StatusCode, message: str, retry: str = ""
) -> NoReturn:
    trailing = (("retry-after", retry),) if retry else ()
    await context.abort(code, status_message(message), trailing)
    raise AssertionError("grpc.aio's abort always raises")


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The GRPCInferenceService methods, answered from the App's model manager."""

    def __init__(self, app: App, max_stream_inflight: int = 64) -> None:
        self.app = app
        self.models: ModelManager = app.models
        self.v2 = app.v2
        self.max_stream_inflight = max_stream_inflight
        self.latency = app.models.registry.histogram(
            "lockgate_grpc_request_duration_seconds",
            "Time from a gRPC request's arrival to its answer, by method and status code.",
            ("method", "code"),
        )

    # -- health and metadata -----------------------------------------------------------
    async def ServerLive(self, request: Any, context: Context) -> pb.ServerLiveResponse:
        return await self._run("ServerLive", context, self._live)

    async def ServerReady(self, request: Any, context: Context) -> pb.ServerReadyResponse:
        return await self._run("ServerReady", context, self._ready)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Context
    ) -> pb.ModelReadyResponse:
        return await self._run("ModelReady", context, lambda: self._model_ready(request))

    async def ServerMetadata(self, request: Any, context: Context) -> pb.ServerMetadataResponse:
        return await self._run("ServerMetadata", context, self._server_metadata)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        return await self._run("ModelMetadata", context, lambda: self._model_metadata(request))

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Context
    ) -> pb.ModelConfigResponse:
        return await self._run("ModelConfig", context, lambda: self._model_config(request))

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        return await self._run("ModelStatistics", context, lambda: self._statistics(request))

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        return await self._run("RepositoryIndex", context, lambda: self._index(request))

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        return await self._run("RepositoryModelLoad", context, lambda: self._load(request))

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        return await self._run("RepositoryModelUnload", context, lambda: self._unload(request))

    # -- system shared memory ----------------------------------------------------------
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        async def status() -> pb.SystemSharedMemoryStatusResponse:
            response = pb.SystemSharedMemoryStatusResponse()
            for region in self.v2.shared_memory.status(request.name or None):
                entry = response.regions[region["name"]]
                entry.name, entry.key = region["name"], region["key"]
                entry.offset, entry.byte_size = region["offset"], region["byte_size"]
            return response

        return await self._run("SystemSharedMemoryStatus", context, status)

    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        async def register() -> pb.SystemSharedMemoryRegisterResponse:
            _on_this_host(context)
            regions = self.v2.shared_memory
            regions.register(request.name, request.key, request.offset, request.byte_size)
            return pb.SystemSharedMemoryRegisterResponse()

        return await self._run("SystemSharedMemoryRegister", context, register)

    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        async def unregister() -> pb.SystemSharedMemoryUnregisterResponse:
            _on_this_host(context)
            self.v2.shared_memory.unregister(request.name or None)
            return pb.SystemSharedMemoryUnregisterResponse()

        return await self._run("SystemSharedMemoryUnregister", context, unregister)

    # -- Triton's logging and trace extensions -------------------------------------------
    async def LogSettings(
        self, request: pb.LogSettingsRequest, context: Context
    ) -> pb.LogSettingsResponse:
        async def settings() -> pb.LogSettingsResponse:
            self._authenticate_settings("/v2/logging", bool(request.settings), context)
            change = codec.log_change(request)
            return codec.encode_log_settings(self.v2.log_settings(change))

        return await self._run("LogSettings", context, settings)

    async def TraceSetting(
        self, request: pb.TraceSettingRequest, context: Context
    ) -> pb.TraceSettingResponse:
        async def settings() -> pb.TraceSettingResponse:
            self._authenticate_settings("/v2/trace/setting", bool(request.settings), context)
            change = codec.trace_change(request)
            document = self.v2.trace_settings(request.model_name, change)
            return codec.encode_trace_settings(document)

        return await self._run("TraceSetting", context, settings)

    async def _load(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        self.app.check_model_control(request.model_name)
        await self.app.load(request.model_name, load_request(_parameters(request.parameters)))
        return pb.RepositoryModelLoadResponse()

    async def _unload(
        self, request: pb.RepositoryModelUnloadRequest
    ) -> pb.RepositoryModelUnloadResponse:
        self.app.check_model_control(request.model_name)
        await self.app.unload(request.model_name, unload_request(_parameters(request.parameters)))
        return pb.RepositoryModelUnloadResponse()

    async def _live(self) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def _ready(self) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.app.not_ready() is None)

    async def _model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        # as Triton's: an unknown model or version is not ready, not an error (REST says 404)
        try:
            reason = self.v2.model_ready(request.name, request.version or None)
        except NotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=reason is None)

    async def _server_metadata(self) -> pb.ServerMetadataResponse:
        return codec.from_document(SERVER_METADATA, pb.ServerMetadataResponse())

    async def _model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        document = self.v2.model_metadata(request.name, request.version)
        return codec.from_document(document, pb.ModelMetadataResponse())

    async def _model_config(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        document = self.v2.model_config(request.name, request.version)
        return pb.ModelConfigResponse(config=codec.from_document(document, pb.ModelConfig()))

    async def _statistics(self, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        document = self.v2.statistics(request.name or None, request.version)
        return codec.from_document(document, pb.ModelStatisticsResponse())

    async def _index(self, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
        response = pb.RepositoryIndexResponse()
        for entry in self.v2.repository_index(ready_only=request.ready):
            response.models.add(
                name=entry.name, version=entry.version, state=entry.state, reason=entry.reason
            )
        return response

    # -- inference ---------------------------------------------------------------------
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: Context
    ) -> pb.ModelInferResponse:
        traced = self._trace("ModelInfer", request, context)
        return await self._run(
            "ModelInfer", context, lambda: self._infer(request, context, traced), traced
        )

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> None:
        try:
            self._authenticate("ModelStreamInfer", context)
        except ServingError as exc:
            await _abort(context, status_code(exc), exc.message)
        stream = _Stream(self, context)
        reader = asyncio.get_running_loop().create_task(stream.read(requests))
        try:
            while (answer := await stream.answers.get()) is not None:
                try:
                    await context.write(answer.message)  # once the client can take it
                except _Gone:
                    log.debug("ModelStreamInfer: the client went away during a write")
                    return
                stream.written(answer)
        finally:
            reader.cancel()
            stream.cancel()

    async def _infer(
        self, request: pb.ModelInferRequest, context: Context, traced: RequestTrace | None
    ) -> pb.ModelInferResponse:
        received = traced.received if traced is not None else time.monotonic()
        name = request.model_name
        served = self.v2.served(name, request.model_version)
        if is_language_model(served.config):  # a router never sends it twice
            context.set_trailing_metadata(_LANGUAGE_KIND)
        decoded = self._decode(request, served)
        deadline = Deadline(received, transport_seconds=context.time_remaining())
        granted = self.app.priority_granted(_bearer(context))
        trace_id = traced.trace_id if traced is not None else ""
        result = await self.v2.infer(
            name, served, decoded, deadline, granted, trace_id, endpoint="ModelInfer RPC"
        )
        if traced is not None and result.request is not None:
            traced.requests.append(result.request)
        return codec.encode_infer_response(
            model_name=name,
            model_version=str(result.served.version),
            request_id=decoded.id,
            outputs=result.outputs,
            requested=decoded.outputs,
            datatypes=result.output_datatypes,
            batched=result.batched,
            parameters=result.parameters,
            shared_memory=self.v2.shared_memory,
            labels=result.output_labels,
        )

    def _decode(self, request: pb.ModelInferRequest, served: ServedVersion) -> V2InferRequest:
        check = functools.partial(self.v2.check_declared, served)  # before any data is decoded
        try:
            return codec.decode_infer_request(
                request, check=check, shared_memory=self.v2.shared_memory
            )
        except ServingError as error:
            self.v2.refused(served, error)
            raise

    def _encode(
        self,
        served: ServedVersion,
        decoded: V2InferRequest,
        response: StreamedResponse,
        request: pb.ModelInferRequest,
    ) -> pb.ModelStreamInferResponse:
        """One response of a decoupled model as a stream message, marked final or not."""
        if response.error is not None:
            return _stream_error(request, response.error.message, response.final)
        if response.outputs is None:  # the final flag alone, named as the request named it
            message = pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id
            )
            message.parameters[FINAL_RESPONSE].bool_param = True
            return pb.ModelStreamInferResponse(infer_response=message)
        outputs = response.outputs
        config = declared_config(served.config)
        encoded = codec.encode_infer_response(
            model_name=request.model_name,
            model_version=str(served.version),
            request_id=decoded.id,
            outputs=outputs,
            requested=[o for o in decoded.outputs if o.name in outputs],
            datatypes={s.name: s.datatype for s in config.outputs},
            batched=config.batching,
            parameters={FINAL_RESPONSE: response.final},
            shared_memory=self.v2.shared_memory,
            labels=served.labels,
        )
        return pb.ModelStreamInferResponse(infer_response=encoded)

    def _trace(
        self, method: str, request: pb.ModelInferRequest, context: Context
    ) -> RequestTrace | None:
        """The trace of an inference request arriving now, when tracing is on."""
        tracing = self.app.tracing
        if tracing is None:
            return None
        metadata = context.invocation_metadata() or ()
        at = time.monotonic()
        return tracing.start_rpc(metadata, method, request.model_name, request.id, at)

    def _end_trace(self, traced: RequestTrace | None, code: grpc.StatusCode) -> str:
        """End a traced request's span, answered with `code`; its trace id ("": none)."""
        if traced is None or self.app.tracing is None:
            return ""
        self.app.tracing.finish_rpc(traced, code.value[0], code in ERROR_CODES, time.monotonic())
        return traced.trace_id

    # -- the frame around every method -------------------------------------------------
    async def _run(
        self,
        method: str,
        context: Context,
        handler: Callable[[], Awaitable[T]],
        traced: RequestTrace | None = None,
    ) -> T:
        """Authenticate, run, time (and end the span of a traced request); a ServingError
        leaves as its gRPC status code."""
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            self._authenticate(method, context)
            return await handler()
        except ServingError as exc:
            code = status_code(exc)
            retry = exc.headers().get("retry-after", "")
            await _abort(context, code, exc.message, retry)
        except asyncio.CancelledError:
            code = cancelled_code(context)
            raise
        except Exception as exc:
            log.exception("unhandled error in gRPC %s", method)
            code = grpc.StatusCode.INTERNAL
            await _abort(context, code, f"internal error: {type(exc).__name__}")
        finally:
            elapsed = time.perf_counter() - start
            self.latency.observe((method, code.name), elapsed, self._end_trace(traced, code))

    def _authenticate(self, method: str, context: Context) -> None:
        if method in SETTINGS_METHODS:  # by what the request asks: `_authenticate_settings`
            return
        if method in MODEL_CONTROL_METHODS:  # the admin keys, as for the REST routes
            self.app.authenticate("POST", _CONTROL_PATH, lambda: _bearer(context))
            return
        keys = self.app.settings.api_keys
        if not keys or method in PUBLIC_METHODS:
            return
        presented = _bearer(context)
        if presented is None:
            raise Unauthorized("missing API key: send metadata 'authorization: Bearer <key>'")
        if not any(hmac.compare_digest(presented, k.encode()) for k in keys):
            raise Forbidden("API key not accepted")

    def _authenticate_settings(self, path: str, change: bool, context: Context) -> None:
        """A read of the log or trace settings takes an API key, a change (a request that
        names settings) an admin key, as GET and POST on the REST `path`."""
        self.app.authenticate("POST" if change else "GET", path, lambda: _bearer(context))


@dataclass(frozen=True, slots=True)
class _Answer:
    """A message for the client. `done`: the last of its request, whose slot it frees once
    written; else one of a decoupled model's responses, which frees its room."""

    message: pb.ModelStreamInferResponse
    done: bool = True


class _Stream:
    """The requests of one ModelStreamInfer call, answered concurrently as they finish.

    `answers` carries the messages, then None once the client has closed its side and
    every request has been answered.
    """

    def __init__(self, servicer: InferenceServicer, context: Context) -> None:
        self.servicer = servicer
        self.context = context
        self.answers: asyncio.Queue[_Answer | None] = asyncio.Queue()
        self.pending: set[asyncio.Task[None]] = set()
        # a request holds a slot from being read until its answer is written
        self.slots = asyncio.Semaphore(servicer.max_stream_inflight)
        # a decoupled model's response holds room until written: past that its request waits
        self.room = asyncio.Semaphore(servicer.max_stream_inflight)

    async def read(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for request in requests:
                await self.slots.acquire()  # backpressure: stop reading past the bound
                task = loop.create_task(self.answer(request))
                self.pending.add(task)
                task.add_done_callback(self.pending.discard)
            if self.pending:
                await asyncio.wait(set(self.pending))
        finally:  # the client closed its side, or reading failed: end the stream either way
            self.answers.put_nowait(None)

    def written(self, answer: _Answer) -> None:
        (self.slots if answer.done else self.room).release()

    async def answer(self, request: pb.ModelInferRequest) -> None:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        traced = self.servicer._trace("ModelStreamInfer", request, self.context)
        try:
            served = self.servicer.v2.served(request.model_name, request.model_version)
            if self.servicer.v2.streams(served):  # decoupled, or a language model
                await self.stream(request, served)
                return
            response = await self.servicer._infer(request, self.context, traced)
            self.answers.put_nowait(_Answer(pb.ModelStreamInferResponse(infer_response=response)))
        except ServingError as exc:
            code = status_code(exc)
            self.answers.put_nowait(_Answer(_stream_error(request, exc.message)))
        except Exception as exc:
            log.exception("unhandled error in gRPC ModelStreamInfer")
            code = grpc.StatusCode.INTERNAL
            error = _stream_error(request, f"internal error: {type(exc).__name__}")
            self.answers.put_nowait(_Answer(error))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            elapsed = time.perf_counter() - start
            trace_id = self.servicer._end_trace(traced, code)
            self.servicer.latency.observe(("ModelStreamInfer", code.name), elapsed, trace_id)

    async def stream(self, request: pb.ModelInferRequest, served: ServedVersion) -> None:
        """A decoupled model's responses to `request`, each a message as it comes; the last
        frees the request's slot. An error before the model runs raises (one message)."""
        servicer = self.servicer
        decoded = servicer._decode(request, served)
        empty_final = decoded.parameters.get(EMPTY_FINAL_RESPONSE) is True
        deadline = Deadline(time.monotonic(), transport_seconds=self.context.time_remaining())
        granted = servicer.app.priority_granted(_bearer(self.context))
        responses = servicer.v2.stream(request.model_name, served, decoded, deadline, granted)
        async with aclosing(responses):
            async for response in responses:
                if response.final and response.empty and not empty_final:
                    break  # the final flag alone, not asked for: no message
                message = servicer._encode(served, decoded, response, request)
                if response.final:
                    self.answers.put_nowait(_Answer(message))
                    return
                await self.room.acquire()
                self.answers.put_nowait(_Answer(message, done=False))
        self.slots.release()  # no last message: the request is done

    def cancel(self) -> None:
        for task in list(self.pending):
            task.cancel("stream closed")


def _stream_error(
    request: pb.ModelInferRequest, message: str, final: bool | None = None
) -> pb.ModelStreamInferResponse:
    """A request's error as a stream message; a decoupled model's marked `final` or not."""
    response = pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id
    )
    if final is not None:
        response.parameters[FINAL_RESPONSE].bool_param = final
    return pb.ModelStreamInferResponse(error_message=message, infer_response=response)


def _parameters(parameters: Any) -> dict[str, Any]:
    """A load or unload request's parameters map, as plain values."""
    found: dict[str, Any] = {}
    for key, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        found[key] = getattr(parameter, choice) if choice is not None else None
    return found


def _bearer(context: Context) -> bytes | None:
    for key, value in context.invocation_metadata() or ():
        if key != "authorization":
            continue
        text = value.encode() if isinstance(value, str) else bytes(value)
        scheme, _, token = text.partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            return token.strip()
        return None
    return None


# -- the server --------------------------------------------------------------------------


async def start_grpc(app: App, settings: GrpcSettings) -> grpc.aio.Server | None:
    """Start serving on the running loop. A port that cannot be bound raises OSError when
    `settings.required`, else logs and returns None (the HTTP server serves on)."""
    server = grpc.aio.server(
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", settings.max_receive_bytes),
            ("grpc.max_send_message_length", -1),
            # a second server on the port must fail, not share it, unless asked to share
            ("grpc.so_reuseport", int(settings.reuse_port)),
        ],
    )
    servicer = InferenceServicer(app, settings.max_stream_inflight)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    add_health_service(app, server)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError as exc:
        if settings.required:
            raise OSError(f"cannot serve gRPC on {address}: {exc}") from None
        log.error("gRPC not served: cannot bind %s (%s); see --grpc-port", address, exc)
        return None
    await server.start()
    log.info("lockgate gRPC listening on %s", address)
    return server


def _on_this_host(context: Context) -> None:
    """Shared memory regions are registered by clients on this host only (`frontend/v2_routes`)."""
    peer = context.peer() or ""
    kind, _, address = peer.partition(":")
    host = address.rpartition(":")[0].strip("[]") if kind in ("ipv4", "ipv6") else ""
    try:
        local = kind == "unix" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if not local:
        raise Forbidden("system shared memory is for clients on this host")
