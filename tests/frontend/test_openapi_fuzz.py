"""Fuzz the whole HTTP API from its own OpenAPI document (schemathesis) against a live server
with classic models, an embedding model and SmolLM2: no 500 for any input, 5xx only where
documented as transient (503, 504), and every answer conforms to the document, the events of
a streamed completion included."""

from __future__ import annotations

import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from lockgate.demo.smollm2 import SERVED_NAME
from lockgate.frontend.openapi import openapi_document
from tests.conftest import ONE_THREAD, RunningServer, smollm2_repository, start_server

EXAMPLES = 10  # per operation (42 operations)
LLM_EXAMPLES = 6  # per generating operation (7): each generates a few tokens
MAX_TOKENS = 3  # what a fuzzed completion may generate at most
MODELS = ("echo", "digits_onnx", "minilm", "smollm2")  # half the cases aim at one of these
SPARE = "spare"  # the only model the fuzzed load and unload calls aim at
GENERATION = r"^/v1/(chat/)?completions$|^/v1/responses$|/generate(_stream)?$"
LLM = "smollm2"  # the repository name, as the generate routes take it


@pytest.fixture(scope="module")
def fuzz_server(
    test_repo: Path, demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("fuzz-repo")
    for name in ("echo", "digits_onnx", "minilm"):
        shutil.copytree(test_repo / name, repo / name)
    shutil.copytree(test_repo / "echo", repo / SPARE)
    small = {
        "kv_cache_gib": "0.02",
        "max_model_len": "128",
        "dtype": "float32",
        "quantization": "none",
        **ONE_THREAD,
    }
    smollm2_repository(demo_repo, repo, small)
    running = start_server(
        repo,
        tmp_path_factory.mktemp("fuzz-server"),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        ready_timeout=600,
    )
    yield running
    running.stop()


# Built from the document the server serves (checked below), not fetched: schemathesis's
# fixture-based loader reads pytest internals that pytest 9 no longer has.
schema = schemathesis.openapi.from_dict(openapi_document())


def test_served_document_is_the_fuzzed_one(fuzz_server: RunningServer) -> None:
    assert httpx.get(fuzz_server.url + "/openapi.json").json() == openapi_document()


def aim(case: schemathesis.Case) -> None:
    """Point half the cases at a served model (and version 1) so bodies reach the decoders;
    keep load and unload off the models the other cases use, and completions short."""
    choice = zlib.crc32(repr((case.body, case.path_parameters)).encode()) % (2 * len(MODELS))
    aimed = choice < len(MODELS)
    params = case.path_parameters or {}
    if case.path.startswith("/v2/repository/models/"):
        if aimed or params["model"] in MODELS:
            params["model"] = SPARE
    elif "model" in params and params["model"] not in MODELS and aimed:
        generates = case.path.endswith(("/generate", "/generate_stream"))
        params["model"] = LLM if generates else MODELS[choice]
        if "version" in params:
            params["version"] = "1"
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path.endswith(("/generate", "/generate_stream")):
        parameters = body.get("parameters")
        if aimed and isinstance(parameters, dict):  # a name in both places is a 400
            for name in set(body) & set(parameters):
                del body[name]
        if "max_tokens" in body or not isinstance(parameters, dict):
            shorten(body, ("max_tokens",))
        else:
            shorten(parameters, ("max_tokens",))
        return
    if not case.path.startswith("/v1/"):
        return
    if aimed and "model" in body:
        body["model"] = "minilm" if case.path == "/v1/embeddings" else SERVED_NAME
    shorten(body, ("max_tokens", "max_completion_tokens", "max_output_tokens"))


def shorten(fields: dict[str, Any], names: tuple[str, ...]) -> None:
    """Cap the tokens a fuzzed generation may ask for (none asked: the cap)."""
    for name in names:
        value = fields.get(name)
        if value is None or (isinstance(value, int) and value > MAX_TOKENS):
            fields[name] = MAX_TOKENS


def check(case: schemathesis.Case, response: Any) -> None:
    """No 500, 5xx only when transient, and an answer as documented: each event of a stream
    too (schemathesis checks events against the event schema), and an OpenAI stream ends
    [DONE] (Triton's generate_stream has no such event)."""
    assert response.status_code != 500, (case.as_curl_command(), response.text[:500])
    assert response.status_code < 500 or response.status_code in (503, 504), response.text[:500]
    case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return
    if case.path == "/v1/responses":  # named events, the last one ending the response
        last = response.text.rpartition("event: ")[2]
        ends = ("response.completed", "response.incomplete", "response.failed")
        assert last.startswith(ends), response.text[-500:]
        return
    last = "data: [DONE]\n\n" if case.path.startswith("/v1/") else "}\n\n"
    assert response.text.endswith(last), response.text[-500:]


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )


@schema.exclude(path_regex=GENERATION).parametrize()
@fuzz(EXAMPLES)
def test_api_never_fails_on_client_input(
    case: schemathesis.Case, fuzz_server: RunningServer
) -> None:
    aim(case)
    check(case, case.call(base_url=fuzz_server.url, timeout=30, allow_redirects=False))


@schema.include(path_regex=GENERATION).parametrize()
@fuzz(LLM_EXAMPLES)
def test_generation_never_fails_on_client_input(
    case: schemathesis.Case, fuzz_server: RunningServer
) -> None:
    aim(case)
    check(case, case.call(base_url=fuzz_server.url, timeout=60))


def test_server_survived_the_fuzzing(fuzz_server: RunningServer) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    r = httpx.post(fuzz_server.url + "/v2/models/echo/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert "Traceback" not in fuzz_server.log()
    assert fuzz_server.process.poll() is None
