"""The OpenAPI document (`frontend/openapi.py`) without a server: valid OpenAPI 3.1, every
route the server answers, and examples that the real decoders accept."""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from openapi_spec_validator import validate

from lockgate.frontend.openapi import openapi_document
from lockgate.protocol import generate, v2_codec
from lockgate.protocol import openai as oa
from lockgate.protocol import responses as rs

ROUTES = {
    ("get", "/v2"),
    ("get", "/v2/health/live"),
    ("get", "/v2/health/ready"),
    ("get", "/v2/models/stats"),
    ("post", "/v2/repository/index"),
    ("post", "/v2/repository/models/{model}/load"),
    ("post", "/v2/repository/models/{model}/unload"),
    ("get", "/v2/systemsharedmemory/status"),
    ("get", "/v2/systemsharedmemory/region/{region}/status"),
    ("post", "/v2/systemsharedmemory/region/{region}/register"),
    ("post", "/v2/systemsharedmemory/region/{region}/unregister"),
    ("post", "/v2/systemsharedmemory/unregister"),
    *((m, "/v2/logging") for m in ("get", "post")),
    *((m, "/v2/trace/setting") for m in ("get", "post")),
    *((m, "/v2/models/{model}/trace/setting") for m in ("get", "post")),
    *(
        (method, prefix + action)
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")
        for method, action in (
            ("get", ""),
            ("get", "/ready"),
            ("get", "/config"),
            ("get", "/stats"),
            ("post", "/infer"),
            ("post", "/generate"),
            ("post", "/generate_stream"),
        )
    ),
    ("get", "/v1/models"),
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("post", "/v1/embeddings"),
    ("post", "/v1/responses"),
    ("get", "/v1/responses/{id}"),
    ("delete", "/v1/responses/{id}"),
    ("get", "/v1/responses/{id}/input_items"),
    ("post", "/v1/responses/{id}/cancel"),
    ("post", "/v1/models/{model}:predict"),
    ("post", "/v1/models/{model}/versions/{version}:predict"),
    ("post", "/tokenize"),
    ("post", "/detokenize"),
    ("get", "/version"),
    ("get", "/health"),
    ("get", "/metrics"),
    ("get", "/dashboard"),
    ("get", "/"),
    ("get", "/openapi.json"),
}


def test_the_document_is_valid_openapi() -> None:
    document = openapi_document()
    validate(document)  # openapi-spec-validator: the 3.1 schema, references, parameters
    schemathesis.openapi.from_dict(document).validate()
    json.dumps(document)  # served as JSON


def test_every_route_is_documented_and_only_those() -> None:
    documented = {
        (method, path)
        for path, item in openapi_document()["paths"].items()
        for method in item
        if method in ("get", "post", "put", "delete", "patch")
    }
    assert documented == ROUTES


def test_every_error_has_a_body_shape() -> None:
    for path, item in openapi_document()["paths"].items():
        for method, operation in item.items():
            for status, answer in operation["responses"].items():
                if status.startswith(("4", "5")):
                    schema = answer["content"]["application/json"]["schema"]
                    assert schema, (method, path, status)


def examples(media: dict[str, Any]) -> list[Any]:
    found = [media["example"]] if "example" in media else []
    return found + [e["value"] for e in media.get("examples", {}).values()]


def test_the_examples_decode() -> None:
    paths = openapi_document()["paths"]
    infer = paths["/v2/models/{model}/infer"]["post"]["requestBody"]["content"]
    for body in examples(infer["application/json"]):
        assert v2_codec.decode_infer_request(json.dumps(body).encode(), None).inputs
    kinds = {
        "/v1/completions": oa.CompletionRequest,
        "/v1/chat/completions": oa.ChatRequest,
        "/v1/embeddings": oa.EmbeddingRequest,
        "/v1/responses": rs.ResponsesRequest,
    }
    for path, kind in kinds.items():
        media = paths[path]["post"]["requestBody"]["content"]["application/json"]
        assert examples(media), path
        for body in examples(media):
            oa.decode(json.dumps(body).encode(), kind)
    for path in ("/v2/models/{model}/generate", "/v2/models/{model}/generate_stream"):
        media = paths[path]["post"]["requestBody"]["content"]["application/json"]
        assert examples(media), path
        for body in examples(media):
            assert generate.decode(json.dumps(body).encode()).text_input


def test_the_generate_body_names_what_the_decoder_takes() -> None:
    """Every name `protocol/generate.py` knows is in the schema, typed as the completion
    request's field it becomes, and nothing else is."""
    schemas = openapi_document()["components"]["schemas"]
    body, completion = schemas["GenerateRequest"], schemas["CompletionRequest"]["properties"]
    names = set(body["properties"]) - {"text_input", "parameters"}
    assert names == generate.KNOWN
    (nested,) = [s for s in body["properties"]["parameters"]["anyOf"] if s["type"] == "object"]
    assert set(nested["properties"]) == generate.KNOWN
    for name in generate.SAMPLING:
        typed = {k: v for k, v in body["properties"][name].items() if k != "description"}
        assert typed == completion[name], name
    assert body["additionalProperties"] is False and nested["additionalProperties"] is False
