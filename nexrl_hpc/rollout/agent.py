"""AgentRolloutWorker (``rollout_worker.type=agent``): one workflow episode per task, into the TrajectoryPool.

Why a worker of its own: a multi-turn episode alternates model turns with environment / tool
text, so its trajectory is one sequence whose loss mask trains only the model's tokens
(``trajectory_to_sequence``: model tokens 1, prompt / environment / tool tokens 0) with the
server's behaviour logprobs. Everything else (fetching, validation routing, re-rollout, batching
puts) is the base worker's: validation episodes go to the validator because ``_aput_trajectory``
routes by the task's context.

Episode numbers (turns, termination reason, tool calls/errors, correctness) travel in the
trajectory's ``scores``; the validator and the advantage processor average them into metrics.jsonl.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

from nexrl_hpc.agents.agent import BaseAgent
from nexrl_hpc.agents.environments import BaseEnv
from nexrl_hpc.agents.rollout_engine import ClientRolloutEngine, RolloutEngine
from nexrl_hpc.agents.runners import WorkflowRunner
from nexrl_hpc.agents.sequence import cumulative_turns, trajectory_to_sequence
from nexrl_hpc.agents.tools.base import Tool
from nexrl_hpc.agents.tools.registry import get_tool_class
from nexrl_hpc.agents.types import Episode, ModelOutput, TerminationReason
from nexrl_hpc.agents.types import Trajectory as AgentTrajectory
from nexrl_hpc.agents.workflow import Workflow
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.config.validate import ConfigError, ConfigProblem, import_configured
from nexrl_hpc.rewards.guard import GuardedReward
from nexrl_hpc.rewards.loader import load_reward
from nexrl_hpc.rewards.runner import ERRORS, TIMEOUTS
from nexrl_hpc.rollout.base import UNDECODABLE_TOKENS, BaseRolloutWorker
from nexrl_hpc.types import PutStatus, Trajectory

KEY = "rollout_worker.agent"


def _load_class(spec: Any, key: str, base: type) -> type[Any]:
    """Import ``module:Class`` and check it subclasses ``base``; a ConfigError names ``key`` otherwise."""
    obj = import_configured(spec, key, form="module:Class")
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ConfigError([ConfigProblem(key, f"{spec!r} is not a subclass of {base.__qualname__}")])
    return obj


def _tool_map(specs: Mapping[str, Any]) -> dict[str, type[Tool]]:
    return {name: _load_class(spec, f"{KEY}.tool_map.{name}", Tool) for name, spec in specs.items()}


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def episode_limits(config: RLTrainConfig) -> dict[str, Any]:
    """A multi-turn workflow's turn, length and time limits and its reward shaping (``rollout_worker.agent``)."""
    rw = config["rollout_worker"]
    agent_cfg = rw["agent"]
    return {
        "max_steps": agent_cfg["max_turns"],
        "max_response_length": agent_cfg["max_episode_length"],
        "max_prompt_length": rw["max_prompt_length"],
        "gamma": agent_cfg["gamma"],
        "reward_bonus_coeff": agent_cfg["reward_bonus_coeff"],
        "timeout": agent_cfg["timeout_s"],
    }


