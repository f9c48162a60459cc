"""The KServe v2 service, independent of its transport.

REST (`frontend/v2_routes.py`) and gRPC (`frontend/grpc_server.py`) are thin adapters over
it: they decode the wire, call one method here, and encode what it returns. Versions,
deadlines, priorities, input and output checks, readiness, metadata, statistics, the
repository index and the log and trace settings are decided here once, so the two protocols
cannot drift apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from lockgate import __version__
from lockgate.backends.base import LLM_BACKEND, spec_of
from lockgate.backends.response_stream import StreamedResponse
from lockgate.compose.executor import Executor
from lockgate.config import ModelConfig
from lockgate.core.batch_times import BatchTimes
from lockgate.core.manager import ModelManager, ModelState, ServedVersion
from lockgate.core.repository import model_names
from lockgate.core.request import InferRequest
from lockgate.core.sequences import SequenceFlags
from lockgate.core.serving_metrics import Timed
from lockgate.core.validate import validate_inputs, validate_outputs, validate_shapes
from lockgate.datatypes import Arrays
from lockgate.errors import BadRequest, Forbidden, NotFound, ServingError
from lockgate.frontend.server_log import ServerLog
from lockgate.protocol import llm_tensors, v2_metadata
from lockgate.protocol.log_settings import LogSettings
from lockgate.protocol.predict import VersionStatus
from lockgate.protocol.shared_memory import SharedMemory
from lockgate.protocol.trace_settings import TraceSettings, TraceValues, change_of
from lockgate.protocol.v2_codec import DeclaredInput, V2InferRequest
from lockgate.protocol.v2_metadata import BatchStats, Document, Duration, ModelStats, Runtime

EXTENSIONS = (
    "binary_tensor_data",
    "classification",
    "model_configuration",
    "statistics",
    "model_repository",
    "schedule_policy",
    "system_shared_memory",
    "logging",
    "trace",
)
SERVER_METADATA = v2_metadata.server_metadata(
    name="lockgate", version=__version__, extensions=EXTENSIONS
)
log = logging.getLogger("lockgate.frontend")
MAX_TIMEOUT_US = 10**13  # about 116 days: any longer is a client mistake
MAX_TIMEOUT_S = 1e7  # the Request-Timeout header, in seconds


@dataclass(slots=True)
class Deadline:
    """What a request says about its deadline, whatever carried it.

    `timeout_us` is the `timeout` parameter; `header_seconds` a Request-Timeout header
    (REST); `transport_seconds` the time the transport itself leaves (a gRPC deadline).
    """

    received: float  # time.monotonic() of the request's first byte
    timeout_us: int | None = None
    header_seconds: float | None = None
    transport_seconds: float | None = None

    def resolve(self, served: ServedVersion) -> float | None:
        """The soonest bound the request gives, else the model's default timeout."""
        bounds = [
            self.received + seconds
            for seconds in (
                None if self.timeout_us is None else self.timeout_us / 1e6,
                self.header_seconds,
                None if self.transport_seconds is None else max(0.0, self.transport_seconds),
            )
            if seconds is not None
        ]
        if bounds:
            return min(bounds)
        default_us = served.config.batcher.default_timeout_us
        return self.received + default_us / 1e6 if default_us > 0 else None

    def of(self, decoded: V2InferRequest) -> Deadline:
        """This deadline with the request's `timeout` parameter (µs) too."""
        timeout_us = timeout_parameter(decoded.parameters)
        return Deadline(self.received, timeout_us, self.header_seconds, self.transport_seconds)


def is_language_model(config: ModelConfig) -> bool:
    return config.backend == LLM_BACKEND


def declared_config(config: ModelConfig) -> ModelConfig:
    """The config a model's v2 requests are checked against and its metadata declares: a
    language model's is the tensors of Triton's vLLM backend (`protocol/llm_tensors.py`)."""
    return llm_tensors.interface(config) if is_language_model(config) else config


