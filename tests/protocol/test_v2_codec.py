from __future__ import annotations

import contextlib
import re
import struct
import tracemalloc
from typing import Any

import ml_dtypes
import msgspec
import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lockgate.datatypes import bf16_bits_from_float32, float32_from_bf16_bits
from lockgate.errors import BadRequest
from lockgate.protocol.v2_codec import (
    DeclaredInput,
    RequestedOutput,
    V2InferRequest,
    classify,
    decode_infer_request,
    encode_error,
    encode_infer_response,
)

NUMERIC = ["UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"]
FLOATS = ["FP16", "FP32", "FP64"]
SAMPLES: dict[str, np.ndarray] = {
    "BOOL": np.array([[True, False, True], [False, False, True]]),
    "UINT8": np.array([[0, 255, 7], [1, 2, 3]], np.uint8),
    "UINT16": np.array([[0, 65535, 7], [1, 2, 3]], np.uint16),
    "UINT32": np.array([[0, 2**32 - 1, 7], [1, 2, 3]], np.uint32),
    "UINT64": np.array([[0, 2**64 - 1, 7], [1, 2, 3]], np.uint64),
    "INT8": np.array([[-128, 127, 0], [1, -2, 3]], np.int8),
    "INT16": np.array([[-(2**15), 2**15 - 1, 0], [1, -2, 3]], np.int16),
    "INT32": np.array([[-(2**31), 2**31 - 1, 0], [1, -2, 3]], np.int32),
    "INT64": np.array([[-(2**63), 2**63 - 1, 0], [1, -2, 3]], np.int64),
    "FP16": np.array([[0.5, -1.25, 65504], [1e-3, 0, 3]], np.float16),
    "FP32": np.array([[0.1, -1.25, 3.4e38], [1e-30, 0, 3]], np.float32),
    "FP64": np.array([[0.1, -1.25, 1e308], [1e-300, 0, 3]], np.float64),
    "BF16": bf16_bits_from_float32(np.array([[0.5, -1.25, 3.0], [2.0**100, 0, 3]], np.float32)),
    "BYTES": np.array([[b"a", b"", "é".encode()], [b"x y", b"[1]", b"\\"]], dtype=object),
}


def body_of(inputs: list[dict[str, Any]], **extra: Any) -> bytes:
    return msgspec.json.encode({"inputs": inputs, **extra})


def tensor(name: str = "x", shape: Any = (1,), datatype: Any = "INT32", **fields: Any) -> dict:
    dims = list(shape) if isinstance(shape, tuple | list) else shape
    return {"name": name, "shape": dims, "datatype": datatype, **fields}


def json_data(array: np.ndarray, datatype: str) -> list[Any]:
    if datatype == "BYTES":
        return [item.decode() for item in array.ravel().tolist()]
    if datatype == "BF16":
        return float32_from_bf16_bits(array).ravel().tolist()
    return array.ravel().tolist()


def raw_bytes(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in array.ravel().tolist())
    return array.tobytes()


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    if want.dtype.kind == "f":
        np.testing.assert_array_equal(got, want)  # NaN equals NaN here
    else:
        assert got.tolist() == want.tolist()


def to_request(body: bytes, header_length: int | None) -> tuple[bytes, int | None]:
    """A response body re-shaped into a request: its outputs become inputs."""
    split = len(body) if header_length is None else header_length
    header = msgspec.json.decode(body[:split])
    request = msgspec.json.encode({"inputs": header["outputs"]})
    if header_length is None:
        return request, None
    return request + body[split:], len(request)


# --- decoding: JSON -------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_json_input_every_datatype(datatype: str) -> None:
    array = SAMPLES[datatype]
    body = body_of([tensor("x", array.shape, datatype, data=json_data(array, datatype))])
    request = decode_infer_request(body, None)
    assert request.input_datatypes == {"x": datatype}
    assert_same(request.inputs["x"], array)


@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_binary_input_every_datatype(datatype: str) -> None:
    array = SAMPLES[datatype]
    raw = raw_bytes(array, datatype)
    header = body_of(
        [tensor("x", array.shape, datatype, parameters={"binary_data_size": len(raw)})]
    )
    request = decode_infer_request(header + raw, len(header))
    assert_same(request.inputs["x"], array)


