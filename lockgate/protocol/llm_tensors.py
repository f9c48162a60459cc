"""A language model's KServe v2 tensors, as Triton's vLLM backend takes and gives them.

    inputs   text_input BYTES [1]; optional: stream, exclude_input_in_output and the
             return_* flags, BOOL [1]; sampling_parameters BYTES [1], a JSON object of vLLM's
             SamplingParams fields (values may be strings: "0.1", "100", as vLLM's sample
             client sends them)
    outputs  text_output BYTES; when their return_* flag is true (or the request names them
             among its outputs): finish_reason BYTES, cumulative_logprob FP32,
             num_input_tokens UINT32, num_output_tokens UINT32

The sampling fields come from `sampling_parameters` when it is given, else from the request's
parameters (the names below only: the other parameters are the request's own, `timeout` and
`priority`). A request decodes into the OpenAI completion request it amounts to, as Triton's
generate does (`protocol/generate.py`), so every API shares one set of checks and limits.

The model is decoupled, as the vLLM backend is: with `stream` true each response carries the
text that is new since the last; with `stream` false one response carries the whole text,
after the prompt unless `exclude_input_in_output` is true. A streamed response never repeats
the prompt (exclude_input_in_output false is refused with stream true, as the backend does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from lockgate.config import ModelConfig, TensorSpec
from lockgate.errors import BadRequest
from lockgate.protocol import generate
from lockgate.protocol import openai as oa

TEXT_INPUT = "text_input"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT = "exclude_input_in_output"
TEXT_OUTPUT = "text_output"
# on every answer of a language model's v2 inference (REST header, gRPC trailing metadata):
# a router sends its requests once, never a hedge's second copy nor a retry once sent
MODEL_KIND_HEADER = b"x-lockgate-model-kind"
LANGUAGE_KIND = b"language"
# a return_* input -> the output it adds to each response
RETURNS = {
    "return_finish_reason": "finish_reason",
    "return_cumulative_logprob": "cumulative_logprob",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
}
INPUTS = (
    TensorSpec(TEXT_INPUT, "BYTES", (1,)),
    TensorSpec(STREAM, "BOOL", (1,), optional=True),
    TensorSpec(SAMPLING_PARAMETERS, "BYTES", (1,), optional=True),
    TensorSpec(EXCLUDE_INPUT, "BOOL", (1,), optional=True),
    *(TensorSpec(name, "BOOL", (1,), optional=True) for name in RETURNS),
)
OUTPUTS = (
    TensorSpec(TEXT_OUTPUT, "BYTES", (-1,)),
    TensorSpec("finish_reason", "BYTES", (-1,)),
    TensorSpec("cumulative_logprob", "FP32", (-1,)),
    TensorSpec("num_input_tokens", "UINT32", (1,)),
    TensorSpec("num_output_tokens", "UINT32", (-1,)),
)
DATATYPES = {spec.name: spec.datatype for spec in OUTPUTS}
# vLLM's SamplingParams fields lockgate applies (the others are refused by name)
SAMPLING = (
    *generate.SAMPLING,
    "min_tokens",
    "repetition_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
_INTEGERS = frozenset({"max_tokens", "top_k", "seed", "priority", "min_tokens"})
_FLOATS = frozenset(
    {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
)
_BOOLEANS = frozenset({"ignore_eos", "include_stop_str_in_output", "skip_special_tokens"})
_MAX_SAMPLING_BYTES = 64 * 1024  # a sampling_parameters string longer than this is refused


def interface(config: ModelConfig) -> ModelConfig:
    """A language model's config as its v2 metadata and config declare it: these tensors,
    unbatched (the engine batches on its own)."""
    return replace(config, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=0)


@dataclass(frozen=True, slots=True)
class TensorRequest:
    """A language model's v2 inference request, decoded."""

    text_input: str
    completion: oa.CompletionRequest  # text_input as the prompt, with the sampling fields
    stream: bool  # a response per piece of text, not one with the whole
    prepend_input: bool  # the (one) response's text_output starts with text_input
    returns: frozenset[str]  # the outputs asked for beside text_output

    @property
    def logprobs(self) -> int | None:
        """The logprobs to compute (the sampled token's alone) when cumulative_logprob is
        asked; None otherwise."""
        return 0 if "cumulative_logprob" in self.returns else None