@dataclass(slots=True)
class InferResult:
    """A finished inference: the outputs and the version that computed them, and the request
    with the times of its way through the batcher."""

    served: ServedVersion
    outputs: Arrays
    source: str = ""  # "": the model computed it; "cache"; "fallback:<kind>[:<model>]"
    request: InferRequest | None = None

    @property
    def parameters(self) -> dict[str, str | bool]:
        """Response parameters that say where the answer came from."""
        if self.source == "cache":
            return {"cache_hit": True}
        if self.source.startswith("fallback:"):
            return {"fallback": self.source.removeprefix("fallback:")}
        return {}

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        if is_language_model(self.served.config):  # a router never sends it twice
            return [(llm_tensors.MODEL_KIND_HEADER, llm_tensors.LANGUAGE_KIND)]
        if self.source == "cache":
            return [(b"x-lockgate-cache", b"hit")]
        if self.source.startswith("fallback:"):
            return [(b"x-lockgate-fallback", self.source.removeprefix("fallback:").encode())]
        return []

    @property
    def output_datatypes(self) -> dict[str, str]:
        return {s.name: s.datatype for s in declared_config(self.served.config).outputs}

    @property
    def output_labels(self) -> dict[str, tuple[str, ...]]:
        """Class names of the outputs that have a label file, for classification."""
        return self.served.labels

    @property
    def batched(self) -> bool:
        """The model batches: the first dim of each output is the batch."""
        return declared_config(self.served.config).batching


@dataclass(frozen=True, slots=True)
class IndexEntry:
    name: str
    version: str
    state: str
    reason: str


def parse_version(text: str | None) -> int | None:
    """A version from a path or a message: None for "the default", 404 when malformed."""
    if text is None or text == "":
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 18:  # '¹' is a digit to isdigit
        raise NotFound(f"unknown version '{text[:40]}'")
    return int(text)


def timeout_parameter(parameters: dict[str, object]) -> int | None:
    """The `timeout` parameter in µs: None when absent or not positive; 400 when absurd."""
    timeout_us = parameters.get("timeout")
    if not isinstance(timeout_us, int) or isinstance(timeout_us, bool) or timeout_us <= 0:
        return None
    if timeout_us > MAX_TIMEOUT_US:
        raise BadRequest(f"parameter 'timeout' must be at most {MAX_TIMEOUT_US} µs")
    return timeout_us


def timeout_header(value: str | None) -> float | None:
    """A Request-Timeout header in seconds: None when absent; 400 when malformed."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise BadRequest("Request-Timeout header must be a number of seconds") from None
    if not 0 < seconds < MAX_TIMEOUT_S:
        raise BadRequest("Request-Timeout header must be a positive number of seconds")
    return seconds


def priority_of(parameters: dict[str, object]) -> int:
    priority = parameters.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
        raise BadRequest("parameter 'priority' must be a non-negative integer")
    return priority


MAX_SEQUENCE_ID_CHARS = 128  # as Triton's string correlation ids


def sequence_of(parameters: dict[str, object]) -> SequenceFlags | None:
    """Triton's sequence parameters: `sequence_id` (an unsigned 64-bit integer, a negative
    int64 read as its unsigned value as gRPC's int64_param carries it, or a string),
    `sequence_start` and `sequence_end`; None when the request gives none of them."""
    if not any(key in parameters for key in ("sequence_id", "sequence_start", "sequence_end")):
        return None
    sequence_id = parameters.get("sequence_id", 0)
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, int | str):
        raise BadRequest("parameter 'sequence_id' must be an unsigned integer or a string")
    if isinstance(sequence_id, int):
        if not -(2**63) <= sequence_id < 2**64:
            raise BadRequest("parameter 'sequence_id' must fit in an unsigned 64-bit integer")
        sequence_id %= 2**64
    elif len(sequence_id) > MAX_SEQUENCE_ID_CHARS:
        raise BadRequest(
            f"string correlation ID cannot be longer than {MAX_SEQUENCE_ID_CHARS} characters"
        )
    flags = {}
    for key in ("sequence_start", "sequence_end"):
        value = parameters.get(key, False)
        if not isinstance(value, bool):
            raise BadRequest(f"parameter '{key}' must be true or false")
        flags[key] = value
    return SequenceFlags(sequence_id, flags["sequence_start"], flags["sequence_end"])


class LanguageModels(Protocol):
    """KServe v2 inference on language models (`frontend/llm_infer.py`), through the engine's
    completion pipeline: `V2Service.infer` and `V2Service.stream` hand their requests to it."""

    async def infer(
        self, served: ServedVersion, decoded: V2InferRequest, deadline: Deadline, granted: bool
    ) -> InferResult: ...

    def stream(
        self, served: ServedVersion, decoded: V2InferRequest, deadline: Deadline, granted: bool
    ) -> AsyncGenerator[StreamedResponse]: ...


@dataclass(slots=True)
class Checked:
    """A request's declared inputs, checked against `config`: its batch rows."""

    config: ModelConfig
    rows: int