def test_nested_json_data_is_row_major() -> None:
    body = body_of(
        [
            tensor("a", (2, 2), "FP32", data=[[1, 2.5], [3, 4]]),
            tensor("b", (2, 1, 2), "BYTES", data=[[["p", "q"]], [["r", "s"]]]),
            tensor("c", (1, 2), "BOOL", data=[[True, False]]),
        ]
    )
    request = decode_infer_request(body, None)
    assert request.inputs["a"].tolist() == [[1, 2.5], [3, 4]]
    assert request.inputs["b"].tolist() == [[[b"p", b"q"]], [[b"r", b"s"]]]
    assert request.inputs["c"].tolist() == [[True, False]]


def test_request_fields_and_parameters() -> None:
    body = body_of(
        [tensor(data=[1])],
        id="req-7",
        parameters={"priority": 2, "timeout": 5000, "binary_data_output": True, "x": "y"},
        outputs=[
            {"name": "a"},
            {"name": "b", "parameters": {"binary_data": False, "classification": 3}},
        ],
    )
    request = decode_infer_request(body, None)
    assert request.id == "req-7"
    assert request.priority == 2 and request.timeout_us == 5000
    assert request.binary_default is True
    assert request.parameters["x"] == "y"
    assert request.outputs == [RequestedOutput("a", None, 0), RequestedOutput("b", False, 3)]


def test_defaults() -> None:
    request = decode_infer_request(body_of([tensor(data=[1])]), None)
    assert request == V2InferRequest("", request.inputs, {"x": "INT32"}, {}, [], False)
    assert request.priority == 0 and request.timeout_us is None


def test_empty_tensors() -> None:
    raw = b""
    header = body_of(
        [
            tensor("j", (0, 3), "FP32", data=[]),
            tensor("b", (2, 0), "INT64", parameters={"binary_data_size": 0}),
            tensor("s", (0,), "BYTES", parameters={"binary_data_size": 0}),
        ]
    )
    request = decode_infer_request(header + raw, len(header))
    assert request.inputs["j"].shape == (0, 3) and request.inputs["j"].dtype == np.float32
    assert request.inputs["b"].shape == (2, 0)
    assert request.inputs["s"].shape == (0,) and request.inputs["s"].dtype == object


def test_mixed_json_and_binary_inputs_take_binary_in_order() -> None:
    first = np.arange(6, dtype=np.int32).reshape(2, 3)
    second = np.array([b"\xff\xfe", b"ok"], dtype=object)  # not UTF-8: binary only
    raw_first, raw_second = raw_bytes(first, "INT32"), raw_bytes(second, "BYTES")
    header = body_of(
        [
            tensor("a", (2, 3), "INT32", parameters={"binary_data_size": len(raw_first)}),
            tensor("j", (2,), "FP64", data=[0.25, -1]),
            tensor("s", (2,), "BYTES", parameters={"binary_data_size": len(raw_second)}),
        ]
    )
    request = decode_infer_request(header + raw_first + raw_second, str(len(header)))
    assert_same(request.inputs["a"], first)
    assert request.inputs["j"].tolist() == [0.25, -1.0]
    assert request.inputs["s"].tolist() == [b"\xff\xfe", b"ok"]


def test_binary_views_are_aligned_and_writable_from_bytearray() -> None:
    raw = np.arange(3, dtype=np.float64).tobytes()
    header = body_of([tensor("a", (3,), "FP64", parameters={"binary_data_size": len(raw)})])
    body = bytearray(header + raw)
    array = decode_infer_request(body, len(header)).inputs["a"]
    assert array.flags.aligned and array.flags.writeable
    assert array.tolist() == [0, 1, 2]


def test_binary_bool_normalizes_any_nonzero_byte() -> None:
    header = body_of([tensor("a", (3,), "BOOL", parameters={"binary_data_size": 3})])
    request = decode_infer_request(header + b"\x00\x02\xff", len(header))
    assert request.inputs["a"].tolist() == [False, True, True]


def test_binary_float_nan_and_inf_pass_through() -> None:
    values = np.array([np.nan, np.inf, -np.inf], np.float32)
    header = body_of([tensor("a", (3,), "FP32", parameters={"binary_data_size": 12})])
    out = decode_infer_request(header + values.tobytes(), len(header)).inputs["a"]
    np.testing.assert_array_equal(out, values)


def test_json_numbers_beyond_fp16_become_inf() -> None:
    body = body_of([tensor("a", (2,), "FP16", data=[1e6, -1e6])])
    assert decode_infer_request(body, None).inputs["a"].tolist() == [np.inf, -np.inf]


