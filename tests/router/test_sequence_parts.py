"""Sequence affinity's bookkeeping: the sequence read off REST bodies (JSON and binary) and
gRPC request bytes, and the table that pins sequences to replicas."""

from __future__ import annotations

import json

import pytest

from lockgate.protocol.grpc import inference_pb2 as pb
from lockgate.router.grpc_model import model_of, sequence_of
from lockgate.router.sequence_affinity import SequenceGone, SequenceRequest, SequenceTable
from tests.router.test_parts import replica


def test_a_rest_body_names_its_sequence_in_its_json_part() -> None:
    inputs = [{"name": "INPUT", "datatype": "INT32", "shape": [1], "data": [1]}]
    plain = json.dumps({"inputs": inputs}).encode()
    assert SequenceRequest.of_json([], plain) is None
    params = {"sequence_id": 2**64 + 7, "sequence_start": True}
    body = json.dumps({"parameters": params, "inputs": inputs}).encode()
    assert SequenceRequest.of_json([], body) == SequenceRequest(b"7", start=True)
    # binary: only the JSON header counts, the tensor bytes after it are not read
    header = json.dumps({"parameters": {"sequence_id": "abc", "sequence_end": True}}).encode()
    binary = header + b'"sequence_id": 9'
    length = [(b"inference-header-content-length", b"%d" % len(header))]
    assert SequenceRequest.of_json(length, binary) == SequenceRequest(b"abc", end=True)
    tail_only = plain + b'"sequence_id"'
    assert SequenceRequest.of_json([(length[0][0], b"%d" % len(plain))], tail_only) is None
    for bad in (0, "", True, 1.5, None):  # no affinity: the replica answers 400
        text = json.dumps({"parameters": {"sequence_id": bad}}).encode()
        assert SequenceRequest.of_json([], text) is None
    assert SequenceRequest.of_json([], b'{"parameters": {"sequence_id": ') is None


def test_a_grpc_request_names_its_sequence_in_its_parameters() -> None:
    request = pb.ModelInferRequest(model_name="acc", id="r1")
    request.parameters["priority"].int64_param = 1
    assert sequence_of(request.SerializeToString()) is None
    request.parameters["sequence_id"].uint64_param = 42
    request.parameters["sequence_start"].bool_param = True
    tensor = request.inputs.add(name="INPUT", datatype="BYTES", shape=[1])
    tensor.parameters["sequence_id"].int64_param = 5  # an input's: not the request's
    request.raw_input_contents.append(b"sequence_id" * 100)
    data = request.SerializeToString()
    assert sequence_of(data) == SequenceRequest(b"42", start=True)
    assert model_of(data) == "acc"
    assert sequence_of(b"\xff\xff") is None


def test_a_sequence_stays_pinned_until_it_ends() -> None:
    a, b, c = replica(1), replica(2), replica(3)
    table = SequenceTable(size=2)
    first = table.pick(SequenceRequest(b"s1", start=True), [a, b])
    assert first is not None
    # a replica that joins takes no live sequence
    assert all(table.pick(SequenceRequest(b"s1"), [a, b, c]) is first for _ in range(5))
    with pytest.raises(SequenceGone, match=f"sequence s1 lives on replica {first.url}"):
        table.pick(SequenceRequest(b"s1"), [r for r in (a, b, c) if r is not first])
    table.pick(SequenceRequest(b"s1", end=True), [a, b, c])
    assert len(table) == 0
    for key in (b"x", b"y", b"z"):  # bounded: the least recently used goes
        table.pick(SequenceRequest(key, start=True), [a, b, c])
    assert list(table.pins) == [b"y", b"z"]
