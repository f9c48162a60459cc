"""Model statistics through the router: Triton's statistics extension (`GET /v2/models/stats`,
`/v2/models/{m}/stats`, `/v2/models/{m}/versions/{v}/stats`, gRPC `ModelStatistics`) asked of
every usable replica at once and summed per model and version, so that a client that reads
them before and after a measurement (perf_analyzer, tritonclient's `get_inference_statistics`)
sees what all the replicas did, not what the one replica the balancer picked did.

- **Merging** (`merged`, pure): the replicas' `model_stats` entries of the same `name` and
  `version` are one entry. Every count and ns total sums (`inference_count`,
  `execution_count`, each duration of `inference_stats`, and any other object of numbers);
  `last_inference` is the latest; `batch_stats` sum per `batch_size`. Entries come in the
  order first seen, replica by replica in the pool's order; batch sizes in increasing order.
- **Fan-out** (`Statistics.gather`): the request, with the client's headers (its
  `authorization`), goes over HTTP to every usable replica (ready, not ejected) of every group
  but those a shadow copies to (their requests are copies of client requests), within the
  request's deadline. Over gRPC the same request is sent the same way, to the replicas' HTTP
  ports, and the merged document answered as a `ModelStatisticsResponse`.
- **A replica that does not answer** (no connection, a 5xx, an answer that is not statistics,
  or none before the deadline) is left out of the sum: the answer is still 200, and says so in
  the headers `x-lockgate-statistics-replicas: ANSWERED/ASKED` (on every answer) and
  `x-lockgate-statistics-missing` (each replica left out and why); over gRPC, the same keys in
  the trailing metadata. A client that compares two reads sees a count go down when a
  replica was left out of the second: those headers say when.
  When no replica answered: 503 (`Retry-After: 1`; 504 when the deadline passed first). When
  none answered 200 but some answered 4xx (an unknown model or version: 404), the first such
  answer, in the pool's order, is passed on; a replica that answers 404 while others answer
  200 (it lacks that model) adds nothing to the sum.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from lockgate.core.metrics import Registry
from lockgate.router.groups import ReplicaGroups
from lockgate.router.pool import ReplicaPool
from lockgate.router.replica import Replica
from lockgate.router.whole_answer import DEADLINE, whole_answer

Document = dict[str, Any]
_encode = msgspec.json.Encoder().encode
_PREFIX = ("v2", "models")
LATEST = "last_inference"  # the one field that is the latest of the replicas', not their sum
BATCHES = "batch_stats"  # summed per batch size
REPLICAS_HEADER = b"x-lockgate-statistics-replicas"
MISSING_HEADER = b"x-lockgate-statistics-missing"
# the router's own, for each replica: its deadline then, and a plain answer it reads itself
_OWN_HEADERS = frozenset({b"request-timeout", b"accept-encoding"})
_MAX_REASON = 200  # characters of one replica's failure in the missing header


class NotStatistics(ValueError):
    """A replica's answer that is not a statistics document."""


@dataclass(frozen=True, slots=True)
class StatisticsRequest:
    """Which statistics are asked: of every model (`model` None), of every version of one
    model, or of one version; `version` without `model` (gRPC only): that version of every
    model."""

    model: str | None = None
    version: str | None = None

    @classmethod
    def parse(cls, method: str, path: str) -> StatisticsRequest | None:
        """The statistics an HTTP request asks for; None when it asks for none."""
        if method != "GET":
            return None
        parts = [p for p in path.split("/") if p]
        if parts[:2] != list(_PREFIX) or parts[-1:] != ["stats"]:
            return None
        rest = parts[2:-1]
        if not rest:
            return cls()
        if len(rest) == 1:
            return cls(rest[0])
        if len(rest) == 3 and rest[1] == "versions":
            return cls(rest[0], rest[2])
        return None

    @property
    def path(self) -> str:
        """The path each replica is asked on."""
        if self.model is None:
            return "/v2/models/stats"
        model = urllib.parse.quote(self.model, safe="")
        if self.version is None:
            return f"/v2/models/{model}/stats"
        return f"/v2/models/{model}/versions/{urllib.parse.quote(self.version, safe='')}/stats"

    @property
    def wanted_version(self) -> str | None:
        """The version the merged answer keeps (the replicas kept it already when the path
        names the model); None: every version."""
        if self.model is not None or self.version is None:
            return None
        text = self.version
        return str(int(text)) if text.isascii() and text.isdigit() and len(text) <= 18 else text