def test_json_numbers_beyond_fp32_become_inf_as_numpy_casts_them() -> None:
    values = [1e39, -1e300, 3.4028235e38, 0.1, 7]
    body = body_of([tensor("a", (5,), "FP32", data=values)])
    array = decode_infer_request(body, None).inputs["a"]
    with np.errstate(over="ignore"):
        expected = np.asarray(values, dtype=np.float64).astype(np.float32)
    assert array.dtype == np.float32
    assert array.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2, 3], "shape [2,2] has 4 elements but data has 3"),
        ([[1, 2], [3, 4], [5, 6]], "shape [2,2] has 4 elements but data has 6"),
        ([[1], [2], [3], [4]], "data has 5 arrays, more than shape [2,2] nests (3)"),
        ([1, 2, 3, "4"], "data for FP32 must be numbers, not strings"),
    ],
)
def test_json_data_refused_in_the_same_words_flat_or_nested(data: object, message: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(message)):
        decode_infer_request(body_of([tensor("a", (2, 2), "FP32", data=data)]), None)


# --- decoding: every malformed case is a BadRequest that says what is wrong -----------------

BAD_JSON_CASES = [
    (b"{", "malformed JSON"),
    (b"", "malformed JSON"),
    (b"[1, 2]", "Expected `object`, got `array`"),
    (b'"inputs"', "Expected `object`"),
    (b"{}", "missing required field `inputs`"),
    (b'{"inputs": {}}', "Expected `array`"),
    (b'{"inputs": [{"name": "x\xff", "shape": [1]}]}', "malformed JSON"),
    (b'{"inputs": [], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "malformed JSON"),
    (b'{"id": 3, "inputs": []}', r"Expected `str`, got `int` - at `\$\.id`"),
]


@pytest.mark.parametrize(("body", "message"), BAD_JSON_CASES)
def test_malformed_json(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode_infer_request(body, None)


BAD_INPUTS = [
    ({"shape": [1], "datatype": "INT32", "data": [1]}, "input 0: .*`name`"),
    (tensor(shape=None, data=[1]), "input 'x'.*shape"),
    ({"name": "x", "shape": [1], "data": [1]}, "input 'x'.*`datatype`"),
    (tensor(shape=["1"], data=[1]), "input 'x'.*shape"),
    (tensor(shape=[1.5], data=[1]), "input 'x'.*shape"),
    (tensor(datatype="FP8", data=[1]), "input 'x': unknown datatype 'FP8'"),
    (tensor(datatype=7, data=[1]), "input 'x'.*datatype"),
    (tensor(shape=[-1], data=[1]), "input 'x': invalid dim -1"),
    (tensor(shape=[10**9], data=[1]), "input 'x'.*invalid dim"),
    (tensor(shape=[10**5, 10**5], data=[1]), "input 'x'.*more than the limit"),
    (tensor(shape=[2**64, 0], data=[]), "input 'x'.*invalid dim"),
    (tensor(shape=[1] * 40, data=[1]), "input 'x': shape has 40 dims"),
    (tensor(shape=[2], data=[1]), "input 'x': shape \\[2\\] has 2 elements but data has 1"),
    (tensor(shape=[2, 2], data=[[1, 2], [3]]), "has 4 elements but data has 3"),
    (tensor(data=["1"]), "input 'x': data for INT32 must be integers, not strings"),
    (tensor(data=[1.5]), "input 'x': data for INT32 must be integers.*`float`"),
    (tensor(data=[True]), "input 'x': data for INT32 must be integers.*`bool`"),
    (tensor(data=[None]), "input 'x': data for INT32 must be integers.*`null`"),
    (tensor(datatype="FP32", data=["a"]), "input 'x': data for FP32 must be numbers"),
    (tensor(datatype="FP32", data=[True]), "input 'x': data for FP32 must be numbers"),
    (tensor(datatype="BOOL", data=[1]), "input 'x': data for BOOL must be true or false"),
    (tensor(datatype="BYTES", data=[1]), "input 'x': data for BYTES must be strings"),
    (tensor(data=5), "input 'x': data must be an array, got a number"),
    (tensor(data={"a": 1}), "input 'x': data must be an array, got an object"),
    (tensor(data=[{"a": 1}]), "input 'x': data for INT32 must be integers"),
    (tensor(datatype="INT8", data=[300]), "input 'x': a value is out of range for INT8"),
    (tensor(datatype="UINT8", data=[-1]), "input 'x': a value is out of range for UINT8"),
    (tensor(datatype="INT64", data=[2**64]), "input 'x': a value is out of range for INT64"),
    (tensor(), "input 'x': no 'data' and no 'binary_data_size'"),
    (tensor(data=[1], parameters={"binary_data_size": 4}), "input 'x': has both"),
    (tensor(data=[1], parameters={"shared_memory_region": "r"}), "shared memory"),
]


@pytest.mark.parametrize(("entry", "message"), BAD_INPUTS)
def test_malformed_input(entry: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode_infer_request(body_of([entry]), None)


def test_duplicate_input_names() -> None:
    with pytest.raises(BadRequest, match="input 'x' appears more than once"):
        decode_infer_request(body_of([tensor(data=[1]), tensor(data=[2])]), None)


@pytest.mark.parametrize(
    ("entry", "tail", "message"),
    [
        (tensor(shape=[2], parameters={"binary_data_size": 4}), b"\0" * 4, "does not match"),
        (tensor(shape=[1], parameters={"binary_data_size": 8}), b"\0" * 4, "exceeds the 4 bytes"),
        (tensor(shape=[1], parameters={"binary_data_size": 4}), b"\0" * 6, "2 bytes of binary"),
        (tensor(shape=[1], parameters={"binary_data_size": -4}), b"\0" * 4, "non-negative"),
        (tensor(shape=[1], parameters={"binary_data_size": "4"}), b"\0" * 4, "non-negative"),
        (tensor(shape=[1], parameters={"binary_data_size": True}), b"\0", "non-negative"),
        (
            tensor(shape=[10**8], parameters={"binary_data_size": 4}),
            b"\0" * 4,
            "does not match",
        ),
        (
            tensor(shape=[2], datatype="BYTES", parameters={"binary_data_size": 5}),
            struct.pack("<I", 1) + b"a",
            "input 'x': 5 bytes cannot hold 2",
        ),
        (
            tensor(shape=[1], datatype="BYTES", parameters={"binary_data_size": 6}),
            struct.pack("<I", 9) + b"ab",
            "input 'x': BYTES element 0 claims 9 bytes",
        ),
    ],
)
def test_malformed_binary(entry: dict, tail: bytes, message: str) -> None:
    header = body_of([entry])
    with pytest.raises(BadRequest, match=message):
        decode_infer_request(header + tail, len(header))


def test_binary_data_without_header_length() -> None:
    body = body_of([tensor(shape=[1], parameters={"binary_data_size": 4})])
    with pytest.raises(BadRequest, match="exceeds the 0 bytes"):
        decode_infer_request(body, None)


@pytest.mark.parametrize("length", [-1, 10**6, "abc", "1e3", "", " -3", 2.0, True])
def test_bad_header_length(length: Any) -> None:
    with pytest.raises(BadRequest, match="Inference-Header-Content-Length"):
        decode_infer_request(body_of([tensor(data=[1])]), length)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"parameters": {"priority": -1}}, "'priority' must be a non-negative integer"),
        ({"parameters": {"priority": "high"}}, "'priority'"),
        ({"parameters": {"timeout": 1.5}}, "'timeout'"),
        ({"parameters": {"binary_data_output": 1}}, "'binary_data_output' must be true"),
        ({"parameters": []}, "parameters"),
        ({"outputs": [{"name": "a"}, {"name": "a"}]}, "output 'a' is requested more than once"),
        ({"outputs": [{"parameters": {}}]}, "`name`"),
        ({"outputs": [{"name": "a", "parameters": {"binary_data": "yes"}}]}, "binary_data"),
        ({"outputs": [{"name": "a", "parameters": {"classification": -2}}]}, "classification"),
        (
            {"outputs": [{"name": "a", "parameters": {"shared_memory_region": "r"}}]},
            "shared memory",
        ),
    ],
)
def test_bad_request_parameters_and_outputs(extra: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode_infer_request(body_of([tensor(data=[1])], **extra), None)


# --- checked as declared, before any data is decoded ---------------------------------------


def test_check_sees_every_input_as_declared_before_any_data_is_decoded() -> None:
    seen: list[list[DeclaredInput]] = []

    def refuse(declared: list[DeclaredInput]) -> None:
        seen.append(declared)
        raise BadRequest("refused by the model's config")

    header = body_of(
        [
            tensor("a", (2, 2), "FP32", data=["not", "numbers", "at", "all"]),
            tensor("b", (1,), "BYTES", parameters={"binary_data_size": 5}),
        ]
    )
    tail = struct.pack("<I", 1) + b"z"
    with pytest.raises(BadRequest, match="refused by the model's config"):
        decode_infer_request(header + tail, len(header), check=refuse)
    assert seen == [[DeclaredInput("a", "FP32", (2, 2)), DeclaredInput("b", "BYTES", (1,))]]
    with pytest.raises(BadRequest, match="must be numbers"):  # what the check spared
        decode_infer_request(header + tail, len(header), check=seen.append)


def test_what_the_check_returns_is_kept_on_the_decoded_request() -> None:
    body = body_of([tensor("a", (1, 2), "FP32", data=[1.0, 2.0])])
    decoded = decode_infer_request(body, None, check=lambda declared: ("rows", len(declared)))
    assert decoded.checked == ("rows", 1)
    assert decode_infer_request(body, None).checked is None  # no check: nothing kept


def test_binary_sizes_are_checked_before_the_check() -> None:
    header = body_of([tensor("a", (4,), "FP32", parameters={"binary_data_size": 12})])
    with pytest.raises(BadRequest, match="does not match shape \\[4\\] of FP32 \\(16 bytes\\)"):
        decode_infer_request(header + b"\0" * 12, len(header), check=pytest.fail)


@pytest.mark.parametrize(
    ("shape", "data"),
    [
        ((2, 3), [1, 2, 3, 4, 5, 6]),  # flat
        ((2, 3), [[1, 2, 3], [4, 5, 6]]),  # nested as the shape
        ((2, 1, 3), [[1, 2, 3], [4, 5, 6]]),  # flatter than the shape
        ((1, 2, 3), [[[1, 2, 3], [4, 5, 6]]]),
        ((), [7]),  # a scalar is one element, flat
    ],
)
def test_data_flat_or_nested_no_deeper_than_its_shape(shape: tuple, data: list) -> None:
    got = decode_infer_request(body_of([tensor("x", shape, data=data)]), None).inputs["x"]
    assert got.shape == shape
    assert got.ravel().tolist() == list(np.ravel(data))


@pytest.mark.parametrize(
    ("shape", "data", "message"),
    [
        ((4,), [[1], [2], [3], [4]], "nested 2 deep, deeper than shape \\[4\\]"),
        ((2, 2), [[[1, 2]], [[3, 4]]], "nested 3 deep"),
        (
            (2, 2),
            [[1], [2], [3], [4]],
            "data has 5 arrays, more than shape \\[2,2\\] nests \\(3\\)",
        ),
        ((2, 2), [[1, 2, 3, 4], []], "an empty array inside it"),
        ((2, 0), [[], []], "an empty array inside it"),
        ((3,), [1, 2, 3, 4], "shape \\[3\\] has 3 elements but data has 4"),
        ((3, 2), [[1, 2], [3, 4, [5, 6]]], "must be integers.*got `array`"),  # deeper inside
        ((2, 2), [[1, 2, 3], 4], "must be integers.*Expected `array`"),  # shallower inside
    ],
)
def test_data_that_cannot_match_its_shape(shape: tuple, data: list, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode_infer_request(body_of([tensor("x", shape, data=data)]), None)


def test_strings_that_surely_outnumber_the_shape_are_refused_before_decoding() -> None:
    body = body_of([tensor("s", (2,), "BYTES", data=["a,b", "c", "d"])])
    with pytest.raises(BadRequest, match="has 2 elements but data has at least 3"):
        decode_infer_request(body, None)
    tricky = ["[1]", "\\", 'say "hi"', "a,b", "]["]  # brackets, commas, escapes in strings
    got = decode_infer_request(body_of([tensor("s", (5,), "BYTES", data=tricky)]), None)
    assert got.inputs["s"].tolist() == [t.encode() for t in tricky]


def test_nested_parameters_are_refused() -> None:
    with pytest.raises(BadRequest, match="parameters"):
        decode_infer_request(body_of([tensor(data=[1])], parameters={"a": [1, 2]}), None)
    entry = tensor(data=[1], parameters={"b": {"c": 1}})
    with pytest.raises(BadRequest, match=r"input 'x'.*parameters"):
        decode_infer_request(body_of([entry]), None)


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 100_000 + b"]" * 100_000,  # deeper than any shape
        b"[" + b",".join([b"[]"] * 2_000_000) + b"]",  # empty lists: 20x in memory
        b"[[" + b"],[".join([b"0"] * 2_000_000) + b"]]",  # more arrays than the shape nests
        b"[" + b",".join([b"0"] * 4_000_000) + b"]",  # more numbers than the shape has
        b'["' + b'","'.join([b"ab"] * 4_000_000) + b'"]',  # strings where numbers go
    ],
    ids=["deep", "empty-lists", "arrays", "numbers", "strings"],
)
def test_amplifying_data_is_refused_without_building_it(data: bytes) -> None:
    """Data that would grow many times its size as Python objects is refused from its raw
    bytes: the decoder's peak memory stays within a few copies of the body."""
    header = b'{"inputs": [{"name": "x", "shape": [64, 4096], "datatype": "INT32", "data": '
    body = header + data + b"}]}"
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest):
            decode_infer_request(body, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * len(body), (peak, len(body))


def test_a_schema_error_names_its_input_without_building_the_rest() -> None:
    data = b"[" + b",".join([b"[]"] * 2_000_000) + b"]"
    good = b'{"name": "x", "shape": [1], "datatype": "FP32", "data": ' + data + b"}"
    bad = b'{"name": "y", "shape": "1", "datatype": "FP32", "data": [1]}'
    body = b'{"inputs": [' + good + b", " + bad + b"]}"
    tracemalloc.start()
    try:
        with pytest.raises(BadRequest, match=r"input 'y': Expected `array`, got `str`"):
            decode_infer_request(body, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(body), (peak, len(body))


# --- the real client's requests decode --------------------------------------------------------


def client_input(name: str, array: np.ndarray, datatype: str, binary: bool) -> triton.InferInput:
    item = triton.InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array, binary_data=binary)
    return item


def client_array(datatype: str) -> np.ndarray:
    if datatype == "BF16":
        return float32_from_bf16_bits(SAMPLES["BF16"]).astype(ml_dtypes.bfloat16)
    return SAMPLES[datatype]


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_tritonclient_request_decodes(datatype: str, binary: bool) -> None:
    if datatype == "BF16" and not binary:
        pytest.skip("tritonclient sends BF16 only as binary")
    array = client_array(datatype)
    inputs = [
        client_input("x", array, datatype, binary),
        client_input("y", SAMPLES["FP32"], "FP32", True),
    ]
    outputs = [triton.InferRequestedOutput("out", binary_data=False, class_count=2)]
    body, length = triton.InferenceServerClient.generate_request_body(
        inputs, outputs=outputs, request_id="r1", priority=3, timeout=100
    )
    request = decode_infer_request(body, length)
    want = SAMPLES[datatype]
    assert_same(request.inputs["x"], want)
    assert_same(request.inputs["y"], SAMPLES["FP32"])
    assert request.id == "r1" and request.priority == 3 and request.timeout_us == 100
    assert request.outputs == [RequestedOutput("out", False, 2)]


def test_tritonclient_default_asks_binary_output() -> None:
    body, length = triton.InferenceServerClient.generate_request_body(
        [client_input("x", SAMPLES["INT32"], "INT32", False)]
    )
    request = decode_infer_request(body, length)
    assert request.binary_default is True and request.outputs == []


# --- encoding -------------------------------------------------------------------------------


def encode(outputs: dict[str, np.ndarray], **kwargs: Any) -> tuple[bytes, int | None]:
    fields: dict[str, Any] = {
        "model_name": "m",
        "model_version": "3",
        "request_id": "",
        "requested": None,
        "binary_default": False,
        "batched": True,
    }
    fields.update(kwargs)
    return encode_infer_response(outputs=outputs, **fields)


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("datatype", sorted(SAMPLES))
def test_tritonclient_reads_response(datatype: str, binary: bool) -> None:
    outputs = {"out": SAMPLES[datatype], "other": np.zeros(2, np.int32)}
    requested = [RequestedOutput("out", binary)]
    body, length = encode(outputs, requested=requested, datatypes={"out": datatype})
    assert (length is not None) == binary
    result = triton.InferResult.from_response_body(body, verbose=False, header_length=length)
    got = result.as_numpy("out")
    assert result.as_numpy("other") is None
    if datatype == "BF16":
        assert got.tolist() == float32_from_bf16_bits(SAMPLES["BF16"]).tolist()
    elif datatype == "BYTES" and not binary:  # JSON carries text
        assert got.tolist() == [[b.decode() for b in row] for row in SAMPLES[datatype].tolist()]
    else:
        assert got.tolist() == SAMPLES[datatype].tolist()
    assert result.get_response()["model_version"] == "3"


def test_response_header_fields() -> None:
    body, length = encode(
        {"a": np.array([1.5], np.float32)},
        request_id="r-9",
        parameters={"sequence_id": 4},
    )
    assert length is None
    doc = msgspec.json.decode(body)
    assert doc == {
        "model_name": "m",
        "model_version": "3",
        "id": "r-9",
        "parameters": {"sequence_id": 4},
        "outputs": [{"name": "a", "datatype": "FP32", "shape": [1], "data": [1.5]}],
    }


def test_response_binary_layout_in_requested_order() -> None:
    outputs = {
        "a": np.array([[1, 2]], np.int16),
        "b": np.array([b"\xff", b"zz"], dtype=object),
        "c": np.array([0.5], np.float64),
    }
    requested = [RequestedOutput("b", None), RequestedOutput("c", False), RequestedOutput("a")]
    body, length = encode(outputs, requested=requested, binary_default=True)
    assert length is not None
    header = msgspec.json.decode(body[:length])
    assert [o["name"] for o in header["outputs"]] == ["b", "c", "a"]
    assert header["outputs"][1]["data"] == [0.5]
    sizes = [o.get("parameters", {}).get("binary_data_size") for o in header["outputs"]]
    assert sizes == [4 + 1 + 4 + 2, None, 4]
    assert body[length:] == struct.pack("<I", 1) + b"\xff" + struct.pack("<I", 2) + b"zz" + (
        np.array([1, 2], "<i2").tobytes()
    )


def test_json_bytes_output_replaces_invalid_utf8() -> None:
    body, _ = encode({"s": np.array([b"ok", b"\xff", "é".encode()], dtype=object)})
    assert msgspec.json.decode(body)["outputs"][0]["data"] == ["ok", "\ufffd", "é"]


def test_json_float_nan_becomes_null() -> None:
    body, _ = encode({"f": np.array([np.nan, 1], np.float32)})
    assert msgspec.json.decode(body)["outputs"][0]["data"] == [None, 1.0]


def test_outputs_cast_to_configured_datatype() -> None:
    outputs: dict[str, np.ndarray] = {
        "f": np.array([0.1, 2], np.float64),
        "h": np.array([1.0], np.float32),
    }
    body, length = encode(outputs, binary_default=True, datatypes={"f": "FP32", "h": "BF16"})
    result = triton.InferResult.from_response_body(body, header_length=length)
    assert result.as_numpy("f").dtype == np.float32
    assert result.as_numpy("f").tolist() == np.array([0.1, 2], np.float32).tolist()
    assert result.as_numpy("h").astype(np.float32).tolist() == [1.0]


def test_unknown_requested_output() -> None:
    with pytest.raises(BadRequest, match="unexpected inference output 'zz'"):
        encode({"a": np.zeros(1)}, requested=[RequestedOutput("zz")])


def test_classification_output() -> None:
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4]], np.float32)
    body, _length = encode({"p": scores}, requested=[RequestedOutput("p", False, 2)])
    doc = msgspec.json.decode(body)["outputs"][0]
    assert doc["datatype"] == "BYTES" and doc["shape"] == [2, 2]
    assert doc["data"] == ["0.700000:1", "0.200000:2", "0.500000:0", "0.400000:2"]
    assert classify(np.array([3.0, 9.0]), 5, False).tolist() == [b"9.000000:1", b"3.000000:0"]


