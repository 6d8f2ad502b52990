"""Workflows: the orchestration of agents and environments for one task.

``run`` drives the interaction and ends by raising ``TerminationEvent(reason)``;
``run_with_termination_handling`` turns that (or a timeout, or any exception -> ERROR) into an
Episode whose trajectories have rewards and Monte Carlo returns (``postprocess_episode``).
Environment calls run in the executor (they may block: sandboxed code, reward parsers).
"""

from __future__ import annotations

import asyncio
import functools
import traceback
from abc import ABC, abstractmethod
from concurrent.futures import Executor
from typing import Any

from nexrl_hpc.agents.agent import BaseAgent
from nexrl_hpc.agents.environments import BaseEnv
from nexrl_hpc.agents.rollout_engine import RolloutEngine
from nexrl_hpc.agents.types import Episode, ModelOutput, TerminationReason, Trajectory

CONTEXT_LENGTH_MESSAGE = "maximum context length"
"""What vLLM, SGLang and nexrl_hpc's server say when prompt + max_tokens does not fit the model."""


class TerminationEvent(Exception):
    """Raised inside ``run`` to end the episode with ``reason``."""

    def __init__(self, reason: TerminationReason = TerminationReason.UNKNOWN) -> None:
        super().__init__(reason.value)
        self.reason = reason


def adjust_step_rewards(trajectory: Trajectory, gamma: float = 0.0, reward_bonus_coeff: float = 0.0) -> None:
    """Reward-bonus shaping, then discounted Monte Carlo returns.

    Bonus: ``r_i += coeff * (raw_r_i - raw_r_{i-1})`` for i >= 1, on the environment's raw rewards
    (so the shaping of step i does not feed into step i+1's). Returns: ``G_i = r_i + gamma * G_{i+1}``;
    gamma 0 makes each return its step's reward.
    """
    steps = trajectory.steps
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if reward_bonus_coeff:
        raw = [s.reward for s in steps]
        for i in range(1, len(steps)):
            steps[i].reward = raw[i] + reward_bonus_coeff * (raw[i] - raw[i - 1])
    ret = 0.0
    for step in reversed(steps):
        ret = step.reward + gamma * ret
        step.mc_return = ret


