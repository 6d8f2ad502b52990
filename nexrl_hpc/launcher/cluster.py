"""What the cluster tells a login node before anything is submitted: its partitions, their nodes
(CPUs, GPUs) and time limits, and whether a job could ever start there.

Slurm accepts many jobs that can never run and leaves them PENDING for good (reasons
``Resources``, ``PartitionConfig``, ``PartitionTimeLimit``): a heterogeneous job whose components
need more nodes than the partition has (each component gets nodes of its own: seen with Slurm
22.05 — three one-task components on two idle nodes never start and block the jobs behind them),
more tasks than the partition's CPUs, a time limit above the partition's. ``check_job`` refuses
those, naming the config key to change. It checks necessary conditions only, on every node of the
partition whatever its state and features, so a job it passes may still wait, but a job it
refuses could never start.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from nexrl_hpc.config.validate import ConfigProblem


class ClusterQueryError(RuntimeError):
    """Slurm could not be asked (no client here, controller down)."""


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    gpus: int


@dataclass
class Partition:
    name: str
    default: bool
    nodes: list[Node]
    max_time_min: float | None  # None: no limit


@dataclass
class Demand:
    """One job (or heterogeneous component) as Slurm is asked for it."""

    label: str  # how messages name it, e.g. "component 1 (rollout)"
    tasks: int
    cpus_per_task: int
    gpus_per_task: int = 0
    tasks_per_node: int | None = None  # --nodes + --ntasks-per-node: a fixed spread
    gpus_per_node: int = 0
    cpus_key: str = ""  # the config keys that set the CPUs (GPUs) on a node, for messages
    gpus_key: str = ""


def read_partitions() -> dict[str, Partition]:
    """Every partition with its nodes, from one ``sinfo`` call (``--all``: hidden partitions too,
    which a user who knows their name may submit to)."""
    try:
        proc = subprocess.run(
            ["sinfo", "--all", "-h", "-N", "-o", "%P|%N|%c|%G|%l"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterQueryError(f"cannot ask Slurm for partitions (sinfo): {exc}") from None
    if proc.returncode != 0:
        raise ClusterQueryError(f"cannot ask Slurm for partitions (sinfo): {proc.stderr.strip()}")
    try:
        return parse_sinfo(proc.stdout)
    except ValueError as exc:
        raise ClusterQueryError(f"cannot read sinfo's answer ({exc}): {proc.stdout[:200]!r}") from None


def parse_sinfo(text: str) -> dict[str, Partition]:
    """``sinfo -h -N -o "%P|%N|%c|%G|%l"`` output (a node once per partition it is in)."""
    partitions: dict[str, Partition] = {}
    seen: set[tuple[str, str]] = set()
    for line in text.splitlines():
        if not line.strip():
            continue
        name, node, cpus, gres, limit = line.strip().split("|")
        default = name.endswith("*")
        name = name.rstrip("*")
        part = partitions.setdefault(name, Partition(name, default, [], parse_time_limit(limit)))
        if (name, node) not in seen:
            seen.add((name, node))
            part.nodes.append(Node(node, int(cpus.rstrip("+")), gpu_count(gres)))
    return partitions


def gpu_count(gres: str) -> int:
    """GPUs in a node's GRES: ``gpu:8``, ``gpu:a100:4(S:0-1),gpu:v100:2``; ``(null)`` is none."""
    return sum(int(n) for n in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


def parse_time_limit(limit: str) -> float | None:
    """Slurm's ``[days-]hours:minutes:seconds``, ``minutes:seconds``, ``minutes`` or ``infinite``."""
    if limit.strip().lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days, _, rest = limit.rpartition("-")
    parts = [float(p) for p in rest.split(":")]
    if len(parts) == 3:
        minutes = parts[0] * 60 + parts[1] + parts[2] / 60
    elif len(parts) == 2:
        minutes = parts[0] + parts[1] / 60
    else:
        minutes = parts[0]
    return minutes + (float(days) * 1440 if days else 0.0)


def find_partition(
    partitions: dict[str, Partition], name: str | None, key: str
) -> tuple[Partition | None, list[ConfigProblem]]:
    """The partition a job goes to (``None``: the cluster's default)."""
    if name is None:
        default = [p for p in partitions.values() if p.default]
        if default:
            return default[0], []
        return None, [
            ConfigProblem(
                key,
                f"the cluster has no default partition: set one (available: {', '.join(sorted(partitions))})",
            )
        ]
    if name not in partitions:
        return None, [
            ConfigProblem(key, f"unknown partition {name!r} (available: {', '.join(sorted(partitions))})")
        ]
    return partitions[name], []


def check_job_in_partition(
    name: str | None,
    partition_key: str,
    demands: list[Demand],
    *,
    separate_nodes: bool,
    time_min: float | None,
    time_key: str,
    shrink_hint: str,
) -> list[ConfigProblem]:
    """Ask Slurm for partition ``name`` (``None``: the default one), then ``check_job``."""
    try:
        partition, problems = find_partition(read_partitions(), name, partition_key)
    except ClusterQueryError as exc:
        return [ConfigProblem(partition_key, str(exc))]
    if partition is None:
        return problems
    return check_job(
        partition,
        partition_key,
        demands,
        separate_nodes=separate_nodes,
        time_min=time_min,
        time_key=time_key,
        shrink_hint=shrink_hint,
    )


def check_job(
    partition: Partition,
    partition_key: str,
    demands: list[Demand],
    *,
    separate_nodes: bool,
    time_min: float | None,
    time_key: str,
    shrink_hint: str,
) -> list[ConfigProblem]:
    """Problems that keep the job from ever starting in ``partition``. ``separate_nodes``: the
    demands are heterogeneous components (no node shared between them). ``shrink_hint`` says
    which keys make the job smaller."""
    problems: list[ConfigProblem] = []
    where = f"partition {partition.name!r} ({_describe_nodes(partition.nodes)})"
    if time_min is not None and partition.max_time_min is not None and time_min > partition.max_time_min:
        problems.append(
            ConfigProblem(
                time_key,
                f"{time_min:g} min is above the time limit of partition "
                f"{partition.name!r} ({partition.max_time_min:g} min): lower it "
                "(the run saves and requeues itself before the limit)",
            )
        )
    most_cpus = max((n.cpus for n in partition.nodes), default=0)
    most_gpus = max((n.gpus for n in partition.nodes), default=0)
    nodes_needed: list[int] = []
    for d in demands:
        per_node = d.tasks_per_node or 1
        cpus, gpus = per_node * d.cpus_per_task, max(d.gpus_per_node, per_node * d.gpus_per_task)
        if cpus > most_cpus:
            problems.append(
                ConfigProblem(
                    d.cpus_key,
                    f"{d.label} asks for {cpus} CPU(s) on one node; no node of "
                    f"{where} has more than {most_cpus}",
                )
            )
            continue
        if gpus > most_gpus:
            problems.append(
                ConfigProblem(
                    d.gpus_key,
                    f"{d.label} asks for {gpus} GPU(s) on one node; no node of "
                    f"{where} has more than {most_gpus}",
                )
            )
            continue
        needed = _nodes_needed(d, partition.nodes)
        if needed is None:
            problems.append(
                ConfigProblem(
                    partition_key,
                    f"{d.label} needs {_describe_demand(d)}, more than "
                    f"{where} holds: {shrink_hint}, or use a larger partition",
                )
            )
            continue
        nodes_needed.append(needed)
    if separate_nodes and not problems and sum(nodes_needed) > len(partition.nodes):
        asked = "; ".join(
            f"{d.label}: {_describe_demand(d)} -> {k} node(s)" for d, k in zip(demands, nodes_needed)
        )
        problems.append(
            ConfigProblem(
                partition_key,
                f"a heterogeneous job gives each component nodes of its own: "
                f"{asked}; {sum(nodes_needed)} nodes in all, but {where} has "
                f"{len(partition.nodes)}: {shrink_hint}, or use a larger "
                "partition",
            )
        )
    return problems


def _units(node: Node, d: Demand) -> int:
    """How much of the demand one node can hold: tasks (free spread) or 0/1 node (fixed spread)."""
    by_cpu = node.cpus // d.cpus_per_task
    tasks = min(by_cpu, node.gpus // d.gpus_per_task) if d.gpus_per_task else by_cpu
    if d.tasks_per_node is None:
        return tasks
    return int(tasks >= d.tasks_per_node and node.gpus >= d.gpus_per_node)


def _nodes_needed(d: Demand, nodes: list[Node]) -> int | None:
    """The fewest nodes of the partition that can hold the demand; None if all of them cannot."""
    needed = d.tasks if d.tasks_per_node is None else -(-d.tasks // d.tasks_per_node)
    held = 0
    for count, units in enumerate(sorted((_units(n, d) for n in nodes), reverse=True), start=1):
        held += units
        if held >= needed:
            return count
    return None


def _describe_demand(d: Demand) -> str:
    gpus = f" + {d.gpus_per_task} GPU" if d.gpus_per_task else ""
    per_node_gpus = f", {d.gpus_per_node} GPU(s)" if d.gpus_per_node else ""
    spread = f" ({d.tasks_per_node} per node{per_node_gpus})" if d.tasks_per_node else ""
    return f"{d.tasks} task(s) x {d.cpus_per_task} CPU(s){gpus}{spread}"


def _describe_nodes(nodes: list[Node]) -> str:
    if not nodes:
        return "no nodes"
    kinds: dict[tuple[int, int], int] = {}
    for n in nodes:
        kinds[(n.cpus, n.gpus)] = kinds.get((n.cpus, n.gpus), 0) + 1
    return ", ".join(
        f"{count} node(s) of {cpus} CPUs" + (f" + {gpus} GPUs" if gpus else "")
        for (cpus, gpus), count in sorted(kinds.items(), reverse=True)
    )
