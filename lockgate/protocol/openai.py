"""OpenAI API wire format: request schemas (msgspec), the limits on what a request may ask
for, and response and stream-chunk builders.

Unknown request fields are ignored, as OpenAI does; fields of the wrong type are a 400.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import msgspec

from lockgate.errors import BadRequest
from lockgate.protocol.json_arrays import count_scalars, opening_depth, strings_at_least

# The version of the model a request to /v1/completions, /v1/chat/completions or
# /v1/embeddings is served at (a positive whole number; without it, the newest ready version).
# The router sets it for a version canary; a client may set it to pin a version.
MODEL_VERSION_HEADER = b"x-lockgate-model-version"
TOKEN_PATHS = frozenset({"/tokenize", "/detokenize"})  # vLLM's, beside /v1


def openai_path(path: str) -> bool:
    """Whether a path is the OpenAI API's (or vLLM's beside it), whose errors have its shape:
    {"error": {"message", "type", "param", "code"}}; not KServe v1's predict beside it
    (`/v1/models/{m}:predict`), whose errors are {"error": "..."}."""
    return (path.startswith("/v1/") and not path.endswith(":predict")) or path in TOKEN_PATHS


@dataclass(frozen=True, slots=True)
class OpenAILimits:
    """The OpenAI API's bounds on costly requests: what one request may ask for, checked
    before the work it would cost, and how many prompts are tokenized at once. Every field is
    the `lockgate serve` flag of its name (`max_stop` is `--max-stop`)."""

    max_stop: int = 4  # stop strings, as the OpenAI API allows
    max_stop_chars: int = 256  # characters of one stop string
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300  # entries of logit_bias, as the OpenAI API allows
    max_bad_words: int = 64  # vLLM's bad_words of one request, each of at most max_stop_chars
    max_request_id_chars: int = 128  # vLLM's request_id, which every chunk's id carries
    max_cache_salt_chars: int = 256  # vLLM's cache_salt
    max_prompt_chars: int = 0  # 0: only the context's (max_model_len x longest token's chars)
    tokenize_threads: int = 2  # prompts tokenized at once, off the event loop
    tokenize_waiting: int = 64  # prompts waiting for a tokenizer thread; past it, 503
    max_embedding_inputs: int = 2048  # texts of one embeddings request, as the OpenAI API allows
    max_embedding_chars: int = 65536  # characters of one text to embed
    max_n: int = 16  # choices (n) and candidates (best_of) of one completion
    max_prompts: int = 64  # prompts of one /v1/completions request (a batch)
    max_grammar_chars: int = 8192  # of a request's JSON schema, regex or grammar; 0: refused
    max_grammar_mask_ms: int = 20  # CPU ms of one token mask of a grammar; past it, it ends
    max_tools: int = 128  # function tools of one chat request, as the OpenAI API allows
    max_tool_chars: int = 16384  # of a request's tools, as JSON; 0: tools refused
    max_payload_bytes: int = 8 * 2**20  # of one request's body (language-model routes)

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            least = 1 if field.name in _AT_LEAST_ONE else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                flag = "--" + field.name.replace("_", "-")
                raise ValueError(f"{flag} must be an integer of at least {least}, got {value!r}")

    def stop_strings(self, stop: str | list[str] | None) -> list[str]:
        """The request's `stop` as a list, within the limits."""
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        if len(strings) > self.max_stop or any(len(s) > self.max_stop_chars for s in strings):
            raise BadRequest(
                f"stop takes at most {self.max_stop} strings of at most "
                f"{self.max_stop_chars} characters",
                param="stop",
            )
        return strings

    def logit_bias(self, raw: msgspec.Raw) -> dict[str, float]:
        """The request's logit_bias ({"token id": bias}), its entries counted from the raw
        bytes first: each has a colon of its own, so more colons than `max_logit_bias`
        cannot be a logit_bias it takes (a million entries were built before they were
        counted)."""
        data = bytes(raw)
        if data.count(b":") > self.max_logit_bias:
            raise BadRequest(f"logit_bias takes at most {self.max_logit_bias} entries")
        if not data:
            return {}
        try:
            return _BIAS.decode(data) or {}
        except msgspec.ValidationError as exc:
            where = str(exc).replace("`$", "`$.logit_bias")
            raise BadRequest(f"invalid request: {where}") from None

    def bad_words(self, words: list[str] | None) -> list[str]:
        """vLLM's bad_words, within the limits: at most `max_bad_words`, each of at most
        `max_stop_chars` characters, none empty or blank."""
        words = words or []
        if len(words) > self.max_bad_words:
            raise BadRequest(
                f"bad_words takes at most {self.max_bad_words} words", param="bad_words"
            )
        for word in words:
            if not word.strip() or len(word) > self.max_stop_chars:
                raise BadRequest(
                    f"bad_words: {word[:40]!r} must be a word of 1 to {self.max_stop_chars} "
                    "characters, not blank",
                    param="bad_words",
                )
        return words

    def response_id(self, prefix: str, request_id: str | None) -> str | None:
        """The id of a response to a request that set vLLM's request_id (`prefix`-request_id,
        as vLLM's), within `max_request_id_chars`; None for one that did not."""
        if request_id is None:
            return None
        if not 0 < len(request_id) <= self.max_request_id_chars or not request_id.isprintable():
            raise BadRequest(
                f"request_id must be 1 to {self.max_request_id_chars} printable characters",
                param="request_id",
            )
        return f"{prefix}-{request_id}"

    def cache_salt(self, salt: str | None) -> str | None:
        """vLLM's cache_salt, checked: 1 to `max_cache_salt_chars` characters."""
        if salt is not None and not 0 < len(salt) <= self.max_cache_salt_chars:
            raise BadRequest(
                f"cache_salt must be a string of 1 to {self.max_cache_salt_chars} characters",
                param="cache_salt",
            )
        return salt

    def check_stop_token_ids(self, ids: list[int] | None, vocab_size: int) -> None:
        """At most `max_stop_token_ids` ids, each a token of the model's vocabulary."""
        if len(ids or ()) > self.max_stop_token_ids:
            raise BadRequest(f"stop_token_ids takes at most {self.max_stop_token_ids} token ids")
        bad = [t for t in ids or () if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(
                f"stop_token_ids: {bad[0]} is not a token id of the model (0..{vocab_size - 1})"
            )

    def check_constraint(self, constraint: OutputConstraint) -> None:
        """A JSON schema, regex or grammar no longer than `max_grammar_chars` (it is compiled
        before the request is admitted: its size bounds that work)."""
        most = self.max_grammar_chars
        if not most:
            raise BadRequest(f"{constraint.field}: guided decoding is turned off on this server")
        if len(constraint.source) > most:
            raise BadRequest(
                f"{constraint.field} has {len(constraint.source)} characters, more than the "
                f"limit of {most}"
            )

    def check_tools(self, tools: list[ToolDefinition]) -> None:
        """At most `max_tools` tools of at most `max_tool_chars` characters in all, as JSON
        (their schemas are compiled before the request is admitted: their size bounds that
        work, and the prompt they take)."""
        if not self.max_tool_chars:
            raise BadRequest("tools: tool calling is turned off on this server")
        if len(tools) > self.max_tools:
            raise BadRequest(
                f"tools has {len(tools)} tools, more than the limit of {self.max_tools}"
            )
        chars = len(tools_json(tools))
        if chars > self.max_tool_chars:
            raise BadRequest(
                f"tools has {chars} characters as JSON, more than the limit of "
                f"{self.max_tool_chars}"
            )

    def sequences(self, n: int, best_of: int | None, stream: bool) -> int:
        """The sequences a completion of `n` choices generates: `best_of` (at least n, not
        streamed), else n; both at most `max_n`."""
        if not 1 <= n <= self.max_n:
            raise BadRequest(f"n must be between 1 and {self.max_n}, got {n}", param="n")
        if best_of is None:
            return n
        if not n <= best_of <= self.max_n:
            raise BadRequest(
                f"best_of must be between n ({n}) and {self.max_n}, got {best_of}", param="best_of"
            )
        if stream and best_of > n:
            raise BadRequest("best_of cannot be used with stream: leave it out, or set it to n")
        return best_of


_AT_LEAST_ONE = frozenset(
    {
        "max_stop_chars",
        "max_request_id_chars",
        "max_cache_salt_chars",
        "tokenize_threads",
        "max_embedding_inputs",
        "max_embedding_chars",
        "max_n",
        "max_prompts",
        "max_tools",
        "max_payload_bytes",
    }
)


class StreamOptions(msgspec.Struct):
    # a last chunk with no choices and the request's usage (true unless set false, as vLLM's)
    include_usage: bool = True
    # vLLM's: with include_usage, each chunk also carries its choice's usage so far
    continuous_usage_stats: bool = False

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class _Sampling(msgspec.Struct, kw_only=True):
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's: no stop before this many output tokens
    repetition_penalty: float | None = None  # vLLM's: over the prompt's and output's tokens
    # vLLM's: only the prompt's last this many tokens are kept (-1: as many as the context has)
    truncate_prompt_tokens: int | None = None
    priority: int = 0  # 1 is the highest; 0: the model's default (as lockgate's v2 priority)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # token id (as a string) -> bias, kept raw until counted (`OpenAILimits.logit_bias`)
    logit_bias: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    response_format: ResponseFormat | None = None
    # vLLM's guided decoding: a JSON schema (an object or its JSON text), a regular
    # expression (Rust's regex syntax), a Lark grammar (llguidance's syntax)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None  # the output is exactly one of these strings
    structured_outputs: StructuredOutputs | None = None  # vLLM's newer spelling of guided_*
    include_stop_str_in_output: bool = False  # vLLM's: a stop string ends the text, kept
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text
    # vLLM's: the only tokens the output may take; words (strings) the output never ends with
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: each prompt token's logprob, rank and this many most likely tokens at it
    prompt_logprobs: int | None = None
    # vLLM's: the response's id is the route's prefix and this (the engine's stays its own)
    request_id: str | None = None
    # vLLM's: special tokens (BOS) added to a text prompt (None: the route's default)
    add_special_tokens: bool | None = None
    # vLLM's: the prefix cache is shared only among requests of the same salt
    cache_salt: str | None = None
    # known to the OpenAI API, not implemented by lockgate (or not on this route): refused
    # by name when given (`unsupported_fields`)
    best_of: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    suffix: Any = None
    parallel_tool_calls: Any = None
    # vLLM's sampling and prompt extensions lockgate does not implement: refused by name, so
    # a request that counts on one is not answered as if it had been applied
    length_penalty: Any = None
    use_beam_search: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    logits_processors: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    unsupported_fields: ClassVar[tuple[str, ...]] = ()
    unsupported_everywhere: ClassVar[tuple[str, ...]] = (
        "length_penalty",
        "use_beam_search",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "structural_tag",
        "logits_processors",
        "spaces_between_special_tokens",
        "return_tokens_as_token_ids",
        "return_token_ids",
        "kv_transfer_params",
        "vllm_xargs",
    )

    def unsupported(self) -> str | None:
        """The first field given that lockgate does not implement on this route, if any.
        (`length_penalty: 1`, `use_beam_search: false` and their like, the values that change
        nothing, are let through.)"""
        for name in (*self.unsupported_fields, *self.unsupported_everywhere):
            value = getattr(self, name)
            if value is None or value == _NO_EFFECT.get(name, object()):
                continue
            return name
        return None

    def check_options(self) -> None:
        """Options that mean nothing without another (400, as vLLM and OpenAI answer)."""
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options can only be given with stream: true")

    def output_constraint(self, limits: OpenAILimits) -> OutputConstraint | None:
        """What the request holds its output to, if anything: at most one of
        `response_format` (json_object or json_schema) and vLLM's `guided_*` fields, within
        `max_grammar_chars`."""
        given = self._constraints()
        if len(given) > 1:
            names = ", ".join(_constraint_name(c.field) for c in given)
            raise BadRequest(
                "give one of response_format (json_object or json_schema), guided_json, "
                "guided_regex, guided_grammar, guided_choice and structured_outputs (one of "
                f"its keys), not several: {names}"
            )
        if not given:
            return None
        limits.check_constraint(given[0])
        return given[0]

    def _constraints(self) -> list[OutputConstraint]:
        found = []
        form = self.response_format
        if isinstance(form, JsonObjectFormat):
            found.append(OutputConstraint("response_format", "json_schema", _ANY_OBJECT, False))
        elif isinstance(form, JsonSchemaFormat):
            spec = form.json_schema
            where = "response_format.json_schema.schema"
            text = _json_text(spec.schema)
            found.append(OutputConstraint(where, "json_schema", text, spec.strict is True))
        if self.guided_json is not None:
            given = self.guided_json
            text = given if isinstance(given, str) else _json_text(given)
            found.append(OutputConstraint("guided_json", "json_schema", text, False))
        if self.guided_regex is not None:
            found.append(OutputConstraint("guided_regex", "regex", self.guided_regex))
        if self.guided_grammar is not None:
            found.append(OutputConstraint("guided_grammar", "lark", self.guided_grammar))
        if self.guided_choice is not None:
            found.append(OutputConstraint("guided_choice", "regex", _choices(self.guided_choice)))
        if self.structured_outputs is not None:
            found += self.structured_outputs.constraints()
        return found


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's structured_outputs: what guided_json, guided_regex, guided_choice,
    guided_grammar and response_format json_object ask, under other names. Its other keys
    (structural_tag, backend and whitespace options) are refused by name."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's syntax), as guided_grammar
    json_object: bool | None = None

    def constraints(self) -> list[OutputConstraint]:
        found = []
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json_text(self.json)
            found.append(OutputConstraint("structured_outputs.json", "json_schema", text, False))
        if self.regex is not None:
            found.append(OutputConstraint("structured_outputs.regex", "regex", self.regex))
        if self.choice is not None:
            found.append(
                OutputConstraint(
                    "structured_outputs.choice",
                    "regex",
                    _choices(self.choice, "structured_outputs.choice"),
                )
            )
        if self.grammar is not None:
            found.append(OutputConstraint("structured_outputs.grammar", "lark", self.grammar))
        if self.json_object:
            field = "structured_outputs.json_object"
            found.append(OutputConstraint(field, "json_schema", _ANY_OBJECT, False))
        return found


# values of the refused vLLM fields that change nothing, and so are let through
_NO_EFFECT: dict[str, Any] = {
    "length_penalty": 1,
    "use_beam_search": False,
    "spaces_between_special_tokens": True,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "modalities": ["text"],
    "add_special_tokens": False,  # on chat, the template adds them
    "include_reasoning": True,  # a model without a reasoning parser: all of it is content
}
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _constraint_name(field: str) -> str:
    """The request field a constraint came from (structured_outputs: with its key)."""
    return field if field.startswith("structured_outputs.") else field.partition(".")[0]


def _choices(choices: list[str], field: str = "guided_choice") -> str:
    """guided_choice as a regular expression: one of the strings, whole."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise BadRequest(f"{field} must be a list of non-empty strings")
    escaped = ("".join("\\" + ch if ch in _REGEX_META else ch for ch in c) for c in choices)
    return "(" + "|".join(escaped) + ")"


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """What a request holds its output to (guided decoding), as the request gave it."""

    field: str  # the request field it came from, named in errors
    kind: Literal["json_schema", "regex", "lark"]
    source: str  # a JSON schema as JSON text, a regular expression or a Lark grammar
    strict: bool = True  # a JSON schema's keywords that cannot be enforced: refused (else ignored)


class TextFormat(msgspec.Struct, tag_field="type", tag="text"):
    """response_format {"type": "text"}: no constraint."""


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object"):
    """response_format {"type": "json_object"}: the output is a JSON object."""


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    name: str
    schema: dict[str, Any]  # the JSON schema the output matches
    description: str | None = None
    strict: bool | None = None  # true: keywords lockgate cannot enforce are refused (400)


class JsonSchemaFormat(msgspec.Struct, tag_field="type", tag="json_schema"):
    """response_format {"type": "json_schema", "json_schema": {...}}: the output matches it."""

    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat
_ANY_OBJECT = '{"type":"object"}'


def _json_text(schema: dict[str, Any]) -> str:
    """A JSON schema given as an object, as JSON text (its keys in the order given)."""
    return msgspec.json.encode(schema).decode()


class CompletionRequest(_Sampling, kw_only=True):
    prompt: msgspec.Raw  # a string, token ids, or a list of either: see `prompts_of`
    best_of: int | None = None  # candidates generated; the n of highest cumulative logprob win
    logprobs: int | None = None
    echo: bool = False
    prompt_embeds: Any = None  # vLLM's: embeddings in place of the prompt's tokens: refused

    @property
    def prompt_only(self) -> bool:
        """`echo` with max_tokens 0: the prompt answered alone (one token computed, dropped)."""
        return self.echo and self.max_tokens == 0

    @property
    def prompt_top(self) -> int | None:
        """The most likely tokens to compute at each prompt token: `echo`'s logprobs or
        `prompt_logprobs`, the larger (None: no prompt logprobs)."""
        asked = [
            n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None
        ]
        return max(asked) if asked else None

    unsupported_fields: ClassVar[tuple[str, ...]] = (
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "suffix",
        "parallel_tool_calls",
        "prompt_embeds",
    )


# -- tools -------------------------------------------------------------------------------------


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A function the model may call: its arguments are a JSON object matching `parameters`."""

    name: str  # ^[a-zA-Z0-9_-]{1,64}$
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: no arguments
    strict: bool | None = None  # true: schema keywords lockgate cannot enforce are refused


class ToolDefinition(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """tool_choice {"type": "function", "function": {"name": ...}}: call that function."""

    type: Literal["function"]
    function: FunctionName


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct, kw_only=True):
    """A call the model made, in an assistant message of the history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class ToolUse:
    """The tools a chat request offers the model, checked, and how it may call them."""

    tools: tuple[FunctionDefinition, ...]
    choice: Literal["auto", "required", "function"]  # function: the one named `function`
    parallel: bool  # more than one call in an answer
    function: str | None = None  # the function to call, with choice "function"

    @property
    def forced(self) -> bool:
        """The answer is a tool call: its output is held to the calls' grammar."""
        return self.choice != "auto"

    @property
    def callable(self) -> tuple[FunctionDefinition, ...]:
        """The functions the answer may call: the one named, else all."""
        if self.function is None:
            return self.tools
        return tuple(f for f in self.tools if f.name == self.function)

    @property
    def most_calls(self) -> int | None:
        """The calls one answer may make (None: any number)."""
        return None if self.parallel and self.function is None else 1

    @property
    def choice_text(self) -> str:
        """tool_choice as the request gave it, for messages."""
        return f"function {self.function!r}" if self.function else repr(self.choice)

    def definitions(self) -> list[dict[str, Any]]:
        """The tools as the OpenAI API gives them ({"type": "function", "function": ...}),
        for a chat template or a system prompt."""
        return [{"type": "function", "function": _function_dict(f)} for f in self.tools]


def _function_dict(function: FunctionDefinition) -> dict[str, Any]:
    found: dict[str, Any] = {"name": function.name}
    if function.description is not None:
        found["description"] = function.description
    found["parameters"] = parameters_of(function)
    return found


def parameters_of(function: FunctionDefinition) -> dict[str, Any]:
    """A function's parameters schema (no parameters: an empty object)."""
    return NO_ARGUMENTS if function.parameters is None else function.parameters


def tools_json(tools: list[ToolDefinition]) -> bytes:
    return msgspec.json.encode(tools)


def _check_tool(index: int, tool: ToolDefinition, seen: set[str]) -> None:
    where = f"tools[{index}].function"
    name = tool.function.name
    if not TOOL_NAME.fullmatch(name):
        raise BadRequest(
            f"{where}.name {name[:80]!r} must be 1 to 64 letters, digits, underscores or dashes"
        )
    if name in seen:
        raise BadRequest(f"{where}.name {name!r} is given twice: function names must be unique")
    seen.add(name)
    parameters = tool.function.parameters
    if parameters is not None and parameters.get("type", "object") != "object":
        raise BadRequest(
            f"{where}.parameters must be the JSON schema of an object (the arguments), "
            f"not of type {parameters.get('type')!r}"
        )


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true
    # vLLM's: how the messages are rendered. None: the assistant's turn is opened, unless
    # the final message is continued (the prompt ends inside it, for the model to go on)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    # vLLM's: documents for retrieval-augmented generation, the template's `documents`
    documents: list[dict[str, str]] | None = None
    echo: bool = False  # vLLM's: the final message's content begins the answer's (`echoed`)
    chat_template: Any = None  # a client's own template: refused
    mm_processor_kwargs: Any = None  # vLLM's, for multimodal processors: refused
    reasoning_effort: Any = None  # OpenAI's, for reasoning models: refused
    include_reasoning: Any = None  # vLLM's, with a reasoning parser: false refused
    # OpenAI's audio output: a text model answers text only (modalities ["text"] passes)
    audio: Any = None
    modalities: Any = None
    unsupported_fields: ClassVar[tuple[str, ...]] = (
        "best_of",
        "functions",
        "function_call",
        "suffix",
        "chat_template",
        "audio",
        "modalities",
        "add_special_tokens",
        "mm_processor_kwargs",
        "reasoning_effort",
        "include_reasoning",
    )

    @property
    def generation_prompt(self) -> bool:
        return generation_prompt(self.add_generation_prompt, self.continue_final_message)

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's variables from the request: chat_template_kwargs, and vLLM's
        `documents` as the variable of that name."""
        if self.documents is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "documents": self.documents}

    @property
    def echoed(self) -> str:
        """With `echo`, the content of the final message, which the answer's content begins
        with (vLLM's): of an assistant message, or of any when no new turn is opened after
        it; else nothing."""
        if not self.echo or not self.messages:
            return ""
        last = self.messages[-1]
        if last.role != "assistant" and self.generation_prompt:
            return ""
        return message_text(last)

    def check_options(self) -> None:
        super().check_options()
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequest(
                "prompt_logprobs cannot be streamed on chat completions (as vLLM): leave "
                "stream out, or prompt_logprobs",
                param="prompt_logprobs",
            )
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= 20:
                raise BadRequest(
                    f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
                    param="top_logprobs",
                )
            if self.top_logprobs and not self.logprobs:  # 0 alone asks nothing (as vLLM)
                raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")

    def tool_use(self, limits: OpenAILimits) -> ToolUse | None:
        """The tools the model is offered, checked (400 naming the problem), and how it may
        call them; None when it calls none (no tools, or tool_choice "none")."""
        choice = self.tool_choice
        if not self.tools:
            if self.tools is not None:
                raise BadRequest("tools must not be an empty list: leave it out")
            if choice not in (None, "none"):
                raise BadRequest("tool_choice needs tools: give the functions it may call")
            return None
        limits.check_tools(self.tools)
        seen: set[str] = set()
        for index, tool in enumerate(self.tools):
            _check_tool(index, tool, seen)
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in seen:
                raise BadRequest(f"tool_choice names the function {name[:80]!r}, not in tools")
        functions = tuple(tool.function for tool in self.tools)
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            return ToolUse(functions, "function", parallel, choice.function.name)
        return ToolUse(functions, choice or "auto", parallel)


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: msgspec.Raw  # a string or a list of strings: see `embedding_texts`
    model: str = ""
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # checked against the model's own by the route
    user: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages through the model's template."""

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None  # messages: as ChatRequest's
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @property
    def generation_prompt(self) -> bool:
        return generation_prompt(self.add_generation_prompt, self.continue_final_message)


def generation_prompt(asked: bool | None, continue_final: bool) -> bool:
    """Whether chat messages are rendered with the assistant's turn opened after them (vLLM's
    add_generation_prompt): by default, unless the final message is continued; both asked is
    a 400 (the prompt either ends inside the final message or opens a new turn)."""
    if continue_final and asked:
        raise BadRequest("continue_final_message and add_generation_prompt cannot both be true")
    return not continue_final if asked is None else asked


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /detokenize: token ids back to text."""

    tokens: msgspec.Raw  # a list of token ids: see `token_ids_of`
    model: str = ""


_TEXT = msgspec.json.Decoder(str)
_BIAS = msgspec.json.Decoder(dict[str, float] | None)
_TEXTS = msgspec.json.Decoder(list[str])
_NOT_TEXT = "input must be a string or a list of strings"
_SPACE = b" \t\r\n"


def embedding_texts(raw: msgspec.Raw, limits: OpenAILimits) -> list[str]:
    """The texts of an embeddings request's `input`: a string or a list of strings, none
    empty, at most `max_embedding_inputs` of them and `max_embedding_chars` characters each.
    Token ids are refused. The strings are counted before a list of them is built."""
    data = bytes(raw)
    depth = opening_depth(data)
    if depth == 0:
        texts = [_decoded(_TEXT, data)]
    else:
        head = data.lstrip(_SPACE)[1:].lstrip(_SPACE)[:1]  # the first item's first character
        if depth > 1 or (head and head in b"-0123456789"):
            raise BadRequest(f"{_NOT_TEXT}: input as token ids is not supported")
        least = strings_at_least(data)
        if least > limits.max_embedding_inputs:
            raise BadRequest(
                f"input has {least} or more texts, more than the limit of "
                f"{limits.max_embedding_inputs} per request"
            )
        texts = _decoded(_TEXTS, data)
        if not texts:
            raise BadRequest("input must not be an empty list")
        if len(texts) > limits.max_embedding_inputs:
            raise BadRequest(
                f"input has {len(texts)} texts, more than the limit of "
                f"{limits.max_embedding_inputs} per request"
            )
    for index, text in enumerate(texts):
        label = f"input[{index}]" if depth else "input"
        if not text:
            raise BadRequest(f"{label} is an empty string")
        if len(text) > limits.max_embedding_chars:
            raise BadRequest(
                f"{label} has {len(text)} characters, more than the limit of "
                f"{limits.max_embedding_chars}"
            )
    return texts


_IDS = msgspec.json.Decoder(list[int])
_ID_LISTS = msgspec.json.Decoder(list[list[int]])
_NOT_PROMPT = "prompt must be a string, a list of token ids, or a list of one of those"
Prompt = str | list[int]


def prompts_of(raw: msgspec.Raw, most_ids: int, most_prompts: int) -> list[Prompt]:
    """The prompts of a completion request: a string or token ids, or a list of strings or of
    token-id lists (a batch, answered as one choice per prompt and `n`), at most
    `most_prompts` of them. Strings and token ids are counted from the raw bytes before a list
    is built: more than `most_ids` token ids per prompt on average (the model's context) are
    refused, and each prompt is checked against the context once tokenized."""
    data = bytes(raw)
    depth = opening_depth(data)
    if depth == 0:
        return [_prompt_decoded(_TEXT, data)]
    head = data.lstrip(_SPACE)[depth:].lstrip(_SPACE)[:1]  # the first item's first character
    if depth == 1 and head == b'"':
        if strings_at_least(data) > most_prompts:
            raise BadRequest(_too_many_prompts(most_prompts))
        texts = _prompt_decoded(_TEXTS, data)
        if not texts:
            raise BadRequest(f"{_NOT_PROMPT}: the list is empty")
        if len(texts) > most_prompts:
            raise BadRequest(_too_many_prompts(most_prompts))
        return list(texts)
    if depth > 2 or b'"' in data or b"{" in data:
        raise BadRequest(_NOT_PROMPT)
    counts = count_scalars(data)
    prompts = max(1, counts.lists - 1) if depth == 2 else 1
    if depth == 1 and counts.lists > 1:
        raise BadRequest(_NOT_PROMPT)
    if prompts > most_prompts:
        raise BadRequest(_too_many_prompts(most_prompts))
    if counts.leaves > most_ids * prompts:
        raise BadRequest(
            f"prompt has {counts.leaves} token ids, more than the model's context of "
            f"{most_ids} tokens" + (f" for each of {prompts} prompts" if prompts > 1 else "")
        )
    batch = [_prompt_decoded(_IDS, data)] if depth == 1 else _prompt_decoded(_ID_LISTS, data)
    if not batch or not all(batch):
        raise BadRequest(f"{_NOT_PROMPT}: the list is empty")
    return batch


def token_ids_of(raw: msgspec.Raw, most: int) -> list[int]:
    """A flat list of token ids, counted from the raw bytes before the list is built: more
    than `most` are refused (400)."""
    data = bytes(raw)
    if opening_depth(data) != 1 or b'"' in data or b"{" in data:
        raise BadRequest("tokens must be a list of token ids")
    counts = count_scalars(data)
    if counts.lists > 1:
        raise BadRequest("tokens must be a list of token ids")
    if counts.leaves > most:
        raise BadRequest(f"tokens has {counts.leaves} ids, more than the context of {most}")
    ids: list[int] = _prompt_decoded(_IDS, data) if data.strip() != b"[]" else []
    return ids


def _too_many_prompts(most: int) -> str:
    if most == 1:
        return "prompt: one prompt per request is supported, not a list of them"
    return f"prompt: at most {most} prompts per request (--max-prompts)"


def _prompt_decoded(decoder: msgspec.json.Decoder[Any], data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        where = str(exc).replace("`$", "`$.prompt")
        raise BadRequest(f"{_NOT_PROMPT}: {where}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON in prompt: {exc}") from None


def _decoded(decoder: msgspec.json.Decoder[Any], data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        where = str(exc).replace("`$", "`$.input")  # a path inside the request, not `input`
        raise BadRequest(f"{_NOT_TEXT}: {where}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadRequest(f"malformed JSON in input: {exc}") from None


_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def decode(body: bytes, kind: Any) -> Any:
    """`body` decoded as `kind` (a Struct, or any type msgspec knows); BadRequest (400) when it
    is not JSON of that shape."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}", param=_field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None


_FIELD = re.compile(r"at `\$\.(\w+)|missing required field `(\w+)`$")


def _field_of(problem: str) -> str | None:
    """The top-level request field a msgspec validation error is about, if it names one."""
    found = _FIELD.search(problem)
    return (found.group(1) or found.group(2)) if found else None


def message_text(message: ChatMessage) -> str:
    """A message's text; content parts of type text are joined, other parts refused."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest("only text content parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def model_card(name: str, created: int, root: str, max_model_len: int | None) -> dict[str, Any]:
    """An entry of /v1/models as vLLM writes it (its ModelCard, with one default
    ModelPermission): `root`, the model it is served from; no `parent` (not an adapter)."""
    permission = {
        "id": new_id("modelperm"),
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "lockgate",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _envelope(rid: str, model: str, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def completion_response(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: Any,
    usage_: dict[str, Any],
) -> dict[str, Any]:
    return {**completion_chunk(rid, model, text, finish_reason, logprobs), "usage": usage_}


def completion_chunk(
    rid: str, model: str, text: str, finish_reason: str | None, logprobs: Any = None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(rid, model, "text_completion", [choice])


def chat_response(
    rid: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    logprobs: Any,
    usage_: dict[str, Any],
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_envelope(rid, model, "chat.completion", [choice]), "usage": usage_}


def chat_chunk(
    rid: str, model: str, delta: dict[str, Any], finish_reason: str | None, logprobs: Any = None
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(rid, model, "chat.completion.chunk", [choice])


def usage_chunk(rid: str, model: str, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    return {**_envelope(rid, model, obj, []), "usage": usage_}


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
