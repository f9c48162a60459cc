"""A Triton Python model served with its `model.py` unchanged.

    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args): ...                   # optional
        def execute(self, requests): ...                  # one InferenceResponse per request
        def finalize(self): ...                           # optional

A `model.py` under `backend: "python"` that defines `TritonPythonModel` (and no lockgate
`Model` class) is served this way; `triton_python_backend_utils` is lockgate's
`backends/pb_utils.py`.

- `initialize(args)` gets Triton's arguments: `model_config` (the config as Triton's JSON),
  `model_instance_kind` ("CPU"), `model_instance_name`, `model_instance_device_id`,
  `model_repository`, `model_version` and `model_name`.
- `execute(requests)` gets, as under Triton, one `InferenceRequest` per client request of
  the batch (the batcher does not merge them: `per_request`), each with its own tensors, id,
  parameters, requested outputs and sequence, and returns one `InferenceResponse` per
  request, in their order; each client gets the response at its request's index.
- Instead of returning a request's response, `execute` may send it through the request's
  sender, as Triton allows since 24.06: `request.get_response_sender().send(response,
  flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)` (or the response, then the flag
  alone), and return None, or None at that request's index. A request neither answered nor
  sent a response by the time `execute` returns fails with a message that says so; a second
  response, or the flag before any response, raises Triton's error in the model.
- An error response fails its request alone, with the model's message and Triton's status
  for its code (`error_of`); a list of the wrong length fails every request of the call, an
  item that is no response its own request. A `TritonError` raised has its code's status;
  when `execute` raises on several requests, each is run again alone, so only the one the
  model refuses fails.
- A model that calls other models (its file builds `pb_utils.InferenceRequest(...)`, or its
  `execute` is `async def`) runs as a composition instead (`TritonPythonComposition`): one
  `execute` per request, outside the batcher, its calls through the called models' batchers.
- A decoupled model (`model_transaction_policy { decoupled: true }`) sends a stream of
  responses per request (`backends/triton_decoupled.py`).
- `finalize()` runs when the model is unloaded.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import itertools
import json
import re
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from lockgate.backends import pb_utils
from lockgate.backends.base import (
    Answer,
    BatchedRequest,
    InferContext,
    RequestView,
    checked_outputs,
    model_file,
)
from lockgate.backends.user_module import import_file
from lockgate.config import DynamicBatching, ModelConfig, TensorSpec
from lockgate.datatypes import Arrays, config_datatype, normalize_datatype
from lockgate.errors import (
    BackendError,
    BadRequest,
    ConfigError,
    NotFound,
    ServingError,
    Unavailable,
    Unsupported,
)

CLASS_NAME = "TritonPythonModel"
_autocompletes = itertools.count(1)
# a TritonError's code -> the error its client gets: Triton's HTTP status for each code
_ERRORS: dict[int, type[ServingError]] = {
    pb_utils.TritonError.INTERNAL: BackendError,  # 500
    pb_utils.TritonError.NOT_FOUND: NotFound,  # 404
    pb_utils.TritonError.UNAVAILABLE: Unavailable,  # 503
    pb_utils.TritonError.UNSUPPORTED: Unsupported,  # 501
}  # the rest (UNKNOWN, INVALID_ARG, ALREADY_EXISTS, CANCELLED): 400
# request parameters the server takes for itself, not passed on to the model (Triton's)
_RESERVED_PARAMETERS = frozenset(
    {"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "binary_data_output"}
)


def model_parameters(parameters: Mapping[str, object]) -> dict[str, object]:
    """A client's request parameters as the model sees them in `request.parameters()`: as
    in Triton, without those the server takes (sequence, priority, timeout, binary output,
    `triton_*`)."""
    return {
        key: value
        for key, value in parameters.items()
        if key not in _RESERVED_PARAMETERS and not key.startswith("triton_")
    }


class TritonPythonBackend:
    """An instance of the model's `TritonPythonModel`: each batch one `execute` call, with
    an `InferenceRequest` per client request (`per_request`: the batcher does not merge them)."""

    __slots__ = (
        "_expected",
        "_instance",
        "_model",
        "_outputs",
        "_states",
        "_version",
        "module_name",
    )

    per_request = True

    def __init__(self, instance: Any, config: ModelConfig, version: int) -> None:
        self._instance = instance
        self._model = config.name
        self._version = version
        self._outputs = [spec.name for spec in config.outputs]
        self._expected = [spec.name for spec in config.outputs if not spec.optional]
        # a stateful model's state outputs go back to the sequence batcher, asked or not
        batching = config.sequence_batching
        self._states = (
            frozenset(s.output_name for s in batching.states) if batching else frozenset()
        )
        self.module_name = ""  # the user's module, dropped from sys.modules on close

    @property
    def instance(self) -> Any:
        return self._instance

    def infer(self, inputs: Arrays) -> Arrays:
        """One request alone (warmup, profiling)."""
        triton = [self.request(inputs)]
        sent = [pb_utils.attach_sent(triton[0])]
        try:
            returned: Any = self.execute(triton)
        except ServingError as exc:
            returned = exc
        return self.outputs_of(self.answers_of(returned, sent, [None]))

    def infer_requests(self, requests: Sequence[BatchedRequest]) -> list[Answer]:
        """One `execute` call for the batch, an `InferenceRequest` per client request; the
        response at each request's index, or the one it sent, is its answer. A wrong count
        of responses fails them all but those sent; a response that is not one, or holds an
        error, fails its request alone. What `execute` raises is raised (the batcher runs the
        requests again, each alone), unless a request has sent its response: the others
        then fail with it."""
        triton = [self.request_of(request) for request in requests]
        sent = [pb_utils.attach_sent(request) for request in triton]
        try:
            returned: Any = self.execute(triton)
        except ServingError as exc:
            if not any(one.response for one in sent):
                raise
            returned = exc
        return self.answers_of(returned, sent, requests)

    def answers_of(
        self,
        returned: Any,
        sent: Sequence[pb_utils.SentResponse],
        requests: Sequence[BatchedRequest | None],
    ) -> list[Answer]:
        """Each request's answer once `execute` has returned (or raised `returned`): the
        response it sent through its sender, else the one returned at its index."""
        for one in sent:
            one.returned = True  # what the model sends from now on raises
        if isinstance(returned, ServingError):
            fallback: list[Answer] = [returned] * len(requests)
        elif returned is None:
            fallback = [self._unanswered(index, "returned None") for index in range(len(sent))]
        elif not isinstance(returned, list | tuple) or len(returned) != len(requests):
            count = (
                _counted(len(returned), "response")
                if isinstance(returned, list | tuple)
                else f"a {type(returned).__name__}"
            )
            error = BackendError(
                f"model '{self._model}': execute() got {_counted(len(requests), 'request')} "
                f"and returned {count}: it must return a list of one InferenceResponse per "
                "request, in their order (or None, having sent each its response)"
            )
            fallback = [error] * len(requests)
        else:
            fallback = [
                self._unanswered(index, f"returned None for request {index}")
                if response is None
                else self.answer_of(response, index, request)
                for index, (response, request) in enumerate(zip(returned, requests, strict=True))
            ]
        return [
            self._sent_answer(one, index, request) if one.response is not None else fallback[index]
            for index, (one, request) in enumerate(zip(sent, requests, strict=True))
        ]

    def _sent_answer(
        self, sent: pb_utils.SentResponse, index: int, request: BatchedRequest | None
    ) -> Answer:
        if not sent.final:
            return BackendError(
                f"model '{self._model}': execute() sent request {index} a response without "
                "TRITONSERVER_RESPONSE_COMPLETE_FINAL: send it with "
                "flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL, or send the flag after it"
            )
        return self.answer_of(sent.response, index, request)

    def _unanswered(self, index: int, returned: str) -> BackendError:
        return BackendError(
            f"model '{self._model}': execute() {returned} and sent request {index} no "
            "response: return one InferenceResponse per request, or send each request's "
            "response with request.get_response_sender().send(response, "
            "flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL) before returning"
        )

    @property
    def model(self) -> str:
        return self._model

    def request(
        self,
        inputs: Arrays,
        request_id: str = "",
        parameters: Mapping[str, object] | None = None,
        outputs: Sequence[str] | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
    ) -> pb_utils.InferenceRequest:
        """The `InferenceRequest` `execute` gets for a client's request: its tensors, id,
        parameters, requested outputs (all when it names none) and sequence."""
        return pb_utils.InferenceRequest(
            model_name=self._model,
            requested_output_names=outputs or self._outputs,
            inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
            request_id=request_id,
            correlation_id=correlation_id,
            model_version=self._version,
            flags=flags,
            parameters=model_parameters(parameters or {}),
        )

    def request_of(self, request: BatchedRequest) -> pb_utils.InferenceRequest:
        return self.request(
            request.inputs,
            request.id,
            request.parameters,
            request.outputs,
            request.correlation_id,
            request.flags,
        )

    def execute(self, requests: list[pb_utils.InferenceRequest]) -> Any:
        try:
            return self._instance.execute(requests)
        except Exception as exc:
            raise self._failure(exc) from exc

    async def execute_async(self, requests: list[pb_utils.InferenceRequest]) -> Any:
        try:
            return await self._instance.execute(requests)
        except Exception as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> ServingError:
        if isinstance(exc, ServingError):
            return exc
        if isinstance(exc, pb_utils.TritonError):
            return self.error_of(exc)
        return BackendError(f"model '{self._model}': {type(exc).__name__}: {exc}")

    def outputs_of(self, answers: list[Answer]) -> Arrays:
        """The outputs of the one answer to one request; raises its error."""
        (answer,) = answers
        if isinstance(answer, ServingError):
            raise answer
        return answer

    def answer_of(
        self, response: Any, index: int, request: BatchedRequest | None
    ) -> Arrays | ServingError:
        """What the response at `index` answers its request: the outputs it asked for (all
        when it named none), or an error."""
        if not isinstance(response, pb_utils.InferenceResponse):
            kind = type(response).__name__
            return BackendError(
                f"model '{self._model}': execute() returned a {kind} for request {index}, not "
                "an InferenceResponse"
            )
        error = response.error()
        if error is not None:
            return self.error_of(error)
        try:
            outputs = self.tensors_of(response)
        except BackendError as exc:
            return exc
        wanted = request.outputs if request is not None else None
        if wanted:  # as Triton, only the outputs it asked for
            outputs = {
                name: array
                for name, array in outputs.items()
                if name in wanted or name in self._states
            }
            expected = [name for name in self._expected if name in wanted]
        else:
            expected = self._expected
        try:
            return checked_outputs(outputs, self._model, expected)
        except BackendError as exc:
            return exc

    def tensors_of(self, response: pb_utils.InferenceResponse) -> Arrays:
        """A response's output tensors as named arrays; BackendError for one not a Tensor."""
        outputs = {}
        for tensor in response.output_tensors():
            if not isinstance(tensor, pb_utils.Tensor):
                kind = type(tensor).__name__
                raise BackendError(f"model '{self._model}': an output is a {kind}, not a Tensor")
            outputs[tensor.name()] = tensor.as_numpy()
        return outputs

    def error_of(self, error: pb_utils.TritonError) -> ServingError:
        """A model's error as its client gets it: its message, with Triton's status for its
        code (INTERNAL 500, NOT_FOUND 404, UNAVAILABLE 503, UNSUPPORTED 501, the rest 400)."""
        message = f"model '{self._model}': {error.message()}"
        kind = _ERRORS.get(error.code(), BadRequest)
        if kind is Unavailable:
            return Unavailable(message, retry_after=1)
        return kind(message)

    def close(self) -> None:
        finalize = getattr(self._instance, "finalize", None)
        try:
            if callable(finalize):
                finalize()
        finally:
            sys.modules.pop(self.module_name, None)


