"""Model lifecycle: load, warm up, profile, serve, reload, drain, unload. One `ModelManager`
per server, for every kind of model: classic models get instances behind a dynamic batcher,
language models (`backend: llm`) a service with its own engine, through the same load and
unload API, readiness and reload without a gap.

A model version reports ready only after its warmup has run. A model that fails to load is
kept with its error, so the readiness endpoint can say why, and the other models serve on.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lockgate.backends.base import (
    LLM_BACKEND,
    Arrays,
    Backend,
    ModelService,
    get_factory,
    get_service_factory,
    model_file,
)
from lockgate.config import EnsembleStep, ModelConfig
from lockgate.core.admission import AdmissionSettings
from lockgate.core.batcher import Arriving, Batcher, batch_bytes
from lockgate.core.fingerprint import version_fingerprint
from lockgate.core.labels import read_labels
from lockgate.core.metrics import Instrumented, Registry
from lockgate.core.request import InferRequest
from lockgate.core.reshape import Reshaped
from lockgate.core.runner import Instance, instance_thread
from lockgate.core.sequence_batcher import DEFAULT_MAX_SEQUENCES, SequenceBatcher, max_sequences
from lockgate.core.serving_metrics import ServingMetrics
from lockgate.core.slo import ServiceProfile
from lockgate.core.warmup import profile_sample, sample_batch, synthetic_batch
from lockgate.errors import BadRequest, ConfigError, NotFound, Unavailable

if TYPE_CHECKING:
    from lockgate.core.bare_model import BareModel

log = logging.getLogger("lockgate.models")


class ModelState(Enum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


@dataclass(slots=True)
class ServedVersion:
    config: ModelConfig
    version: int
    path: Path  # the version folder, which the backend loads from
    folder: Path  # the model folder: label files, warmup data
    state: ModelState = ModelState.LOADING
    error: str = ""
    batcher: Batcher | None = None
    sequences: SequenceBatcher | None = None  # a stateful model's, around its batcher
    service: ModelService | None = None  # a model with its own scheduler (a language model)
    load_seconds: float = 0.0
    warmup_seconds: float = 0.0
    last_inference_ms: int = 0
    finite_inputs: bool = False  # the backend refuses NaN and Inf in float inputs
    fingerprint: str = ""  # of its config and files (`core.fingerprint`); "": a language model
    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)  # output -> class names

    @property
    def serving(self) -> bool:
        """Ready, and with at least one healthy instance (not all of them restarting)."""
        if self.state is not ModelState.READY:
            return False
        if self.batcher is None:
            return True
        instances = self.batcher.instances
        if len(instances) == 1:  # the common case, on every request: no generator
            return instances[0].healthy
        return any(i.healthy for i in instances)


@dataclass(slots=True)
class ServedModel:
    name: str
    path: Path
    config: ModelConfig | None
    versions: dict[int, ServedVersion] = field(default_factory=dict)
    error: str = ""
    bare: bool = False  # one model file served as it is: `path` is its folder and version 1's

    def version_dir(self, version: int) -> Path:
        return self.path if self.bare else self.path / str(version)

    @property
    def failures(self) -> list[str]:
        """Why each version that failed to load failed, as "version N: reason"."""
        return [
            f"version {v}: {served.error}"
            for v, served in sorted(self.versions.items())
            if served.error
        ]

    def latest_ready(self) -> ServedVersion | None:
        if len(self.versions) == 1:  # the common case, on every request: no sort
            (served,) = self.versions.values()
            return served if served.serving else None
        for version in sorted(self.versions, reverse=True):
            if self.versions[version].serving:
                return self.versions[version]
        return None


PROFILE_BUDGET_S = 0.25  # seconds of timed runs per batch size at most (one at least)


@dataclass(frozen=True, slots=True)
class ServingSettings:
    hang_timeout: float | None = 30.0  # seconds a batch may run before its instance restarts
    profile_repeats: int = 5  # runs per batch size when profiling T(B) at warmup
    unload_drain_timeout: float = 30.0  # seconds an unloaded or replaced version may drain
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    language_models: bool = True  # False: `backend: llm` models are listed, not loaded
    # the repository's models loaded at start-up (None: all); explicit model control mode
    # loads only those of --load-model, as in Triton
    startup_models: frozenset[str] | None = None
    # poll mode: seconds between looks at the repository for changes (None: no polling)
    repository_poll_s: float | None = None
    # live sequences of a stateful model version whose config sets no max_candidate_sequences
    max_sequences: int = DEFAULT_MAX_SEQUENCES


class ModelManager:
    def __init__(self, registry: Registry, settings: ServingSettings | None = None) -> None:
        self.registry = registry
        self.metrics = ServingMetrics.create(registry)
        self.settings = settings or ServingSettings()
        self.models: dict[str, ServedModel] = {}
        self.repository: Path | None = None  # the repository loaded from, once known
        # T(B) is measured one model at a time: models that load together would otherwise
        # share the cores while timed, and start with a profile several times too slow,
        # which refuses their first requests
        self._profiling = threading.Lock()
        # versions loading or warming up now: their threads hold the GIL in Python code for
        # seconds, which lags the event loop without any request being the cause
        self.loading = 0
        # requests the front end read this loop turn whose handlers have not yet started:
        # a cheap model's batch waits for the last of them (`Arriving`)
        self.arriving = Arriving()

    # -- lookup ------------------------------------------------------------------------
    def get(self, name: str, version: int | None = None) -> ServedVersion:
        model = self.models.get(name)
        if model is None:
            raise NotFound(f"unknown model '{name}'")
        if version is None:
            served = model.latest_ready()
            if served is None:
                reason = model.error or self._why_not_ready(model)
                raise Unavailable(f"model '{name}' is not ready: {reason}", retry_after=1)
            self._check_steps(name, served.config)
            return served
        served_version = model.versions.get(version)
        if served_version is None:
            raise NotFound(f"unknown version {version} of model '{name}'")
        if not served_version.serving:
            reason = served_version.error or served_version.state.value.lower()
            if served_version.state is ModelState.READY:
                reason = "every instance is restarting"
            raise Unavailable(
                f"model '{name}' version {version} is not ready: {reason}", retry_after=1
            )
        self._check_steps(name, served_version.config)
        return served_version

    def _check_steps(self, name: str, config: ModelConfig) -> None:
        """A composition is ready when every model it runs is, and takes and gives the tensors
        its ensemble steps map: 503 naming the first that does not (an ensemble whose step was
        unloaded answered 404 for the step, and one that maps a tensor its step model lacks
        answered every request with 500)."""
        if not config.ensemble and config.cascade is None:
            return  # not a composition: the request path's common case
        for step, version in config.runs:
            if self._step(step, version) is None:
                which = f"'{step}'" if version is None else f"'{step}' version {version}"
                raise Unavailable(
                    f"model '{name}' is not ready: the model {which} it runs is not loaded "
                    "or not ready",
                    retry_after=1,
                )
        for ensemble_step in config.ensemble:
            served = self._step(ensemble_step.model, ensemble_step.version)
            problem = "" if served is None else _step_problem(ensemble_step, served.config)
            if problem:
                raise Unavailable(f"model '{name}' is not ready: {problem}", retry_after=1)

    def _check_decoupled_steps(self, config: ModelConfig) -> None:
        """Refuse to load an ensemble with a decoupled step among the models known now (those
        of a repository being loaded are all known); a step that becomes decoupled later makes
        the ensemble not ready (`_check_steps`)."""
        for index, step in enumerate(config.ensemble):
            known = self.models.get(step.model)
            if known is not None and known.config is not None and known.config.decoupled:
                field = f"ensemble_scheduling.step[{index}]"
                raise ConfigError(config.source or config.name, field, _decoupled_step(step))

    def _step(self, name: str, version: int | None) -> ServedVersion | None:
        """The version of `name` a composition runs, if it serves."""
        model = self.models.get(name)
        if model is None:
            return None
        if version is None:
            return model.latest_ready()
        served = model.versions.get(version)
        return served if served is not None and served.serving else None

    @staticmethod
    def _why_not_ready(model: ServedModel) -> str:
        errors = [v.error for v in model.versions.values() if v.error]
        if errors:
            return errors[0]
        return "loading" if model.versions else "no version to serve"

    async def infer(self, request: InferRequest) -> Arrays:
        served = self.get(request.model, request.version)
        if served.batcher is None:  # a model with its own scheduler
            raise BadRequest(
                f"model '{request.model}' is a language model: use /v1/completions "
                "or /v1/chat/completions"
            )
        if served.finite_inputs:
            _check_finite(request)
        if served.sequences is not None:
            result = await served.sequences.submit(request)
        else:
            result = await served.batcher.submit(request)
        served.last_inference_ms = int(time.time() * 1000)
        return result

    # -- loading -----------------------------------------------------------------------
    async def load_repository(self, root: Path, bare: BareModel | None = None) -> None:
        """Load every model of a repository, concurrently, or the one `bare` model file that
        `root` names. Failures are kept, not raised."""
        from lockgate.core.bare_model import bare_entry
        from lockgate.core.repository import scan_repository

        start = time.monotonic()
        self.repository = None if bare else root  # a bare model's folder lists no others
        chosen = None if bare else self.settings.startup_models
        scanned = [bare_entry(bare)] if bare else scan_repository(root)
        if chosen is not None:
            for name in sorted(chosen - {e.name for e in scanned}):
                log.error("--load-model %s: no such model in the repository %s", name, root)
        entries = [
            e
            for e in scanned
            if (chosen is None or e.name in chosen)
            and (
                self.settings.language_models or e.config is None or e.config.backend != LLM_BACKEND
            )
        ]
        await asyncio.gather(
            *(
                self.load_model(e.name, e.path, e.config, e.versions, e.error, bare=e.bare)
                for e in entries
            )
        )
        ready = sum(1 for m in self.models.values() if m.latest_ready() is not None)
        log.info(
            "repository %s: %d of %d models ready in %.2f s",
            root,
            ready,
            len(entries),
            time.monotonic() - start,
        )

    async def load_model(
        self,
        name: str,
        path: Path,
        config: ModelConfig | None,
        versions: list[int],
        error: str | None = None,
        *,
        bare: bool = False,
    ) -> ServedModel:
        """Load a model, or reload one already served without a gap: the old versions keep
        serving until the new ones are warm, then drain. A reload in which a version fails
        leaves the old model serving and returns the failed one, with its errors (as Triton,
        which keeps the loaded versions when any new one fails)."""
        old = self.models.get(name)
        model = ServedModel(name, path, config, error=error or "", bare=bare)
        if old is None:
            self.models[name] = model  # listed at once, with readiness "loading"
        if config is None or error:
            log.error("model %s not loaded: %s", name, error)
        else:
            if not versions:
                model.error = f"no version folder under {path} matches the version policy"
            await asyncio.gather(*(self._load_version(model, config, v) for v in versions))
        if old is not None:
            await self._replace(old, model)
        return model

    async def _replace(self, old: ServedModel, new: ServedModel) -> None:
        failed = new.latest_ready() is None or bool(new.failures)
        if failed and old.latest_ready() is not None:
            log.error("model %s reload failed, the loaded versions serve on", old.name)
            serving = {v for v, s in old.versions.items() if s.state is ModelState.READY}
            await self._retire(new, keep=serving)
            for version in serving:  # the failed load set them to 0 as it began
                self.metrics.model_ready.set((old.name, str(version)), 1)
            return
        self.models[new.name] = new
        ready = {v for v, s in new.versions.items() if s.state is ModelState.READY}
        await self._retire(old, keep=ready)
        log.info("model %s reloaded: versions %s", new.name, sorted(ready))

    async def _load_version(self, model: ServedModel, config: ModelConfig, version: int) -> None:
        served = ServedVersion(config, version, model.version_dir(version), model.path)
        model.versions[version] = served
        labels = (model.name, str(version))
        loaded = self.models.get(model.name)
        replaced = None if loaded is None else loaded.versions.get(version)
        if replaced is None or replaced is served or not replaced.serving:
            self.metrics.model_ready.set(labels, 0)  # else it serves on until replaced
        self.loading += 1
        try:
            await self._start(served)
        except Exception as exc:
            served.state = ModelState.FAILED
            served.error = f"{type(exc).__name__}: {exc}"
            log.error("model %s version %d failed to load: %s", model.name, version, served.error)
            return
        finally:
            self.loading -= 1
        served.state = ModelState.READY
        self.metrics.model_ready.set(labels, 1)
        log.info(
            "model %s version %d ready: load %.2f s, warmup %.2f s, %d instance(s)",
            model.name,
            version,
            served.load_seconds,
            served.warmup_seconds,
            served.config.instance_count,
        )

    async def _start(self, served: ServedVersion) -> None:
        loop = asyncio.get_running_loop()
        config, labels = served.config, (served.config.name, str(served.version))
        served.labels = read_labels(config, served.folder)
        if config.backend != LLM_BACKEND:  # weights of gigabytes; their cache keys differ
            bare = served.path == served.folder  # its folder may hold anything else
            only = model_file(config, served.path) if bare else None
            served.fingerprint = await loop.run_in_executor(
                None, version_fingerprint, config, served.path, only
            )
        # past an await: every model of a repository loaded at once is listed by now
        self._check_decoupled_steps(config)
        service_factory = get_service_factory(config.backend)
        if service_factory is not None:  # loads and warms up in one call
            start = time.monotonic()
            service = await loop.run_in_executor(None, service_factory, config, served.path)
            if service is not None and config.sequence_batching is not None:
                await loop.run_in_executor(None, service.close)
                raise ConfigError(
                    config.source,
                    "sequence_batching",
                    "this model calls other models, outside the batcher: it cannot keep "
                    "sequences (a stateful model computes its own answer)",
                )
            if service is not None:
                if isinstance(service, Instrumented):
                    service.instrument(self.registry)
                served.service = service
                served.load_seconds = time.monotonic() - start
                self.metrics.load_seconds.set(labels, served.load_seconds)
                return
        factory = get_factory(config.backend)
        start = time.monotonic()

        def build() -> Backend:
            backend = factory(config, served.path)
            return Reshaped(backend, config) if config.reshapes else backend

        # each instance is loaded, warmed up and profiled on the thread that will run it
        names = [f"{config.name}-{served.version}-{i}" for i in range(config.instance_count)]
        threads = [instance_thread(name) for name in names]
        try:
            backends = await asyncio.gather(
                *(loop.run_in_executor(thread, build) for thread in threads)
            )
        except BaseException:
            for thread in threads:
                thread.shutdown(wait=False)
            raise
        served.load_seconds = time.monotonic() - start
        served.finite_inputs = bool(getattr(backends[0], "finite_inputs", False))
        self.metrics.load_seconds.set(labels, served.load_seconds)
        instances = [
            Instance(
                name,
                backend,
                hang_timeout=self.settings.hang_timeout,
                reload=build,
                executor=thread,
            )
            for name, backend, thread in zip(names, backends, threads, strict=True)
        ]
        start = time.monotonic()
        profile = ServiceProfile(max(1, config.max_batch_size))
        await asyncio.gather(
            *(
                loop.run_in_executor(i.executor, self._warm, config, served.folder, i)
                for i in instances
            )
        )
        timed = await loop.run_in_executor(
            instances[0].executor,
            self._measure,
            config,
            served.folder,
            instances[0],
            profile,
        )
        served.warmup_seconds = time.monotonic() - start
        self.metrics.warmup_seconds.set(labels, served.warmup_seconds)
        batcher = Batcher(
            config,
            served.version,
            instances,
            self.metrics,
            profile,
            self.settings.admission,
            self.arriving,
        )
        if config.batching:
            batcher.warmed(timed)
        for instance in instances:
            instance.on_replaced = batcher.instance_ready
        batcher.start()
        served.batcher = batcher
        if config.sequence_batching is not None:
            limit = max_sequences(config, self.settings.max_sequences)
            served.sequences = SequenceBatcher(config, served.version, batcher, self.metrics, limit)

    def _warm(self, config: ModelConfig, folder: Path, instance: Instance) -> None:
        """Run the configured warmup samples on an instance (on its own thread)."""
        for sample in config.warmup:
            inputs = sample_batch(config, folder, sample, sample.batch_size)
            for _ in range(sample.count):
                instance.infer_sync(inputs)

    def _measure(
        self, config: ModelConfig, folder: Path, instance: Instance, profile: ServiceProfile
    ) -> dict[int, int]:
        """Measure T(B) on an instance (on its own thread, where traffic will run it). Returns
        the input bytes of the batch timed at each size."""
        if not config.inputs:
            return {}
        sizes = _profile_sizes(config.max_batch_size) if config.batching else [1]
        with self._profiling:
            timed = self._profile(instance, config, folder, sizes, profile)
        profile.seal()  # traffic's own batches replace what synthetic inputs measured
        return timed

    def _profile(
        self,
        instance: Instance,
        config: ModelConfig,
        folder: Path,
        sizes: list[int],
        profile: ServiceProfile,
    ) -> dict[int, int]:
        """T(B) on the warmup's data from a file when a sample gives one, else on random."""
        timed = {}
        sample = profile_sample(config)
        slo = config.latency_slo_ms / 1000 if config.latency_slo_ms else None
        for rows in sizes:
            if sample is not None:
                inputs = sample_batch(config, folder, sample, rows)
            else:
                inputs = synthetic_batch(config, rows, "random")
            timed[rows] = batch_bytes(inputs)
            t0 = time.perf_counter()
            instance.infer_sync(inputs)  # first run at a new shape pays for allocation
            first = time.perf_counter() - t0
            # a slow size is timed fewer times (traffic's batches replace these figures)
            repeats = min(self.settings.profile_repeats, int(PROFILE_BUDGET_S / first) + 1)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                instance.infer_sync(inputs)
                times.append(time.perf_counter() - t0)
            median = statistics.median(times)
            profile.observe(rows, median)
            if slo is not None and 2 * median > slo:
                break  # no batch this size or larger fits the SLO: the cap stays below it
        return timed

    def services(self) -> list[ModelService]:
        """The services of every serving version of a model with its own scheduler."""
        return [
            s.service
            for m in self.models.values()
            for s in m.versions.values()
            if s.service is not None and s.serving
        ]

    # -- unloading ---------------------------------------------------------------------
    async def unload(self, name: str) -> None:
        model = self.models.pop(name, None)
        if model is None:
            raise NotFound(f"unknown model '{name}'")
        await self._retire(model, keep=set())

    async def _retire(self, model: ServedModel, keep: set[int]) -> None:
        """Drain and close every version of `model`; versions in `keep` live on elsewhere, so
        their readiness gauge stays."""
        for served in model.versions.values():
            served.state = ModelState.UNLOADING
            if served.version not in keep:
                self.metrics.model_ready.set((model.name, str(served.version)), 0)
            if served.batcher is not None:
                await served.batcher.drain(timeout=self.settings.unload_drain_timeout)
                await served.batcher.close()
            if served.sequences is not None:
                served.sequences.close()
            if served.service is not None:
                await served.service.drain(self.settings.unload_drain_timeout)
                await asyncio.get_running_loop().run_in_executor(None, served.service.close)

    async def drain(self, timeout: float) -> bool:
        """Stop intake on every model and wait for admitted requests. True if all finished."""
        versions = [s for m in self.models.values() for s in m.versions.values()]
        batchers = [s.batcher.drain(timeout) for s in versions if s.batcher is not None]
        services = [s.service.drain(timeout) for s in versions if s.service is not None]
        results = await asyncio.gather(*batchers, *services)
        return all(results)

    async def close(self) -> None:
        for name in list(self.models):
            await self.unload(name)

    def ready(self) -> bool:
        """Server readiness: every model that has a valid config has a ready version."""
        return all(
            m.latest_ready() is not None for m in self.models.values() if m.config is not None
        )


