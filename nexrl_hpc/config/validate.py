"""Check a composed config against the TypedDict schema and report EVERY problem at once.

Problems carry the dotted key path; the caller turns a non-empty list into one error and exit code 2,
before anything is built, started or submitted.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Union

from typing_extensions import NotRequired, Required, is_typeddict

from nexrl_hpc.config.constraints import Ge, Gt, Le
from nexrl_hpc.config.imports import load_object
from nexrl_hpc.config.key_names import did_you_mean, key_paths, verl_hint

CONFIG_ERROR_EXIT_CODE = 2

# keys that were removed because another key names the same thing: old path -> the key to use
MOVED_KEYS = {"train_worker.sync_weight_path": "weight.sync_weight_path"}


# keys a preset may leave unset (null) for the user to fill: path -> what to set it to
REQUIRED_VALUE_HINTS = {
    "rollout_worker.reward_fn": "set it to your reward function, 'module:function' or "
    "'path/to/file.py:function' (or a list of them); the task preset, e.g. task=custom, has none of its own",
}


def moved_key_hint(path: str) -> str:
    """`` (did you mean 'new.key'?)`` for a key that moved, else ''."""
    return f" (did you mean {MOVED_KEYS[path]!r}?)" if path in MOVED_KEYS else ""


@dataclass(frozen=True)
class ConfigProblem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.message}"


class ConfigError(ValueError):
    """A config that must not run; lists every problem with its dotted path."""

    exit_code = CONFIG_ERROR_EXIT_CODE

    def __init__(self, problems: list[ConfigProblem]):
        self.problems = list(problems)
        lines = [f"invalid config ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"]
        lines += [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def config_value(cfg: Mapping, path: str) -> Any:
    """The value at a dotted key path; KeyError naming the path where a level is missing."""
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


def g_safe(cfg: Mapping, path: str) -> Any:
    """``config_value``, or None where a level is missing (for messages and optional keys)."""
    try:
        return config_value(cfg, path)
    except KeyError:
        return None


def import_configured(spec: Any, key: str, form: str = "module:name", label: str = "") -> Any:
    """The object a ``"module:name"`` (or ``file.py:name``) config value names; a ConfigError naming
    ``key`` when the value is not a string or does not import (the importing module's own error)."""
    if not isinstance(spec, str):
        raise ConfigError([ConfigProblem(key, f"must be a '{form}' string, got {spec!r}")])
    try:
        return load_object(spec)
    except Exception as exc:  # ImportError, AttributeError, or an error raised while importing
        raise ConfigError(
            [ConfigProblem(key, f"cannot import {label}{spec!r}: {type(exc).__name__}: {exc}")]
        ) from exc


def rule_problems(holds: Callable[[], object], path: str, message: str) -> list[ConfigProblem]:
    """``[ConfigProblem(path, message)]`` when the cross-field rule ``holds()`` is false; nothing when it
    holds or cannot be evaluated (a missing or mistyped key: the schema check names that one)."""
    try:
        return [] if holds() else [ConfigProblem(path, message)]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return []


def callable_problems(
    cfg: Mapping, path: str, n_args: int | None, kwargs: Mapping[str, Any] | None = None
) -> list[ConfigProblem]:
    """The ``"module:function"`` at ``path`` (if set) imports, is callable and, when ``n_args`` is
    given, accepts ``n_args`` positional arguments and the keywords ``kwargs``."""
    spec = g_safe(cfg, path)
    if spec is None or not isinstance(spec, str):
        return []
    try:
        obj = import_configured(spec, path)
    except ConfigError as exc:
        return list(exc.problems)
    if not callable(obj):
        return [ConfigProblem(path, f"{spec!r} is not callable")]
    if n_args is None:
        return []
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    try:
        sig.bind(*([None] * n_args), **dict(kwargs or {}))
    except TypeError:
        extra = f" and the keywords {sorted(kwargs)}" if kwargs else ""
        return [
            ConfigProblem(
                path,
                f"{spec!r} must accept {n_args} positional arguments{extra}, its signature is "
                f"{spec.split(':')[-1]}{sig}",
            )
        ]
    return []


def _type_name(tp: Any) -> str:
    tp = _enum_as_literal(tp)
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return {
            "str": "string",
            "int": "int",
            "float": "float",
            "bool": "bool",
            "list": "list",
            "dict": "mapping",
        }.get(tp.__name__, tp.__name__)
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(item)}"
    if is_typeddict(tp):
        return "mapping"
    return str(tp)


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}" if not isinstance(value, (dict, list)) else type(value).__name__


