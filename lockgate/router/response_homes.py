"""Where the OpenAI Responses API's stored responses live: each replica keeps the responses it
answered in its own memory, so `GET /v1/responses/{id}` (and its `/input_items`), `DELETE
/v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and `POST /v1/responses` with
`previous_response_id` must reach the replica that stored it.

A replica names the id of the response it answers to `POST /v1/responses` in its answer's
head (`x-lockgate-response-id`, streamed or not), and the router keeps the replica of each id,
at most `--responses-table-size` of them (the least recently used is forgotten first). A request
for an id the table does not hold (stored through another router, or forgotten) has its
replica found by asking each usable replica of its group for the response at once
(`GET /v1/responses/{id}`); with none storing it, the router answers 404 itself. Pure
bookkeeping here; the router does the asking.

Only `previous_response_id` is read off a POST's body, and only when the body holds it: the
rest of the body is not decoded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

RESPONSES_PATH = "/v1/responses"
_PREFIX = RESPONSES_PATH + "/"
_MARK = b'"previous_response_id"'
_ITEM_ROUTES = {("input_items", "GET"), ("cancel", "POST")}  # /v1/responses/{id}/...


class _Body(msgspec.Struct):
    previous_response_id: Any = None


_decode = msgspec.json.Decoder(_Body).decode


@dataclass(frozen=True, slots=True)
class ResponseRequest:
    """A request of the Responses API, as the router routes it."""

    rid: str | None  # the stored response it reads, deletes or continues; None: none
    creates: bool = False  # POST: a generation, whose answer names the response it stored
    deletes: bool = False  # DELETE

    @classmethod
    def parse(cls, method: str, path: str, body: bytes) -> ResponseRequest | None:
        """None for a request outside the Responses API (or one the replica answers 404 or
        405 for, which needs no routing)."""
        if path == RESPONSES_PATH:
            if method != "POST":
                return None
            if _MARK not in body:
                return cls(None, creates=True)
            try:
                rid = _decode(body).previous_response_id
            except (msgspec.DecodeError, msgspec.ValidationError):
                rid = None  # the replica answers 400
            valid = isinstance(rid, str) and rid and "/" not in rid
            return cls(rid if valid else None, creates=True)
        if not path.startswith(_PREFIX):
            return None
        rid, _, rest = path[len(_PREFIX) :].partition("/")
        if not rid:
            return None
        if not rest and method in ("GET", "DELETE"):
            return cls(rid, deletes=method == "DELETE")
        if (rest, method) in _ITEM_ROUTES:
            return cls(rid)
        return None


@dataclass(slots=True)
class ResponseHomes:
    """The replica (by URL) of each response stored through this router."""

    size: int = 65536
    homes: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError("--responses-table-size must be 0 or more")

    def home(self, rid: str) -> str | None:
        url = self.homes.get(rid)
        if url is not None:
            self.homes.move_to_end(rid)
        return url

    def keep(self, rid: str, url: str) -> None:
        if not self.size:
            return
        self.homes[rid] = url
        self.homes.move_to_end(rid)
        if len(self.homes) > self.size:
            self.homes.popitem(last=False)

    def forget(self, rid: str) -> None:
        self.homes.pop(rid, None)

    def __len__(self) -> int:
        return len(self.homes)
