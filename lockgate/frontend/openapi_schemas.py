"""The shapes of lockgate's JSON answers, as msgspec Structs: the response schemas of the
OpenAPI document (`frontend/openapi.py`).

The encoders build these answers as plain data (`protocol/v2_metadata.py`,
`protocol/v2_codec.py`, `protocol/openai.py`, `protocol/generate.py`); the fuzz test
(`tests/frontend/test_openapi_fuzz.py`) holds every answer of a live server to these shapes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from lockgate.protocol.v2_metadata import Duration

# --- errors -------------------------------------------------------------------------------


class Error(msgspec.Struct):
    """A KServe v2 error; also any refusal made before a request reaches its route (503)."""

    error: str


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str  # the error kind: invalid_request, not_found, unavailable, ...
    code: int  # the HTTP status
    param: str | None = None


class OpenAIError(msgspec.Struct):
    """An error on /v1, in the OpenAI API's shape."""

    error: OpenAIErrorDetail


# --- KServe v2 and Triton's extensions ----------------------------------------------------


class Live(msgspec.Struct):
    live: bool


class Ready(msgspec.Struct):
    """Readiness; `error` says why not."""

    ready: bool
    error: str = ""


class ServerMetadata(msgspec.Struct):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(msgspec.Struct):
    name: str
    datatype: str
    shape: list[int]  # -1 for the batch dimension of a batching model


class ModelMetadata(msgspec.Struct):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ModelReady(msgspec.Struct):
    """A model version's readiness; `error` says why not."""

    name: str
    ready: bool
    error: str = ""


class ConfigTensor(msgspec.Struct):
    name: str
    data_type: str  # TYPE_FP32, TYPE_STRING (BYTES), ...
    dims: list[int]


class ModelConfig(msgspec.Struct):
    """The model's configuration in the JSON form of Triton's model_config.proto."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    input: list[ConfigTensor]
    output: list[ConfigTensor]
    version_policy: dict[str, Any]
    instance_group: list[dict[str, Any]]
    parameters: dict[str, dict[str, str]]
    model_warmup: list[dict[str, Any]]
    dynamic_batching: dict[str, Any] = {}


class InferenceStats(msgspec.Struct):
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration
    cache_hit: Duration
    cache_miss: Duration


class BatchStats(msgspec.Struct):
    batch_size: int
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


class ModelStats(msgspec.Struct):
    name: str
    version: str
    last_inference: int  # ms since the epoch
    inference_count: int  # rows inferred
    execution_count: int  # model executions (batches)
    inference_stats: InferenceStats
    batch_stats: list[BatchStats]


class ModelStatistics(msgspec.Struct):
    """Triton's statistics extension."""

    model_stats: list[ModelStats]


class InferOutput(msgspec.Struct):
    """An output tensor: `data` in JSON, or `parameters.binary_data_size` bytes of the
    binary tail."""

    name: str
    datatype: str
    shape: list[int]
    data: list[Any] = []
    parameters: dict[str, Any] = {}


class InferResponse(msgspec.Struct):
    model_name: str
    model_version: str
    outputs: list[InferOutput]
    id: str = ""
    parameters: dict[str, Any] = {}  # cache_hit, or the fallback that answered


class Empty(msgspec.Struct):
    pass


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class Version(msgspec.Struct):
    version: str


class SharedMemoryRegion(msgspec.Struct):
    """A registered system shared memory region."""

    name: str
    key: str
    offset: int
    byte_size: int


_VERBOSE = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
_LOG_FORMAT = Literal["default", "ISO8601"]


class LogSettings(msgspec.Struct):
    """Triton's log settings (`protocol/log_settings.py`)."""

    log_file: Annotated[str, msgspec.Meta(description='"": standard error')]
    log_info: bool
    log_warning: bool
    log_error: bool
    log_verbose_level: Annotated[_VERBOSE, msgspec.Meta(description="above 0: DEBUG records")]
    log_format: _LOG_FORMAT


class LogSettingsRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The log settings to change; null or absent: left as they are. log_file is refused."""

    log_info: bool | None = None
    log_warning: bool | None = None
    log_error: bool | None = None
    log_verbose_level: _VERBOSE | None = None
    log_format: _LOG_FORMAT | None = None
    log_file: Annotated[None, msgspec.Meta(description="refused (400) when given a value")] = None


class TraceSettings(msgspec.Struct):
    """Triton's trace settings (`protocol/trace_settings.py`), of the server or of a model."""

    trace_level: list[Literal["OFF", "TIMESTAMPS"]]
    trace_rate: Annotated[str, msgspec.Meta(description="one request traced in every N")]
    trace_count: Annotated[str, msgspec.Meta(description="traces left; -1: no limit")]
    trace_mode: Literal["opentelemetry"]


