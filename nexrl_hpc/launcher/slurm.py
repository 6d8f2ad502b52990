"""launcher=slurm: submit the run's mpi mode as one Slurm job through submitit, from a login node.

The placement decides the ranks; its colocation groups become Slurm components. Adjacent groups
with the same per-rank resources share a component; one component is a plain job, several are a
heterogeneous job (``#SBATCH hetjob``) whose tasks form one MPI_COMM_WORLD through
``srun --mpi=pmi2 --het-group=0-N`` (ranks in component order: rank 0 is the driver). submitit
has no hetjob support; ``launcher.hetjob.HetSlurmExecutor`` adds it. Every rank runs ``SlurmRun``,
which runs the mpi mode and, on preemption, leaves the requeue to rank 0 (see ``runtime.preemption``).

Hydra's own submitit launcher (``-m hydra/launcher=submitit_slurm``) submits one plain job per sweep
point instead; its tasks call ``launch.train``'s task function, which runs them as ``SlurmRun``
does (``run_job_task``). ``check_hydra_submitit_job`` checks those jobs on the login node first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

from nexrl_hpc.config.schema import RLTrainConfig
from nexrl_hpc.config.validate import ConfigError, ConfigProblem
from nexrl_hpc.launcher.cluster import Demand, check_job_in_partition
from nexrl_hpc.launcher.elastic_jobs import submit_join_jobs
from nexrl_hpc.launcher.hetjob import Component, HetSlurmExecutor, job_sizing
from nexrl_hpc.runtime.network import is_loopback_spec
from nexrl_hpc.runtime.placement import PlacementError, plan_placement, reward_rank_count, service_rank_count
from nexrl_hpc.runtime.preemption import PREEMPTED_EXIT

FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
}


def plan_components(config: RLTrainConfig) -> tuple[int, list[Component]]:
    """(world size, components in rank order); raises ConfigError when the placement cannot fit."""
    world = 1 + service_rank_count(config) + reward_rank_count(config) + config["launcher"]["rollout_ranks"]
    if config["placement"]["mode"] == "manual":
        world = 0  # the groups decide
    try:
        placement = plan_placement(config, world) if world else _manual_placement(config)
    except PlacementError as err:
        raise ConfigError(err.problems) from err
    components: list[Component] = []
    for group in _groups_in_rank_order(placement):
        spec = placement.groups[[g.name for g in placement.groups].index(group)]
        last = components[-1] if components else None
        if last and (last.cpus_per_task, last.gpus_per_task) == (spec.cpus_per_rank, spec.gpus_per_rank):
            last.groups.append(group)
            last.ntasks += spec.count
        else:
            components.append(Component([group], spec.count, spec.cpus_per_rank, spec.gpus_per_rank))
    return placement.world_size, components


def _manual_placement(config: RLTrainConfig) -> Any:
    from nexrl_hpc.runtime.placement import manual_groups, trainer_group

    problems: list[ConfigProblem] = []
    groups = manual_groups(config["placement"], problems) + trainer_group(config)
    if problems:
        raise PlacementError(problems)
    return plan_placement(config, sum(g.count for g in groups))


def _groups_in_rank_order(placement: Any) -> list[str]:
    seen: list[str] = []
    for spec in placement.ranks:
        if spec.group not in seen:
            seen.append(spec.group)
    return seen


class SlurmRun:
    """What every task of the job runs (pickled by submitit; re-run after each requeue)."""

    def __init__(self, config: RLTrainConfig):
        self.config = config

    def __call__(self) -> dict[str, Any]:
        return run_job_task(self.config)

    def checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """Not used: rank 0 saves and requeues itself (submitit's handler is replaced)."""
        return None


def job_config(config: RLTrainConfig) -> RLTrainConfig:
    """The config a Slurm job runs: a requeued job must resume its run (``resume.mode=auto``)."""
    mode = config["resume"]["mode"]
    return cast(
        RLTrainConfig, dict(config, resume=dict(config["resume"], mode="auto" if mode == "disable" else mode))
    )


def run_job_task(config: RLTrainConfig, launcher_dir: str | None = None) -> dict[str, Any]:
    """One task of a job submitit started (``SlurmRun``, or a task of Hydra's submitit launcher):
    run this rank, then end as the job needs. Preempted: leave at once (rank 0 saved and requeued
    the job; there is no result). Failed: raise on rank 0 (submitit's result carries the error).
    Finished: return the result, for submitit to store."""
    from nexrl_hpc.runtime.gc_tuning import freeze_imports, hold_collections
    from nexrl_hpc.runtime.preemption import catch_signal_early

    catch_signal_early(config["preemption"])  # a signal during start-up is remembered, not fatal
    hold_collections(config["runtime"])  # as launch.train: before the heavy imports
    from nexrl_hpc.assembly.roles import ROLES
    from nexrl_hpc.controller import run_controller
    from nexrl_hpc.runtime.mpi import run_mpi

    freeze_imports(config["runtime"])

    rank = int(os.environ.get("SLURM_PROCID", "0"))
    os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("SLURM_CPUS_PER_TASK", "1"))
    if config["launch_mode"] == "mpi":
        code = run_mpi(config, run_controller, ROLES, launcher_dir)
    else:
        code = run_controller(config)
    sys.stdout.flush()
    sys.stderr.flush()
    # whatever threads of dead peers linger, this process ends (after submitit writes the result)
    watchdog = threading.Timer(60.0, os._exit, (code,))
    watchdog.daemon = True  # never what keeps the process alive (a requeue waits for every process)
    watchdog.start()
    if code == PREEMPTED_EXIT:  # rank 0 saved and requeued the job: no result, leave at once
        os._exit(code)
    if code != 0 and rank == 0:
        raise RuntimeError(f"the run failed (exit code {code}); see {config['run_dir']}/train.log")
    return {"exit_code": code, "rank": rank, "run_dir": config["run_dir"]}


