"""Tool calls in Hermes's format (`protocol/tool_calls.py`): the tools a chat request offers,
checked against the limits; the history as a template without tools support gets it; and the
parser, whose pieces give what the whole output gives."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest

from lockgate.errors import BadRequest
from lockgate.protocol import openai as oa
from lockgate.protocol import tool_calls as tc

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def request(**fields: Any) -> oa.ChatRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return oa.decode(msgspec.json.encode(body), oa.ChatRequest)  # type: ignore[no-any-return]


def use_of(**fields: Any) -> oa.ToolUse:
    use = request(tools=[WEATHER, CLOCK], **fields).tool_use(oa.OpenAILimits())
    assert use is not None
    return use


def call(name: str, arguments: Any) -> str:
    return f"{tc.OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{tc.CLOSE}"


def pieces(parser: tc.ToolCallParser, text: str, rng: random.Random) -> tc.Parsed:
    got, start = tc.Parsed(), 0
    while start < len(text):
        end = start + rng.randint(1, 7)
        got.extend(parser.feed(text[start:end]))
        start = end
    got.extend(parser.finish())
    return got


def functions(parsed: tc.Parsed) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls]


OUTPUTS = [
    "Plain prose, no call at all.  \n",
    "Let me look.\n" + call("get_weather", {"city": "Oslo"}),
    call("get_weather", {"city": "Oslo"}) + "\n" + call("get_time", {}) + "\n",
    call("get_time", {}) + "\n\nDone: it is noon <tool",
    "Sure.\n" + call("get_weather", "Oslo"),  # arguments not an object
    "x " + call("get_wether", {}) + "\n",  # no such function
    "<tool_call>\n{not json}\n</tool_call> and <tool_call>{",  # malformed, then left open
    "a < b, and <tool_ca is not a tag",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_pieces_give_what_the_whole_output_gives(text: str) -> None:
    use = use_of()
    whole = tc.parse(text, use)
    rng = random.Random(text)
    for _ in range(100):
        split = pieces(tc.ToolCallParser(use), text, rng)
        assert (split.content, functions(split)) == (whole.content, functions(whole))


def test_calls_become_calls_and_whitespace_around_them_goes() -> None:
    use = use_of()
    parsed = tc.parse(OUTPUTS[2], use)
    assert parsed.content == ""
    assert functions(parsed) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed.calls)
    assert len({c["id"] for c in parsed.calls}) == 2
    parsed = tc.parse(OUTPUTS[1], use)
    assert (parsed.content, functions(parsed)) == (
        "Let me look.",
        [("get_weather", {"city": "Oslo"})],
    )
    parsed = tc.parse(OUTPUTS[3], use)
    assert parsed.content == "\n\nDone: it is noon <tool"


@pytest.mark.parametrize("text", [OUTPUTS[0], *OUTPUTS[4:]])
def test_output_with_no_valid_call_is_its_text_unchanged(text: str) -> None:
    parsed = tc.parse(text, use_of())
    assert (parsed.content, parsed.calls) == (text, [])


def test_without_parallel_calls_only_the_first_call_is_kept() -> None:
    parsed = tc.parse(OUTPUTS[2], use_of(parallel_tool_calls=False))
    assert functions(parsed) == [("get_weather", {"city": "Oslo"})]
    assert parsed.content == ""


def test_a_named_choice_calls_that_function_alone() -> None:
    use = use_of(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (use.forced, use.most_calls) == (True, 1)
    assert [f.name for f in use.callable] == ["get_time"]
    grammar = tc.grammar(use.callable, use.most_calls)
    assert '"get_time"' in grammar and "get_weather" not in grammar
    assert '("\\n" call)*' not in grammar  # one call
    assert '("\\n" call)*' in tc.grammar(use_of(tool_choice="required").callable, None)


def raw(parsed: tc.Parsed) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.calls]


def test_a_forced_output_cut_short_ends_in_the_call_it_was_writing() -> None:
    """As vLLM's: the name (written, or the one known) and the arguments' text so far."""
    named = use_of(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    required = use_of(tool_choice="required")
    whole = call("get_weather", {"city": "Oslo"})
    inside = whole[: whole.index('"Oslo"') + 3]  # ends in the argument's value
    cuts = {
        "<tool_": ("", None),
        whole[:20]: ("", None),  # inside the name
        inside: ('{"city": "Os', "get_weather"),
        whole[: -len(tc.CLOSE) - 1]: ('{"city": "Oslo"}', "get_weather"),
    }
    for text, (arguments, written) in cuts.items():
        assert raw(tc.parse(text, named, cut=True)) == [("get_weather", arguments)], text
        parsed = tc.parse(text, required, cut=True)
        assert raw(parsed) == ([(written, arguments)] if written else []), text
        assert parsed.content == "", text
        assert raw(tc.parse(text, named)) == [] and tc.parse(text, named).content  # not cut
    after_one = call("get_time", {}) + "\n" + inside
    assert raw(tc.parse(after_one, required, cut=True)) == [
        ("get_time", "{}"),
        ("get_weather", '{"city": "Os'),
    ]
    auto = tc.parse(inside, use_of(tool_choice="auto"), cut=True)
    assert (auto.calls, auto.content) == ([], inside)  # not forced: the text stays text


def test_a_function_named_like_a_choice_is_still_a_function() -> None:
    tools = [{"type": "function", "function": {"name": "auto"}}]
    named = {"type": "function", "function": {"name": "auto"}}
    use = request(tools=tools, tool_choice=named).tool_use(oa.OpenAILimits())
    assert use is not None and use.forced and use.function == "auto"


def test_tool_limits_are_the_servers_own() -> None:
    body = request(tools=[WEATHER, CLOCK])
    with pytest.raises(BadRequest, match="tools has 2 tools, more than the limit of 1"):
        body.tool_use(oa.OpenAILimits(max_tools=1))
    with pytest.raises(
        BadRequest, match=r"tools has \d+ characters as JSON, more than the limit of 50"
    ):
        body.tool_use(oa.OpenAILimits(max_tool_chars=50))
    with pytest.raises(BadRequest, match="tool calling is turned off"):
        body.tool_use(oa.OpenAILimits(max_tool_chars=0))
    with pytest.raises(ValueError, match="--max-tools must be an integer of at least 1"):
        oa.OpenAILimits(max_tools=0)
    assert request(tools=[WEATHER], tool_choice="none").tool_use(oa.OpenAILimits()) is None


def test_a_history_is_written_in_hermess_format_for_a_template_without_tools() -> None:
    made = {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}
    body = request(
        tools=[WEATHER],
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": made}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
        ],
    )  # fmt: skip
    use = body.tool_use(oa.OpenAILimits())
    assert use is not None
    rendered = tc.prompt_messages(body.messages, use, template_takes_tools=False)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    system = rendered[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in system
    assert rendered[2]["content"] == call("get_weather", {"city": "Oslo"})
    assert rendered[3]["content"] == "<tool_response>\n5 C\n</tool_response>"
    without = tc.prompt_messages(body.messages[1:], use, template_takes_tools=False)
    assert without[0] == {"role": "system", "content": tc.system_prompt(use)}
    assert tc.prompt_messages(body.messages, None, template_takes_tools=False)[0] == {
        "role": "system",
        "content": "Be brief.",
    }
    for_template = tc.prompt_messages(body.messages, use, template_takes_tools=True)
    as_object = {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert for_template[2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": as_object}],
    }
    assert for_template[3] == {"role": "tool", "content": "5 C", "tool_call_id": "c1"}
