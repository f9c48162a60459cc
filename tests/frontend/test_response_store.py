"""The store of /v1/responses (`frontend/response_store.py`): an LRU bounded by count."""

from __future__ import annotations

import pytest

from lockgate.frontend.response_store import ResponseStore, StoredResponse


def stored(n: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}"}, (), ())


def test_the_least_recently_used_goes_first() -> None:
    store = ResponseStore(2)
    assert store.put("a", stored(1)) and store.put("b", stored(2))
    assert store.get("a") == stored(1)  # read: now the most recent
    store.put("c", stored(3))
    assert store.get("b") is None and len(store) == 2
    assert store.get("a") == stored(1) and store.get("c") == stored(3)
    store.put("a", stored(4))  # stored again: replaced, the most recent
    store.put("d", stored(5))
    assert store.get("c") is None and store.get("a") == stored(4)
    assert store.delete("a") and not store.delete("a") and store.get("a") is None


def test_size_zero_keeps_nothing_and_negative_is_refused() -> None:
    off = ResponseStore(0)
    assert not off.put("a", stored(1)) and off.get("a") is None
    with pytest.raises(ValueError, match="--responses-store-size"):
        ResponseStore(-1)
