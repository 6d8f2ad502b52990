"""The ``reward_model`` config checks: what the configured scorer needs is there before the run starts."""

from __future__ import annotations

import os
import string
from collections.abc import Mapping

from nexrl_hpc.config.validate import ConfigProblem, g_safe
from nexrl_hpc.scoring.classifier import PATH_KEY, classifier_path_problem

TEMPLATE_FIELDS = {"prompt", "response", "answer"}


def template_problem(template: object) -> str | None:
    """Why the judge's rubric is no ``str.format`` template of {prompt}, {response}, {answer}."""
    if not isinstance(template, str):
        return None  # the schema names it
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        return f"is no str.format template ({exc}); write a literal brace as {{{{ or }}}}"
    unknown = sorted(fields - TEMPLATE_FIELDS)
    if unknown:
        return f"names {', '.join(map(repr, unknown))}; its fields are {{prompt}}, {{response}}, {{answer}}"
    if "response" not in fields:
        return "has no {response}: the judge would not see what it grades"
    return None


def _judge_problems(cfg: Mapping) -> list[ConfigProblem]:
    problems = []
    problem = template_problem(g_safe(cfg, "reward_model.judge.prompt_template"))
    if problem:
        problems.append(ConfigProblem("reward_model.judge.prompt_template", problem))
    base_url, model_path = (
        g_safe(cfg, "reward_model.judge.base_url"),
        g_safe(cfg, "reward_model.judge.model_path"),
    )
    if base_url is None:
        if g_safe(cfg, "reward_model.placement") != "own_ranks":
            problems.append(
                ConfigProblem(
                    "reward_model.judge.base_url",
                    "a colocated judge needs a running server's base_url; or set reward_model.placement=own_ranks "
                    "and reward_model.judge.model_path: the run serves the judge on a rank of its own",
                )
            )
        elif not model_path or not os.path.isfile(os.path.join(str(model_path), "config.json")):
            problems.append(
                ConfigProblem(
                    "reward_model.judge.model_path",
                    f"{model_path!r} is not a model directory (no config.json): with base_url=null the run "
                    "serves the judge from it (nothing is downloaded)",
                )
            )
    return problems


def reward_model_problems(cfg: Mapping) -> list[ConfigProblem]:
    """The scorer's model or server, the judge's rubric, and where a model reward can run."""
    kind = g_safe(cfg, "reward_model.type")
    if kind is None:
        return []
    problems = []
    if g_safe(cfg, "rollout_worker.type") != "single_turn":
        problems.append(
            ConfigProblem(
                "reward_model.type",
                f"a model reward scores single-turn rollouts: set rollout_worker.type=single_turn "
                f"(not {g_safe(cfg, 'rollout_worker.type')})",
            )
        )
    if kind == "classifier":
        problem = classifier_path_problem(g_safe(cfg, PATH_KEY))
        if problem:
            problems.append(ConfigProblem(PATH_KEY, problem))
    elif kind == "judge":
        problems += _judge_problems(cfg)
    return problems
