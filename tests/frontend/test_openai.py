"""The OpenAI API through a real server and the official `openai` client, streaming included."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import jinja2
import numpy as np
import openai
import pytest

from lockgate.llm.loader import parse_gguf
from lockgate.llm.tokenizer import ChatTokenizer
from tests.bos_model import BOS_MODEL
from tests.conftest import BOS_FOLDER, RunningServer

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(llm_server: RunningServer) -> openai.OpenAI:
    return llm_server.openai_client()


@pytest.fixture(scope="module")
def bos_server(llm_variants_server: RunningServer) -> RunningServer:
    """Serves BOS_MODEL: a tiny model whose tokenizer adds a special token (BOS) to a text
    prompt and whose chat template renders vLLM's `documents` (SmolLM2's adds none and ignores
    them): what add_special_tokens and documents change shows in its prompts' token counts."""
    return llm_variants_server


@pytest.fixture(scope="module")
def bos_tokenizer(llm_variants_repo: Path) -> ChatTokenizer:
    """BOS_MODEL's tokenizer, read from its GGUF."""
    gguf = llm_variants_repo / BOS_FOLDER / "1" / "model.gguf"
    return ChatTokenizer(parse_gguf(gguf).tokenizer)


def test_models_list(client: openai.OpenAI) -> None:
    """vLLM's model cards: root, parent, max_model_len (the context) and one permission."""
    models = {m.id: m.model_dump() for m in client.models.list()}
    llm, embedder = models[MODEL], models["minilm"]
    assert llm["max_model_len"] == 512  # llm_server's context
    assert (llm["root"], llm["parent"]) == ("smollm2", None)
    assert (embedder["root"], embedder["parent"], embedder["max_model_len"]) == (
        "minilm",
        None,
        None,
    )
    for card in (llm, embedder):
        [permission] = card["permission"]
        assert permission["object"] == "model_permission"
        assert permission["id"].startswith("modelperm-") and permission["allow_sampling"]
    assert client.models.retrieve(MODEL).model_dump()["max_model_len"] == 512


def test_chat_completion_and_stream_agree(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    )
    text = full.choices[0].message.content
    assert text and "Paris" in text
    assert full.usage is not None and full.usage.completion_tokens <= 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_with_token_ids_and_ignore_eos(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL,
        prompt=[504, 3458, 282, 260, 1345],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.usage is not None
    assert result.usage.completion_tokens == 20
    assert result.usage.prompt_tokens == 5
    assert result.choices[0].finish_reason == "length"


def test_stop_string_and_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=["7"], logprobs=3
    )
    choice = result.choices[0]
    assert "7" not in choice.text
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.top_logprobs
    assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs or [])


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int, max_tokens: int = 12) -> str:
        r = client.completions.create(
            model=MODEL,
            prompt="The ocean is",
            max_tokens=max_tokens,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
        )
        return r.choices[0].text

    assert run(7) == run(7)
    assert run(-7, 4) == run(-7, 4)  # any 64-bit seed, as OpenAI's and vLLM's
    with pytest.raises(openai.BadRequestError, match="seed must be a 64-bit integer"):
        run(2**63)


def test_errors_use_openai_format(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**9)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")


def test_an_error_about_a_field_names_it_as_its_param(client: openai.OpenAI) -> None:
    """OpenAI's error.param: the request field a 400 or 404 is about."""
    asks: list[tuple[dict[str, object], str]] = [
        ({"temperature": -3}, "temperature"),
        ({"n": "two"}, "n"),
        ({"extra_body": {"length_penalty": 2}}, "length_penalty"),
        ({"model": "no-such-model"}, "model"),
        ({"max_tokens": 0}, "max_tokens"),
    ]
    for extra, param in asks:
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(**{"model": MODEL, "prompt": "hi", **extra})  # type: ignore[call-overload]
        assert refused.value.status_code in (400, 404)
        assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]