class TritonPythonComposition:
    """A Triton Python model that calls other models (`InferenceRequest(...).exec()`, Triton's
    business logic scripting), run as a composition: outside the batcher, each request its own
    `execute` call, whose calls go through the called models' batchers within its deadline and
    at its priority. A synchronous `execute` runs on a thread of the model's own, at most
    `instance_count` at once (Triton runs one per instance); an `async def execute` runs on
    the event loop, awaiting `async_exec()`."""

    __slots__ = ("_async", "_backend", "_pool")

    def __init__(self, backend: TritonPythonBackend, threads: int) -> None:
        self._backend = backend
        self._async = inspect.iscoroutinefunction(backend.instance.execute)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-python")

    async def run(self, inputs: Arrays, ctx: InferContext) -> Arrays:
        requests = [self._backend.request_of(RequestView.of(ctx.request, inputs))]
        sent = [pb_utils.attach_sent(requests[0])]
        loop = asyncio.get_running_loop()
        token = pb_utils.CALLER.set(pb_utils.Caller(loop, ctx))
        responses: Any
        try:
            if self._async:
                responses = await self._backend.execute_async(requests)
            else:
                context = contextvars.copy_context()  # the thread sees the caller
                call = functools.partial(context.run, self._backend.execute, requests)
                responses = await loop.run_in_executor(self._pool, call)
        except ServingError as exc:
            responses = exc
        finally:
            pb_utils.CALLER.reset(token)
        return self._backend.outputs_of(self._backend.answers_of(responses, sent, [None]))

    async def drain(self, timeout: float) -> bool:
        return True  # its requests wait in the models it calls, which drain them

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._backend.close()


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def calls_models(cls: type, source: str) -> bool:
    """Whether a Triton Python model calls other models: its `execute` is a coroutine
    function, or its file builds an `InferenceRequest` (the only reason a model would)."""
    return inspect.iscoroutinefunction(getattr(cls, "execute", None)) or bool(
        re.search(r"\bInferenceRequest\s*\(", source)
    )


