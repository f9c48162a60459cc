"""/v1/completions with a batch of prompts, and `echo` (with its prompt's logprobs, as an
evaluation harness scores a text), through a real server (SmolLM2) and the official client."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def add(a, b):", "Roses are red,"]
GREEDY = {"temperature": 0, "max_tokens": 5, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(llm_server: RunningServer) -> openai.OpenAI:
    return llm_server.openai_client()


def complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.completions.create(**{"model": MODEL, **GREEDY, **kwargs})


def test_a_batch_of_prompts_answers_n_choices_for_each_in_order(client: openai.OpenAI) -> None:
    alone = [complete(client, prompt=p) for p in PROMPTS]
    batch = complete(client, prompt=PROMPTS, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, single in enumerate(alone):
        assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == single.choices[0].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * 5
    ids = client.completions.create(model=MODEL, prompt=[[504, 3575], [1848]], max_tokens=2)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 3


def test_a_streamed_batch_carries_each_choice_by_index(client: openai.OpenAI) -> None:
    whole = complete(client, prompt=PROMPTS)
    texts = ["", "", ""]
    for chunk in complete(client, prompt=PROMPTS, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


def test_echo_puts_the_prompt_in_front_of_the_completion(client: openai.OpenAI) -> None:
    plain = complete(client, prompt=PROMPTS[0])
    echoed = complete(client, prompt=PROMPTS[0], echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text
    streamed = "".join(
        c.choices[0].text for c in complete(client, prompt=PROMPTS[0], echo=True, stream=True)
    )
    assert streamed == echoed.choices[0].text


def test_echo_with_max_tokens_0_scores_the_prompt_as_the_model_would_generate_it(
    client: openai.OpenAI,
) -> None:
    first = complete(client, prompt=PROMPTS[0], max_tokens=1, logprobs=1)
    generated = first.choices[0].logprobs
    context = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    prompt_tokens = context.usage.prompt_tokens
    # the prompt and the token the model chose after it, scored as one text
    scored = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0] + first.choices[0].text,
        max_tokens=0,
        echo=True,
        logprobs=1,
        temperature=0,
    )
    choice = scored.choices[0]
    assert choice.text == PROMPTS[0] + first.choices[0].text  # the prompt alone: no output
    logprobs = choice.logprobs
    n = scored.usage.prompt_tokens
    assert n == prompt_tokens + 1 and len(logprobs.tokens) == n
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    # the last token's logprob is the one the model gave it when it generated it
    assert logprobs.tokens[-1] == generated.tokens[0]
    assert logprobs.token_logprobs[-1] == pytest.approx(generated.token_logprobs[0], abs=0.05)
    assert list(logprobs.top_logprobs[-1]) == list(generated.top_logprobs[0])
    # the prompt's tokens score the same whatever follows them
    head = context.choices[0].logprobs.token_logprobs[1:]
    assert head == pytest.approx(logprobs.token_logprobs[1:prompt_tokens], abs=0.05)
    total = sum(logprobs.token_logprobs[1:])
    assert math.isfinite(total) and total < 0


def test_echo_with_logprobs_streams_the_prompts_then_the_outputs(client: openai.OpenAI) -> None:
    whole = complete(client, prompt=PROMPTS[2], echo=True, logprobs=2, max_tokens=3)
    logprobs = whole.choices[0].logprobs
    prompt_tokens = whole.usage.prompt_tokens
    assert len(logprobs.tokens) == prompt_tokens + 3
    assert whole.choices[0].text.startswith(PROMPTS[2])
    assert logprobs.text_offset[prompt_tokens] == len(PROMPTS[2])  # the output's first token
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
    text, tokens = "", []
    for chunk in complete(
        client, prompt=PROMPTS[2], echo=True, logprobs=2, max_tokens=3, stream=True
    ):
        choice = chunk.choices[0]
        text += choice.text
        tokens += choice.logprobs.tokens if choice.logprobs else []
    assert text == whole.choices[0].text and tokens == logprobs.tokens


def test_too_many_prompts_or_max_tokens_0_without_echo_is_400(llm_server: RunningServer) -> None:
    url = llm_server.url + "/v1/completions"
    answer = httpx.post(url, json={"model": MODEL, "prompt": ["a"] * 65, "max_tokens": 1})
    assert answer.status_code == 400 and "at most 64 prompts" in answer.json()["error"]["message"]
    answer = httpx.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": 0})
    assert answer.status_code == 400 and "max_tokens" in answer.json()["error"]["message"]


def test_vllm_prompt_logprobs_give_each_prompt_token_its_logprob_and_rank(
    llm_server: RunningServer,
) -> None:
    url = llm_server.url + "/v1/completions"
    ask = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0}
    answer = httpx.post(url, json={**ask, "prompt_logprobs": 2, "echo": True, "logprobs": 1})
    assert answer.status_code == 200, answer.text
    choice, usage = answer.json()["choices"][0], answer.json()["usage"]
    prompt = choice["prompt_logprobs"]
    assert len(prompt) == usage["prompt_tokens"] and prompt[0] is None
    echoed = choice["logprobs"]["token_logprobs"]  # the same numbers, in OpenAI's form
    for position, entries in enumerate(prompt[1:], start=1):
        ranks = sorted(e["rank"] for e in entries.values())
        # the 2 most likely, and the prompt's token when it is not one of them
        assert ranks[:2] == [1, 2] and (len(ranks) == 2 or (len(ranks) == 3 and ranks[2] > 2))
        actual = [e for e in entries.values() if e["logprob"] == echoed[position]]
        assert actual, (position, entries, echoed[position])
        best = max(e["logprob"] for e in entries.values())
        assert (actual[0]["rank"] == 1) == (actual[0]["logprob"] == best)
    streamed = httpx.post(url, json={**ask, "prompt_logprobs": 0, "stream": True}).text
    first = json.loads(streamed.split("\n\n")[0].removeprefix("data: "))
    assert len(first["choices"][0]["prompt_logprobs"]) == usage["prompt_tokens"]


def test_chat_prompt_logprobs_are_the_responses_and_not_streamed(
    llm_server: RunningServer,
) -> None:
    """As vLLM's: the prompt's logprobs, one entry per token of the rendered chat (null for
    the first), at the top of the response; streamed, a 400 naming them."""
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 1}
    answer = httpx.post(llm_server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert answer.status_code == 200, answer.text
    prompt = answer.json()["prompt_logprobs"]
    tokens = httpx.post(
        llm_server.url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=60
    ).json()["tokens"]
    assert (
        prompt[0] is None and len(prompt) == len(tokens) == answer.json()["usage"]["prompt_tokens"]
    )
    for token, entries in zip(tokens[1:], prompt[1:], strict=True):
        assert str(token) in entries and 1 in {e["rank"] for e in entries.values()}
    assert "prompt_logprobs" not in answer.json()["choices"][0]
    refused = httpx.post(
        llm_server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
