"""vLLM's /tokenize and /detokenize, and /version, through a real server (SmolLM2): the token
ids are those a completion counts, and they decode back to the text."""

from __future__ import annotations

import httpx
import openai
import pytest

from lockgate import __version__
from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def client(llm_server: RunningServer) -> openai.OpenAI:
    return llm_server.openai_client()


def post(server: RunningServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_tokens_are_what_a_completion_counts_and_decode_back(
    llm_server: RunningServer, client: openai.OpenAI
) -> None:
    answer = post(
        llm_server, "/tokenize", {"model": MODEL, "prompt": TEXT, "return_token_strs": True}
    )
    assert answer.status_code == 200, answer.text
    tokenized = answer.json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 512
    completion = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1)
    assert completion.usage is not None and completion.usage.prompt_tokens == tokenized["count"]
    assert "".join(tokenized["token_strs"]) == TEXT
    back = post(llm_server, "/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}
    messages = [{"role": "user", "content": "Name a color."}]
    chat = post(llm_server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    answered = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert answered.usage is not None and answered.usage.prompt_tokens == chat["count"]
    open_turn = {"model": MODEL, "messages": messages, "add_generation_prompt": False}
    assert post(llm_server, "/tokenize", open_turn).json()["count"] < chat["count"]


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/tokenize", {"model": MODEL}, "either prompt or messages"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "either"),
        ("/tokenize", {"prompt": 7}, "invalid request"),
        ("/detokenize", {"tokens": [10**9]}, "outside the vocabulary"),
        ("/detokenize", {"tokens": [1] * 600}, "more than the context of 512"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, "does not exist"),
    ],
)
def test_bad_requests_are_4xx_with_a_message(
    llm_server: RunningServer, path: str, body: dict[str, object], says: str
) -> None:
    answer = post(llm_server, path, body)
    assert 400 <= answer.status_code < 500 and says in answer.text, answer.text


def test_version_and_methods(llm_server: RunningServer) -> None:
    assert httpx.get(llm_server.url + "/version").json() == {"version": __version__}
    wrong = httpx.get(llm_server.url + "/tokenize")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
