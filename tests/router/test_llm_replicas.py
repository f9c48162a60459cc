"""A language model behind `lockgate route` over two real SmolLM2 replicas (the session's
`llm_server` and `llm_variants_server`): its KServe v2 inference, REST and gRPC, is sent to one
replica only, even with hedging on after 1 ms; the OpenAI Responses API's stored responses,
each on one replica, are retrieved, continued and deleted through the router with the `openai`
client."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from lockgate.demo.smollm2 import SERVED_NAME
from tests.conftest import RunningServer
from tests.frontend.test_llm_infer import MODEL, request
from tests.router.test_grpc_proxy import GrpcRouter, start_grpc_router
from tests.router.test_router import metric


@pytest.fixture(scope="module")
def replicas(llm_server: RunningServer, llm_variants_server: RunningServer) -> list[RunningServer]:
    """The session's two servers of SmolLM2 as `llm_server` serves it."""
    return [llm_server, llm_variants_server]


@pytest.fixture(scope="module")
def front(
    replicas: list[RunningServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GrpcRouter]:
    """Hedging on after 1 ms, with the whole budget: any request it may hedge, it does."""
    tmp = tmp_path_factory.mktemp("llm-router")
    running = start_grpc_router(tmp, replicas, "--hedge-delay-ms", "1", "--hedge-budget", "1")
    yield running
    running.router.stop()


def generations(server: RunningServer) -> float:
    """Requests the replica's engine took, whatever their end (an abort included)."""
    text = httpx.get(server.url + "/metrics").text
    pattern = r"^lockgate_llm_request_success_total\{[^}]*\} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def test_a_language_models_v2_infer_is_sent_to_one_replica_only(
    front: GrpcRouter, replicas: list[RunningServer]
) -> None:
    """Four generations of 16 tokens (each far longer than the hedge delay), over REST and
    gRPC: each ran on one replica, and the router sent no second copy."""
    before = [generations(r) for r in replicas]
    hedged = metric(front.router.url, "lockgate_router_hedges_total")
    sampling = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    http = httpclient.InferenceServerClient(front.router.address)
    grpc = front.client()
    for i in range(4):
        client, module = (http, httpclient) if i % 2 else (grpc, grpcclient)
        inputs = request(module, f"Count from {i} to {i + 9}:", False, sampling)
        result = client.infer(MODEL, inputs)
        text = result.as_numpy("text_output")
        assert isinstance(text, np.ndarray) and text[0].decode().startswith("Count from")
    took = [generations(r) - b for r, b in zip(replicas, before, strict=True)]
    assert sum(took) == 4, took
    assert metric(front.router.url, "lockgate_router_hedges_total") == hedged == 0
    # the replicas said so on every answer: the router knows the model for a language model
    answer = httpx.post(
        front.router.url + f"/v2/models/{MODEL}/infer",
        json={
            "inputs": [
                {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Hi"]},
                {"name": "stream", "datatype": "BOOL", "shape": [1], "data": [False]},
            ],
            "parameters": {"max_tokens": 2},
        },
        timeout=60,
    )
    assert answer.status_code == 200 and answer.headers["x-lockgate-model-kind"] == "language"


def holders(replicas: list[RunningServer], rid: str) -> list[int]:
    """The replicas (their index) that store response `rid`, asked directly."""
    return [
        i
        for i, r in enumerate(replicas)
        if httpx.get(f"{r.url}/v1/responses/{rid}", timeout=30).status_code == 200
    ]


def test_stored_responses_are_reached_through_the_router(
    front: GrpcRouter, replicas: list[RunningServer]
) -> None:
    """Responses created through the router (whole and streamed) are each stored on one
    replica; retrieving, continuing (`previous_response_id`) and deleting each reach that
    replica; one stored behind the router's back is found by asking the replicas."""
    client = openai.OpenAI(base_url=front.router.url + "/v1", api_key="k", max_retries=0)
    ask = {"model": SERVED_NAME, "temperature": 0, "max_output_tokens": 4}
    created = [client.responses.create(input=f"Name a colour, {i}.", **ask) for i in range(4)]
    *_, last = client.responses.create(input="Name a fruit.", stream=True, **ask)
    created.append(last.response)  # incomplete (max_output_tokens): stored all the same
    homes = {}
    for response in created:
        [homes[response.id]] = holders(replicas, response.id)
        assert client.responses.retrieve(response.id).output_text == response.output_text
        [item] = client.responses.input_items.list(response.id).data  # its one input
        assert item.type == "message" and item.content[0].text.startswith("Name a")  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="synchronous"):  # asked of its home
        client.responses.cancel(created[0].id)
    for response in created:
        follow = client.responses.create(
            input="And another?", previous_response_id=response.id, **ask
        )
        assert holders(replicas, follow.id) == [homes[response.id]]  # continued at home
    for response in created:
        assert client.responses.delete(response.id) is None
        with pytest.raises(openai.NotFoundError, match="no replica stores a response"):
            client.responses.retrieve(response.id)
    # stored on a replica directly: the router finds it
    direct = replicas[1].openai_client().responses.create(input="Name a tree.", **ask)
    assert client.responses.retrieve(direct.id).output_text == direct.output_text
