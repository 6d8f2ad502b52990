"""Local launch mode: every role is a plain object in this process (seed 003's resource manager API)."""

from __future__ import annotations

from typing import Any

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.runtime.roles import RunContext, build_module, role_counts
from nexrl_hpc.types import NexRLRole


class LocalResourceManager:
    """Builds each registered role ``count`` times; the "actor wrapper" of a local module is the module."""

    def __init__(self, config: RLTrainConfig, ctx: RunContext):
        self._config = config
        self._ctx = ctx
        self._modules: dict[NexRLRole, list[Any]] = {}

    def create_all_actors(self) -> None:
        for role, count in role_counts(self._config).items():
            modules = []
            for index in range(count):
                module = build_module(role, self._config, self._ctx)
                module.set_module_name(role.value if count == 1 else f"{role.value}_{index}")
                modules.append(module)
            self._modules[role] = modules

    def get_actor_wrapper(self, role: NexRLRole) -> list[Any]:
        return self._modules[role]

    def get_one(self, role: NexRLRole) -> Any:
        return self._modules[role][0]

    def all_modules(self) -> list[Any]:
        return [m for mods in self._modules.values() for m in mods]
