"""The model repository extension's load and unload requests (HTTP and gRPC), checked.

`POST /v2/repository/models/{m}/load` takes `{"parameters": {"config": "<JSON>"}}`: a model
config in Triton's JSON form that replaces the repository's for this load, as in Triton.
Triton's `file:<version>/<name>` parameters (model files sent in the request) are refused by
name: lockgate loads model files from the repository only. `.../unload` takes
`{"parameters": {"unload_dependents": true}}`: the models an ensemble or a cascade runs are
unloaded with it. Any other parameter is refused (400) rather than ignored, so a request that
counts on one is not answered as if it had been applied.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockgate.errors import BadRequest

MAX_CONFIG_CHARS = 1 << 20  # a config override longer than this is refused


@dataclass(frozen=True, slots=True)
class LoadRequest:
    config: str | None = None  # a config in Triton's JSON form replacing the repository's


@dataclass(frozen=True, slots=True)
class UnloadRequest:
    dependents: bool = False  # unload the models an ensemble or a cascade runs, too


def load_request(parameters: Mapping[str, Any]) -> LoadRequest:
    config = None
    for key, value in parameters.items():
        if key == "config":
            if not isinstance(value, str):
                raise BadRequest("parameters.config must be a string: a model config as JSON")
            if len(value) > MAX_CONFIG_CHARS:
                raise BadRequest(f"parameters.config is longer than {MAX_CONFIG_CHARS} characters")
            config = value
        elif key.startswith("file:"):
            raise BadRequest(
                f"parameter '{key[:200]}' is not supported: lockgate loads model files from the "
                "repository only"
            )
        else:
            raise BadRequest(f"unknown load parameter '{key[:200]}' (lockgate takes 'config')")
    return LoadRequest(config)


def unload_request(parameters: Mapping[str, Any]) -> UnloadRequest:
    dependents = False
    for key, value in parameters.items():
        if key != "unload_dependents":
            raise BadRequest(
                f"unknown unload parameter '{key[:200]}' (lockgate takes 'unload_dependents')"
            )
        if not isinstance(value, bool):
            raise BadRequest("parameters.unload_dependents must be true or false")
        dependents = value
    return UnloadRequest(dependents)


def parameters_of(body: bytes) -> Mapping[str, Any]:
    """The `parameters` object of an HTTP load or unload request's body (empty: none)."""
    if not body.strip():
        return {}
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON in the request body: {exc}") from None
    if not isinstance(document, dict):
        raise BadRequest("the request body must be a JSON object")
    parameters = document.get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest("parameters must be an object of name/value pairs")
    return parameters
