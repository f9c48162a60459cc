"""Exact-match caching of deterministic completions, through a real server with SmolLM2 and the
official `openai` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import CACHED_FOLDER, CACHED_LLM, RunningServer

MODEL = CACHED_LLM  # a served name of its own: the generate routes take CACHED_FOLDER


@pytest.fixture(scope="module")
def server(llm_variants_server: RunningServer) -> RunningServer:
    return llm_variants_server


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client()


def test_greedy_completion_is_answered_from_the_cache(
    client: openai.OpenAI, server: RunningServer
) -> None:
    ask = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 10}
    first = client.completions.with_raw_response.create(**ask, temperature=0)
    generated = server.metric("lockgate_llm_request_success_total")
    second = client.completions.with_raw_response.create(**ask, temperature=0)
    assert first.headers.get("x-lockgate-cache") is None
    assert second.headers.get("x-lockgate-cache") == "hit"
    a, b = first.parse(), second.parse()
    assert a.choices[0].text and a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == b.choices[0].finish_reason
    assert a.usage is not None and b.usage is not None
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (
        b.usage.prompt_tokens,
        b.usage.completion_tokens,
    )
    # the engine ran once: the second answer generated nothing
    assert server.metric("lockgate_llm_request_success_total") == generated
    assert server.metric("lockgate_cache_hits_total") >= 1


def test_a_streamed_hit_gives_the_text_the_model_gave(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a large ocean."}]
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
    )
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers.get("x-lockgate-cache") == "hit"
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert full.usage is not None and usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens


def test_streamed_completion_fills_the_cache(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 8, "temperature": 0}
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(**ask, stream=True)  # type: ignore[call-overload]
    )
    again = client.completions.with_raw_response.create(**ask)
    assert again.headers.get("x-lockgate-cache") == "hit"
    assert again.parse().choices[0].text == streamed


def test_sampled_and_logprob_completions_are_not_cached(
    client: openai.OpenAI, server: RunningServer
) -> None:
    hits = server.metric("lockgate_cache_hits_total")
    for _ in range(2):
        sampled = client.completions.with_raw_response.create(
            model=MODEL, prompt="A story:", max_tokens=6, temperature=0.8, seed=3
        )
        assert sampled.headers.get("x-lockgate-cache") is None
        with_logprobs = client.completions.with_raw_response.create(
            model=MODEL, prompt="A story:", max_tokens=6, temperature=0, logprobs=2
        )
        assert with_logprobs.headers.get("x-lockgate-cache") is None
        assert with_logprobs.parse().choices[0].logprobs is not None
    assert server.metric("lockgate_cache_hits_total") == hits


def test_different_parameters_do_not_share_an_entry(client: openai.OpenAI) -> None:
    base = {"model": MODEL, "prompt": "Water boils at", "temperature": 0}
    short = client.completions.create(**base, max_tokens=2)  # type: ignore[call-overload]
    longer = client.completions.with_raw_response.create(**base, max_tokens=9)
    assert longer.headers.get("x-lockgate-cache") is None
    assert longer.parse().usage.completion_tokens >= short.usage.completion_tokens


def test_triton_generate_shares_the_completions_entries(
    client: openai.OpenAI, server: RunningServer
) -> None:
    prompt = "Seven, eight,"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    body = {"text_input": prompt, "parameters": {"max_tokens": 6, "temperature": 0}}
    url = server.url + f"/v2/models/{CACHED_FOLDER}/generate"
    whole = httpx.post(url, json=body, timeout=60)
    assert whole.headers.get("x-lockgate-cache") == "hit"
    assert whole.json()["text_output"] == text.choices[0].text
    streamed = httpx.post(url + "_stream", json=body, timeout=60)
    assert streamed.headers.get("x-lockgate-cache") == "hit"
    assert streamed.text == "data: " + json.dumps(whole.json(), separators=(",", ":")) + "\n\n"
