"""Triton's logging extension: the server's log settings, and a change to them read off the
wire, checked whole before any of it applies.

The settings and their JSON shape are Triton's (`GET|POST /v2/logging`, gRPC `LogSettings`):

    log_file           "" (the log goes to standard error); never changed at run time
    log_info           INFO records written
    log_warning        WARNING records written
    log_error          ERROR (and CRITICAL) records written
    log_verbose_level  0: no verbose (DEBUG) records; any higher value: DEBUG records of
                       lockgate's loggers (Python's logging has one verbose level)
    log_format         "default" or "ISO8601" (the time stamp of each line)

A change names some of them; a null value leaves that setting as it is (as Triton's REST
does). An unknown name, a value of the wrong type, a verbose level outside 0 to 2^32 - 1 or an
unknown format is refused (400), and so is any `log_file` (as in Triton since 24.01: the log
file cannot be moved through the network). This module is bookkeeping only:
`frontend/server_log.py` applies the settings to Python's logging.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockgate.errors import BadRequest
from lockgate.protocol.json_body import json_object

LOG_FORMATS = ("default", "ISO8601")
MAX_VERBOSE_LEVEL = 2**32 - 1  # a uint32, as in Triton's gRPC message
FLAGS = ("log_info", "log_warning", "log_error")
NAMES = ("log_file", *FLAGS, "log_verbose_level", "log_format")  # Triton's order

LogValue = bool | int | str


@dataclass(frozen=True, slots=True)
class LogSettings:
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "default"
    log_file: str = ""  # "": standard error

    def __post_init__(self) -> None:
        if not 0 <= self.log_verbose_level <= MAX_VERBOSE_LEVEL:
            raise ValueError(f"log_verbose_level must be 0 to {MAX_VERBOSE_LEVEL}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}")

    @property
    def verbose(self) -> bool:
        return self.log_verbose_level > 0

    def document(self) -> dict[str, LogValue]:
        """Every setting, by name, in Triton's order."""
        values: dict[str, LogValue] = {name: getattr(self, name) for name in NAMES}
        return values

    def changed(self, change: Mapping[str, Any]) -> LogSettings:
        """These settings with `change` applied (name -> value; None: unchanged); 400 naming
        the first setting that cannot be applied, and then nothing is applied."""
        updates: dict[str, LogValue] = {}
        for name, value in change.items():
            if name not in NAMES:
                raise BadRequest(
                    f"unknown log setting '{str(name)[:200]}' (the settings: {', '.join(NAMES)})"
                )
            if value is not None:
                updates[name] = _checked(name, value)
        return dataclasses.replace(self, **updates)  # type: ignore[arg-type]


def _checked(name: str, value: object) -> LogValue:
    if name == "log_file":
        raise BadRequest(
            "log_file cannot be changed at run time (as in Triton): lockgate logs to standard "
            "error; redirect that to a file"
        )
    if name in FLAGS:
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be true or false")
        return value
    if name == "log_verbose_level":
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRequest("log_verbose_level must be an integer")
        if not 0 <= value <= MAX_VERBOSE_LEVEL:
            raise BadRequest(f"log_verbose_level must be 0 to {MAX_VERBOSE_LEVEL}, got {value}")
        return value
    if not isinstance(value, str) or value not in LOG_FORMATS:
        raise BadRequest(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {value!r:.100}")
    return value


def decode_settings(body: bytes) -> dict[str, Any]:
    """The settings a REST request's body changes (log or trace): a JSON object of name/value
    pairs (an empty body: none)."""
    return json_object(body, "a JSON object of settings")
