"""The OpenAPI 3.1 document of lockgate's HTTP API, served at /openapi.json.

Every route of `frontend/app.py`, `frontend/openai_routes.py`, `frontend/responses_routes.py`
and `frontend/generate_routes.py` is here, with its answers and its errors. The schemas come
from msgspec types (`msgspec.json.schema_components`): request bodies from the Structs that
decode them (`protocol/v2_codec.py`, `protocol/openai.py`, `protocol/responses.py`; Triton's
generate body from the names `protocol/generate.py` takes, typed as the completion request
they decode into), so the document cannot drift from what the server accepts, and answers from
`frontend/openapi_schemas.py`, which the fuzz test holds a live server's answers to.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Any

import msgspec

from lockgate import __version__
from lockgate.config import DATATYPES
from lockgate.frontend import openapi_schemas as out
from lockgate.frontend.v2_service import IndexEntry
from lockgate.protocol import generate, v2_codec
from lockgate.protocol import openai as oa
from lockgate.protocol import responses as rs
from lockgate.protocol.predict import PredictIn
from lockgate.protocol.shared_memory import RegisterRequest

# --- schemas ------------------------------------------------------------------------------


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_SCHEMA_TYPES = (
    *(v for v in vars(out).values() if isinstance(v, type) and issubclass(v, msgspec.Struct)),
    list[IndexEntry],
    v2_codec._RequestIn,
    RegisterRequest,
    oa.TokenizeRequest,
    oa.DetokenizeRequest,
    oa.CompletionRequest,
    oa.ChatRequest,
    oa.EmbeddingRequest,
    rs.ResponsesRequest,
    PredictIn,
)
# the v2 decoder's Structs are private to its module: their names in the document
_RENAMED = {
    "_RequestIn": "InferRequest",
    "_TensorIn": "InferInput",
    "_OutputIn": "InferOutputIn",
    "PredictIn": "PredictRequest",
}
_COUNT = {"type": "integer", "minimum": 0}
_TOKEN_IDS = {"type": "array", "items": _COUNT, "minItems": 1}
_SCALAR = {"type": ["string", "number", "boolean", "null"]}  # a v2 parameter: nothing nested
_TEXT = {"type": "string", "minLength": 1}
# fields that the decoders type loosely and check by hand, described as the checks are
_HAND_CHECKED: dict[tuple[str, str], dict[str, Any]] = {
    ("InferRequest", "parameters"): {
        "type": "object",
        "properties": {
            "priority": {**_COUNT, "description": "1 is the highest; 0: the model's default"},
            "timeout": {**_COUNT, "description": "microseconds; 0: the model's default"},
            "binary_data_output": {"type": "boolean"},
        },
        "additionalProperties": _SCALAR,
    },
    ("InferInput", "datatype"): {"type": "string", "enum": list(DATATYPES)},
    ("InferInput", "shape"): {"type": "array", "items": _COUNT},
    ("InferInput", "data"): {
        "type": "array",
        "description": "the elements in row-major order, flat or nested no deeper than the "
        "shape; absent when binary",
    },
    ("InferInput", "parameters"): {
        "type": "object",
        "properties": {"binary_data_size": _COUNT},
        "additionalProperties": _SCALAR,
    },
    ("InferOutputIn", "parameters"): {
        "type": "object",
        "properties": {
            "binary_data": {"type": "boolean"},
            "classification": {**_COUNT, "description": "> 0: the top classes, as BYTES"},
        },
        "additionalProperties": _SCALAR,
    },
    ("ChatRequest", "messages"): {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
    ("ChatRequest", "tools"): {
        "anyOf": [
            {"type": "array", "items": _ref("ToolDefinition"), "minItems": 1},
            {"type": "null"},
        ],
        "description": "at most --max-tools tools of at most --max-tool-chars characters in all",
    },
    ("FunctionDefinition", "name"): {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
    ("FunctionDefinition", "parameters"): {
        "anyOf": [{"type": "object"}, {"type": "null"}],
        "description": "the JSON schema of the arguments, an object; absent: no arguments",
    },
    ("PredictRequest", "instances"): {
        "type": "array",
        "minItems": 1,
        "description": "one item per row: the input's value, or an object of input values by "
        "name; BYTES values are strings or {'b64': ...}",
    },
    ("PredictRequest", "inputs"): {
        "description": "the batch of the one input, or an object of batches by input name",
    },
    ("EmbeddingRequest", "input"): {
        "description": "a string or a list of strings (token ids are not supported), each of "
        "at most --max-embedding-chars characters, at most --max-embedding-inputs of them",
        "anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1}],
    },
    ("EmbeddingRequest", "dimensions"): {
        "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}],
        "description": "the size of the model's own embeddings: they are not shortened",
    },
    ("DetokenizeRequest", "tokens"): {
        "type": "array",
        "items": _COUNT,
        "description": "token ids, at most the model's max_model_len of them",
    },
    ("CompletionRequest", "prompt"): {
        "description": "a string, token ids, or a list of either (a batch of at most "
        "--max-prompts prompts, one choice each per n)",
        "anyOf": [
            {"type": "string", "minLength": 1},
            _TOKEN_IDS,
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 64},
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 64},
        ],
    },
}
for _request in (oa.CompletionRequest, oa.ChatRequest):
    for _field in _request.unsupported_fields:
        _HAND_CHECKED[_request.__name__, _field] = {
            "type": "null",
            "description": "not implemented by lockgate on this route: refused (400) when given"
            + (" (best_of: completions only)" if _field == "best_of" else ""),
        }
_HAND_CHECKED["ChatRequest", "modalities"] = {
    "anyOf": [{"type": "null"}, {"type": "array", "items": {"const": "text"}}],
    "description": 'only ["text"]: a text model answers no audio (other values: 400)',
}
_HAND_CHECKED["ChatRequest", "add_special_tokens"] = {
    "anyOf": [{"type": "null"}, {"const": False}],
    "description": "only false: the chat template adds the special tokens (true: 400)",
}
_HAND_CHECKED["ChatRequest", "include_reasoning"] = {
    "anyOf": [{"type": "null"}, {"const": True}],
    "description": "only true: without a reasoning parser the whole output is content (false: 400)",
}


def schema_components() -> dict[str, Any]:
    """The named schemas of the document (#/components/schemas/...)."""
    _, found = msgspec.json.schema_components(
        _SCHEMA_TYPES, ref_template="#/components/schemas/{name}"
    )
    components = _renamed(found)
    for old, new in _RENAMED.items():
        components[new] = {**components.pop(old), "title": new}
    for (component, field), schema in _HAND_CHECKED.items():
        components[component]["properties"][field] = schema
    components["GenerateRequest"] = _generate_request(components["CompletionRequest"])
    return dict(sorted(components.items()))


_GENERATE_OPTIONS = {
    "stream": {
        "anyOf": [{"type": "boolean"}, {"type": "null"}],
        "description": "when given, must match the route: true for /generate_stream",
    },
    "exclude_input_in_output": {
        "anyOf": [{"type": "boolean"}, {"type": "null"}],
        "description": "false: text_output starts with text_input (default true)",
    },
}


def _generate_request(completion: dict[str, Any]) -> dict[str, Any]:
    """Triton's generate body as `protocol/generate.py` decodes it: `text_input`, and the
    names it knows, typed as in the completion request they become, at the top level or in
    `parameters` (not both); any other name is refused (400)."""
    fields = {name: completion["properties"][name] for name in generate.SAMPLING}
    fields["max_tokens"] = {**fields["max_tokens"], "description": "default 16"}
    fields.update({name: _GENERATE_OPTIONS[name] for name in generate.OPTIONS})
    parameters = {
        "anyOf": [
            {"type": "object", "properties": fields, "additionalProperties": False},
            {"type": "null"},
        ],
        "description": "sampling parameters, with vLLM's names",
    }
    return {
        "title": "GenerateRequest",
        "type": "object",
        "properties": {"text_input": _TEXT, "parameters": parameters, **fields},
        "required": ["text_input"],
        "additionalProperties": False,
    }


def _renamed(node: Any) -> Any:
    """`node` with its references to the renamed schemas renamed."""
    if isinstance(node, list):
        return [_renamed(item) for item in node]
    if not isinstance(node, dict):
        return node
    renamed = {key: _renamed(value) for key, value in node.items()}
    prefix, _, name = str(renamed.get("$ref", "")).rpartition("/")
    if name in _RENAMED:
        renamed["$ref"] = f"{prefix}/{_RENAMED[name]}"
    return renamed


# --- answers ------------------------------------------------------------------------------

_ERRORS = {
    400: "The request is malformed or fails a check; the message says which.",
    401: "No API key, on a server started with keys.",
    403: "The API key is not accepted, or the action is turned off.",
    404: "No such model, version or route.",
    408: "The body did not arrive in time.",
    413: "The body is over the size limit (inflated, when it has a Content-Encoding).",
    415: "The body's Content-Encoding is neither gzip, deflate nor identity.",
    429: "The language model's queue is full.",
    500: "The model raised; only the requests of its batch see this.",
    503: "Saturated, draining, or the model is not ready: retry after Retry-After seconds.",
    504: "The request's deadline passed before it was answered.",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
_BINARY = {"type": "string", "format": "binary"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _ok(name: str) -> dict[str, Any]:
    return {"200": _json(_ref(name))}


def _text(media: str, description: str) -> dict[str, Any]:
    return {"200": {"description": description, "content": {media: {"schema": {"type": "string"}}}}}


def _errors(codes: tuple[int, ...], openai: bool, public: bool) -> dict[str, Any]:
    """The error answers of an operation. /v1 answers in the OpenAI shape, except refusals
    made before any route is reached (503 {"error": "..."}); keys are asked off public paths."""
    error = _ref("OpenAIError") if openai else _ref("Error")
    refused = {"anyOf": [error, _ref("Error")]} if openai else error
    responses = {}
    for code in sorted({*codes, *(() if public else (401, 403))}):
        responses[str(code)] = _json(refused if code == 503 else error, _ERRORS[code])
        if code in (429, 503):
            responses[str(code)]["headers"] = _RETRY_AFTER
    return responses


def _operation(
    operation_id: str,
    summary: str,
    ok: dict[str, Any],
    errors: tuple[int, ...] = (),
    *,
    tag: str,
    params: tuple[dict[str, Any], ...] = (),
    body: dict[str, Any] | None = None,
    public: bool = False,
) -> dict[str, Any]:
    """One operation. `ok` holds its answers that are not errors, `errors` its error codes;
    an error code also in `ok` keeps the answer `ok` gives it."""
    operation: dict[str, Any] = {"operationId": operation_id, "summary": summary, "tags": [tag]}
    if params:
        operation["parameters"] = list(params)
    if body is not None:
        operation["requestBody"] = {"required": True, "content": body}
    responses = {**_errors(errors, tag == "openai", public), **ok}
    operation["responses"] = dict(sorted(responses.items()))
    if public:
        operation["security"] = []
    return operation


def _parameter(
    name: str, where: str, description: str, schema: dict[str, Any], example: str | None = None
) -> dict[str, Any]:
    parameter = {"name": name, "in": where, "description": description, "schema": schema}
    if example is not None:
        parameter["example"] = example
    return {**parameter, "required": True} if where == "path" else parameter


_MODEL = _parameter("model", "path", "the model's name", {"type": "string"}, "minilm")
_LLM_MODEL = _parameter(
    "model", "path", "a language model's name in the repository", {"type": "string"}, "smollm2"
)
_VERSION = _parameter("version", "path", "a version number", {"type": "string"}, "1")
_TIMEOUT = _parameter(
    "Request-Timeout",
    "header",
    "seconds from the request's first byte: past them it is answered 504 (a language model"
    " finishes with reason length)",
    {"type": "number", "exclusiveMinimum": 0},
)
_HEADER_LENGTH = _parameter(
    "Inference-Header-Content-Length",
    "header",
    "with a binary body: the length of its JSON header; the tensors' bytes follow",
    _COUNT,
)

# --- paths --------------------------------------------------------------------------------

# requests to the models of the demo repository (`make serve`)
_INFER_EXAMPLE = {
    "inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["hello world"]}]
}
_LLM = "SmolLM2-135M-Instruct"
_GENERATION_EXAMPLES = {
    "CompletionRequest": {"model": _LLM, "prompt": "The capital of France is", "max_tokens": 8},
    "ChatRequest": {
        "model": _LLM,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
    },
}
_RESPONSE_EXAMPLE = {
    "model": _LLM,
    "input": "What is the capital of France?",
    "max_output_tokens": 8,
}
_EMBEDDING_EXAMPLE = {"model": "minilm", "input": ["hello world"]}
_GENERATE_EXAMPLE = {
    "text_input": "The capital of France is",
    "parameters": {"max_tokens": 8, "temperature": 0},
}


def _model_paths(prefix: str, params: tuple[dict[str, Any], ...], at: str) -> dict[str, Any]:
    """The routes of one model, at its newest ready version or at `versions/{version}`."""
    op = partial(_operation, tag="v2", params=params)
    not_ready = _json({"anyOf": [_ref("ModelReady"), _ref("Error")]}, "Not ready, or refused")
    ready = {**_ok("ModelReady"), "503": not_ready}
    return {
        prefix: {
            "get": op(f"model_metadata{at}", "Model metadata", _ok("ModelMetadata"), (404, 503))
        },
        f"{prefix}/ready": {"get": op(f"model_ready{at}", "Model readiness", ready, (404,))},
        f"{prefix}/config": {
            "get": op(
                f"model_config{at}", "Model configuration (Triton)", _ok("ModelConfig"), (404, 503)
            )
        },
        f"{prefix}/stats": {
            "get": op(
                f"model_statistics{at}",
                "Model statistics (Triton)",
                _ok("ModelStatistics"),
                (404, 503),
            )
        },
        f"{prefix}/infer": {"post": _infer(params, at)},
        f"{prefix}/generate": {"post": _generate(params, at, stream=False)},
        f"{prefix}/generate_stream": {"post": _generate(params, at, stream=True)},
    }


def _infer(params: tuple[dict[str, Any], ...], at: str) -> dict[str, Any]:
    body = {
        "application/json": {"schema": _ref("InferRequest"), "example": _INFER_EXAMPLE},
        "application/octet-stream": {"schema": _BINARY},  # Triton's binary tensor extension
    }
    content = {
        "application/json": {"schema": _ref("InferResponse")},
        "application/octet-stream": {"schema": _BINARY},
    }
    description = (
        "The outputs; binary (with Inference-Header-Content-Length) when an output asks for"
        " binary_data"
    )
    return _operation(
        f"infer{at}",
        "Inference (KServe v2)",
        {"200": {"description": description, "content": content}},
        (400, 403, 404, 408, 413, 415, 500, 503, 504),
        tag="v2",
        params=(*params, _TIMEOUT, _HEADER_LENGTH),
        body=body,
    )


def _generate(params: tuple[dict[str, Any], ...], at: str, stream: bool) -> dict[str, Any]:
    """Triton's generate extension on a language model: the text whole, or as server-sent
    events (and, in words, on any other model)."""
    if stream:
        data = {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref("GenerateResponse"), _ref("Error")]},
        }
        event = {
            "type": "object",
            "description": "`data: {GenerateResponse}` events, each with the text new since the"
            " last (first text_input, with exclude_input_in_output false), and an Error event"
            " last if the generation fails once started; no [DONE]",
            "properties": {"data": data},
            "required": ["data"],
        }
        ok = {
            "200": {
                "description": "The generated text as server-sent events",
                "content": {"text/event-stream": {"schema": event}},
            }
        }
        operation_id, summary = f"generate_stream{at}", "Generation, streamed (Triton)"
    else:
        ok = _ok("GenerateResponse")
        operation_id, summary = f"generate{at}", "Generation (Triton)"
    body = {"application/json": {"schema": _ref("GenerateRequest"), "example": _GENERATE_EXAMPLE}}
    operation = _operation(
        operation_id,
        summary,
        ok,
        (400, 403, 404, 408, 413, 415, 429, 503, 504),
        tag="v2",
        params=(_LLM_MODEL, *params[1:], _TIMEOUT),
        body=body,
    )
    operation["description"] = _GENERATE_OTHER_MODELS
    return operation


_GENERATE_OTHER_MODELS = (
    "Described here on a language model. Any other model answers too, as Triton answers on "
    "its Python models: the body's fields named as the model's inputs are those inputs (a "
    "value or a flat list of values), the others request parameters, and each answer is "
    '`{"model_name", "model_version", <output>: value, ...}`; a decoupled model streams each '
    "of its responses as an event (docs/protocols.md, Triton's generate extension on other "
    "models)."
)


def _v2_paths() -> dict[str, Any]:
    op = partial(_operation, tag="v2")
    not_ready = _json(_ref("Ready"), "Not ready: loading, draining, or no model is")
    index = {"200": _json({"type": "array", "items": _ref("IndexEntry")})}
    paths: dict[str, Any] = {
        "/v2": {"get": op("server_metadata", "Server metadata", _ok("ServerMetadata"), (503,))},
        "/v2/health/live": {"get": op("server_live", "Liveness", _ok("Live"), public=True)},
        "/v2/health/ready": {
            "get": op("server_ready", "Readiness", {**_ok("Ready"), "503": not_ready}, public=True)
        },
        "/v2/models/stats": {
            "get": op("statistics", "Statistics of every model", _ok("ModelStatistics"), (503,))
        },
        "/v2/repository/index": {
            "post": op("repository_index", "Every model version and its state", index, (503,))
        },
    }
    for action in ("load", "unload"):
        summary = f"{action.capitalize()} a model (with --model-control-mode explicit)"
        paths[f"/v2/repository/models/{{model}}/{action}"] = {
            "post": op(
                f"repository_{action}",
                summary,
                _ok("Empty"),
                (400, 403, 404, 503),
                params=(_MODEL,),
            )
        }
    paths.update(_model_paths("/v2/models/{model}", (_MODEL,), ""))
    paths.update(_model_paths("/v2/models/{model}/versions/{version}", (_MODEL, _VERSION), "_at"))
    paths.update(_shared_memory_paths())
    paths.update(_settings_paths())
    return paths


def _settings_paths() -> dict[str, Any]:
    """Triton's logging and trace extensions: GET reads the settings, POST changes them (with
    the admin keys when they are set)."""
    op = partial(_operation, tag="v2")
    log = {"application/json": {"schema": _ref("LogSettingsRequest")}}
    trace = {"application/json": {"schema": _ref("TraceSettingsRequest")}}
    paths: dict[str, Any] = {
        "/v2/logging": {
            "get": op("log_settings", "The log settings (Triton)", _ok("LogSettings")),
            "post": op(
                "update_log_settings",
                "Change the log settings (Triton)",
                _ok("LogSettings"),
                (400, 413),
                body=log,
            ),
        }
    }
    for path, at, params, missing in (
        ("/v2/trace/setting", "", (), ()),
        ("/v2/models/{model}/trace/setting", "_of_model", (_MODEL,), (404,)),
    ):
        whose = "of a model" if params else "global"
        paths[path] = {
            "get": op(
                f"trace_settings{at}",
                f"The trace settings, {whose} (Triton)",
                _ok("TraceSettings"),
                missing,
                params=params,
            ),
            "post": op(
                f"update_trace_settings{at}",
                f"Change the trace settings, {whose} (Triton)",
                _ok("TraceSettings"),
                (400, 413, *missing),
                params=params,
                body=trace,
            ),
        }
    return paths


_REGION = _parameter("region", "path", "a shared memory region's name", {"type": "string"}, "in0")


def _shared_memory_paths() -> dict[str, Any]:
    """Triton's system shared memory extension (`protocol/shared_memory.py`)."""
    op = partial(_operation, tag="v2")
    regions = {"200": _json({"type": "array", "items": _ref("SharedMemoryRegion")})}
    register = {"application/json": {"schema": _ref("RegisterRequest")}}
    region = "/v2/systemsharedmemory/region/{region}"
    return {
        "/v2/systemsharedmemory/status": {
            "get": op("shared_memory_status", "Every registered shared memory region", regions)
        },
        f"{region}/status": {
            "get": op(
                "shared_memory_region_status", "One region", regions, (404,), params=(_REGION,)
            )
        },
        f"{region}/register": {
            "post": op(
                "shared_memory_register",
                "Register a region of a POSIX shared memory object (clients on this host)",
                _ok("Empty"),
                (400, 413, 415),
                params=(_REGION,),
                body=register,
            )
        },
        f"{region}/unregister": {
            "post": op(
                "shared_memory_unregister", "Unregister a region", _ok("Empty"), params=(_REGION,)
            )
        },
        "/v2/systemsharedmemory/unregister": {
            "post": op("shared_memory_unregister_all", "Unregister every region", _ok("Empty"))
        },
    }


def _generation(operation_id: str, summary: str, request: str, answer: str) -> dict[str, Any]:
    """/v1/completions or /v1/chat/completions: JSON, or server-sent events with stream."""
    # each event, as a JSON object (OpenAPI 3.2 names this schema itemSchema)
    chunk = {"anyOf": [_ref(f"{answer}Chunk"), _ref("OpenAIError")]}
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": chunk}
    event = {
        "type": "object",
        "description": f"`data: {{{answer}Chunk}}` events, an OpenAIError event if the"
        " generation fails once started, then `data: [DONE]`",
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, data]}},
        "required": ["data"],
    }
    events = {"schema": event}
    ok = {
        "200": {
            "description": f"The {summary.lower()}, or with stream: true its server-sent events",
            "content": {"application/json": {"schema": _ref(answer)}, "text/event-stream": events},
        }
    }
    example = _GENERATION_EXAMPLES[request]
    streamed = {**example, "stream": True, "stream_options": {"include_usage": True}}
    examples = {"whole": {"value": example}, "streamed": {"value": streamed}}
    body = {"application/json": {"schema": _ref(request), "examples": examples}}
    errors = (400, 403, 404, 408, 413, 415, 429, 503, 504)
    operation = _operation(
        operation_id, summary, ok, errors, tag="openai", params=(_TIMEOUT,), body=body
    )
    return {"post": operation}


