from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockgate.config import DATATYPES
from lockgate.datatypes import (
    bf16_bits_from_float32,
    datatype_of,
    deserialize_bytes_tensor,
    element_size,
    float32_from_bf16_bits,
    is_datatype,
    numpy_dtype,
    serialize_bytes_tensor,
)
from lockgate.errors import BadRequest, ServingError

SIZES = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "FP32": 4,
    "FP64": 8,
    "BF16": 2,
}


def test_every_config_datatype_is_known() -> None:
    assert all(is_datatype(name) for name in DATATYPES)
    assert not is_datatype("FP8")


@pytest.mark.parametrize("datatype", sorted(SIZES))
def test_element_size(datatype: str) -> None:
    assert element_size(datatype) == SIZES[datatype]
    assert numpy_dtype(datatype).itemsize == SIZES[datatype]


def test_bytes_has_no_element_size_and_is_object() -> None:
    assert numpy_dtype("BYTES") == np.dtype(object)
    with pytest.raises(BadRequest, match="BYTES"):
        element_size("BYTES")


def test_unknown_datatype_is_bad_request() -> None:
    with pytest.raises(BadRequest, match="'COMPLEX64'"):
        numpy_dtype("COMPLEX64")


@pytest.mark.parametrize("datatype", sorted(set(SIZES) - {"BF16"}))
def test_datatype_of_inverts_numpy_dtype(datatype: str) -> None:
    assert datatype_of(np.zeros(2, dtype=numpy_dtype(datatype))) == datatype


def test_datatype_of_big_endian_and_text() -> None:
    assert datatype_of(np.zeros(2, dtype=">f4")) == "FP32"
    assert datatype_of(np.array([b"a"])) == "BYTES"
    assert datatype_of(np.array(["a"])) == "BYTES"
    assert datatype_of(np.array([b"a"], dtype=object)) == "BYTES"
    with pytest.raises(ServingError, match="complex"):
        datatype_of(np.zeros(2, dtype=np.complex64))


def test_bf16_round_trip_is_exact_for_bf16_values() -> None:
    values = np.array([0.0, -0.0, 1.0, -2.5, 3.140625, np.inf, -np.inf, 2.0**100], np.float32)
    bits = bf16_bits_from_float32(values)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(float32_from_bf16_bits(bits), values)
    assert bits[2] == 0x3F80  # 1.0


def test_bf16_rounds_to_nearest_even_and_keeps_nan() -> None:
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0)
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    np.testing.assert_array_equal(
        float32_from_bf16_bits(bf16_bits_from_float32(halfway)), [1, 1 + 2**-6]
    )
    nan = float32_from_bf16_bits(bf16_bits_from_float32(np.array([np.nan], np.float32)))
    assert np.isnan(nan).all()


@given(st.lists(st.floats(width=32), max_size=16))
def test_bf16_rounding_matches_ml_dtypes(values: list[float]) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    array = np.array(values, dtype=np.float32)
    expected = array.astype(ml_dtypes.bfloat16).view(np.uint16)
    ours = bf16_bits_from_float32(array)
    finite = ~np.isnan(array)
    np.testing.assert_array_equal(ours[finite], expected[finite])
    assert np.isnan(float32_from_bf16_bits(ours[~finite])).all()


def test_bytes_serialization_layout() -> None:
    array = np.array([[b"ab", b""], [b"\xff\x00", "é"]], dtype=object)
    raw = serialize_bytes_tensor(array)
    assert raw == b"".join(
        struct.pack("<I", len(p)) + p for p in [b"ab", b"", b"\xff\x00", "é".encode()]
    )
    back = deserialize_bytes_tensor(raw, 4)
    assert back.tolist() == [b"ab", b"", b"\xff\x00", "é".encode()]


def test_serialize_non_bytes_elements_as_text() -> None:
    raw = serialize_bytes_tensor(np.array([7, bytearray(b"x")], dtype=object))
    assert deserialize_bytes_tensor(raw, 2).tolist() == [b"7", b"x"]


def test_empty_bytes_tensor() -> None:
    assert serialize_bytes_tensor(np.empty((0, 3), dtype=object)) == b""
    assert deserialize_bytes_tensor(b"", 0).shape == (0,)


@pytest.mark.parametrize(
    ("raw", "count", "message"),
    [
        (b"\x01\x00", 1, "cannot hold"),  # shorter than one length
        (struct.pack("<I", 5) + b"abc", 1, "claims 5 bytes but only 3 remain"),
        (struct.pack("<I", 0xFFFFFFFF), 1, "claims 4294967295"),
        (struct.pack("<I", 1) + b"a" + b"\x00\x00", 2, "cannot hold"),
        (struct.pack("<I", 1) + b"a" + b"\x00\x00\x00\x00\x00", 2, "left over"),
        (struct.pack("<I", 1) + b"a" + b"\x00\x00\x00", 1, "3 bytes left over"),
        (b"\x00" * 8, 10**9, "cannot hold"),  # a huge count fails before allocating
    ],
)
def test_deserialize_rejects_malformed(raw: bytes, count: int, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        deserialize_bytes_tensor(raw, count, name="text")
    assert "input 'text'" in str(info.value)


@given(st.lists(st.binary(max_size=20), max_size=20))
def test_bytes_round_trip(items: list[bytes]) -> None:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    assert deserialize_bytes_tensor(serialize_bytes_tensor(array), len(items)).tolist() == items


@given(st.binary(max_size=64), st.integers(min_value=0, max_value=40))
def test_deserialize_only_raises_bad_request(raw: bytes, count: int) -> None:
    with contextlib.suppress(BadRequest):
        deserialize_bytes_tensor(raw, count)
