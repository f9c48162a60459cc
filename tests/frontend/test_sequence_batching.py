"""Stateful models (Triton's `sequence_batching`) on a real server, through tritonclient over
HTTP and gRPC: control inputs, an implicit state carried from request to request, sequences
that share batches a row each, ends, idle timeouts and the bound on live sequences."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.backends.test_triton_python import triton_repository
from tests.conftest import PERF_ANALYZER, RunningServer, free_port, start_server

# an accumulator: OUTPUT = state + INPUT, the new state; it also answers what the sequence
# batcher gave it: the control inputs, the requests of its execute(), and how many of them
# belong to the request's own sequence (by its correlation id)
ACCUMULATOR = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        ids = [request.correlation_id() for request in requests]
        time.sleep(0.01)  # batches long enough for requests of other sequences to gather
        responses = []
        for request in requests:
            def get(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            corrid = get("CORRID")
            total = get("STATE_IN") + get("INPUT")
            outputs = {
                "OUTPUT": total,
                "STATE_OUT": total,
                "ROWS": np.full(corrid.shape, len(requests), dtype=np.int32),
                "SHARED": np.full(corrid.shape, ids.count(ids[len(responses)]), dtype=np.int32),
            }
            for name in ("START", "END", "READY", "CORRID"):
                outputs[name + "_OUT"] = get(name)
            tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
input [{{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }}]
output [
  {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "START_OUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "END_OUT" data_type: TYPE_FP32 dims: [ 1 ] }},
  {{ name: "READY_OUT" data_type: TYPE_BOOL dims: [ 1 ] }},
  {{ name: "CORRID_OUT" data_type: {corrid} dims: [ 1 ] }},
  {{ name: "ROWS" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "SHARED" data_type: TYPE_INT32 dims: [ 1 ] }}
]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  control_input [
    {{ name: "START" control [{{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }}] }},
    {{ name: "END" control [{{ kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] }}] }},
    {{ name: "READY"
       control [{{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }}] }},
    {{ name: "CORRID" control [{{ kind: CONTROL_SEQUENCE_CORRID data_type: {corrid} }}] }}
  ]
  state [{{
    input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ]
    initial_state {{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zeros" }}
  }}]
}}
"""

CHAIN = """
name: "chain"
platform: "ensemble"
max_batch_size: 8
input [{{ name: "VALUE" data_type: TYPE_INT32 dims: [ 1 ] }}]
output [{{ name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }}]
ensemble_scheduling {{ step [{{
  model_name: "acc" model_version: -1
  input_map {{ key: "INPUT" value: "VALUE" }}
  output_map {{ key: "OUTPUT" value: "SUM" }}
}}] }}
"""

IDLE_S = 0.8  # the `text` model's max_sequence_idle_microseconds
TEXT_LIMIT = 3  # --max-sequences: the `text` model's config sets no max_candidate_sequences