def build_workflow_args(config: RLTrainConfig) -> tuple[type[Workflow], dict[str, Any]]:
    """(workflow class, its kwargs) from ``rollout_worker.agent``; raises ConfigError naming the key."""
    rw = config["rollout_worker"]
    agent_cfg = rw["agent"]
    workflow_cls = _load_class(agent_cfg["workflow"], f"{KEY}.workflow", Workflow)
    agent_cls = _load_class(agent_cfg["agent_cls"], f"{KEY}.agent_cls", BaseAgent)
    env_cls = _load_class(agent_cfg["env_cls"], f"{KEY}.env_cls", BaseEnv)
    tools = list(agent_cfg["tools"] or [])
    for i, name in enumerate(tools):
        try:
            get_tool_class(name)
        except KeyError as exc:
            raise ConfigError([ConfigProblem(f"{KEY}.tools[{i}]", str(exc.args[0]))]) from None
    tool_map = _tool_map(agent_cfg["tool_map"] or {})
    agent_args = dict(agent_cfg["agent_args"] or {})
    env_args = dict(agent_cfg["env_args"] or {})
    for args, accepts in (
        (agent_args, _accepts(agent_cls.__init__, "tools")),
        (env_args, _accepts(env_cls.__init__, "tools")),
    ):
        if accepts and tools:
            args.setdefault("tools", tools)
        if accepts and tool_map:
            args.setdefault("tool_map", tool_map)
    # the one reward API: any accepted signature, scored as the single-turn worker scores (a reward
    # that raises or runs past reward_timeout_s scores 0 and is counted, the episode goes on)
    reward_spec = env_args.get("reward_fn")
    if isinstance(reward_spec, str):
        reward = load_reward(reward_spec, f"{KEY}.env_args.reward_fn")
        env_args["reward_fn"] = GuardedReward(reward, rw["reward_timeout_s"], rw["reward_threads"])
    elif reward_spec is None and _accepts(env_cls.__init__, "reward_fn"):
        # one function: the config check refuses a list of them for an agent rollout
        reward = load_reward(str(rw["reward_fn"]), "rollout_worker.reward_fn")
        env_args["reward_fn"] = GuardedReward(reward, rw["reward_timeout_s"], rw["reward_threads"])
    workflow_args: dict[str, Any] = {
        "agent_cls": agent_cls,
        "env_cls": env_cls,
        "agent_args": agent_args,
        "env_args": env_args,
        **episode_limits(config),
    }
    workflow_args.update(agent_cfg["workflow_args"] or {})
    return workflow_cls, workflow_args


def agent_config_problems(cfg: Mapping[str, Any]) -> list[ConfigProblem]:
    """Start-up checks of ``rollout_worker.agent`` (class paths, tools, reward fn, a chat template)."""
    problems: list[ConfigProblem] = []
    try:
        workflow_cls, args = build_workflow_args(cfg)  # type: ignore[arg-type]
        # one instance proves the agent/env/workflow arguments fit their constructors
        workflow_cls(rollout_engine=_NoModel(), **args)
    except ConfigError as exc:
        problems += exc.problems
    except Exception as exc:
        problems.append(
            ConfigProblem(KEY, f"cannot build the workflow from this section: {type(exc).__name__}: {exc}")
        )
    model = cfg.get("model") or {}
    if model.get("path") is None and not (model.get("tiny") or {}).get("tokenizer", {}).get("chat_template"):
        problems.append(
            ConfigProblem(
                "model.tiny.tokenizer.chat_template",
                "rollout_worker.type=agent sends chat requests: the tiny model's tokenizer needs a chat template",
            )
        )
    return problems


class _NoModel(RolloutEngine):
    """Stands in for the model when a workflow is built only to check its arguments."""

    async def get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput:
        raise RuntimeError("a workflow built by the config check has no model")


class _WorkerRolloutEngine(ClientRolloutEngine):
    """The client with the worker's sampling of the moment (greedy in validation, sampled in training)."""

    def __init__(self, client: Any, sampling: Callable[[], dict[str, Any]]) -> None:
        super().__init__(client)
        self._sampling = sampling

    async def get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput:
        return await super().get_model_response(messages, **{**self._sampling(), **kwargs})


def episode_scores(episode: Episode, reward: float) -> dict[str, float]:
    """Per-episode numbers averaged into metrics: reward, correctness, turns, tool use, termination."""
    metrics = episode.metrics or {}
    scores = {
        "reward": float(reward),
        "is_correct": float(bool(episode.is_correct)),
        "num_turns": float(metrics.get("num_steps", 0)),
        "num_tool_calls": float(metrics.get("num_tool_calls", 0)),
        "num_tool_errors": float(metrics.get("num_tool_errors", 0)),
        ERRORS: float(metrics.get(ERRORS, 0)),  # reward calls that failed or timed out (scored 0)
        TIMEOUTS: float(metrics.get(TIMEOUTS, 0)),
    }
    reason = episode.termination_reason
    for r in TerminationReason:
        scores[f"termination/{r.value}"] = float(reason == r)
    return scores


