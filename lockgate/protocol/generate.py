"""Triton's generate extension: the request body of `POST /v2/models/{m}/generate` and
`.../generate_stream`, and the objects they answer with.

A request is `{"text_input": "...", "parameters": {...}}`. Its sampling fields carry vLLM's
names and may stand in `parameters` or at the top level (Triton passes a request's other
top-level properties on to the model); a name lockgate does not know is refused by name.
They decode into the OpenAI completion request they amount to, so both APIs share one set of
checks and limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from lockgate.errors import BadRequest
from lockgate.protocol import openai as oa

SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "priority",
)
OPTIONS = ("stream", "exclude_input_in_output")
KNOWN = frozenset(SAMPLING + OPTIONS)
_SHOWN_NAMES = 8  # unknown names quoted in an error, at most


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    text_input: str
    completion: oa.CompletionRequest  # text_input as the prompt, with the sampling fields
    stream: bool | None = None  # None: not given (the route decides)
    exclude_input_in_output: bool = True  # False: text_output starts with text_input


def decode(body: bytes) -> GenerateRequest:
    """A checked generate request; BadRequest (400) naming what is wrong."""
    fields: dict[str, Any] = oa.decode(body, dict[str, Any])
    text = fields.pop("text_input", None)
    if not isinstance(text, str):
        raise BadRequest("text_input is required: the prompt, as a string")
    parameters = fields.pop("parameters", None)
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise BadRequest("parameters must be an object of name/value pairs")
    twice = sorted(set(fields) & set(parameters))
    if twice:
        raise BadRequest(f"given both at the top level and in parameters: {_names(twice)}")
    fields.update(parameters)
    unknown = sorted(set(fields) - KNOWN)
    if unknown:
        raise BadRequest(
            f"unknown parameters: {_names(unknown)} (known: {', '.join(sorted(KNOWN))})"
        )
    stream = _flag(fields, "stream")
    exclude = _flag(fields, "exclude_input_in_output") is not False
    try:
        completion = msgspec.convert({**fields, "prompt": text}, oa.CompletionRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid parameters: {exc}") from None
    return GenerateRequest(text, completion, stream, exclude)


def _flag(fields: dict[str, Any], name: str) -> bool | None:
    """A boolean field, taken out of `fields`; None when not given."""
    value = fields.pop(name, None)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n[:40]) for n in names[:_SHOWN_NAMES])
    more = len(names) - _SHOWN_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def response(model_name: str, model_version: str, text_output: str) -> dict[str, Any]:
    """The answer of /generate, and each event of /generate_stream (with the new text)."""
    return {"model_name": model_name, "model_version": model_version, "text_output": text_output}


def error(message: str) -> dict[str, Any]:
    """An error, in the body of a refused request or as an event of a stream cut short."""
    return {"error": message}