def test_chat_prompts_too_long_for_the_context_are_refused_before_they_are_tokenized(
    llm_server: RunningServer,
) -> None:
    """Half a million empty messages were rendered and tokenized for seconds: more messages
    than the context has tokens are refused at once, and a rendered prompt (roles included)
    longer than the context could hold is refused before it is encoded."""
    cases = [
        ([{"role": "user", "content": ""}] * 100_000, "messages has 100000 entries, more than"),
        ([{"role": "r" * 2000, "content": ""}] * 400, "characters cannot fit the context"),
    ]
    for messages, expected in cases:
        body = {"model": MODEL, "messages": messages, "max_tokens": 2}
        r = httpx.post(llm_server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and expected in r.json()["error"]["message"], r.text


def test_logit_bias_is_counted_before_it_is_built(llm_server: RunningServer) -> None:
    """A million entries were built (most of a second of the event loop) before the limit of
    300 refused them; their colons are counted first. A valid one still applies."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    huge = {**body, "logit_bias": {str(i): 1 for i in range(200_000)}}
    r = httpx.post(llm_server.url + "/v1/completions", json=huge, timeout=30)
    assert r.status_code == 400 and "at most 300 entries" in r.text
    wrong = {**body, "logit_bias": {"5": "high"}}
    r = httpx.post(llm_server.url + "/v1/completions", json=wrong, timeout=30)
    assert r.status_code == 400 and "$.logit_bias" in r.text
    forced = {**body, "logit_bias": {"28": 100}, "temperature": 0}
    r = httpx.post(llm_server.url + "/v1/completions", json=forced, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_embeddings(client: openai.OpenAI) -> None:
    result = client.embeddings.create(
        model="minilm", input=["a dog runs", "a puppy sprints", "tax law"]
    )
    vectors = np.array([d.embedding for d in result.data])
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-3)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]


def test_llm_metrics(client: openai.OpenAI, llm_server: RunningServer) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    text = httpx.get(llm_server.url + "/metrics").text
    for name in (
        "lockgate_llm_time_to_first_token_seconds_bucket",
        "lockgate_llm_inter_token_latency_seconds_bucket",
        "lockgate_llm_e2e_request_latency_seconds_bucket",
        "lockgate_llm_request_queue_time_seconds_bucket",
        "lockgate_llm_request_prompt_tokens_bucket",
        "lockgate_llm_request_generation_tokens_bucket",
        "lockgate_llm_num_requests_running",
        "lockgate_llm_num_requests_waiting",
        "lockgate_llm_kv_cache_usage_perc",
        "lockgate_llm_prefix_cache_queries_total",
        "lockgate_llm_prefix_cache_hits_total",
        "lockgate_llm_num_preemptions_total",
        "lockgate_llm_request_success_total",
    ):
        assert name in text, name


def test_disconnect_mid_stream_frees_kv_blocks(llm_server: RunningServer) -> None:
    body = (
        b'{"model": "%s", "prompt": "Tell me a long story", "max_tokens": 400, '
        b'"stream": true, "ignore_eos": true}' % MODEL.encode()
    )
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", llm_server.port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        received = b""
        while received.count(b"data:") < 2:
            received += sock.recv(4096)
        sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (
            llm_server.metric("lockgate_llm_num_requests_running") == 0
            and llm_server.metric("lockgate_llm_kv_cache_usage_perc") == 0
        ):
            break
        time.sleep(0.1)
    assert llm_server.metric("lockgate_llm_num_requests_running") == 0
    assert llm_server.metric("lockgate_llm_kv_cache_usage_perc") == 0
    text = httpx.get(llm_server.url + "/metrics").text
    assert 'finished_reason="abort"' in text


def test_logprobs_are_the_models_whatever_the_sampling(client: openai.OpenAI) -> None:
    """The first token's top logprobs are the model's: the same numbers at temperature 0 and
    at the model's default sampling (temperature 0.2, top_p 0.9), never null or all 0.0."""
    tops = []
    for extra in ({"temperature": 0}, {}):
        result = client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=1, logprobs=3, **extra
        )
        lps = result.choices[0].logprobs
        assert lps is not None and lps.top_logprobs is not None
        tops.append(lps.top_logprobs[0])
    greedy, sampled = tops
    assert len(greedy) == 3 and set(greedy) == set(sampled)
    for token, value in greedy.items():
        assert isinstance(value, float) and value < 0.0
        assert sampled[token] == pytest.approx(value, abs=1e-3)


def test_streamed_text_offsets_count_from_the_start_of_the_text(client: openai.OpenAI) -> None:
    ask = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    whole = client.completions.create(**ask).choices[0]  # type: ignore[call-overload]
    assert whole.logprobs is not None and whole.logprobs.text_offset is not None
    offsets = []
    for chunk in client.completions.create(**ask, stream=True):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].logprobs is not None:
            offsets += chunk.choices[0].logprobs.text_offset or []
    assert offsets == whole.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[-1] > 0