def check_slurm_job(config: RLTrainConfig) -> list[ConfigProblem]:
    """``launcher=slurm``: the placement's components fit the partition, and a job on several nodes
    does not bind loopback (login node, before sbatch)."""
    try:
        _, components = plan_components(config)
    except ConfigError as err:
        return err.problems
    lc = config["launcher"]
    het = len(components) > 1
    spread: list[ConfigProblem] = []  # a job on several nodes: no loopback address will do
    if het:
        spread = loopback_across_hosts(config, "a heterogeneous job gives each component nodes of its own")
    elif (lc["nodes"] or 0) > 1:
        spread = loopback_across_hosts(config, f"launcher.nodes={lc['nodes']}")
    if het:
        job_level = [k for k in ("nodes", "gres", "gpus_per_node", "cpus_per_gpu") if lc.get(k)]
        if job_level:
            groups = "; ".join(f"component {k}: {', '.join(c.groups)}" for k, c in enumerate(components))
            return spread + [
                ConfigProblem(
                    f"launcher.{key}",
                    f"applies to a job of one component, but the placement "
                    f"makes a heterogeneous job ({groups}): size it per group with "
                    "placement.resources.<group>.{cpus_per_rank,gpus_per_rank}, or give every "
                    "group the same resources",
                )
                for key in job_level
            ]
    demands = [
        Demand(
            label=f"component {k} ({', '.join(c.groups)})" if het else f"the job ({', '.join(c.groups)})",
            tasks=c.ntasks,
            cpus_per_task=c.cpus_per_task,
            gpus_per_task=c.gpus_per_task,
            # launcher.nodes: Slurm spreads the tasks evenly (block distribution)
            tasks_per_node=-(-c.ntasks // lc["nodes"]) if lc["nodes"] and not het else None,
            gpus_per_node=(lc["gpus_per_node"] or 0) if not het else 0,
            cpus_key=", ".join(f"placement.resources.{g}.cpus_per_rank" for g in c.groups),
            gpus_key=", ".join(f"placement.resources.{g}.gpus_per_rank" for g in c.groups),
        )
        for k, c in enumerate(components)
    ]
    ranks = (
        "launcher.rollout_ranks, service.train_service.world_size"
        if config["placement"]["mode"] == "auto"
        else "placement.roles.<role>.count, service.train_service.world_size"
    )
    hint = f"use fewer ranks ({ranks}) or fewer CPUs/GPUs per rank (placement.resources.<group>)"
    return spread + check_job_in_partition(
        lc["partition"],
        "launcher.partition",
        demands,
        separate_nodes=het,
        time_min=lc["time_min"],
        time_key="launcher.time_min",
        shrink_hint=hint,
    )


def loopback_across_hosts(config: RLTrainConfig, why: str) -> list[ConfigProblem]:
    """A job whose ranks will be on several nodes (``why``) cannot exchange loopback addresses:
    refused on the login node, before the job waits in the queue (the ranks check again what their
    setting resolved to, for jobs that Slurm spreads over nodes by itself)."""
    spec = config["runtime"]["rpc"]["interface"]
    if not is_loopback_spec(spec):
        return []
    return [
        ConfigProblem(
            "runtime.rpc.interface",
            f"{spec!r} is loopback, but the job's ranks will be on more "
            f"than one node ({why}) and no other node can reach a loopback address: set it to "
            "the cluster network, an interface (eth0, ib0) or a CIDR network (10.0.0.0/8)",
        )
    ]


def check_hydra_submitit_job(config: RLTrainConfig, launcher: dict[str, Any]) -> list[ConfigProblem]:
    """``hydra/launcher=submitit_slurm``: every task of a point's job gets the same resources
    (``launcher`` is ``hydra.launcher``). Checked on the login node before Hydra submits: the
    partition exists and can hold ``nodes`` x ``tasks_per_node`` tasks within its time limit;
    launch_mode=local is one task; launch_mode=mpi has as many tasks as fit the placement, no
    group asking for other resources than the rest (that is a heterogeneous job: launcher=slurm),
    and srun starting them with pmi2."""
    problems = _check_hydra_submitit_partition(launcher)
    if config["launcher"]["name"] != "local":
        problems.append(
            ConfigProblem(
                "launcher",
                "launcher=slurm submits a job of its own; with "
                "hydra/launcher=submitit_slurm each point is a job already: leave launcher=local",
            )
        )
    tasks = int(launcher["nodes"]) * int(launcher["tasks_per_node"])
    where = f"hydra.launcher.nodes x tasks_per_node = {tasks} tasks"
    if int(launcher["nodes"]) > 1 and config["launch_mode"] == "mpi":
        problems += loopback_across_hosts(config, f"hydra.launcher.nodes={launcher['nodes']}")
    if config["launch_mode"] == "local":
        if tasks != 1:
            problems.append(
                ConfigProblem(
                    "hydra.launcher.tasks_per_node",
                    f"{where}, but launch_mode=local "
                    "is one process: set launch_mode=mpi to make them ranks, or 1 task",
                )
            )
        return problems
    try:
        placement = plan_placement(config, tasks)
    except PlacementError as err:
        return problems + [ConfigProblem(p.path, f"{where}: {p.message}") for p in err.problems]
    resources = {g.name: (g.cpus_per_rank, g.gpus_per_rank) for g in placement.groups}
    if len(set(resources.values())) > 1:
        asked = ", ".join(f"{name} {c} CPU/{g} GPU" for name, (c, g) in resources.items())
        problems.append(
            ConfigProblem(
                "placement.resources",
                f"groups ask for different resources per rank "
                f"({asked}); a Hydra submitit job gives every task the same: use "
                "launcher=slurm (a heterogeneous job)",
            )
        )
    mpi_type, source = srun_mpi_type(list(launcher.get("setup") or []))
    if mpi_type != "pmi2":
        problems.append(
            ConfigProblem(
                "hydra.launcher.setup",
                f"srun would start the ranks with MPI type "
                f"{mpi_type!r} ({source}); launch_mode=mpi needs pmi2: "
                'add "export SLURM_MPI_TYPE=pmi2" to hydra.launcher.setup',
            )
        )
    return problems


def _check_hydra_submitit_partition(launcher: dict[str, Any]) -> list[ConfigProblem]:
    """The point's job (``nodes`` x ``tasks_per_node`` tasks) fits its partition."""
    per_node = int(launcher["tasks_per_node"])
    demand = Demand(
        label=f"each of the {launcher['nodes']} node(s) of the job",
        tasks=int(launcher["nodes"]) * per_node,
        cpus_per_task=int(launcher.get("cpus_per_task") or 1),
        gpus_per_task=int(launcher.get("gpus_per_task") or 0),
        tasks_per_node=per_node,
        gpus_per_node=int(launcher.get("gpus_per_node") or 0),
        cpus_key="hydra.launcher.cpus_per_task, hydra.launcher.tasks_per_node",
        gpus_key="hydra.launcher.gpus_per_node, hydra.launcher.gpus_per_task",
    )
    hint = "use fewer nodes or tasks (hydra.launcher.nodes, hydra.launcher.tasks_per_node)"
    return check_job_in_partition(
        launcher.get("partition"),
        "hydra.launcher.partition",
        [demand],
        separate_nodes=False,
        time_min=launcher.get("timeout_min"),
        time_key="hydra.launcher.timeout_min",
        shrink_hint=hint,
    )


def srun_mpi_type(setup: list[str]) -> tuple[str, str]:
    """(the MPI plugin srun uses in a job whose script runs ``setup`` first, where that comes from):
    SLURM_MPI_TYPE if a setup line exports it, else the cluster's MpiDefault."""
    for line in reversed(setup):
        found = re.search(r"\bSLURM_MPI_TYPE=[\"']?([\w-]+)", line)
        if found:
            return found.group(1), "hydra.launcher.setup"
    try:
        out = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=60
        ).stdout
    except OSError:  # no Slurm client here
        out = ""
    found = re.search(r"^MpiDefault\s*=\s*(\S+)", out, re.MULTILINE)
    return (found.group(1) if found else "unknown"), "the cluster's MpiDefault"


