"""WorkflowRunner (a pool of workflows with retry) and AgentRunner (the simple agent+env path).

Both run on one asyncio loop; environment calls go to a thread pool, so environments run in
parallel threads only when their class says ``is_multithread_safe()`` — otherwise construction
with more than one parallel slot is refused with an error naming the class.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nexrl_hpc.agents.agent import BaseAgent
from nexrl_hpc.agents.environments import BaseEnv
from nexrl_hpc.agents.rollout_engine import RolloutEngine
from nexrl_hpc.agents.types import Episode, TerminationReason
from nexrl_hpc.agents.workflow import MultiTurnWorkflow, Workflow

logger = logging.getLogger(__name__)


class NotThreadSafeError(ValueError):
    """An environment that is not multithread-safe was asked to run in parallel."""


def _check_thread_safety(workflows: Sequence[Workflow], what: str, env_cls: Any = None) -> None:
    """Envs the workflows hold, and ``env_cls`` from the workflow args (workflows may make envs in ``run``)."""
    if len(workflows) <= 1:
        return
    unsafe = {type(e).__qualname__ for w in workflows for e in w.envs() if not e.is_multithread_safe()}
    if isinstance(env_cls, type) and issubclass(env_cls, BaseEnv) and not env_cls.is_multithread_safe():
        unsafe.add(env_cls.__qualname__)
    if unsafe:
        raise NotThreadSafeError(
            f"{what} > 1 runs environments in parallel threads, but {', '.join(sorted(unsafe))} "
            "is not multithread-safe (is_multithread_safe() returns False); use 1 or make the env safe"
        )


class WorkflowRunner:
    """``n_parallel_tasks`` workflow instances; each task takes a free one, runs, and gives it back.

    An episode that ends in ERROR is retried (up to ``retry_limit`` attempts in all); every other
    termination reason is an outcome of the policy and is returned as is. ``episode.info["attempts"]``
    says how many attempts it took.
    """

    def __init__(
        self,
        workflow_cls: type[Workflow],
        workflow_args: dict[str, Any],
        rollout_engine: RolloutEngine,
        n_parallel_tasks: int = 128,
        retry_limit: int = 3,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        if n_parallel_tasks < 1:
            raise ValueError(f"n_parallel_tasks must be >= 1, got {n_parallel_tasks}")
        if retry_limit < 1:
            raise ValueError(f"retry_limit must be >= 1 (the first attempt counts), got {retry_limit}")
        self.workflow_cls = workflow_cls
        self.workflow_args = dict(workflow_args)
        self.rollout_engine = rollout_engine
        self.n_parallel_tasks = n_parallel_tasks
        self.retry_limit = retry_limit
        self.executor = executor or ThreadPoolExecutor(max_workers=min(n_parallel_tasks, 32))
        self.workflows = [
            workflow_cls(rollout_engine=rollout_engine, executor=self.executor, **self.workflow_args)
            for _ in range(n_parallel_tasks)
        ]
        _check_thread_safety(self.workflows, "n_parallel_tasks", self.workflow_args.get("env_cls"))
        self._queue: asyncio.Queue[Workflow] | None = None

    def _pool(self) -> asyncio.Queue[Workflow]:
        """The queue is made on first use, inside the loop that will use it."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            for workflow in self.workflows:
                self._queue.put_nowait(workflow)
        return self._queue

    async def process_task_with_retry(
        self, task: dict[str, Any], task_id: str, rollout_idx: int = 0
    ) -> Episode:
        uid = f"{task_id}:{rollout_idx}"
        pool = self._pool()
        episode: Episode | None = None
        for attempt in range(1, self.retry_limit + 1):
            workflow = await pool.get()
            try:
                episode = await workflow.run_with_termination_handling(task, uid)
            finally:
                pool.put_nowait(workflow)
            episode.info["attempts"] = attempt
            if episode.termination_reason != TerminationReason.ERROR:
                return episode
            logger.warning(
                "episode %s attempt %d/%d ended in error: %s",
                uid,
                attempt,
                self.retry_limit,
                (episode.error or {}).get("message"),
            )
        assert episode is not None
        return episode

    async def execute_tasks(
        self, tasks: list[dict[str, Any]], task_ids: list[str] | None = None, n: int = 1
    ) -> list[Episode]:
        """Each task ``n`` times (a GRPO group), all concurrently up to the pool size; results in input order."""
        if task_ids is not None and len(task_ids) != len(tasks):
            raise ValueError(f"{len(task_ids)} task_ids for {len(tasks)} tasks")
        ids = task_ids or [str(task.get("uid", i)) for i, task in enumerate(tasks)]
        jobs = [
            self.process_task_with_retry(task, task_id, k)
            for task, task_id in zip(tasks, ids)
            for k in range(n)
        ]
        return list(await asyncio.gather(*jobs))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)


class AgentRunner:
    """The simple execution path: ``n_parallel_agents`` (agent, env) pairs run tasks with a multi-turn loop.

    Each pair is driven by a MultiTurnWorkflow (same termination reasons, MC returns with ``gamma``);
    no retries — a failed episode comes back with reason ERROR.
    """

    def __init__(
        self,
        agent_class: type[BaseAgent],
        env_class: type[BaseEnv],
        rollout_engine: RolloutEngine,
        agent_args: dict[str, Any] | None = None,
        env_args: dict[str, Any] | None = None,
        n_parallel_agents: int = 1,
        max_steps: int = 5,
        gamma: float = 0.2,
        reward_bonus_coeff: float = 0.0,
        max_response_length: int | None = None,
        max_prompt_length: int | None = None,
        trajectory_timeout: float | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        if n_parallel_agents < 1:
            raise ValueError(f"n_parallel_agents must be >= 1, got {n_parallel_agents}")
        self.agents = [agent_class(**(agent_args or {})) for _ in range(n_parallel_agents)]
        self.envs = [env_class.from_dict(dict(env_args or {})) for _ in range(n_parallel_agents)]
        self.rollout_engine = rollout_engine
        self.executor = ThreadPoolExecutor(max_workers=min(n_parallel_agents, 32))
        self._workflows = [
            MultiTurnWorkflow(
                rollout_engine,
                agent=agent,
                env=env,
                max_steps=max_steps,
                max_response_length=max_response_length,
                max_prompt_length=max_prompt_length,
                sampling=sampling,
                executor=self.executor,
                timeout=trajectory_timeout,
                gamma=gamma,
                reward_bonus_coeff=reward_bonus_coeff,
            )
            for agent, env in zip(self.agents, self.envs)
        ]
        _check_thread_safety(self._workflows, "n_parallel_agents")

    async def run_agent_trajectory_async(
        self, idx: int, task: dict[str, Any], uid: str | None = None
    ) -> Episode:
        """Run ``task`` on pair ``idx`` (the caller keeps a pair to one task at a time)."""
        return await self._workflows[idx].run_with_termination_handling(
            task, uid or str(task.get("uid", idx))
        )

    async def execute_tasks(self, tasks: list[dict[str, Any]]) -> list[Episode]:
        """All tasks over the pairs; results in input order."""
        free: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(self._workflows)):
            free.put_nowait(i)

        async def one(i: int, task: dict[str, Any]) -> Episode:
            idx = await free.get()
            try:
                return await self.run_agent_trajectory_async(idx, task, str(task.get("uid", i)))
            finally:
                free.put_nowait(idx)

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)
