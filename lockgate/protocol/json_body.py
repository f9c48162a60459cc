"""A request body that is one JSON object (an empty body: an empty one)."""

from __future__ import annotations

import json
from typing import Any

from lockgate.errors import BadRequest


def json_object(body: bytes, what: str) -> dict[str, Any]:
    """`body` decoded as a JSON object, else 400: malformed JSON, or `what` the body must be."""
    if not body.strip():
        return {}
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON in the request body: {exc}") from None
    if not isinstance(document, dict):
        raise BadRequest(f"the request body must be {what}")
    return document
