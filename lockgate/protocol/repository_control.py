"""The model repository extension's load and unload requests (HTTP and gRPC), checked.

`POST /v2/repository/models/{m}/load` takes `{"parameters": {"config": "<JSON>"}}`: a model
config in Triton's JSON form that replaces the repository's for this load, as in Triton.
With it, `file:<version>/<path>` parameters send the model's files themselves (base64 over
REST, bytes over gRPC, as tritonclient's `load_model(..., files=...)` sends them): the model
is then loaded from those files alone, in place of its repository folder, which it need not
have. A path is relative to the model's folder, starts with a version number, and never
leads out of the folder; at most `MAX_FILES` files. `.../unload` takes
`{"parameters": {"unload_dependents": true}}`: the models an ensemble or a cascade runs are
unloaded with it. Any other parameter is refused (400) rather than ignored, so a request that
counts on one is not answered as if it had been applied.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from lockgate.errors import BadRequest
from lockgate.protocol.json_body import json_object

MAX_CONFIG_CHARS = 1 << 20  # a config override longer than this is refused
MAX_FILES = 1024  # model files one load request may send
FILE_PREFIX = "file:"


@dataclass(frozen=True, slots=True)
class LoadRequest:
    config: str | None = None  # a config in Triton's JSON form replacing the repository's
    # the model's files, sent in the request: path in the model's folder -> contents
    files: Mapping[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class UnloadRequest:
    dependents: bool = False  # unload the models an ensemble or a cascade runs, too


def load_request(parameters: Mapping[str, Any]) -> LoadRequest:
    config = None
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if key == "config":
            if not isinstance(value, str):
                raise BadRequest("parameters.config must be a string: a model config as JSON")
            if len(value) > MAX_CONFIG_CHARS:
                raise BadRequest(f"parameters.config is longer than {MAX_CONFIG_CHARS} characters")
            config = value
        elif key.startswith(FILE_PREFIX):
            if len(files) >= MAX_FILES:
                raise BadRequest(f"a load request sends at most {MAX_FILES} files")
            files[file_path(key)] = _contents(key, value)
        else:
            raise BadRequest(
                f"unknown load parameter '{key[:200]}' (lockgate takes 'config' and "
                "'file:<version>/<path>')"
            )
    if files and config is None:
        raise BadRequest("a load that sends model files needs parameters.config, as in Triton")
    return LoadRequest(config, files)


def file_path(key: str) -> str:
    """The path in the model's folder of a `file:<version>/<path>` parameter, checked."""
    text = key.removeprefix(FILE_PREFIX)
    path = PurePosixPath(text)
    parts = path.parts
    if (
        len(parts) < 2
        or path.is_absolute()
        or not parts[0].isdigit()
        or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts)
        or str(path) != text
    ):
        raise BadRequest(
            f"parameter '{key[:200]}': a model file is 'file:<version>/<path>', inside its "
            "version folder"
        )
    return text


def _contents(key: str, value: Any) -> bytes:
    if isinstance(value, bytes):  # gRPC's bytes_param
        return value
    if isinstance(value, str):  # REST: base64
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            raise BadRequest(f"parameter '{key[:200]}' is not base64") from None
    raise BadRequest(f"parameter '{key[:200]}' must be the file's contents (base64 over REST)")


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
    parameters = json_object(body, "a JSON object").get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest("parameters must be an object of name/value pairs")
    return parameters