def decode(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, object]) -> TensorRequest:
    """A checked request from its inputs (names, datatypes and shapes already checked against
    `INPUTS`) and its request parameters; BadRequest (400) naming what is wrong."""
    text = _text(inputs[TEXT_INPUT], TEXT_INPUT)
    stream = _flag(inputs, STREAM)
    exclude = _flag(inputs, EXCLUDE_INPUT)
    prepend = not exclude if exclude is not None else not stream
    if prepend and stream:
        raise BadRequest(
            "exclude_input_in_output false is not allowed with stream true: a streamed "
            "response carries the new text only"
        )
    returns = frozenset(output for name, output in RETURNS.items() if _flag(inputs, name))
    if SAMPLING_PARAMETERS in inputs:
        fields = _sampling_tensor(inputs[SAMPLING_PARAMETERS])
    else:
        fields = {name: value for name, value in parameters.items() if name in SAMPLING}
    completion = _completion(text, fields)
    return TensorRequest(text, completion, bool(stream), prepend, returns)


def _text(array: np.ndarray, name: str) -> str:
    value = array.reshape(-1)[0]
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"{name} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def _flag(inputs: Mapping[str, np.ndarray], name: str) -> bool | None:
    """A BOOL [1] input's value; None when not given."""
    array = inputs.get(name)
    return None if array is None else bool(array.reshape(-1)[0])


def _sampling_tensor(array: np.ndarray) -> dict[str, Any]:
    """The JSON object of a sampling_parameters input, its names checked."""
    value = array.reshape(-1)[0]
    raw = value.encode() if isinstance(value, str) else bytes(value)
    if len(raw) > _MAX_SAMPLING_BYTES:
        raise BadRequest(f"sampling_parameters is over {_MAX_SAMPLING_BYTES} bytes")
    try:
        fields = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(f"sampling_parameters is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise BadRequest("sampling_parameters must be a JSON object of vLLM sampling fields")
    unknown = sorted(set(fields) - set(SAMPLING))
    if unknown:
        shown = ", ".join(repr(name[:40]) for name in unknown[:8])
        raise BadRequest(
            f"unknown sampling parameters: {shown} (known: {', '.join(sorted(SAMPLING))})"
        )
    return fields


def _completion(text: str, fields: Mapping[str, Any]) -> oa.CompletionRequest:
    """The completion request of a prompt and its sampling fields: the strings vLLM's backend
    reads as numbers or booleans read so; None as not given."""
    typed = {name: _typed(name, value) for name, value in fields.items() if value is not None}
    body = msgspec.json.encode({"prompt": text, **typed})
    try:
        return msgspec.json.decode(body, type=oa.CompletionRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid sampling parameters: {exc}") from None


def _typed(name: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if name in _INTEGERS:
            return int(text)
        if name in _FLOATS:
            return float(text)
    except ValueError:
        raise BadRequest(
            f"sampling parameter {name} must be a number, got {value[:40]!r}"
        ) from None
    if name in _BOOLEANS:
        if text.lower() not in ("true", "false"):
            raise BadRequest(f"sampling parameter {name} must be true or false")
        return text.lower() == "true"
    return value


@dataclass(frozen=True, slots=True)
class Piece:
    """What one response tells: its text, and the counts the return_* flags ask for."""

    text: str
    finish_reason: str | None  # None: not finished
    num_input_tokens: int
    num_output_tokens: int  # generated in this response (all of them: the whole text's)
    cumulative_logprob: float = 0.0


def outputs(piece: Piece, returns: frozenset[str]) -> dict[str, np.ndarray]:
    """A response's outputs: text_output, and those `returns` asks for. An unfinished
    sequence's finish_reason is "None", as the vLLM backend writes it."""
    found = {TEXT_OUTPUT: np.array([piece.text.encode()], dtype=object)}
    values: dict[str, np.ndarray] = {
        "finish_reason": np.array([str(piece.finish_reason).encode()], dtype=object),
        "cumulative_logprob": np.array([piece.cumulative_logprob], dtype=np.float32),
        "num_input_tokens": np.array([piece.num_input_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([piece.num_output_tokens], dtype=np.uint32),
    }
    found.update((name, array) for name, array in values.items() if name in returns)
    return found


def stream_refused(model: str) -> BadRequest:
    """The error of stream true over an endpoint that answers once."""
    return BadRequest(
        f"stream true is answered over a stream: gRPC ModelStreamInfer, or "
        f"/v2/models/{model}/generate_stream; send stream false (or none) here"
    )
