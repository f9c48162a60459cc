from __future__ import annotations

import numpy as np

from lockgate.cache import blob
from lockgate.cache.lru import LRUTier


def outputs(n: int) -> dict[str, np.ndarray]:
    return {"y": np.zeros(n, dtype=np.uint8)}


def test_bounded_in_bytes_least_recently_used_leaves_first() -> None:
    tier = LRUTier(max_bytes=300)
    for key in "abc":
        tier.put(key, outputs(100), 100, None)
    assert tier.get("a", 0.0) is not None  # a is now the most recent
    tier.put("d", outputs(100), 100, None)
    assert tier.get("b", 0.0) is None and tier.get("a", 0.0) is not None
    assert tier.bytes == 300 and len(tier) == 3


def test_too_large_entries_are_not_kept() -> None:
    tier = LRUTier(max_bytes=50)
    assert not tier.put("a", outputs(100), 100, None)
    assert len(tier) == 0 and tier.bytes == 0


def test_expired_entries_answer_only_when_stale_is_asked() -> None:
    tier = LRUTier(max_bytes=1000)
    tier.put("a", outputs(1), 10, expires=5.0)
    assert tier.get("a", 4.0) is not None
    assert tier.get("a", 6.0) is None
    assert tier.get("a", 6.0, stale=True) is not None


def test_replacing_a_key_keeps_the_byte_count_right() -> None:
    tier = LRUTier(max_bytes=1000)
    tier.put("a", outputs(1), 10, None)
    tier.put("a", outputs(1), 30, None)
    assert tier.bytes == 30 and len(tier) == 1


def test_blob_round_trips_numeric_and_bytes_tensors() -> None:
    arrays = {
        "f": np.arange(6, dtype=np.float32).reshape(2, 3),
        "i": np.array([1, -2], dtype=np.int64),
        "t": np.array([[b"x"], [b"\x00yz"]], dtype=object),
    }
    back = blob.decode(blob.encode(arrays))
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        assert back[name].tolist() == array.tolist()
    assert blob.nbytes(arrays) > 0
