"""The bookkeeping of a stateful model's sequences (`core/sequences.py`): ids, starts and ends,
the idle timeout and the bound on live sequences, with the times given."""

from __future__ import annotations

import pytest

from lockgate.core.sequences import SequenceFlags, SequenceTable
from lockgate.errors import BadRequest, Unavailable


def table(limit: int = 4, idle_s: float = 1.0) -> SequenceTable:
    return SequenceTable("acc", limit, idle_s)


def test_a_request_without_a_correlation_id_is_refused_in_tritons_words() -> None:
    for flags in (SequenceFlags(), SequenceFlags(0, start=True), SequenceFlags("", start=True)):
        with pytest.raises(BadRequest, match="must specify a non-zero or non-empty correlation"):
            table().admit(flags, 0.0)


def test_a_sequence_starts_with_start_and_is_freed_by_end() -> None:
    live = table()
    with pytest.raises(BadRequest, match="sequence 7 to model 'acc' must specify the START flag"):
        live.admit(SequenceFlags(7), 0.0)
    first = live.admit(SequenceFlags(7, start=True), 0.0)
    live.done(first, 0.1)
    second = live.admit(SequenceFlags(7), 0.2)
    assert second is first and list(live.live) == [7]
    live.done(second, 0.3)
    last = live.admit(SequenceFlags(7, end=True), 0.4)
    assert not live.live  # a request that follows the end must start again
    with pytest.raises(BadRequest, match="START flag"):
        live.admit(SequenceFlags(7), 0.5)
    again = live.admit(SequenceFlags(7, start=True), 0.5)
    assert again is not last and again.turn is last.turn  # runs after the end is answered
    live.done(last, 0.6)
    assert not live.ending


def test_string_ids_are_sequences_of_their_own() -> None:
    live = table()
    live.admit(SequenceFlags("a", start=True), 0.0)
    live.admit(SequenceFlags(97, start=True), 0.0)
    assert sorted(map(str, live.live)) == ["97", "a"]


def test_an_idle_sequence_is_freed_but_not_one_with_a_request_waiting() -> None:
    live = table(idle_s=1.0)
    waiting = live.admit(SequenceFlags(1, start=True), 0.0)  # not answered yet
    idle = live.admit(SequenceFlags(2, start=True), 0.0)
    live.done(idle, 0.5)
    assert live.count(1.4) == 2  # 0.9 s idle: still live
    assert live.count(1.6) == 1 and 1 in live.live  # 2 freed; 1 still has a request
    with pytest.raises(BadRequest, match="START flag"):
        live.admit(SequenceFlags(2), 1.6)
    live.done(waiting, 1.7)
    assert live.count(2.8) == 0


def test_past_the_limit_a_new_sequence_waits_for_one_to_end_or_idle_out() -> None:
    live = table(limit=2, idle_s=3.0)
    for key in (1, 2):
        live.done(live.admit(SequenceFlags(key, start=True), 0.0), 0.0)
    with pytest.raises(Unavailable) as caught:
        live.admit(SequenceFlags(3, start=True), 1.0)
    assert caught.value.retry_after == 2  # the first idles out at 3.0
    live.admit(SequenceFlags(2), 1.0)  # a live sequence goes on
    live.done(live.admit(SequenceFlags(1, end=True), 1.0), 1.0)
    live.admit(SequenceFlags(3, start=True), 1.1)
    assert sorted(live.live) == [2, 3]
