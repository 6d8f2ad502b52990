"""BaseRolloutWorker: pulls tasks, runs ``step`` on many of them concurrently, returns what it cannot finish.

The worker owns an asyncio loop on its own thread with up to ``max_concurrency`` steps in flight;
an ``async def step`` runs on the loop (its LLM calls coalesce into batched requests), a plain
``def step`` runs on a thread pool. In validation mode tasks come from the validation loader and
trajectories go to the validator. A task whose step raised, or whose trajectory the pool sent
back ("re-rollout"), goes back to the front of its loader: nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.errors import ErrorSeverity
from nexrl_hpc.core.execute import execute
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.inference.factory import create_llm_client
from nexrl_hpc.types import Trajectory

logger = logging.getLogger(__name__)

_IS_VALIDATE: contextvars.ContextVar[bool] = contextvars.ContextVar("nexrl_is_validate", default=False)


class BaseRolloutWorker(NexRLModule):
    def __init__(self, config: RLTrainConfig):
        super().__init__()
        rw = config["rollout_worker"]
        self._config = config
        self._max_concurrency = rw["max_concurrency"]
        self._idle_wait_s = rw["idle_wait_s"]
        self._model_tag = config["service"]["inference_service"]["model_tag"]
        self._train_sampling = {
            "max_tokens": rw["max_response_length"],
            "temperature": rw["temperature"],
            "top_p": rw["top_p"],
        }
        self._val_sampling = {
            "max_tokens": rw["max_response_length"],
            "temperature": rw["val_kwargs"]["temperature"],
            "top_p": rw["val_kwargs"]["top_p"],
        }
        self._llm_client: Any = None
        self._is_running_validate = False
        self._trajectory_pool: Any = None
        self._dataloader: Any = None
        self._weight_sync_controller: Any = None
        self._validate_dataloader: Any = None
        self._validator: Any = None
        self._step_is_async = inspect.iscoroutinefunction(self.step)
        self.num_completed = 0
        self.num_failed = 0
        self._inflight = 0

    # --- setup ----------------------------------------------------------------------------------
    def set_module_references(
        self,
        trajectory_pool: Any,
        dataloader: Any,
        weight_sync_controller: Any,
        validate_dataloader: Any,
        validator: Any,
    ) -> None:
        self._trajectory_pool = trajectory_pool
        self._dataloader = dataloader
        self._weight_sync_controller = weight_sync_controller
        self._validate_dataloader = validate_dataloader
        self._validator = validator
        if self._llm_client is not None:
            self._llm_client.set_weight_sync_controller(weight_sync_controller)

    def set_inference_endpoint(self, base_url: str | None, api_key: str | None) -> None:
        """Where the inference service answers (known only once it has started)."""
        self._llm_client = create_llm_client(self._config, base_url, api_key)
        if self._weight_sync_controller is not None:
            self._llm_client.set_weight_sync_controller(self._weight_sync_controller)

    def set_llm_client(self, client: Any) -> None:
        self._llm_client = client

    # --- lifecycle ------------------------------------------------------------------------------
    def run(self) -> None:
        if self._llm_client is None:
            raise RuntimeError(f"{self._module_name}: set_inference_endpoint must be called before run")
        self._start_thread(lambda: asyncio.run(self._main()))

    def stop(self) -> None:
        self._stop_thread(timeout=30)

    def begin_validate(self) -> None:
        self._is_running_validate = True

    def end_validate(self) -> None:
        self._is_running_validate = False

    # --- the worker loop ------------------------------------------------------------------------
    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(
            ThreadPoolExecutor(
                max_workers=min(self._max_concurrency, 64), thread_name_prefix=self._module_name
            )
        )
        groups: set[asyncio.Task] = set()
        self._inflight = 0
        slot_freed = asyncio.Event()
        try:
            while not self.stopped:
                free = self._max_concurrency - self._inflight
                if free <= 0:
                    slot_freed.clear()
                    await slot_freed.wait()
                    continue
                # nothing in flight: block briefly in the loader until work appears (no timers to serve)
                wait_s = self._idle_wait_s if self._inflight == 0 else 0.0
                tasks, is_validate = self._fetch_tasks(free, wait_s)
                if not tasks:
                    await asyncio.sleep(0 if wait_s else self._idle_wait_s)
                    continue
                self._inflight += len(tasks)
                group = asyncio.create_task(self._run_group(tasks, is_validate, slot_freed))
                groups.add(group)
                group.add_done_callback(groups.discard)
                await asyncio.sleep(0)  # let the new steps start (and their requests coalesce)
        finally:
            for g in list(groups):
                g.cancel()
            if groups:
                await asyncio.gather(*groups, return_exceptions=True)
            if hasattr(self._llm_client, "aclose"):
                await self._llm_client.aclose()

    def _fetch_tasks(self, max_items: int, wait_s: float = 0.0) -> tuple[list[dict[str, Any]], bool]:
        if self._is_running_validate:
            return execute(self._validate_dataloader.get_next_items, max_items, wait_s), True
        if execute(self._weight_sync_controller.check_rollout_service_status, self._model_tag) == "block":
            if wait_s:
                time.sleep(wait_s)
            return [], False
        return execute(self._dataloader.get_next_items, max_items, wait_s), False

    async def _run_group(
        self, tasks: list[dict[str, Any]], is_validate: bool, slot_freed: asyncio.Event
    ) -> None:
        """Tasks fetched together run concurrently under one activity token (one tracker call each way)."""
        assert self._activity_tracker is not None
        token = self._activity_tracker.start(self._module_name, "validate" if is_validate else "rollout")
        try:
            await asyncio.gather(*(self._run_task(task, is_validate, slot_freed) for task in tasks))
        finally:
            self._activity_tracker.end(token)

    async def _run_task(
        self, task: dict[str, Any], is_validate: bool, slot_freed: asyncio.Event | None = None
    ) -> None:
        assert self._activity_tracker is not None
        _IS_VALIDATE.set(is_validate)
        try:
            if self._step_is_async:
                result = await self.step(task)
            else:
                result = await asyncio.to_thread(self.step, task)
            if result == "re-rollout":
                self._put_rollout_task(task, is_validate)
            elif result in (None, "fail"):
                self.num_failed += 1
                self._activity_tracker.report_error(
                    self._module_name,
                    "rollout",
                    f"step returned {result!r} for task uid={task.get('uid')!r}; the sample was dropped",
                    ErrorSeverity.ERROR,
                    details={"uid": task.get("uid")},
                )
            else:
                self.num_completed += 1
        except asyncio.CancelledError:
            self._put_rollout_task(task, is_validate)
            raise
        except Exception as exc:
            self.num_failed += 1
            self._put_rollout_task(task, is_validate)
            self._activity_tracker.report_exception(
                self._module_name, "rollout", exc, details={"uid": task.get("uid")}
            )
        finally:
            self._inflight -= 1
            if slot_freed is not None:
                slot_freed.set()

    # --- seed 000 data-flow helpers ---------------------------------------------------------------
    def step(self, task: dict[str, Any]) -> str | None:
        """Roll out one task; return "success" | "fail" | "re-rollout" | None (may be ``async def``)."""
        raise NotImplementedError

    def _sampling_kwargs(self) -> dict[str, Any]:
        return dict(self._val_sampling if _IS_VALIDATE.get() else self._train_sampling)

    def _put_trajectory(self, trajectory: Trajectory) -> str:
        destination = self._validator if _IS_VALIDATE.get() else self._trajectory_pool
        return execute(destination.put_trajectory, trajectory)

    def _get_rollout_task(self) -> dict[str, Any] | None:
        tasks, _ = self._fetch_tasks(1)
        if not tasks:
            time.sleep(self._idle_wait_s)
            return None
        return tasks[0]

    def _put_rollout_task(self, task: dict[str, Any], is_validate: bool | None = None) -> bool:
        loader = (
            self._validate_dataloader
            if (is_validate if is_validate is not None else _IS_VALIDATE.get())
            else self._dataloader
        )
        try:
            execute(loader.add_item_front, task)
            return True
        except Exception as exc:
            logger.error(
                "%s: could not return task uid=%s to its loader: %s", self._module_name, task.get("uid"), exc
            )
            return False

    @staticmethod
    def make_trajectory(
        task: dict[str, Any], result: dict[str, Any], scores: dict[str, float] | None = None
    ) -> Trajectory:
        """Task fields + what the engine returned; the loss mask trains every generated token."""
        trajectory: Trajectory = dict(task)
        response_ids = result["response_ids"]
        trajectory.update(
            model_tag=result["model_tag"],
            response=result["response"],
            finish_reason=result["finish_reason"],
            prompt_ids=result["prompt_ids"],
            response_ids=response_ids,
            behaviour_log_probs=result["logprobs"],
            loss_mask=[1] * len(response_ids),
            weight_version=result["weight_version"],
        )
        if scores is not None:
            trajectory["scores"] = scores
            trajectory["reward"] = float(scores["reward"])
        return trajectory
