"""`n` choices and `best_of` candidates on the OpenAI routes, through a real server (SmolLM2)
and the official `openai` client."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningServer

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Once upon a time, in a land far away,"
FIXED = {"ignore_eos": True}  # every choice generates exactly max_tokens


@pytest.fixture(scope="module")
def client(llm_server: RunningServer) -> openai.OpenAI:
    return llm_server.openai_client()


def complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "extra_body": FIXED}
    return client.completions.create(**{**args, **kwargs})


def test_n_choices_are_indexed_distinct_and_reproducible(client: openai.OpenAI) -> None:
    first = complete(client, n=3, temperature=1.0, seed=11)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3, texts  # each choice draws with a seed of its own
    assert [c.text for c in complete(client, n=3, temperature=1.0, seed=11).choices] == texts
    single = complete(client, n=1, temperature=1.0, seed=11)
    assert single.choices[0].text == texts[0]  # choice i draws with seed + i
    assert first.usage is not None and single.usage is not None
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
    assert first.usage.completion_tokens == 3 * 6  # every choice's tokens


def test_greedy_chat_choices_are_equal(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=5,
        temperature=0,
        n=2,
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].message.content == result.choices[1].message.content
    assert all(c.finish_reason in ("stop", "length") for c in result.choices)


def test_streamed_choices_carry_their_index_and_finish_reason(client: openai.OpenAI) -> None:
    whole = complete(client, n=2, temperature=1.0, seed=3)
    chunks = list(
        complete(
            client,
            n=2,
            temperature=1.0,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finished: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        assert finished[choice.index] == [], "a chunk after the choice finished"
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index].append(choice.finish_reason)
    assert finished == {0: ["length"], 1: ["length"]}
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]  # same seeds, same text
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert whole.usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == 2 * 6


def test_streamed_chat_choices_each_open_with_the_role(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
            temperature=1.0,
            seed=1,
            n=2,
            stream=True,
        )
    )
    roles = {c.choices[0].index: c.choices[0].delta.role for c in reversed(chunks)}
    assert roles == {0: "assistant", 1: "assistant"}  # each choice's first chunk


def logprob_sum(choice: Any) -> float:
    return float(sum(choice.logprobs.token_logprobs))


def test_best_of_answers_the_candidate_of_highest_cumulative_logprob(
    client: openai.OpenAI,
) -> None:
    candidates = complete(client, n=3, temperature=1.0, seed=21, logprobs=1).choices
    sums = [logprob_sum(c) for c in candidates]
    assert len(set(sums)) == 3, sums
    best = complete(client, n=1, best_of=3, temperature=1.0, seed=21, logprobs=1)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert logprob_sum(best.choices[0]) == pytest.approx(max(sums), abs=1e-3)
    assert best.choices[0].text == candidates[sums.index(max(sums))].text
    assert best.usage is not None and best.usage.completion_tokens == 3 * 6  # all computed
    two = complete(client, n=2, best_of=3, temperature=1.0, seed=21)
    ranked = [candidates[i].text for i in sorted(range(3), key=lambda i: -sums[i])]
    assert [c.text for c in two.choices] == ranked[:2]  # best first
    assert all(c.logprobs is None for c in two.choices)  # ranked by them, not asked for


def bad_request(call: Any, **kwargs: Any) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        call(**kwargs)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    return str(body["message"])


@pytest.mark.parametrize(
    ("asked", "named"),
    [
        ({"n": 17}, "n must be between 1 and 16"),
        ({"n": 0}, "n must be between 1 and 16"),
        ({"n": 3, "best_of": 2}, "best_of must be between n (3) and 16"),
        ({"best_of": 17}, "best_of must be between n (1) and 16"),
        ({"best_of": 2, "stream": True}, "best_of cannot be used with stream"),
    ],
)
def test_choices_over_the_limits_are_a_400_naming_the_field(
    client: openai.OpenAI, asked: dict[str, Any], named: str
) -> None:
    message = bad_request(complete, client=client, **asked)
    assert named in message


def test_best_of_is_for_completions_only(client: openai.OpenAI) -> None:
    message = bad_request(
        client.chat.completions.create,
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"best_of": 2},
    )
    assert "'best_of' is not supported" in message


def series(server: RunningServer, name: str, labels: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    match = re.search(rf"^{name}{{{labels}}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_disconnect_aborts_every_choice(llm_server: RunningServer) -> None:
    model = f'model_name="{MODEL}"'
    aborted = f'finished_reason="abort",{model}'
    before = series(llm_server, "lockgate_llm_request_success_total", aborted)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "n": 4, "stream": True}
    seen: set[int] = set()
    with httpx.stream("POST", llm_server.url + "/v1/completions", json={**body, **FIXED}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) == 4:
                break  # every choice has started: leave
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = series(llm_server, "lockgate_llm_num_requests_running", model)
        waiting = series(llm_server, "lockgate_llm_num_requests_waiting", model)
        if running == waiting == 0:
            break
        time.sleep(0.1)
    assert running == waiting == 0
    after = series(llm_server, "lockgate_llm_request_success_total", aborted)
    assert after - before == 4  # aborted, not run to their 400 tokens
