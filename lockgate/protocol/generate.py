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


_EMPTY = msgspec.Raw()
_NESTED = object()  # a raw value that is an array or an object
_PARAMETERS = msgspec.defstruct(
    "GenerateParameters",
    [(name, msgspec.Raw, _EMPTY) for name in sorted(KNOWN)],
    forbid_unknown_fields=True,
)
_BODY = msgspec.defstruct(
    "GenerateBody",
    [("text_input", msgspec.Raw, _EMPTY), ("parameters", msgspec.Raw, _EMPTY)],
    bases=(_PARAMETERS,),
    forbid_unknown_fields=True,
)
_NAMES_READ_BELOW = 64 * 1024  # bytes: an object this small is read again to name every
# unknown field; a larger one is refused naming the first (no object is built for its values)


def decode(body: bytes) -> GenerateRequest:
    """A checked generate request; BadRequest (400) naming what is wrong. Every value is kept
    as raw JSON until it is known to belong, then decoded by its type: nothing the request
    does not define is ever built."""
    top = _typed(body, _BODY, inner=False)
    text = _value(top.text_input, "text_input")
    if text is None:
        raise BadRequest("text_input is required: the prompt, as a string")
    if not isinstance(text, str):
        kind = "a list or an object" if text is _NESTED else type(text).__name__
        raise BadRequest(f"text_input must be a string (the prompt), got {kind}")
    raw_parameters = bytes(top.parameters)
    if raw_parameters.strip() in (b"", b"null"):
        parameters = _PARAMETERS()
    elif raw_parameters.lstrip()[:1] != b"{":
        raise BadRequest("parameters must be an object of name/value pairs")
    else:
        parameters = _typed(raw_parameters, _PARAMETERS, inner=True)
    given: dict[str, bytes] = {}
    twice = []
    for name in sorted(KNOWN):
        outer, inner = bytes(getattr(top, name)), bytes(getattr(parameters, name))
        if outer and inner:
            twice.append(name)
        if outer or inner:
            given[name] = outer or inner
    if twice:
        raise BadRequest(f"given both at the top level and in parameters: {_names(twice)}")
    stream = _flag(given, "stream")
    exclude = _flag(given, "exclude_input_in_output") is not False
    fields = b",".join(b'"%s":%s' % (name.encode(), value) for name, value in given.items())
    prompt = msgspec.json.encode(text)
    try:
        completion = msgspec.json.decode(
            b'{"prompt":%s%s%s}' % (prompt, b"," if fields else b"", fields),
            type=oa.CompletionRequest,
        )
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid parameters: {exc}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON in parameters: {exc}") from None
    return GenerateRequest(text, completion, stream, exclude)


def _typed(data: bytes, kind: Any, *, inner: bool) -> Any:
    try:
        return oa.decode(data, kind)
    except BadRequest as exc:
        if "unknown field" not in exc.message:
            raise
    unknown = []
    if len(data) < _NAMES_READ_BELOW:  # small: read its names, to name them all
        names = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
        unknown = sorted(set(names) - KNOWN - (set() if inner else {"text_input", "parameters"}))
    else:
        unknown = [_first_unknown(data, kind)]
    raise BadRequest(f"unknown parameters: {_names(unknown)} (known: {', '.join(sorted(KNOWN))})")


def _first_unknown(data: bytes, kind: Any) -> str:
    try:
        msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        return str(exc).partition("`")[2].rpartition("`")[0]
    return ""


def _value(raw: msgspec.Raw, name: str) -> object:
    """A raw field's value: None when it was not given. Only called on fields that hold a
    scalar when valid; anything nested is refused by its caller's type check."""
    data = bytes(raw)
    if not data:
        return None
    if data.lstrip()[:1] in (b"[", b"{"):
        return _NESTED  # not a scalar: the caller refuses it by its type
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON in {name}: {exc}") from None


def _flag(fields: dict[str, bytes], name: str) -> bool | None:
    """A boolean field, taken out of `fields`; None when not given."""
    raw = fields.pop(name, b"")
    value = _value(msgspec.Raw(raw), name)
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
