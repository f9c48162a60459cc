"""Request bodies for the load generator, encoded once: synthetic or read from files.

KServe v2 bodies are built from the model's metadata (random data of each input's datatype
and shape). OpenAI bodies carry synthetic prompts of mixed lengths, prompts from a JSONL
file, or the token-id prompts of a shared workload file (`{"requests": [{"prompt_ids",
"max_new_tokens"}]}`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lockgate.errors import BadRequest, NotFound, Unavailable

ENDPOINTS = ("v2", "openai-completions", "openai-chat")

_WORD_TEXT = (
    "the a of to and in is was for on with as by at from it that this be are or have had "
    "not but they which one you were all we can her has there been if more when will would "
    "who so no river mountain light green cold small large journey painted built busy city "
    "morning garden window quiet story music paper stone bridge market winter summer ocean "
    "forest letter friend table yellow silver market engine signal station question answer"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class Payload:
    """One pre-encoded request body."""

    body: bytes
    max_tokens: int | None = None  # LLM: output tokens asked for


@dataclass(frozen=True, slots=True)
class V2Target:
    url: str  # base, e.g. http://127.0.0.1:8000
    model: str
    version: str | None = None

    @property
    def model_url(self) -> str:
        base = f"{self.url}/v2/models/{self.model}"
        return f"{base}/versions/{self.version}" if self.version else base

    @property
    def infer_url(self) -> str:
        return f"{self.model_url}/infer"


def openai_url(url: str, endpoint: str) -> str:
    return f"{url}/v1/chat/completions" if endpoint == "openai-chat" else f"{url}/v1/completions"


async def fetch_v2_metadata(session: Any, target: V2Target) -> dict[str, Any]:
    """GET the model metadata; a missing model or a dead server is a clear error."""
    import aiohttp

    try:
        async with session.get(target.model_url) as response:
            if response.status == 404:
                raise NotFound(f"model {target.model!r} not found at {target.model_url}")
            if response.status != 200:
                raise Unavailable(f"{target.model_url} answered {response.status}")
            metadata = await response.json(content_type=None)
    except aiohttp.ClientError as exc:
        raise Unavailable(f"cannot reach {target.model_url}: {exc}") from exc
    if not isinstance(metadata, dict) or not isinstance(metadata.get("inputs"), list):
        raise BadRequest(f"{target.model_url}: metadata has no 'inputs' list")
    return metadata


async def first_openai_model(session: Any, url: str) -> str:
    """The first language model that GET /v1/models lists (those it gives a `max_model_len`;
    an embedding model cannot complete)."""
    import aiohttp

    try:
        async with session.get(f"{url}/v1/models") as response:
            listing = await response.json(content_type=None)
    except (aiohttp.ClientError, json.JSONDecodeError) as exc:
        raise Unavailable(f"cannot list models at {url}/v1/models: {exc}") from exc
    models = listing.get("data") if isinstance(listing, dict) else None
    if not models:
        raise NotFound(f"{url}/v1/models lists no model; pass --model")
    fitting = [m for m in models if "max_model_len" in m] or models  # (a server that tells
    # no model's length, OpenAI's own: its first)
    return str(fitting[0]["id"])


def _random_tensor(datatype: str, count: int, rng: np.random.Generator) -> list[Any]:
    """`count` random values of a KServe v2 datatype, as JSON-ready Python values."""
    if datatype == "BOOL":
        return rng.integers(0, 2, size=count).astype(bool).tolist()
    if datatype == "BYTES":
        return [" ".join(rng.choice(_WORDS, size=4)) for _ in range(count)]
    if datatype.startswith("FP") or datatype == "BF16":
        return np.round(rng.random(count), 4).tolist()
    if datatype.startswith(("INT", "UINT")):
        return rng.integers(0, 100, size=count).tolist()
    raise BadRequest(f"unknown datatype {datatype!r}")


def synthesize_v2_body(
    metadata: dict[str, Any], batch_size: int, rng: np.random.Generator
) -> bytes:
    """A v2 infer body with random data for every input; the leading -1 becomes batch_size,
    any other -1 becomes 1."""
    inputs = []
    for spec in metadata["inputs"]:
        try:
            name, datatype, dims = spec["name"], spec["datatype"], list(spec["shape"])
        except (KeyError, TypeError) as exc:
            raise BadRequest(f"metadata input needs name, datatype and shape: {spec}") from exc
        shape = [batch_size if i == 0 and d == -1 else max(int(d), 1) for i, d in enumerate(dims)]
        count = int(np.prod(shape)) if shape else 1
        data = _random_tensor(datatype, count, rng)
        inputs.append({"name": name, "shape": shape, "datatype": datatype, "data": data})
    return json.dumps({"inputs": inputs}).encode()


def v2_payloads(
    metadata: dict[str, Any], count: int, seed: int, batch_size: int = 1
) -> list[Payload]:
    rng = np.random.default_rng(seed)
    return [Payload(synthesize_v2_body(metadata, batch_size, rng)) for _ in range(max(1, count))]


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Each non-blank line is one JSON object."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise BadRequest(f"cannot read {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadRequest(f"{path}:{number}: not JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise BadRequest(f"{path}:{number}: each line must be a JSON object")
        rows.append(row)
    if not rows:
        raise BadRequest(f"{path}: no requests")
    return rows


def v2_file_payloads(path: str | Path) -> list[Payload]:
    return [Payload(json.dumps(row).encode()) for row in read_jsonl(path)]


def synthetic_prompts(count: int, seed: int, min_words: int = 8, max_words: int = 256) -> list[str]:
    """Prompts of random words, lengths uniform in [min_words, max_words]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_words, max_words + 1, size=max(1, count))
    return [" ".join(rng.choice(_WORDS, size=int(n))) for n in lengths]


