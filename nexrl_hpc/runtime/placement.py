"""Placement: which roles run on which MPI ranks (colocation groups, here: ranks).

A colocation group is a set of roles that share one process; each of its ``count`` instances is one
rank. Rules: every role in a group has the same count; a role without a group gets its
own ranks; unknown roles are errors. ``mode: auto`` puts the driver roles (loaders, pools,
processor, weight sync, validator, train worker — and the controller and activity tracker) on
rank 0, ``service.train_service.world_size`` trainer ranks next (then, distilling, the teacher's
``service.train_service.teacher_service.world_size`` ranks; in both modes: groups hosting no
module, the torch.distributed group the train worker drives), and every remaining rank becomes a
rollout rank (rollout worker + its inference service); a model reward served on ranks of its own
(``reward_model.placement=own_ranks``) takes ``reward_model.world_size`` ranks (group ``reward``)
before them, and in manual mode is placed like any role (``placement.roles.reward_service``). Rank 0 is always instance 0 of the group
that holds the data loader.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nexrl_hpc.config.validate import ConfigProblem
from nexrl_hpc.types import NexRLRole

SINGLETON_ROLES = (
    NexRLRole.DATA_LOADER,
    NexRLRole.VALIDATE_DATALOADER,
    NexRLRole.TRAJECTORY_POOL,
    NexRLRole.ALGORITHM_PROCESSOR,
    NexRLRole.TRAIN_BATCH_POOL,
    NexRLRole.WEIGHT_SYNC_CONTROLLER,
    NexRLRole.VALIDATOR,
    NexRLRole.TRAIN_WORKER,
)
DRIVER_GROUP, TRAINER_GROUP, TEACHER_GROUP, ROLLOUT_GROUP = "driver", "trainer", "teacher", "rollout"
REWARD_GROUP = "reward"
CRITIC_GROUP = "critic"  # PPO's value model (algorithm.adv_estimator=gae)
SERVICE_GROUPS = (TRAINER_GROUP, TEACHER_GROUP, CRITIC_GROUP)  # ranks that run a trainer group, not modules


class PlacementError(ValueError):
    def __init__(self, problems: list[ConfigProblem]):
        self.problems = problems
        super().__init__("invalid placement:\n" + "\n".join(f"  {p}" for p in problems))


@dataclass
class GroupSpec:
    name: str
    roles: list[NexRLRole]
    count: int
    cpus_per_rank: int = 1
    gpus_per_rank: int = 0


@dataclass
class RankSpec:
    rank: int
    group: str
    instance: int
    roles: list[NexRLRole]
    module_names: list[str] = field(default_factory=list)


@dataclass
class Placement:
    groups: list[GroupSpec]
    ranks: list[RankSpec]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def modules(self) -> dict[str, tuple[int, NexRLRole, int]]:
        """Module name -> (rank, role, instance index of the role)."""
        out: dict[str, tuple[int, NexRLRole, int]] = {}
        for spec in self.ranks:
            for name, role in zip(spec.module_names, spec.roles):
                out[name] = (spec.rank, role, spec.instance)
        return out

    def describe(self) -> str:
        return "; ".join(
            f"rank {r.rank} [{r.group}#{r.instance}]: {', '.join(r.module_names)}" for r in self.ranks
        )


def module_name(role: NexRLRole, index: int, count: int) -> str:
    """The name a module is registered and addressed under (same rule in every launch mode)."""
    return role.value if count == 1 else f"{role.value}_{index}"


def _role(name: str, path: str, problems: list[ConfigProblem]) -> NexRLRole | None:
    try:
        return NexRLRole(name)
    except ValueError:
        known = ", ".join(r.value for r in NexRLRole)
        problems.append(ConfigProblem(path, f"unknown role {name!r} (known roles: {known})"))
        return None


def manual_groups(placement_cfg: Mapping[str, Any], problems: list[ConfigProblem]) -> list[GroupSpec]:
    """Groups from ``placement.roles``: {role: {count, colocation_group}} (one entry per role, as a role is registered)."""
    roles_cfg = placement_cfg["roles"]
    resources = placement_cfg["resources"]
    groups: dict[str, dict[str, Any]] = {}
    for name, spec in roles_cfg.items():
        path = f"placement.roles.{name}"
        role = _role(str(name), path, problems)
        if not isinstance(spec, Mapping) or not isinstance(spec.get("count"), int) or spec["count"] < 1:
            problems.append(ConfigProblem(path, "needs {count: int >= 1, colocation_group: name | null}"))
            continue
        if role is None:
            continue
        group = spec.get("colocation_group") or role.value  # no group: dedicated ranks
        entry = groups.setdefault(str(group), {"roles": [], "counts": {}})
        entry["roles"].append(role)
        entry["counts"][role.value] = spec["count"]
    out = []
    for name, entry in groups.items():
        counts = entry["counts"]
        if len(set(counts.values())) > 1:
            problems.append(
                ConfigProblem(
                    f"placement.roles ({name})",
                    f"All roles in colocation group must have same count: {', '.join(f'{r}={c}' for r, c in counts.items())}",
                )
            )
            continue
        res = resources.get(name, {})
        out.append(
            GroupSpec(
                name,
                entry["roles"],
                next(iter(counts.values())),
                res.get("cpus_per_rank", 1),
                res.get("gpus_per_rank", 0),
            )
        )
    return out


def reward_rank_count(config: Mapping[str, Any]) -> int:
    """Ranks of the model reward's own group (``reward_model.placement=own_ranks``), else none."""
    rm = config["reward_model"]
    return rm["world_size"] if rm["type"] is not None and rm["placement"] == "own_ranks" else 0


