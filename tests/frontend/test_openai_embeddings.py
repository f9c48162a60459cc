"""/v1/embeddings through a real server and the official `openai` client: what `input`,
`encoding_format` and `dimensions` may be, usage counted by the model's own tokenizer, and
the limits of `--max-embedding-inputs` and `--max-embedding-chars` set lower than their
defaults."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from lockgate.demo.build import MINILM_TOKENIZER_PACKAGE
from lockgate.demo.packages import package_folder
from tests.conftest import RunningServer, start_server

MAX_INPUTS = 40  # more than minilm's max_batch_size (32): a request runs in two batches
MAX_CHARS = 2000


@pytest.fixture(scope="module")
def embedder(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("embeddings-repo")
    shutil.copytree(demo_repo / "minilm", repo / "minilm")
    limits = ["--max-embedding-inputs", str(MAX_INPUTS), "--max-embedding-chars", str(MAX_CHARS)]
    running = start_server(repo, tmp_path_factory.mktemp("embeddings"), "--no-llm", *limits)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(embedder: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=embedder.url + "/v1", api_key="unused", max_retries=3)


def tokens_of(texts: list[str]) -> int:
    """What minilm's own tokenizer counts: [CLS] and [SEP] included, at most 256 a text."""
    path = package_folder(MINILM_TOKENIZER_PACKAGE) / "model" / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.enable_truncation(256)
    tokenizer.no_padding()  # the file pads to 128
    return sum(len(encoding.ids) for encoding in tokenizer.encode_batch(texts))


def test_usage_counts_the_tokens_of_the_models_tokenizer(client: openai.OpenAI) -> None:
    texts = [
        "a dog runs",
        "antidisestablishmentarianism, tokenized",
        "日本語のテキスト",
        "ok " * 400,
    ]
    result = client.embeddings.create(model="minilm", input=texts, user="someone")
    assert [d.index for d in result.data] == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == tokens_of(texts) == result.usage.total_tokens
    assert tokens_of(texts) != sum(len(t.split()) for t in texts)  # not a word count
    one = client.embeddings.create(model="minilm", input="a dog runs")
    assert one.usage.prompt_tokens == tokens_of(["a dog runs"]) == 5


def test_more_texts_than_a_batch_run_in_batches(client: openai.OpenAI) -> None:
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'taxes'}" for i in range(40)]
    together = client.embeddings.create(model="minilm", input=texts)
    vectors = np.array([d.embedding for d in together.data])
    assert vectors.shape == (40, 384)
    alone = client.embeddings.create(model="minilm", input=texts[37])
    np.testing.assert_allclose(vectors[37], alone.data[0].embedding, atol=1e-4)
    assert together.usage.prompt_tokens == tokens_of(texts)


def test_float_and_base64_agree_and_dimensions_may_name_the_models_own(
    client: openai.OpenAI,
) -> None:
    floats = client.embeddings.create(model="minilm", input="hi", encoding_format="float")
    packed = client.embeddings.create(model="minilm", input="hi", dimensions=384)  # base64
    np.testing.assert_allclose(floats.data[0].embedding, packed.data[0].embedding, atol=1e-6)


def bad_request(client: openai.OpenAI, **fields: object) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="minilm", **fields)  # type: ignore[arg-type]
    return str(caught.value)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"input": []}, "input must not be an empty list"),
        ({"input": ""}, "input is an empty string"),
        ({"input": ["a", ""]}, "input[1] is an empty string"),
        ({"input": [101, 2023, 102]}, "token ids is not supported"),
        ({"input": [[101, 2023], [102]]}, "token ids is not supported"),
        ({"input": ["a", 5]}, "at `$.input[1]`"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, f"more than the limit of {MAX_INPUTS} per request"),
        ({"input": "x" * (MAX_CHARS + 1)}, f"more than the limit of {MAX_CHARS}"),
        ({"input": "hi", "encoding_format": "hex"}, "Invalid enum value 'hex'"),
        ({"input": "hi", "dimensions": 100}, "384-dimensional embeddings and does not shorten"),
        ({"input": "hi", "dimensions": 1000}, "more than the 384 of model 'minilm'"),
        ({"input": "hi", "dimensions": 0}, "dimensions must be a positive integer"),
    ],
    ids=[
        "empty-list",
        "empty-string",
        "empty-text",
        "token-ids",
        "token-id-lists",
        "not-text",
        "too-many",
        "too-long",
        "encoding",
        "fewer-dimensions",
        "more-dimensions",
        "zero-dimensions",
    ],
)
@pytest.mark.usefixtures("bounded_rss")
def test_what_input_and_options_may_not_be(
    client: openai.OpenAI, fields: dict[str, object], expected: str
) -> None:
    assert expected in bad_request(client, **fields)


@pytest.mark.usefixtures("bounded_rss")
def test_a_million_tiny_texts_are_refused_before_they_are_built(embedder: RunningServer) -> None:
    body = json.dumps({"model": "minilm", "input": ["ab"] * 1_000_000}).encode()  # 6 MB
    started = time.monotonic()
    r = httpx.post(embedder.url + "/v1/embeddings", content=body, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert "more than the limit of 40" in r.json()["error"]["message"]
    assert time.monotonic() - started < 5
    assert httpx.get(embedder.url + "/v2/health/live").status_code == 200
