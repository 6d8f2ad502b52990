"""Tool calls in model output: a compact tag syntax a tiny char-level model can learn, and OpenAI ``tool_calls``.

The tag syntax::

    <NAME>BODY</NAME>

* ``NAME`` is a tool name: ``[A-Za-z_][A-Za-z0-9_]*`` (a one-letter alias such as ``c`` keeps
  calls short for a char-level model: ``<c>3+4</c>`` is 10 tokens).
* ``BODY`` is either a JSON object of arguments (``<python>{"code": "print(1)"}</python>``) or
  bare text that fills the tool's primary argument (``<calculator>3+4</calculator>`` ->
  ``{"expression": "3+4"}``). Bare text is stripped of surrounding whitespace.
* Text outside calls is ``content`` (the model's answer / prose).
* Results come back as ``<result>7</result>`` (``format_tool_result``, tag configurable, e.g.
  ``<r>7</r>``). They are written by the environment; a model that writes one itself is calling
  an unknown tool and is told so.
* For the char tokenizer, ``tag_alphabet`` gives the characters to add; tag names ``s``, ``pad``
  and ``unk`` are refused because ``<s>``/``</s>`` etc. are its BOS/EOS/special tokens.
* Limitation: a body cannot contain ``<name>`` or ``</name>`` for any identifier ``name`` (such a
  call is reported as malformed); models that need that use the JSON form with escaped ``\u003c``.

A call that cannot be parsed (unclosed, closed by another name, nested, empty, bad JSON) becomes
a ``ToolCallError`` naming the tool and the problem. The environment turns it into an error
observation so the episode continues and the model can learn from the mistake.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nexrl_hpc.agents.tools.base import ToolOutput
from nexrl_hpc.agents.types import ToolCall

_TAG = re.compile(r"<(/?)([A-Za-z_][A-Za-z0-9_]*)>")


@dataclass
class ToolCallError:
    """A call the model tried to make but got wrong; ``name`` is the tool when it is known."""

    message: str
    name: str | None = None

    def to_output(self) -> ToolOutput:
        return ToolOutput(self.name or "tool_call", error=self.message)


@dataclass
class ParsedToolCalls:
    """The calls, the errors, and the text outside calls, in the order they appeared."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)
    content: str = ""

    @property
    def error_outputs(self) -> list[ToolOutput]:
        return [e.to_output() for e in self.errors]


def _arguments(name: str, body: str, primary: str | None, known: bool) -> dict[str, Any] | ToolCallError:
    text = body.strip()
    if not text:
        return ToolCallError(f"empty <{name}> call: put the input between <{name}> and </{name}>", name)
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            if primary is None:
                return ToolCallError(
                    f"<{name}> arguments are not valid JSON: {exc.msg} at char {exc.pos}", name
                )
        else:
            if isinstance(value, dict):
                return value
            if primary is None:
                return ToolCallError(
                    f"<{name}> arguments must be a JSON object, got {type(value).__name__}", name
                )
    if primary is None:
        if not known:
            return {}  # unknown tool: MultiTool reports it by name
        return ToolCallError(f"<{name}> takes a JSON object of arguments, got text {text[:40]!r}", name)
    return {primary: text}