def check_groups(groups: list[GroupSpec], problems: list[ConfigProblem], config: Mapping[str, Any]) -> None:
    placed: dict[NexRLRole, GroupSpec] = {}
    for g in groups:
        for role in g.roles:
            placed[role] = g
    served_reward = reward_rank_count(config) > 0
    for role in NexRLRole:
        if role not in placed and (role != NexRLRole.REWARD_SERVICE or served_reward):
            problems.append(ConfigProblem(f"placement.roles.{role.value}", "role has no placement"))
    if NexRLRole.REWARD_SERVICE in placed and not served_reward:
        problems.append(
            ConfigProblem(
                "placement.roles.reward_service",
                "placed, but no model reward is served on ranks of its own (reward_model.type, reward_model.placement)",
            )
        )
    for role in SINGLETON_ROLES:
        if role in placed and placed[role].count != 1:
            problems.append(
                ConfigProblem(f"placement.roles.{role.value}", f"must have count 1, got {placed[role].count}")
            )
    worker, service = placed.get(NexRLRole.ROLLOUT_WORKER), placed.get(NexRLRole.INFERENCE_SERVICE)
    if worker and service and worker is not service:
        problems.append(
            ConfigProblem(
                "placement.roles.inference_service",
                "must be in the rollout workers' colocation group (each worker talks to the server on its own rank)",
            )
        )


def trainer_rank_count(config: Mapping[str, Any]) -> int:
    """Ranks of the job's own trainer group (the training service embedded in the job): none when training happens elsewhere."""
    ts = config["service"]["train_service"]
    return ts["world_size"] if ts["backend"] == "local" else 0


def teacher_rank_count(config: Mapping[str, Any]) -> int:
    """Ranks of the job's teacher group (on-policy distillation's teacher embedded in the job)."""
    if config["algorithm"]["teacher_model_path"] is None:
        return 0
    teacher = config["service"]["train_service"]["teacher_service"]
    return teacher["world_size"] if teacher["backend"] == "local" else 0


def critic_rank_count(config: Mapping[str, Any]) -> int:
    """Ranks of the job's critic group (PPO: ``algorithm.adv_estimator=gae``)."""
    critic = config["service"]["train_service"]["critic"]
    if config["algorithm"]["adv_estimator"] != "gae" or critic["head_on_policy"]:
        return 0  # head_on_policy: the value head trains on the actor's ranks
    return int(critic["world_size"])


def service_rank_count(config: Mapping[str, Any]) -> int:
    """Ranks of every trainer group the job runs itself (the policy's, the teacher's, the critic's)."""
    return trainer_rank_count(config) + teacher_rank_count(config) + critic_rank_count(config)


def trainer_group(config: Mapping[str, Any]) -> list[GroupSpec]:
    """The job's own trainer groups: the policy's, then the teacher's (each a torch.distributed group)."""
    groups = []
    for name, count in (
        (TRAINER_GROUP, trainer_rank_count(config)),
        (TEACHER_GROUP, teacher_rank_count(config)),
        (CRITIC_GROUP, critic_rank_count(config)),
    ):
        if count:
            res = config["placement"]["resources"].get(name, {})
            groups.append(
                GroupSpec(name, [], count, res.get("cpus_per_rank", 1), res.get("gpus_per_rank", 0))
            )
    return groups


