from __future__ import annotations

import numpy as np

from lockgate.cache.key import request_key, text_key


def key(inputs: dict[str, np.ndarray], outputs: tuple[str, ...] | None = None) -> str:
    return request_key("m", 1, inputs, outputs)


def test_equal_requests_give_equal_keys_in_any_input_order() -> None:
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(2, dtype=np.int64)
    assert key({"a": a, "b": b}) == key({"b": b.copy(), "a": a.copy()})


def test_everything_that_decides_the_answer_changes_the_key() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    base = key({"x": x})
    changed = [
        key({"x": x.reshape(3, 2)}),  # shape
        key({"x": x.astype(np.float64)}),  # dtype
        key({"y": x}),  # name
        key({"x": x + 1}),  # bytes
        key({"x": x}, ("label",)),  # outputs asked for
        request_key("m", 2, {"x": x}, None),  # version
        request_key("n", 1, {"x": x}, None),  # model
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_bytes_tensors_are_length_prefixed() -> None:
    one = np.array([b"ab", b"c"], dtype=object)
    other = np.array([b"a", b"bc"], dtype=object)
    assert key({"t": one}) != key({"t": other})
    assert text_key("m", "1", b"ab") != text_key("m", "1", b"abc")


def test_non_contiguous_arrays_hash_by_value() -> None:
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert key({"x": x[:, ::2]}) == key({"x": np.ascontiguousarray(x[:, ::2])})