def config(**values: object) -> str:
    return CONFIG.format(**values).replace("{", "{{").replace("}", "}}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    oldest = "oldest { max_candidate_sequences: 8 }"
    repo = triton_repository(
        tmp_path_factory.mktemp("sequence-repo"),
        (
            "acc",
            config(
                name="acc",
                max_batch_size=8,
                corrid="TYPE_UINT64",
                idle_us=5_000_000,
                strategy=oldest,
            ),
            ACCUMULATOR,
        ),
        (
            "text",  # no batch dimension, string correlation ids, Triton's default strategy
            config(
                name="text",
                max_batch_size=0,
                corrid="TYPE_STRING",
                idle_us=int(IDLE_S * 1e6),
                strategy="",
            ),
            ACCUMULATOR,
        ),
        ("chain", CHAIN, ""),
        (
            "caller",  # calls other models: it runs outside the batcher, so it cannot be loaded
            config(name="caller", max_batch_size=8, corrid="TYPE_UINT64", idle_us=1, strategy=""),
            ACCUMULATOR + "\n# pb_utils.InferenceRequest(model_name='acc')\n",
        ),
    )
    running = start_server(
        repo,
        tmp_path_factory.mktemp("sequence-logs"),
        "--no-llm",
        "--model-control-mode",
        "explicit",
        *("--load-model", "acc", "--load-model", "text", "--load-model", "chain"),
        "--max-sequences",
        str(TEXT_LIMIT),
        grpc_port=free_port(),
    )
    yield running
    running.stop()


def clients(server: RunningServer) -> tuple[Any, ...]:
    return (
        (httpclient.InferenceServerClient(server.address), httpclient),
        (grpcclient.InferenceServerClient(server.grpc_address), grpcclient),
    )


def step(
    client: Any, module: Any, model: str, value: int, sequence_id: int | str, **flags: bool
) -> Any:
    shape = [1, 1] if model == "acc" else [1]
    tensor = module.InferInput("INPUT", shape, "INT32")
    tensor.set_data_from_numpy(np.full(shape, value, dtype=np.int32))
    return client.infer(model, [tensor], sequence_id=sequence_id, **flags)


def run_sequence(
    address: str, module: Any, sequence_id: int, values: list[int], seen: list[dict[str, Any]]
) -> None:
    client = module.InferenceServerClient(address)  # one per thread, as tritonclient asks
    for index, value in enumerate(values):
        first, last = index == 0, index == len(values) - 1
        result = step(
            client, module, "acc", value, sequence_id, sequence_start=first, sequence_end=last
        )
        row = {name: result.as_numpy(name) for name in ("START_OUT", "END_OUT", "READY_OUT")}
        seen.append(
            {
                "id": sequence_id,
                "index": index,
                "output": int(result.as_numpy("OUTPUT")[0, 0]),
                "controls": tuple(row[name][0, 0].item() for name in row),
                "corrid": int(result.as_numpy("CORRID_OUT")[0, 0]),
                "rows": int(result.as_numpy("ROWS")[0, 0]),
                "shared": int(result.as_numpy("SHARED")[0, 0]),
                "state": result.as_numpy("STATE_OUT"),
            }
        )


def test_interleaved_sequences_keep_their_own_running_sums(server: RunningServer) -> None:
    """Three sequences over HTTP and three over gRPC at once: each gets the running sum of its
    own values in order, the controls of its place in the sequence, and its id; sequences
    share execute() calls (a request each), never two requests of one sequence in a call (by
    their correlation ids); the state stays inside."""
    values = {sequence_id: [sequence_id % 7 + k for k in range(5)] for sequence_id in range(1, 7)}
    values[2**63 + 5] = [3, 1, 4, 1, 5]  # an id past int64, over HTTP
    seen: list[dict[str, Any]] = []
    threads = [
        threading.Thread(
            target=run_sequence,
            args=(address, module, sequence_id, sequence_values, seen),
        )
        for sequence_id, sequence_values in values.items()
        for address, module in (
            [(server.grpc_address, grpcclient)]
            if sequence_id % 2 and sequence_id < 2**63
            else [(server.address, httpclient)]
        )
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 5 * len(values)
    for answer in seen:
        own = values[answer["id"]]
        index = answer["index"]
        assert answer["output"] == sum(own[: index + 1]), answer
        start, end = float(index == 0), float(index == len(own) - 1)
        assert answer["controls"] == (start, end, True), answer
        assert answer["corrid"] == answer["id"]
        assert answer["shared"] == 1  # one request per sequence in any execute()
        assert answer["state"] is None  # the state output is not the client's
    assert max(answer["rows"] for answer in seen) > 1  # sequences shared batches


def test_requests_of_one_sequence_sent_at_once_run_one_at_a_time(server: RunningServer) -> None:
    """Three requests of one sequence at once, each on a connection of its own: each runs on
    the state the one before left, never two in one batch, so the last sees the whole sum."""
    client = httpclient.InferenceServerClient(server.address)
    step(client, httpclient, "acc", 1, 555, sequence_start=True)
    answers: list[tuple[int, int]] = []

    def send(value: int) -> None:
        own = httpclient.InferenceServerClient(server.address)
        result = step(own, httpclient, "acc", value, 555)
        answers.append((int(result.as_numpy("OUTPUT")[0, 0]), int(result.as_numpy("SHARED")[0, 0])))

    threads = [threading.Thread(target=send, args=(value,)) for value in (10, 100, 1000)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(shared == 1 for _, shared in answers), answers
    assert len({output for output, _ in answers}) == 3 and max(answers)[0] == 1111, answers
    last = step(client, httpclient, "acc", 10000, 555, sequence_end=True)
    assert last.as_numpy("OUTPUT")[0, 0] == 11111


def test_end_frees_the_sequence_and_a_request_needs_an_id(server: RunningServer) -> None:
    for (client, module), sequence_id in zip(clients(server), (900, 901), strict=True):
        step(client, module, "acc", 4, sequence_id, sequence_start=True)
        last = step(client, module, "acc", 5, sequence_id, sequence_end=True)
        assert last.as_numpy("OUTPUT")[0, 0] == 9
        with pytest.raises(InferenceServerException) as after_end:
            step(client, module, "acc", 1, sequence_id)
        assert f"sequence {sequence_id} to model 'acc' must specify the START flag" in (
            after_end.value.message()
        )
        again = step(client, module, "acc", 2, sequence_id, sequence_start=True)
        assert again.as_numpy("OUTPUT")[0, 0] == 2  # a new start: the initial state again
        tensor = module.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.ones((1, 1), dtype=np.int32))
        with pytest.raises(InferenceServerException) as no_id:
            client.infer("acc", [tensor])
        assert "must specify a non-zero or non-empty correlation ID" in no_id.value.message()
    rest = httpx.post(
        server.url + "/v2/models/acc/infer",
        json={"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [1]}]},
    )
    assert rest.status_code == 400, rest.text
    two_rows = {"name": "INPUT", "shape": [2, 1], "datatype": "INT32", "data": [1, 2]}
    rest = httpx.post(
        server.url + "/v2/models/acc/infer",
        json={"inputs": [two_rows], "parameters": {"sequence_id": 5, "sequence_start": True}},
    )
    assert rest.status_code == 400 and "batch-size 1" in rest.text


def test_an_ensemble_passes_its_sequence_on_to_a_stateful_step(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(server.address)
    sums = []
    for index, value in enumerate((5, 6, 7)):
        tensor = httpclient.InferInput("VALUE", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
        result = client.infer(
            "chain", [tensor], sequence_id=77, sequence_start=index == 0, sequence_end=index == 2
        )
        sums.append(int(result.as_numpy("SUM")[0, 0]))
    assert sums == [5, 11, 18]


def test_string_ids_and_the_idle_timeout(server: RunningServer) -> None:
    _, (grpc, module) = clients(server)
    step(grpc, module, "text", 10, "alpha", sequence_start=True)
    second = step(grpc, module, "text", 5, "alpha")
    assert second.as_numpy("OUTPUT")[0] == 15
    assert second.as_numpy("CORRID_OUT")[0] == b"alpha"
    assert server.metric("lockgate_sequences_live", 'model="text",version="1"') == 1
    time.sleep(IDLE_S + 0.3)
    assert server.metric("lockgate_sequences_live", 'model="text",version="1"') == 0
    with pytest.raises(InferenceServerException) as idled:
        step(grpc, module, "text", 1, "alpha")
    assert "sequence alpha to model 'text' must specify the START flag" in idled.value.message()


def test_past_the_limit_a_new_sequence_gets_503_with_retry_after(server: RunningServer) -> None:
    time.sleep(IDLE_S + 0.1)  # sequences left by other tests idle out
    body = {"inputs": [{"name": "INPUT", "shape": [1], "datatype": "INT32", "data": [1]}]}

    def post(sequence_id: str, **flags: bool) -> httpx.Response:
        parameters = {"sequence_id": sequence_id, **{f"sequence_{k}": v for k, v in flags.items()}}
        return httpx.post(
            server.url + "/v2/models/text/infer", json={**body, "parameters": parameters}
        )

    for index in range(TEXT_LIMIT):
        assert post(f"s{index}", start=True).status_code == 200
    refused = post("one-too-many", start=True)
    assert refused.status_code == 503 and "live sequences" in refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert post("s0", end=True).status_code == 200  # an end makes room
    assert post("one-too-many", start=True, end=True).status_code == 200


def test_a_model_that_calls_others_cannot_keep_sequences(server: RunningServer) -> None:
    loaded = httpx.post(server.url + "/v2/repository/models/caller/load", timeout=60)
    assert loaded.status_code == 400, loaded.text
    assert "sequence_batching" in loaded.text and "calls other models" in loaded.text


@pytest.mark.skipif(
    not PERF_ANALYZER.exists(),
    reason="perf_analyzer not installed (scripts/install-perf-analyzer.sh)",
)
def test_perf_analyzer_drives_a_stateful_model(server: RunningServer, tmp_path: Path) -> None:
    command = [str(PERF_ANALYZER), "-m", "acc", "-u", server.address, "-i", "http"]
    command += ["--sequence-length", "4", "--concurrency-range", "2"]
    command += ["--measurement-interval", "500", "--max-trials", "3"]
    command += ["--stability-percentage", "100"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Throughput" in done.stdout
