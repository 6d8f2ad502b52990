"""Local launch mode: every role is a plain object in this process (a ``runtime.protocol.Runtime``).

A runtime builds the modules of the roles, gives each an activity-tracker proxy, and answers
``get_actor_wrapper(role)`` with what callers use to reach them — here the objects themselves.
The MPI runtime answers the same questions with remote handles; the controller does not care.
"""

from __future__ import annotations

from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.core.activity import ActivityTracker, ActivityTrackerProxy
from nexrl_hpc.core.module import abort_modules
from nexrl_hpc.runtime.elastic import JoinDoor, Member
from nexrl_hpc.runtime.placement import module_name
from nexrl_hpc.runtime.protocol import Runtime
from nexrl_hpc.runtime.roles import RoleRegistry, RunContext, local_role_counts
from nexrl_hpc.types import NexRLRole


class LocalRuntime(Runtime):
    """Every module is an object of this process, built by the ``roles`` it is handed."""

    def __init__(self, config: RLTrainConfig, roles: RoleRegistry) -> None:
        self._config = config
        self._roles = roles
        self._modules: dict[NexRLRole, list[Any]] = {}

    def create_all_actors(self, ctx: RunContext, tracker: ActivityTracker) -> None:
        proxy = ActivityTrackerProxy(tracker)
        for role, count in local_role_counts(self._config).items():
            modules = []
            for index in range(count):
                module = self._roles.build_module(role, self._config, ctx)
                module.set_module_name(module_name(role, index, count))
                module.set_activity_tracker(proxy)
                modules.append(module)
            self._modules[role] = modules

    def get_actor_wrapper(self, role: NexRLRole) -> list[Any]:
        return self._modules[role]

    def get_one(self, role: NexRLRole) -> Any:
        return self._modules[role][0]

    def modules(self) -> list[tuple[str, NexRLRole, Any]]:
        return [(m.get_module_name(), role, m) for role, mods in self._modules.items() for m in mods]

    def location(self, name: str) -> str:
        return "this process"

    # --- nothing to watch or tear down across processes ---------------------------------------------
    def elastic_door(self) -> JoinDoor | None:
        return None  # one process: nothing joins it

    def admit_joiner(self, member: Member) -> tuple[Any, Any]:
        raise RuntimeError("local mode admits no joined rank (launch_mode=mpi does)")

    def dead_ranks(self, timeout: float) -> list[dict[str, Any]]:
        return []

    def is_trainer_rank(self, rank: int) -> bool:
        return False

    def retire_rank(self, rank: int, reason: str) -> None:
        raise RuntimeError("local mode has no ranks")

    def ranks_only_hosting(self, names: list[str]) -> list[int]:
        return []

    def describe_rank(self, rank: int) -> str:
        return "this process"

    def rpc_rejected_total(self) -> float:
        return 0.0

    def abort_startup(self) -> None:
        return None

    def shutdown(self, reason: str, exit_code: int) -> None:
        return None

    def abort(self, reason: str, exit_code: int) -> None:
        """End the run now, with no orderly stop: every module aborts (server processes killed)."""
        abort_modules([module for _, _, module in self.modules()])