def openai_body(
    endpoint: str, model: str, prompt: str | list[int], max_tokens: int, ignore_eos: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0}
    if endpoint == "openai-chat":
        if not isinstance(prompt, str):
            raise BadRequest("the chat endpoint needs text prompts; token ids need completions")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def streaming(body: dict[str, Any]) -> Payload:
    """Ask for a stream with a final usage chunk, and encode once."""
    body = {**body, "stream": True}
    body["stream_options"] = {**body.get("stream_options", {}), "include_usage": True}
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    return Payload(json.dumps(body).encode(), int(max_tokens) if max_tokens else None)


def openai_payloads(
    endpoint: str,
    model: str,
    prompts: Sequence[str | list[int]],
    max_tokens: list[int],
    ignore_eos: bool,
) -> list[Payload]:
    return [
        streaming(openai_body(endpoint, model, prompt, tokens, ignore_eos))
        for prompt, tokens in zip(prompts, max_tokens, strict=True)
    ]


def openai_file_payloads(path: str | Path, model: str, ignore_eos: bool) -> list[Payload]:
    """A JSONL of request bodies; the model and ignore_eos are filled in when missing."""
    payloads = []
    for row in read_jsonl(path):
        row.setdefault("model", model)
        if ignore_eos:
            row.setdefault("ignore_eos", True)
        payloads.append(streaming(row))
    return payloads


def is_shared_workload(path: str | Path) -> bool:
    return str(path).endswith(".json")


def load_shared_workload(path: str | Path) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, max_new_tokens) of each request in a shared workload file."""
    try:
        data = json.loads(Path(path).read_text())
        requests = data["requests"]
        prompts = [[int(t) for t in r["prompt_ids"]] for r in requests]
        max_new = [int(r["max_new_tokens"]) for r in requests]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise BadRequest(
            f"{path}: expected {{'requests': [{{'prompt_ids', 'max_new_tokens'}}]}}: {exc}"
        ) from exc
    if not prompts:
        raise BadRequest(f"{path}: no requests")
    return prompts, max_new
