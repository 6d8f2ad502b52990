"""The rollout section's schema (``rollout_worker``): sampling, rewards, and each rollout type's own
keys (agent workflows, verifiers and OpenEnv environments, the sandbox of model-written code)."""

from __future__ import annotations

from typing import Annotated, Literal, TypedDict

from nexrl_hpc.config.constraints import Ge, Gt, Le


class ValKwargs(TypedDict):
    temperature: Annotated[float, Ge(0.0)]
    top_p: Annotated[float, Gt(0.0), Le(1.0)]


class AgentRolloutConfig(TypedDict):
    """rollout_worker.type=agent: one workflow episode per task (the agent model, nexrl_hpc.agents)."""

    workflow: str  # "module:Class", a nexrl_hpc.agents.workflow.Workflow subclass
    agent_cls: str  # "module:Class", a BaseAgent subclass (workflow arg agent_cls)
    env_cls: str  # "module:Class", a BaseEnv subclass (workflow arg env_cls)
    agent_args: dict  # constructor kwargs of agent_cls
    env_args: dict  # env_cls.from_dict args; reward_fn defaults to rollout_worker.reward_fn
    tools: list[str]  # registry tool names given to agent and env (when they take ``tools``)
    tool_map: dict  # tool name -> "module:Class" given to agent and env (when they take ``tool_map``)
    max_turns: Annotated[int, Ge(1)]  # model turns per episode (workflow max_steps)
    max_episode_length: Annotated[int, Ge(1)] | None  # tokens after the first prompt; null: no limit
    gamma: Annotated[float, Ge(0.0), Le(1.0)]  # discount of the per-step Monte Carlo returns
    reward_bonus_coeff: float
    timeout_s: Annotated[float, Gt(0.0)] | None  # wall time of one episode; null: no limit
    retry_limit: Annotated[int, Ge(1)]  # attempts per episode; only ERROR episodes are retried
    workflow_args: dict  # more kwargs of the workflow class


class SandboxConfig(TypedDict):
    """rollout_worker.sandbox: limits of model-written code (nexrl_hpc.agents.sandbox.SandboxLimits)."""

    require_isolation: bool  # false: run the code unisolated where namespaces are unavailable
    wall_time_s: Annotated[float, Gt(0.0)]
    cpu_time_s: Annotated[int, Ge(1)]
    memory_mb: Annotated[int, Ge(1)]  # address space per process
    max_processes: Annotated[int, Ge(1)]
    max_output_bytes: Annotated[int, Ge(1)]
    max_open_files: Annotated[int, Ge(1)]
    tmp_mb: Annotated[int, Ge(1)]  # each of its private /tmp and /dev/shm
    unprivileged_uid: Annotated[int, Ge(1)]  # a root-started run's code runs as this uid
    python_executable: str | None  # null: the run's interpreter


class VerifiersRolloutConfig(TypedDict):
    """rollout_worker.type=verifiers: a verifiers environment's episodes (nexrl_hpc.hub)."""

    python: str | None  # the verifiers venv's python; null: scripts/install_verifiers.sh's
    taskset: dict  # {id: the taskset's package id, ...its TasksetConfig fields}
    harness: dict  # {id: nexrl_chat | a verifiers harness id, ...its HarnessConfig fields}
    renderer: dict | None  # renderers' RendererConfig ({name: default, ...}); null: verifiers' auto
    python_path: list[str]
    max_concurrent: Annotated[int, Ge(1)]
    start_timeout_s: Annotated[float, Gt(0.0)]
    val_size: Annotated[int, Ge(1)]  # the taskset's last N tasks: the validation set


class OpenEnvRolloutConfig(TypedDict):
    """rollout_worker.type=openenv: an OpenEnv environment's episodes (nexrl_hpc.hub.openenv_env)."""

    python: str | None  # the OpenEnv venv's python; null: scripts/install_openenv.sh's
    env_factory: str | None  # "module:Class" with TRL's environment_factory contract
    reward_fn: str | None  # "module:function" taking `environments` (TRL); null: the instance's `reward`
    server_app: str | None  # "module:app": an OpenEnv server app served on loopback (OPENENV_BASE_URL)
    python_path: list[str]
    describe_tools: bool  # a system prompt listing the tools (unless agent_args.system_prompt is set)
    max_tool_calls: Annotated[int, Ge(0)]
    max_concurrent: Annotated[int, Ge(1)]
    start_timeout_s: Annotated[float, Gt(0.0)]
    call_timeout_s: Annotated[float, Gt(0.0)]


AGENT_ROLLOUTS = ("agent", "openenv")
"""rollout_worker.type values whose episodes are the agent stack's: multi-turn, per-turn returns,
max_response_length per turn, prompts built by the agent."""


class RolloutWorkerConfig(TypedDict):
    type: Literal["simple", "single_turn", "agent", "verifiers", "openenv"]
    num_workers: Annotated[int, Ge(1)]
    max_concurrency: Annotated[int, Ge(1)]
    fetch_size: Annotated[int, Ge(1)]  # tasks taken from the loader per call (spreads a batch over workers)
    temperature: Annotated[float, Ge(0.0)]
    top_p: Annotated[float, Gt(0.0), Le(1.0)]
    max_prompt_length: Annotated[int, Ge(1)]
    max_response_length: Annotated[int, Ge(1)]
    # "module:function" or "file.py:function" (nexrl_hpc.rewards.loader: accepted signatures), or a list
    # of them (TRL's reward_funcs; type=single_turn), summed with reward_weights; null: an error naming it
    # null: only with type=verifiers or openenv (the environment scores); any other rollout needs one
    reward_fn: str | list[str] | None
    reward_weights: list[float] | None  # one per reward_fn entry (TRL's reward_weights); null: 1 each
    reward_timeout_s: Annotated[float, Gt(0.0)]  # a longer reward call scores 0 (reward/timeouts)
    reward_threads: Annotated[int, Ge(1)]  # threads scoring responses off the worker's event loop
    # a training batch whose reward calls failed (raised, returned no reward) for more than this
    # fraction of its samples stops the run (exit 1, the first error's traceback); 1: never
    max_reward_error_frac: Annotated[float, Ge(0.0), Le(1.0)]
    val_kwargs: ValKwargs
    agent: AgentRolloutConfig
    verifiers: VerifiersRolloutConfig
    openenv: OpenEnvRolloutConfig
    sandbox: SandboxConfig
    long_poll_s: Annotated[
        float, Gt(0.0)
    ]  # longest wait for work in one call (returns early when work comes)
    stop_timeout_s: Annotated[float, Gt(0.0)]  # stop() waits this long for the worker loop
