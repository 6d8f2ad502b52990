"""Which task preset a command line gets when it names none: your own model or data mean ``task=custom``.

The defaults list of ``rl_train.yaml`` picks ``task: max_digit``, the embedded toy task. Hydra's
defaults cannot depend on config values, so the choice is made on the overrides, before Hydra
composes them: a command line that sets ``model.path`` or a ``data.type`` other than ``task`` and
names no task gets ``task=custom`` (configs/task/custom.yaml: no task reward, LLM-sized lengths,
lr 1e-6); an explicit ``task=<name>`` always wins. ``launch.train`` and ``nexrl_hpc.train`` both
apply it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException

CUSTOM_TASK = "custom"
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn"}
_FLAGS_WITH_VALUE |= {"--config-dir", "-cd", "--experimental-rerun"}
_INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def overrides_of(argv: Sequence[str]) -> list[str]:
    """The overrides of a ``launch.train`` command line: its Hydra flags and their values left out."""
    out: list[str] = []
    skip_next = False
    for i, arg in enumerate(argv):
        if skip_next:
            skip_next = False
        elif arg.startswith("-"):
            skip_next = arg in _FLAGS_WITH_VALUE or (
                arg in ("--info", "-i") and i + 1 < len(argv) and argv[i + 1] in _INFO_TOPICS
            )
        else:
            out.append(arg)
    return out


def _values(override: Override) -> list[str | None]:
    """The value(s) an override sets, as strings (every point of a sweep); None for null or a delete."""
    if override.is_delete():
        return [None]
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    value = override.value()
    return [None if value is None else str(value)]


def custom_task_reason(overrides: Sequence[str], own_data: str | None = None) -> str | None:
    """Why ``overrides`` (a command line: Hydra's flags are passed over) get ``task=custom`` (the override that asks for it), or None: a task is
    named, nothing of the user's own is given, or the overrides do not parse (the config check
    names those). ``own_data``: the reason when the caller hands in data of its own (the Python API's
    ``train_dataset``), which the overrides do not show."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides_of(overrides))
    except HydraException:
        return None
    if any(o.key_or_group == "task" or o.key_or_group.startswith("task/") for o in parsed):
        return None
    if own_data is not None:
        return own_data
    for o in parsed:
        values = _values(o)
        if o.key_or_group == "model.path" and any(v not in (None, "null") for v in values):
            return f"model.path={values[0]}"
        if o.key_or_group == "data.type" and all(v not in (None, "task") for v in values):
            return f"data.type={values[0]}"
    return None


def with_task_choice(overrides: Sequence[str], own_data: str | None = None) -> list[str]:
    """``overrides`` with ``task=custom`` appended when ``custom_task_reason`` finds a reason."""
    out = list(overrides)
    if custom_task_reason(overrides, own_data) is not None:
        out.append(f"task={CUSTOM_TASK}")
    return out
