"""The tag tool-call syntax and OpenAI tool_calls: well-formed calls parse, malformed ones become errors."""

from __future__ import annotations

import pytest

from nexrl_hpc.agents.tool_format import (
    format_tool_call,
    format_tool_result,
    parse_openai_tool_calls,
    parse_tool_calls,
    tag_alphabet,
    tool_arguments,
)
from nexrl_hpc.agents.tools import MultiTool, ToolCall, ToolOutput

TOOLS = {"calculator": "expression", "python": "code", "c": "expression", "lookup": None}


def test_bare_text_fills_the_primary_argument_and_content_is_kept() -> None:
    parsed = parse_tool_calls("first <c>3+4</c> then <calculator> 2*5 </calculator> done", TOOLS)
    assert parsed.calls == [
        ToolCall("c", {"expression": "3+4"}),
        ToolCall("calculator", {"expression": "2*5"}),
    ]
    assert parsed.errors == []
    assert parsed.content == "first  then  done"


def test_json_body_gives_named_arguments() -> None:
    parsed = parse_tool_calls('<lookup>{"key": "fr", "field": "capital"}</lookup>', TOOLS)
    assert parsed.calls == [ToolCall("lookup", {"key": "fr", "field": "capital"})]
    code = parse_tool_calls("<python>{1: 2}</python>", TOOLS)  # not JSON: python code that looks like it
    assert code.calls == [ToolCall("python", {"code": "{1: 2}"})]


def test_text_without_calls_is_all_content() -> None:
    parsed = parse_tool_calls("7", TOOLS)
    assert (parsed.calls, parsed.errors, parsed.content) == ([], [], "7")


@pytest.mark.parametrize(
    ("text", "name", "message"),
    [
        ("<c>3+4", "c", "<c> call not closed: expected </c> before the end of the output"),
        ("<c>3+</python>", "c", "<c> call closed by </python>; expected </c>"),
        ("</c>7", "c", "</c> without a matching <c>"),
        ("<c> </c>", "c", "empty <c> call: put the input between <c> and </c>"),
        ("<lookup>fr</lookup>", "lookup", "<lookup> takes a JSON object of arguments, got text 'fr'"),
        (
            '<lookup>{"key": </lookup>',
            "lookup",
            "<lookup> arguments are not valid JSON: Expecting value at char 7",
        ),
        ("<lookup>[1]</lookup>", "lookup", "<lookup> takes a JSON object of arguments, got text '[1]'"),
    ],
)
def test_malformed_calls_are_errors_naming_the_tool(text: str, name: str, message: str) -> None:
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.calls == []
    assert [(e.name, e.message) for e in parsed.errors] == [(name, message)]
    (output,) = parsed.error_outputs
    assert output == ToolOutput(name, error=message)


def test_nested_call_reports_the_outer_and_keeps_the_inner() -> None:
    parsed = parse_tool_calls("<c>1+<c>2</c>", TOOLS)
    assert parsed.calls == [ToolCall("c", {"expression": "2"})]
    assert [e.message for e in parsed.errors] == ["<c> call not closed: found <c> before </c>"]


def test_too_many_calls_are_refused_by_name() -> None:
    parsed = parse_tool_calls("<c>1</c><c>2</c><c>3</c>", TOOLS, max_calls=2)
    assert [c.arguments["expression"] for c in parsed.calls] == ["1", "2"]
    assert [e.message for e in parsed.errors] == ["more than 2 tool calls in one turn; <c> ignored"]


def test_unknown_tool_reaches_multitool_and_comes_back_as_an_error() -> None:
    tools = MultiTool(tools=["calculator"])
    parsed = parse_tool_calls(
        "<search>paris</search><calculator>1+1</calculator>", tool_arguments(tools.tools)
    )
    outputs = [tools.execute(call) for call in parsed.calls]
    assert [o.to_string() for o in outputs] == [
        "Error: unknown tool 'search'; available: ['calculator']",
        "2",
    ]


def test_openai_tool_calls() -> None:
    raw = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'},
        },
        {"id": "b", "type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}},
        {"id": "c", "type": "function", "function": {"name": "finish", "arguments": ""}},
        {"id": "d", "type": "function", "function": {"name": "calculator", "arguments": "{oops"}},
        {"id": "e", "type": "function", "function": {"name": "calculator", "arguments": "[1, 2]"}},
        {"type": "function", "function": {"arguments": "{}"}},
        "not a call",
    ]
    parsed = parse_openai_tool_calls(raw)
    assert parsed.calls == [
        ToolCall("calculator", {"expression": "1+2"}, id="a"),
        ToolCall("python", {"code": "print(1)"}, id="b"),
        ToolCall("finish", {}, id="c"),
    ]
    assert [e.message for e in parsed.errors] == [
        "tool_calls[3] ('calculator', id 'd'): arguments are not valid JSON: Expecting property name enclosed in double quotes",
        "tool_calls[4] ('calculator', id 'e'): arguments must be a JSON object, got list",
        "tool_calls[5] has no function name: {'type': 'function', 'function': {'arguments': '{}'}}",
        "tool_calls[6] has no function name: 'not a call'",
    ]
    assert [e.name for e in parsed.errors] == ["calculator", "calculator", None, None]
    assert parsed.error_outputs[2].name == "tool_call"


def test_format_round_trips_through_the_parser() -> None:
    for call, primary in [
        (ToolCall("c", {"expression": "3+4"}), "expression"),
        (ToolCall("lookup", {"key": "fr"}), None),
    ]:
        text = format_tool_call(call, primary)
        assert parse_tool_calls(text, TOOLS).calls == [call]
    assert format_tool_call(ToolCall("c", {"expression": "3+4"}), "expression") == "<c>3+4</c>"
    assert format_tool_result(ToolOutput("c", output="7"), tag="r") == "<r>7</r>"
    assert format_tool_result(ToolOutput("c", error="division by zero in '1/0'")) == (
        "<result>Error: division by zero in '1/0'</result>"
    )
    assert ToolCall("c", {"expression": "1"}, id="x").to_openai() == {
        "type": "function",
        "function": {"name": "c", "arguments": '{"expression": "1"}'},
        "id": "x",
    }


def test_tag_alphabet_for_a_char_tokenizer() -> None:
    assert tag_alphabet(["c"], result_tag="r") == "</>cr"
    assert tag_alphabet(["calc", "lookup"], result_tag="r") == "</>calokupr"
    with pytest.raises(ValueError, match="tag name 's' collides with the char tokenizer's special tokens"):
        tag_alphabet(["s"], result_tag="r")
    with pytest.raises(ValueError, match="tag name 'unk' collides"):
        tag_alphabet(["c"], result_tag="unk")
    with pytest.raises(ValueError, match="tag name 'a b' is not an identifier"):
        tag_alphabet(["a b"])


def test_tag_calls_tokenize_one_char_per_token() -> None:
    """With the alphabet extended by tag_alphabet, a call and its result are plain characters to the tiny model."""
    from nexrl_hpc.models.tokenizer import build_char_tokenizer

    alphabet = "0123456789+*=" + tag_alphabet(["c"], result_tag="r")
    tokenizer = build_char_tokenizer(alphabet)
    text = "<c>3+4</c><r>7</r>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    completion = tokenizer.decode(ids[: text.index("<r>")])  # what the model wrote; the result is the env's
    assert parse_tool_calls(completion, {"c": "expression"}).calls == [ToolCall("c", {"expression": "3+4"})]
