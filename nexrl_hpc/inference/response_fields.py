"""Typed reads of an inference server's JSON answer: a field that is missing or of the wrong type is
an ``InferenceResponseError`` naming the server and the field's path (``choices[2].token_ids[0]``),
never a bare ``KeyError``/``TypeError``/``AttributeError`` from deep in the client.

Why a reader per answer and not a schema library: the answers are small, the engines' shapes differ
in a few fields each, and the error must name the server the client talked to.
"""

from __future__ import annotations

from typing import Any

from nexrl_hpc.inference.errors import InferenceResponseError

_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fits(value: Any, kind: type) -> bool:
    if isinstance(value, bool):  # JSON true/false are not numbers here
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


class AnswerReader:
    """Reads one answer of ``server``; ``what`` names the answer in errors (``the completion``)."""

    def __init__(self, server: str, what: str) -> None:
        self.server = server
        self.what = what

    def error(self, path: str, problem: str) -> InferenceResponseError:
        where = f"{path} " if path else ""
        return InferenceResponseError(f"{self.server}: malformed answer to {self.what}: {where}{problem}")

    def check(self, value: Any, kind: type, path: str) -> Any:
        """``value`` itself, when it is of ``kind`` (a float field takes JSON integers too)."""
        if not _fits(value, kind):
            raise self.error(path, f"is {type(value).__name__} {_shown(value)}, not {_KIND_NAMES[kind]}")
        return value

    def field(self, obj: Any, key: str, kind: type, path: str, required: bool = True) -> Any:
        """``obj[key]`` of ``kind``; None when it is absent or null and not ``required``."""
        self.check(obj, dict, path or "the answer")
        value = obj.get(key)
        where = f"{path}.{key}" if path else key
        if value is None:
            if required:
                raise self.error(path or "the answer", f"has no {key!r}")
            return None
        return self.check(value, kind, where)

    def items(self, values: Any, kind: type, path: str) -> list[Any]:
        """``values`` as a list whose every item is of ``kind``."""
        self.check(values, list, path)
        for i, value in enumerate(values):
            self.check(value, kind, f"{path}[{i}]")
        return list(values)

    def ints(self, values: Any, path: str) -> list[int]:
        return [int(v) for v in self.items(values, int, path)]

    def floats(self, values: Any, path: str) -> list[float]:
        return [float(v) for v in self.items(values, float, path)]
