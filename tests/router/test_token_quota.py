"""Token quotas count prompt and completion tokens: through `lockgate route` in front of the
session's SmolLM2 server, with the openai client; and the stream editing behind it."""

from __future__ import annotations

import json
import math
import time

import openai
import pytest

from lockgate.router.llm_request import LLMRequest
from lockgate.router.usage import HiddenUsage, Metered, asking_usage
from tests.conftest import RunningServer
from tests.router.test_rollout import sample
from tests.router.test_router import start_router

MODEL = "SmolLM2-135M-Instruct"
TPM = 400  # 6.7 tokens a second
PROMPT = "The old lighthouse keeper counted the ships that passed each night. " * 12


def test_a_token_quota_counts_prompt_tokens_and_refuses_with_retry_after(
    llm_server: RunningServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    router = start_router(
        tmp_path_factory.mktemp("quota"),
        *("--replica", llm_server.url, "--rate-limit-tpm", str(TPM)),
    )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0, timeout=120)
    ask = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    try:
        started = time.monotonic()
        embedded = client.embeddings.create(model="minilm", input=PROMPT)
        whole = client.completions.create(**ask)
        assert whole.usage is not None and whole.usage.completion_tokens == 8
        prompt = whole.usage.prompt_tokens
        assert prompt > 100  # the prompt weighs more than the completions
        # a stream whose client did not ask for usage: the router asks, and hides the chunk
        chunks = list(client.completions.create(**ask, stream=True))
        assert [c.usage for c in chunks] == [None] * 8 and all(c.choices for c in chunks)
        spent = embedded.usage.prompt_tokens + 2 * (prompt + 8)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(**{**ask, "max_tokens": 50})
        elapsed = time.monotonic() - started
        limited = sample(router.url, "lockgate_router_rate_limited_total", limit="tokens")
    finally:
        router.stop()
    # 50 wanted, TPM - spent left (plus what flowed in meanwhile), at TPM / 60 a second;
    # counting completion tokens only, 384 would be left and the request admitted
    rate = TPM / 60
    latest = math.ceil((50 - (TPM - spent)) / rate)
    earliest = math.ceil((50 - (TPM - spent) - rate * elapsed) / rate)
    retry_after = int(refused.value.response.headers["retry-after"])
    assert max(1, earliest) <= retry_after <= latest, (retry_after, spent, elapsed)
    assert "token quota" in refused.value.response.json()["error"]["message"]
    assert refused.value.body["type"] == "rate_limited"  # type: ignore[index]  # OpenAI's shape
    assert limited == 1


def test_a_stream_asks_for_usage_and_its_client_gets_none() -> None:
    asked = json.loads(asking_usage(b'{"stream": true, "stream_options": {"x": 1}}') or b"")
    assert asked["stream_options"] == {"x": 1, "include_usage": True}
    assert asking_usage(b'{"stream_options": "yes"}') is None  # the replica answers 400
    assert asking_usage(b"[1]") is None
    stream = {"model": "m", "prompt": "hi", "stream": True}
    metered = Metered.of(LLMRequest.parse(json.dumps(stream).encode(), 8), b"{}")
    assert metered.hidden is not None and metered.charge == 16
    own = {**stream, "stream_options": {"include_usage": True}}
    body = json.dumps(own).encode()
    assert Metered.of(LLMRequest.parse(body, 8), body).hidden is None  # asked: passed as is
    events = [
        {"choices": [{"text": "a"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    ]
    sent = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    sent += b"data: [DONE]\n\n"
    hidden = HiddenUsage()
    out = b"".join(hidden.edit(sent[i : i + 5]) for i in range(0, len(sent), 5)) + hidden.rest()
    assert out == b"data: " + json.dumps(events[0]).encode() + b"\n\ndata: [DONE]\n\n"