def test_classification_of_a_batch_has_a_row_per_batch_row() -> None:
    """A batching model's first dim is the batch, whatever the rank: [batch, k]."""
    labels = np.array([7, 2, 7], np.int64)  # one scalar per row
    body, _length = encode({"label": labels}, requested=[RequestedOutput("label", False, 1)])
    doc = msgspec.json.decode(body)["outputs"][0]
    assert doc["shape"] == [3, 1] and doc["data"] == ["7.000000:0", "2.000000:0", "7.000000:0"]
    scores = np.array([[[0.1, 0.9]], [[0.8, 0.2]]], np.float32)  # [2, 1, 2]
    assert classify(scores, 1, True).tolist() == [[b"0.900000:1"], [b"0.800000:0"]]


def test_classification_without_batching_is_of_the_whole_tensor() -> None:
    scores = np.array([[0.1, 0.7], [0.9, 0.2]], np.float32)
    body, _length = encode({"p": scores}, requested=[RequestedOutput("p", False, 2)], batched=False)
    doc = msgspec.json.decode(body)["outputs"][0]
    assert doc["shape"] == [2] and doc["data"] == ["0.900000:2", "0.700000:1"]


def test_encode_error() -> None:
    assert msgspec.json.decode(encode_error('bad "x"')) == {"error": 'bad "x"'}