class AgentRolloutWorker(BaseRolloutWorker):
    """Runs ``rollout_worker.agent.workflow`` on each task through a WorkflowRunner (retry on ERROR)."""

    def __init__(self, config: RLTrainConfig):
        super().__init__(config)
        self._workflow_cls, self._workflow_args = self._workflow(config)
        self._retry_limit = config["rollout_worker"]["agent"]["retry_limit"]
        self._runner: WorkflowRunner | None = None

    def _workflow(self, config: RLTrainConfig) -> tuple[type[Workflow], dict[str, Any]]:
        """The workflow class and its kwargs (``rollout_worker.agent``)."""
        return build_workflow_args(config)

    def _workflow_runner(self) -> WorkflowRunner:
        """Made on first use: the LLM client exists only once ``run`` started."""
        if self._runner is None:
            self._runner = WorkflowRunner(
                self._workflow_cls,
                self._workflow_args,
                _WorkerRolloutEngine(self._llm_client, self._sampling_kwargs),
                n_parallel_tasks=self._max_concurrency,
                retry_limit=self._retry_limit,
            )
        return self._runner

    async def step(self, task: dict[str, Any]) -> PutStatus | None:
        episode = await self._workflow_runner().process_task_with_retry(task, str(task.get("uid", "")))
        trajectory = self.episode_to_trajectory(task, episode, self._model_tag)
        if trajectory is None:
            return PutStatus.FAIL
        trajectory["scores"][UNDECODABLE_TOKENS] = self._undecodable_tokens(trajectory["response_ids"])
        return await self._aput_trajectory(trajectory)

    @staticmethod
    def episode_to_trajectory(task: dict[str, Any], episode: Episode, model_tag: str) -> Trajectory | None:
        """Task fields + the episode as one training sequence; None when there is nothing to train on.

        An ERROR episode (after retries) or one without a model turn is dropped (reported by the
        base worker) rather than trained with a made-up reward. When a turn's prompt does not
        extend the previous turn's prompt + completion (the chat template did not reproduce the
        completion, e.g. a sampled special token that the decoded text leaves out), the turns from
        there on were sampled from a context one sequence cannot hold: the exact prefix trains,
        with the episode's outcome, and ``scores["context_mismatch"]`` counts it.
        """
        if episode.termination_reason == TerminationReason.ERROR:
            return None
        trained = [t for t in episode.trajectories if t.steps]
        if not trained:
            return None
        if len(trained) != 1:
            raise ValueError(
                f"episode {episode.id!r} has {len(trained)} trajectories with steps; the agent worker "
                "trains one sequence per task (a multi-agent workflow needs a worker that groups them)"
            )
        (agent_trajectory,) = trained
        kept = cumulative_turns(agent_trajectory)
        mismatch = kept < len(agent_trajectory.steps)
        if mismatch:
            agent_trajectory = AgentTrajectory(
                name=agent_trajectory.name,
                task=agent_trajectory.task,
                steps=agent_trajectory.steps[:kept],
                reward=agent_trajectory.reward,
                info=agent_trajectory.info,
            )
        sequence = trajectory_to_sequence(agent_trajectory)
        trajectory: dict[str, Any] = dict(task)  # the task's own fields ride along
        trajectory.update(sequence.to_trajectory_fields())
        reward_errors = [s.info["reward_error"] for s in agent_trajectory.steps if s.info.get("reward_error")]
        if reward_errors:  # the run stops at max_reward_error_frac with this message
            trajectory["reward_error"] = reward_errors[0]
        trajectory.update(
            model_tag=model_tag,
            response="".join(s.model_response for s in agent_trajectory.steps),
            termination_reason=episode.termination_reason.value if episode.termination_reason else None,
            scores={**episode_scores(episode, sequence.reward), "context_mismatch": float(mismatch)},
        )
        return cast(Trajectory, trajectory)