class V2Service:
    """KServe v2 inference, health, metadata and Triton's extensions over a model manager."""

    def __init__(
        self,
        models: ModelManager,
        executor: Executor,
        shared_memory_regions: int = 256,
        trace: TraceSettings | None = None,
        shared_memory_registry: str = "",
    ) -> None:
        self.models = models
        self.executor = executor
        # Triton's logging and trace extensions: the process's log, the requests traced
        self.log = ServerLog()
        self.trace = trace or TraceSettings(TraceValues(), exporting=False)
        # the regions tensors may be passed in (0 regions: the extension is off)
        self.shared_memory = SharedMemory(shared_memory_regions, registry=shared_memory_registry)
        self.language: LanguageModels | None = None  # set when language models are served

    # -- inference ---------------------------------------------------------------------
    def served(self, name: str, version_text: str | None) -> ServedVersion:
        return self.models.get(name, parse_version(version_text))

    @staticmethod
    def check_declared(served: ServedVersion, declared: list[DeclaredInput]) -> Checked:
        """The inputs a request declares against the model's config (names, datatypes,
        shapes, batch size), before their data is decoded. The decoder keeps the answer on
        the request (`V2InferRequest.checked`): its arrays have the shapes checked here, so
        `core_request` need not check them again."""
        shapes = {d.name: d.shape for d in declared}
        config = declared_config(served.config)
        rows = validate_shapes(config, shapes, {d.name: d.datatype for d in declared})
        return Checked(config, rows)

    def core_request(
        self,
        name: str,
        served: ServedVersion,
        decoded: V2InferRequest,
        deadline: float | None,
        arrival: float | None = None,
        priority_granted: bool = True,
        trace_id: str = "",
    ) -> InferRequest:
        """A decoded request checked against the model's config. A priority above the
        model's default needs `priority_granted` (a key that grants it)."""
        checked = decoded.checked
        if isinstance(checked, Checked) and checked.config is served.config:
            rows = checked.rows
        else:
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
            parameters=decoded.parameters,
            rows=rows,
            arrival=time.monotonic() if arrival is None else arrival,
            trace_id=trace_id,
            sequence=sequence_of(decoded.parameters),
        )

    async def infer(
        self,
        name: str,
        served: ServedVersion,
        decoded: V2InferRequest,
        deadline: Deadline,
        priority_granted: bool = True,
        trace_id: str = "",
        endpoint: str = "HTTP end point",
    ) -> InferResult:
        """Check, admit, batch and run one request on `served` (from `served()`); its
        outputs, unencoded. A `trace_id` marks a traced request (see `frontend/otel.py`).
        A decoupled model is refused, as Triton refuses it on `endpoint`: it answers only
        on a stream. A language model answers here with its whole text (`stream` false)."""
        if is_language_model(served.config):
            return await self._language().infer(served, decoded, deadline, priority_granted)
        self.check_coupled(served, endpoint)
        request = self._request(name, served, decoded, deadline, priority_granted, trace_id)
        answer = await self.executor.infer(request, served)
        return InferResult(answer.served, answer.outputs, answer.source, request)

    def check_coupled(self, served: ServedVersion, endpoint: str = "HTTP end point") -> None:
        """400 for a decoupled model, in Triton's words for `endpoint`: it answers only on a
        stream (gRPC ModelStreamInfer, or Triton's generate extension)."""
        if served.config.decoupled:
            name = served.config.name
            error = BadRequest(
                f"{endpoint} doesn't support models with decoupled transaction policy: "
                f"model '{name}' streams its responses over gRPC ModelStreamInfer or "
                f"/v2/models/{name}/generate_stream"
            )
            self.refused(served, error)
            raise error

    def stream(
        self,
        name: str,
        served: ServedVersion,
        decoded: V2InferRequest,
        deadline: Deadline,
        priority_granted: bool = True,
    ) -> AsyncGenerator[StreamedResponse]:
        """The responses of a decoupled model to one checked request, as the model sends
        them; closing the iterator before its final response cancels the request. A language
        model streams its text (`stream` true) or answers once with the whole."""
        if is_language_model(served.config):
            return self._language().stream(served, decoded, deadline, priority_granted)
        request = self._request(name, served, decoded, deadline, priority_granted, "")
        return self.executor.stream(request, served, decoded.parameters)

    @staticmethod
    def streams(served: ServedVersion) -> bool:
        """The model answers a request on a stream by `stream` (not by one answer): a
        decoupled model, or a language model."""
        return served.config.decoupled or is_language_model(served.config)

    def _language(self) -> LanguageModels:
        if self.language is None:
            raise NotFound("this server runs without language models")
        return self.language

    def _request(
        self,
        name: str,
        served: ServedVersion,
        decoded: V2InferRequest,
        deadline: Deadline,
        priority_granted: bool,
        trace_id: str,
    ) -> InferRequest:
        timed = deadline.of(decoded)
        try:
            return self.core_request(
                name,
                served,
                decoded,
                timed.resolve(served),
                deadline.received,
                priority_granted,
                trace_id,
            )
        except ServingError as error:
            self.refused(served, error)
            raise

    def refused(self, served: ServedVersion, error: ServingError) -> None:
        """Count a request refused before it reached the model (malformed, or not what its
        config declares) among the model's failures, as Triton counts them: in
        `lockgate_requests_total` by the error's kind, and in the statistics' `fail`."""
        labels = (served.config.name, str(served.version), error.kind)
        self.models.metrics.requests.inc(labels)

    # -- health and metadata -----------------------------------------------------------
    def model_ready(self, name: str, version_text: str | None) -> str | None:
        """None when the model (version) is ready, else why not; 404 for an unknown model."""
        if name not in self.models.models:
            raise NotFound(f"unknown model '{name}'")
        version = parse_version(version_text)
        try:
            self.models.get(name, version)
        except NotFound:
            raise
        except Exception as exc:
            return str(exc)
        return None

    def model_metadata(self, name: str, version_text: str | None) -> Document:
        served = self.served(name, version_text)
        model = self.models.models[name]
        versions = [v for v, s in model.versions.items() if s.state is ModelState.READY]
        versions = sorted(versions) or [served.version]
        config = declared_config(served.config)
        return v2_metadata.model_metadata(config, versions, _runtime(config))

    def model_config(self, name: str, version_text: str | None) -> Document:
        """The model's config; a language model's declares its tensors and that it is
        decoupled, as Triton's vLLM backend completes its config."""
        config = self.served(name, version_text).config
        document = v2_metadata.model_config(declared_config(config), _runtime(config))
        if is_language_model(config):
            document["model_transaction_policy"] = {"decoupled": True}
        return document

    def statistics(self, name: str | None, version_text: str | None) -> Document:
        """Every version of the model (`name`; None: of every model), or one version of it;
        404 for an unknown model or version, as its config and metadata."""
        version = parse_version(version_text)
        if name is not None:
            named = self.models.models.get(name)
            if named is None:
                raise NotFound(f"unknown model '{name}'")
            if version is not None and version not in named.versions:
                raise NotFound(f"unknown version {version} of model '{name}'")
        stats = [
            self._stats_of(served)
            for model in self.models.models.values()
            if name is None or model.name == name
            for served in model.versions.values()
            if version is None or served.version == version
        ]
        return v2_metadata.model_statistics(stats)

    def knows(self, name: str) -> bool:
        """The model is loaded, loading or failed (not only a folder of the repository)."""
        return name in self.models.models

    def version_states(
        self, name: str, version_text: str | None
    ) -> tuple[list[VersionStatus], str]:
        """The state of each version of a model (or of the one asked), and why the model
        failed when it did before any version (its config or folder), for a status request:
        404 for a model or version not loaded."""
        model = self.models.models.get(name)
        if model is None:
            raise NotFound(f"unknown model '{name}'")
        wanted = parse_version(version_text)
        states = [
            VersionStatus(version, served.state.value, served.error)
            for version, served in sorted(model.versions.items())
            if wanted is None or version == wanted
        ]
        if wanted is not None and not states:
            raise NotFound(f"unknown version {wanted} of model '{name}'")
        return states, model.error

    def repository_index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every model version and its state; a model with no version as UNAVAILABLE."""
        index = [
            IndexEntry(model.name, str(version), served.state.value, served.error)
            for model in self.models.models.values()
            for version, served in sorted(model.versions.items())
            if not ready_only or served.state is ModelState.READY
        ]
        if not ready_only:
            index += [
                IndexEntry(m.name, "", "UNAVAILABLE", m.error)
                for m in self.models.models.values()
                if not m.versions
            ]
            root = self.models.repository
            if root is not None:  # the repository's models not loaded, as Triton lists them
                index += [
                    IndexEntry(name, "", "UNAVAILABLE", "unloaded")
                    for name in model_names(root)
                    if name not in self.models.models
                ]
        return index

    # -- Triton's logging and trace extensions -----------------------------------------
    def log_settings(self, change: Mapping[str, Any]) -> LogSettings:
        """The log settings, after `change` (name -> value; empty: none) is applied whole."""
        if change:
            settings = self.log.settings.changed(change)
            self.log.apply(settings)
            log.info("log settings changed: %s", settings.document())
        return self.log.settings

    def trace_settings(
        self, model: str, change: Mapping[str, list[str] | None]
    ) -> dict[str, list[str]]:
        """The trace settings of `model` ("": the global ones), after `change` (name -> values;
        None or []: clear) is applied whole; 404 for a model the server does not have."""
        if model and model not in self.models.models:
            raise NotFound(f"unknown model '{model[:200]}'")
        if change:
            self.trace.update(model, change_of(change))
            document = self.trace.document(model)
            log.info("trace settings of %s changed: %s", model or "the server", document)
        return self.trace.document(model)

    def _stats_of(self, served: ServedVersion) -> ModelStats:
        labels = (served.config.name, str(served.version))
        batcher = served.batcher
        t = self.models.metrics.totals(labels)
        failures = int(t.failures)
        queue = t.queued
        if served.service is not None:
            # a composition has no queue of its own (its steps wait in their models' queues,
            # counted there): each request passes it at once. Counted, as Triton counts an
            # ensemble's, so perf_analyzer finds the model's requests in its statistics
            queue = Timed(t.answered.count + failures, 0.0)
        elif t.cache_hits.count:
            # as Triton counts them: a request answered from the cache passed the queue at
            # once (its queue time is the time before the lookup: none here)
            queue = Timed(queue.count + t.cache_hits.count, queue.seconds)
        computes = t.computed.count
        return ModelStats(
            name=served.config.name,
            version=str(served.version),
            last_inference_ms=served.last_inference_ms,
            inference_count=t.rows,
            execution_count=t.executions,
            success=_duration(t.answered),
            fail=_duration(Timed(failures, 0.0)),
            queue=_duration(queue),
            compute_input=_duration(
                Timed(computes, batcher.times.input_seconds if batcher else 0.0)
            ),
            compute_infer=_duration(t.computed),
            compute_output=_duration(
                Timed(computes, batcher.times.output_seconds if batcher else 0.0)
            ),
            cache_hit=_duration(t.cache_hits),
            cache_miss=_duration(t.cache_misses),
            batch_stats=_batch_stats(batcher.times) if batcher else [],
        )


def _runtime(config: ModelConfig) -> Runtime:
    spec = spec_of(config.backend)
    return Runtime(spec.name, spec.platform)


def _duration(timed: Timed) -> Duration:
    return Duration(count=timed.count, ns=int(timed.seconds * 1e9))


def _batch_stats(times: BatchTimes) -> list[BatchStats]:
    """Triton's batch_stats: per batch size executed, its executions and phase times."""
    return [
        BatchStats(
            batch_size=rows,
            compute_input=_duration(Timed(phases.count, phases.input_seconds)),
            compute_infer=_duration(Timed(phases.count, phases.infer_seconds)),
            compute_output=_duration(Timed(phases.count, phases.output_seconds)),
        )
        for rows, phases in times.by_size()
    ]
