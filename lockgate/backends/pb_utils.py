"""`triton_python_backend_utils`: what Triton's Python backend gives a model's code, on the CPU.

A Triton Python model (`class TritonPythonModel` in `<version>/model.py`) imports this module
as `import triton_python_backend_utils as pb_utils`; lockgate serves it under that name
(`backends/triton_python.py`). It holds the request, response, tensor and error types the
model's `initialize`, `execute` and `finalize` use, the helpers that read its config,
Triton's logger, and the `ModelConfig` that `auto_complete_config` fills, each with Triton's
names and signatures.

Calling other models from `execute` (Triton's business logic scripting:
`InferenceRequest(...).exec()`, or `await ...async_exec()` from an `async def execute`) works
in a model that lockgate runs as a composition (`backends/triton_python.py`): each call goes
through the called model's own batcher, within the calling request's deadline and at its
priority. A request to a decoupled model (`model_transaction_policy { decoupled: true }`)
has a `ResponseSender` (`request.get_response_sender()`) that sends its responses as they
come, from `execute` or from any thread, and `is_cancelled()` once its client has gone. A
request to a default (non-decoupled) model has one too, for its one response (`SentResponse`),
sent before `execute` returns. What
lockgate does not give a Python model is refused by a clear error when used, rather than
faked: decoupled calls to other models (`exec(decoupled=True)`) and tensors on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np

from lockgate.backends.base import InferContext
from lockgate.backends.response_stream import ResponseStream, StreamedResponse
from lockgate.config import DATATYPES
from lockgate.datatypes import Arrays, normalize_datatype, numpy_dtype, serialize_bytes_tensor
from lockgate.errors import ServingError

log = logging.getLogger("lockgate.models.python")

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

_BLS = (
    "this model calls other models, which lockgate allows only in a model it runs as a "
    "composition: one whose model.py builds pb_utils.InferenceRequest(...) itself"
)


@dataclass(frozen=True, slots=True)
class Caller:
    """Where the request being executed came from: the event loop its models run on, and
    its context (deadline, priority) that calls to other models inherit."""

    loop: asyncio.AbstractEventLoop
    ctx: InferContext


CALLER: ContextVar[Caller | None] = ContextVar("triton_python_caller", default=None)


class TritonError(Exception):
    """An error a model puts in a response (`InferenceResponse(error=...)`) or raises."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """Raised by the utilities on misuse, as in Triton."""


class Tensor:
    """A named array. BYTES tensors are object arrays of `bytes`, as in Triton."""

    def __init__(self, name: str, data: Any) -> None:
        if not isinstance(name, str):
            raise TritonModelException(f"a tensor's name must be a string, not {name!r}")
        array = data if isinstance(data, np.ndarray) else np.asarray(data)
        if array.dtype.kind in "US":  # text given as str: Triton's TYPE_STRING holds bytes
            array = np.vectorize(_as_bytes, otypes=[object])(array)
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return numpy_to_triton_type(self._array.dtype.type)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        if self._array.dtype == object:
            raise TritonModelException(f"tensor '{self._name}': BYTES tensors have no DLPack form")
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, dlpack: Any) -> Tensor:
        """A tensor from an object with `__dlpack__` (a torch tensor, a numpy array), or from
        a DLPack capsule (`torch.utils.dlpack.to_dlpack`; read through torch)."""
        if hasattr(dlpack, "__dlpack__"):
            return Tensor(name, np.from_dlpack(dlpack))
        try:
            import torch
        except ImportError:
            raise TritonModelException(
                "Tensor.from_dlpack takes an object with __dlpack__; a bare capsule needs torch"
            ) from None
        return Tensor(name, torch.from_dlpack(dlpack).cpu().numpy())


class InferenceRequest:
    """A request as `execute` receives it: its input tensors and what it asked for."""

    def __init__(
        self,
        model_name: str = "",
        requested_output_names: Sequence[str] = (),
        inputs: Sequence[Tensor] = (),
        request_id: str = "",
        correlation_id: int | str = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: Any = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._model_name = model_name
        self._requested = list(requested_output_names)
        self._inputs = list(inputs)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._responses: _Responses | None = None  # a decoupled model's request: its stream
        self._sent: SentResponse | None = None  # a default model's request: its one response
        if isinstance(parameters, str):
            self._parameters = parameters
        else:
            self._parameters = json.dumps(parameters) if parameters else "{}"

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        """The request's parameters, as a JSON object in a string (Triton's form)."""
        return self._parameters

    def is_cancelled(self) -> bool:
        """Whether the client has gone (its stream was closed or cancelled): responses sent
        now are dropped, and the model may stop working on the request."""
        return self._responses is not None and self._responses.stream.cancelled

    def get_response_sender(self) -> ResponseSender:
        """The sender of this request's responses: a stream of them in a decoupled model, the
        one response in a default model."""
        if self._responses is not None:
            return ResponseSender(self._responses)
        if self._sent is not None:
            return ResponseSender(self._sent)
        raise TritonModelException(
            "get_response_sender() is for a request that execute() received, not one it builds"
        )

    def exec(self, decoupled: bool = False) -> InferenceResponse:
        """Run this request on its model, from a thread executing a request: the answer, or
        a response holding the error (as in Triton, nothing is raised for a model's error)."""
        caller = self._caller(decoupled)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is caller.loop:
            raise TritonModelException(
                "exec() would block the event loop that runs the models: from an async "
                "execute, await request.async_exec()"
            )
        future = asyncio.run_coroutine_threadsafe(self._infer(caller.ctx), caller.loop)
        return future.result()

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse:
        caller = self._caller(decoupled)
        if asyncio.get_running_loop() is not caller.loop:
            future = asyncio.run_coroutine_threadsafe(self._infer(caller.ctx), caller.loop)
            return await asyncio.wrap_future(future)
        return await self._infer(caller.ctx)

    def _caller(self, decoupled: bool) -> Caller:
        if decoupled:
            raise TritonModelException("decoupled calls to other models are not supported")
        caller = CALLER.get()
        if caller is None:
            raise TritonModelException(_BLS)
        if not self._model_name:
            raise TritonModelException("InferenceRequest needs a model_name to be executed")
        return caller

    async def _infer(self, ctx: InferContext) -> InferenceResponse:
        inputs: Arrays = {tensor.name(): tensor.as_numpy() for tensor in self._inputs}
        version = self._model_version if self._model_version > 0 else None
        try:
            outputs = await ctx.infer(self._model_name, inputs, version)
        except ServingError as exc:
            return InferenceResponse(error=TritonError(exc.message, _code_of(exc)))
        wanted = set(self._requested) or set(outputs)
        return InferenceResponse([Tensor(n, a) for n, a in outputs.items() if n in wanted])


class InferenceResponse:
    """What `execute` returns for each request: output tensors, or an error."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or ())
        self._error = error
        self._parameters = parameters

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class _Responses:
    """Where the responses of one request to a decoupled model go: its stream, and how a
    response becomes what the stream carries. Its request and its senders hold it; when the
    last of them is dropped without the final flag, the stream ends there (with a warning),
    so a model that forgets the flag never leaves its client waiting."""

    __slots__ = ("closed", "convert", "model", "stream")

    def __init__(
        self,
        stream: ResponseStream,
        convert: Callable[[InferenceResponse, bool], StreamedResponse],
        model: str,
    ) -> None:
        self.stream = stream
        self.convert = convert
        self.model = model
        self.closed = False  # the model sent the final flag

    def send(self, response: InferenceResponse | None, flags: int) -> None:
        if self.closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        final = _final(response, flags)
        self.closed = final
        streamed = (
            StreamedResponse(final=True) if response is None else self.convert(response, final)
        )
        self.stream.send(streamed)

    @property
    def cancelled(self) -> bool:
        return self.stream.cancelled

    def __del__(self) -> None:
        if not self.closed and not self.stream.ended:
            log.warning(
                "model '%s': a request's response sender was dropped without "
                "TRITONSERVER_RESPONSE_COMPLETE_FINAL; its stream ends here",
                self.model,
            )
            self.stream.end()


def _final(response: InferenceResponse | None, flags: int) -> bool:
    """Whether a sender's `send(response, flags)` is the last; TritonModelException for a
    call no sender takes."""
    final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    if response is None and not final:
        raise TritonModelException(
            "send() needs a response unless flags is TRITONSERVER_RESPONSE_COMPLETE_FINAL"
        )
    if response is not None and not isinstance(response, InferenceResponse):
        kind = type(response).__name__
        raise TritonModelException(f"send() takes an InferenceResponse, not a {kind}")
    return final


def attach_responses(
    request: InferenceRequest,
    stream: ResponseStream,
    convert: Callable[[InferenceResponse, bool], StreamedResponse],
    model: str,
) -> None:
    """Make `request` a decoupled model's: its responses go to `stream`, each converted by
    `convert(response, final)`."""
    request._responses = _Responses(stream, convert, model)


class SentResponse:
    """The one response a request to a default (non-decoupled) model may send through its
    sender instead of `execute` returning it, as Triton allows: one `InferenceResponse` with
    the final flag, or followed by the flag alone, before `execute` returns. A second
    response, or the flag before any response, raises Triton's error in the model."""

    __slots__ = ("final", "response", "returned")

    def __init__(self) -> None:
        self.response: InferenceResponse | None = None
        self.final = False  # the model sent TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.returned = False  # execute() has returned: the request is answered or failed

    @property
    def cancelled(self) -> bool:
        return False  # a default model's client waits for its answer

    def send(self, response: InferenceResponse | None, flags: int) -> None:
        final = _final(response, flags)
        if response is not None and self.response is not None:
            raise TritonModelException("Non-decoupled model cannot send more than one response.")
        if response is None and self.response is None:
            raise TritonModelException(
                "Non-decoupled model cannot send complete final before sending a response."
            )
        if self.final:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        if self.returned:
            raise TritonModelException(
                "Unable to send response: execute() has returned, and a non-decoupled model's "
                "request is answered then; send before returning, or make the model decoupled"
            )
        self.response = response or self.response
        self.final = final


def attach_sent(request: InferenceRequest) -> SentResponse:
    """Give `request`, to a default model, a sender for its one response: what it holds."""
    request._sent = SentResponse()
    return request._sent


class ResponseSender:
    """Triton's response sender: sends a decoupled model's responses for one request, from
    `execute` or from any thread, then the final flag (alone, or with the last response).
    While `max_buffered_responses` wait for a slow client, a send from a thread waits (an
    async `execute` waits at its next `await`); after the client has gone, sends are dropped
    without an error. In a default model it sends the request's one response
    (`SentResponse`)."""

    __slots__ = ("_responses",)

    def __init__(self, responses: _Responses | SentResponse) -> None:
        self._responses = responses

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        self._responses.send(response, flags)

    def is_cancelled(self) -> bool:
        return self._responses.cancelled


class ModelConfig:
    """The config `auto_complete_config(auto_complete_model_config)` receives and returns:
    Triton's JSON form, in which it may set the batch size, dynamic batching, inputs and
    outputs, each checked against what the config already says (ValueError, as in Triton)."""

    _TENSOR_KEYS = frozenset({"name", "data_type", "dims"})

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        doc = json.loads(model_config) if isinstance(model_config, str) else model_config
        doc.setdefault("input", [])
        doc.setdefault("output", [])
        doc.setdefault("max_batch_size", 0)
        self._config: dict[str, Any] = doc

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = self._config["max_batch_size"]
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but "
                f"auto_complete_config of model '{self._config['name']}' set {max_batch_size}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for scheduler in ("sequence_batching", "ensemble_scheduling"):
            if scheduler in self._config:
                raise ValueError(
                    f"configuration specified '{scheduler}', but auto_complete_config of model "
                    f"'{self._config['name']}' set dynamic_batching"
                )
        self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        unknown = set(transaction_policy_dict) - {"decoupled"}
        if unknown:
            raise ValueError(f"model_transaction_policy has no {sorted(unknown)}")
        self._config["model_transaction_policy"] = dict(transaction_policy_dict)

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output)

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        model = self._config.get("name", "")
        name = tensor.get("name")
        extra = set(tensor) - self._TENSOR_KEYS
        if extra:
            raise ValueError(
                f"{kind} '{name}' of model '{model}' has properties other than name, "
                f"data_type and dims: {sorted(extra)}"
            )
        missing = [key for key in ("name", "data_type", "dims") if key not in tensor]
        if missing:
            raise ValueError(f"{kind} '{name}' of model '{model}' lacks {', '.join(missing)}")
        for current in self._config[kind]:
            if current["name"] != name:
                continue
            datatype = current.get("data_type", "TYPE_INVALID")
            if datatype != "TYPE_INVALID" and datatype != tensor["data_type"]:
                raise ValueError(
                    f"model '{model}': the configuration gives {kind} '{name}' datatype "
                    f"{datatype}, the model {tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{model}': the configuration gives {kind} '{name}' dims "
                    f"{current['dims']}, the model {tensor['dims']}"
                )
            current["data_type"], current["dims"] = tensor["data_type"], list(tensor["dims"])
            return
        self._config[kind].append(
            {"name": name, "data_type": tensor["data_type"], "dims": list(tensor["dims"])}
        )