def parse_tool_calls(
    text: str,
    tools: Mapping[str, str | None] | None = None,
    max_calls: int = 8,
) -> ParsedToolCalls:
    """Parse tag-syntax calls from ``text``.

    ``tools`` maps tool name -> primary argument (``{"calculator": "expression"}``; build it with
    ``tool_arguments(multi_tool)``). Any well-formed tag pair is a call, including names not in
    ``tools``: executing it yields "unknown tool" from MultiTool, which is the feedback the model needs.
    """
    tools = tools or {}
    result = ParsedToolCalls()
    content: list[str] = []
    pos = 0  # end of what has been consumed
    open_name: str | None = None
    open_end = 0  # end of the opening tag of the current call
    for match in _TAG.finditer(text):
        closing, name = match.group(1) == "/", match.group(2)
        if open_name is None:
            if closing:
                result.errors.append(ToolCallError(f"</{name}> without a matching <{name}>", name))
                content.append(text[pos : match.start()])
                pos = match.end()
                continue
            content.append(text[pos : match.start()])
            open_name, open_end = name, match.end()
            continue
        if closing and name == open_name:
            if len(result.calls) >= max_calls:
                result.errors.append(
                    ToolCallError(f"more than {max_calls} tool calls in one turn; <{name}> ignored", name)
                )
            else:
                args = _arguments(name, text[open_end : match.start()], tools.get(name), name in tools)
                if isinstance(args, ToolCallError):
                    result.errors.append(args)
                else:
                    result.calls.append(ToolCall(name=name, arguments=args))
            open_name, pos = None, match.end()
            continue
        # a tag inside an open call that does not close it: the open call is malformed
        if closing:
            message = f"<{open_name}> call closed by </{name}>; expected </{open_name}>"
            result.errors.append(ToolCallError(message, open_name))
            open_name, pos = None, match.end()
        else:
            message = f"<{open_name}> call not closed: found <{name}> before </{open_name}>"
            result.errors.append(ToolCallError(message, open_name))
            open_name, open_end = name, match.end()
            pos = match.start()
    if open_name is not None:
        result.errors.append(
            ToolCallError(
                f"<{open_name}> call not closed: expected </{open_name}> before the end of the output",
                open_name,
            )
        )
        pos = len(text)
    content.append(text[pos:])
    result.content = "".join(content).strip()
    return result


def parse_openai_tool_calls(tool_calls: list[Any]) -> ParsedToolCalls:
    """Parse the ``tool_calls`` of an OpenAI chat response (``arguments`` is a JSON string or a dict)."""
    result = ParsedToolCalls()
    for i, raw in enumerate(tool_calls):
        function = raw.get("function") if isinstance(raw, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str) or not name:
            result.errors.append(ToolCallError(f"tool_calls[{i}] has no function name: {raw!r:.120}"))
            continue
        call_id = raw.get("id")
        where = f"tool_calls[{i}] ({name!r}{', id ' + repr(call_id) if call_id else ''})"
        arguments = function.get("arguments")
        if arguments is None or arguments == "":
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                result.errors.append(ToolCallError(f"{where}: arguments are not valid JSON: {exc.msg}", name))
                continue
        if not isinstance(arguments, dict):
            result.errors.append(
                ToolCallError(
                    f"{where}: arguments must be a JSON object, got {type(arguments).__name__}", name
                )
            )
            continue
        result.calls.append(ToolCall(name=name, arguments=arguments, id=call_id))
    return result


def format_tool_call(call: ToolCall, primary: str | None = None) -> str:
    """The tag form of ``call`` (bare text when it only has its primary argument): for prompts and demos."""
    if primary is not None and set(call.arguments) == {primary}:
        return f"<{call.name}>{call.arguments[primary]}</{call.name}>"
    return f"<{call.name}>{json.dumps(call.arguments)}</{call.name}>"


def format_tool_result(output: ToolOutput, tag: str = "result") -> str:
    """How a tool's output is shown to the model in the tag syntax: ``<result>7</result>``."""
    return f"<{tag}>{output.to_string()}</{tag}>"


def tool_arguments(tools: Mapping[str, Any]) -> dict[str, str | None]:
    """name -> primary argument for ``parse_tool_calls``, from a MultiTool's ``tools`` dict."""
    return {name: tool.primary_argument for name, tool in tools.items()}


def tag_alphabet(tool_names: Iterable[str], result_tag: str = "result") -> str:
    """The characters the tag syntax needs in a char-level tokenizer's alphabet (tool arguments not included).

    Raises ValueError for a tag that would not be read as characters: ``<s>``, ``</s>``, ``<pad>``,
    ``<unk>`` are the char tokenizer's special tokens (``</s>`` is EOS: generation would stop there).
    """
    from nexrl_hpc.models.tokenizer import SPECIAL_TOKENS  # transformers: only when building a task

    names = [*tool_names, result_tag]
    chars = dict.fromkeys("</>")
    for name in names:
        if not _TAG.fullmatch(f"<{name}>"):
            raise ValueError(f"tag name {name!r} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)")
        if f"<{name}>" in SPECIAL_TOKENS or f"</{name}>" in SPECIAL_TOKENS:
            raise ValueError(
                f"tag name {name!r} collides with the char tokenizer's special tokens {SPECIAL_TOKENS}"
            )
        chars.update(dict.fromkeys(name))
    return "".join(chars)
