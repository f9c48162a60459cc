"""Hypothesis against the request decoders: whatever a client sends, the answer is a value or
a 4xx error with a message, never another exception (which the server would turn into a 500)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
