"""Triton's generate extension and a model's generation_config.json defaults, through a real
server with SmolLM2 (whose generation_config.json asks for greedy sampling) and a classic
model, with httpx and the official `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import GREEDY_FOLDER, GREEDY_LLM, RunningServer

PROMPT = "The capital of France is"
MODEL, FOLDER = GREEDY_LLM, GREEDY_FOLDER  # the generate routes take the folder's name


@pytest.fixture(scope="module")
def server(llm_variants_server: RunningServer) -> RunningServer:
    return llm_variants_server


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client()


def generate(server: RunningServer, body: object, route: str = "generate") -> httpx.Response:
    return httpx.post(f"{server.url}/v2/models/{FOLDER}/{route}", json=body, timeout=120)


def events(server: RunningServer, body: object) -> list[dict[str, object]]:
    url = f"{server.url}/v2/models/{FOLDER}/generate_stream"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_requests_without_temperature_use_the_models_generation_config(
    server: RunningServer, client: openai.OpenAI
) -> None:
    entry = next(m for m in httpx.get(server.url + "/v1/models").json()["data"] if m["id"] == MODEL)
    assert entry["generation_defaults"] == {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 50,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    ask = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10}
    first = client.completions.create(**ask).choices[0].text  # type: ignore[call-overload]
    second = client.completions.create(**ask).choices[0].text  # type: ignore[call-overload]
    greedy = client.completions.create(**ask, temperature=0).choices[0].text  # type: ignore[call-overload]
    assert first == second == greedy


def test_generate_answers_the_completions_text(
    server: RunningServer, client: openai.OpenAI
) -> None:
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    r = generate(server, {"text_input": PROMPT, "parameters": {"temperature": 0, "max_tokens": 8}})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {
        "model_name": FOLDER,
        "model_version": "1",
        "text_output": completion.choices[0].text,
    }
    # top-level fields, as Triton passes them on; the input echoed when asked
    echoed = generate(
        server,
        {"text_input": PROMPT, "max_tokens": 8, "temperature": 0, "exclude_input_in_output": False},
    )
    assert echoed.json()["text_output"] == PROMPT + completion.choices[0].text


def test_generate_stream_events_add_up_to_the_generate_text(server: RunningServer) -> None:
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 8, "stream": True}}
    streamed = events(server, body)
    assert len(streamed) > 1
    assert all(e["model_name"] == FOLDER and e["model_version"] == "1" for e in streamed)
    whole = generate(server, {"text_input": PROMPT, "parameters": {"max_tokens": 8}}).json()
    assert "".join(str(e["text_output"]) for e in streamed) == whole["text_output"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"parameters": {"max_tokens": 4}}, "text_input is required"),
        ({"text_input": 7}, "text_input must be a string (the prompt), got int"),
        ({"text_input": ["hi"]}, "text_input must be a string (the prompt), got a list or an"),
        (
            {"text_input": "hi", "parameters": {"beam_width": 2, "bad_words": ""}},
            "'bad_words', 'beam_width'",
        ),
        (
            {"text_input": "hi", "repetition_penalty": 1.1},
            "unknown parameters: 'repetition_penalty'",
        ),
        ({"text_input": "hi", "parameters": {"temperature": "hot"}}, "$.temperature"),
        ({"text_input": "hi", "parameters": {"temperature": -1}}, "temperature must be >= 0"),
        ({"text_input": "hi", "parameters": {"max_tokens": 10**6}}, "maximum context length"),
        ({"text_input": "hi", "max_tokens": 2, "parameters": {"max_tokens": 2}}, "both"),
        ({"text_input": "hi", "parameters": {"stream": True}}, "/generate_stream"),
        ({"text_input": "hi", "parameters": [1]}, "parameters must be an object"),
        ({"text_input": "hi", "priority": -1}, "priority must be a non-negative integer"),
        (["hi"], "Expected `object`"),
        ({"text_input": ""}, "prompt has 0 tokens"),
    ],
)
def test_client_mistakes_are_400_with_a_message(
    server: RunningServer, body: object, says: str
) -> None:
    r = generate(server, body)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]


def test_generate_names_what_it_cannot_serve(server: RunningServer) -> None:
    url = server.url + "/v2/models"
    malformed = httpx.post(f"{url}/{FOLDER}/generate_stream", content=b"{", timeout=30)
    assert malformed.status_code == 400 and "malformed JSON" in malformed.json()["error"]
    # another model maps the fields to its inputs (frontend/generate_tensor_routes.py)
    classic = httpx.post(f"{url}/digits_onnx/generate", json={"text_input": "hi"}, timeout=30)
    assert classic.status_code == 400 and "missing required input" in classic.json()["error"]
    unknown = httpx.post(f"{url}/nope/generate", json={"text_input": "hi"}, timeout=30)
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
    version = httpx.post(f"{url}/{FOLDER}/versions/9/generate", json={"text_input": "hi"})
    assert version.status_code == 404
    infer = httpx.post(f"{url}/{FOLDER}/infer", json={"inputs": []}, timeout=30)
    assert infer.status_code == 400 and "text_input" in infer.json()["error"]