class Logger:
    """Triton's model logger, on lockgate's log (`lockgate.models.python`)."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3
    _LEVELS = {INFO: logging.INFO, WARNING: logging.WARNING, ERROR: logging.ERROR}

    @staticmethod
    def log(message: str, level: int = INFO) -> None:
        log.log(Logger._LEVELS.get(level, logging.DEBUG), "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        log.debug("%s", message)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in model_config.get("input", ()) if c.get("name") == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((c for c in model_config.get("output", ()) if c.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


# Triton's TRITONSERVER_DataType numbers, in its order: BYTES before BF16
_TRITON_TYPES = ("INVALID", *(d for d in DATATYPES if d not in ("BF16", "BYTES")), "BYTES", "BF16")


def triton_string_to_numpy(triton_type_string: str) -> type:
    """A config's `data_type` ("TYPE_FP32", "TYPE_STRING") as a numpy scalar type."""
    datatype = normalize_datatype(triton_type_string)
    if datatype is None or datatype == "BF16":
        raise TritonModelException(f"no numpy type for {triton_type_string!r}")
    found: type = numpy_dtype(datatype).type
    return found


def triton_to_numpy_type(data_type: int) -> type | None:
    """A TRITONSERVER_DataType number as a numpy scalar type; None when numpy has none."""
    if not 0 < data_type < len(_TRITON_TYPES) - 1:
        return None
    return triton_string_to_numpy(_TRITON_TYPES[data_type])


