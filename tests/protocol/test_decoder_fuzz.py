"""Hypothesis against the request decoders: whatever a client sends, the answer is a value or
a 4xx error with a message, never another exception (which the server would turn into a 500)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockgate.config import ModelConfig, TensorSpec
from lockgate.core.validate import validate_shapes
from lockgate.errors import ServingError
from lockgate.protocol import openai as oa
from lockgate.protocol import v2_codec as v2
from lockgate.protocol.grpc import codec
from lockgate.protocol.grpc import inference_pb2 as pb

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
DATATYPES = st.sampled_from(["FP32", "FP16", "BF16", "INT64", "UINT8", "BOOL", "BYTES", "X", ""])
TENSOR = st.fixed_dictionaries(
    {
        "name": st.one_of(st.text(max_size=6), st.integers()),
        "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), JSON_VALUES),
        "datatype": st.one_of(DATATYPES, JSON_VALUES),
        "data": JSON_VALUES,
    },
    optional={"parameters": JSON_VALUES},
)
V2_BODY = st.fixed_dictionaries(
    {"inputs": st.one_of(st.lists(TENSOR, max_size=3), JSON_VALUES)},
    optional={"outputs": JSON_VALUES, "parameters": JSON_VALUES, "id": JSON_VALUES},
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHORT = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a model whose config the decoders check declarations against before decoding any data
MODEL = ModelConfig(
    name="m",
    backend="python",
    max_batch_size=4,
    inputs=(TensorSpec("x", "FP32", (-1, 3)), TensorSpec("s", "BYTES", (1,), optional=True)),
    outputs=(TensorSpec("y", "FP32", (3,)),),
)
# `data` as sent: shaped as declared (flat or nested), any nesting of JSON values, or raw text
RAW_DATA = st.text(alphabet='[]{},:" \\0123456789.-etrufalsn', max_size=40)
LEAVES = st.one_of(st.integers(-3, 3), st.floats(-2, 2), st.booleans(), st.text(max_size=3))
KIND = {"FP32": st.floats(-2, 2, width=32), "BYTES": st.text(max_size=3), "BOOL": st.booleans()}
NESTINGS = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4), max_leaves=16)


def data_for(draw: st.DrawFn, datatype: str, shape: list[int]) -> str:
    leaf = draw(st.one_of(KIND.get(datatype, st.integers(-3, 3)), LEAVES))
    shaped = np.full(shape, None, dtype=object)
    shaped.fill(leaf)
    choice = draw(st.sampled_from(["flat", "nested", "any", "raw"]))
    if choice == "raw":
        return draw(RAW_DATA)
    value = {"flat": shaped.ravel().tolist(), "nested": shaped.tolist()}.get(choice)
    return json.dumps(draw(NESTINGS) if value is None else value)


@st.composite
def v2_inputs(draw: st.DrawFn) -> tuple[str, str, list[int], str]:
    """An input of MODEL's, mostly declared as the model takes it."""
    name = draw(st.sampled_from(["x", "s", "z"]))
    spec = MODEL.input(name)
    if spec is not None and draw(st.integers(0, 3)):
        dims = [draw(st.integers(0, 4)) if dim < 0 else dim for dim in spec.dims]
        datatype, shape = spec.datatype, [draw(st.integers(0, 5)), *dims]
    else:
        datatype = draw(st.sampled_from(["FP32", "BYTES", "INT64", "BOOL"]))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
    return name, datatype, shape, data_for(draw, datatype, shape)


def only_client_errors(call: Any, *args: Any, **kwargs: Any) -> None:
    try:
        call(*args, **kwargs)
    except ServingError as exc:
        assert 400 <= exc.status < 500, exc
        assert exc.message


@FUZZ
@given(V2_BODY, st.one_of(st.none(), st.integers(-5, 10**6), st.text(max_size=30)))
def test_v2_json_bodies(body: dict[str, Any], header_length: int | str | None) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    only_client_errors(v2.decode_infer_request, raw, None)
    only_client_errors(v2.decode_infer_request, raw + b"\x00\x01binary", header_length)


@FUZZ
@given(st.binary(max_size=300))
def test_v2_arbitrary_bytes(raw: bytes) -> None:
    only_client_errors(v2.decode_infer_request, raw, None)


@FUZZ
@given(
    st.fixed_dictionaries(
        {"prompt": JSON_VALUES, "model": JSON_VALUES},
        optional={
            "max_tokens": JSON_VALUES,
            "stop": JSON_VALUES,
            "logit_bias": JSON_VALUES,
            "temperature": JSON_VALUES,
            "priority": JSON_VALUES,
            "stream_options": JSON_VALUES,
        },
    )
)
def test_openai_completion_bodies(body: dict[str, Any]) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    only_client_errors(oa.decode, raw, oa.CompletionRequest)


