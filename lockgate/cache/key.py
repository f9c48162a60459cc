"""The cache key: a BLAKE2b hash of everything that decides a model's answer."""

from __future__ import annotations

import hashlib

import numpy as np

from lockgate.datatypes import Arrays

DIGEST_BYTES = 16  # 128 bits: collisions are out of reach, and keys stay short


def request_key(
    model: str,
    version: int,
    inputs: Arrays,
    outputs: tuple[str, ...] | None,
    generation: str = "",
) -> str:
    """The key of one request: model, version and its `generation` (what the loaded version
    is: its fingerprint), every input's name, dtype, shape and bytes in name order, and the
    outputs asked for. Equal requests give equal keys, whatever the order of their inputs."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _text(h, model)
    _text(h, str(version))
    _text(h, generation)
    for name in sorted(inputs):
        array = inputs[name]
        _text(h, name)
        _text(h, array.dtype.str)
        _text(h, ",".join(map(str, array.shape)))
        _array(h, array)
    _text(h, "outputs:" + ("*" if outputs is None else ",".join(sorted(outputs))))
    return h.hexdigest()


def text_key(model: str, version: str, text: bytes) -> str:
    """The key of one text for per-text caches (embeddings)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in (model.encode(), version.encode(), text):
        _bytes(h, part)
    return h.hexdigest()


def _text(h: hashlib.blake2b, value: str) -> None:
    _bytes(h, value.encode())


def _bytes(h: hashlib.blake2b, value: bytes | memoryview) -> None:
    h.update(len(value).to_bytes(8, "little"))  # length-prefixed: no two splits collide
    h.update(value)


def _array(h: hashlib.blake2b, array: np.ndarray) -> None:
    if array.dtype == object:  # BYTES: each element, length-prefixed
        for item in array.reshape(-1):
            _bytes(h, item if isinstance(item, bytes) else str(item).encode())
        return
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    _bytes(h, data.data)