def numpy_to_triton_type(data_type: Any) -> int:
    """A numpy type as a TRITONSERVER_DataType number (object and bytes: BYTES)."""
    kind = np.dtype(data_type)
    if kind.kind in "OSU":
        return _TRITON_TYPES.index("BYTES")
    for number, name in enumerate(_TRITON_TYPES[1:-2], start=1):
        if numpy_dtype(name) == kind:
            return number
    raise TritonModelException(f"no Triton type for numpy type {kind}")


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray:
    """BYTES elements in Triton's wire form: each a 4-byte little-endian length and its
    bytes, flattened in row-major order, as a uint8 array."""
    return np.frombuffer(serialize_bytes_tensor(np.asarray(input_tensor)), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes | np.ndarray) -> np.ndarray:
    """The inverse of `serialize_byte_tensor`: a flat object array of bytes."""
    data = bytes(encoded_tensor)
    items, at = [], 0
    while at < len(data):
        if at + 4 > len(data):
            raise TritonModelException("truncated BYTES tensor: a length runs past the end")
        size = int.from_bytes(data[at : at + 4], "little")
        if at + 4 + size > len(data):
            raise TritonModelException("truncated BYTES tensor: an element runs past the end")
        items.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    return np.array(items, dtype=object)


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    return str(item).encode("utf-8")


def _code_of(exc: ServingError) -> int:
    """A lockgate error's status as the nearest TritonError code."""
    if exc.status == 404:
        return TritonError.NOT_FOUND
    if exc.status == 501:
        return TritonError.UNSUPPORTED
    if exc.status in (400, 413, 415):
        return TritonError.INVALID_ARG
    if exc.status in (429, 503, 504):
        return TritonError.UNAVAILABLE
    return TritonError.INTERNAL
