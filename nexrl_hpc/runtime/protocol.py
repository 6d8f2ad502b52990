"""The ``Runtime`` protocol: what the controller asks of a launch mode's runtime.

A runtime builds every role's modules and hands the controller what reaches them: the objects
themselves (``LocalRuntime``) or handles to modules on other MPI ranks (``MPIRuntime``); it also
answers for rank liveness and stops the other ranks. The controller types against this protocol
only, so it cannot tell the launch modes apart.
"""

from __future__ import annotations

from typing import Any, Protocol

from nexrl_hpc.core.activity import ActivityTracker
from nexrl_hpc.runtime.elastic import JoinDoor, Member
from nexrl_hpc.runtime.roles import RunContext
from nexrl_hpc.types import NexRLRole


class Runtime(Protocol):
    """Module references (``Any`` below) are a role's module object or a remote handle mirroring it."""

    # --- building the modules and reaching them -------------------------------------------------
    def create_all_actors(self, ctx: RunContext, tracker: ActivityTracker) -> None:
        """Build every role's modules, each with an activity-tracker proxy."""
        ...

    def get_actor_wrapper(self, role: NexRLRole) -> list[Any]:
        """What reaches every instance of ``role``, in instance order."""
        ...

    def get_one(self, role: NexRLRole) -> Any:
        """What reaches the first instance of ``role``."""
        ...

    def modules(self) -> list[tuple[str, NexRLRole, Any]]:
        """(name, role, reference) of every module."""
        ...

    def location(self, name: str) -> str:
        """Where the module ``name`` runs, for messages."""
        ...

    # --- rollout ranks that join later (runtime.elastic) ------------------------------------------
    def elastic_door(self) -> JoinDoor | None:
        """Where joiners come in (None: this launch mode or config admits none)."""
        ...

    def admit_joiner(self, member: Member) -> tuple[Any, Any]:
        """Reach a proven joiner's modules: (its rollout worker, its inference service)."""
        ...

    # --- ranks: liveness, statistics --------------------------------------------------------------
    def dead_ranks(self, timeout: float) -> list[dict[str, Any]]:
        """Ranks silent for ``timeout`` seconds and not yet retired (rank, host, modules, silence_s)."""
        ...

    def is_trainer_rank(self, rank: int) -> bool: ...

    def retire_rank(self, rank: int, reason: str) -> None:
        """Declare ``rank`` dead: calls to it fail at once from now on."""
        ...

    def ranks_only_hosting(self, names: list[str]) -> list[int]:
        """Ranks all of whose modules are in ``names``."""
        ...

    def describe_rank(self, rank: int) -> str: ...

    def rpc_rejected_total(self) -> float:
        """Messages every rank's RPC sockets rejected so far."""
        ...

    # --- the end of the run -----------------------------------------------------------------------
    def abort_startup(self) -> None:
        """The controller failed before the modules were built: release whoever waits for them."""
        ...

    def shutdown(self, reason: str, exit_code: int) -> None:
        """Tell the other ranks to stop their modules (with the reason and exit code); wait for them."""
        ...

    def abort(self, reason: str, exit_code: int) -> None:
        """End the run's processes now, with no orderly stop (server processes killed)."""
        ...