def _step_problem(step: EnsembleStep, config: ModelConfig) -> str:
    """Why an ensemble cannot run `step` on the model `config` describes ("" if it can)."""
    return _decoupled_step(step) if config.decoupled else _unmapped(step, config)


def _decoupled_step(step: EnsembleStep) -> str:
    return (
        f"its step '{step.model}' is decoupled (model_transaction_policy {{ decoupled: true }}): "
        "an ensemble runs models that answer each request once; stream that model's responses "
        "on its own (gRPC ModelStreamInfer or /generate_stream)"
    )


def _unmapped(step: EnsembleStep, config: ModelConfig) -> str:
    """What an ensemble step maps that its model does not take or give ("" if nothing; a
    model that declares no tensors is not checked)."""
    for kind, names, specs in (
        ("input", step.input_map, config.inputs),
        ("output", step.output_map, config.outputs),
    ):
        known = [spec.name for spec in specs]
        for tensor in names:
            if known and tensor not in known:
                return (
                    f"its step '{step.model}' maps the {kind} '{tensor}', which that model does "
                    f"not have ({kind}s: {', '.join(known)})"
                )
    return ""


def _check_finite(request: InferRequest) -> None:
    for name, array in request.inputs.items():
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise BadRequest(
                f"input '{name}' holds NaN or Inf, which model '{request.model}' does not accept"
            )


def _profile_sizes(max_batch_size: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch_size)
    return sizes