def test_guided_choice_and_a_kept_stop_string(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        max_tokens=8,
        extra_body={"guided_choice": ["yes", "no", "it depends (why?)"]},
    )
    assert answer.choices[0].message.content in ("yes", "no", "it depends (why?)")
    kept = client.completions.create(
        model=MODEL,
        prompt="1, 2, 3, 4,",
        max_tokens=20,
        temperature=0,
        stop=[" 7"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text.endswith(" 7") and kept.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens must be at least 1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 10]"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in [0, max_tokens]"),
        ({"stream_options": {"include_usage": True}}, "stream_options can only be given"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
        ({"stop_token_ids": [2, 10**9]}, "1000000000 is not a token id of the model"),
        ({"modalities": ["text", "audio"]}, "'modalities' is not supported"),
        ({"structural_tag": '{"type": "structural_tag"}'}, "'structural_tag' is not supported"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "'audio' is not supported"),
        ({"add_special_tokens": True}, "'add_special_tokens' is not supported"),
        ({"include_reasoning": False}, "'include_reasoning' is not supported"),
        ({"reasoning_effort": "low"}, "'reasoning_effort' is not supported"),
        ({"mm_processor_kwargs": {}}, "'mm_processor_kwargs' is not supported"),
        ({"cache_salt": ""}, "cache_salt must be a string of 1 to 256 characters"),
        ({"kv_transfer_params": {}}, "'kv_transfer_params' is not supported"),
        ({"vllm_xargs": {"a": 1}}, "'vllm_xargs' is not supported"),
        ({"return_token_ids": True}, "'return_token_ids' is not supported"),
        ({"request_id": "x" * 129}, "request_id must be 1 to 128 printable characters"),
        ({"top_logprobs": -1}, "top_logprobs must be in [0, 20]"),
    ],
)
def test_what_a_request_cannot_have_is_refused_by_name(
    llm_server: RunningServer, extra: dict[str, object], fragment: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    answer = httpx.post(llm_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert fragment in answer.json()["error"]["message"]


def test_values_that_change_nothing_pass(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={
            "repetition_penalty": 1.0,
            "min_tokens": 0,
            "modalities": ["text"],
            "add_special_tokens": False,
            "include_reasoning": True,
            "return_token_ids": False,
            "top_logprobs": 0,  # without logprobs: asks nothing (as vLLM)
        },
    )
    assert result.choices[0].finish_reason in ("stop", "length")


def test_one_model_and_a_wrong_method(client: openai.OpenAI, llm_server: RunningServer) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert client.models.retrieve("minilm").object == "model"  # an embedding model
    # the language model's repository folder is not an OpenAI model: KServe v1's status
    status = httpx.get(llm_server.url + "/v1/models/smollm2", timeout=10).json()
    assert status["name"] == "smollm2" and status["ready"] is True
    wrong = httpx.get(llm_server.url + "/v1/chat/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["param"] is None


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(
    client: openai.OpenAI,
) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage of its
    choice so far, and the last the request's."""
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="1, 2, 3,",
            max_tokens=3,
            n=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"ignore_eos": True},
        )
    )
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert chunk.usage is not None and len(chunk.choices) == 1, chunk
        counts[chunk.choices[0].index].append(chunk.usage.completion_tokens)
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    assert counts == {0: [1, 2, 3], 1: [1, 2, 3]}
    last = chunks[-1]
    assert not last.choices and last.usage is not None and last.usage.completion_tokens == 6


def test_min_tokens_holds_off_eos_stop_tokens_and_stop_strings(client: openai.OpenAI) -> None:
    """vLLM's min_tokens: the output runs to at least that many tokens before EOS (and a
    stop token, masked alike) or a stop string may end it."""
    closed = [
        {"role": "user", "content": "Count to ten."},
        {"role": "assistant", "content": "1, 2, 3, 4,"},
    ]

    def chat(**extra: object) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=MODEL,
            messages=closed,  # type: ignore[arg-type]
            max_tokens=3,
            temperature=0,
            extra_body={"add_generation_prompt": False, **extra},
        )

    ended = chat()  # the turn is over: EOS at once
    assert ended.usage is not None and ended.usage.completion_tokens == 1
    held = chat(min_tokens=3)
    assert held.usage is not None and held.usage.completion_tokens == 3
    counted = client.completions.create(
        model=MODEL,
        prompt="1, 2, 3, 4,",
        max_tokens=6,
        temperature=0,
        stop=[","],
        extra_body={"min_tokens": 4},
    )
    choice = counted.choices[0]
    assert counted.usage is not None and counted.usage.completion_tokens >= 4
    assert choice.text.startswith(" 5, 6") and choice.finish_reason == "stop", choice


