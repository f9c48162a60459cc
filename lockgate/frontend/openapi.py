"""The OpenAPI 3.0 document of lockgate's REST API, served at /openapi.json."""

from __future__ import annotations

from functools import cache
from typing import Any

from lockgate import __version__
from lockgate.config import DATATYPES

_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}
_TENSOR = {
    "type": "object",
    "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": {
            "type": "string",
            "enum": list(DATATYPES),
        },
        "parameters": {"type": "object"},
        "data": {"type": "array", "items": {}},
    },
}
_INFER_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": {
            "type": "object",
            "properties": {
                "priority": {"type": "integer", "minimum": 0},
                "timeout": {"type": "integer", "minimum": 0, "description": "microseconds"},
                "binary_data_output": {"type": "boolean"},
            },
        },
        "inputs": {"type": "array", "items": _TENSOR},
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
            },
        },
    },
}
_INFER_RESPONSE = {
    "type": "object",
    "required": ["model_name", "outputs"],
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "parameters": {"type": "object"},
        "outputs": {"type": "array", "items": _TENSOR},
    },
}


def _errors(*codes: int) -> dict[str, Any]:
    return {
        str(code): {
            "description": "error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for code in codes
    }


def _json_ok(schema: dict[str, Any] | None = None) -> dict[str, Any]:
    content = {"application/json": {"schema": schema or {"type": "object"}}}
    return {"200": {"description": "OK", "content": content}}


_MODEL = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
_VERSION = {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}


def _model_paths(prefix: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    infer = {
        "post": {
            "summary": "Run inference (KServe v2)",
            "parameters": params,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}}
                },
            },
            "responses": {
                **_json_ok({"$ref": "#/components/schemas/InferResponse"}),
                **_errors(400, 404, 413, 500, 503, 504),
            },
        }
    }
    get = {"parameters": params, "responses": {**_json_ok(), **_errors(404, 503)}}
    return {
        f"{prefix}": {"get": {"summary": "Model metadata", **get}},
        f"{prefix}/ready": {"get": {"summary": "Model readiness", **get}},
        f"{prefix}/config": {"get": {"summary": "Model configuration (Triton)", **get}},
        f"{prefix}/stats": {"get": {"summary": "Model statistics (Triton)", **get}},
        f"{prefix}/infer": infer,
    }


@cache
def openapi_document() -> dict[str, Any]:
    simple = {"get": {"responses": {**_json_ok(), **_errors(503)}}}
    paths: dict[str, Any] = {
        "/v2/health/live": simple,
        "/v2/health/ready": simple,
        "/v2": {"get": {"summary": "Server metadata", "responses": _json_ok()}},
        "/v2/models/stats": {"get": {"summary": "All model statistics", "responses": _json_ok()}},
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {"200": {"description": "OK", "content": {"text/plain": {}}}},
            }
        },
    }
    paths.update(_model_paths("/v2/models/{model}", [_MODEL]))
    paths.update(_model_paths("/v2/models/{model}/versions/{version}", [_MODEL, _VERSION]))
    return {
        "openapi": "3.0.3",
        "info": {"title": "lockgate", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": {
                "Error": _ERROR,
                "InferRequest": _INFER_REQUEST,
                "InferResponse": _INFER_RESPONSE,
            }
        },
    }