# -- merging -------------------------------------------------------------------------------


def entries(document: Any) -> list[Document]:
    """The `model_stats` of a replica's answer; NotStatistics when it has none of that shape."""
    if not isinstance(document, dict):
        raise NotStatistics("not a JSON object")
    found = document.get("model_stats")
    if not isinstance(found, list):
        raise NotStatistics("no model_stats list")
    for entry in found:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("version"), str)
        ):
            raise NotStatistics("a model_stats entry without a name and a version")
    return found


def merged(documents: Iterable[Any], version: str | None = None) -> Document:
    """The statistics of several replicas as one document (the module's docstring says how);
    `version`: keep only that version's entries. NotStatistics for a document of another
    shape."""
    by_key: dict[tuple[str, str], Document] = {}
    for document in documents:
        for entry in entries(document):
            key = (entry["name"], entry["version"])
            if version is not None and key[1] != version:
                continue
            known = by_key.get(key)
            by_key[key] = _copy(entry) if known is None else _added(known, entry)
    return {"model_stats": list(by_key.values())}


def _copy(entry: Document) -> Document:
    return _added({"name": entry["name"], "version": entry["version"]}, entry)


def _added(total: Document, entry: Document) -> Document:
    """`entry` added into `total` (an entry of the same model and version), field by field."""
    for name, value in entry.items():
        if name in ("name", "version"):
            continue
        if name == BATCHES:
            total[name] = _batches(total.get(name, []), value)
        elif name == LATEST:
            total[name] = max(_number(total.get(name, 0), name), _number(value, name))
        else:
            total[name] = _sum(total.get(name), value)
    return total


def _sum(total: Any, value: Any) -> Any:
    """Numbers sum; objects sum field by field; anything else (or a field of another shape
    on another replica) keeps the first replica's."""
    if isinstance(value, dict):
        base = total if isinstance(total, dict) else {}
        return {**base, **{key: _sum(base.get(key), item) for key, item in value.items()}}
    if total is None:
        return value
    if _numeric(total) and _numeric(value):
        return total + value
    return total


def _batches(total: Any, value: Any) -> list[Document]:
    """batch_stats summed per batch size, in increasing order of it."""
    by_size: dict[int, Document] = {}
    for batch in [*_batch_list(total), *_batch_list(value)]:
        size = batch["batch_size"]
        known = by_size.get(size)
        if known is None:
            by_size[size] = {"batch_size": size}
            known = by_size[size]
        for name, item in batch.items():
            if name != "batch_size":
                known[name] = _sum(known.get(name), item)
    return [by_size[size] for size in sorted(by_size)]


def _batch_list(value: Any) -> list[Document]:
    if not isinstance(value, list) or not all(
        isinstance(b, dict) and isinstance(b.get("batch_size"), int) for b in value
    ):
        raise NotStatistics(f"{BATCHES} is not a list of batch sizes")
    return value


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: Any, name: str) -> int | float:
    if _numeric(value):
        return value  # type: ignore[no-any-return]
    raise NotStatistics(f"{name} is not a number")


# -- the fan-out ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Asked:
    """One replica's answer to a statistics request: its status (0: none) and body, or why
    it gave none."""

    replica: Replica
    status: int
    body: bytes = b""
    why: str = ""
    document: Any = None  # a 200's statistics, parsed

    @property
    def counted(self) -> bool:
        """An answer that goes into the sum (or, as a 4xx, stands for the replica's)."""
        return self.status == 200 or 400 <= self.status < 500

    @property
    def reason(self) -> str:
        text = self.why or f"status {self.status}"
        return text[:_MAX_REASON].replace(";", ",")