def _responses_paths() -> dict[str, Any]:
    """/v1/responses: a response whole, or its named server-sent events; and the stored ones."""
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": _ref("ResponseStreamEvent"),
    }
    event = {
        "type": "object",
        "description": "`event: <type>` and `data: {ResponseStreamEvent}`, numbered by "
        "sequence_number: response.created, response.in_progress, the items' events, then "
        "response.completed or response.incomplete (an error once started: an error event "
        "and response.failed)",
        "properties": {"event": {"type": "string"}, "data": data},
        "required": ["data"],
    }
    ok = {
        "200": {
            "description": "The response, or with stream: true its server-sent events",
            "content": {
                "application/json": {"schema": _ref("ResponseObject")},
                "text/event-stream": {"schema": event},
            },
        }
    }
    streamed = {**_RESPONSE_EXAMPLE, "stream": True}
    examples = {"whole": {"value": _RESPONSE_EXAMPLE}, "streamed": {"value": streamed}}
    body = {"application/json": {"schema": _ref("ResponsesRequest"), "examples": examples}}
    errors = (400, 403, 404, 408, 413, 415, 429, 503, 504)
    create = _operation(
        "responses",
        "A response (the OpenAI Responses API), stored unless store is false",
        ok,
        errors,
        tag="openai",
        params=(_TIMEOUT,),
        body=body,
    )
    rid = _parameter("id", "path", "a stored response's id", {"type": "string"}, "resp_0")
    stored = {
        "get": _operation(
            "response",
            "A stored response",
            _ok("ResponseObject"),
            (404,),
            tag="openai",
            params=(rid,),
        ),
        "delete": _operation(
            "delete_response",
            "Delete a stored response",
            _ok("ResponseDeleted"),
            (404,),
            tag="openai",
            params=(rid,),
        ),
    }
    page = (
        rid,
        _parameter("after", "query", "an item's id: the items after it", {"type": "string"}),
        _parameter("before", "query", "an item's id: the items before it", {"type": "string"}),
        _parameter(
            "limit",
            "query",
            "items at most (default 20)",
            {"type": "integer", "minimum": 1, "maximum": rs.MAX_PAGE},
        ),
        _parameter(
            "order",
            "query",
            "desc (the default): the latest first; asc: the conversation's order",
            {"type": "string", "enum": ["asc", "desc"]},
        ),
        _parameter(
            "include",
            "query",
            "the API's includables: accepted, nothing to add",
            {"type": "array", "items": {"type": "string", "enum": sorted(rs.INCLUDABLE)}},
        ),
    )
    items = _operation(
        "response_input_items",
        "The input items of a stored response, a page at a time",
        _ok("InputItemList"),
        (400, 404),
        tag="openai",
        params=page,
    )
    cancel = _operation(
        "cancel_response",
        "Cancel a response: refused (400) for every stored one, as OpenAI refuses a response "
        "not made with background, the only kind lockgate makes",
        {},
        (400, 404),
        tag="openai",
        params=(rid,),
    )
    return {
        "/v1/responses": {"post": create},
        "/v1/responses/{id}": stored,
        "/v1/responses/{id}/input_items": {"get": items},
        "/v1/responses/{id}/cancel": {"post": cancel},
    }


