"""Triton's trace extension: the trace settings of the server and of each model, and which
requests they sample. Bookkeeping only: `frontend/otel.py` asks `sample` of each traced
request and makes its spans.

The settings and their shapes are Triton's (`GET|POST /v2[/models/{m}]/trace/setting`, gRPC
`TraceSetting`); every value is a string, `trace_level` a list of them:

    trace_level  ["OFF"]: no request traced; ["TIMESTAMPS"]: requests traced with the times
                 of their phases (`frontend/otel.py`). "TENSORS" is refused: lockgate's spans
                 carry no tensor data.
    trace_rate   "N": one request traced in every N (1 to 2^32 - 1), counted per setting
    trace_count  "N": N more requests traced, then none ("-1": no limit); it counts down as
                 requests are traced, and reads as what is left
    trace_mode   "opentelemetry" (read only): spans leave over OTLP/HTTP
    log_frequency, trace_file: Triton's trace files, which lockgate does not write: refused
                 (a null log_frequency, which asks for nothing, is accepted)

A model with settings of its own uses them; the settings it does not set follow the global
ones, now and when they change. A null value (REST) or an empty list (gRPC) clears a setting:
a model's then follows the global one again, and a global one returns to the server's start-up
value. A model with no setting left uses the global settings. Each setting (the global one,
or a model's) counts its own requests for trace_rate and trace_count, from the moment it was
last set, as in Triton.

A request that arrives with a W3C `traceparent` is traced whenever its setting's level is
TIMESTAMPS, whatever trace_rate and trace_count say (the caller sampled it: Triton's
OpenTelemetry mode does the same); it is still counted towards trace_rate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lockgate.errors import BadRequest

MAX_RATE = 2**32 - 1  # uint32, as in Triton
MAX_COUNT = 2**31 - 1  # int32, as in Triton
TRACE_MODE = "opentelemetry"
LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
NAMES = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file", "trace_mode")
SETTINGS = {"trace_level": "timestamps", "trace_rate": "rate", "trace_count": "count"}
NO_EXPORTER = (
    "tracing needs an OpenTelemetry collector: start lockgate with --otel-endpoint URL "
    "(and the lockgate[otel] extra)"
)


@dataclass(frozen=True, slots=True)
class TraceValues:
    """What one setting says: trace at all, one in `rate` requests, `count` more (-1: no
    limit)."""

    timestamps: bool = True
    rate: int = 1
    count: int = -1

    def __post_init__(self) -> None:
        if not 1 <= self.rate <= MAX_RATE:
            raise ValueError(f"the trace rate must be 1 to {MAX_RATE}, got {self.rate}")
        if not -1 <= self.count <= MAX_COUNT:
            raise ValueError(
                f"the trace count must be -1 (no limit) to {MAX_COUNT}, got {self.count}"
            )

    def document(self) -> dict[str, list[str]]:
        """Triton's shape, every value a list of strings (REST shows the scalars unwrapped)."""
        return {
            "trace_level": ["TIMESTAMPS" if self.timestamps else "OFF"],
            "trace_rate": [str(self.rate)],
            "trace_count": [str(self.count)],
            "trace_mode": [TRACE_MODE],
        }


@dataclass(slots=True)
class TraceScope:
    """The setting the requests of one model (or of the server) are sampled by: its values,
    those set on it (the rest follow the setting above it), and its count of requests."""

    values: TraceValues
    specified: frozenset[str] = frozenset()  # TraceValues fields set on this scope
    seen: int = 0  # requests counted since the setting was made

    def sample(self, parented: bool) -> bool:
        """Whether a request arriving now is traced; `parented`: it carries a caller's trace."""
        values = self.values
        if not values.timestamps:
            return False
        if values.count == 0:  # spent
            return parented
        self.seen += 1
        if self.seen % values.rate:
            return parented
        if values.count > 0:
            self.values = replace(values, count=values.count - 1)
        return True


@dataclass(frozen=True, slots=True)
class TraceChange:
    """A checked change: the fields to set (TraceValues names) and those to clear."""

    set: dict[str, bool | int] = field(default_factory=dict)
    clear: frozenset[str] = frozenset()


class TraceSettings:
    """The global setting and the models' own, over the server's start-up values."""

    def __init__(self, startup: TraceValues, exporting: bool) -> None:
        self.startup = startup if exporting else replace(startup, timestamps=False)
        self.exporting = exporting  # an OTLP exporter is there to send spans to
        self.server = TraceScope(self.startup)
        self.models: dict[str, TraceScope] = {}
        self.tracing = self.startup.timestamps  # some setting's level is TIMESTAMPS

    def of(self, model: str) -> TraceScope:
        """The setting a request to `model` is sampled by."""
        return self.models.get(model) or self.server

    def document(self, model: str = "") -> dict[str, list[str]]:
        return self.of(model).values.document()

    def update(self, model: str, change: TraceChange) -> None:
        """Apply a checked change to `model`'s setting ("": the global one); 400 when the
        result would trace with no exporter."""
        self._update(model, change)
        self.tracing = self.server.values.timestamps or any(
            s.values.timestamps for s in self.models.values()
        )

    def _update(self, model: str, change: TraceChange) -> None:
        if model:
            current = self.models.get(model)
            scope = _rebuilt(current, self.server.values, change)
            self._check(scope)
            if scope.specified:
                self.models[model] = scope
            else:
                self.models.pop(model, None)
            return
        scope = _rebuilt(self.server, self.startup, change)
        self._check(scope)
        self.server = scope
        everything = frozenset(f.name for f in fields(TraceValues))
        for name, own in list(self.models.items()):
            if own.specified != everything:  # it follows the global setting in part
                self.models[name] = _rebuilt(own, scope.values, TraceChange())

    def _check(self, scope: TraceScope) -> None:
        if scope.values.timestamps and not self.exporting:
            raise BadRequest(NO_EXPORTER)


