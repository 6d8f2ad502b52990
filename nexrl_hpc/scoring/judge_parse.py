"""Read a judge model's score out of its free-text answer.

Judges answer in many shapes: ``Score: 7/10``, ``**Rating:** 4``, ``{"score": 0.8}``, a paragraph
of reasoning that ends with ``Final score: 8 out of 10``. ``parse_judge_score`` takes, in order: a
JSON object holding ``score`` / ``rating`` / ``grade``; else the *last* labelled number (``score``,
``rating``, ``grade``, ``verdict``, markdown and ``:``/``=`` allowed between); else the last bare
fraction ``N/M`` or ``N out of M``. A number with its own denominator is divided by it, one without
by ``score_max``; a result outside [0, 1], a refusal or anything without a score raises
``JudgeParseError`` (the caller counts it: ``reward/judge_parse_errors``).
"""

from __future__ import annotations

import json
import math
import re

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_LABEL = r"(?:final\s+)?(?:score|rating|grade|verdict)"
_DENOMINATOR = rf"\s*(?:/|out\s+of)\s*({_NUMBER})"
_LABELLED = re.compile(
    rf"{_LABEL}(?:\s+-\s+)?[\s*_:=\"'`]*\[*({_NUMBER})\]*(?:{_DENOMINATOR})?", re.IGNORECASE
)
_FRACTION = re.compile(rf"({_NUMBER}){_DENOMINATOR}", re.IGNORECASE)
_JSON_OBJECT = re.compile(r"\{[^{}]*\}")
_JSON_KEYS = ("score", "rating", "grade")


class JudgeParseError(ValueError):
    """The judge's answer holds no score in [0, 1] after scaling."""


def parse_judge_score(text: str, score_max: float) -> float:
    """The score in ``text`` scaled to [0, 1]; JudgeParseError (with the text's start) when it has none."""
    found = _from_json(text) or _last(_LABELLED, text) or _last(_FRACTION, text)
    if found is None:
        raise JudgeParseError(f"no score in the judge's answer {text[:120]!r}")
    value, denominator = found
    scale = denominator if denominator is not None else score_max
    if scale <= 0:
        raise JudgeParseError(f"a score out of {scale:g} in {text[:120]!r}")
    score = value / scale
    if not math.isfinite(score) or not 0.0 <= score <= 1.0:
        raise JudgeParseError(f"score {value:g} out of {scale:g} is outside [0, 1] in {text[:120]!r}")
    return score


def _from_json(text: str) -> tuple[float, float | None] | None:
    for match in reversed(_JSON_OBJECT.findall(text)):
        try:
            data = json.loads(match)
        except ValueError:
            continue
        if not isinstance(data, dict):
            continue
        for key in _JSON_KEYS:
            value = data.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value), None
            if isinstance(value, str):
                inner = _last(_FRACTION, value)
                if inner is not None:
                    return inner
                try:
                    return float(value), None
                except ValueError:
                    continue
    return None


def _last(pattern: re.Pattern[str], text: str) -> tuple[float, float | None] | None:
    matches = pattern.findall(text)
    if not matches:
        return None
    value, denominator = matches[-1]
    return float(value), float(denominator) if denominator else None