def _unwrap_required(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Required, NotRequired):
        return typing.get_args(tp)[0]
    return _enum_as_literal(tp)


def _enum_as_literal(tp: Any) -> Any:
    """A key typed with an enum (``config.algorithm_names``) holds one of its values, as a Literal would."""
    if isinstance(tp, type) and issubclass(tp, Enum):
        return Literal[tuple(member.value for member in tp)]
    return tp


def _check(value: Any, tp: Any, path: str, problems: list[ConfigProblem]) -> bool:
    """Check ``value`` against ``tp``; append problems; return True if the value has the right type."""
    tp = _unwrap_required(tp)
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if value is None and not _matches_type(None, tp):
        hint = f": {REQUIRED_VALUE_HINTS[path]}" if path in REQUIRED_VALUE_HINTS else ""
        problems.append(ConfigProblem(path, f"not set (null), expected {_type_name(tp)}{hint}"))
        return False
    if origin is typing.Annotated:
        return _check_annotated(value, tp, path, problems)
    if origin in (Union, types.UnionType):
        return _check_union(value, tp, path, problems)
    if origin is Literal:
        return _check_literal(value, tp, path, problems)
    if is_typeddict(tp):
        if not isinstance(value, Mapping):
            problems.append(ConfigProblem(path, f"expected a mapping, got {_describe(value)}"))
            return False
        _check_typeddict(value, tp, path, problems)
        return True
    if origin is list:
        return _check_list(value, tp, path, problems)
    if origin is dict or tp is dict:
        return _check_dict(value, tp, path, problems)
    if not _matches_type(value, tp):
        problems.append(ConfigProblem(path, f"expected {_type_name(tp)}, got {_describe(value)}"))
        return False
    return True


def _check_annotated(value: Any, tp: Any, path: str, problems: list[ConfigProblem]) -> bool:
    base, *marks = typing.get_args(tp)
    if not _check(value, base, path, problems):
        return False
    for mark in marks:
        if isinstance(mark, (Ge, Gt, Le)) and value is not None:
            msg = mark.check(value)
            if msg:
                problems.append(ConfigProblem(path, msg))
                return False
    return True


def _check_union(value: Any, tp: Any, path: str, problems: list[ConfigProblem]) -> bool:
    for option in typing.get_args(tp):
        trial: list[ConfigProblem] = []
        if _matches_type(value, option):
            _check(value, option, path, trial)
            problems.extend(trial)
            return not trial
    problems.append(ConfigProblem(path, f"expected {_type_name(tp)}, got {_describe(value)}"))
    return False


def _check_literal(value: Any, tp: Any, path: str, problems: list[ConfigProblem]) -> bool:
    allowed = typing.get_args(tp)
    if value in allowed and type(value) in {type(a) for a in allowed}:
        return True
    close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    problems.append(ConfigProblem(path, f"{value!r} is not one of {list(allowed)}{hint}"))
    return False


def _check_list(value: Any, tp: Any, path: str, problems: list[ConfigProblem]) -> bool:
    if not isinstance(value, list):
        problems.append(ConfigProblem(path, f"expected {_type_name(tp)}, got {_describe(value)}"))
        return False
    (item_tp,) = typing.get_args(tp) or (Any,)
    ok = True
    for i, item in enumerate(value):
        ok = _check(item, item_tp, f"{path}[{i}]", problems) and ok
    return ok


def _check_dict(value: Any, tp: Any, path: str, problems: list[ConfigProblem]) -> bool:
    if not isinstance(value, Mapping):
        problems.append(ConfigProblem(path, f"expected a mapping, got {_describe(value)}"))
        return False
    key_tp, value_tp = typing.get_args(tp) or (Any, Any)
    ok = True
    for key, item in value.items():
        if not _matches_type(key, key_tp):
            problems.append(ConfigProblem(f"{path}.{key}", f"key: expected {_type_name(key_tp)}"))
            ok = False
        elif value_tp is not Any:
            ok = _check(item, value_tp, f"{path}.{key}", problems) and ok
    return ok


