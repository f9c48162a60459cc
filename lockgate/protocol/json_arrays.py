"""JSON arrays measured before they are decoded: how deep, how many leaves, how many lists.

A decoder builds a Python object for every element and every list, 30 bytes and more for a
few bytes of JSON: `[[],[],...]` grows twenty times in memory. These counts read the raw
bytes at the speed of `bytes.count`, so data that cannot match what its request declares is
refused before anything is built. They are exact for valid JSON; on invalid JSON they still
bound what a decoder builds before it meets the error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OPENING = re.compile(rb"[\s\[]*")
_WHITESPACE = b" \t\r\n"
_EMPTY = re.compile(rb"\[[ \t\r\n]*\]")  # an empty list
_KINDS = {b"[": "an array", b"{": "an object", b'"': "a string", b"n": "null"}
_KINDS |= {b"t": "a boolean", b"f": "a boolean"}


@dataclass(slots=True)
class ScalarArray:
    """The counts of an array of numbers, booleans or null, nested or flat."""

    leaves: int
    lists: int  # the array itself and every list inside it
    empty_inside: bool  # an empty list below the top one


def opening_depth(data: bytes) -> int:
    """The brackets `data` opens with: how deep its first element is nested (0: no array)."""
    match = _OPENING.match(data)
    return match.group().count(b"[") if match else 0


def kind_of(data: bytes) -> str:
    """What a JSON value is, from its first character, in JSON's words."""
    head = data.lstrip(_WHITESPACE)[:1]
    return _KINDS.get(head, "a number" if head else "nothing")


def count_scalars(data: bytes) -> ScalarArray:
    """Counts of an array that holds no string and no object. A list of k > 0 items has
    k - 1 commas, so with no empty list the leaves are the commas plus one. (Whitespace
    counts for nothing, and is not removed first: that copy took a third of the time.)"""
    if _EMPTY.fullmatch(data.strip(_WHITESPACE)):
        return ScalarArray(0, 1, False)
    empty_inside = _EMPTY.search(data) is not None
    return ScalarArray(data.count(b",") + 1, data.count(b"["), empty_inside)


def strings_at_least(data: bytes) -> int:
    """A lower bound on the strings of an array of strings. Each string opens with a quote
    that no backslash precedes, and closes with one that only an escaped backslash may
    precede; so a decoder builds at most twice this many (plus one) before it stops."""
    return (data.count(b'"') - data.count(b'\\"')) // 2
