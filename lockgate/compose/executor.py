"""Runs one request on any kind of model, and answers from the cache or a fallback when it
can.

The frontends call `Executor.infer` with a checked request. In order:
1. the response cache, when the model enables it (a hit skips admission: it costs nothing);
2. coalescing: an identical request already in flight answers this one too;
3. the model itself: a batched model through its batcher, or a composition (ensemble,
   cascade, Python model calling others) whose steps each go through their own batcher,
   within the request's deadline and at its priority;
4. on a refusal for load or time (503, 429, 504), the model's fallbacks in order: a cheaper
   model, the cache even if stale, a static answer. The answer says where it came from.

`Executor.stream` runs a request on a model that answers with a stream of responses (a
decoupled model, a `StreamingService`): no cache, no coalescing, no fallback, as each
response goes to the client as it comes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from lockgate.backends.python import PythonComposition
from lockgate.backends.response_stream import StreamedResponse, StreamingService, StreamRequest
from lockgate.backends.triton_python import TritonPythonComposition
from lockgate.cache.key import request_key
from lockgate.cache.response_cache import ResponseCache
from lockgate.cache.single_flight import SingleFlight
from lockgate.compose.cascade import Cascade
from lockgate.compose.ensemble import Ensemble
from lockgate.config import Fallback, FallbackKind, ModelConfig
from lockgate.core.manager import ModelManager, ServedVersion
from lockgate.core.metrics import Registry
from lockgate.core.request import InferRequest
from lockgate.core.validate import validate_inputs
from lockgate.datatypes import Arrays, datatype_of, numpy_dtype
from lockgate.errors import (
    BackendError,
    BadRequest,
    DeadlineExceeded,
    ServingError,
    TooManyRequests,
    Unavailable,
)

MAX_DEPTH = 16  # compositions calling compositions: deeper is a cycle
FALLBACK_ON = (Unavailable, TooManyRequests, DeadlineExceeded)


@dataclass(slots=True)
class Answer:
    outputs: Arrays
    served: ServedVersion
    source: str = ""  # "": the model; "cache"; or "fallback:<kind>[:<model>]"


class Executor:
    def __init__(self, models: ModelManager, cache: ResponseCache, registry: Registry) -> None:
        self.models = models
        self.cache = cache
        self.flights: SingleFlight[Arrays] = SingleFlight()
        mv = ("model", "version")
        self.fallbacks = registry.counter(
            "lockgate_fallback_answers_total",
            "Requests answered by a fallback after the model refused them, by kind.",
            (*mv, "kind"),
        )
        self.cascade_rows = registry.counter(
            "lockgate_cascade_rows_total",
            "Rows answered by each stage of a cascade (stage 0 is the cheapest model).",
            (*mv, "stage"),
        )

    async def infer(self, request: InferRequest, served: ServedVersion, depth: int = 0) -> Answer:
        config = served.config
        cached = config.response_cache.enable
        digest = generation = ""
        if cached:
            metrics, labels = self.models.metrics, (config.name, str(served.version))
            looked = time.monotonic()
            generation = self.generation(served)
            digest = request_key(
                config.name, served.version, request.inputs, request.outputs, generation
            )
            hit = await self.cache.get(
                config.name, served.version, config.response_cache, digest, generation
            )
            done = time.monotonic()
            if hit is not None:
                metrics.cache_hit_latency.observe(labels, done - looked)
                self._answered(request, served, done)
                return Answer(hit.outputs, served, "cache")
            metrics.cache_miss_latency.observe(labels, done - looked)
        try:
            if cached and config.response_cache.coalesce:
                key = f"{config.name}:{served.version}:{digest}"
                outputs = await self._coalesced(key, request, served, depth)
            else:
                outputs = await self._run(request, served, depth)
        except FALLBACK_ON as refused:
            if not config.fallback:
                raise
            return await self._fall_back(request, served, digest, refused, depth)
        if cached:
            self.cache.put(
                config.name, served.version, config.response_cache, digest, outputs, generation
            )
        return Answer(outputs, served)

    async def stream(
        self,
        request: InferRequest,
        served: ServedVersion,
        parameters: Mapping[str, object] | None = None,
    ) -> AsyncGenerator[StreamedResponse]:
        """The responses of a streaming model to `request` (with the client's `parameters`),
        as it sends them, up to its final one. Closing the iterator early (the client went
        away) cancels the request."""
        service = served.service
        if not isinstance(service, StreamingService):
            raise BadRequest(f"model '{request.model}' is not decoupled: it answers once")
        opened = StreamRequest(request.inputs, request.id, request.deadline, parameters or {})
        labels = (served.config.name, str(served.version))
        try:
            responses = service.open(opened, Context(self, request, 1))
        except ServingError as error:
            self.models.metrics.requests.inc((*labels, error.kind))
            raise
        kind = "cancelled"
        try:
            async for response in responses:
                if response.outputs is not None and request.outputs is not None:
                    wanted = request.outputs
                    outputs = {k: v for k, v in response.outputs.items() if k in wanted}
                    response = replace(response, outputs=outputs)
                if response.final:
                    kind = response.error.kind if response.error is not None else "success"
                yield response
        finally:
            if not responses.ended:
                responses.cancel()  # the client has gone before the final response
            if kind == "success":  # one execution per request, as a composition's
                self.models.metrics.batch_size.observe(labels, request.rows)
                self._answered(request, served, time.monotonic())
            else:
                self.models.metrics.requests.inc((*labels, kind))

    def generation(self, served: ServedVersion) -> str:
        """What a cached answer of `served` depends on: its fingerprint, and for an ensemble
        or a cascade those of the versions it runs now (a step reloaded as another model
        changes it too)."""
        parts = [served.fingerprint]
        for model, version in served.config.runs:
            try:
                step = self.models.get(model, version)
            except ServingError:
                parts.append("-")  # not ready: the request is refused anyway
                continue
            parts.append(f"{step.version}.{step.fingerprint}")
        return ":".join(parts)

    async def run(self, request: InferRequest, served: ServedVersion) -> Arrays:
        """The model's own answer (a batcher or a composition), with no cache and no fallback:
        for callers that cache in their own way (per text, for embeddings)."""
        return await self._run(request, served, 0)

    async def _coalesced(
        self, key: str, request: InferRequest, served: ServedVersion, depth: int
    ) -> Arrays:
        before = self.flights.coalesced
        outputs = await self.flights.run(key, lambda: self._run(request, served, depth))
        if self.flights.coalesced > before:
            self.cache.coalesced.inc((served.config.name,))
        return outputs

    def _run(self, request: InferRequest, served: ServedVersion, depth: int) -> Awaitable[Arrays]:
        """The model's answer: its batcher's, awaited with no frame of this one between, or its
        composition's."""
        if served.service is None:
            return self.models.infer(request)
        return self._composed(request, served, depth)

    async def _composed(self, request: InferRequest, served: ServedVersion, depth: int) -> Arrays:
        if depth >= MAX_DEPTH:
            raise BackendError(
                f"model '{request.model}': compositions nest deeper than {MAX_DEPTH}"
            )
        labels = (served.config.name, str(served.version))
        try:
            outputs = await self._compose(request, served, depth)
        except ServingError as error:
            self.models.metrics.requests.inc((*labels, error.kind))
            raise
        # one execution of the composition per request; its steps count in their own models
        self.models.metrics.batch_size.observe(labels, request.rows)
        self._answered(request, served, time.monotonic())
        return outputs

    def _answered(self, request: InferRequest, served: ServedVersion, done: float) -> None:
        """Count an answer no batcher counted (a cache hit, a composition's) as the model's
        own, for GET /v2/models/{m}/stats and /metrics."""
        metrics, labels = self.models.metrics, (served.config.name, str(served.version))
        metrics.requests.inc((*labels, "success"))
        metrics.request_latency.observe(labels, done - request.arrival, request.trace_id)
        served.last_inference_ms = int(time.time() * 1000)

    async def _compose(self, request: InferRequest, served: ServedVersion, depth: int) -> Arrays:
        service = served.service
        ctx = Context(self, request, depth + 1)
        if isinstance(service, Ensemble):
            outputs = await service.run(request.inputs, ctx)
        elif isinstance(service, Cascade):
            result = await service.run(request.inputs, ctx)
            labels = (served.config.name, str(served.version))
            for stage, rows in enumerate(result.rows_per_stage):
                self.cascade_rows.inc((*labels, str(stage)), rows)
            outputs = result.outputs
        elif isinstance(service, PythonComposition | TritonPythonComposition):
            outputs = await service.run(request.inputs, ctx)
        elif isinstance(service, StreamingService):
            raise BadRequest(
                f"model '{request.model}' is decoupled: its responses stream over gRPC "
                f"ModelStreamInfer or /v2/models/{request.model}/generate_stream"
            )
        else:
            raise BadRequest(
                f"model '{request.model}' is a language model: use /v1/completions, "
                f"/v1/chat/completions or /v2/models/{request.model}/generate"
            )
        if request.outputs is not None:
            outputs = {k: v for k, v in outputs.items() if k in request.outputs}
        return outputs

    async def _fall_back(
        self,
        request: InferRequest,
        served: ServedVersion,
        digest: str,
        refused: ServingError,
        depth: int,
    ) -> Answer:
        config = served.config
        labels = (config.name, str(served.version))
        for fallback in config.fallback:
            outputs, source = await self._try(fallback, request, served, digest, depth)
            if outputs is not None:
                self.fallbacks.inc((*labels, fallback.kind.value))
                return Answer(outputs, served, source)
        raise refused

    async def _try(
        self,
        fallback: Fallback,
        request: InferRequest,
        served: ServedVersion,
        digest: str,
        depth: int,
    ) -> tuple[Arrays | None, str]:
        config = served.config
        if fallback.kind is FallbackKind.CACHE:
            generation = self.generation(served)
            if not digest:
                digest = request_key(
                    config.name, served.version, request.inputs, request.outputs, generation
                )
            hit = self.cache.get_stale(
                config.name, served.version, config.response_cache, digest, generation
            )
            return (None if hit is None else hit.outputs), "fallback:cache"
        if fallback.kind is FallbackKind.STATIC:
            return static_outputs(config, fallback, request), "fallback:static"
        if request.expired():
            return None, ""  # a cheaper model cannot answer in time either
        try:
            other = self.models.get(fallback.model)
            child = replace(request, model=fallback.model, version=None, future=None)
            answer = await self.infer(child, other, depth + 1)
        except FALLBACK_ON:
            return None, ""
        return answer.outputs, f"fallback:model:{fallback.model}"


class Context:
    """The `InferContext` of one composed request: steps inherit its deadline, its priority
    and its sequence (as Triton passes an ensemble's correlation id on to its steps)."""

    __slots__ = ("depth", "executor", "parent")

    def __init__(self, executor: Executor, parent: InferRequest, depth: int) -> None:
        self.executor = executor
        self.parent = parent
        self.depth = depth

    @property
    def request(self) -> InferRequest:
        return self.parent

    async def infer(self, model: str, inputs: Arrays, version: int | None = None) -> Arrays:
        served = self.executor.models.get(model, version)
        datatypes = {name: datatype_of(array) for name, array in inputs.items()}
        rows = validate_inputs(served.config, inputs, datatypes)
        request = InferRequest(
            model=model,
            inputs=inputs,
            version=served.version,
            deadline=self.parent.deadline,
            soft_deadline=self.parent.soft_deadline,
            priority=self.parent.priority,
            id=self.parent.id,
            rows=rows,
            arrival=time.monotonic(),
            sequence=self.parent.sequence,  # a stateful step continues the caller's sequence
        )
        answer = await self.executor.infer(request, served, self.depth)
        return answer.outputs


def static_outputs(config: ModelConfig, fallback: Fallback, request: InferRequest) -> Arrays:
    """The fallback's fixed row values, repeated for every row of the request."""
    outputs: Arrays = {}
    for name, row in fallback.static.items():
        spec = config.output(name)
        dtype = object if spec is None or spec.datatype == "BYTES" else numpy_dtype(spec.datatype)
        value = np.asarray(row, dtype=dtype)
        if config.batching:
            value = np.repeat(value[np.newaxis, ...], request.rows, axis=0)
        outputs[name] = value
    if request.outputs is not None:
        outputs = {k: v for k, v in outputs.items() if k in request.outputs}
    return outputs