class TraceSettingsRequest(msgspec.Struct, forbid_unknown_fields=True):
    """The trace settings to change; null: clear it (a model's then follows the global one,
    a global one returns to its start-up value). TENSORS, trace_file and a log_frequency
    are refused (400); so is TIMESTAMPS on a server with no --otel-endpoint."""

    trace_level: list[Literal["OFF", "TIMESTAMPS", "TENSORS"]] | None = None
    trace_rate: Annotated[str, msgspec.Meta(description="an integer, 1 to 2^32 - 1")] | None = None
    trace_count: Annotated[str, msgspec.Meta(description="an integer, -1 to 2^31 - 1")] | None = (
        None
    )
    log_frequency: None = None
    trace_file: None = None


class GenerateResponse(msgspec.Struct):
    """The answer of Triton's /generate, and each event of /generate_stream (whose
    `text_output` is the text new since the last event)."""

    model_name: str
    model_version: str
    text_output: str


# --- OpenAI API ---------------------------------------------------------------------------


class ModelPermission(msgspec.Struct):
    """vLLM's one default permission entry of a model card."""

    id: str
    object: Literal["model_permission"]
    created: int
    allow_create_engine: bool
    allow_sampling: bool
    allow_logprobs: bool
    allow_search_indices: bool
    allow_view: bool
    allow_fine_tuning: bool
    organization: str
    group: str | None
    is_blocking: bool


class ModelCard(msgspec.Struct):
    """vLLM's model card: `root` is the repository model it is served from, `parent` null
    (no adapters), `max_model_len` the context (null for an embedding model)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None
    permission: list[ModelPermission]


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(msgspec.Struct):
    """One server-sent event of a streamed completion; the last (with stream_options.
    include_usage) has no choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text


class AssistantToolCall(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None  # None: only tool calls
    tool_calls: list[AssistantToolCall] | None = None


class ToolCallDelta(msgspec.Struct):
    """A tool call of a streamed chat completion, sent whole when it closes."""

    index: int  # of the call in the choice's message
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct):
    content: str | None = None  # absent in a chunk of tool calls only
    role: Literal["assistant"] | None = None  # in the first chunk only
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    """One server-sent event of a streamed chat completion; the last (with stream_options.
    include_usage) has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Embedding(msgspec.Struct):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# --- the Responses API ------------------------------------------------------------------------


class ResponseUsageInput(msgspec.Struct):
    cached_tokens: int


class ResponseUsageOutput(msgspec.Struct):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: ResponseUsageInput
    output_tokens: int
    output_tokens_details: ResponseUsageOutput
    total_tokens: int


class OutputText(msgspec.Struct):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(msgspec.Struct, tag_field="type", tag="message"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(msgspec.Struct, tag_field="type", tag="function_call"):
    id: str
    status: Literal["in_progress", "completed"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text (empty while in progress)


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct):
    """A response of /v1/responses, with the request's settings echoed."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: ResponseError | None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"]


class ResponseStreamEvent(msgspec.Struct):
    """One event of a streamed response: `type` names it (as the SSE `event:` field does);
    the lifecycle events carry the response, the others an item, a part or a delta."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item_id: str | None = None
    content_index: int | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    message: str | None = None  # of an error event


class ResponseDeleted(msgspec.Struct):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ItemText(msgspec.Struct):
    type: Literal["input_text", "output_text"]
    text: str


class ItemMessage(msgspec.Struct, tag_field="type", tag="message"):
    """A message among a response's input items: the input's, or an output's before it."""

    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["user", "system", "developer", "assistant"]
    content: list[ItemText]


class ItemFunctionCallOutput(msgspec.Struct, tag_field="type", tag="function_call_output"):
    id: str
    status: Literal["completed"]
    call_id: str
    output: str | list[ItemText]  # text parts, as input_text


class InputItemList(msgspec.Struct):
    """A page of a stored response's input items (GET /v1/responses/{id}/input_items)."""

    object: Literal["list"]
    data: list[ItemMessage | OutputFunctionCall | ItemFunctionCallOutput]
    first_id: str | None
    last_id: str | None
    has_more: bool


# --- KServe v1 / TensorFlow Serving predict --------------------------------------------------


class PredictAnswer(msgspec.Struct, omit_defaults=True):
    """A predict answer: `predictions` (one item per row) for `instances`, `outputs` (the
    columns) for `inputs`."""

    predictions: list[Any] | None = None
    outputs: Any = None