def _rebuilt(current: TraceScope | None, fallback: TraceValues, change: TraceChange) -> TraceScope:
    """A new scope (its counts from zero): `change` over what `current` set, the rest from
    `fallback`. A setting kept from `current` keeps its value (a count, what is left)."""
    kept = (current.specified if current is not None else frozenset()) - change.clear
    values: dict[str, Any] = {}
    for name in kept | change.set.keys():
        if name in change.set:
            values[name] = change.set[name]
        elif current is not None:
            values[name] = getattr(current.values, name)
    return TraceScope(replace(fallback, **values), kept | change.set.keys())


def change_of(settings: Mapping[str, list[str] | None]) -> TraceChange:
    """A change from the wire, each setting as a list of strings (None or []: clear it); 400
    naming the first setting that cannot be applied."""
    sets: dict[str, bool | int] = {}
    clear: set[str] = set()
    for name, values in settings.items():
        _known(name)
        _settable(name, values)
        if name == "log_frequency":
            continue  # cleared: nothing to do
        field_name = SETTINGS[name]
        if not values:
            clear.add(field_name)
        elif name == "trace_level":
            sets[field_name] = _level(values)
        else:
            sets[field_name] = _number(name, values)
    return TraceChange(sets, frozenset(clear))


def _known(name: str) -> None:
    if name not in NAMES:
        raise BadRequest(
            f"unknown trace setting '{str(name)[:200]}' (the settings: {', '.join(NAMES)})"
        )


def _settable(name: str, values: list[str] | None) -> None:
    if name == "trace_file":
        raise BadRequest(
            "trace_file cannot be set (as in Triton, not through the network): lockgate writes "
            "no trace files; its spans go to the OTLP endpoint of --otel-endpoint"
        )
    if name == "trace_mode":
        raise BadRequest(f"trace_mode cannot be changed: lockgate traces with {TRACE_MODE}")
    if name == "log_frequency" and values:
        raise BadRequest(
            "log_frequency is not supported: it paces Triton's trace files, and lockgate "
            "writes none (its spans leave over OTLP as they end)"
        )


def _level(values: list[str]) -> bool:
    for value in values:
        if value not in LEVELS:
            raise BadRequest(
                f"unknown trace level {value!r:.100} (the levels: {', '.join(LEVELS)})"
            )
    if "TENSORS" in values:
        raise BadRequest(
            "trace level TENSORS is not supported: lockgate's spans hold the times of a "
            "request's phases, not its tensors; use TIMESTAMPS"
        )
    if "OFF" in values and len(values) > 1:
        raise BadRequest("trace level OFF must be given alone")
    return values[0] == "TIMESTAMPS"


def _number(name: str, values: list[str]) -> int:
    if len(values) != 1:
        raise BadRequest(f"{name} takes one value, got {len(values)}")
    text = values[0]
    low, high = (1, MAX_RATE) if name == "trace_rate" else (-1, MAX_COUNT)
    try:
        number = int(text) if text.isascii() and len(text) <= 20 else None
    except ValueError:
        number = None
    if number is None or not low <= number <= high:
        raise BadRequest(f"{name} must be an integer from {low} to {high}, got {text!r:.100}")
    return number


def json_change(document: Mapping[str, Any]) -> dict[str, list[str] | None]:
    """A REST request's settings as lists of strings: `trace_level` a list of strings, the
    others one string, any of them null; 400 for another type."""
    found: dict[str, list[str] | None] = {}
    for name, value in document.items():
        _known(name)
        if value is None:
            found[name] = None
        elif name == "trace_level":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise BadRequest('trace_level must be a list of strings, e.g. ["TIMESTAMPS"]')
            if not value:
                raise BadRequest("trace_level must name a level (null clears it)")
            found[name] = value
        elif isinstance(value, str):
            found[name] = [value]
        else:
            raise BadRequest(f'{str(name)[:200]} must be a string, e.g. "1000" (null clears it)')
    return found


def json_document(values: dict[str, list[str]]) -> dict[str, str | list[str]]:
    """The REST shape of a document: trace_level a list, the other settings one string."""
    return {k: v if k == "trace_level" else v[0] for k, v in values.items()}