def _teacher_note(config: Mapping[str, Any]) -> str:
    count, critic = teacher_rank_count(config), critic_rank_count(config)
    note = f" + {count} teacher (service.train_service.teacher_service.world_size)" if count else ""
    return note + (f" + {critic} critic (service.train_service.critic.world_size)" if critic else "")


def _reward_note(reward_ranks: int) -> str:
    return f" + {reward_ranks} reward (reward_model.world_size)" if reward_ranks else ""


def auto_groups(config: Mapping[str, Any], world_size: int) -> list[GroupSpec]:
    resources = config["placement"]["resources"]
    trainer_ranks = service_rank_count(config)
    reward_ranks = reward_rank_count(config)
    rollout_ranks = world_size - 1 - trainer_ranks - reward_ranks
    if rollout_ranks < 1:
        raise PlacementError(
            [
                ConfigProblem(
                    "placement.mode",
                    f"world size {world_size} does not fit placement=auto: it needs at least "
                    f"{2 + trainer_ranks + reward_ranks} ranks "
                    f"(1 driver + {trainer_ranks} trainer (service.train_service.world_size"
                    f"{_teacher_note(config)}){_reward_note(reward_ranks)} + >= 1 rollout); "
                    f"start {2 + trainer_ranks + reward_ranks} or more ranks, or lower service.train_service.world_size",
                )
            ]
        )

    def res(name: str) -> tuple[int, int]:
        r = resources.get(name, {})
        return r.get("cpus_per_rank", 1), r.get("gpus_per_rank", 0)

    return [
        # the train worker drives the trainer group from the driver rank (the training service's client)
        GroupSpec(DRIVER_GROUP, list(SINGLETON_ROLES), 1, *res(DRIVER_GROUP)),
        *trainer_group(config),
        *(
            [GroupSpec(REWARD_GROUP, [NexRLRole.REWARD_SERVICE], reward_ranks, *res(REWARD_GROUP))]
            if reward_ranks
            else []
        ),
        GroupSpec(
            ROLLOUT_GROUP,
            [NexRLRole.ROLLOUT_WORKER, NexRLRole.INFERENCE_SERVICE],
            rollout_ranks,
            *res(ROLLOUT_GROUP),
        ),
    ]


def plan_placement(config: Mapping[str, Any], world_size: int) -> Placement:
    """Ranks for every role; raises ``PlacementError`` saying what fits when it cannot."""
    problems: list[ConfigProblem] = []
    if config["placement"]["mode"] == "auto":
        groups = auto_groups(config, world_size)
    else:
        groups = manual_groups(config["placement"], problems)
        for own in trainer_group(config):
            if any(g.name == own.name for g in groups):
                problems.append(
                    ConfigProblem(
                        "placement.roles",
                        f"colocation group {own.name!r} is the {own.name} ranks' (service.train_service); "
                        "name yours differently",
                    )
                )
        groups += trainer_group(config)
    check_groups(groups, problems, config)
    if problems:
        raise PlacementError(problems)
    # the group holding the data loader goes first: its instance 0 is rank 0 (the controller's)
    groups.sort(key=lambda g: NexRLRole.DATA_LOADER not in g.roles)
    needed = sum(g.count for g in groups)
    if needed != world_size:
        sizes = ", ".join(f"{g.name}={g.count}" for g in groups)
        raise PlacementError(
            [
                ConfigProblem(
                    "placement.roles",
                    f"the placement needs {needed} ranks ({sizes}) but the world size is {world_size}; start {needed} ranks",
                )
            ]
        )
    ranks: list[RankSpec] = []
    for g in groups:
        for instance in range(g.count):
            ranks.append(RankSpec(len(ranks), g.name, instance, list(g.roles)))
    # module names: role_i numbers the instances of a role across ranks
    counts = {role: g.count for g in groups for role in g.roles}
    for spec in ranks:
        spec.module_names = [module_name(role, spec.instance, counts[role]) for role in spec.roles]
    return Placement(groups, ranks)


def placement_problems(config: Mapping[str, Any]) -> list[ConfigProblem]:
    """What can be checked before the world size is known (preflight)."""
    if config.get("launch_mode") != "mpi" or config["placement"]["mode"] != "manual":
        return []
    problems: list[ConfigProblem] = []
    check_groups(manual_groups(config["placement"], problems), problems, config)
    return problems
