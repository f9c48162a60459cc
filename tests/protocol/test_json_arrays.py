from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from lockgate.protocol.json_arrays import count_scalars, kind_of, opening_depth, strings_at_least

SCALARS = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none())
# arrays nested at any depth, no inner array empty (the top one may be)
NESTED = st.recursive(
    st.lists(SCALARS, min_size=1, max_size=4),
    lambda inner: st.lists(st.one_of(SCALARS, inner), min_size=1, max_size=4),
    max_leaves=30,
)
PROPERTY = settings(max_examples=200, deadline=None)


def leaves_and_lists(value: Any) -> tuple[int, int]:
    if not isinstance(value, list):
        return 1, 0
    counts = [leaves_and_lists(item) for item in value]
    return sum(c[0] for c in counts), 1 + sum(c[1] for c in counts)


@PROPERTY
@given(NESTED, st.sampled_from([",", ", ", ",\n  "]))
def test_scalar_counts_are_exact(value: list[Any], separator: str) -> None:
    data = json.dumps(value, separators=(separator, ":")).encode()
    counted = count_scalars(data)
    assert (counted.leaves, counted.lists) == leaves_and_lists(value)
    assert not counted.empty_inside


def test_empty_arrays() -> None:
    assert count_scalars(b" [ ] ").leaves == 0
    assert count_scalars(b"[[], [1]]").empty_inside
    assert count_scalars(b"[[1], [ ]]").empty_inside


@PROPERTY
@given(st.lists(st.text(), max_size=8))
def test_strings_at_least_bounds_the_strings(texts: list[str]) -> None:
    data = json.dumps(texts).encode()
    least = strings_at_least(data)
    assert least <= len(texts) <= 2 * least + 1


def test_opening_depth_and_kind() -> None:
    assert opening_depth(b" [ [\n[1]]]") == 3
    assert opening_depth(b"[" * 100_000) == 100_000
    assert opening_depth(b'"[[["') == 0
    assert [kind_of(v) for v in (b" {", b'"a"', b"-1", b"true", b"null", b"")] == [
        "an object",
        "a string",
        "a number",
        "a boolean",
        "null",
        "nothing",
    ]