@FUZZ
@given(st.lists(st.fixed_dictionaries({"role": JSON_VALUES, "content": JSON_VALUES}), max_size=3))
def test_openai_chat_bodies(messages: list[dict[str, Any]]) -> None:
    raw = json.dumps({"model": "m", "messages": messages}, allow_nan=True).encode()
    try:
        decoded = oa.decode(raw, oa.ChatRequest)
    except ServingError as exc:
        assert 400 <= exc.status < 500
        return
    for message in decoded.messages:
        only_client_errors(oa.message_text, message)


@FUZZ
@given(
    st.lists(
        st.tuples(st.text(max_size=6), DATATYPES, st.lists(st.integers(-2, 2**40), max_size=3)),
        max_size=3,
    ),
    st.lists(st.binary(max_size=64), max_size=4),
)
def test_grpc_requests(inputs: list[tuple[str, str, list[int]]], raw: list[bytes]) -> None:
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.extend(raw)
    only_client_errors(codec.decode_infer_request, request)


def check_against_model(declared: list[v2.DeclaredInput]) -> None:
    shapes = {d.name: d.shape for d in declared}
    validate_shapes(MODEL, shapes, {d.name: d.datatype for d in declared})


@SHORT
@given(st.lists(v2_inputs(), max_size=3, unique_by=lambda entry: entry[0]))
def test_v2_data_checked_against_a_model(
    inputs: list[tuple[str, str, list[int], str]],
) -> None:
    """Raw `data` of any shape against a model's config: only client errors, whether the
    check or the data refuses; what is accepted matches its declaration."""
    tensors = [
        f'{{"name": "{name}", "datatype": "{datatype}", "shape": {shape}, "data": {data}}}'
        for name, datatype, shape, data in inputs
    ]
    raw = ('{"inputs": [' + ", ".join(tensors) + "]}").encode()
    try:
        decoded = v2.decode_infer_request(raw, None, check=check_against_model)
    except ServingError as exc:
        assert 400 <= exc.status < 500 and exc.message, exc
        return
    for name, array in decoded.inputs.items():
        spec = MODEL.input(name)
        assert spec is not None and decoded.input_datatypes[name] == spec.datatype
        assert len(array.shape) == 1 + len(spec.dims) and array.shape[-1] == spec.dims[-1]


@SHORT
@given(
    st.lists(
        st.tuples(st.sampled_from(["x", "s", "q"]), DATATYPES, st.lists(st.integers(-2, 9))),
        max_size=3,
    ),
    st.lists(st.binary(max_size=64), max_size=4),
)
def test_grpc_requests_checked_against_a_model(
    inputs: list[tuple[str, str, list[int]]], raw: list[bytes]
) -> None:
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.extend(raw)
    only_client_errors(codec.decode_infer_request, request, check=check_against_model)


EMBEDDING_INPUTS = st.one_of(
    JSON_VALUES,
    st.text(max_size=8),
    st.lists(st.text(max_size=8), max_size=6),
    st.lists(st.integers(-5, 70_000), max_size=4),
)


@SHORT
@given(
    EMBEDDING_INPUTS,
    st.one_of(st.sampled_from(["float", "base64", "hex"]), JSON_VALUES),
    st.one_of(st.none(), st.integers(-3, 500), JSON_VALUES),
    st.one_of(st.none(), st.text(max_size=4), JSON_VALUES),
)
def test_openai_embedding_bodies(
    input_: Any, encoding_format: Any, dimensions: Any, user: Any
) -> None:
    body = {"model": "m", "input": input_, "encoding_format": encoding_format}
    body |= {"dimensions": dimensions, "user": user}
    raw = json.dumps(body, allow_nan=True).encode()
    limits = oa.OpenAILimits(max_embedding_inputs=4, max_embedding_chars=6)

    def decode() -> None:
        texts = oa.embedding_texts(oa.decode(raw, oa.EmbeddingRequest).input, limits)
        assert 1 <= len(texts) <= 4 and all(0 < len(t) <= 6 for t in texts)

    only_client_errors(decode)


@SHORT
@given(
    st.fixed_dictionaries(
        {"model": JSON_VALUES, "stop": JSON_VALUES, "stop_token_ids": JSON_VALUES},
        optional={"prompt": JSON_VALUES, "logit_bias": JSON_VALUES, "n": JSON_VALUES},
    )
)
def test_openai_stop_limits(body: dict[str, Any]) -> None:
    raw = json.dumps({"prompt": "p", **body}, allow_nan=True).encode()
    limits = oa.OpenAILimits(max_stop=2, max_stop_chars=3, max_stop_token_ids=2)

    def decode() -> None:
        request = oa.decode(raw, oa.CompletionRequest)
        assert len(limits.stop_strings(request.stop)) <= 2
        limits.check_stop_token_ids(request.stop_token_ids, 100)
        assert len(limits.logit_bias(request.logit_bias)) <= limits.max_logit_bias

    only_client_errors(decode)