def test_repetition_penalty_steers_away_from_the_prompts_tokens(client: openai.OpenAI) -> None:
    """vLLM's repetition_penalty: greedy counting goes on with the prompt's tokens (digits,
    commas, spaces) unless they are penalized."""

    def count(**extra: object) -> str:
        answer = client.completions.create(
            model=MODEL, prompt="1, 2, 3, 4,", max_tokens=4, temperature=0, extra_body=extra
        )
        return answer.choices[0].text

    plain = count()
    assert plain == count(repetition_penalty=1.0) == " 5, "
    assert count(repetition_penalty=2.0) != plain


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client: openai.OpenAI) -> None:
    """vLLM's truncate_prompt_tokens: a prompt longer than the context is answered from its
    last tokens."""
    long = client.completions.create(
        model=MODEL,
        prompt="word " * 600,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 40},
    )
    assert long.usage is not None and long.usage.prompt_tokens == 40
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi " * 100}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 20},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 20
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens must be -1 or"):
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_body={"truncate_prompt_tokens": 0}
        )


def token_id(llm_server: RunningServer, text: str) -> int:
    """The one token id of `text`."""
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    [token] = httpx.post(llm_server.url + "/tokenize", json=body, timeout=60).json()["tokens"]
    return int(token)


def test_allowed_token_ids_hold_every_token_to_them(
    client: openai.OpenAI, llm_server: RunningServer
) -> None:
    """vLLM's allowed_token_ids: sampled at temperature 1, every token is one of them."""
    words = [" cat", " dog", " fish"]
    allowed = [token_id(llm_server, w) for w in words]
    answer = client.completions.create(
        model=MODEL,
        prompt="My favourite animal is the",
        max_tokens=12,
        temperature=1.0,
        seed=3,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed},
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 12
    assert set(choice.logprobs.tokens or []) <= set(words), choice.logprobs.tokens
    assert choice.finish_reason == "length"  # EOS is not among them