def _openai_paths() -> dict[str, Any]:
    embeddings = _operation(
        "embeddings",
        "Embeddings, from a model with one BYTES input and an FP32 output",
        _ok("EmbeddingList"),
        (400, 404, 408, 413, 415, 500, 503, 504),
        tag="openai",
        body={
            "application/json": {"schema": _ref("EmbeddingRequest"), "example": _EMBEDDING_EXAMPLE}
        },
    )
    return {
        "/v1/models": {
            "get": _operation(
                "models", "Language and embedding models", _ok("ModelList"), (503,), tag="openai"
            )
        },
        "/v1/completions": _generation(
            "completions", "Completion", "CompletionRequest", "Completion"
        ),
        "/v1/chat/completions": _generation(
            "chat_completions", "Chat completion", "ChatRequest", "ChatCompletion"
        ),
        "/v1/embeddings": {"post": embeddings},
        **_responses_paths(),
        **{
            f"/{name}": {
                "post": _operation(
                    name,
                    summary,
                    _ok(f"{name.capitalize()}Response"),
                    (400, 404, 408, 413, 415, 503),
                    tag="openai",
                    body={"application/json": {"schema": _ref(f"{name.capitalize()}Request")}},
                )
            }
            for name, summary in (
                ("tokenize", "A prompt's or chat messages' token ids (vLLM)"),
                ("detokenize", "Token ids back to text (vLLM)"),
            )
        },
    }