def _matches_type(value: Any, tp: Any) -> bool:
    """Shallow type test used to pick the branch of a union."""
    tp = _unwrap_required(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _matches_type(value, typing.get_args(tp)[0])
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is Literal:
        return value is not None and any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    if origin is list:
        return isinstance(value, list)
    if origin is dict or tp is dict or is_typeddict(tp):
        return isinstance(value, Mapping)
    if origin in (Union, types.UnionType):
        return any(_matches_type(value, a) for a in typing.get_args(tp))
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _check_typeddict(value: Mapping, td: type, path: str, problems: list[ConfigProblem]) -> None:
    hints = typing.get_type_hints(td, include_extras=True)
    required = set(getattr(td, "__required_keys__", set(hints)))
    prefix = f"{path}." if path else ""
    for key in value:
        if key not in hints:  # the hint comes from the whole tree: check_against_schema
            problems.append(ConfigProblem(f"{prefix}{key}", UNKNOWN_KEY))
    for key, tp in hints.items():
        if key not in value:
            if key in required:
                problems.append(
                    ConfigProblem(f"{prefix}{key}", f"missing required key (expected {_type_name(tp)})")
                )
            continue
        _check(value[key], tp, f"{prefix}{key}", problems)


UNKNOWN_KEY = "unknown key"


def _typeddict_of(tp: Any) -> Any:
    """The TypedDict a key's type holds (through Required, Annotated, ``| None``), else None."""
    tp = _unwrap_required(tp)
    if typing.get_origin(tp) is typing.Annotated:
        return _typeddict_of(typing.get_args(tp)[0])
    if typing.get_origin(tp) in (Union, types.UnionType):
        found = [_typeddict_of(a) for a in typing.get_args(tp)]
        return next((f for f in found if f is not None), None)
    return tp if is_typeddict(tp) else None


def schema_tree(td: type) -> dict[str, Any]:
    """The keys of a TypedDict schema as a nested dict (a key holding a TypedDict: its keys; else None)."""
    tree: dict[str, Any] = {}
    for key, tp in typing.get_type_hints(td, include_extras=True).items():
        inner = _typeddict_of(tp)
        tree[key] = schema_tree(inner) if inner is not None else None
    return tree


def unknown_key_hint(path: str, tree: Mapping) -> str:
    """What follows "unknown key" for ``path``: the key it moved to, or ``key_names.did_you_mean``."""
    return moved_key_hint(path) or did_you_mean(path, tree)


def _unknown_key_problems(path: str, config: Mapping, tree: Mapping) -> list[ConfigProblem]:
    """An unknown key's problem with its hint; a section of verl keys (``trainer: {save_freq: 5}``)
    gets one problem per verl key in it, each naming our key (and the section's other keys, if any)."""
    value = g_safe(config, path)
    inner = [f"{path}.{sub}" for sub in key_paths(value)] if isinstance(value, Mapping) else []
    verl = [p for p in inner if verl_hint(p)]
    problems = [ConfigProblem(p, UNKNOWN_KEY + verl_hint(p)) for p in verl]
    leaves = [p for p in inner if not isinstance(g_safe(config, p), Mapping)]
    if not verl or any(p not in verl for p in leaves):
        problems.insert(0, ConfigProblem(path, UNKNOWN_KEY + unknown_key_hint(path, tree)))
    return problems


def check_against_schema(config: Mapping, schema: type) -> list[ConfigProblem]:
    """All type / key / enum / range problems of ``config`` against a TypedDict ``schema``; an unknown
    key is matched against every key of the schema (and verl's names)."""
    problems: list[ConfigProblem] = []
    _check_typeddict(config, schema, "", problems)
    if not any(p.message == UNKNOWN_KEY for p in problems):
        return problems
    tree = schema_tree(schema)
    out: list[ConfigProblem] = []
    for p in problems:
        out += _unknown_key_problems(p.path, config, tree) if p.message == UNKNOWN_KEY else [p]
    return out
