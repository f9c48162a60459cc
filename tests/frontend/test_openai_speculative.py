"""Speculative decoding set in a model's `parameters`, through a real server and the `openai`
client: greedy answers equal those of the same model served without it."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from tests.conftest import SPECULATIVE_LLM, RunningServer

MODEL = "SmolLM2-135M-Instruct"  # `llm_server`'s
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and polished the great lens, "
    "so that ships passing in the dark would know where the rocks were."
)
MESSAGES = [{"role": "user", "content": "Repeat this text exactly: " + PARAGRAPH}]


@pytest.fixture(scope="module")
def speculative_server(llm_variants_server: RunningServer) -> RunningServer:
    """SmolLM2 as `llm_server` serves it, plus `speculative: ngram` with 5 drafts a step, served
    as SPECULATIVE_LLM."""
    return llm_variants_server


def counter(server: RunningServer, name: str, model: str) -> float:
    return server.metric(name, f'model_name="{model}"')


def test_greedy_chat_equals_the_model_without_speculation(
    speculative_server: RunningServer, llm_server: RunningServer
) -> None:
    drafts = "lockgate_llm_spec_decode_num_draft_tokens_total"
    accepted = "lockgate_llm_spec_decode_num_accepted_tokens_total"
    before = [counter(speculative_server, name, SPECULATIVE_LLM) for name in (drafts, accepted)]
    answers = [
        server.openai_client().chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=80,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        for server, model in ((llm_server, MODEL), (speculative_server, SPECULATIVE_LLM))
    ]
    plain, spec = (a.choices[0] for a in answers)
    assert spec.message.content == plain.message.content
    assert spec.message.content and PARAGRAPH[:60] in spec.message.content
    assert spec.finish_reason == plain.finish_reason == "stop"
    plain_usage, spec_usage = answers[0].usage, answers[1].usage
    assert plain_usage is not None and spec_usage is not None
    # (cached prompt tokens differ: the plain server is shared with other tests)
    assert spec_usage.prompt_tokens == plain_usage.prompt_tokens
    assert spec_usage.completion_tokens == plain_usage.completion_tokens
    assert plain.logprobs is not None and plain.logprobs.content is not None
    assert spec.logprobs is not None and spec.logprobs.content is not None
    for a, b in zip(plain.logprobs.content, spec.logprobs.content, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    # most of the copy came from accepted drafts; the server without speculation drafts nothing
    new_drafts = counter(speculative_server, drafts, SPECULATIVE_LLM) - before[0]
    new_accepted = counter(speculative_server, accepted, SPECULATIVE_LLM) - before[1]
    assert answers[1].usage is not None
    assert answers[1].usage.completion_tokens / 2 < new_accepted <= new_drafts
    assert counter(llm_server, drafts, MODEL) == 0
    streamed = speculative_server.openai_client().chat.completions.create(
        model=SPECULATIVE_LLM,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=30,
        temperature=0,
        stop=["narrow"],
        stream=True,
    )
    assert isinstance(streamed, openai.Stream)
    chunks: list[ChatCompletionChunk] = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.endswith("climbed the ") and "narrow" not in text