# --- property tests -------------------------------------------------------------------------

SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


def _fixed_arrays(datatype: str, finite: bool) -> st.SearchStrategy[np.ndarray]:
    if datatype == "BF16":  # uint16 bits; JSON cannot carry NaN or inf, binary can but NaN != NaN

        def wanted(bits: np.ndarray) -> bool:
            values = float32_from_bf16_bits(bits)
            return bool(np.isfinite(values).all() if finite else not np.isnan(values).any())

        return hnp.arrays(np.uint16, SHAPES).filter(wanted)
    dtype = np.dtype(SAMPLES[datatype].dtype)
    if dtype.kind != "f":
        return hnp.arrays(dtype, SHAPES)
    width: Any = dtype.itemsize * 8
    floats = st.floats(width=width, allow_nan=not finite, allow_infinity=not finite)
    return hnp.arrays(dtype, SHAPES, elements=floats)


def _bytes_arrays(text_only: bool) -> st.SearchStrategy[np.ndarray]:
    item = st.text(max_size=6).map(str.encode) if text_only else st.binary(max_size=6)
    return hnp.arrays(np.dtype(object), SHAPES, elements=item)


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("datatype", sorted(SAMPLES))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_round_trip_property(datatype: str, binary: bool, data: st.DataObject) -> None:
    if datatype == "BYTES":
        array = data.draw(_bytes_arrays(text_only=not binary))
    else:
        array = data.draw(_fixed_arrays(datatype, finite=not binary))
    body, length = encode({"t": array}, binary_default=binary, datatypes={"t": datatype})
    request = decode_infer_request(*to_request(body, length))
    assert request.input_datatypes == {"t": datatype}
    assert_same(request.inputs["t"], array)