class Workflow(ABC):
    """Subclass and implement ``run``; agents/envs stored as attributes are reset and collected automatically.

    ``timeout`` (seconds) bounds one ``run``; ``gamma`` / ``reward_bonus_coeff`` shape rewards in
    ``postprocess_episode``.
    """

    def __init__(
        self,
        rollout_engine: RolloutEngine,
        executor: Executor | None = None,
        timeout: float | None = None,
        gamma: float = 0.0,
        reward_bonus_coeff: float = 0.0,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unknown argument(s) {sorted(kwargs)}")
        self.rollout_engine = rollout_engine
        self.executor = executor
        self.timeout = timeout
        self.gamma = gamma
        self.reward_bonus_coeff = reward_bonus_coeff
        self.task: Any = None
        self.uid: str = ""
        self._committed: list[Trajectory] = []
        self._committed_agents: set[int] = set()

    # --- lifecycle -----------------------------------------------------------------------------
    @abstractmethod
    async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode | None: ...

    def reset(self, task: Any = None, uid: str | None = None) -> None:
        """Fresh agents and environments state for a new task (environments are reset by ``run``)."""
        self.task = task
        self.uid = uid or ""
        self._committed = []
        self._committed_agents = set()
        for agent in self._agents():
            agent.reset()

    def commit(
        self, name: str | None = None, agent: BaseAgent | None = None, trajectory: Trajectory | None = None
    ) -> None:
        """Record a trajectory (or an agent's) for this episode; an agent is committed once."""
        if (agent is None) == (trajectory is None):
            raise ValueError("commit takes exactly one of agent= or trajectory=")
        if agent is not None:
            if id(agent) in self._committed_agents:
                return
            self._committed_agents.add(id(agent))
            trajectory = agent.trajectory
        assert trajectory is not None
        if name is not None:
            trajectory.name = name
        if trajectory.task is None:
            trajectory.task = self.task
        self._committed.append(trajectory)

    def collect_trajectories(self) -> Episode:
        """The committed trajectories plus those of agents nobody committed (if they took a step)."""
        for name, agent in self._named_agents():
            if id(agent) not in self._committed_agents and agent.trajectory.steps:
                self.commit(name=name, agent=agent)
        return Episode(id=self.uid, task=self.task, trajectories=list(self._committed))

    def postprocess_episode(
        self, episode: Episode, termination_reason: TerminationReason, error: dict[str, Any] | None = None
    ) -> Episode:
        """Trajectory rewards (sum of step rewards), shaped step rewards, MC returns, correctness, metrics."""
        episode.termination_reason = termination_reason
        episode.error = error
        for trajectory in episode.trajectories:
            trajectory.reward = float(sum(s.reward for s in trajectory.steps))
            adjust_step_rewards(trajectory, self.gamma, self.reward_bonus_coeff)
        episode.is_correct = self.is_correct(episode)
        episode.metrics = self.episode_metrics(episode)
        return episode

    def is_correct(self, episode: Episode) -> bool:
        """The last step's ``info["is_correct"]`` when an env reported it, else trajectory reward > 0."""
        verdicts = []
        for trajectory in episode.trajectories:
            reported = [
                s.info["is_correct"] for s in trajectory.steps if s.info.get("is_correct") is not None
            ]
            verdicts.append(bool(reported[-1]) if reported else trajectory.reward > 0)
        return bool(verdicts) and all(verdicts)

    def episode_metrics(self, episode: Episode) -> dict[str, Any]:
        steps = [s for t in episode.trajectories for s in t.steps]
        last_info = steps[-1].info if steps else {}
        metrics: dict[str, Any] = {
            "num_steps": len(steps),
            "reward": sum(t.reward for t in episode.trajectories),
            "is_correct": float(episode.is_correct),
        }
        for key in ("num_tool_calls", "num_tool_errors"):
            if key in last_info:
                metrics[key] = last_info[key]
        for key in ("reward/errors", "reward/timeouts"):  # failed reward calls of every step (scored 0)
            counts = [s.info.get("reward_metadata", {}).get(key) for s in steps if isinstance(s.info, dict)]
            if any(c is not None for c in counts):
                metrics[key] = sum(float(c or 0.0) for c in counts)
        for t in episode.trajectories:
            metrics[f"{t.name}/reward"] = t.reward
        return metrics

    async def run_with_termination_handling(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode:
        """``run`` bounded by ``timeout``; every way it can end becomes an Episode with a reason."""
        error: dict[str, Any] | None = None
        try:
            if self.timeout is not None:
                episode = await asyncio.wait_for(self.run(task, uid, **kwargs), self.timeout)
            else:
                episode = await self.run(task, uid, **kwargs)
            reason = (
                episode.termination_reason
                if episode is not None and episode.termination_reason is not None
                else TerminationReason.UNKNOWN
            )
        except TerminationEvent as event:
            episode, reason = None, event.reason
        except asyncio.TimeoutError:
            episode, reason = None, TerminationReason.TIMEOUT
        except Exception as exc:  # any bug or failure in the episode: reported, retried by the engine
            episode, reason = None, TerminationReason.ERROR
            error = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        if episode is None:
            episode = self.collect_trajectories()
        episode.id = episode.id or uid
        episode.task = episode.task if episode.task is not None else task
        return self.postprocess_episode(episode, reason, error)

    # --- helpers ---------------------------------------------------------------------------------
    async def run_in_executor(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput:
        """The engine's answer; a server's "maximum context length" refusal ends the episode with
        MAX_PROMPT_LENGTH_EXCEEDED (deterministic: retrying it as an ERROR would fail again)."""
        try:
            return await self.rollout_engine.get_model_response(messages, **kwargs)
        except Exception as exc:
            if CONTEXT_LENGTH_MESSAGE in str(exc):
                raise TerminationEvent(TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED) from exc
            raise

    def _named_agents(self) -> list[tuple[str, BaseAgent]]:
        return [(k, v) for k, v in vars(self).items() if isinstance(v, BaseAgent)]

    def _agents(self) -> list[BaseAgent]:
        return [a for _, a in self._named_agents()]

    def envs(self) -> list[BaseEnv]:
        return [v for v in vars(self).values() if isinstance(v, BaseEnv)]

    def is_multithread_safe(self) -> bool:
        return all(env.is_multithread_safe() for env in self.envs())


class MultiTurnWorkflow(Workflow):
    """One agent, one env, up to ``max_steps`` model turns (the agent model's multi-turn loop).

    Ends with ENV_DONE, MAX_TURNS_EXCEEDED, MAX_RESPONSE_LENGTH_EXCEEDED (a turn cut off by the
    token limit, or the episode's response — completions plus environment tokens after the first
    prompt — longer than ``max_response_length``) or MAX_PROMPT_LENGTH_EXCEEDED (a turn's prompt
    longer than ``max_prompt_length``). ``sampling`` are per-call kwargs for the rollout engine.
    ``score_truncated``: a turn cut off by a length limit still goes to ``env.step`` (its reward
    is kept, the episode still ends), so an env with shaped rewards can score a model that has not
    yet learnt to stop; by default the cut-off turn earns nothing.
    """

    def __init__(
        self,
        rollout_engine: RolloutEngine,
        agent_cls: type[BaseAgent] | None = None,
        env_cls: type[BaseEnv] | None = None,
        agent_args: dict[str, Any] | None = None,
        env_args: dict[str, Any] | None = None,
        agent: BaseAgent | None = None,
        env: BaseEnv | None = None,
        max_steps: int = 5,
        max_response_length: int | None = None,
        max_prompt_length: int | None = None,
        sampling: dict[str, Any] | None = None,
        score_truncated: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(rollout_engine, **kwargs)
        if agent is None:
            if agent_cls is None:
                raise ValueError(f"{type(self).__name__} needs agent_cls (or an agent instance)")
            agent = agent_cls(**(agent_args or {}))
        if env is None:
            if env_cls is None:
                raise ValueError(f"{type(self).__name__} needs env_cls (or an env instance)")
            env = env_cls.from_dict(dict(env_args or {}))
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.agent = agent
        self.env = env
        self.max_steps = max_steps
        self.max_response_length = max_response_length
        self.max_prompt_length = max_prompt_length
        self.sampling = dict(sampling or {})
        self.score_truncated = score_truncated

    async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode | None:
        self.reset(task=task, uid=uid)
        observation, info = await self.run_in_executor(self.env.reset, task)
        self.agent.update_from_env(observation, 0.0, False, info)
        first_prompt_length: int | None = None
        for _ in range(self.max_steps):
            output = await self.get_model_response(self.agent.chat_completions, **self.sampling)
            action = self.agent.update_from_model(output)
            if first_prompt_length is None:
                first_prompt_length = output.prompt_length
            if self.max_prompt_length is not None and output.prompt_length > self.max_prompt_length:
                raise TerminationEvent(TerminationReason.MAX_PROMPT_LENGTH_EXCEEDED)
            response_length = output.prompt_length + output.completion_length - first_prompt_length
            if output.finish_reason == "length" or (
                self.max_response_length is not None and response_length > self.max_response_length
            ):
                if self.score_truncated:  # the env still scores the cut-off turn (shaped rewards)
                    observation, reward, _, info = await self.run_in_executor(self.env.step, action.action)
                    self.agent.update_from_env(observation, reward, True, info)
                raise TerminationEvent(TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED)
            observation, reward, done, info = await self.run_in_executor(self.env.step, action.action)
            self.agent.update_from_env(observation, reward, done, info)
            if done:
                raise TerminationEvent(TerminationReason.ENV_DONE)
        raise TerminationEvent(TerminationReason.MAX_TURNS_EXCEEDED)


class SingleTurnWorkflow(MultiTurnWorkflow):
    """One model turn; the env's step ends the episode (ENV_DONE) or the turn limit does."""

    def __init__(self, rollout_engine: RolloutEngine, **kwargs: Any) -> None:
        if kwargs.get("max_steps", 1) != 1:
            raise ValueError(f"SingleTurnWorkflow takes one step; got max_steps={kwargs['max_steps']}")
        kwargs["max_steps"] = 1
        super().__init__(rollout_engine, **kwargs)
