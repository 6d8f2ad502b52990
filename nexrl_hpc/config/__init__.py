"""Config: Hydra composition, OmegaConf resolvers, schema validation with one error listing every problem.

The ground floor: imports no other folder of the package. The cross-field checks live with the
rooms that own the settings and are gathered by ``nexrl_hpc.assembly`` (whose ``validate_config``
is the full check); ``checked_config`` runs the schema check and the checks it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.config.validate import ConfigError, ConfigProblem, check_against_schema

__all__ = ["ConfigError", "ConfigProblem", "checked_config", "register_resolvers", "resolve_config"]


def register_resolvers() -> None:
    """``${mul:a,b}`` and ``${floordiv:a,b}`` for derived sizes (e.g. trajectories per batch =
    prompts x samples; DAPO's overlong buffer = a fifth of the response budget)."""
    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda a, b: int(a) * int(b))
    if not OmegaConf.has_resolver("floordiv"):
        OmegaConf.register_new_resolver("floordiv", lambda a, b: int(a) // int(b))


def resolve_config(cfg: DictConfig | Mapping) -> tuple[dict[str, Any], list[ConfigProblem], dict[str, str]]:
    """Plain dict with interpolations resolved; an unresolvable interpolation is a problem at its key.

    Also returns the raw interpolation string of every interpolated key (to trace follow-on errors).
    """
    interpolations: dict[str, str] = {}
    if not isinstance(cfg, DictConfig):
        return dict(cfg), [], interpolations
    problems: list[ConfigProblem] = []
    cfg = cfg.copy()
    OmegaConf.set_readonly(cfg, False)

    def walk(node: Any, prefix: str) -> None:
        keys: Iterable[Any] = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(node, DictConfig) and OmegaConf.is_interpolation(node, key):
                interpolated = node._get_node(key)
                assert interpolated is not None  # is_interpolation: the key has a node
                interpolations[path] = str(interpolated._value())
            if isinstance(node, DictConfig) and OmegaConf.is_missing(node, key):
                problems.append(ConfigProblem(path, "missing required value (???)"))
                node[key] = None
                continue
            try:
                value = node[key]
            except Exception as exc:  # InterpolationResolutionError and friends
                problems.append(ConfigProblem(path, f"cannot resolve: {exc}".split("\n")[0]))
                node[key] = None
                continue
            if isinstance(value, (DictConfig,)) or OmegaConf.is_list(value):
                walk(value, path)

    walk(cfg, "")
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    return cast("dict[str, Any]", container), problems, interpolations  # the top-level keys are names


def _drop_follow_on(problems: list[ConfigProblem], interpolations: dict[str, str]) -> list[ConfigProblem]:
    """Keep a problem at a key only if it is not just a copy (by interpolation) of a problem elsewhere."""
    bad = {p.path for p in problems}
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for path, raw in interpolations.items():
            if path not in tainted and any(
                "${" + b + "}" in raw or "${" + b + "," in raw or "," + b + "}" in raw
                for b in bad | tainted
                if b != path
            ):
                tainted.add(path)
                changed = True
    out: list[ConfigProblem] = []
    seen: set[tuple[str, str]] = set()
    for p in problems:
        if p.path in tainted or (p.path, p.message) in seen:
            continue
        seen.add((p.path, p.message))
        out.append(p)
    return out


def checked_config(
    cfg: DictConfig | Mapping, cross_field_problems: Callable[[Mapping], list[ConfigProblem]]
) -> RLTrainConfig:
    """Resolve and check ``cfg`` against the schema and with ``cross_field_problems`` (the rooms'
    checks, ``nexrl_hpc.assembly.checks.semantic_problems``); raise ``ConfigError`` listing every
    problem (exit code 2)."""
    register_resolvers()
    container, problems, interpolations = resolve_config(cfg)
    problems += check_against_schema(container, RLTrainConfig)
    problems += cross_field_problems(container)
    problems = _drop_follow_on(problems, interpolations)
    if problems:
        raise ConfigError(problems)
    return container  # type: ignore[return-value]