@dataclass(frozen=True, slots=True)
class Gathered:
    """The router's answer: its status, JSON body and the headers that say which replicas it
    sums."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @property
    def message(self) -> str:
        """The error an answer other than 200 gives."""
        try:
            error = msgspec.json.decode(self.body).get("error", "")
        except (msgspec.DecodeError, AttributeError):
            error = ""
        return str(error) or f"status {self.status}"

    @classmethod
    def of(cls, request: StatisticsRequest, asked: Sequence[Asked]) -> Gathered:
        answered = [a for a in asked if a.counted]
        missing = [a for a in asked if not a.counted]
        headers = [(REPLICAS_HEADER, b"%d/%d" % (len(answered), len(asked)))]
        if missing:
            where = "; ".join(f"{a.replica.url} ({a.reason})" for a in missing)
            headers.append((MISSING_HEADER, where.encode("ascii", "replace")))
        ok = [a.document for a in answered if a.status == 200]
        if ok:
            body = _encode(merged(ok, request.wanted_version))
            return cls(200, body, tuple(headers))
        if answered:  # every replica that answered refused the request itself (404, 400)
            return cls(answered[0].status, answered[0].body, tuple(headers))
        if not asked:
            headers.append((b"retry-after", b"1"))
            return cls(503, _error("no replica is ready"), tuple(headers))
        status = 504 if all(a.why == DEADLINE for a in missing) else 503
        if status == 503:
            headers.append((b"retry-after", b"1"))
        where = "; ".join(f"{a.replica.url}: {a.reason}" for a in missing)
        return cls(
            status, _error(f"no replica answered for its statistics: {where}"), tuple(headers)
        )


def _error(message: str) -> bytes:
    return _encode({"error": message})


class Statistics:
    """Asks the replicas for their statistics and answers with their sum."""

    def __init__(
        self,
        pool: ReplicaPool,
        groups: ReplicaGroups,
        copies: Collection[str],
        registry: Registry,
    ) -> None:
        self.pool = pool
        self.groups = groups
        self.copies = frozenset(copies)  # the groups a shadow copies requests to: not asked
        self.asked = registry.counter(
            "lockgate_router_statistics_replicas_total",
            "Replicas asked for their model statistics, by outcome ('answered': summed, or a "
            "4xx passed on; 'missing': left out of the sum).",
            ("outcome",),
        )

    def replicas(self, now: float) -> list[Replica]:
        """The replicas asked: usable, and not a shadow's."""
        return [
            r
            for r in self.pool.replicas
            if r.usable(now) and self.groups.group(r) not in self.copies
        ]

    async def gather(
        self,
        request: StatisticsRequest,
        headers: Sequence[tuple[bytes, bytes]],
        deadline: float | None,
    ) -> Gathered:
        """Ask every replica at once (`deadline`: on the monotonic clock, None for none) and
        answer for all of them."""
        sent = [
            (k, v) for k, v in headers if k not in _OWN_HEADERS and not k.startswith(b"content-")
        ]
        targets = self.replicas(time.monotonic())
        asked = await asyncio.gather(*(self._ask(r, request, sent, deadline) for r in targets))
        for a in asked:
            self.asked.inc(("answered" if a.counted else "missing",))
        return Gathered.of(request, asked)

    async def _ask(
        self,
        replica: Replica,
        request: StatisticsRequest,
        headers: list[tuple[bytes, bytes]],
        deadline: float | None,
    ) -> Asked:
        answer = await whole_answer(replica, "GET", request.path, headers, b"", deadline)
        if answer.status == 0:
            return Asked(replica, 0, why=answer.why)
        data = answer.body
        if answer.status != 200:
            return Asked(replica, answer.status, data)
        try:
            document = msgspec.json.decode(data)
            entries(document)
            merged([document])  # every field of a shape the sum takes
        except (msgspec.DecodeError, NotStatistics) as exc:
            return Asked(replica, 0, why=f"not statistics: {exc}")
        return Asked(replica, 200, data, document=document)
