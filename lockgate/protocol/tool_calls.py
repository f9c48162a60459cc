"""Tool calls as the model writes them: Hermes's format, one call per tag,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

which vLLM's `hermes` parser reads, and Qwen2.5's, Hermes's and SmolLM3's chat templates ask
for. A chat template that takes `tools` renders them itself; for one that does not (SmolLM2's),
lockgate writes the tools and this format into the system message, the history's calls as
these tags and tool results in `<tool_response>` tags.

    prompt_messages   the chat history as the model's template takes it
    grammar           the Lark grammar of the calls a forced tool_choice allows (llguidance)
    ToolCallParser    the model's output, as it streams, split into content and calls
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from lockgate.errors import BadRequest
from lockgate.protocol import openai as oa

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def system_prompt(use: oa.ToolUse) -> str:
    """The tools and the format of a call, for the system message."""
    tools = "\n".join(_json(definition) for definition in use.definitions())
    return _SYSTEM.format(tools=tools)


def prompt_messages(
    messages: list[oa.ChatMessage], use: oa.ToolUse | None, template_takes_tools: bool
) -> list[dict[str, Any]]:
    """The messages for the model's chat template. A template that takes tools gets the
    OpenAI form (each call's arguments as an object, as Hugging Face's templates expect);
    for one that does not, calls and tool results are written into the content in Hermes's
    format, and the tools offered into the system message (a new first one if there is none).
    400 for a malformed call."""
    if template_takes_tools:
        return [_template_message(i, m) for i, m in enumerate(messages)]
    rendered = [_hermes_message(i, m) for i, m in enumerate(messages)]
    if use is None:
        return rendered
    section = system_prompt(use)
    if rendered and rendered[0]["role"] == "system":
        text = rendered[0]["content"]
        rendered[0]["content"] = f"{text}\n\n{section}" if text else section
    else:
        rendered.insert(0, {"role": "system", "content": section})
    return rendered


def _template_message(index: int, message: oa.ChatMessage) -> dict[str, Any]:
    calls = _calls_of(index, message)
    content = None if message.content is None and calls else oa.message_text(message)
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if calls:
        rendered["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": a}}
            for c, a in zip(message.tool_calls or (), calls, strict=True)
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _hermes_message(index: int, message: oa.ChatMessage) -> dict[str, Any]:
    text = oa.message_text(message)
    calls = _calls_of(index, message)
    if calls:
        written = [
            f"{OPEN}\n{_json({'name': c.function.name, 'arguments': a})}\n{CLOSE}"
            for c, a in zip(message.tool_calls or (), calls, strict=True)
        ]
        text = "\n".join([text, *written] if text else written)
    elif message.role == "tool":
        text = f"<tool_response>\n{text}\n</tool_response>"
    return {"role": message.role, "content": text}


def _calls_of(index: int, message: oa.ChatMessage) -> list[dict[str, Any]]:
    """The arguments of each call of an assistant message, as objects (400 when not)."""
    if not message.tool_calls:
        return []
    if message.role != "assistant":
        raise BadRequest(f"messages[{index}]: only assistant messages have tool_calls")
    found = []
    for j, call in enumerate(message.tool_calls):
        arguments = _object(call.function.arguments)
        if arguments is None:
            raise BadRequest(
                f"messages[{index}].tool_calls[{j}].function.arguments must be a JSON object, "
                "as text"
            )
        found.append(arguments)
    return found


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# -- the grammar of a forced tool_choice -------------------------------------------------------


def call_schema(function: oa.FunctionDefinition) -> dict[str, Any]:
    """The JSON schema of one call of `function`: its name, then arguments that match its
    parameters (llguidance writes properties in the order given). Arguments whose schema
    names properties have no others unless it says so (`additionalProperties`): a small model
    held to a schema that allows any other goes on writing them."""
    arguments = oa.parameters_of(function)
    open_ended = "additionalProperties" in arguments or "patternProperties" in arguments
    if "properties" in arguments and not open_ended:
        arguments = {**arguments, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# JSON as system_prompt shows it: `{"name": "f", "arguments": {"a": 1}}`, no other whitespace
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar(functions: tuple[oa.FunctionDefinition, ...], most_calls: int | None) -> str:
    """The Lark grammar (llguidance's syntax) of `most_calls` calls (None: one or more), each
    of one of `functions`, in Hermes's format and laid out as `system_prompt` shows it; a
    function that is not `strict` has the schema keywords llguidance cannot enforce ignored,
    a strict one refused."""
    alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
    more = "" if most_calls == 1 else ' ("\\n" call)*'
    lines = [f"start: call{more}", f'call: "{OPEN}\\n" ({alternatives}) "\\n{CLOSE}"']
    for i, function in enumerate(functions):
        options = {**_LAYOUT, "lenient": function.strict is not True}
        schema = {**call_schema(function), "x-guidance": options}
        lines.append(f"fn{i}: %json {_json(schema)}")
    return "\n".join(lines)


# -- the model's output --------------------------------------------------------------------------


@dataclass(slots=True)
class Parsed:
    """A piece of a model's output: text for the content, and the calls completed in it
    (OpenAI's tool_calls items: id, type, function with name and arguments)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.calls += other.calls


class ToolCallParser:
    """Splits a model's output into content and tool calls as it streams. Each call is given
    whole when its closing tag arrives; text that may open a call is held until it is known.
    A call that is not a JSON object with the name of a function offered and object arguments
    stays text, and so does a call left open at the end: a model that writes no valid call
    answers its text as content, unchanged. Whitespace alone before, between and after valid
    calls is dropped; past `most_calls`, further calls are dropped. The whole output parsed at
    once gives what its pieces give.

    An output held to calls (a forced tool_choice) and cut short (max_tokens) ends, as vLLM's
    does, in a call as far as it was written: its name (the one tool_choice names, or the one
    function offered, until the output has written one) and as its arguments the text written
    of them (not a whole JSON object); the format's own text before a name is known is no
    content, and is dropped."""

    def __init__(self, use: oa.ToolUse) -> None:
        self.names = {f.name for f in use.callable}
        self.most_calls = use.most_calls
        self.forced = use.forced
        # the function a forced call is of before its name is written
        self.known = use.function or (use.callable[0].name if len(use.callable) == 1 else None)
        self.made = 0  # calls given so far
        self._held = ""  # text not given yet: the open call's, or what may open one
        self._in_call = False
        self._lead = ""  # whitespace before the open call: given with it if it stays text
        self._after_call = False  # a valid call just closed: whitespace alone next is dropped

    def feed(self, text: str) -> Parsed:
        """What `text`, the output's next piece, completes."""
        parsed = Parsed()
        self._held += text
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    return parsed
                body, self._held = self._held[:end], self._held[end + len(CLOSE) :]
                self._in_call = False
                self._close(body, parsed)
                continue
            start = self._held.find(OPEN)
            if start < 0:
                self._give_text(parsed, final=False)
                return parsed
            before = self._held[:start]
            if self._after_call and not before.strip():
                before = ""  # between two calls
            self._after_call = False
            given = before.rstrip()
            parsed.content += given
            self._lead = before[len(given) :]
            self._held = self._held[start + len(OPEN) :]
            self._in_call = True

    def finish(self, cut: bool = False) -> Parsed:
        """The rest, at the end of the output; `cut`: the output was cut short (max_tokens)."""
        parsed = Parsed()
        if cut and self.forced:
            self._give_partial(parsed)
        elif self._in_call:
            parsed.content = self._lead + OPEN + self._held
        else:
            self._give_text(parsed, final=True)
        self._held, self._in_call = "", False
        return parsed

    def _give_partial(self, parsed: Parsed) -> None:
        """A forced output cut short: the call it was writing, as far as it was written (the
        first call of a named function, when none was opened yet)."""
        if self._in_call:
            call = self._call(self._held) or self._partial_call(self._held)
        else:
            call = _call_of(self.known, "") if self.made == 0 and self.known else None
        if call is not None and (self.most_calls is None or self.made < self.most_calls):
            parsed.calls.append(call)
            self.made += 1

    def _partial_call(self, body: str) -> dict[str, Any] | None:
        """A call cut inside its JSON, laid out as `grammar` holds it: its name, when written
        whole (else the one known), and its arguments' text so far."""
        written = _PARTIAL.match(body)
        name = self.known
        arguments = ""
        if written is not None:
            name = written.group(1)
            arguments = written.group(2) or ""
        return _call_of(name, arguments) if name in self.names else None

    def _give_text(self, parsed: Parsed, final: bool) -> None:
        text = self._held
        if self._after_call and not text.strip():
            if final:
                self._held = ""  # after the last call
            return
        self._after_call = False
        keep = 0 if final else _open_prefix(text)
        cut = len(text) - keep
        if not final:
            cut = len(text[:cut].rstrip())  # whitespace may come before a call
        parsed.content += text[:cut]
        self._held = text[cut:]

    def _close(self, body: str, parsed: Parsed) -> None:
        call = self._call(body)
        if call is None:
            parsed.content += self._lead + OPEN + body + CLOSE
        else:
            self._after_call = True
            if self.most_calls is None or self.made < self.most_calls:
                parsed.calls.append(call)
                self.made += 1
        self._lead = ""

    def _call(self, body: str) -> dict[str, Any] | None:
        value = _object(body)
        if value is None:
            return None
        name, arguments = value.get("name"), value.get("arguments", {})
        if not isinstance(name, str) or name not in self.names or not isinstance(arguments, dict):
            return None
        return _call_of(name, _json(arguments))


def _call_of(name: str, arguments: str) -> dict[str, Any]:
    """A call in OpenAI's form, `arguments` as text."""
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


# a call cut short, as `grammar` lays it out: its name written whole, then its arguments so far
_PARTIAL = re.compile(r'\s*\{"name": "((?:[^"\\]|\\.)*)"(?:, "arguments": (.*))?', re.DOTALL)


def _open_prefix(text: str) -> int:
    """The length of the longest end of `text` that begins the opening tag."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0


def parse(text: str, use: oa.ToolUse, cut: bool = False) -> Parsed:
    """A whole output, split into content and calls; `cut`: it was cut short (max_tokens)."""
    parser = ToolCallParser(use)
    parsed = parser.feed(text)
    parsed.extend(parser.finish(cut))
    return parsed