def is_triton_model(module: Any) -> bool:
    return isinstance(getattr(module, CLASS_NAME, None), type)


def load(cls: type, config: ModelConfig, version_dir: Path) -> TritonPythonBackend:
    """Build the model's class and run its `initialize` with Triton's arguments."""
    version = int(version_dir.name) if version_dir.name.isdigit() else 1
    model = cls()
    initialize = getattr(model, "initialize", None)
    if callable(initialize):
        initialize(
            {
                "model_config": json.dumps(triton_config(config)),
                "model_instance_kind": "CPU",
                "model_instance_name": f"{config.name}_0_0",
                "model_instance_device_id": "0",
                "model_repository": str(version_dir.parent),
                "model_version": str(version),
                "model_name": config.name,
            }
        )
    if not callable(getattr(model, "execute", None)):
        raise BackendError(f"model '{config.name}': {CLASS_NAME} has no execute()")
    return TritonPythonBackend(model, config, version)


def autocomplete(config: ModelConfig, version_dir: Path) -> ModelConfig:
    """What the model's `auto_complete_config(auto_complete_model_config)` adds to its config,
    as in Triton: the batch size, dynamic batching, and the inputs and outputs the config does
    not list. A model without it, or a lockgate model, keeps its config."""
    path = model_file(config, version_dir)
    if "auto_complete_config" not in path.read_text(errors="replace"):
        return config  # (no import of a file that cannot have it)
    module_name = f"lockgate_autocomplete_{next(_autocompletes)}"
    module = import_file(path, module_name)
    try:
        cls = getattr(module, CLASS_NAME, None)
        complete = getattr(cls, "auto_complete_config", None)
        if not is_triton_model(module) or not callable(complete):
            return config
        try:
            completed = complete(pb_utils.ModelConfig(triton_config(config)))
        except Exception as exc:
            raise ConfigError(
                str(path), "auto_complete_config", f"{type(exc).__name__}: {exc}"
            ) from exc
    finally:
        sys.modules.pop(module_name, None)
    if not isinstance(completed, pb_utils.ModelConfig):
        kind = type(completed).__name__
        raise ConfigError(str(path), "auto_complete_config", f"returned a {kind}, not the config")
    return _completed(config, completed.as_dict(), str(path))


