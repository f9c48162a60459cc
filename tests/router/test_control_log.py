"""The router's record of model control requests (`control_log.py`) and how the answers of the
replicas make one answer (`ControlAnswer`): pure bookkeeping, no sockets."""

from __future__ import annotations

import json

from lockgate.router.control_log import Control, ControlLog, Entry
from lockgate.router.model_control import DEADLINE, ControlAnswer, Told
from lockgate.router.replica import Replica
from lockgate.router.upstream import Upstream


def entry(model: str, action: str = "load", body: bytes = b"{}") -> Entry:
    return Entry(Control(model, action), ((b"authorization", b"Bearer k"),), body)


def test_control_paths() -> None:
    assert Control.parse("POST", "/v2/repository/models/m/load") == Control("m", "load")
    assert Control.parse("POST", "/v2/repository/models/m/unload") == Control("m", "unload")
    for method, path in [
        ("GET", "/v2/repository/models/m/load"),
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/repository/models//load"),
        ("POST", "/v2/repository/models/m/versions/1/load"),
        ("POST", "/v2/repository/models/m/reload"),
        ("POST", "/v2/models/m/infer"),
    ]:
        assert Control.parse(method, path) is None, path
    assert Control("a b", "load").path == "/v2/repository/models/a%20b/load"


def test_each_model_keeps_its_last_request_in_the_order_they_came() -> None:
    log = ControlLog(max_bytes=10_000)
    assert log.record(entry("a"))
    assert log.record(entry("b"))
    assert log.record(entry("a", "unload"))
    assert log.seq == 3
    assert [(e.control.model, e.control.action, e.seq) for e in log.since(0)] == [
        ("b", "load", 2),
        ("a", "unload", 3),
    ]
    assert [e.control.model for e in log.since(2)] == ["a"]  # told up to 2: a's unload only
    assert log.since(3) == []
    assert log.size == sum(e.size for e in log.since(0))


def test_a_request_past_the_memory_bound_is_not_kept_nor_its_models_older_one() -> None:
    log = ControlLog(max_bytes=200)
    assert log.record(entry("a", body=b"x" * 50))
    assert log.record(entry("b", body=b"x" * 50))
    assert not log.record(entry("a", body=b"x" * 500))  # a's files: too many bytes
    assert [e.control.model for e in log.since(0)] == ["b"]  # a's old load is not replayed
    assert log.seq == 3  # a replica told up to 2 is behind: there is nothing for it to replay
    assert log.size == entry("b", body=b"x" * 50).size
    log.forget("b")
    assert log.size == 0 and log.since(0) == []


def replica(n: int) -> Replica:
    return Replica(f"http://127.0.0.1:{9000 + n}", Upstream("127.0.0.1", 9000 + n))


def test_the_answer_is_200_only_when_every_replica_applied_it() -> None:
    load = Control("m", "load")
    ok = [Told(replica(i), 200, b"{}") for i in range(3)]
    assert ControlAnswer.of(load, ok) == ControlAnswer(200, b"{}")
    refused = Told(replica(1), 400, b'{"error": "model \'m\' failed to load: bad"}')
    gone = Told(replica(2), 0, why="cannot connect")
    answer = ControlAnswer.of(load, [ok[0], refused, gone])
    assert answer.status == 400  # the first failure's, in the pool's order
    message = json.loads(answer.body)["error"]
    assert message == answer.message
    assert "load of model 'm' failed on 2 of 3 replicas (applied on 1)" in message
    assert "http://127.0.0.1:9001: 400: model 'm' failed to load: bad" in message
    assert "http://127.0.0.1:9002: cannot connect" in message
    assert "http://127.0.0.1:9000" not in message
    assert "before it takes traffic again" in message  # the one not reached catches up
    assert ControlAnswer.of(load, [gone, ok[0]]).status == 502
    late = Told(replica(0), 0, why=DEADLINE)
    assert ControlAnswer.of(load, [late]).status == 504
    text = Told(replica(0), 500, b"Internal Server Error")  # not JSON: its text
    assert "500: Internal Server Error" in ControlAnswer.of(load, [text]).message