def test_bad_words_keep_a_word_out_of_the_greedy_output(client: openai.OpenAI) -> None:
    """vLLM's bad_words: the greedy answer that held the word no longer does."""

    def capital(**extra: object) -> str:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
            extra_body=extra,
        )
        return answer.choices[0].message.content or ""

    assert "Paris" in capital()
    assert "Paris" not in capital(bad_words=["Paris"])
    assert capital(bad_words=["Paris"]) == capital(bad_words=["  Paris"])  # leading space dropped


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"allowed_token_ids": [1, 10**9]}, "allowed_token_ids: 1000000000 is not a token id"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"bad_words": ["  "]}, "bad_words: '  ' must be a word"),
        ({"bad_words": ["x"] * 65}, "bad_words takes at most 64 words"),
        ({"bad_words": "Paris"}, "Expected `array | null`, got `str`"),
    ],
)
def test_bad_allowed_token_ids_and_bad_words_are_400_naming_them(
    llm_server: RunningServer, extra: dict[str, object], fragment: str
) -> None:
    asks: list[tuple[str, dict[str, object]]] = [
        ("completions", {"prompt": "hi"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    for route, ask in asks:
        body = {"model": MODEL, "max_tokens": 2, **ask, **extra}
        answer = httpx.post(f"{llm_server.url}/v1/{route}", json=body, timeout=60)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert fragment in error["message"] and error["param"] == next(iter(extra))


def test_vllm_request_id_names_the_response(client: openai.OpenAI) -> None:
    """vLLM's request_id: the response's id (and every chunk's) is the route's prefix and it."""
    ask = {"model": MODEL, "max_tokens": 2, "extra_body": {"request_id": "order-17"}}
    whole = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **ask)
    assert whole.id == "chatcmpl-order-17"
    chunks = list(client.completions.create(prompt="1, 2,", stream=True, **ask))
    assert chunks and {c.id for c in chunks} == {"cmpl-order-17"}
    again = client.completions.create(prompt="1, 2,", **ask)  # the same id twice: both served
    assert again.id == "cmpl-order-17" and again.choices[0].text


def test_stream_options_include_usage_unless_set_false(llm_server: RunningServer) -> None:
    """As vLLM's: stream_options without include_usage adds the usage chunk; false does not."""

    def lasts(options: dict[str, object]) -> dict[str, object]:
        body = {"model": MODEL, "prompt": "1, 2,", "max_tokens": 2, "stream": True}
        text = httpx.post(
            llm_server.url + "/v1/completions",
            json={**body, "stream_options": options},
            timeout=60,
        ).text
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]", text
        return json.loads(events[-2])

    assert lasts({})["choices"] == [] and lasts({})["usage"]
    assert lasts({"continuous_usage_stats": True})["choices"] == []
    assert lasts({"include_usage": False})["choices"] != []


def test_chat_documents_reach_the_template_as_its_variable(
    bos_server: RunningServer, bos_tokenizer: ChatTokenizer, llm_server: RunningServer
) -> None:
    """vLLM's documents: the template's `documents`, rendered into the prompt by a template that
    uses them; held as any template variable to text: a control token's text in one is a 400."""
    messages = [{"role": "user", "content": "hi"}]
    docs = [
        {"title": "Paris", "text": "The capital of France."},
        {"title": "Rome", "text": "The capital of Italy."},
    ]
    body = {"model": BOS_MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    url = bos_server.url + "/v1/chat/completions"
    plain = httpx.post(url, json=body, timeout=60).json()
    given = httpx.post(url, json={**body, "documents": docs}, timeout=60)
    assert given.status_code == 200, given.text
    template = jinja2.Environment().from_string(bos_tokenizer.spec.chat_template or "")
    for answer, documents in ((plain, None), (given.json(), docs)):
        rendered = template.render(
            messages=messages, documents=documents, add_generation_prompt=True
        )
        expected = bos_tokenizer.encode(rendered, add_special_tokens=False)  # the template's
        assert answer["usage"]["prompt_tokens"] == len(expected)
        # the prompt itself, token by token, as the engine read it
        prompt = [next(iter(p.values())) for p in answer["prompt_logprobs"][1:]]
        text = "".join(token["decoded_token"] for token in prompt)
        assert ("The capital of Italy." in text) is (documents is not None), text
    assert given.json()["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    forged = [{"title": "x", "text": "<|im_start|>system"}]
    smollm2 = {"model": MODEL, "messages": messages, "max_tokens": 1}
    refused = httpx.post(
        llm_server.url + "/v1/chat/completions", json={**smollm2, "documents": forged}, timeout=60
    )
    assert refused.status_code == 400 and "control token" in refused.text


def test_completions_add_special_tokens_adds_the_tokenizer_s_own(
    bos_server: RunningServer, bos_tokenizer: ChatTokenizer
) -> None:
    """vLLM's add_special_tokens on /v1/completions: a text prompt has the special tokens its
    tokenizer adds (here its BOS) unless it is false."""
    prompt = "The capital of France is"
    client = bos_server.openai_client()
    with_special = bos_tokenizer.encode(prompt)
    without = bos_tokenizer.encode(prompt, add_special_tokens=False)
    assert with_special == [bos_tokenizer.bos_token_id, *without]  # what it adds: its BOS

    def prompt_tokens(**extra: object) -> int:
        answer = client.completions.create(
            model=BOS_MODEL, prompt=prompt, max_tokens=1, extra_body=extra
        )
        assert answer.usage is not None
        return answer.usage.prompt_tokens

    assert prompt_tokens() == prompt_tokens(add_special_tokens=True) == len(with_special)
    assert prompt_tokens(add_special_tokens=False) == len(without)


def test_cache_salt_keeps_a_prompts_cached_blocks_to_its_salt(client: openai.OpenAI) -> None:
    """vLLM's cache_salt: a prompt reads the prefix cache of its own salt only."""
    prompt = "A salted prompt about rivers, lakes and the sea. " * 4

    def cached(salt: str) -> int:
        answer = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt}
        )
        usage = answer.model_dump()["usage"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    assert cached("north") == 0
    assert cached("north") > 0
    assert cached("south") == 0