def _predict_paths() -> dict[str, Any]:
    def predict(at: str) -> dict[str, Any]:
        params = (_MODEL, _VERSION) if at else (_MODEL,)
        summary = "Predict (KServe v1, TensorFlow Serving)" + (" at a version" if at else "")
        body = {"application/json": {"schema": _ref("PredictRequest")}}
        errors = (400, 404, 408, 413, 415, 429, 500, 503, 504)
        ok = _ok("PredictAnswer")
        return {
            "post": _operation(
                f"predict{at}", summary, ok, errors, tag="v1", params=(*params, _TIMEOUT), body=body
            )
        }

    return {
        "/v1/models/{model}:predict": predict(""),
        "/v1/models/{model}/versions/{version}:predict": predict("_at"),
    }


def _server_paths() -> dict[str, Any]:
    op = partial(_operation, tag="server")
    text = {"schema": {"type": "string"}}
    formats = {"text/plain": text, "application/openmetrics-text": text}
    metrics = {
        "200": {
            "description": "The Prometheus text format 0.0.4, or OpenMetrics when the Accept"
            " header asks for application/openmetrics-text",
            "content": formats,
        }
    }
    redirect = {"302": {"description": "To /dashboard", "headers": {"Location": {"schema": {}}}}}
    return {
        "/health": {"get": op("live", "Liveness (as /v2/health/live)", _ok("Live"), public=True)},
        # a key is asked for the metrics unless the server runs with --metrics-public
        "/metrics": {"get": op("metrics", "Prometheus metrics", metrics)},
        "/dashboard": {
            "get": op(
                "dashboard", "Live dashboard", _text("text/html", "The page"), (503,), public=True
            )
        },
        "/": {"get": op("root", "Redirect to the dashboard", redirect, (503,), public=True)},
        "/version": {"get": op("version", "lockgate's version", _ok("Version"), (503,))},
        "/openapi.json": {
            "get": op(
                "openapi", "This document", {"200": _json({"type": "object"})}, (503,), public=True
            )
        },
    }


@cache
def openapi_document() -> dict[str, Any]:
    """The whole document: every path, its answers and errors, and the schemas."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "lockgate",
            "version": __version__,
            "description": "KServe v2 with Triton's extensions, the OpenAI API, metrics and a"
            " dashboard. Errors are {'error': '...'}; on /v1, OpenAI's error object.",
        },
        "tags": [
            {"name": "v2", "description": "KServe v2 (Open Inference Protocol) and Triton's"},
            {"name": "v1", "description": "KServe v1 and TensorFlow Serving's predict"},
            {"name": "openai", "description": "The OpenAI API"},
            {"name": "server", "description": "Health, metrics, dashboard"},
        ],
        "paths": {**_v2_paths(), **_predict_paths(), **_openai_paths(), **_server_paths()},
        "components": {
            "schemas": schema_components(),
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"apiKey": []}, {}],  # a key only on a server started with keys
    }
