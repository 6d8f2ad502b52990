"""OpenEnvRolloutWorker (``rollout_worker.type=openenv``): an OpenEnv environment's episodes, as agent episodes.

The environment class (TRL's ``environment_factory`` contract) runs in OpenEnv's venv
(``nexrl_hpc.hub.openenv_env``); this worker starts that process when it starts, learns the class's
tools from it, and runs each row as an ``OpenEnvWorkflow`` episode: the agent (``rollout_worker.agent``'s
``agent_cls``, a ToolAgent) calls the tools in the agent stack's tag syntax, the worker's instance runs
them, and the reward is read from the instance when the episode ends. Turn and length limits, retries
and the trajectory are the agent worker's (``rollout_worker.agent``: ``max_turns``,
``max_episode_length``, ``timeout_s``, ``retry_limit``, ``gamma``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from nexrl_hpc.agents.agent import ToolAgent
from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.hub.openenv_env import (
    OpenEnvEnvironment,
    OpenEnvProcess,
    OpenEnvWorkflow,
    tool_stubs,
    tools_system_prompt,
)
from nexrl_hpc.rollout.agent import KEY as AGENT_KEY
from nexrl_hpc.rollout.agent import AgentRolloutWorker, _load_class, episode_limits

logger = logging.getLogger(__name__)


def build_openenv_workflow_args(config: RLTrainConfig) -> dict[str, Any]:
    """The workflow's kwargs but the environment's process and tools (known once the worker runs)."""
    rw = config["rollout_worker"]
    agent_cfg = rw["agent"]
    return {
        "agent_cls": _load_class(agent_cfg["agent_cls"], f"{AGENT_KEY}.agent_cls", ToolAgent),
        "env_cls": OpenEnvEnvironment,
        "agent_args": dict(agent_cfg["agent_args"] or {}),
        "env_args": {"max_tool_calls": rw["openenv"]["max_tool_calls"]},
        **episode_limits(config),
    }


class OpenEnvRolloutWorker(AgentRolloutWorker):
    def __init__(self, config: RLTrainConfig):
        self._process: OpenEnvProcess | None = None
        super().__init__(config)

    def _workflow(self, config: RLTrainConfig) -> tuple[type[OpenEnvWorkflow], dict[str, Any]]:
        return OpenEnvWorkflow, build_openenv_workflow_args(config)

    def run(self) -> None:
        if self._process is None:
            cfg = self._config
            log = os.path.join(cfg["run_dir"], "logs", f"openenv_{self._module_name}.log")
            process = OpenEnvProcess(cfg["rollout_worker"]["openenv"], log)
            ready = process.start()
            logger.info("%s: OpenEnv environment ready: %s", self._module_name, ready)
            self._process = process
            schemas = list(ready["tools"])
            agent_args = self._workflow_args["agent_args"]
            agent_args["tool_map"] = tool_stubs(schemas)
            if cfg["rollout_worker"]["openenv"]["describe_tools"]:
                agent_args.setdefault("system_prompt", tools_system_prompt(schemas))
            self._workflow_args["env_args"]["process"] = process
        super().run()

    def stop(self) -> None:
        super().stop()
        if self._process is not None:
            self._process.close()
            self._process = None
        if self._runner is not None:  # its environments hold the closed process: a restart makes new ones
            self._runner.shutdown()
            self._runner = None
