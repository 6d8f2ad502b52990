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
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from nexrl_hpc.agents.sandbox import SandboxLimits, check_isolation, set_default_limits
from nexrl_hpc.config.schema import RLTrainConfig, RolloutWorkerConfig
from nexrl_hpc.core.errors import ErrorSeverity
from nexrl_hpc.core.execute import aexecute, execute, execute_async
from nexrl_hpc.core.module import NexRLModule
from nexrl_hpc.data.loader import task_key
from nexrl_hpc.data.prompts import engine_prompt, needs_chat_template
from nexrl_hpc.inference.factory import create_llm_client, import_llm_client_ahead
from nexrl_hpc.models.run_tokenizer import load_run_tokenizer
from nexrl_hpc.types import PutStatus, RolloutServiceStatus, Trajectory

if TYPE_CHECKING:
    from nexrl_hpc.data.interfaces import DataLoaderRef
    from nexrl_hpc.inference.factory import LLMClient
    from nexrl_hpc.inference.interfaces import InferenceServiceRef
    from nexrl_hpc.pool.interfaces import TrajectoryDestination
    from nexrl_hpc.scheduler.interfaces import RolloutSchedulerRef

logger = logging.getLogger(__name__)

# a trajectory's score entry: sampled ids without a token, summed per step (the step's metric)
UNDECODABLE_TOKENS = "rollout/undecodable_tokens"
_IS_VALIDATE: contextvars.ContextVar[bool] = contextvars.ContextVar("nexrl_is_validate", default=False)
# when the task's step started and its generation ended (wall clock): the trajectory's rollout_times
_STARTED: contextvars.ContextVar[float] = contextvars.ContextVar("nexrl_step_started", default=0.0)
_GENERATED: contextvars.ContextVar[float | None] = contextvars.ContextVar("nexrl_generated", default=None)


def runs_model_code(rw: RolloutWorkerConfig) -> bool:
    """Whether the configured reward or tools run model-written code (the shipped code reward, the
    python tool): such a run checks the sandbox's isolation at start-up."""
    agent = rw["agent"]
    specs = rw["reward_fn"]
    configured = [specs] if isinstance(specs, str) else (specs or [])
    rewards = [*configured, str(agent["env_args"].get("reward_fn") or "")]
    tools = [*agent["tools"], *(str(v) for v in agent["tool_map"].values())]
    return any("nexrl_hpc.agents.rewards.code" in r for r in rewards) or (
        rw["type"] == "agent" and any(t == "python" or t.endswith(":PythonTool") for t in tools)
    )