# --- fuzz: nothing but BadRequest escapes ---------------------------------------------------


def _valid_body() -> tuple[bytes, int]:
    raw = np.arange(4, dtype=np.float32).tobytes() + struct.pack("<I", 2) + b"hi"
    header = body_of(
        [
            tensor("a", (2, 2), "FP32", parameters={"binary_data_size": 16}),
            tensor("b", (1,), "BYTES", parameters={"binary_data_size": 6}),
            tensor("c", (2, 1), "INT64", data=[[1], [2]]),
            tensor("d", (1,), "BYTES", data=["s"]),
        ],
        id="z",
        outputs=[{"name": "o", "parameters": {"binary_data": True}}],
    )
    return header + raw, len(header)


def test_valid_fuzz_seed_decodes() -> None:
    body, length = _valid_body()
    request = decode_infer_request(body, length)
    assert request.inputs["b"].tolist() == [b"hi"]


def _decode_only_bad_request(body: bytes, length: int | str | None) -> None:
    with contextlib.suppress(BadRequest):
        decode_infer_request(body, length, max_elements=1 << 16)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.one_of(st.none(), st.integers(-5, 250), st.text(max_size=4)))
def test_fuzz_random_bytes(body: bytes, length: int | str | None) -> None:
    _decode_only_bad_request(body, length)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["flip", "cut", "insert", "delete"]),
            st.integers(0, 10**6),
            st.binary(min_size=1, max_size=8),
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(-3, 3),
)
def test_fuzz_mutated_valid_body(edits: list[tuple[str, int, bytes]], shift: int) -> None:
    body, length = _valid_body()
    mutable = bytearray(body)
    for op, where, blob in edits:
        at = where % (len(mutable) + 1)
        if op == "flip" and at < len(mutable):
            mutable[at] ^= blob[0] or 1
        elif op == "cut":
            del mutable[at:]
        elif op == "insert":
            mutable[at:at] = blob
        else:
            del mutable[at : at + len(blob)]
    _decode_only_bad_request(bytes(mutable), length + shift)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=3),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "name": st.one_of(st.just("x"), JSON_VALUES),
            "shape": st.one_of(st.lists(st.integers(-2, 5), max_size=3), JSON_VALUES),
            "datatype": st.one_of(st.sampled_from(sorted(SAMPLES)), JSON_VALUES),
            "data": JSON_VALUES,
            "parameters": st.one_of(
                st.just({}), st.fixed_dictionaries({"binary_data_size": JSON_VALUES})
            ),
        }
    )
)
def test_fuzz_structured_inputs(entry: dict) -> None:
    _decode_only_bad_request(body_of([entry]), None)