def _completed(config: ModelConfig, doc: dict[str, Any], source: str) -> ModelConfig:
    def specs(kind: str) -> tuple[TensorSpec, ...]:
        optional = {spec.name for spec in (*config.inputs, *config.outputs) if spec.optional}
        found = []
        for tensor in doc[kind]:
            datatype = normalize_datatype(str(tensor["data_type"]))
            if datatype is None:
                problem = f"{kind} '{tensor['name']}' has data_type {tensor['data_type']!r}"
                raise ConfigError(source, "auto_complete_config", problem)
            dims = tuple(int(d) for d in tensor["dims"])
            found.append(TensorSpec(tensor["name"], datatype, dims, tensor["name"] in optional))
        return tuple(found)

    batching = config.dynamic_batching
    if batching is None and "dynamic_batching" in doc:
        batching = DynamicBatching()
    decoupled = bool(doc.get("model_transaction_policy", {}).get("decoupled", False))
    return replace(
        config,
        max_batch_size=int(doc["max_batch_size"]),
        inputs=specs("input"),
        outputs=specs("output"),
        dynamic_batching=batching,
        decoupled=config.decoupled or decoupled,
    )


def triton_config(config: ModelConfig) -> dict[str, Any]:
    """The parts of Triton's JSON model config a Python model reads: its name, batching,
    tensors (`data_type` in Triton's spelling), parameters and instances."""
    doc: dict[str, Any] = {
        "name": config.name,
        "backend": "python",
        "max_batch_size": config.max_batch_size,
        "input": [_tensor(spec) for spec in config.inputs],
        "output": [_tensor(spec) for spec in config.outputs],
        "parameters": {key: {"string_value": value} for key, value in config.parameters.items()},
        "instance_group": [{"count": config.instance_count, "kind": "KIND_CPU"}],
        "model_transaction_policy": {"decoupled": config.decoupled},
    }
    if config.dynamic_batching is not None:
        doc["dynamic_batching"] = {
            "max_queue_delay_microseconds": config.dynamic_batching.max_queue_delay_us
        }
    if config.sequence_batching is not None:
        doc["sequence_batching"] = config.sequence_batching.document()
    return doc


def _tensor(spec: TensorSpec) -> dict[str, Any]:
    data_type = config_datatype(spec.datatype)
    doc: dict[str, Any] = {"name": spec.name, "data_type": data_type, "dims": list(spec.dims)}
    if spec.optional:
        doc["optional"] = True
    if spec.allow_ragged_batch:
        doc["allow_ragged_batch"] = True
    return doc
