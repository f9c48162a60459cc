"""How a chat request's messages become its prompt, with vLLM's fields for it
(`add_generation_prompt`, `continue_final_message`, `echo`, `chat_template_kwargs`), through
a real server (SmolLM2) and the official client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"
STARTED = [
    {"role": "user", "content": "Count to ten."},
    {"role": "assistant", "content": "1, 2, 3, 4,"},
]


@pytest.fixture(scope="module")
def client(llm_server: RunningServer) -> openai.OpenAI:
    return llm_server.openai_client()


def streamed_contents(llm_server: RunningServer, body: dict[str, Any]) -> dict[int, str]:
    contents: dict[int, str] = {}
    with httpx.stream(
        "POST", llm_server.url + "/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"].get("content") or ""
                    contents[choice["index"]] = contents.get(choice["index"], "") + delta
    return contents


def test_continue_final_message_ends_the_prompt_inside_it_and_echo_answers_it_whole(
    client: openai.OpenAI, llm_server: RunningServer
) -> None:
    """The model goes on writing the final assistant message (no new turn opened after it),
    and `echo` begins the answer with that message's content, streamed or not."""
    tokenized = httpx.post(
        llm_server.url + "/tokenize",
        json={"messages": STARTED, "continue_final_message": True, "return_token_strs": True},
    ).json()
    assert "".join(tokenized["token_strs"]).endswith("<|im_start|>assistant\n1, 2, 3, 4,")
    extra = {"continue_final_message": True, "echo": True}
    whole = client.chat.completions.create(
        model=MODEL,
        messages=STARTED,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        extra_body=extra,
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == tokenized["count"]
    text = whole.choices[0].message.content
    assert text is not None and text.startswith("1, 2, 3, 4, 5"), text
    body = {"model": MODEL, "messages": STARTED, "max_tokens": 4, "temperature": 0, "n": 2}
    assert streamed_contents(llm_server, {**body, **extra}) == {0: text, 1: text}
    opened = client.chat.completions.create(
        model=MODEL,
        messages=STARTED,  # type: ignore[arg-type]
        max_tokens=1,
        extra_body={"echo": False},
    )
    assert opened.usage is not None and opened.usage.prompt_tokens > tokenized["count"]


def test_echo_answers_with_a_final_message_of_another_role_only_when_no_turn_is_opened(
    client: openai.OpenAI,
) -> None:
    asked = [{"role": "user", "content": "Tell me a story about a"}]

    def echoed(**extra: object) -> str:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=asked,  # type: ignore[arg-type]
            max_tokens=1,
            extra_body={"echo": True, **extra},
        )
        return answer.choices[0].message.content or ""

    assert echoed(add_generation_prompt=False).startswith("Tell me a story about a")
    assert not echoed().startswith("Tell me")  # the assistant's turn: nothing of it to echo


def test_chat_prompt_fields_that_cannot_be_honoured_are_400(llm_server: RunningServer) -> None:
    cases = [
        ({"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
        ({"chat_template": "{{ messages }}"}, "'chat_template' is not supported"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
        ({"chat_template_kwargs": {"x": "<|im_start|>"}}, "control token"),
    ]
    for extra, expected in cases:
        body = {"model": MODEL, "messages": STARTED, "max_tokens": 1, **extra}
        r = httpx.post(llm_server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and expected in r.json()["error"]["message"], r.text


def test_skip_special_tokens_false_keeps_the_special_tokens_text(client: openai.OpenAI) -> None:
    """vLLM's skip_special_tokens: the turn is over, so the model writes its end-of-turn and
    the next turn's start (EOS ignored): their text is left out unless asked for."""

    def closed(**extra: object) -> str:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=STARTED,  # type: ignore[arg-type]
            max_tokens=3,
            temperature=0,
            extra_body={"add_generation_prompt": False, "ignore_eos": True, **extra},
        )
        return answer.choices[0].message.content or ""

    assert "<|im_" not in closed()
    assert "<|im_" in closed(skip_special_tokens=False)