class BaseRolloutWorker(NexRLModule):
    def __init__(self, config: RLTrainConfig):
        super().__init__()
        rw = config["rollout_worker"]
        self._config = config
        # the sandbox's limits for code run in this process (the code reward, the python tool); a run
        # that runs model-written code fails here, naming the setting, where isolation is unavailable
        set_default_limits(SandboxLimits.from_config(rw["sandbox"]))
        if runs_model_code(rw):
            check_isolation()
        self._max_concurrency = rw["max_concurrency"]
        self._fetch_size = rw["fetch_size"]
        self._long_poll_s = rw["long_poll_s"]
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
        # module references: the module itself in local mode, a handle with its methods elsewhere
        self._llm_client: LLMClient | None = None
        self._inference_service: InferenceServiceRef | None = None
        self._is_running_validate = False
        self._trajectory_pool: TrajectoryDestination | None = None
        self._dataloader: DataLoaderRef | None = None
        self._scheduler: RolloutSchedulerRef | None = None
        self._validate_dataloader: DataLoaderRef | None = None
        self._validator: TrajectoryDestination | None = None
        self._step_is_async = inspect.iscoroutinefunction(self.step)
        self._tokenizer: Any = None  # the run's tokenizer, loaded when a prompt first needs its chat template
        self._known_ids: frozenset[int] | None = None  # the ids the run's tokenizer has a token for
        self.num_completed = 0
        self.num_failed = 0
        self._inflight = 0
        self._put_buffer: dict[
            int, tuple[TrajectoryDestination, list[tuple[Trajectory, asyncio.Future[PutStatus]]]]
        ] = {}

    # --- setup ----------------------------------------------------------------------------------
    def set_module_references(
        self,
        trajectory_pool: TrajectoryDestination,
        dataloader: DataLoaderRef,
        scheduler: RolloutSchedulerRef,
        validate_dataloader: DataLoaderRef,
        validator: TrajectoryDestination,
    ) -> None:
        self._trajectory_pool = trajectory_pool
        self._dataloader = dataloader
        self._scheduler = scheduler
        self._validate_dataloader = validate_dataloader
        self._validator = validator
        if self._llm_client is not None:
            self._llm_client.set_scheduler(scheduler)

    def set_inference_service(self, inference_service: InferenceServiceRef) -> None:
        """The engine this worker talks to (on its own rank: the endpoint and key stay local)."""
        self._inference_service = inference_service
        if self._llm_client is None:  # wired while the servers start: the client's imports overlap
            import_llm_client_ahead(self._config)

    def set_reward_service(self, reward_service: Any) -> None:
        """The model reward's service (reward_model.placement=own_ranks); a single-turn worker scores with it."""
        raise RuntimeError(
            f"{type(self).__name__} takes no reward service (reward_model needs type=single_turn)"
        )

    def set_llm_client(self, client: LLMClient) -> None:
        self._llm_client = client

    # --- lifecycle ------------------------------------------------------------------------------
    def run(self) -> None:
        if self._llm_client is None:
            if self._inference_service is None:
                raise RuntimeError(f"{self._module_name}: set_inference_service must be called before run")
            base_url, api_key = execute(self._inference_service.get_endpoint)
            self._llm_client = create_llm_client(self._config, base_url, api_key)
            self._llm_client.set_scheduler(self._scheduler)
        self._start_thread(lambda: asyncio.run(self._main()))

    def stop(self) -> None:
        self._stop_thread(timeout=self._config["rollout_worker"]["stop_timeout_s"])

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
        # fetching long-polls the loader (maybe on another rank) on its own thread: the event loop
        # keeps serving the steps in flight, and new work starts the moment it is handed out
        fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self._module_name}-fetch")
        groups: set[asyncio.Task] = set()
        self._inflight = 0
        slot_freed = asyncio.Event()
        try:
            while not self.stopped:
                free = min(self._max_concurrency - self._inflight, self._fetch_size)
                if free <= 0:
                    slot_freed.clear()
                    await slot_freed.wait()
                    continue
                tasks, is_validate = await asyncio.wrap_future(self._request_tasks(free, 0.0))
                if not tasks:  # nothing ready: wait for work off the loop
                    tasks, is_validate = await loop.run_in_executor(
                        fetcher, self._fetch_tasks, free, self._long_poll_s
                    )
                if not tasks:
                    continue
                self._inflight += len(tasks)
                group = asyncio.create_task(self._run_group(tasks, is_validate, slot_freed))
                groups.add(group)
                group.add_done_callback(groups.discard)
                await asyncio.sleep(0)  # let the new steps start (and their requests coalesce)
        finally:
            fetcher.shutdown(wait=False)
            for g in list(groups):
                g.cancel()
            if groups:
                await asyncio.gather(*groups, return_exceptions=True)
            if self._llm_client is not None and hasattr(self._llm_client, "aclose"):
                await self._llm_client.aclose()

    def _request_tasks(self, max_items: int, wait_s: float) -> Future:
        """(tasks, is_validate) in a future; the loader long-polls up to ``wait_s``. A local loader
        answers inline and a remote one over the wire, so with ``wait_s=0`` the event loop does not
        wait for the loader (only the scheduler's status check is a quick blocking call).

        While a validation runs its tasks come first and training tasks fill the rest: the
        validation measures the weights the next training batch is rolled out with (the rollout
        scheduler releases that batch with the validation), so both share the engine's batches.
        Only the training loader is long-polled then: the controller wakes it when a validation
        starts, and a validation task that comes back waits at most ``long_poll_s``."""
        if not self._is_running_validate:
            return self._request_training_tasks(max_items, wait_s)
        assert self._validate_dataloader is not None
        validation = execute_async(
            self._validate_dataloader.get_next_items, max_items, 0.0, self._module_name
        )
        if validation.done() and not validation.exception() and not validation.result():
            return self._request_training_tasks(max_items, wait_s)  # a local loader: no task left
        return _mapped(validation, lambda tasks: (tasks, True))

    def _request_training_tasks(self, max_items: int, wait_s: float) -> Future:
        assert self._scheduler is not None and self._dataloader is not None
        if (
            execute(self._scheduler.check_rollout_service_status, self._model_tag)
            == RolloutServiceStatus.BLOCK
        ):
            time.sleep(min(wait_s, 0.005))  # a reload takes milliseconds
            done: Future = Future()
            done.set_result(([], False))
            return done
        request = execute_async(self._dataloader.get_next_items, max_items, wait_s, self._module_name)
        return _mapped(request, lambda tasks: (tasks, False))

    def _fetch_tasks(self, max_items: int, wait_s: float = 0.0) -> tuple[list[dict[str, Any]], bool]:
        if not self._is_running_validate:
            return self._request_training_tasks(max_items, wait_s).result()  # one call, one long poll
        tasks, is_validate = self._request_tasks(max_items, 0.0).result()
        if tasks or wait_s <= 0:
            return tasks, is_validate
        return self._request_training_tasks(max_items, wait_s).result()

    async def _run_group(
        self, tasks: list[dict[str, Any]], is_validate: bool, slot_freed: asyncio.Event
    ) -> None:
        """Tasks fetched together run concurrently under one activity token (one tracker call each way)
        and are acknowledged to their loader together once done (one call)."""
        assert self._activity_tracker is not None
        token = await self._activity_tracker.astart(
            self._module_name, "validate" if is_validate else "rollout"
        )
        _IS_VALIDATE.set(is_validate)  # the tasks below inherit this context
        try:
            done = await asyncio.gather(*(self._run_task(task, is_validate, slot_freed) for task in tasks))
            loader = self._validate_dataloader if is_validate else self._dataloader
            assert loader is not None
            for outcome in ("delivered", "dropped"):
                finished = [task_key(t) for t, o in zip(tasks, done) if o == outcome]
                if finished:
                    await aexecute(loader.complete_items, self._module_name, finished, outcome == "delivered")
        finally:
            await self._activity_tracker.aend(token)

    async def _run_task(
        self, task: dict[str, Any], is_validate: bool, slot_freed: asyncio.Event | None = None
    ) -> str | None:
        """Run one step: "delivered" (trajectory accepted), "dropped" (reported), None (task returned)."""
        assert self._activity_tracker is not None
        _STARTED.set(time.time())
        _GENERATED.set(None)
        try:
            if self._step_is_async:
                result = await cast("Awaitable[PutStatus | None]", self.step(task))
            else:
                result = cast("PutStatus | None", await asyncio.to_thread(self.step, task))
            if result == PutStatus.RE_ROLLOUT:
                self._put_rollout_task(task, is_validate)
                return None
            if result in (None, PutStatus.FAIL):
                self.num_failed += 1
                self._activity_tracker.report_error(
                    self._module_name,
                    "rollout",
                    f"step returned {result!r} for task uid={task.get('uid')!r}; the sample was dropped",
                    ErrorSeverity.ERROR,
                    details={"uid": task.get("uid")},
                )
                return "dropped"
            self.num_completed += 1
            return "delivered"
        except asyncio.CancelledError:
            self._put_rollout_task(task, is_validate)
            raise
        except Exception as exc:
            self.num_failed += 1
            self._put_rollout_task(task, is_validate)
            self._activity_tracker.report_exception(
                self._module_name, "rollout", exc, details={"uid": task.get("uid")}
            )
            return None
        finally:
            self._inflight -= 1
            if slot_freed is not None:
                slot_freed.set()

    # --- data-flow helpers -----------------------------------------------------------------------
    def step(self, task: dict[str, Any]) -> PutStatus | None | Awaitable[PutStatus | None]:
        """Roll out one task; return its trajectory's ``PutStatus`` (or the equal string) or None (may be
        ``async def``)."""
        raise NotImplementedError

    def _engine_prompt(self, task: dict[str, Any]) -> str | list[int] | None:
        """What to send for ``task``'s prompt: chat-template token ids (chat messages, or a string with
        ``data.apply_chat_template``), the raw string, or None when the task has no usable prompt."""
        prompt = task.get("prompt")
        if not prompt or not isinstance(prompt, (str, list)):
            return None
        data = self._config["validate"]["data"] if _IS_VALIDATE.get() else self._config["data"]
        if not needs_chat_template(prompt, data["apply_chat_template"]):
            return prompt
        if self._tokenizer is None:
            self._tokenizer = load_run_tokenizer(self._config["model"])
        return engine_prompt(
            self._tokenizer, prompt, data["apply_chat_template"], data["add_generation_prompt"]
        )

    def _undecodable_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` the run's tokenizer has no token for: a model's embedding padded
        past its tokenizer (every Qwen: 151,936 rows, ~151,665 tokens) lets the engine sample them;
        they decode to nothing and train like any other token (``rollout/undecodable_tokens``)."""
        if self._known_ids is None:
            if self._tokenizer is None:
                self._tokenizer = load_run_tokenizer(self._config["model"])
            self._known_ids = frozenset(self._tokenizer.get_vocab().values())
        known = self._known_ids
        return sum(1 for t in token_ids if t not in known)

    def _sampling_kwargs(self) -> dict[str, Any]:
        return dict(self._val_sampling if _IS_VALIDATE.get() else self._train_sampling)

    @staticmethod
    def _mark_generated() -> None:
        """The step's generation is done (what follows until the put is reward scoring); a step
        that never says so counts wholly as generation (agent episodes: turns, tools, environment)."""
        _GENERATED.set(time.time())

    @staticmethod
    def _stamp(trajectory: Trajectory) -> None:
        """``rollout_times``: [started, generated, scored] on the wall clock (the step-time breakdown)."""
        now = time.time()
        generated = _GENERATED.get()
        trajectory["rollout_times"] = [_STARTED.get() or now, now if generated is None else generated, now]

    async def _aput_trajectory(self, trajectory: Trajectory) -> PutStatus:
        """Put a finished trajectory into the pool (the validator while validating); trajectories
        finishing together go out in one call."""
        self._stamp(trajectory)
        destination = self._validator if _IS_VALIDATE.get() else self._trajectory_pool
        assert destination is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PutStatus] = loop.create_future()
        key = id(destination)
        if key not in self._put_buffer:
            self._put_buffer[key] = (destination, [])
            loop.call_soon(self._flush_puts, key)
        self._put_buffer[key][1].append((trajectory, future))
        return await future

    def _flush_puts(self, key: int) -> None:
        """Send what accumulated for one destination in one call: a local pool answers inline, a
        remote one over the wire (its reply resolves the waiting steps on this loop)."""
        destination, items = self._put_buffer.pop(key)
        request = execute_async(destination.put_trajectories, [t for t, _ in items])
        if request.done():
            _resolve_puts(items, request)
        else:
            loop = asyncio.get_running_loop()
            request.add_done_callback(lambda f: loop.call_soon_threadsafe(_resolve_puts, items, f))

    def _put_rollout_task(self, task: dict[str, Any], is_validate: bool | None = None) -> bool:
        loader = (
            self._validate_dataloader
            if (is_validate if is_validate is not None else _IS_VALIDATE.get())
            else self._dataloader
        )
        try:
            assert loader is not None
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
        response_ids = result["response_ids"]
        rollout: Trajectory = {
            "model_tag": result["model_tag"],
            "response": result["response"],
            "finish_reason": result["finish_reason"],
            "prompt_ids": result["prompt_ids"],
            "response_ids": response_ids,
            "behaviour_log_probs": result["logprobs"],
            "loss_mask": [1] * len(response_ids),
            "weight_version": result["weight_version"],
        }
        trajectory = cast(Trajectory, {**task, **rollout})  # the task's own fields ride along
        if scores is not None:
            trajectory["scores"] = scores
            trajectory["reward"] = float(scores["reward"])
        return trajectory


def _mapped(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of ``fn(result)`` (errors pass through)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as exc:
            out.set_exception(exc)

    future.add_done_callback(done)
    return out


def _resolve_puts(
    items: list[tuple[Trajectory, asyncio.Future[PutStatus]]], request: Future[list[PutStatus]]
) -> None:
    try:
        results = request.result()
    except Exception as exc:
        for _, future in items:
            if not future.done():
                future.set_exception(exc)
        return
    for (_, future), result in zip(items, results):
        if not future.done():
            future.set_result(result)