def submit(config: RLTrainConfig) -> tuple[Any, dict[str, Any]]:
    """Check what only the cluster can tell, submit, write ``<run_dir>/launcher.json``."""
    lc = config["launcher"]
    problems = check_slurm_job(config)
    if problems:
        raise ConfigError(problems)
    world, components = plan_components(config)
    run_dir = os.path.abspath(config["run_dir"])
    run_config = cast(RLTrainConfig, dict(job_config(config), launch_mode="mpi", run_dir=run_dir))
    folder = os.path.join(run_dir, "slurm")
    os.makedirs(folder, exist_ok=True)
    parameters = {
        "job_name": lc["job_name"],
        "partition": lc["partition"],
        "account": lc["account"],
        "qos": lc["qos"],
        "time": lc["time_min"],
        "signal_delay_s": lc["signal_grace_s"],
        "setup": list(lc["setup"]),
        "gres": lc["gres"],
        "srun_args": ["--mpi=pmi2", "--kill-on-bad-exit=0"],
        "additional_parameters": {**lc["sbatch"], "requeue": True},
    }
    executor = HetSlurmExecutor(
        folder, components, job_sizing(dict(lc)), **{k: v for k, v in parameters.items() if v is not None}
    )
    job = executor.submit(SlurmRun(run_config))
    elastic_jobs = submit_join_jobs(config, run_dir, folder)  # launcher.elastic: they wait for its door
    info = {
        "job_id": str(job.job_id),
        "run_dir": run_dir,
        "world_size": world,
        "components": [asdict(c) for c in components],
        "heterogeneous": len(components) > 1,
        "submitit_folder": folder,
        "stdout": [str(Path(folder) / f"{job.job_id}_{t}_log.out") for t in range(world)],
        "stderr": [str(Path(folder) / f"{job.job_id}_{t}_log.err") for t in range(world)],
        "train_log": os.path.join(run_dir, "train.log"),
        "submitted_at": time.time(),
        "elastic_jobs": elastic_jobs,
    }
    path = os.path.join(run_dir, "launcher.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump(info, f, indent=1)
    os.replace(f"{path}.tmp", path)
    return job, info


def job_state(job_id: str) -> str:
    """The job's state from sacct (component 0 of a heterogeneous job); UNKNOWN if not listed yet."""
    proc = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", job_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sacct -j {job_id}: {proc.stderr.strip() or proc.returncode}")
    for line in proc.stdout.splitlines():
        jid, _, state = line.partition("|")
        if jid in (job_id, f"{job_id}+0"):
            return state.split()[0] if state else "UNKNOWN"
    return "UNKNOWN"


def follow(job: Any, info: dict[str, Any], poll_s: float) -> int:
    """Print state changes until the job ends; the run's exit status (0: finished)."""
    last = ""
    while True:
        state = job_state(info["job_id"])
        if state != last:
            print(f"job {info['job_id']}: {state}", flush=True)
            last = state
        if state in FINAL_STATES:
            break
        time.sleep(poll_s)
    if state != "COMPLETED":
        print(
            f"error: job {info['job_id']} ended {state}; logs: {info['stderr'][0]}, {info['train_log']}",
            file=sys.stderr,
        )
        return 1
    try:
        results = job.results()
    except Exception as exc:
        print(f"error: job {info['job_id']}: {exc}", file=sys.stderr)
        return 1
    return int(max(r["exit_code"] for r in results))
